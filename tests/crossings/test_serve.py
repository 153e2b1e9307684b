"""The crossing matrix in the serve place: aimu serve's app under Uvicorn (one per module,
shared by every cell), on the loopback model; a seeded sample in the normal suite, every
cell marked slow."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from aimu import aio
from aimu.serve import app
from aimu.testing.server import LoopbackServer
from tests.crossings import serve_tools
from tests.crossings.capabilities import mcp_server
from tests.crossings.matrix import ENDINGS, Cell, cells, params, stratified
from tests.crossings.served import Place, run_served_cell
from tests.serve.harness import uvicorn_serving

SEEDS = (0, 1)
SAMPLE_SEED = 42
#: kill9 and drain are tests/crossings/test_recovery.py's (processes of their own).
SERVED_ENDINGS = [e.name for e in ENDINGS if e.name not in ("kill9", "drain")]
SERVE = [c for c in cells(["serve"], SEEDS) if c.ending in SERVED_ENDINGS]
#: One cell of each capability, the endings in turn (seed 1).
QUICK = stratified([c for c in SERVE if c.seed == 1], 1, SAMPLE_SEED)


@dataclass
class Server:
    url: str
    store: Path
    model: LoopbackServer
    effects: Path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    where = tmp_path_factory.mktemp("serve")
    effects = where / "effects"
    effects.mkdir()
    os.environ["AIMU_CROSSING_EFFECTS"] = str(effects)
    try:
        with LoopbackServer.in_thread(serve_tools.script) as model:
            client = aio.client("openai:loop", base_url=model.openai_base_url, api_key="sk-t")
            tools = [serve_tools.charge, serve_tools.look, serve_tools.wire, mcp_server()]
            application = app(client, store=where / "sessions.db", tools=tools, token=None)
            with uvicorn_serving(application) as url:
                yield Server(url, where / "sessions.db", model, effects)
    finally:
        del os.environ["AIMU_CROSSING_EFFECTS"]


@pytest.fixture
async def place(server: Server) -> AsyncIterator[Place]:
    async with (httpx.AsyncClient(base_url=server.url, timeout=30) as http,
                aio.SQLiteStore(server.store) as store):
        yield Place(http, http, store, server.model, server.effects)


@pytest.mark.parametrize("cell", params(QUICK, "serve", full=False))
async def test_sample(cell: Cell, place: Place, strict: str) -> None:
    assert await run_served_cell(cell, place, strict, sweep=False, prefix="q-") >= 1


@pytest.mark.slow
@pytest.mark.parametrize("cell", params(SERVE, "serve", endings=SERVED_ENDINGS))
async def test_cell(cell: Cell, place: Place, strict: str) -> None:
    assert await run_served_cell(cell, place, strict, sweep=False) >= 1
