"""The crossing matrix's kill9 and drain endings in the serve place: ``aimu serve`` killed
(or drained) at an event index, then ``aimu serve --recover`` on the same store. Each case
starts two processes (seconds each), so these cells are in the slow matrix only, with one
seed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from aimu import aio
from aimu.testing.server import LoopbackServer
from tests.crossings import serve_tools
from tests.crossings.matrix import Cell, cells, params, sample
from tests.crossings.recovery import Ground, run_recovery_cell

SEEDS = (0,)
SAMPLE_SEED = 42
#: Two process starts a cell: a seeded sample (AIMU_CROSSING_ALL=1: every cell).
RECOVERY = sample([c for c in cells(["serve"], SEEDS) if c.ending in ("kill9", "drain")], 2,
                  SAMPLE_SEED)


@pytest.fixture(scope="module")
def model() -> Iterator[LoopbackServer]:
    with LoopbackServer.in_thread(serve_tools.script) as server:
        yield server


@pytest.fixture
async def ground(model: LoopbackServer, tmp_path: Path) -> AsyncIterator[Ground]:
    effects = tmp_path / "effects"
    effects.mkdir()
    async with aio.SQLiteStore(tmp_path / "sessions.db") as store:
        yield Ground(model, tmp_path, effects, tmp_path / "sessions.db", store)


@pytest.mark.slow
@pytest.mark.parametrize("cell", params(RECOVERY, "serve", endings=("kill9", "drain")))
async def test_cell(cell: Cell, ground: Ground, strict: str) -> None:
    await run_recovery_cell(cell, ground, strict)
