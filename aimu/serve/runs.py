"""The runs a server offers: one service over a backend that executes and finds them.

:class:`Runs` is what the HTTP routes call. It checks the input, reads the calls a paused
run waits on from the store, records decisions and resumes a session once; where a run
executes and how it is found, followed and stopped is its :class:`RunsBackend`'s, one of
:mod:`aimu.serve.backends` (in this process, shared through Redis, or on Temporal
workers). The sessions, their transcripts and the approvals stay in the store, read
through :mod:`aimu.aio.approvals`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any, Final

from aimu._hosting import AgentFactory, open_agent
from aimu.aio._echo import echo
from aimu.aio._numbers import finite
from aimu.aio.agent import Agent
from aimu.aio.agent.tree import stored_pending
from aimu.aio.approvals import Approvals
from aimu.aio.steering import Steer
from aimu.aio.store import Store, validate_session_name
from aimu.serve.backends.base import (
    KEEPALIVE_SECONDS,
    Batch,
    Decided,
    JSONEvent,
    RunsBackend,
    RunView,
    Verdict,
    no_cancel_error,
)
from aimu.serve.errors import BadRequest, Conflict, Draining, ServeError
from aimu.serve.ids import check_run_id

__all__ = [
    "KEEPALIVE_SECONDS",
    "AgentFactory",
    "Batch",
    "Decided",
    "JSONEvent",
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

MAX_GRACE_SECONDS: Final = 3600.0


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

    async def cancel_many(self, run_ids: Sequence[str], reason: str | None) -> dict[str, Any]:
        """Cancel each of ``run_ids`` now, all at once (each keeps its partial reply): the
        runs the cancel was accepted for, as it found them, and those refused with the
        error a cancel of that run alone answers (unknown, ended, ...). The ids were
        checked first (the body's model): a bad one refuses the whole request."""
        request = Steer("cancel", reason=reason or "cancelled over HTTP")

        runs: list[dict[str, Any]] = []
        refused: list[dict[str, Any]] = []

        async def one(run_id: str) -> None:
            try:
                runs.append(await self._request(run_id, request))
            except ServeError as error:
                refused.append({"run_id": run_id, "error": str(error), "status": error.status})

        async with asyncio.TaskGroup() as group:
            for run_id in run_ids:
                group.create_task(one(run_id))
        order = {run_id: i for i, run_id in enumerate(run_ids)}  # the request's order
        runs.sort(key=lambda run: order[run["run_id"]])
        refused.sort(key=lambda run: order[run["run_id"]])
        return {"runs": runs, "refused": refused}

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
