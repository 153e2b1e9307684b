"""What every workflow shares: the run wrapper, events, state and the step slots.

A workflow run opens its own :class:`~aimu.aio.scope.RunScope` under the one it runs
in, so an interrupt of a handle around it reaches every agent inside, and the agents'
events bubble out through it. Each step runs in a :class:`_Slot`: a fresh session of
the configured step (``step.start()``), its answer once finished, and the partial
transcript (or nested workflow state) while it is not.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import aclosing
from typing import (
    Any,
    ClassVar,
    Literal,
    Protocol,
    TypeAlias,
    TypeVar,
    cast,
    get_args,
    overload,
)

from aimu.aio.agent import INTERRUPTED, Agent
from aimu.aio.events import Event, RunFinished, RunStarted, RunStatus, StepFinished
from aimu.aio.scope import RunScope, current_scope
from aimu.aio.transcript import Message, Usage, add_usage, copy_messages, zero_usage

__all__ = ["INTERRUPTED", "STATE_VERSION", "Resumable", "SlotStatus", "Step", "Workflow"]

#: The version of the ``state`` format; ``restore()`` refuses any other.
STATE_VERSION = 1

#: How far one step or branch got: never started, started and stopped, or answered.
SlotStatus: TypeAlias = Literal["pending", "in_flight", "finished"]
_SLOT_STATUSES = get_args(SlotStatus)
_RUN_STATUSES = get_args(RunStatus)
_FINISHED: tuple[RunStatus, ...] = ("completed", "max_rounds")
_F = TypeVar("_F", bound=Callable[..., Any])
_BUSY = "a run is already in progress on this workflow; use workflow.start() for another"


class Resumable(Protocol):
    """What a workflow needs of a step; :class:`~aimu.aio.Agent` and workflows have it."""

    @property
    def name(self) -> str: ...

    @property
    def last_status(self) -> RunStatus | None: ...

    def start(self) -> Resumable: ...

    def run(self, task: str) -> Awaitable[str]: ...

    def resume(self) -> Awaitable[str]: ...

    def interrupt(self) -> bool: ...


#: A step of a workflow: an agent, or another workflow (nesting).
Step: TypeAlias = "Agent | Workflow"


def check_step(step: object, where: str) -> Step:
    """``step`` if it can be a workflow step, else a TypeError naming ``where``."""
    if not isinstance(step, Agent | Workflow):
        raise TypeError(
            f"{where} must be an aio.Agent or a workflow (Chain, Router, Parallel, "
            f"EvaluatorOptimizer), got {type(step).__name__}"
        )
    return step


def check_steps(steps: object, owner: str, noun: str, nouns: str) -> tuple[Step, ...]:
    """``steps`` as a tuple if it is a non-empty list of steps; errors name ``owner``."""
    if isinstance(steps, str | bytes) or not isinstance(steps, Sequence):
        raise TypeError(f"{owner} takes a list of {nouns}, got {type(steps).__name__}")
    if not steps:
        raise ValueError(f"{owner} needs at least one {noun}")
    return tuple(check_step(step, f"{owner} {noun} {i + 1}") for i, step in enumerate(steps))


def kind_of(step: Step) -> str:
    return "agent" if isinstance(step, Agent) else step.kind


def load_usage(value: object, where: str) -> Usage:
    if value is None:
        return zero_usage()
    if (
        not isinstance(value, Mapping)
        or not isinstance(value.get("input_tokens"), int)
        or not isinstance(value.get("output_tokens"), int)
    ):
        raise ValueError(f"{where}: 'usage' must be {{'input_tokens': int, 'output_tokens': int}}")
    return {"input_tokens": value["input_tokens"], "output_tokens": value["output_tokens"]}


def mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a dict (as workflow.state gives), got "
                         f"{type(value).__name__}")
    return cast(Mapping[str, Any], value)


def step_or_function(value: Step | _F, what: str, function: str) -> tuple[Step | None, _F | None]:
    """Split a step argument that may also be a plain function; TypeError naming ``what``."""
    if isinstance(value, Agent | Workflow):
        return value, None
    if callable(value):
        return None, value
    raise TypeError(
        f"{what} must be an agent, a workflow or a function {function}, "
        f"got {type(value).__name__}"
    )


def function_record(answer: str | None) -> dict[str, Any]:
    """The state record of a part done by a user function: its answer once it returned."""
    return {
        "kind": "function",
        "status": "pending" if answer is None else "finished",
        "answer": answer,
    }


def load_function_record(record: Mapping[str, Any], where: str, verb: str, role: str) -> str | None:
    """The answer in a :func:`function_record` (None until it returned); ValueError when
    the state had a step in this place."""
    kind = record.get("kind")
    if kind != "function":
        raise ValueError(
            f"{where}: the state {verb} with {kind!r} and this workflow {verb} with a "
            f"function; build it with the same kind of {role}"
        )
    if record.get("status") != "finished":
        return None
    answer = record.get("answer")
    if not isinstance(answer, str):
        raise ValueError(f"{where} {role}: a finished {role} needs its 'answer' as a string")
    return answer


async def call_user_function(function: Callable[..., Any], *args: object) -> Any:
    """Call a user's sync or async function and return what it gives."""
    result = function(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


class _Slot:
    """One step of one run: its own session of the step, and how far it got."""

    __slots__ = ("_usage", "answer", "error", "finished", "label", "session", "step")

    def __init__(self, step: Step, label: str) -> None:
        self.step = step
        self.label = label
        self.session: Step | None = None
        self.finished = False
        self.answer = ""
        self.error: str | None = None
        self._usage = zero_usage()

    @property
    def status(self) -> SlotStatus:
        if self.finished:
            return "finished"
        return "in_flight" if self._started() else "pending"

    def _started(self) -> bool:
        session = self.session
        if session is None:
            return False
        if isinstance(session, Agent):
            return any(m["role"] == "user" for m in session.model_client.messages)
        return session.task is not None

    def usage(self) -> Usage:
        session = self.session
        if isinstance(session, Workflow):
            return session.usage
        return {"input_tokens": self._usage["input_tokens"],
                "output_tokens": self._usage["output_tokens"]}

    def record(self) -> dict[str, Any]:
        """This slot as plain JSON data (nothing shared with the live session)."""
        record: dict[str, Any] = {
            "name": self.step.name,
            "kind": kind_of(self.step),
            "status": self.status,
            "answer": self.answer if self.finished else None,
        }
        if self.error is not None:
            record["error"] = self.error
        session = self.session
        if isinstance(self.step, Agent):
            messages = session.model_client.messages if isinstance(session, Agent) else []
            record["messages"] = copy_messages(messages)
            record["usage"] = dict(self._usage)
        else:
            record["state"] = session.state if isinstance(session, Workflow) else None
        return record

    @classmethod
    def load(cls, step: Step, label: str, record: object, where: str) -> _Slot:
        """A slot holding ``record`` (from :meth:`record`); ValueError naming ``where``."""
        data = mapping(record, where)
        kind, found = kind_of(step), data.get("kind")
        if found != kind:
            raise ValueError(
                f"{where}: the state has {_article(found)} here and this workflow has "
                f"{_article(kind)}; restore a state into a workflow of the same shape"
            )
        status = data.get("status")
        if status not in _SLOT_STATUSES:
            raise ValueError(f"{where}: 'status' must be one of {_SLOT_STATUSES}, got {status!r}")
        slot = cls(step, label)
        try:
            if isinstance(step, Agent):
                messages = data.get("messages") or []
                if messages:
                    session = step.start()
                    session.restore(cast(list[Message], messages))
                    slot.session = session
                slot._usage = load_usage(data.get("usage"), where)
            elif data.get("state") is not None:
                nested = step.start()
                nested.restore(data["state"])
                slot.session = nested
        except (ValueError, TypeError) as error:
            raise ValueError(f"{where}: {error}") from error
        if status == "finished":
            answer = data.get("answer")
            if not isinstance(answer, str):
                raise ValueError(f"{where}: a finished step needs its 'answer' as a string")
            slot.finished, slot.answer = True, answer
        error_text = data.get("error")
        slot.error = error_text if isinstance(error_text, str) else None
        return slot

    async def run(self, task: str) -> str | None:
        """Run, or resume, this step; its answer, or None when an interrupt stopped it.

        A finished step returns its answer without running again.
        """
        if self.finished:
            return self.answer
        session = self.session
        if session is None:
            session = self.session = self.step.start()
        resume = self._started()
        self.error = None
        status: RunStatus | None
        try:
            if isinstance(session, Agent):
                status, reply = await self._run_agent(session, task, resume)
            else:
                reply = await (session.resume() if resume else session.run(task))
                status = session.last_status
        except Exception as error:
            self.error = f"{type(error).__name__}: {error}"
            raise
        if status in _FINISHED:
            self.finished, self.answer = True, reply
            return reply
        return None

    async def _run_agent(self, session: Agent, task: str, resume: bool) -> tuple[RunStatus, str]:
        # Drained here rather than with run(): the final event carries status and usage.
        events = session.resume(stream=True) if resume else session.run(task, stream=True)
        final: RunFinished | None = None
        async with aclosing(events):
            async for event in events:
                if isinstance(event, RunFinished):
                    final = event
                    add_usage(self._usage, event.usage)
        assert final is not None, "an agent run always ends with RunFinished"
        return final.status, final.reply


def numbered_slots(steps: Sequence[Step], label: str) -> list[_Slot]:
    """One fresh slot per step, labelled ``"{label} 1"``, ``"{label} 2"``..."""
    return [_Slot(step, f"{label} {i + 1}") for i, step in enumerate(steps)]


def load_numbered_slots(
    steps: Sequence[Step], state: Mapping[str, Any], key: str, label: str, where: str
) -> list[_Slot]:
    """:func:`numbered_slots` holding the records in ``state[key]``; ValueError naming
    ``where`` when that is not a list of one record per step."""
    records = state.get(key)
    if not isinstance(records, list):
        raise ValueError(f"{where}: the state has no {key!r} list")
    if len(records) != len(steps):
        raise ValueError(
            f"{where} has {len(steps)} {key} and the state has {len(records)}; "
            "restore it into a workflow of the same shape"
        )
    return [
        _Slot.load(step, f"{label} {i + 1}", record, f"{where} {label} {i + 1}")
        for i, (step, record) in enumerate(zip(steps, records, strict=True))
    ]


def _article(kind: object) -> str:
    if not isinstance(kind, str):
        return f"kind {kind!r}"
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"


class _End:
    """Put in a stream's queue when the run's task is done."""


_END = _End()


class Workflow(abc.ABC):
    """Base of Chain, Router, Parallel and EvaluatorOptimizer: run, stop, snapshot, resume.

    One run at a time per workflow object (``start()`` gives another). ``state`` is a
    JSON-serialisable snapshot at any moment; ``restore(state)`` loads one into a
    workflow of the same shape and ``resume()`` finishes it without redoing finished steps.
    """

    #: The ``kind`` written in ``state`` and used as the default name.
    kind: ClassVar[str]

    def __init__(self, name: str | None) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a string or None, got {type(name).__name__}")
        self._name = name or self.kind
        self._scope: RunScope | None = None
        self._task: str | None = None
        self._answer: str | None = None
        #: How the last run of this workflow ended (None before the first).
        self.last_status: RunStatus | None = None

    # -- what each workflow defines ------------------------------------------------------

    @abc.abstractmethod
    def _fresh(self) -> None:
        """Forget the progress of the last run (a new run starts)."""

    @abc.abstractmethod
    async def _execute(self, task: str, scope: RunScope) -> tuple[RunStatus, str]:
        """Run or continue the steps; returns how the run ended and its reply."""

    @abc.abstractmethod
    def _progress(self) -> dict[str, Any]:
        """The workflow-specific part of ``state``."""

    @abc.abstractmethod
    def _load(self, state: Mapping[str, Any]) -> Callable[[], None]:
        """Check ``state`` against this shape; return what installs it (changes nothing)."""

    @abc.abstractmethod
    def _slots(self) -> list[_Slot]:
        """Every slot of the current run (for usage)."""

    @abc.abstractmethod
    def start(self) -> Workflow:
        """A new workflow of the same configuration, with no progress."""

    # -- the public surface --------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def task(self) -> str | None:
        """The task of the current or last run (None before the first run or restore)."""
        return self._task

    @property
    def running(self) -> bool:
        return self._scope is not None

    @property
    def usage(self) -> Usage:
        """Tokens used by every agent of this run so far, resumes included."""
        total = zero_usage()
        for slot in self._slots():
            add_usage(total, slot.usage())
        return total

    def __repr__(self) -> str:
        state = "running" if self.running else (self.last_status or "idle")
        return f"<{type(self).__name__} {self._name!r} {state}>"

    def interrupt(self) -> bool:
        """Stop the run at its next step boundary; False when no run is in progress.

        Every agent inside finishes the step it is in (its model turn and tool round)
        and stops; no further step starts; the run returns ``"Run interrupted."``.
        """
        scope = self._scope
        if scope is None:
            return False
        scope.request_interrupt()
        return True

    @overload
    def run(self, task: str, *, stream: Literal[False] = False) -> Coroutine[Any, Any, str]: ...

    @overload
    def run(self, task: str, *, stream: Literal[True]) -> AsyncGenerator[Event, None]: ...

    def run(
        self, task: str, *, stream: bool = False
    ) -> Coroutine[Any, Any, str] | AsyncGenerator[Event, None]:
        """Run ``task`` through the workflow from the start; return the final answer.

        ``stream=True`` returns the events of every agent inside and the workflow's own
        (``RunStarted``, ``StepFinished``, ``RunFinished`` named after the workflow, last).
        """
        if not isinstance(task, str):
            raise TypeError(f"run() takes the task as a string, got {type(task).__name__}")
        self._check_idle()
        return self._stream(task) if stream else self._run(task)

    @overload
    def resume(self, *, stream: Literal[False] = False) -> Coroutine[Any, Any, str]: ...

    @overload
    def resume(self, *, stream: Literal[True]) -> AsyncGenerator[Event, None]: ...

    def resume(
        self, *, stream: bool = False
    ) -> Coroutine[Any, Any, str] | AsyncGenerator[Event, None]:
        """Continue the last or restored run: finished steps are not run again.

        Steps in flight continue their agents' transcripts (``agent.resume()``); a
        finished run returns its answer at once.
        """
        self._check_idle()
        self._check_resumable()
        return self._stream(None) if stream else self._run(None)

    @property
    def state(self) -> dict[str, Any]:
        """Plain JSON-serialisable progress: the task, and per step its status, answer,
        transcript (or nested state); safe to take at any moment."""
        if self.running:
            status: str = "running"
        else:
            status = self.last_status or "pending"
        return {
            "kind": self.kind,
            "version": STATE_VERSION,
            "name": self._name,
            "task": self._task,
            "status": status,
            "answer": self._answer,
            "usage": self.usage,
            **self._progress(),
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Load ``state`` (from ``workflow.state``, maybe through JSON) into this workflow.

        A state from a workflow of another shape, or a bad transcript in it, raises
        ``ValueError`` naming what differs, and changes nothing.
        """
        where = self._where()
        if self.running:
            raise RuntimeError(
                f"cannot restore() {where} while a run is in progress on it; "
                "wait for the run to end, or restore into workflow.start()"
            )
        data = mapping(state, f"the state given to {where}.restore()")
        if data.get("kind") != self.kind:
            raise ValueError(
                f"the state is of {_article(data.get('kind'))} workflow and {where} is "
                f"{_article(self.kind)}; restore it into a workflow of the same shape"
            )
        if data.get("version") != STATE_VERSION:
            raise ValueError(
                f"{where}: state version {data.get('version')!r} is not supported "
                f"(this aimu reads version {STATE_VERSION})"
            )
        task = data.get("task")
        if task is not None and not isinstance(task, str):
            raise ValueError(f"{where}: 'task' must be a string or None")
        answer = data.get("answer")
        status = data.get("status")
        commit = self._load(data)
        commit()
        self._task = task
        self._answer = answer if isinstance(answer, str) else None
        self.last_status = cast(RunStatus, status) if status in _RUN_STATUSES else None

    # -- running ---------------------------------------------------------------------------

    def _where(self) -> str:
        return f"{self.kind} {self._name!r}"

    def _check_idle(self) -> None:
        if self._scope is not None:
            raise RuntimeError(f"{self._where()}: {_BUSY}")

    def _check_resumable(self) -> None:
        if self._task is None:
            raise ValueError(
                f"nothing to resume: {self._where()} has no run yet; "
                "use run(task), or restore(state) first"
            )

    def _begin(self, task: str | None) -> RunScope:
        """Claim this workflow for one run and open the run's scope."""
        self._check_idle()
        if task is None:
            self._check_resumable()
        else:
            self._task = task
            self._answer = None
            self._fresh()
        scope = self._scope = RunScope(self._name, parent=current_scope.get())
        return scope

    def _end(self, scope: RunScope, status: RunStatus, reply: str, error: str | None) -> None:
        """Release the workflow and emit its one terminal event (once per run)."""
        if self._scope is not scope:
            return
        self._scope = None
        self.last_status = status
        if status in _FINISHED:
            self._answer = reply
        scope.emit(RunFinished(self._name, status, reply, self.usage, error))

    async def _step(self, slot: _Slot, task: str, scope: RunScope) -> bool:
        """Run ``slot`` on ``task`` at a step boundary unless it has finished already;
        False when an interrupt stops the run here (before the step, or within it)."""
        if slot.finished:
            return True
        if scope.interrupt_requested or await slot.run(task) is None:
            return False
        self._step_finished(scope)
        return True

    def _step_finished(self, scope: RunScope) -> None:
        done = sum(slot.finished for slot in self._slots())
        scope.emit(StepFinished(self._name, done))

    async def _run(self, task: str | None) -> str:
        scope = self._begin(task)
        scope.emit(RunStarted(self._name, task))
        return await self._body(scope)

    async def _body(self, scope: RunScope) -> str:
        assert self._task is not None
        token = current_scope.set(scope)
        status: RunStatus = "failed"
        reply = ""
        error: str | None = None
        try:
            status, reply = await self._execute(self._task, scope)
            return reply
        except BaseException as exc:
            status = "failed" if isinstance(exc, Exception) else "cancelled"
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            # Closed from another context (a task destroyed unfinished): nothing to reset.
            with contextlib.suppress(ValueError):
                current_scope.reset(token)
            self._end(scope, status, reply, error)

    async def _stream(self, task: str | None) -> AsyncGenerator[Event, None]:
        # The run goes on in a task of its own and its events arrive through a queue, so
        # no yield of this generator ever sits inside a TaskGroup or a timeout.
        scope = self._begin(task)
        queue: asyncio.Queue[Event | _End] = asyncio.Queue()
        remove = scope.add_listener(queue.put_nowait)
        scope.emit(RunStarted(self._name, task))
        driver = asyncio.get_running_loop().create_task(self._body(scope), name=self._name)
        driver.add_done_callback(lambda _: queue.put_nowait(_END))
        # The run belongs to the task reading it: a consumer that ends (say, cancelled in
        # its own loop body, leaving this stream unclosed) must not leave it running.
        consumer = asyncio.current_task()

        def consumer_done(_: object) -> None:
            driver.cancel()

        if consumer is not None:
            consumer.add_done_callback(consumer_done)
        failure: BaseException | None = None
        try:
            while not isinstance(event := await queue.get(), _End):
                yield event
        except GeneratorExit:
            # The consumer stopped iterating: stop the run; nothing more may be yielded.
            await self._stop_driver(driver, scope)
            raise
        except BaseException as exc:  # our consumer was cancelled: cancel the run, then say so
            failure = exc
            await self._stop_driver(driver, scope)
        finally:
            remove()
            if consumer is not None:
                consumer.remove_done_callback(consumer_done)
        if failure is None:
            failure = _outcome(driver)
        rest = [e for e in _drain_queue(queue) if not isinstance(e, _End)]
        if failure is None:
            for event in rest:
                yield event
            return
        # Deliver what is left (the terminal event last), then the exception.
        try:
            for event in rest:
                yield event
        except GeneratorExit:
            raise failure from None
        raise failure

    async def _stop_driver(self, driver: asyncio.Task[str], scope: RunScope) -> None:
        """Cancel the run's task and wait until it has ended, however often we are cancelled.

        As a TaskGroup does: the stream never ends while its run still works on the
        transcripts; a further cancel of ours is raised once the run has stopped.
        """
        driver.cancel()
        again: asyncio.CancelledError | None = None
        while not driver.done():
            try:
                await asyncio.wait((driver,))
            except asyncio.CancelledError as exc:
                again = exc
        _outcome(driver)  # retrieved: never "Task exception was never retrieved"
        # A task cancelled before its first step never ran _body's finally.
        self._end(scope, "cancelled", "", "CancelledError: the stream was stopped")
        if again is not None:
            raise again


def _outcome(task: asyncio.Task[str]) -> BaseException | None:
    if task.cancelled():
        return asyncio.CancelledError()
    return task.exception()


def _drain_queue(queue: asyncio.Queue[Event | _End]) -> list[Event | _End]:
    items: list[Event | _End] = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def interrupted(scope: RunScope) -> tuple[RunStatus, str]:
    """How a run stopped by an interrupt at a step boundary ends; the scope records it."""
    scope.note_interrupted()
    return "interrupted", INTERRUPTED
