"""Runs executing in this process, found and controlled from it (``aimu serve``):
:class:`LocalBackend` launches runs (:mod:`.launcher`), keeps their numbered events
(:mod:`.run_log`) and records decisions in the store (:mod:`.decisions`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

from aimu.aio._event_tap import EventTap
from aimu.aio._ids import new_run_id
from aimu.aio.agent import Agent
from aimu.aio.ends import error_text
from aimu.aio.event_json import event_data
from aimu.aio.events import Event, HandleFinished, RunFinished
from aimu.aio.run_handle import RunHandle
from aimu.aio.steering import LocalRuns, Steer, Steering, send_kept
from aimu.aio.store import Store
from aimu.serve.backends.decisions import StoreDecisions
from aimu.serve.backends.launcher import Launcher
from aimu.serve.backends.run_log import RunLog, RunRecord
from aimu.serve.errors import Conflict
from aimu.serve.runs import (
    AgentFactory,
    Decided,
    RunView,
    Verdict,
    no_cancel_error,
)

__all__ = ["LocalBackend"]



class LocalBackend(RunLog):
    """Runs executing in this process, found and controlled from this process only."""

    def __init__(self, agents: AgentFactory, store: Store, *, keep_finished: int = 1000) -> None:
        super().__init__(keep_finished=keep_finished)
        self._store = store
        self._launcher = Launcher(agents, store)
        self._runs_here = LocalRuns(self._launcher.spawn)
        self._steering: Steering = self._runs_here
        self._decisions = StoreDecisions(store, agents, self)

    async def start(self, session: str, task: str | None, agent: Agent | None) -> RunView:
        try:
            self.check_free(session)
        except Conflict:
            if agent is not None:
                await agent.aclose()
            raise
        view = RunView(new_run_id(), session, task, created_at=time.time())

        def start(run: Coroutine[Any, Any, str], messages_from: int) -> RunHandle[str]:
            view.messages_from = messages_from
            return RunHandle.start(run, name=f"run {view.run_id}", run_id=view.run_id)

        handle = await self._launcher.launch(session, task, agent, start)
        record = self.add(view)
        record.handle = handle
        self._runs_here.add(handle)
        view.status = handle.status
        tap = handle.tap(notify=lambda: self._log(record, handle, tap))
        await self._launcher.accepted(handle)
        return view

    def _log(self, record: RunRecord, handle: RunHandle[str], tap: EventTap) -> None:
        """Add what the run's tap holds to its log; its end after the handle's done
        callbacks (the launcher's release of the session among them)."""
        for event in tap.take():
            if isinstance(event, HandleFinished):
                asyncio.get_running_loop().call_soon(self._finished, record, handle)
            else:
                self._on_event(record, event)

    def _on_event(self, record: RunRecord, event: Event) -> None:
        view = record.view
        if view.status == "pending":
            view.status = "running"
        if isinstance(event, RunFinished):
            view.reply, view.error = event.reply, event.error
            view.usage = dict(event.usage)  # type: ignore[assignment]
        record.add(no_cancel_error(event_data(event)))

    def _finished(self, record: RunRecord, handle: RunHandle[str]) -> None:
        error = None
        if record.view.error is None and handle.status == "failed":
            failure = handle.exception()
            error = None if failure is None else error_text(failure)
        record.end(handle.status, handle.reason, error)

    async def request(self, run_id: str, request: Steer) -> None:
        record = self.record(run_id)
        kind = request.kind
        what = "send to" if kind == "send" else kind
        if record.ended or record.handle is None:
            raise Conflict(
                f"run {run_id} already ended ({record.view.status}): nothing to {what}"
            )
        if kind == "send":  # in the store before it is answered (DESIGN invariant 6)
            taken = await send_kept(self._store, record.view.session, request,
                                    lambda kept: self._steering.request(run_id, kept))
        else:
            taken = await self._steering.request(run_id, request)
        if not taken and kind == "interrupt":
            raise Conflict(f"run {run_id} is being cancelled already: nothing to interrupt")
        if not taken and kind == "send":
            raise Conflict(
                f"run {run_id} is ending (being cancelled): the text was not sent; "
                "start a new run with it"
            )

    async def decide(self, view: RunView, verdict: Verdict) -> Decided:
        return await self._decisions.decide(view, verdict)

    async def drain(self, grace: float) -> None:
        await self._launcher.drain(grace)

    async def aclose(self) -> None:
        self.begin_shutdown()
        await self._launcher.aclose()

