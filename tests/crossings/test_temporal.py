"""The crossing matrix on Temporal: aimu serve's app with its Temporal backend (under
Uvicorn) and an ``AgentWorker`` on an event loop in a thread of its own, on one dev server
and one task queue for the module; the runs API drives each cell as in the serve place.
Slow only (a dev server to start), with one seed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import threading
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
from tests.crossings.matrix import Cell, cells, params, sample
from tests.crossings.served import Place, run_served_cell
from tests.serve.harness import uvicorn_serving
from tests.services import temporal_address

pytest.importorskip("temporalio")

SEEDS = (0,)
SAMPLE_SEED = 42
#: Each cell takes seconds of Temporal round trips: a seeded sample (AIMU_CROSSING_ALL=1:
#: every cell).
TEMPORAL = sample(cells(["temporal"], SEEDS), 4, SAMPLE_SEED)
TOOLS = (serve_tools.charge, serve_tools.look, serve_tools.wire)


@dataclass
class Deployment:
    url: str
    store: Path
    model: LoopbackServer
    effects: Path


@contextlib.contextmanager
def worker_thread(address: str, queue: str, store: Path, model_url: str) -> Iterator[None]:
    """An AgentWorker on its own loop in a thread until the block ends."""
    from aimu.serve.agents import agent_factory
    from aimu.temporal import AgentWorker

    ready = threading.Event()
    failed: list[BaseException] = []
    stopping: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    async def work() -> None:
        stop = asyncio.Event()
        stopping.append((asyncio.get_running_loop(), stop))
        opened = aio.SQLiteStore(store)
        model = aio.client("openai:loop", base_url=model_url, api_key="sk-test")
        agents, close = agent_factory(model, opened, tools=[*TOOLS, mcp_server()])
        worker = AgentWorker(agents, opened, temporal=address, task_queue=queue,
                             heartbeat=0.1)
        try:
            await worker.start()
            ready.set()
            await stop.wait()
        finally:
            await worker.aclose()
            await close()
            await opened.aclose()

    def main() -> None:
        try:
            asyncio.run(work())
        except BaseException as error:  # told to the test below
            failed.append(error)
            ready.set()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    try:
        assert ready.wait(120) and not failed, failed
        yield
    finally:
        if stopping:
            loop, stop = stopping[0]
            loop.call_soon_threadsafe(stop.set)
        thread.join(60)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    where = tmp_path_factory.mktemp("temporal")
    effects = where / "effects"
    effects.mkdir()
    store = where / "sessions.db"
    address, queue = temporal_address(), f"aimu-crossing-{secrets.token_hex(6)}"
    os.environ["AIMU_CROSSING_EFFECTS"] = str(effects)
    try:
        with LoopbackServer.in_thread(serve_tools.script) as model:
            client = aio.client("openai:loop", base_url=model.openai_base_url, api_key="sk-t")
            application = app(client, store=store, tools=[*TOOLS, mcp_server()], token=None,
                              temporal=address, task_queue=queue)
            with (worker_thread(address, queue, store, model.openai_base_url),
                  uvicorn_serving(application) as url):
                yield Deployment(url, store, model, effects)
    finally:
        del os.environ["AIMU_CROSSING_EFFECTS"]


@pytest.fixture
async def place(deployment: Deployment) -> AsyncIterator[Place]:
    async with (httpx.AsyncClient(base_url=deployment.url, timeout=60) as http,
                aio.SQLiteStore(deployment.store) as store):
        yield Place(http, http, store, deployment.model, deployment.effects,
                    pause_continues_run=True)


@pytest.mark.slow
@pytest.mark.parametrize("cell", params(TEMPORAL, "temporal"))
async def test_cell(cell: Cell, place: Place, strict: str) -> None:
    assert await run_served_cell(cell, place, strict, sweep=False) >= 1
