"""What the runs service and its backends share: the contract of a backend
(:class:`RunsBackend`), the run it reports (:class:`RunView`), its events in batches, a
decision (:class:`Verdict`) and what it left (:class:`Decided`), and the mark that links
a run whose process died to the run that continues it (:func:`resumed_here`).

:mod:`aimu.serve.runs` serves runs over a backend; each backend of
:mod:`aimu.serve.backends` implements this contract and imports nothing above it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Sequence
from typing import Any, Final, NamedTuple, Protocol, TypeAlias

from aimu.aio.agent import Agent
from aimu.aio.agent.tree import DIED
from aimu.aio.approvals import PendingApproval
from aimu.aio.status import LIVE
from aimu.aio.steering import Steer
from aimu.aio.store import RunRecord, Store
from aimu.aio.transcript import Usage

__all__ = [
    "KEEPALIVE_SECONDS",
    "RESUMED",
    "Batch",
    "Decided",
    "JSONEvent",
    "RunView",
    "RunsBackend",
    "Verdict",
    "continued_event",
    "next_run",
    "no_cancel_error",
    "resumed_here",
]

#: One event of a run, as JSON.
JSONEvent: TypeAlias = dict[str, Any]
#: Events in order, each with its id; empty: nothing happened for a while (keep-alive).
Batch: TypeAlias = list[tuple[str, JSONEvent]]

#: A follower with nothing to read hears a comment this often, so proxies keep it open.
KEEPALIVE_SECONDS: Final = 15.0


def no_cancel_error(event: JSONEvent) -> JSONEvent:
    """``event`` without an ``error`` if it reports a cancel: a stop somebody asked for
    (its ``reason`` says who) is not an error, though the run ended by CancelledError."""
    if event.get("status") == "cancelled" and event.get("error") is not None:
        event = {**event, "error": None}
    return event


@dataclasses.dataclass
class RunView:
    """One run as a backend reports it (``GET /runs/{id}`` without its waiting calls)."""

    run_id: str
    session: str
    task: str | None
    """The message that started it, or None for a resume."""
    status: str = "pending"
    created_at: float = 0.0
    finished_at: float | None = None
    reason: str | None = None
    reply: str | None = None
    error: str | None = None
    usage: Usage | None = None
    events: int = 0
    messages_from: int = 0
    """How many messages the session held before this run added any."""
    asks_as: str | None = None
    """The run id its pauses are stored under when not its own (on Temporal: its
    workflow's)."""

    @property
    def live(self) -> bool:
        return self.status in LIVE

    def waits_on(self, pending: PendingApproval) -> bool:
        """True if this run paused on ``pending``, or no run did (it was asked again, in
        doubt, when its session was loaded); a call another run (or a run in another
        process, with no id) paused on is not this run's to decide."""
        if pending.run_id is None:
            return pending.in_doubt
        return pending.run_id == (self.asks_as or self.run_id)

    def public(self) -> dict[str, Any]:
        """The JSON body of ``GET /runs/{id}`` (``pending`` filled in by the service)."""
        finished = self.finished_at
        return {
            "run_id": self.run_id,
            "session": self.session,
            "task": self.task,
            "status": self.status,
            "reason": self.reason,
            "reply": self.reply,
            "error": None if self.status == "cancelled" else self.error,
            "usage": None if self.usage is None else dict(self.usage),
            "created_at": self.created_at,
            "finished_at": finished,
            "duration": None if finished is None else max(0.0, finished - self.created_at),
            "events": self.events,
            "pending": [],
        }


class Decided(NamedTuple):
    """What a decision left: the calls still waiting (as JSON), and the run the session
    went on with once none was left."""

    pending: list[dict[str, Any]]
    resumed_run_id: str | None


class Verdict(NamedTuple):
    """A person's decision on ``call_id``: ``approve`` or deny (``reason``), given for
    the pause ``pause_id`` (None: the one the run paused on, whatever its id); for an
    external tool's call, ``result`` is its result (``approve`` true)."""

    call_id: str
    approve: bool
    reason: str | None = None
    pause_id: str | None = None
    result: str | None = None


class RunsBackend(Protocol):
    """Where runs execute and how any of them is found, followed and stopped.

    Errors are :mod:`aimu.serve.errors`' (``NotFound`` for a run it does not know,
    ``Conflict`` for a session that is busy or a run that ended, ``ServiceUnavailable``
    when what it depends on is away) or aimu's own (``SessionLockedError``), answered by
    serve's one error table. Run ids reach it checked (:mod:`aimu.serve.ids`).
    """

    async def start(self, session: str, task: str | None, agent: Agent | None) -> RunView:
        """Start ``task`` on ``session`` (None: resume it); return the run once every
        process that may be asked about it can find it and it is durable (its record
        stored, or Temporal's workflow started): a server that dies after answering
        "started" loses no run. ``agent``: the session's agent, already open (a
        decision holds its lock), for the resume; None: open it."""
        ...

    async def view(self, run_id: str) -> RunView:
        """The run, wherever it executes; ``NotFound`` if unknown."""
        ...

    async def latest(
        self, sessions: Sequence[str], *, live: bool = False
    ) -> dict[str, RunView]:
        """The latest run of each session that has one, in time independent of how many
        runs are kept; ``live``: only those in progress are wanted (a backend may leave
        out the others without reading them)."""
        ...

    async def check_follow(self, run_id: str, after: str | None) -> None:
        """Raise now what following ``run_id`` after event id ``after`` would."""
        ...

    def follow(self, run_id: str, after: str | None) -> AsyncGenerator[Batch, None]:
        """The run's events after ``after`` in batches, then its ``handle_finished``;
        an empty batch after a quiet while; ends early when the server shuts down."""
        ...

    async def request(self, run_id: str, request: Steer) -> None:
        """Deliver ``request`` to the live run; ``Conflict`` if it ended or refused it. A
        send is durable when this returns (DESIGN invariant 6)."""
        ...

    async def decide(self, view: RunView, verdict: Verdict) -> Decided:
        """Record ``verdict`` on a call the paused run ``view`` waits on (``Conflict``,
        nothing decided, if the pause it names or the run's own no longer waits); after
        the last, resume its session as a new run. The backends that execute with the
        store's sessions use :class:`~aimu.serve.backends.decisions.StoreDecisions`."""
        ...

    def begin_shutdown(self) -> None:
        """End every follower's stream now (they reconnect elsewhere); runs go on."""
        ...

    async def drain(self, grace: float) -> None:
        """Interrupt the runs executing here, cancel those still going ``grace`` seconds
        later, and wait for them; each so stopped is marked to be recovered."""
        ...

    async def aclose(self) -> None:
        """Stop the runs executing here (their transcripts are kept) and wait for them."""
        ...


#: Run records read a page at a time (:func:`next_run`).
_RUNS_PAGE: Final = 1000
#: How the reason of a run whose process died ends once a recovering server resumed its
#: session: the next run of the session continues it (:func:`resumed_here`).
RESUMED: Final = "a recovering server resumed it"


def resumed_here(status: str, reason: str | None) -> bool:
    """True for the end of a run whose process died and whose session a recovering
    server resumed: the session's next run continues it. Recovery writes this end, under
    the session's lock, just before it starts that run (a server that dies between
    leaves the record marked, and the next recovering server starts it)."""
    return status == "failed" and (reason or "").startswith(DIED) and (
        reason or "").endswith(RESUMED)


async def next_run(store: Store, session: str, run_id: str) -> RunRecord | None:
    """The run ``session`` recorded after its run ``run_id`` (None: none yet, or no such
    run). For a run that ended :func:`resumed_here`, it is the run that continues it: a
    recovering server records that end and starts the next run under the session's lock."""
    newer: RunRecord | None = None
    before: str | None = None
    while True:  # the session's runs, newest first, until this one
        page = await store.runs(session=session, limit=_RUNS_PAGE, before=before)
        for stored in page:
            if stored.id == run_id:
                return newer
            newer = stored
        if len(page) < _RUNS_PAGE:
            return None
        before = page[-1].id


def continued_event(
    run_id: str, reason: str | None, continued_as: str, messages_from: int
) -> JSONEvent:
    """The event that tells a follower run ``run_id`` (ended for ``reason``) goes on as
    run ``continued_as``, whose messages begin at ``messages_from`` in the session."""
    return {
        "type": "run_continued", "run_id": run_id, "continued_as": continued_as,
        "reason": reason, "messages_from": messages_from,
    }
