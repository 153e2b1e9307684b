"""A :class:`~aimu.aio.RunHandle`'s states and how it moves between them.

The state machine (:class:`HandleState`)::

    PENDING ──first step──▶ RUNNING ──the run returns──▶ COMPLETED, INCOMPLETE,
       │                      │                          INTERRUPTED or PAUSED
       │                      │     ──the run raises───▶ FAILED
       │                      │     ──CancelledError───▶ CANCELLED
       ├──cancel()────────────┴──▶ CANCELLING ──the run ends──▶ CANCELLED (COMPLETED or
       │                      │        ▲                        FAILED if it returned or
       │                      │        │ cancel()               raised instead)
       └──deadline────────────┴──▶ EXPIRING ──the run ends──▶ TIMED_OUT, or CANCELLED
                                                              if another cancel came too

The seven on the right are final. Moves the diagram lacks are refused: ``cancel()`` and
``interrupt()`` answer False on a final handle, and a second finish raises
``RuntimeError`` naming the state it found. A cancel (or deadline)
that comes while PENDING is delivered at the task's first step, so it lands at the
run's first ``await``: its opening lines (an agent recording the task) still run.
``interrupt()`` is a request, not a state: it sets the scope's ``interrupt_requested``
while PENDING or RUNNING. A run that returns ends INTERRUPTED when a loop in its scope
honoured an interrupt (``scope.halt``: agents and workflows record it, a
loop of your own calls ``scope.note_interrupted()``), PAUSED when one paused for
approvals (``scope.halt`` too), INCOMPLETE when the agent or workflow run it ran
answered with a reply cut off (by the model's length limit or a filter; see
``handle.last_run``), else COMPLETED, even if an interrupt was asked for. A typed agent
run (``output_type=``) stopped that way has no value to return: it raises
``NoOutputError``, and the handle ends INTERRUPTED (PAUSED) with that error. A
paused run has ended: cancelling its handle does nothing. The deadline counts its
cancel as ``asyncio.timeout`` does: TIMED_OUT only when its cancel is the task's only
one (``task.cancelling()``), so a cancel from anywhere else, even in the same loop
iteration, is reported as CANCELLED.
"""

from __future__ import annotations

from typing import Final

from aimu.aio.status import HANDLE_STATUSES, LIVE, STOPPED

__all__ = ["LIVE_STATES", "RETURNED_STATES", "HandleState"]


class HandleState:
    """The states of the diagram above: each :data:`~aimu.aio.status.HandleStatus` by its
    name (a test holds them equal), and two of a run ending by a cancel or deadline.
    Plain strings, not an ``enum.Enum``: loading an Enum member goes through its
    metaclass and costs four times a class attribute, and the hot path of every run
    loads several."""

    PENDING: Final = "pending"
    RUNNING: Final = "running"
    CANCELLING: Final = "cancelling"
    EXPIRING: Final = "expiring"
    COMPLETED: Final = "completed"
    INCOMPLETE: Final = "incomplete"
    INTERRUPTED: Final = "interrupted"
    PAUSED: Final = "paused"
    LIMITED: Final = "limited"
    BLOCKED: Final = "blocked"
    CANCELLED: Final = "cancelled"
    TIMED_OUT: Final = "timed_out"
    FAILED: Final = "failed"


#: Not ended: live (see :data:`~aimu.aio.status.LIVE`), or ending by a cancel or deadline.
LIVE_STATES: Final[frozenset[str]] = LIVE | {HandleState.CANCELLING, HandleState.EXPIRING}
#: Ended with the run's value (not by an exception).
RETURNED_STATES: Final[frozenset[str]] = HANDLE_STATUSES - LIVE - STOPPED
