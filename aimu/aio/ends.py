"""How a run ends: the reply texts, the rule that says what an error made of a run, and
the run's terminal event.

The agent, workflows, run handles, serve, Redis control and Temporal import these
rather than spelling them again. The outcome statuses and their groupings are
:mod:`aimu.aio.status`'s (re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from aimu.aio.events import RunFinished, RunResult
from aimu.aio.status import (
    ANSWERED,
    BLOCKED,
    FINAL,
    HALTED,
    STOPPED,
    HaltStatus,
    RunStatus,
)
from aimu.aio.transcript import Usage

__all__ = [
    "ANSWERED", "BLOCKED", "BLOCKED_REPLY", "FINAL", "HALTED", "INTERRUPTED", "LIMITED",
    "PAUSED", "STOPPED", "Halt", "HaltStatus", "error_text", "run_finished", "stopped_status",
]

#: What a run returns when ``interrupt()`` stopped it at a step boundary.
INTERRUPTED: Final = "Run interrupted."
#: What a run returns when it paused because tool calls wait for a person.
PAUSED: Final = "Run paused: tool calls wait for approval."
#: What a run returns when a usage limit stopped it before any reply.
LIMITED: Final = "Run stopped by a usage limit."

#: What a run returns when a guardrail blocked it (a run's own reply names the guardrail).
BLOCKED_REPLY: Final = "Run blocked by a guardrail."

#: Which halt a scope keeps when loops in it halted differently: a guardrail's block (the
#: run is refused) over the one a person must act on first (a pause waits for
#: decisions) over a limit over an interrupt.
_RANK: Final[dict[str, int]] = {"interrupted": 0, "limited": 1, "paused": 2, "blocked": 3}


@dataclass(frozen=True, slots=True)
class Halt:
    """How a loop inside a run stopped at a step boundary, as the run's scope reports it:
    ``status``, and for ``limited`` the limit's stop reason (``"limit:<name>"``), for
    ``blocked`` the guardrail's (``"guardrail:<name>"``) and the blocked run's reply."""

    status: HaltStatus
    stop_reason: str | None = None
    text: str | None = None

    def outranks(self, other: Halt | None) -> bool:
        """True when this halt, not ``other``, says how the run around ended."""
        return other is None or _RANK[self.status] >= _RANK[other.status]

    @property
    def reply(self) -> str:
        """What a run that ended by this halt returns."""
        if self.text is not None:
            return self.text
        return {"interrupted": INTERRUPTED, "limited": LIMITED, "paused": PAUSED,
                "blocked": BLOCKED_REPLY}[self.status]


def stopped_status(error: BaseException, deadline_passed: bool) -> RunStatus:
    """How ``error``, raised out of a run, ends it: ``failed`` for an Exception,
    ``cancelled`` for a cancel (or the consumer closing the stream), ``timed_out`` when
    the cancel was a deadline's (``deadline_passed``)."""
    if isinstance(error, Exception):
        return "failed"
    return "timed_out" if deadline_passed else "cancelled"


def error_text(error: BaseException) -> str:
    """The ``error`` a run's result and terminal event carry: type and message."""
    return f"{type(error).__name__}: {error}"


def run_finished(result: RunResult[Any], usage: Usage | None = None) -> RunFinished:
    """The terminal event of the run whose result is ``result`` (``usage``: the tokens
    to report, when not the run's own)."""
    return RunFinished(
        result.source, result.status, result.reply,
        result.usage if usage is None else usage, result.error, result.stop_reason,
        result.requests, result.retries, result.duration,
    )
