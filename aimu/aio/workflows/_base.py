"""What every workflow shares: the run wrapper, events, state and the step slots.

A workflow is a :class:`~aimu.aio.runnable.Runnable`: its run opens its own
:class:`~aimu.aio.scope.RunScope` under the one it runs in, so an interrupt of a
handle around it reaches every agent inside, and the agents' events bubble out
through it. Each step runs in a :class:`_Slot`: a fresh session of the configured
step (``step.start()``), its answer once finished, and the step's snapshot (an agent's
transcript, a nested workflow's state) while it is not. A slot knows a step only
through the Runnable surface: ``finish``, ``snapshot``, ``session_from``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import inspect
import json
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar, Literal, TypeAlias, TypeVar, cast, get_args

from aimu.aio._stops import past_deadline
from aimu.aio._tasks import wait_through_cancels
from aimu.aio.approvals import PendingApproval
from aimu.aio.ends import (
    ANSWERED,
    INTERRUPTED,
    STOPPED,
    error_text,
    run_finished,
    stopped_status,
)
from aimu.aio.events import Event, RunFinished, RunResult, RunStarted, RunStatus, StepFinished
from aimu.aio.limits import SharedBudget
from aimu.aio.runnable import NO_OPTIONS, RunClock, Runnable, RunOptions
from aimu.aio.scope import RunScope, current_scope
from aimu.aio.status import NAMED_HALTS
from aimu.aio.transcript import Message, Usage, add_usage, check_text, zero_usage

__all__ = ["INTERRUPTED", "STATE_VERSION", "Resumable", "SlotStatus", "Step", "Workflow"]

#: The version of the ``state`` format; ``restore()`` refuses any other.
STATE_VERSION = 1

#: How far one step or branch got: never started, started and stopped, or answered.
SlotStatus: TypeAlias = Literal["pending", "in_flight", "finished"]
_SLOT_STATUSES = get_args(SlotStatus)
_RUN_STATUSES = get_args(RunStatus)
_F = TypeVar("_F", bound=Callable[..., Any])

#: A step of a workflow: an agent, or another workflow (nesting).
Step: TypeAlias = Runnable[object]
#: The former name of what a workflow needs of a step: the Runnable surface.
Resumable: TypeAlias = Runnable[object]


def check_step(step: object, where: str) -> Step:
    """``step`` if it can be a workflow step, else a TypeError naming ``where``."""
    if not isinstance(step, Runnable):
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


def _check_encodable(state: Mapping[str, Any], where: str) -> None:
    """ValueError naming ``where`` if a string anywhere in ``state`` (the task, an
    answer, a message) holds a lone surrogate: the rule of ``agent.restore()``."""
    try:
        text = json.dumps(state, ensure_ascii=False)
    except (TypeError, ValueError):
        return  # not JSON data: the checks of each part name what is wrong
    check_text(text, f"{where} (as JSON)")


def expect_dict(value: object, where: str) -> Mapping[str, Any]:
    """``value`` if it is a dict (a record of a state); ValueError naming ``where``."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a dict (as workflow.state gives), got "
                         f"{type(value).__name__}")
    return cast(Mapping[str, Any], value)


def step_or_function(value: Step | _F, what: str, function: str) -> tuple[Step | None, _F | None]:
    """Split a step argument that may also be a plain function; TypeError naming ``what``."""
    if isinstance(value, Runnable):
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


async def call_for_text(function: Callable[..., Any], *args: object, must: str) -> str:
    """Call a user's function that must return a string; ``must`` says so in the error
    (``"<workflow>: the classifier must return a route name (a string)"``)."""
    result = await call_user_function(function, *args)
    if not isinstance(result, str):
        raise TypeError(f"{must}, got {type(result).__name__}")
    return result


class _Slot:
    """One step of one run: its own session of the step, and how far it got."""

    __slots__ = ("answer", "cut_off", "error", "finished", "label", "session", "step",
                 "stop_reason")

    def __init__(self, step: Step, label: str) -> None:
        self.step = step
        self.label = label
        self.session: Step | None = None
        self.finished = False
        self.answer = ""
        #: Why the finished step's model stopped, and whether its answer was cut off.
        self.stop_reason: str | None = None
        self.cut_off = False
        self.error: str | None = None

    @property
    def status(self) -> SlotStatus:
        if self.finished:
            return "finished"
        return "in_flight" if self._started() else "pending"

    def _started(self) -> bool:
        return self.session is not None and self.session.resumable

    def usage(self) -> Usage:
        return zero_usage() if self.session is None else self.session.local_usage

    def record(self) -> dict[str, Any]:
        """This slot as plain JSON data (nothing shared with the live session)."""
        record: dict[str, Any] = {
            "name": self.step.name,
            "kind": self.step.kind,
            "status": self.status,
            "answer": self.answer if self.finished else None,
        }
        if self.error is not None:
            record["error"] = self.error
        if self.stop_reason is not None:
            record["stop_reason"] = self.stop_reason
        if self.cut_off:
            record["incomplete"] = True
        session = self.session
        record.update(self.step.blank_snapshot() if session is None else session.snapshot())
        return record

    @classmethod
    def load(cls, step: Step, label: str, record: object, where: str) -> _Slot:
        """A slot holding ``record`` (from :meth:`record`); ValueError naming ``where``."""
        data = expect_dict(record, where)
        kind, found = step.kind, data.get("kind")
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
            slot.session = step.session_from(data)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{where}: {error}") from error
        if status == "finished":
            answer = data.get("answer")
            if not isinstance(answer, str):
                raise ValueError(f"{where}: a finished step needs its 'answer' as a string")
            slot.finished, slot.answer = True, answer
            reason = data.get("stop_reason")
            slot.stop_reason = reason if isinstance(reason, str) else None
            slot.cut_off = data.get("incomplete") is True
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
        try:
            final = await session.finish(None if resume else task)
        except Exception as error:
            self.error = error_text(error)
            raise
        if final.status in ANSWERED:
            self.finished, self.answer = True, final.reply
            self.stop_reason, self.cut_off = final.stop_reason, final.status == "incomplete"
            return final.reply
        return None


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


class _StepResults(RunScope):
    """A workflow run's scope: it keeps the result of every step run that ended in it."""

    __slots__ = ("ended",)

    def __init__(self, name: str, parent: RunScope | None = None) -> None:
        super().__init__(name, parent)
        self.ended: list[RunResult[Any]] = []

    def note_ended(self, result: RunResult[Any]) -> None:
        super().note_ended(result)
        self.ended.append(result)


class Workflow(Runnable):
    """Base of Chain, Router, Parallel and EvaluatorOptimizer: run, stop, snapshot, resume.

    One run at a time per workflow object (``start()`` gives another). ``state`` is a
    JSON-serialisable snapshot at any moment; ``restore(state)`` loads one into a
    workflow of the same shape and ``resume()`` finishes it without redoing finished steps.
    """

    #: The ``kind`` written in ``state`` and used as the default name.
    kind: ClassVar[str]
    _scope_type = _StepResults

    def __init__(self, name: str | None) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a string or None, got {type(name).__name__}")
        self._name = name or self.kind
        self._take_seat(self._name)
        self._task: str | None = None
        self._answer: str | None = None
        self._clock = RunClock()
        #: The steps whose answers make the reply of the run in progress (see _answered).
        self._reply_slots: tuple[_Slot, ...] = ()

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

    # -- progress, as a step of another workflow -------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        return {"state": self.state}

    def blank_snapshot(self) -> dict[str, Any]:
        return {"state": None}

    def session_from(self, snapshot: Mapping[str, Any]) -> Workflow | None:
        state = snapshot.get("state")
        if state is None:
            return None
        nested = self.start()
        nested.restore(state)
        return nested

    # -- the public surface --------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def task(self) -> str | None:
        """The task of the current or last run (None before the first run or restore)."""
        return self._task

    @property
    def resumable(self) -> bool:
        return self._task is not None

    # -- approvals: those of the agents inside ----------------------------------------------

    @property
    def pending_approvals(self) -> list[PendingApproval]:
        """The calls the agents inside wait on; the workflow is paused while any wait."""
        return [
            pending
            for slot in self._slots()
            if slot.session is not None
            for pending in slot.session.pending_approvals
        ]

    def approve(self, call: str | PendingApproval) -> None:
        self._session_waiting_on(call).approve(call)

    def deny(self, call: str | PendingApproval, reason: str | None = None) -> None:
        self._session_waiting_on(call).deny(call, reason)

    def answer(self, call: str | PendingApproval, result: str) -> None:
        self._session_waiting_on(call).answer(call, result)

    def _session_waiting_on(self, call: str | PendingApproval) -> Step:
        call_id = call.call_id if isinstance(call, PendingApproval) else call
        if self.running:
            raise RuntimeError(f"{self._where()}: cannot decide while a run is in progress")
        for slot in self._slots():
            session = slot.session
            if session is not None and any(p.call_id == call_id for p in session.pending_approvals):
                return session
        waiting = ", ".join(repr(p.call_id) for p in self.pending_approvals) or "none"
        raise ValueError(
            f"{self._where()}: no call {call_id!r:.80} waits for approval (waiting: {waiting})"
        )

    @property
    def local_usage(self) -> Usage:
        """Tokens used by every agent of this workflow's runs, resumes included (as this
        object counted them, or its restored ``state`` says)."""
        total = zero_usage()
        for slot in self._slots():
            add_usage(total, slot.usage())
        return total

    def __repr__(self) -> str:
        state = "running" if self.running else (self.last_status or "idle")
        return f"<{type(self).__name__} {self._name!r} {state}>"

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
            "usage": self.local_usage,
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
        data = expect_dict(state, f"the state given to {where}.restore()")
        _check_encodable(data, f"the state given to {where}.restore()")
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

    def _check_resumable(self) -> None:
        if self._task is None:
            raise ValueError(
                f"nothing to resume: {self._where()} has no run yet; "
                "use run(task), or restore(state) first"
            )
        waiting = self.pending_approvals
        if waiting:
            names = ", ".join(f"{p.call_id!r} ({p.tool})" for p in waiting)
            raise ValueError(
                f"{self._where()}: calls wait for a decision: {names}; approve() or deny() "
                "each, then resume()"
            )

    def _claim(self, task: str | None, options: RunOptions = NO_OPTIONS) -> RunScope:
        """Claim this workflow for one run and open the run's scope (holding ``options``:
        each agent run inside uses their deps, and all of them together their limits)."""
        if options.images:
            raise TypeError(
                f"{self.kind} {self.name!r}: images go to an agent's run, not a workflow's"
            )
        if options.continue_partial:
            raise TypeError(
                f"{self.kind} {self.name!r}: continue_partial is an agent's resume() option"
            )
        if options.limits is not None:  # one budget for every agent run inside
            options = replace(options, shared=SharedBudget(options.limits))
        scope = self._seat.claim(options)
        self._clock = RunClock()
        self._reply_slots = ()
        if task is not None:
            self._task = task
            self._answer = None
            self._fresh()
        return scope

    def _end(
        self, scope: RunScope, status: RunStatus, reply: str, error: str | None
    ) -> RunFinished | None:
        """Release the workflow and emit its one terminal event (once per run)."""
        if self._scope is not scope:
            return None
        result = self._result_of(scope, status, reply, error)
        self._seat.release(result)
        if status in ANSWERED:
            self._answer = reply
        final = run_finished(result, self.local_usage)
        scope.emit(final)
        return final

    def _answered(self, reply: str, *slots: _Slot) -> tuple[RunStatus, str]:
        """The run answers ``reply``, made of the answers of ``slots``: ``incomplete``
        when one of them was cut off, else ``completed``."""
        self._reply_slots = slots
        return ("incomplete" if any(s.cut_off for s in slots) else "completed"), reply

    def _result_of(
        self, scope: RunScope, status: RunStatus, reply: str, error: str | None
    ) -> RunResult[str]:
        """This run's result: the totals of its steps' runs, and what it answered."""
        ended = scope.ended if isinstance(scope, _StepResults) else []
        usage = zero_usage()
        messages: list[Message] = []
        for step in ended:
            add_usage(usage, step.usage)
            messages.extend(step.messages)
        cut = [s for s in self._reply_slots if s.cut_off] or self._reply_slots[-1:]
        duration, started_at, ended_at = self._clock.span()
        return RunResult(
            source=self._name,
            status=status,
            output=None if status in STOPPED else reply,
            reply=reply,
            stop_reason=(
                scope.halt.stop_reason
                if status in NAMED_HALTS and scope.halt is not None
                else cut[0].stop_reason if cut and status in ANSWERED else None
            ),
            usage=usage,
            requests=sum(step.requests for step in ended),
            retries=sum(step.retries for step in ended),
            duration=duration,
            started_at=started_at,
            ended_at=ended_at,
            messages=messages,
            error=error,
            run_id=scope.run_id,
        )

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

    async def _finish(
        self, task: str | None, reset: bool, options: RunOptions = NO_OPTIONS
    ) -> RunFinished:
        scope = self._claim(task, options)
        scope.emit(RunStarted(self._name, task))
        return await self._body(scope)

    async def _body(self, scope: RunScope) -> RunFinished:
        assert self._task is not None
        token = current_scope.set(scope)
        status: RunStatus = "failed"
        reply = ""
        error: str | None = None
        try:
            status, reply = await self._execute(self._task, scope)
        except BaseException as exc:
            status = stopped_status(exc, past_deadline(scope))
            error = error_text(exc)
            raise
        finally:
            # Closed from another context (a task destroyed unfinished): nothing to reset.
            with contextlib.suppress(ValueError):
                current_scope.reset(token)
            final = self._end(scope, status, reply, error)
        assert final is not None, "a workflow run ends once"
        return final

    async def _events(
        self, task: str | None, reset: bool, options: RunOptions = NO_OPTIONS
    ) -> AsyncGenerator[Event, None]:
        # The run goes on in a task of its own and its events arrive through a queue, so
        # no yield of this generator ever sits inside a TaskGroup or a timeout.
        scope = self._claim(task, options)
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

    async def _stop_driver(self, driver: asyncio.Task[RunFinished], scope: RunScope) -> None:
        """Cancel the run's task and wait until it has ended, however often we are cancelled.

        As a TaskGroup does: the stream never ends while its run still works on the
        transcripts; a further cancel of ours is raised once the run has stopped.
        """
        driver.cancel()
        again = await wait_through_cancels(driver)
        _outcome(driver)  # retrieved: never "Task exception was never retrieved"
        # A task cancelled before its first step never ran _body's finally.
        self._end(scope, "cancelled", "", "CancelledError: the stream was stopped")
        if again is not None:
            raise again


def _outcome(task: asyncio.Task[RunFinished]) -> BaseException | None:
    if task.cancelled():
        return asyncio.CancelledError()
    return task.exception()


def _drain_queue(queue: asyncio.Queue[Event | _End]) -> list[Event | _End]:
    items: list[Event | _End] = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def interrupted(scope: RunScope) -> tuple[RunStatus, str]:
    """How a run stopped at a step boundary ends: paused when an agent inside paused for
    approvals, else interrupted (the scope records which)."""
    halt = scope.halt
    if halt is not None and halt.status != "interrupted":
        return halt.status, halt.reply
    scope.note_interrupted()
    return "interrupted", INTERRUPTED
