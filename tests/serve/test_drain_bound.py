"""``--drain S`` bounds the exit (issue 42 item 7): a sync tool blocking in a worker
thread (60 s, never looking at its cancel) cannot hold ``aimu serve`` past its drain.
After S seconds the run is cancelled, recorded and marked to be recovered, and the
process exits 0 whatever threads still run. Real processes, a real SIGTERM; asserted on
the store and the exit, with only a hang guard (15 s, far above S=2 and far below the
tool's 60 s) on the time."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import pytest

from aimu.serve.recovery import CRASHED
from aimu.testing.server import LoopbackServer
from tests.serve import test_drain_recover as drain_recover
from tests.serve.harness import aimu_serve, start
from tests.serve.test_drain_recover import latest_is, ran, runs_of, said, until

# The loopback model and the held tools' directory, as the drain and recovery tests have.
model = drain_recover.model
held = drain_recover.held

#: Far above --drain 2 plus its margin, far below the tool's 60 s: only a hang guard.
HANG_GUARD = 15


async def _sigterm_mid_call(
    model: LoopbackServer, tmp_path: Path, held: Path, tool: str, session: str, task: str
) -> tuple[str, int, str]:
    """``aimu serve --drain 2`` with ``tool``, a run of ``task`` on ``session`` held in
    its call (query ``a``), then SIGTERM: the run's id, the exit status and the log,
    once the process exited (a hang fails at HANG_GUARD)."""
    store = tmp_path / "sessions.db"
    options = ("--store", str(store), "--tool", f"tests.serve.recover_tools:{tool}")
    async with aimu_serve(model, tmp_path, *options, "--drain", "2") as one:
        async with httpx.AsyncClient(base_url=one.url, timeout=30) as http:
            run_id = await start(http, session, task)
        await until("the tool runs", (held / "entered-a").exists)
        one.process.send_signal(signal.SIGTERM)
        await until("the drain begins", lambda: said(one.log, "aimu serve: draining"))
        code = await asyncio.wait_for(one.process.wait(), HANG_GUARD)
    return run_id, code, one.log.read_text()


async def test_a_sync_tool_blocking_in_a_thread_cannot_hold_the_exit(
    tmp_path: Path, model: LoopbackServer, held: Path
) -> None:
    try:
        run_id, code, log = await _sigterm_mid_call(
            model, tmp_path, held, "blocking", "t1", "block a")
    finally:
        (held / "open").touch()  # a process that hung lets its thread go
    assert code == 0, log
    assert "exiting with a tool's thread still running" in log
    [record] = await runs_of(tmp_path / "sessions.db", "t1")
    assert (record.id, record.status, record.recover) == (run_id, "cancelled", True)
    assert "into its drain" in (record.reason or ""), record.reason
    assert ran(held) == []  # the thread never finished: the process left it behind


@pytest.mark.slow  # waits out --drain 2 and its margin on purpose
async def test_a_run_that_does_not_settle_cannot_hold_the_exit_and_is_recovered(
    tmp_path: Path, model: LoopbackServer, held: Path
) -> None:
    """A tool that swallows its cancel keeps its run from settling: the process exits
    anyway, DRAIN_MARGIN s after the drain's S; the run's record still says ``running``,
    and ``--recover`` goes on with it as a run whose process died."""
    store = tmp_path / "sessions.db"
    tool = ("--tool", "tests.serve.recover_tools:stubborn")
    run_id, code, log = await _sigterm_mid_call(model, tmp_path, held, "stubborn", "u1", "stub a")
    assert code == 0, log
    assert "still shutting down 7 s after the drain began: exiting now" in log
    [record] = await runs_of(store, "u1")
    assert (record.id, record.status) == (run_id, "running")  # left for --recover
    (held / "open").touch()
    async with aimu_serve(model, tmp_path, "--store", str(store), *tool, "--recover",
                          name="recovering"):
        await until("the run goes on", lambda: latest_is(store, "u1", "completed"))
    new, old = await runs_of(store, "u1")
    assert old.id == run_id and (old.reason or "").startswith(CRASHED)
    assert new.status == "completed"
    assert ran(held) == []  # a call in doubt is never run again
