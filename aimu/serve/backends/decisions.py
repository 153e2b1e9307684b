"""Decisions on paused runs recorded in the shared store, for the backends whose runs
open the store's sessions (:class:`~aimu.serve.backends.local.LocalBackend`,
:class:`~aimu.serve.backends.redis.RedisBackend`).

Each decision is recorded in the session's state under its write lock: of two processes
given the last two decisions at once, one records its decision and releases the lock,
the other then finds every call decided and resumes the run, once. A decision holds
only for the pause it was shown for, checked against the stored state under that lock:
once the session went on, was deleted, or paused again in another run (here or in any
process sharing the store, even on a call of the same id), it changes nothing and says
which.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final, Protocol

from aimu._hosting import AgentFactory, open_agent
from aimu.aio.agent import Agent
from aimu.aio.approvals import Approvals
from aimu.aio.errors import SessionLockedError
from aimu.aio.store import Store
from aimu.serve.backends.base import Decided, RunView, Verdict
from aimu.serve.errors import BadRequest, Conflict, NotFound

__all__ = ["DECISION_WAIT_SECONDS", "StoreDecisions"]

#: How long a decision waits for the session's lock while another decision holds it.
DECISION_WAIT_SECONDS: Final = 10.0
_FIRST_RETRY: Final = 0.005
_log = logging.getLogger("aimu.serve")


class _Starts(Protocol):
    """What the decisions need of their backend: the latest runs, and a start."""

    async def latest(self, sessions: list[str]) -> dict[str, RunView]: ...

    async def start(self, session: str, task: str | None, agent: Agent | None) -> RunView: ...


class StoreDecisions:
    """Records decisions in ``store`` and resumes sessions through ``backend``."""

    def __init__(self, store: Store, agents: AgentFactory, backend: _Starts) -> None:
        self._store = store
        self._agents = agents
        self._backend = backend

    async def decide(self, view: RunView, verdict: Verdict) -> Decided:
        agent = await self._open(view, verdict.call_id)
        try:
            await self._apply(agent, view, verdict)
            waiting = agent.pending_approvals
        except BaseException:
            await agent.aclose()
            raise
        if waiting:
            await agent.aclose()  # saves the decision in the session's state
            return Decided([p.as_json() for p in waiting], None)
        resumed = await self._backend.start(view.session, None, agent)
        return Decided([], resumed.run_id)

    async def _open(self, view: RunView, call_id: str) -> Agent:
        """The paused session's agent, open; waits while another decision holds the
        session's lock, ``Conflict`` once the session went on (the calls were decided)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DECISION_WAIT_SECONDS
        delay = _FIRST_RETRY
        while True:
            later = (await self._backend.latest([view.session])).get(view.session)
            if later is not None and later.run_id != view.run_id:
                if later.task is None:
                    raise Conflict(
                        f"tool call {call_id[:64]!r} of run {view.run_id} is decided already: "
                        f"the session went on with run {later.run_id}"
                    )
                raise Conflict(
                    f"run {view.run_id} no longer waits on tool call {call_id[:64]!r}: "
                    f"session {view.session!r} went on with a new run ({later.run_id})"
                )
            if await self._store.info(view.session) is None:
                raise NotFound(
                    f"session {view.session!r} was deleted: run {view.run_id} waits on "
                    "nothing any more"
                )
            try:
                return await open_agent(self._agents, view.session)
            except SessionLockedError as error:
                if loop.time() >= deadline:
                    _log.info("decision on session %r: %s", view.session, error)
                    raise Conflict(
                        f"session {view.session!r} stayed locked for "
                        f"{DECISION_WAIT_SECONDS:g} s: try again"
                    ) from None
            if delay == _FIRST_RETRY:
                _log.debug(
                    "decision on call %r of session %r waits for the session's lock",
                    call_id[:64], view.session,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def _apply(self, agent: Agent, view: RunView, verdict: Verdict) -> None:
        """Decide on the open ``agent`` (its state just loaded, its lock held): the call
        must wait for this run, as the pause ``verdict`` names if it names one;
        NotFound / Conflict change nothing."""
        call_id = verdict.call_id
        shown = {p.call_id: p for p in agent.pending_approvals}
        pending = shown.get(call_id)
        if pending is None:
            state = await self._store.load_state(view.session)
            if call_id in Approvals.from_state(state, view.session).decisions or not shown:
                raise Conflict(
                    f"tool call {call_id[:64]!r} of run {view.run_id} is decided already "
                    f"(if the session did not go on: POST /sessions/{view.session}/resume)"
                )
            raise NotFound(f"run {view.run_id} waits on no tool call {call_id[:64]!r}")
        if not view.waits_on(pending):
            where = "in another process" if pending.run_id is None else pending.run_id
            raise Conflict(
                f"tool call {call_id[:64]!r} of run {view.run_id} no longer waits: the "
                f"session paused again since ({where}, on {pending.tool}); nothing was "
                "decided, look at the session again"
            )
        if verdict.pause_id is not None and verdict.pause_id != pending.pause_id:
            raise Conflict(
                f"tool call {call_id[:64]!r} of run {view.run_id} was asked again since "
                f"the pause shown ({verdict.pause_id[:64]!r}); nothing was decided, look "
                "at the waiting calls again"
            )
        try:
            if verdict.result is not None:
                agent.answer(call_id, verdict.result)
            elif verdict.approve:
                agent.approve(call_id)
            else:
                agent.deny(call_id, verdict.reason)
        except ValueError as error:  # a result for an approval, a yes for an external call
            raise BadRequest(str(error)) from None
