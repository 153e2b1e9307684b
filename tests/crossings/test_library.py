"""The crossing matrix in the library place: a seeded sample in the normal suite, every
cell marked slow (seed 0 sweeps the cancel and leave endings over every event index)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.crossings.capabilities import shared_mcp
from tests.crossings.library import run_cell
from tests.crossings.matrix import REGRESSIONS, Cell, cells, params, stratified

SEEDS = (0, 1)
SAMPLE_SEED = 42

#: The MCP server's cells (a child process each: seconds on a busy machine) with seed 0
#: only; the serve place has more.
LIBRARY = [c for c in cells(["library"], SEEDS) if c.capability != "mcp" or c.seed == 0]
#: Two cells of each capability, the endings in turn, seed 1: every capability and ending.
#: It leaves out the MCP server's cells (a child process to start: seconds on a busy
#: machine); the serve place's sample has them.
QUICK = stratified([c for c in LIBRARY if c.seed == 1 and c.capability != "mcp"], 2,
                   SAMPLE_SEED)


async def run(cell: Cell, tmp_path: Path, strict: str, *, sweep: bool) -> None:
    extra = shared_mcp if cell.capability == "mcp" else None
    assert await run_cell(cell, tmp_path, strict, sweep=sweep, extra=extra) >= 1


@pytest.mark.parametrize("cell", params(QUICK, "library", full=False))
async def test_sample(cell: Cell, tmp_path: Path, strict: str) -> None:
    await run(cell, tmp_path, strict, sweep=False)


@pytest.mark.parametrize(
    "cell", params([Cell.parse(c) for c in REGRESSIONS if ":library:" in c], "library",
                   full=False),
)
async def test_regression(cell: Cell, tmp_path: Path, strict: str) -> None:
    """The cells that found a defect fixed here, swept over every event index."""
    await run(cell, tmp_path, strict, sweep=True)


@pytest.mark.slow
@pytest.mark.parametrize("cell", params(LIBRARY, "library"))
async def test_cell(cell: Cell, tmp_path: Path, strict: str) -> None:
    # "cancel at every event index" (and leaving the stream): seed 0 sweeps them; other
    # endings take one index a seed.
    swept = cell.seed == 0 and cell.ending in ("cancel", "leave")
    await run(cell, tmp_path, strict, sweep=swept)
