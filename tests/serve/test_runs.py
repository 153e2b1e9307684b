"""LocalRuns without HTTP: what the routes rely on and cannot show from outside."""

from __future__ import annotations

from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.run_handle import RunHandle
from aimu.serve.runs import LocalRuns, RunRecord


class NoHandles(LocalRuns):
    """Runs whose handle cannot start (as when the server's control has closed)."""

    def _start_handle(self, run: Coroutine[Any, Any, str], record: RunRecord) -> RunHandle[str]:
        raise RuntimeError("no handle today")


async def test_a_run_whose_handle_cannot_start_releases_its_session(tmp_path: Path) -> None:
    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        client = aio.client("test")
        runs = NoHandles(lambda s: aio.Agent(client.fork(), store=store, session=s), store)
        with pytest.raises(RuntimeError, match="no handle today"):
            await runs.start("s", "hello")
        assert runs.active_run("s") is None
        writer = await store.open_session("s")  # the lock was released
        await writer.aclose()
        await client.aclose()
