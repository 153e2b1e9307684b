"""A turn retried in the worker that still runs its earlier attempt (Temporal timed the
attempt out: its heartbeats came late, as with a thousand runs on one worker) takes
the run over: the earlier attempt is cancelled and lets the session go, and the retry
does not fail ``AimuLocked`` meanwhile."""

from __future__ import annotations

import asyncio
import threading

from temporalio import activity
from temporalio.client import Client

from aimu import aio
from aimu.aio.store import SQLiteStore
from aimu.temporal import RunsClient
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from tests.temporal.conftest import Workers
from tests.temporal.test_runs import restorable


async def retried(client: Client, run_id: str, state: int) -> None:
    """Wait until the turn's second attempt is ``state`` in Temporal (1: scheduled, its
    first timed out; 2: started, a worker took it)."""
    handle = client.get_workflow_handle(run_id)
    async with asyncio.timeout(60):
        while True:
            described = await handle.describe()
            if any(p.attempt >= 2 and p.state >= state
                   for p in described.raw_description.pending_activities):
                return
            await asyncio.sleep(0.05)


def block_until_retried(temporal: str, run_id: str) -> None:
    """Block this thread (the worker's event loop: no heartbeat goes out) until
    Temporal has timed the turn's first attempt out and scheduled a second."""
    failed: list[BaseException] = []

    async def poll() -> None:
        await retried(await Client.connect(temporal), run_id, 1)

    def run() -> None:
        try:
            asyncio.run(poll())
        except BaseException as error:  # said below, in the test
            failed.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not failed, failed


async def test_a_retry_takes_the_turn_over_from_its_late_attempt_in_this_worker(
    temporal: str, runs: RunsClient, workers: Workers, store: SQLiteStore,
    model_server: LoopbackServer,
) -> None:
    model_server.script = [Turn(tool_calls=(ScriptedCall("hold", {}),)), Turn("done")]
    attempts: list[int] = []
    cancelled: list[int] = []

    async def hold() -> str:
        """Hold on (the first attempt: until it is cancelled)."""
        attempt = activity.info().attempt
        attempts.append(attempt)
        if attempt == 1:
            block_until_retried(temporal, activity.info().workflow_id or "")
            try:
                await asyncio.Event().wait()  # the late attempt holds its session on
            except asyncio.CancelledError:
                cancelled.append(attempt)
                # ... until the retry is on this worker (without a take-over, it would
                # find the session locked now and fail).
                await retried(runs.client, activity.info().workflow_id or "", 2)
                raise
        return "held"

    await workers.start(tools=[aio.tool(hold, idempotent=True)])
    run_id = await runs.start("s1", "hold on")
    state = await runs.wait(run_id, timeout=90)
    assert (state["status"], state["reply"]) == ("completed", "done")
    assert attempts == cancelled == [1]  # the retry found its call answered "cancelled"
    history = await runs.client.get_workflow_handle(run_id).fetch_history()
    started = [e.activity_task_started_event_attributes for e in history.events
               if e.HasField("activity_task_started_event_attributes")]
    assert started[-1].attempt == 2, started  # no attempt failed on the session's lock
    messages = await restorable(store, "s1")
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
