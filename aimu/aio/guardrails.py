"""Guardrails: functions that check a run's input, its final answer and its tool calls.

A guardrail is a function, sync or async, of the run's :class:`~aimu.aio.RunContext`
and what it checks (the task text; the final answer, text or typed output; a tool
call's arguments or result). It returns (anything: ok) or raises :class:`Tripwire`
with a reason. A guardrail that ends any other way fails closed: the run fails with a
:class:`GuardrailError` naming it, whether it raised or ended cancelled while the run
was not stopped (it awaited a cancelled future); a stop of the run stays a stop.

- ``input_guardrails=`` run *beside* the run's first model turn (as one task, started
  when the task is recorded). A tripwire cuts the turn in flight: what it streamed is
  kept, marked partial, its complete calls answered as not run, and the run ends
  ``blocked`` with the reason. A turn that ends before the guardrails have decided
  waits for them before anything of it counts (no tool runs on unchecked input).
- ``output_guardrails=`` check the final answer before the run returns it and records
  its end: a tripwire ends the run ``blocked`` and the answer stays in the transcript
  marked partial (a resume asks the model again; the new answer is checked again).
- ``tool_guardrails=`` (:class:`ToolGuardrail`) check a call's arguments before it
  runs (a tripwire: the call does not run, the model reads the reason as the tool's
  error) and its result before the model sees it (a tripwire: the model reads the
  reason instead of the result).

The guardrail task is the run's: a stop, an interrupt or the run's end cancels it and
waits for it, so no task is left behind.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

from aimu.aio._cut import Cut, cut_steps
from aimu.aio.errors import AimuError
from aimu.aio.instructions import RunContext
from aimu.aio.tools import ToolOutcome
from aimu.aio.transcript import ToolCall

__all__ = [
    "Guardrail",
    "GuardrailError",
    "InputGuard",
    "ToolGuardrail",
    "Tripwire",
    "check_guardrails",
    "guard_name",
    "guarded",
    "guarded_call",
    "run_guardrails",
]

_T = TypeVar("_T")
_Outcome = TypeVar("_Outcome")

#: A guardrail: ``fn(ctx, value)``, sync or async; returns (ok) or raises Tripwire.
Guardrail: TypeAlias = Callable[[RunContext[Any], Any], object]


class Tripwire(Exception):
    """Raised by a guardrail to stop what it checks, with ``reason`` (shown to the user
    for input and output, to the model for a tool call)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = str(reason)


class GuardrailError(AimuError):
    """A guardrail raised something other than Tripwire: the run fails, naming it."""

    def __init__(self, kind: str, name: str, error: BaseException) -> None:
        if isinstance(error, asyncio.CancelledError):
            said = "ended cancelled, and the run was not stopped: a check that did not " \
                "decide fails closed"
        else:
            said = f"raised {type(error).__name__}: {error}"
        super().__init__(f"{kind} guardrail {name!r} {said}")
        self.guardrail = name
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Tripped:
    """A guardrail's tripwire: which guardrail and why."""

    guardrail: str
    reason: str

    @property
    def stop_reason(self) -> str:
        return f"guardrail:{self.guardrail}"

    @property
    def reply(self) -> str:
        return f"Run blocked by guardrail {self.guardrail!r}: {self.reason}"


@dataclass(frozen=True, slots=True)
class ToolGuardrail:
    """Checks for tool calls (``tool_guardrails=[...]`` on the agent): ``before(ctx,
    call)`` sees the call (``{"name", "arguments"}``) before it runs, ``after(ctx,
    result)`` the result text (``{"name", "arguments", "result"}``) before the model
    does; either may be None. ``tools``: the tool names it checks (None: every tool)."""

    before: Guardrail | None = None
    after: Guardrail | None = None
    tools: frozenset[str] | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.before is None and self.after is None:
            raise ValueError("a ToolGuardrail needs before=, after=, or both")
        for label, fn in (("before", self.before), ("after", self.after)):
            if fn is not None and not callable(fn):
                raise TypeError(f"ToolGuardrail {label}= must be callable, got {fn!r}")
        if self.tools is not None:
            object.__setattr__(self, "tools", frozenset(self.tools))

    def checks(self, tool: str) -> bool:
        return self.tools is None or tool in self.tools


def guard_name(fn: object) -> str:
    """How a guardrail is named in a stop reason and an error: its ``__name__``."""
    if isinstance(fn, ToolGuardrail) and fn.name:
        return fn.name
    return str(getattr(fn, "__name__", None) or type(fn).__name__)


def check_guardrails(label: str, given: object, kind: type | None = None) -> tuple[Any, ...]:
    """``given`` as a tuple, each item checked (TypeError naming ``label`` if not)."""
    if given is None:
        return ()
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise TypeError(f"{label} must be a list of guardrails, got {type(given).__name__}")
    for item in given:
        if kind is not None and not isinstance(item, kind):
            raise TypeError(f"{label} takes {kind.__name__} items, got {type(item).__name__}")
        if kind is None and not callable(item):
            raise TypeError(f"{label} takes functions (ctx, value), got {item!r}")
    return tuple(given)


async def run_guardrails(
    kind: str, guardrails: Sequence[Guardrail], context: RunContext[Any], value: object
) -> Tripped | None:
    """Run ``guardrails`` on ``value`` in order: the first tripwire, or None when all
    pass. Anything else (an error, a cancel of its own): GuardrailError naming it."""
    for fn in guardrails:
        tripped = await _run_one(kind, fn, context, value)
        if tripped is not None:
            return tripped
    return None


async def _run_one(
    kind: str, fn: Guardrail, context: RunContext[Any], value: object
) -> Tripped | None:
    """One guardrail's verdict: None (passed), its tripwire, or GuardrailError. A
    CancelledError while nobody cancelled this task (``cancelling()`` is 0: the
    guardrail awaited a cancelled future) is the guardrail's failure, not a stop; a
    cancel of the task (the run stopped) propagates untouched."""
    try:
        outcome = fn(context, value)
        if inspect.isawaitable(outcome):
            await outcome
    except Tripwire as trip:
        return Tripped(guard_name(fn), trip.reason)
    except asyncio.CancelledError as cancel:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise
        raise GuardrailError(kind, guard_name(fn), cancel) from cancel
    except Exception as error:
        raise GuardrailError(kind, guard_name(fn), error) from error
    return None


class GuardCut(Exception):
    """The input guardrails tripped while the first turn streamed (internal)."""


class InputGuard:
    """The input guardrails of one run, as a task beside its first model turn.

    When the task ends with a tripwire or an error, the step waiting in :meth:`guard`
    (a stream step) is cancelled and ``guard`` raises GuardCut (a tripwire) or the
    GuardrailError in its place; a guard after that raises at once. The cancel
    accounting is asyncio.timeout's: a cancel from elsewhere in the same moment stays a
    CancelledError (the run ends one way)."""

    __slots__ = (
        "_checking", "_cut", "_stopping", "_taken", "_task", "error", "tripped",
    )

    def __init__(
        self, guardrails: Sequence[Guardrail], context: RunContext[Any], task: str
    ) -> None:
        self.tripped: Tripped | None = None
        self.error: GuardrailError | None = None
        self._cut = Cut()  # of the step waiting in guard()
        self._taken = False  # the task's outcome read (once, by _take)
        self._stopping = False  # the run cancelled the task (its end, a stop)
        self._checking = "?"  # the guardrail running now: named if its task ends cancelled
        self._task = asyncio.get_running_loop().create_task(
            self._check(guardrails, context, task), name="aimu input guardrails"
        )
        self._task.add_done_callback(self._done)

    async def _check(
        self, guardrails: Sequence[Guardrail], context: RunContext[Any], task: str
    ) -> Tripped | None:
        for fn in guardrails:
            self._checking = guard_name(fn)
            tripped = await _run_one("input", fn, context, task)
            if tripped is not None:
                return tripped
        return None

    @property
    def passed(self) -> bool:
        """The guardrails ran to the end and none tripped."""
        self._take()
        task = self._task
        return task.done() and not task.cancelled() and self.tripped is None \
            and self.error is None

    def _done(self, task: asyncio.Task[Tripped | None]) -> None:
        if self._taken:  # read already (a guard or decision came before this callback)
            return
        self._take()
        if self.tripped is not None or self.error is not None:
            self._cut.fire()

    def _take(self) -> None:
        """Read the task's outcome once it is done: from the task itself, since its done
        callback runs a loop step later. A task that ended cancelled while the run did
        not stop it cannot decide, and fails closed (an error, never "passed")."""
        task = self._task
        if self._taken or not task.done():
            return
        self._taken = True
        if task.cancelled():
            if self._stopping:  # the run is ending: no decision is wanted
                return
            error: BaseException | None = asyncio.CancelledError()
        else:
            error = task.exception()
        if isinstance(error, GuardrailError):
            self.error = error
        elif error is not None:  # not an Exception of a guardrail: kept as the error
            self.error = GuardrailError("input", self._checking, error)
        else:
            self.tripped = task.result()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error
        if self.tripped is not None:
            raise GuardCut

    async def guard(self, awaitable: Awaitable[_T]) -> _T:
        """``awaitable``'s value, or GuardCut / GuardrailError (``awaitable`` cancelled)
        if the guardrails decide against the input first."""
        self._take()
        if self.tripped is not None or self.error is not None:
            if inspect.iscoroutine(awaitable):
                awaitable.close()
            self._raise()
        return await self._cut.run(awaitable, self._raise)

    async def decision(self) -> None:
        """Wait for the guardrails (a turn ended before they decided): GuardCut on a
        tripwire, GuardrailError on an error; a cancel of the run cancels them."""
        if not self._task.done():
            await asyncio.wait([self._task])
        self._take()
        self._raise()

    def cancel(self) -> None:
        """The run is ending: a guardrail still running is cancelled (see close)."""
        self._stopping = True
        self._task.cancel()

    async def close(self) -> None:
        """The run has ended: a guardrail still running is cancelled and awaited."""
        task = self._task
        self._stopping = True
        task.cancel()
        if not task.done():
            await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # retrieved: never "Task exception was never retrieved"


def guarded(chunks: AsyncGenerator[_T, None], guard: InputGuard) -> AsyncGenerator[_T, None]:
    """``chunks``, each step cut when the input guardrails decide against the input.
    Only a run's first turn with input guardrails pays for this frame."""
    return cut_steps(chunks, guard.guard)


async def guarded_call(
    guardrails: Sequence[ToolGuardrail],
    context: RunContext[Any],
    call: ToolCall,
    run_it: Callable[[], Awaitable[_Outcome]],
) -> _Outcome | ToolOutcome:
    """Run a tool call through the tool guardrails that check its tool: the ``before``
    checks see its arguments first (a tripwire: it does not run, the model reads the
    reason as the tool's error), the ``after`` checks its result (a tripwire: the model
    reads the reason instead). A result that is not text (a call held open) is not
    checked."""
    function = call["function"]
    name, arguments = function["name"], function["arguments"]
    mine = [g for g in guardrails if g.checks(name)]
    before = [g.before for g in mine if g.before is not None]
    seen = {"name": name, "arguments": arguments}
    tripped = await run_guardrails("tool", before, context, seen) if before else None
    if tripped is not None:
        return ToolOutcome(
            f"[not run: blocked by guardrail {tripped.guardrail!r}: {tripped.reason}]", True
        )
    outcome = await run_it()
    after = [g.after for g in mine if g.after is not None]
    if not after or not isinstance(outcome, ToolOutcome):
        return outcome
    seen["result"] = outcome.content
    tripped = await run_guardrails("tool", after, context, seen)
    if tripped is None:
        return outcome
    return ToolOutcome(
        f"[result withheld by guardrail {tripped.guardrail!r}: {tripped.reason}]", True
    )
