"""The crossing matrix in the library place: a seeded sample in the normal suite, every
cell marked slow (the cancel ending swept over every event index with seed 0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.crossings.capabilities import shared_mcp
from tests.crossings.library import run_cell
from tests.crossings.matrix import Cell, cells, params, sample

SEEDS = (0, 1)
SAMPLE_SEED = 42

LIBRARY = [c for c in cells(["library"], SEEDS) if c.ending != "kill9"]
QUICK = sample([c for c in LIBRARY if c.seed != 0], 24, SAMPLE_SEED)


async def run(cell: Cell, tmp_path: Path, strict: str, *, sweep: bool) -> None:
    extra = shared_mcp if cell.capability == "mcp" else None
    assert await run_cell(cell, tmp_path, strict, sweep=sweep, extra=extra) >= 1


@pytest.mark.parametrize("cell", params(QUICK, "library", full=False))
async def test_sample(cell: Cell, tmp_path: Path, strict: str) -> None:
    await run(cell, tmp_path, strict, sweep=False)


@pytest.mark.slow
@pytest.mark.parametrize("cell", params(LIBRARY, "library"))
async def test_cell(cell: Cell, tmp_path: Path, strict: str) -> None:
    # "cancel at every event index": seed 0 sweeps them; other endings take one a seed.
    await run(cell, tmp_path, strict, sweep=cell.seed == 0 and cell.ending == "cancel")
