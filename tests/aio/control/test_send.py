"""control.send on a real Redis, with two controls (a worker's and a controller's): the
text crosses Redis and joins the run in the worker exactly once, at its step boundary."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from aimu import aio
from aimu.aio.control import worker as control_worker
from aimu.aio.events import ToolCallStarted
from aimu.aio.transcript import validate
from aimu.testing.server import LoopbackServer
from tests.aio.control.helpers import LEASE
from tests.aio.control.scripts import steer


@pytest.fixture
async def worker(redis_url: str, prefix: str) -> AsyncIterator[aio.RedisControl]:
    async with aio.RedisControl(redis_url, prefix, lease=LEASE) as made:
        yield made


async def test_a_send_from_another_control_joins_the_run_once(
    worker: aio.RedisControl, control: aio.RedisControl, monkeypatch: pytest.MonkeyPatch
) -> None:
    arrived = asyncio.Event()
    original = control_worker.REQUESTS["send"]

    def observed(*args: Any) -> bool:
        taken = original(*args)
        arrived.set()  # the provable point: the worker applied the send
        return taken

    monkeypatch.setitem(control_worker.REQUESTS, "send", observed)

    async def wait_for_send() -> str:
        """Wait until a send reached the worker."""
        await arrived.wait()
        return "a send arrived"

    async with LoopbackServer(steer) as server:
        agent = aio.Agent(aio.client("ollama:m", host=server.url), [wait_for_send])
        try:
            handle = aio.RunHandle.start(agent.run("steer"), control=worker)
            run_id = await worker.registered(handle)
            async for seen in control.events(run_id):
                if isinstance(seen.event, ToolCallStarted):
                    break
            assert await control.send(run_id, "and more")
            assert await handle == "got and more"
            assert handle.status == "completed"
            messages = agent.model_client.messages
            validate(messages)
            assert [m["content"] for m in messages if m["role"] == "user"] == [
                "steer", "and more",
            ]
            info = await control.wait(run_id, timeout=10)
            assert info.status == "completed"
            # The run has ended: a send is refused, and changes nothing.
            assert not await control.send(run_id, "too late")
            assert len(agent.model_client.messages) == len(messages)
        finally:
            await agent.aclose()


async def test_send_bad_input(control: aio.RedisControl) -> None:
    with pytest.raises(aio.UnknownRunError):
        await control.send("nosuchrun", "hello")
    with pytest.raises(TypeError):
        await control.send("nosuchrun", 3)  # type: ignore[arg-type]
