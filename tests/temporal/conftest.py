"""Fixtures of the Temporal tests: a dev server per test process, a task queue per test,
the loopback model server, and in-process workers over a SQLite store."""

from __future__ import annotations

import gc
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.store import SQLiteStore
from aimu.testing.server import LoopbackServer
from tests.serve.conftest import pytest_runtest_makereport  # the browser test's screenshots
from tests.services import temporal_address

__all__ = ["pytest_runtest_makereport"]

pytest.importorskip("temporalio")

from aimu.serve.agents import agent_factory
from aimu.temporal import AgentWorker, RunsClient

#: Seconds of silence after which a dead worker's turn goes to another worker.
HEARTBEAT_TIMEOUT = 2.0


@pytest.fixture(scope="session")
def temporal() -> str:
    return temporal_address()


@pytest.fixture
def queue() -> str:
    return f"aimu-test-{secrets.token_hex(6)}"


@pytest.fixture
async def model_server() -> AsyncIterator[LoopbackServer]:
    async with LoopbackServer() as server:
        yield server


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    opened = SQLiteStore(tmp_path / "sessions.db")
    yield opened
    await opened.aclose()


@pytest.fixture
async def runs(temporal: str, queue: str) -> RunsClient:
    return await RunsClient.connect(temporal, queue, heartbeat_timeout=HEARTBEAT_TIMEOUT)


class Workers:
    """Start in-process workers on the test's queue; every one is closed at the end."""

    def __init__(self, temporal: str, queue: str, store: SQLiteStore, server: LoopbackServer):
        self.temporal, self.queue, self.store, self.server = temporal, queue, store, server
        self.started: list[tuple[AgentWorker, Callable[[], Any]]] = []

    async def start(
        self, tools: Sequence[Any] = (), redis: Any = None, drain: float = 0.0,
        sandboxed: bool = True,
    ) -> AgentWorker:
        model = aio.client("ollama:test", host=self.server.url)
        agents, close = agent_factory(model, self.store, tools=tools)
        worker = AgentWorker(agents, self.store, temporal=self.temporal, task_queue=self.queue,
                             redis=redis, heartbeat=0.1, drain=drain, sandboxed=sandboxed)
        await worker.start()
        self.started.append((worker, close))
        return worker

    def handing_off(self) -> bool:
        """True once a turn on these workers was asked to end for its run to continue
        as new (a look inside the workers, for tests that land at that point)."""
        return any(
            running.attempt is not None and running.attempt.handoff
            for worker, _ in self.started
            for running in worker._activities._turns.values()
        )

    async def stop(self, worker: AgentWorker) -> None:
        for entry in list(self.started):
            if entry[0] is worker:
                self.started.remove(entry)
                await worker.aclose()
                await entry[1]()

    async def aclose(self) -> None:
        for worker, _ in list(self.started):
            await self.stop(worker)


@pytest.fixture
async def workers(
    temporal: str, queue: str, store: SQLiteStore, model_server: LoopbackServer
) -> AsyncIterator[Workers]:
    made = Workers(temporal, queue, store, model_server)
    yield made
    await made.aclose()
    gc.collect()  # what the workers left is reported by this test, not a later one
