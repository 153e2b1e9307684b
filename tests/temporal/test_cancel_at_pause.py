"""A cancel that reaches a turn as it ends paused (it comes as the turn lets its session
go: the turn lets it go all the same and returns its pause) still ends the run:
cancelled, with the pause it ended in recorded so, not waiting for decisions forever."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.store import SQLiteStore
from aimu.temporal import RunsClient
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from tests.temporal.conftest import Workers
from tests.temporal.test_runs import PAY, approval_tool, paused, restorable


class HeldStore(SQLiteStore):
    """A store whose first session writer, as it is closed, waits for ``hold()``."""

    hold: Callable[[], Awaitable[None]] | None = None

    async def open_session(self, session: str) -> Any:
        writer = await super().open_session(session)
        hold, self.hold = self.hold, None
        if hold is not None:
            close = writer.aclose

            async def aclose() -> None:
                await hold()
                await close()

            writer.aclose = aclose
        return writer


async def cancel_requested(runs: RunsClient, run_id: str) -> None:
    """Wait until the workflow has asked Temporal to cancel its turn's activity."""
    handle = runs.client.get_workflow_handle(run_id)
    async with asyncio.timeout(60):
        while not any(  # noqa: ASYNC110 - the history, read again
                e.HasField("activity_task_cancel_requested_event_attributes")
                      for e in (await handle.fetch_history()).events):
            await asyncio.sleep(0.05)


async def test_a_cancel_as_the_turn_pauses_ends_the_run_cancelled(
    temporal: str, queue: str, runs: RunsClient, model_server: LoopbackServer,
    tmp_path: Path,
) -> None:
    store = HeldStore(tmp_path / "sessions.db")
    closing, go = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        closing.set()
        await go.wait()

    store.hold = hold
    workers = Workers(temporal, queue, store, model_server)
    transfer, done = approval_tool()
    model_server.script = [PAY, Turn("done")]
    try:
        await workers.start(tools=[transfer])
        run_id = await runs.start("s1", "pay")
        await asyncio.wait_for(closing.wait(), 60)  # paused; the turn lets its session go
        assert await runs.cancel(run_id, "the user pressed Stop")
        await cancel_requested(runs, run_id)
        go.set()  # the turn returns its pause: the workflow's cancel went to it
        state = await runs.wait(run_id, timeout=30)
        assert (state["status"], state["reason"]) == ("cancelled", "the user pressed Stop")
        info = await store.info("s1")
        assert info is not None and info.status == "cancelled"
        record = await store.run(run_id)
        assert record is not None and (record.status, record.reason) == (
            "cancelled", "the user pressed Stop")
        assert done == []
    finally:
        go.set()
        await workers.aclose()
        await store.aclose()


@pytest.mark.parametrize("sandboxed", [True, False], ids=["sandboxed", "no sandbox"])
@pytest.mark.parametrize(("kind", "ends"), [("stop", "cancelled"), ("interrupt", "interrupted")])
async def test_a_stop_or_interrupt_while_the_run_waits_reaches_the_resumed_turn(
    kind: str, ends: str, sandboxed: bool, temporal: str, queue: str, runs: RunsClient,
    workers: Workers, store: SQLiteStore, model_server: LoopbackServer,
) -> None:
    """Accepted means acted on: a stop or interrupt recorded while the run waits for its
    decisions (no turn runs to take it; on a busy host, one that left the client before
    the run paused lands here too) is taken by the turn the decisions resume, which
    stops: the run ends stopped, not completed. (One the running turn took before the
    run paused is done with: the run stopped, at its pause.)"""
    transfer, _ = approval_tool()
    looked: list[str] = []

    @aio.tool
    def look() -> str:
        """Look around."""
        looked.append("look")
        return "nothing"

    # After the decided call, a step with a tool call: an interrupt ends the run at its
    # boundary (with no next step, a run that answers completes, interrupted or not).
    model_server.script = [PAY, Turn("", tool_calls=(ScriptedCall("look", {}),)), Turn("done")]
    await workers.start(tools=[transfer, look], sandboxed=sandboxed)
    run_id = await runs.start("s1", "pay")
    state = await paused(runs, run_id)
    if kind == "stop":
        assert await runs.request_stop(run_id, grace=0)
    else:
        assert await runs.interrupt(run_id)
    pending = state["pending"]
    assert isinstance(pending, list) and len(pending) == 1, state
    await runs.approve(run_id, pending[0]["call_id"], pause_id=pending[0]["pause_id"])
    state = await runs.wait(run_id, timeout=60)
    assert state["status"] == ends, state
    assert len(model_server.requests) <= 2, "no model turn after the stop"
    record = await store.run(run_id)
    assert record is not None and record.status == ends, record
    info = await store.info("s1")
    assert info is not None and info.status == ends, info
    await restorable(store, "s1")
