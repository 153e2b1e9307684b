"""``aimu worker --drain S`` bounds the exit (issue 42 item 7), as ``aimu serve``'s does
(tests/serve/test_drain_bound.py): a sync tool blocking 60 s in a worker thread cannot
hold the worker process past its drain; the run is cancelled and recorded, marked to be
recovered, and the process exits 0. A real process and a real SIGTERM; the time is
asserted only as a hang guard (15 s, far above S=2, far below the tool's 60 s)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

from aimu.aio.store import SQLiteStore
from aimu.temporal import RunsClient
from aimu.testing.server import LoopbackServer
from tests.serve import recover_tools
from tests.serve.harness import ROOT, clean_env
from tests.serve.test_drain_recover import ran, said, until

HANG_GUARD = 15


async def test_a_sync_tool_blocking_in_a_thread_cannot_hold_the_worker_exit(
    temporal: str, queue: str, runs: RunsClient, tmp_path: Path
) -> None:
    held = tmp_path / "held"
    held.mkdir()
    store_path = tmp_path / "sessions.db"
    log_path = tmp_path / "worker.log"
    async with LoopbackServer(recover_tools.script) as model:
        env = clean_env(OPENAI_BASE_URL=model.openai_base_url, OPENAI_API_KEY="sk-test",
                        AIMU_TEST_HELD=str(held))
        with log_path.open("wb") as log:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "aimu", "worker", "--temporal", temporal,
                "--task-queue", queue, "--store", str(store_path), "--model", "openai:loop",
                "--tool", "tests.serve.recover_tools:blocking", "--heartbeat", "0.1",
                "--drain", "2", cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=log,
            )
        try:
            run_id = await runs.start("w1", "block a")
            await until("the tool blocks in its thread", (held / "entered-a").exists)
            process.send_signal(signal.SIGTERM)
            await until("the drain begins", lambda: said(log_path, "aimu worker: draining"))
            code = await asyncio.wait_for(process.wait(), HANG_GUARD)
        finally:
            (held / "open").touch()  # a process that hung lets its thread go
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert code == 0, log_path.read_text()
    assert said(log_path, "exiting with a tool's thread still running")
    store = SQLiteStore(store_path)
    try:
        record = await store.run(run_id)
    finally:
        await store.aclose()
    assert record is not None and (record.status, record.recover) == ("cancelled", True)
    assert ran(held) == []  # the thread never finished: the process left it behind
