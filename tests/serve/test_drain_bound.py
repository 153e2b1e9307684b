"""``--drain S`` bounds the exit (issue 42 item 7): a sync tool blocking in a worker
thread (60 s, never looking at its cancel) cannot hold ``aimu serve`` past its drain.
After S seconds the run is cancelled, recorded and marked to be recovered, and the
process exits 0 whatever threads still run. Real processes, a real SIGTERM; asserted on
the store and the exit, with only a hang guard (15 s, far above S=2 and far below the
tool's 60 s) on the time."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aimu.serve.recovery import CRASHED
from aimu.testing.server import LoopbackServer
from tests.serve import recover_tools
from tests.serve.harness import aimu_serve, start
from tests.serve.test_drain_recover import latest_is, ran, runs_of, said, until

#: Far above --drain 2 plus its margin, far below the tool's 60 s: only a hang guard.
HANG_GUARD = 15


@pytest.fixture(scope="module")
def model() -> Iterator[LoopbackServer]:
    with LoopbackServer.in_thread(recover_tools.script) as server:
        yield server


@pytest.fixture
def held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    where = tmp_path / "held"
    where.mkdir()
    monkeypatch.setenv("AIMU_TEST_HELD", str(where))  # the servers inherit it
    return where


async def test_a_sync_tool_blocking_in_a_thread_cannot_hold_the_exit(
    tmp_path: Path, model: LoopbackServer, held: Path
) -> None:
    store = tmp_path / "sessions.db"
    tool = ("--tool", "tests.serve.recover_tools:blocking")
    async with aimu_serve(model, tmp_path, "--store", str(store), *tool, "--drain", "2") as one:
        async with httpx.AsyncClient(base_url=one.url, timeout=30) as http:
            run_id = await start(http, "t1", "block a")
        await until("the tool blocks in its thread", (held / "entered-a").exists)
        one.process.send_signal(signal.SIGTERM)
        await until("the drain begins", lambda: said(one.log, "aimu serve: draining"))
        try:
            code = await asyncio.wait_for(one.process.wait(), HANG_GUARD)
        finally:
            (held / "open").touch()  # a process that hung lets its thread go
        assert code == 0, one.log.read_text()
    assert said(one.log, "exiting with a tool's thread still running")
    [record] = await runs_of(store, "t1")
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
    async with aimu_serve(model, tmp_path, "--store", str(store), *tool, "--drain", "2") as one:
        async with httpx.AsyncClient(base_url=one.url, timeout=30) as http:
            run_id = await start(http, "u1", "stub a")
        await until("the tool runs", (held / "entered-a").exists)
        one.process.send_signal(signal.SIGTERM)
        await until("the drain begins", lambda: said(one.log, "aimu serve: draining"))
        assert await asyncio.wait_for(one.process.wait(), HANG_GUARD) == 0
        assert said(one.log, "still shutting down 7 s after the drain began: exiting now")
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
