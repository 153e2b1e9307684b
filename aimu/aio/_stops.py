"""How a run that did not complete stopped, and why: one verdict for the log and the span.

Every agent run that ends other than ``completed`` logs one INFO record on
``aimu.aio.agent`` (a stop is not the happy path, and not an error: the caller has the
outcome). The reason names things (a cancel's reason, the tools waiting, an error's
type), never a message's contents.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from aimu.aio.events import RunFinished
from aimu.aio.scope import RunScope

__all__ = ["CLOSED", "Stop", "log", "past_deadline", "stop_of"]

log = logging.getLogger("aimu.aio.agent")
#: The reason of a run stopped because its consumer closed its event stream.
CLOSED = "the consumer closed the event stream"

@dataclass(frozen=True, slots=True)
class Stop:
    """How a run ended for its span and log: the status (``timed_out`` for a cancel its
    deadline made) and why, when known."""

    status: str
    reason: str | None = None

    def log(self, agent: str) -> None:
        if self.status != "completed":
            why = f": {self.reason}" if self.reason else ""
            log.info("agent %r: the run ended %s%s", agent, self.status, why)


def stop_of(
    final: RunFinished,
    error: BaseException | None,
    scope: RunScope,
    waiting: Sequence[str] = (),
    max_rounds: int = 0,
    limit: str | None = None,
) -> Stop:
    """The :class:`Stop` of the run that ``final`` ended, by ``error`` (if any);
    ``waiting`` names the calls a paused run waits on."""
    status: str = final.status
    if status == "timed_out":
        return Stop(status, "deadline passed")
    if status == "cancelled":
        if past_deadline(scope):
            return Stop("timed_out", "deadline passed")
        if isinstance(error, GeneratorExit):
            return Stop(status, CLOSED)
        if error is not None and error.args and isinstance(error.args[0], str):
            return Stop(status, error.args[0])
        return Stop(status)
    if status == "failed":
        return Stop(status, None if error is None else type(error).__name__)
    if status == "paused":
        return Stop(status, f"tool calls wait for approval: {', '.join(waiting)}")
    if status == "limited":
        return Stop(status, limit or final.stop_reason)
    if status == "blocked":
        return Stop(status, final.reply)
    if status == "max_rounds":
        return Stop(status, f"the limit of {max_rounds} tool rounds was reached")
    if status == "interrupted":
        return Stop(status, "interrupt requested; stopped at a step boundary")
    if status != "completed" and final.stop_reason is not None:
        return Stop(status, f"the model stopped with {final.stop_reason!r}")  # cut off
    return Stop(status)


def past_deadline(scope: RunScope | None) -> bool:
    """True when a handle around the run is stopping it for its deadline (and no cancel
    came before or since): the run ends timed_out, as the handle does."""
    while scope is not None:
        if scope.expiring:
            return True
        scope = scope.parent
    return False
