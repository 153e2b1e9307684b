"""Fixtures for the control tests: a key prefix per test, controls, a Redis to restart."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.control import worker as control_worker
from aimu.aio.steering import Steer
from tests.aio.control.helpers import LEASE, DurableRedis


@pytest.fixture
async def prefix(redis_url: str) -> AsyncIterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    name = f"aimu_test_{secrets.token_hex(4)}"
    yield name
    async with aio.RedisControl(redis_url, name) as control:
        client = control._client
        keys = [key async for key in client.scan_iter(match=f"{name}:*")]
        if keys:
            await client.delete(*keys)


@pytest.fixture
async def control(redis_url: str, prefix: str) -> AsyncIterator[aio.RedisControl]:
    async with aio.RedisControl(redis_url, prefix, lease=LEASE) as made:
        yield made


@pytest.fixture
async def worker(redis_url: str, prefix: str) -> AsyncIterator[aio.RedisControl]:
    """The worker's control: a second connection, as another process would have."""
    async with aio.RedisControl(redis_url, prefix, lease=LEASE) as made:
        yield made


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "sessions.db"


@pytest.fixture
def durable_redis() -> Iterator[DurableRedis]:
    server = DurableRedis()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def send_arrived(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Set each time a worker has applied a send: the provable point after one."""
    arrived = asyncio.Event()
    original = control_worker.steer

    def observed(handle: Any, request: Steer, spawn: Any) -> bool:
        taken = original(handle, request, spawn)
        if request.kind == "send":
            arrived.set()
        return taken

    monkeypatch.setattr(control_worker, "steer", observed)
    return arrived
