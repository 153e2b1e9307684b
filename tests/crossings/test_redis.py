"""The crossing matrix in the redis place: two ``aimu serve --redis`` processes on one
store and one Redis prefix (started once per module); each run starts and is followed on
one, and its stop, sends and decisions go to the other. Two processes start per module
(seconds each): slow only."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from aimu import aio
from aimu.testing.server import LoopbackServer
from tests.crossings import serve_tools
from tests.crossings.matrix import Cell, cells, params, sample
from tests.crossings.processes import Process, serve_args, serving
from tests.crossings.served import Place, run_served_cell

SEEDS = (0,)
SAMPLE_SEED = 42
#: A seeded sample, cheap once the two processes are up (AIMU_CROSSING_ALL=1: every cell).
REDIS = sample(cells(["redis"], SEEDS), 10, SAMPLE_SEED)


@dataclass
class Pair:
    a: Process
    b: Process
    store: Path
    model: LoopbackServer
    effects: Path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Pair]:
    where = tmp_path_factory.mktemp("redis")
    effects = where / "effects"
    effects.mkdir()
    store = where / "sessions.db"
    args = [*serve_args(store), "--redis", redis_url,
            "--redis-prefix", f"aimu_test_crossing_{secrets.token_hex(4)}"]
    with LoopbackServer.in_thread(serve_tools.script) as model:
        url = model.openai_base_url
        with (serving(url, where, effects, *args, name="a") as a,
              serving(url, where, effects, *args, name="b") as b):
            yield Pair(a, b, store, model, effects)


@pytest.fixture
async def place(pair: Pair) -> AsyncIterator[Place]:
    async with (httpx.AsyncClient(base_url=pair.a.url, timeout=30) as a,
                httpx.AsyncClient(base_url=pair.b.url, timeout=30) as b,
                aio.SQLiteStore(pair.store) as store):
        yield Place(a, b, store, pair.model, pair.effects)


@pytest.mark.slow
@pytest.mark.parametrize("cell", params(REDIS, "redis"))
async def test_cell(cell: Cell, place: Place, strict: str) -> None:
    assert await run_served_cell(cell, place, strict, sweep=False) >= 1
