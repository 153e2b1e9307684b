"""A turn heartbeats whatever its reads of the controls wait for: with no worker to
answer the workflow's queries (or one too busy to), the read hangs, and the turn must
not look dead to Temporal (it would be timed out and retried, its model asked again)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.worker import Worker

from aimu import aio
from aimu.aio.store import SQLiteStore
from aimu.serve.agents import agent_factory
from aimu.temporal import RunsClient
from aimu.temporal._activities import Activities
from aimu.temporal._worker import _RUNNER
from aimu.temporal._workflow import RunWorkflow
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from tests.temporal.conftest import HEARTBEAT_TIMEOUT, Workers


async def beats_past_the_timeout(runs: RunsClient, run_id: str) -> None:
    """Wait until the turn's heartbeats have gone on past the heartbeat timeout from
    now, on its first attempt (AssertionError once Temporal timed it out)."""
    handle = runs.client.get_workflow_handle(run_id)
    first = None
    async with asyncio.timeout(60):
        while True:
            [turn] = (await handle.describe()).raw_description.pending_activities
            assert turn.attempt == 1, turn
            if turn.HasField("last_heartbeat_time"):
                beat = turn.last_heartbeat_time.ToDatetime().timestamp()
                first = first or beat
                if beat - first > HEARTBEAT_TIMEOUT + 1:
                    return
            await asyncio.sleep(0.1)


class SlowToOpen(SQLiteStore):
    """A store whose sessions open only once ``gate`` is set (``opening`` says it waits)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.opening, self.gate = asyncio.Event(), asyncio.Event()

    async def open_session(self, session: str) -> Any:
        self.opening.set()
        await self.gate.wait()
        return await super().open_session(session)


async def test_a_turn_heartbeats_while_its_session_is_slow_to_open(
    temporal: str, queue: str, runs: RunsClient, model_server: LoopbackServer, tmp_path: Path,
) -> None:
    store = SlowToOpen(tmp_path / "sessions.db")
    workers = Workers(temporal, queue, store, model_server)
    try:
        await workers.start()
        run_id = await runs.start("s1", "hello")
        await asyncio.wait_for(store.opening.wait(), 60)  # the turn waits for its session
        await beats_past_the_timeout(runs, run_id)
        store.gate.set()
        state = await runs.wait(run_id, timeout=60)
        assert state["status"] == "completed"
        assert len(model_server.requests) == 1  # no retried turn asked the model again
    finally:
        store.gate.set()
        await workers.aclose()
        await store.aclose()


async def test_a_turn_heartbeats_while_its_controls_go_unanswered(
    temporal: str, queue: str, runs: RunsClient, store: SQLiteStore,
    model_server: LoopbackServer,
) -> None:
    running, go = asyncio.Event(), asyncio.Event()

    async def hold() -> str:
        """Hold on."""
        running.set()
        await go.wait()
        return "held"

    model_server.script = [Turn(tool_calls=(ScriptedCall("hold", {}),)), Turn("done")]
    agents, close = agent_factory(aio.client("ollama:test", host=model_server.url), store,
                                  tools=[aio.tool(hold)])
    client = await Client.connect(temporal)
    tick = timedelta(seconds=0.1)
    activities = Activities(agents, store, tick=0.1)
    turns = Worker(client, task_queue=queue, activities=[activities.turn],
                   max_heartbeat_throttle_interval=tick, default_heartbeat_throttle_interval=tick)

    other = await Client.connect(temporal)  # one client's workers may not overlap

    def workflow_worker() -> Worker:  # and the local activities, which run beside it
        return Worker(other, task_queue=queue, workflows=[RunWorkflow], workflow_runner=_RUNNER,
                      activities=[activities.begin, activities.end_paused],
                      no_remote_activities=True)

    workflows = workflow_worker()
    running_turns = asyncio.ensure_future(turns.run())
    running_workflows = asyncio.ensure_future(workflows.run())
    try:
        run_id = await runs.start("s1", "hold on")
        await asyncio.wait_for(running.wait(), 60)
        await workflows.shutdown()  # nobody answers the turn's reads of its controls now
        await running_workflows
        await beats_past_the_timeout(runs, run_id)
        go.set()
        workflows = workflow_worker()
        running_workflows = asyncio.ensure_future(workflows.run())
        state = await runs.wait(run_id, timeout=60)
        assert (state["status"], state["reply"]) == ("completed", "done")
        assert len(model_server.requests) == 2  # no turn asked the model again
    finally:
        go.set()
        for worker, task in ((workflows, running_workflows), (turns, running_turns)):
            if not task.done():
                await worker.shutdown()
            await task
        await close()
