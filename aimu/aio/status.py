"""A run's words, once: how a run stands and how it ended, and every grouping of them.

Each status is spelled here and nowhere else as a type or a set: every status type of
aimu is a union of the ones below (``HandleStatus = Literal["pending", "running"] |
RunStatus``), and every set of statuses one of the groupings (``FINAL``, ``LIVE``, ...).
Code elsewhere compares a typed status with one word (``status == "paused"``), which
mypy checks against these types. An architecture test holds the rule.

The outcomes, by what a caller does next:

- answered (:data:`ANSWERED`): ``completed``; ``incomplete`` (the model's reply was cut
  off, by its length limit or a content filter: ``stop_reason`` says which);
  ``max_rounds`` (the reply of the last turn ``max_rounds`` allowed);
- stopped mid-step from outside the loop (:data:`STOPPED`): ``cancelled``, ``timed_out``,
  ``failed`` (an error): open calls got results, the run returns nothing;
- halted at a step boundary, ``resume()`` goes on (:data:`HALTED`): ``interrupted``,
  ``paused`` (tool calls wait for a person), ``limited`` (a usage limit:
  ``stop_reason`` is ``"limit:<name>"``);
- blocked (:data:`BLOCKED`): a guardrail's tripwire refused the input or the answer
  (``stop_reason`` is ``"guardrail:<name>"``, the reply gives the reason).

Where a run stands, each concept with its one authoritative shape:

- the result: :class:`~aimu.aio.RunResult` (what ``run()`` returns), whose terminal event
  is :class:`~aimu.aio.RunFinished` (its fields, as an event); a handle's
  :class:`~aimu.aio.HandleFinished` adds the handle's own status (:data:`HandleStatus`);
- the record: :class:`~aimu.aio.store.RunRecord` (the store's, durable:
  :data:`RunRecordStatus`); serve's ``RunRecord`` model is its JSON schema;
- the live view: ``aio.control.RunInfo`` (Redis: :data:`ControlStatus`); serve's
  ``RunView`` (and its schema ``serve.models.Run``) is the same view behind HTTP, whatever
  backend holds the run.
"""

from __future__ import annotations

from typing import Any, Final, Literal, TypeAlias, get_args

__all__ = [
    "ANSWERED", "BLOCKED", "BY_CANCEL", "CONTROL_STATUSES", "ENDED", "FINAL", "HALTED",
    "HANDLE_STATUSES", "LIVE", "NAMED_HALTS", "RECOVERABLE", "RUN_RECORD_STATUSES",
    "RUN_STATUSES", "SESSION_STATUSES", "STOPPED", "Answered", "Blocked", "ControlStatus",
    "HaltStatus", "Halted", "HandleStatus", "Live", "Replied", "RunRecordStatus",
    "RunStatus", "RunnerStatus", "SessionStatus", "Stopped", "words",
]

#: The model's reply ended the run: in full, or cut off (``incomplete``).
Replied: TypeAlias = Literal["completed", "incomplete"]
#: The run answered: its reply is the model's (``max_rounds``: the reply of the last turn
#: ``max_rounds`` allowed). A typed run has its output.
Answered: TypeAlias = Replied | Literal["max_rounds"]
#: Something outside the loop stopped the run mid-step (a cancel, its deadline, an error).
Stopped: TypeAlias = Literal["cancelled", "timed_out", "failed"]
#: The run stopped at a step boundary and ``resume()`` goes on from there.
Halted: TypeAlias = Literal["interrupted", "paused", "limited"]
#: A guardrail's tripwire ended the run.
Blocked: TypeAlias = Literal["blocked"]
#: How a run ended (the outcome :class:`~aimu.aio.RunResult` and ``RunFinished`` carry).
RunStatus: TypeAlias = Answered | Stopped | Halted | Blocked
#: A run not ended yet: reserved or started, not yet running (``pending``), or running.
Live: TypeAlias = Literal["pending", "running"]
#: A :class:`~aimu.aio.RunHandle`'s status: live, or how its run ended (a run that
#: ended at ``max_rounds`` answered: its handle says ``completed``).
HandleStatus: TypeAlias = Live | Replied | Halted | Blocked | Stopped
#: A run in Redis (``aio.RedisControl``): its handle's status, or ``lost`` (registered,
#: but its worker's lease expired).
ControlStatus: TypeAlias = HandleStatus | Literal["lost"]
#: How a runnable stands: ``idle`` before its first run, ``running``, or how the last ended.
RunnerStatus: TypeAlias = Literal["idle", "running"] | RunStatus
#: A session in a store: ``in_progress`` while a run writes it, or how its last run ended.
SessionStatus: TypeAlias = Literal["in_progress"] | RunStatus
#: A run's record in a store: ``running``, or how it ended.
RunRecordStatus: TypeAlias = Literal["running"] | RunStatus
#: How a loop inside a run stopped at a step boundary, as the run's scope reports it.
HaltStatus: TypeAlias = Halted | Blocked


def words(status_type: Any) -> tuple[str, ...]:
    """The words of a status type (a ``Literal`` or a union of them), in their order."""
    found: list[str] = []
    for arg in get_args(status_type):
        for word in (arg,) if isinstance(arg, str) else words(arg):
            if word not in found:
                found.append(word)
    return tuple(found)


def _set(status_type: Any) -> frozenset[Any]:
    return frozenset(words(status_type))


#: The run answered (see :data:`Answered`).
ANSWERED: Final[frozenset[RunStatus]] = _set(Answered)
#: Something outside the loop stopped the run mid-step (see :data:`Stopped`).
STOPPED: Final[frozenset[RunStatus]] = _set(Stopped)
#: The run stopped at a step boundary and ``resume()`` goes on (see :data:`Halted`).
HALTED: Final[frozenset[RunStatus]] = _set(Halted)
#: A guardrail's tripwire ended the run.
BLOCKED: Final[frozenset[RunStatus]] = _set(Blocked)
#: Every outcome.
RUN_STATUSES: Final[frozenset[RunStatus]] = _set(RunStatus)
#: The run is over: every outcome but ``paused`` (a paused run waits for a person's
#: decision and goes on in the same run, on Temporal in the same workflow).
FINAL: Final[frozenset[RunStatus]] = RUN_STATUSES - {"paused"}
#: The part of the run a handle held has ended: every outcome, ``paused`` too (a paused
#: run's decisions go to its session through the store). Redis' "done".
ENDED: Final[frozenset[RunStatus]] = RUN_STATUSES
#: Ended by a cancel: a caller's, or its deadline's.
BY_CANCEL: Final[frozenset[RunStatus]] = STOPPED - {"failed"}
#: Halts whose ``stop_reason`` names what stopped the run (``"limit:<name>"``,
#: ``"guardrail:<name>"``).
NAMED_HALTS: Final[frozenset[RunStatus]] = _set(Literal["limited"] | Blocked)
#: Not ended yet (see :data:`Live`).
LIVE: Final[frozenset[Live]] = _set(Live)
#: Ended by an interrupt or a cancel that was not a person's last word: a run a draining
#: server stopped, or a Temporal turn that handed off, ended so, and its run goes on
#: under the same id (recovered, or reopened in Redis).
RECOVERABLE: Final[frozenset[RunStatus]] = frozenset({"interrupted", "cancelled"})
#: Every value of each status type, to check what a store or a wire holds.
HANDLE_STATUSES: Final[frozenset[HandleStatus]] = _set(HandleStatus)
CONTROL_STATUSES: Final[frozenset[ControlStatus]] = _set(ControlStatus)
SESSION_STATUSES: Final[frozenset[SessionStatus]] = _set(SessionStatus)
RUN_RECORD_STATUSES: Final[frozenset[RunRecordStatus]] = _set(RunRecordStatus)
