"""A worker that stops drains (issue 34 item 3): it takes no new task, interrupts its
runs at their next step boundary, cancels what is left when its time is up or at a
second signal, and each run goes on on another worker from where it stopped, its
drained end unseen by followers and its record marked to be recovered meanwhile."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.store import SQLiteStore
from aimu.temporal import RunsClient
from aimu.temporal._command import _work, add_worker_options
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from tests.temporal.conftest import Workers
from tests.temporal.test_runs import restorable

SCRIPT = [Turn("step 1 ", tool_calls=(ScriptedCall("step", {"n": 1}),)),
          Turn("step 2 ", tool_calls=(ScriptedCall("step", {"n": 2}),)),
          Turn("done")]


class Step:
    """The ``step`` tool: step 1 says it runs, then waits for the run's interrupt (the
    drain's) and returns, or (``stubborn``) goes on until it is cancelled."""

    def __init__(self, *, stubborn: bool = False) -> None:
        self.calls: list[int] = []
        self.running = asyncio.Event()
        self.interrupted = asyncio.Event()
        self.cancelled = False

        async def step(ctx: aio.ToolContext, n: int) -> str:
            """Do step n."""
            self.calls.append(n)
            if n == 1:
                self.running.set()
                while not ctx.interrupt_requested:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
                self.interrupted.set()
                if stubborn:
                    try:
                        await asyncio.Event().wait()
                    except asyncio.CancelledError:
                        self.cancelled = True
                        raise
            return f"did {n}"

        self.tool = aio.tool(step)


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


async def test_a_drained_worker_stops_its_run_at_the_step_boundary_and_another_goes_on(
    runs: RunsClient, workers: Workers, store: SQLiteStore, model_server: LoopbackServer
) -> None:
    model_server.script = list(SCRIPT)
    step = Step()
    draining = await workers.start(tools=[step.tool], drain=600)
    run_id = await runs.start("s1", "do the steps")
    await asyncio.wait_for(step.running.wait(), 60)
    await workers.stop(draining)  # returns once the run stopped at its step boundary
    assert step.interrupted.is_set()  # the drain's interrupt, not its 600 s, ended it
    record = await store.run(run_id)
    assert record is not None and (record.status, record.recover) == ("interrupted", True)
    await workers.start(tools=[step.tool])
    state = await runs.wait(run_id, timeout=60)
    assert (state["status"], state["reply"]) == ("completed", "done")
    assert step.calls == [1, 2]  # each step once
    assert len(model_server.requests) == 3  # no model turn asked twice
    messages = await restorable(store, "s1")
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["did 1", "did 2"]
    record = await store.run(run_id)
    assert record is not None and (record.status, record.recover) == ("completed", False)
    events = [event async for _, event in runs.events(run_id)]
    assert kinds(events).count("run_started") == kinds(events).count("run_finished") == 1
    assert events[-1]["status"] == "completed"


async def test_sigterm_drains_aimu_worker_and_a_second_one_cancels_at_once(
    temporal: str, queue: str, runs: RunsClient, workers: Workers, store: SQLiteStore,
    model_server: LoopbackServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", model_server.openai_base_url)
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")
    model_server.script = list(SCRIPT)
    step = Step(stubborn=True)
    parser = argparse.ArgumentParser()
    add_worker_options(parser)
    options = parser.parse_args([
        "--temporal", temporal, "--task-queue", queue, "--store", str(tmp_path / "sessions.db"),
        "--model", "openai:test", "--heartbeat", "0.1", "--drain", "600",
    ])
    command = asyncio.create_task(_work(options, [step.tool]))
    run_id = await runs.start("s1", "do the steps")
    await asyncio.wait_for(step.running.wait(), 60)
    os.kill(os.getpid(), signal.SIGTERM)  # drain: the run is asked to stop at its boundary
    await asyncio.wait_for(step.interrupted.wait(), 60)
    assert not command.done()  # the tool goes on: the drain waits for it
    os.kill(os.getpid(), signal.SIGTERM)  # the second: cancelled at once
    assert await asyncio.wait_for(command, 60) == 0
    assert step.cancelled
    record = await store.run(run_id)
    assert record is not None and (record.status, record.recover) == ("cancelled", True)
    await workers.start(tools=[step.tool])  # another worker goes on with the run
    state = await runs.wait(run_id, timeout=60)
    assert (state["status"], state["reply"]) == ("completed", "done")
    messages = await restorable(store, "s1")
    assert [m["role"] for m in messages].count("user") == 1
    events = [event async for _, event in runs.events(run_id)]
    assert kinds(events).count("run_started") == kinds(events).count("run_finished") == 1
