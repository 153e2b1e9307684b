"""``aimu runs cancel|resume RUN_ID --temporal HOST:PORT``: a terminal cancels a run a
Temporal worker runs, mid-stream (its stored record says cancelled, under the run id the
client was given), then resumes its session as a new run, recorded beside it."""

from __future__ import annotations

import asyncio

import pytest

from aimu.aio.store import SQLiteStore
from aimu.cli import main
from aimu.temporal import RunsClient
from aimu.testing.script import Turn
from aimu.testing.server import LoopbackServer
from tests.temporal.conftest import Workers

#: A reply that outlasts every wait of the test (200 s): the cancel never races its end.
HELD = Turn("one two three four five six seven eight nine ten " * 20, delay=1.0)


async def test_a_terminal_cancels_a_temporal_run(
    temporal: str, queue: str, runs: RunsClient, workers: Workers, store: SQLiteStore,
    model_server: LoopbackServer, capsys: pytest.CaptureFixture[str],
) -> None:
    model_server.script = [HELD, Turn("resumed")]
    await workers.start()
    run_id = await runs.start("s1", "talk")
    async for _, event in runs.events(run_id):
        if event["type"] == "text":
            break  # provably mid-stream
    cancel = ["runs", "cancel", "--temporal", temporal, "--task-queue", queue]
    assert await asyncio.to_thread(main, [*cancel, run_id, "--reason", "from a shell"]) == 0
    assert capsys.readouterr().out == f"run {run_id} cancelled\n"
    state = await runs.wait(run_id, timeout=60)
    assert (state["status"], state["reason"]) == ("cancelled", "from a shell")
    assert await asyncio.to_thread(main, [*cancel, run_id]) == 1
    assert "had already ended" in capsys.readouterr().err
    (record,) = await store.runs(session="s1")
    assert record.id == run_id and record.status == "cancelled"
    # The caller's reason reaches the activity's run too (read from the workflow).
    assert record.reason == "from a shell"

    resume = ["runs", "resume", "--temporal", temporal, "--task-queue", queue, run_id]
    assert await asyncio.to_thread(main, resume) == 0
    resumed = capsys.readouterr().out.strip()
    assert (await runs.wait(resumed, timeout=60))["status"] == "completed"
    assert [(r.id, r.status) for r in await store.runs(session="s1")] == [
        (resumed, "completed"), (run_id, "cancelled"),
    ]
