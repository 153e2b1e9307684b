"""What agents and workflows share: one run at a time in a run scope, and how it is driven.

A :class:`Runnable` runs ``run(task)`` or ``resume()`` to an answer, or hands the same
run out as events (``stream=True``). Every run opens a :class:`~aimu.aio.scope.RunScope`
under the one it runs in: ``interrupt()`` asks that scope, so an interrupt from the
object itself, from a workflow around it or from a handle reaches the run the same way.
Workflows drive their steps through the same surface (:meth:`Runnable.finish`).
"""

from __future__ import annotations

import abc
import asyncio
import warnings
from collections.abc import AsyncGenerator, Callable, Coroutine, Mapping, Sequence
from contextlib import aclosing
from types import CoroutineType
from typing import Any, ClassVar, Generic, Literal, cast, overload

from typing_extensions import TypeVar

from aimu.aio._run_options import NO_DEPS, NO_OPTIONS, RunClock, RunOptions, options_in
from aimu.aio._run_stream import RunStream
from aimu.aio.approvals import PendingApproval
from aimu.aio.events import Event, RunFinished, RunResult, RunStatus
from aimu.aio.images import image_urls
from aimu.aio.limits import UsageLimits
from aimu.aio.scope import RunScope, RunSeat, sent_message
from aimu.aio.status import RunnerStatus
from aimu.aio.transcript import Usage, check_text, zero_usage

__all__ = [
    "NO_DEPS", "NO_OPTIONS", "OutputT", "RunClock", "RunOptions", "Runnable", "RunnerStatus",
    "load_usage", "options_in",
]

#: What ``run()`` returns: the answer's text, or an agent's ``output_type``.
OutputT = TypeVar("OutputT", covariant=True, default=str)


class Runnable(abc.ABC, Generic[OutputT]):
    """Base of :class:`~aimu.aio.Agent` and the workflows: run, resume, stream, interrupt.

    One run at a time per object (``start()`` gives another session). ``status`` says
    whether a run is in progress and how the last one ended.
    """

    #: The ``kind`` written in a workflow's ``state`` for a step of this class.
    kind: ClassVar[str]
    #: The class of the scope each run opens.
    _scope_type: ClassVar[type[RunScope]] = RunScope

    #: The run in progress and how the last one ended (what the run's driver claims).
    _seat: RunSeat
    #: The closing of a run whose stream's consumer left the loop (see RunStream): a run
    #: asked for while it still settles waits for it, instead of finding the session busy.
    _leaving: asyncio.Task[None] | None = None

    def _take_seat(self, name: str) -> None:
        """Give this session its seat for runs (a subclass's ``__init__`` does, first)."""
        self._seat = RunSeat(self.kind, name, self._scope_type)

    @property
    def _scope(self) -> RunScope | None:
        """The scope of the run in progress, None between runs."""
        return self._seat.scope

    @property
    def last_status(self) -> RunStatus | None:
        """How the last run ended (None before the first)."""
        return self._seat.last_status

    @last_status.setter
    def last_status(self, status: RunStatus | None) -> None:
        self._seat.last_status = status

    @property
    def last_run(self) -> RunResult[OutputT] | None:
        """What the last run did: status, stop reason, usage, duration, messages (None
        before the first run). Set on every outcome, before the run's RunFinished is
        emitted."""
        return self._seat.last_run

    @last_run.setter
    def last_run(self, result: RunResult[OutputT] | None) -> None:
        self._seat.last_run = result

    # -- what each runnable defines ------------------------------------------------------

    @property
    @abc.abstractmethod
    def name(self) -> str: ...

    @property
    @abc.abstractmethod
    def local_usage(self) -> Usage:
        """Tokens used by the runs of this object, resumes included: what it counted
        itself, so a new object on a stored session starts at zero (a workflow restored
        from its ``state`` gets its steps' counts back). The session's totals, as its
        store keeps them across processes, are an agent's :attr:`~aimu.aio.Agent.spend`."""

    @property
    def usage(self) -> Usage:
        """Deprecated: it read as "this session's" but counts only this object's runs (0
        in a new process). Read :attr:`local_usage` for that, or an agent's ``spend`` for
        the session's totals."""
        warnings.warn(
            f"{type(self).__name__}.usage counts only this object's runs (0 in a new "
            "process), not the session's: read .local_usage for that, or an agent's "
            ".spend for the session's totals",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.local_usage

    @property
    @abc.abstractmethod
    def resumable(self) -> bool:
        """True when ``resume()`` has a task to continue."""

    @abc.abstractmethod
    def start(self) -> Runnable[OutputT]:
        """A new session of the same configuration, with no progress."""

    @property
    @abc.abstractmethod
    def pending_approvals(self) -> list[PendingApproval]:
        """The tool calls a paused run waits on, for ``approve()`` / ``deny()``."""

    @abc.abstractmethod
    def approve(self, call: str | PendingApproval) -> None:
        """Let the waiting call (its id, or the PendingApproval shown: then that pause
        only) run when the run resumes; ValueError if none waits, StaleDecisionError if
        the pause shown no longer does."""

    @abc.abstractmethod
    def deny(self, call: str | PendingApproval, reason: str | None = None) -> None:
        """Refuse the waiting call: on resume the model reads that it was denied."""

    @abc.abstractmethod
    def answer(self, call: str | PendingApproval, result: str) -> None:
        """Give the result of a waiting call of an external tool
        (:func:`~aimu.aio.external_tool`): on resume the model reads it as the tool's."""

    @abc.abstractmethod
    def _events(
        self, task: str | None, reset: bool, options: RunOptions = NO_OPTIONS
    ) -> AsyncGenerator[Event, None]:
        """The run as events, ending with one RunFinished (``task`` None: resume)."""

    @abc.abstractmethod
    def _check_resumable(self) -> None:
        """Raise ValueError saying why there is nothing to resume."""

    @abc.abstractmethod
    def snapshot(self) -> dict[str, Any]:
        """This session's progress as plain JSON data (a workflow keeps it per step)."""

    @abc.abstractmethod
    def blank_snapshot(self) -> dict[str, Any]:
        """The :meth:`snapshot` of a step that has not started."""

    @abc.abstractmethod
    def session_from(self, snapshot: Mapping[str, Any]) -> Runnable[OutputT] | None:
        """A new session holding a :meth:`snapshot`, or None when it holds no progress;
        ValueError (or TypeError) when it does not fit this configuration."""

    # -- the shared surface --------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True while a run is in progress on this session."""
        return self._scope is not None

    @property
    def status(self) -> RunnerStatus:
        """``running``, else how the last run ended, else ``idle``."""
        if self._scope is not None:
            return "running"
        return self.last_status or "idle"

    def interrupt(self) -> bool:
        """Ask the run in progress to stop at its next step boundary.

        The step in flight (a model turn and its tool round) finishes and is recorded;
        the run then returns ``"Run interrupted."``. With no run in progress this does
        nothing and returns False. Safe from a signal handler or another thread.
        """
        scope = self._scope
        if scope is None:
            return False
        scope.request_interrupt()
        return True

    def send(self, text: str, *, images: Sequence[object] = ()) -> bool:
        """Give ``text`` (and ``images``: bytes or paths, as ``run(images=)`` takes them)
        to the run in progress: it joins as a user message at the next step boundary
        (after the model turn and tool round in flight) and the run goes on with it.
        False, and nothing happens, when no run is in progress. Thread-safe; several
        sends keep their order."""
        message = sent_message(text, images)  # refused whether or not a run is in progress
        scope = self._scope
        return scope is not None and scope.post(message)

    @property
    def interrupt_requested(self) -> bool:
        """True while the run in progress has been asked to stop (by anyone around it)."""
        scope = self._scope
        return scope is not None and scope.interrupt_requested

    def _check_limits(self, limits: UsageLimits) -> None:
        """ValueError when ``limits`` cannot apply here (an agent: a cost limit without a
        price for its model)."""

    def _check_new_task(self) -> None:
        """Raise ValueError when a new task may not start now (calls wait for a person)."""
        if self.pending_approvals:
            names = ", ".join(f"{p.call_id!r} ({p.tool})" for p in self.pending_approvals)
            raise ValueError(
                f"{self.kind} {self.name!r}: calls wait for a decision: {names}; approve() "
                "or deny() each, then resume()"
            )

    @overload
    def run(
        self,
        task: str,
        *,
        reset: bool = False,
        stream: Literal[False] = False,
        limits: UsageLimits | None = None,
        deps: object = NO_DEPS,
        images: Sequence[object] = (),
    ) -> Coroutine[Any, Any, OutputT]: ...

    @overload
    def run(
        self,
        task: str,
        *,
        reset: bool = False,
        stream: Literal[True],
        limits: UsageLimits | None = None,
        deps: object = NO_DEPS,
        images: Sequence[object] = (),
    ) -> AsyncGenerator[Event, None]: ...

    def run(
        self,
        task: str,
        *,
        reset: bool = False,
        stream: bool = False,
        limits: UsageLimits | None = None,
        deps: object = NO_DEPS,
        images: Sequence[object] = (),
    ) -> Coroutine[Any, Any, OutputT] | AsyncGenerator[Event, None]:
        """Run ``task`` to its answer and return it.

        ``stream=True`` returns the same run as an async iterator of events, ending with
        one :class:`RunFinished`. ``reset=True`` starts an agent from an empty transcript
        (keeping its system prompt); a workflow's run always starts from its first step.
        ``limits`` and ``deps`` replace the configured ones for this run; ``images``
        (bytes or paths) go to the model beside the task.
        """
        if not isinstance(task, str):
            raise TypeError(f"run() takes the task as a string, got {type(task).__name__}")
        check_text(task, f"the task given to {self.kind} {self.name!r}")
        if self._scope is not None:
            if not self._settling_left():
                raise RuntimeError(self._seat.busy())
            return self._after_left(lambda: cast(Any, self.run)(
                task, reset=reset, stream=stream, limits=limits, deps=deps, images=images
            ), stream)
        options = self._options(limits, deps, images, False)
        self._check_new_task()
        return self._begin(task, reset, stream, options)

    @overload
    def resume(
        self,
        *,
        stream: Literal[False] = False,
        limits: UsageLimits | None = None,
        deps: object = NO_DEPS,
        continue_partial: bool = False,
    ) -> Coroutine[Any, Any, OutputT]: ...

    @overload
    def resume(
        self,
        *,
        stream: Literal[True],
        limits: UsageLimits | None = None,
        deps: object = NO_DEPS,
        continue_partial: bool = False,
    ) -> AsyncGenerator[Event, None]: ...

    def resume(
        self,
        *,
        stream: bool = False,
        limits: UsageLimits | None = None,
        deps: object = NO_DEPS,
        continue_partial: bool = False,
    ) -> Coroutine[Any, Any, OutputT] | AsyncGenerator[Event, None]:
        """Continue exactly where the last run stopped, adding no user message.

        What was finished is not done again; a run that had answered returns its
        answer at once. ``continue_partial=True``: an answer a stop cut short is
        continued from where it was cut, where the server can (see the agent).
        """
        if self._scope is not None:
            if not self._settling_left():
                raise RuntimeError(self._seat.busy())
            return self._after_left(lambda: cast(Any, self.resume)(
                stream=stream, limits=limits, deps=deps, continue_partial=continue_partial
            ), stream)
        options = self._options(limits, deps, (), continue_partial)
        self._check_resumable()
        return self._begin(None, False, stream, options)

    def _options(
        self,
        limits: UsageLimits | None,
        deps: object,
        images: Sequence[object],
        continue_partial: bool,
    ) -> RunOptions:
        """The call's options, checked (TypeError/ValueError; nothing has changed)."""
        if limits is not None and not isinstance(limits, UsageLimits):
            raise TypeError(f"limits must be aio.UsageLimits or None, got {type(limits).__name__}")
        if limits is not None:
            self._check_limits(limits)
        if isinstance(images, str | bytes) or not isinstance(images, Sequence):
            raise TypeError("images must be a list of images (bytes or paths)")
        if not isinstance(continue_partial, bool):
            raise TypeError(f"continue_partial must be a bool, got {continue_partial!r}")
        if limits is None and deps is NO_DEPS and not images and not continue_partial:
            return NO_OPTIONS
        return RunOptions(limits, deps, tuple(image_urls(images)), continue_partial)

    def run_sync(self, task: str, *, reset: bool = False) -> OutputT:
        """``run(task)`` for code with no event loop (a script, a notebook without one).

        Runs in a new event loop (``asyncio.run``) and returns the answer; the same agent
        runs again later, in another loop. Ctrl+C cancels the run, which settles as any
        cancel does. Inside a running loop it raises ``RuntimeError``: await ``run()``.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.run(task, reset=reset))
        raise RuntimeError(
            f"{self.kind} {self.name!r}: run_sync() cannot run inside a running event loop; "
            "use `await ....run(task)` there"
        )

    def _settling_left(self) -> bool:
        """True while the run in progress is one whose stream's consumer left its loop."""
        leaving = self._leaving
        return leaving is not None and not leaving.done()

    def _after_left(
        self, start: Callable[[], Any], stream: bool
    ) -> Coroutine[Any, Any, OutputT] | AsyncGenerator[Event, None]:
        """The run asked for while the last one, whose stream was left, still settles
        (a loop turn): it starts once that is done, checked then as if asked then."""
        leaving = self._leaving
        assert leaving is not None
        if stream:
            async def events() -> AsyncGenerator[Event, None]:
                await asyncio.wait((leaving,))
                async with start() as started:
                    async for event in started:
                        yield event

            return RunStream(events(), self)

        async def reply() -> OutputT:
            await asyncio.wait((leaving,))
            return cast(OutputT, await start())

        coroutine = cast("CoroutineType[Any, Any, OutputT]", reply())
        coroutine.__qualname__ = coroutine.__name__ = self.name
        return coroutine

    def _begin(
        self, task: str | None, reset: bool, stream: bool, options: RunOptions = NO_OPTIONS
    ) -> Coroutine[Any, Any, OutputT] | AsyncGenerator[Event, None]:
        if stream:  # leaving its async-for loop stops the run (see RunStream)
            return RunStream(self._events(task, reset, options), self)
        coroutine = cast("CoroutineType[Any, Any, OutputT]", self._reply(task, reset, options))
        # A RunHandle names itself after its coroutine: make that this runnable's name.
        coroutine.__qualname__ = coroutine.__name__ = self.name
        return coroutine

    async def _reply(
        self, task: str | None, reset: bool, options: RunOptions = NO_OPTIONS
    ) -> OutputT:
        """What ``run()`` returns: the reply's text (an agent with ``output_type`` parses it)."""
        return cast(OutputT, (await self._finish(task, reset, options)).reply)

    async def finish(self, task: str | None) -> RunFinished:
        """Run ``task`` (None: resume) to its end; return its RunFinished.

        What a workflow calls for each step. Raises the run's error, or CancelledError.
        """
        if task is None:
            self._check_resumable()
        return await self._finish(task, False)

    async def _finish(
        self, task: str | None, reset: bool, options: RunOptions = NO_OPTIONS
    ) -> RunFinished:
        """The run, drained; the default goes through :meth:`_events`."""
        final: RunFinished | None = None
        events = self._events(task, reset, options)
        async with aclosing(events):
            async for event in events:
                if isinstance(event, RunFinished):
                    final = event  # the last one is the run's own
        assert final is not None, f"the run of {self.name!r} ended without its RunFinished"
        return final


def load_usage(value: object, where: str) -> Usage:
    """Token usage read back from JSON (None: zero); ValueError naming ``where``."""
    if value is None:
        return zero_usage()
    if (
        not isinstance(value, Mapping)
        or not isinstance(value.get("input_tokens"), int)
        or not isinstance(value.get("output_tokens"), int)
    ):
        raise ValueError(f"{where}: 'usage' must be {{'input_tokens': int, 'output_tokens': int}}")
    return {"input_tokens": value["input_tokens"], "output_tokens": value["output_tokens"]}
