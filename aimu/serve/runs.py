"""The runs a server offers: one service over a backend that executes and finds them.

:class:`Runs` is what the HTTP routes call. It checks the input, reads the calls a paused
run waits on from the store, records decisions and resumes a session once; where a run
executes and how it is found, followed and stopped is its :class:`RunsBackend`'s, one of
:mod:`aimu.serve.backends` (in this process, shared through Redis, or on Temporal
workers). The sessions, their transcripts and the approvals stay in the store, read
through :mod:`aimu.aio.approvals`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any, Final, NamedTuple, Protocol, TypeAlias

from aimu._hosting import AgentFactory
from aimu.aio._echo import echo
from aimu.aio._numbers import finite
from aimu.aio.agent import Agent
from aimu.aio.agent.tree import stored_pending
from aimu.aio.approvals import Approvals, PendingApproval
from aimu.aio.status import LIVE
from aimu.aio.steering import Steer
from aimu.aio.store import Store, validate_session_name
from aimu.aio.transcript import Usage
from aimu.serve.errors import BadRequest, Conflict, Draining
from aimu.serve.ids import check_run_id

__all__ = [
    "AgentFactory",
    "Batch",
    "Decided",
    "RunView",
    "Runs",
    "RunsBackend",
    "Verdict",
    "check_fits",
    "check_grace",
    "no_cancel_error",
    "open_agent",
    "validate_name",
]

#: Builds the agent for one run of ``session``, writing to that session in the store.
JSONEvent: TypeAlias = dict[str, Any]
#: Events in order, each with its id; empty: nothing happened for a while (keep-alive).
Batch: TypeAlias = list[tuple[str, JSONEvent]]

#: A follower with nothing to read hears a comment this often, so proxies keep it open.
KEEPALIVE_SECONDS: Final = 15.0
MAX_GRACE_SECONDS: Final = 3600.0


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


def check_grace(grace: float) -> float:
    if not finite(grace) or not 0 <= grace <= MAX_GRACE_SECONDS:
        raise BadRequest(
            f"grace must be seconds from 0 to {MAX_GRACE_SECONDS:g}, got {echo(grace)}"
        )
    return grace


def validate_name(session: str) -> str:
    """``session`` if valid, else ``BadRequest`` saying what a name may hold."""
    try:
        return validate_session_name(session)
    except ValueError as error:
        raise BadRequest(str(error)) from error


async def open_agent(agents: AgentFactory, session: str) -> Agent:
    """The agent of ``session``, its store session open (its write lock taken);
    ``SessionLockedError`` if a writer holds it."""
    agent = agents(session)
    try:
        await agent.open()
    except BaseException:
        await agent.aclose()
        raise
    return agent


def check_fits(
    given: str, call: Mapping[str, Any], approve: bool, result: str | None
) -> None:
    """``BadRequest`` if the decision does not fit the waiting call: an external (client
    side) tool's call takes its result or a denial, any other call a yes or a no."""
    if call.get("external") and approve and result is None:
        raise BadRequest(f"tool call {given!r} ({call['name']}) is a client-side tool's: "
                         "send its result, not an approval")
    if not call.get("external") and result is not None:
        raise BadRequest(f"tool call {given!r} ({call['name']}) waits for approval, not "
                         "for a result")


class Runs:
    """The runs API over ``backend``: checks, waiting calls, decisions, shutdown."""

    def __init__(self, backend: RunsBackend, store: Store, agents: AgentFactory) -> None:
        self.backend = backend
        self.store = store
        self._agents = agents
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise Draining(
                "the server is shutting down and starts no run: send the request to "
                "another server, or again once this one is back"
            )

    # -- starting --------------------------------------------------------------------

    async def start(
        self, session: str, task: str | None, prepare: Callable[[Agent], None] | None = None
    ) -> RunView:
        """Start ``task`` on ``session`` (None: resume where it stopped); ``Conflict`` for
        a resume of a session whose last run completed (nothing to resume). ``prepare``
        is given the session's agent, open, before the run: what it sets in the session's
        state (its external tools, its shared state) every backend's process finds
        (``ValueError`` from it: ``BadRequest``, nothing changed)."""
        self._check_open()
        validate_name(session)
        if task is None:
            info = await self.store.info(session)
            if info is not None and info.status == "completed":
                raise Conflict(
                    f"session {session!r} finished its last run (completed): nothing to "
                    f"resume; start a run with a task (POST /sessions/{session}/runs)"
                )
        if prepare is None:
            return await self.backend.start(session, task, None)
        agent = await open_agent(self._agents, session)
        try:
            waiting = agent.pending_approvals
            if waiting and task is not None:
                names = ", ".join(f"{p.call_id!r} ({p.tool})" for p in waiting)
                raise Conflict(
                    f"session {session!r}: calls wait for a decision: {names}; decide "
                    "each, or the run goes on"
                )
            try:
                prepare(agent)
            except ValueError as error:  # e.g. a tool named as one of the agent's
                raise BadRequest(str(error)) from None
        except BaseException:
            await agent.aclose()
            raise
        return await self.backend.start(session, task, agent)

    # -- reading ---------------------------------------------------------------------

    async def public(self, run_id: str) -> dict[str, Any]:
        """The JSON body of ``GET /runs/{id}``."""
        view = await self.backend.view(check_run_id(run_id))
        body = view.public()
        body["pending"] = await self._waiting(view)
        return body

    async def session_run(self, session: str) -> RunView | None:
        """The run in progress on ``session``, if any."""
        latest = (await self.backend.latest([session], live=True)).get(session)
        return latest if latest is not None and latest.live else None

    async def session_runs(self, sessions: Sequence[str]) -> dict[str, str]:
        """session -> the id of its run in progress, for those of ``sessions`` with one."""
        latest = await self.backend.latest(sessions, live=True)
        return {name: view.run_id for name, view in latest.items() if view.live}

    async def paused_on(self, session: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The session's last run if it paused, and the calls it still waits on."""
        latest = (await self.backend.latest([session])).get(session)
        if latest is None or latest.status != "paused":
            return None, []
        return latest.run_id, await self._waiting(latest)

    async def _waiting(self, view: RunView) -> list[dict[str, Any]]:
        """The calls the paused run still waits on, as the store's session state says."""
        if view.status != "paused" or await self._went_on(view) is not None:
            return []
        state = await self.store.load_state(view.session)
        try:
            approvals = Approvals.from_state(state, view.session)
        except ValueError:
            return []
        waiting = [*approvals.waiting(), *await stored_pending(self.store, view.session)]
        return [p.as_json() for p in waiting if view.waits_on(p)]

    async def _went_on(self, view: RunView) -> RunView | None:
        """The run the session went on with after ``view``, if any."""
        latest = (await self.backend.latest([view.session])).get(view.session)
        return None if latest is None or latest.run_id == view.run_id else latest

    async def check_follow(self, run_id: str, after: str | None) -> None:
        await self.backend.check_follow(check_run_id(run_id), after)

    def follow(self, run_id: str, after: str | None) -> AsyncGenerator[Batch, None]:
        return self.backend.follow(check_run_id(run_id), after)

    # -- control ---------------------------------------------------------------------

    async def _request(self, run_id: str, request: Steer) -> dict[str, Any]:
        await self.backend.request(check_run_id(run_id), request)
        return await self.public(run_id)

    async def cancel(self, run_id: str, reason: str | None) -> dict[str, Any]:
        return await self._request(run_id, Steer("cancel", reason=reason or "cancelled over HTTP"))

    async def interrupt(self, run_id: str) -> dict[str, Any]:
        return await self._request(run_id, Steer("interrupt"))

    async def stop(self, run_id: str, grace: float) -> dict[str, Any]:
        """Interrupt now and cancel after ``grace`` seconds, in the background."""
        return await self._request(run_id, Steer("stop", grace=check_grace(grace)))

    async def send(
        self, run_id: str, text: str, images: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """Give ``text`` (and ``images``, checked ``data:`` URLs) to the run: they join as
        a user message at its next step boundary. Answered once kept in the session's
        store (the local and Redis backends, ``steering.send_kept``) or in Temporal's
        history (a signal): a server that dies before that boundary loses none of it."""
        return await self._request(run_id, Steer("send", text=text, images=images))

    # -- decisions -------------------------------------------------------------------

    async def decide(
        self, run_id: str, call_id: str, approve: bool, reason: str | None,
        pause_id: str | None = None, result: str | None = None,
    ) -> dict[str, Any]:
        """Record a decision on a call the paused run waits on, bound to the pause
        ``pause_id`` when given (the one the person was shown); after the last one the
        session resumes, once, as a new run (``resumed_run_id``)."""
        self._check_open()
        view = await self.backend.view(check_run_id(run_id))
        if view.status != "paused":
            raise Conflict(
                f"run {run_id} is {view.status}, not paused: no tool call awaits a decision"
            )
        waiting = {call["call_id"]: call for call in await self._waiting(view)}
        if call_id in waiting:  # else the backend says why it waits on no such call
            check_fits(call_id, waiting[call_id], approve, result)
        decided = await self.backend.decide(
            view, Verdict(call_id, approve, reason, pause_id, result)
        )
        return {
            "run_id": run_id,
            "call_id": call_id,
            "approve": approve,
            "pending": decided.pending,
            "resumed_run_id": decided.resumed_run_id,
        }

    # -- shutting down ---------------------------------------------------------------

    def begin_shutdown(self) -> None:
        """End every follower's stream now (they reconnect elsewhere); runs go on."""
        self.backend.begin_shutdown()

    @property
    def agents(self) -> AgentFactory:
        """How the agent of a session's run is built."""
        return self._agents

    @property
    def draining(self) -> bool:
        """True once the server refuses new runs (it drains or closes)."""
        return self._closed

    async def drain(self, grace: float) -> None:
        """Refuse new runs (503), interrupt those executing here at their next step
        boundary, cancel what is left after ``grace`` seconds and wait; the runs so
        stopped are marked in their records to be recovered (``--recover``)."""
        self._closed = True
        await self.backend.drain(grace)

    async def aclose(self) -> None:
        """Refuse new runs, stop the runs executing here and wait for them."""
        self._closed = True
        await self.backend.aclose()
