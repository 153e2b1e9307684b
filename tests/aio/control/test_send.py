"""control.send on a real Redis, with two controls (a worker's and a controller's): the
text crosses Redis and joins the run in the worker exactly once, at its step boundary."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

import pytest

from aimu import aio
from aimu.aio import steering
from aimu.aio.events import ToolCallStarted
from aimu.aio.transcript import validate
from aimu.testing.server import LoopbackServer
from tests.aio.control.scripts import steer
from tests.aio.test_images import png


class Steered(NamedTuple):
    server: LoopbackServer
    agent: aio.Agent
    handle: aio.RunHandle[str]
    run_id: str


@contextlib.asynccontextmanager
async def steered_run(
    worker: aio.RedisControl, control: aio.RedisControl, arrived: asyncio.Event
) -> AsyncIterator[Steered]:
    """A run in ``worker`` whose tool waits until a send reached the worker; yielded
    once ``control`` saw the tool call start (the provable point to send)."""

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
            yield Steered(server, agent, handle, run_id)
        finally:
            await agent.aclose()


async def test_a_send_from_another_control_joins_the_run_once(
    worker: aio.RedisControl, control: aio.RedisControl, send_arrived: asyncio.Event
) -> None:
    async with steered_run(worker, control, send_arrived) as (_, agent, handle, run_id):
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


async def test_images_sent_through_redis_join_the_run_with_their_text(
    worker: aio.RedisControl, control: aio.RedisControl, send_arrived: asyncio.Event
) -> None:
    async with steered_run(worker, control, send_arrived) as (server, agent, handle, run_id):
        with pytest.raises(ValueError, match="not an image"):
            await control.send(run_id, "bad", images=[b"no image"])  # nothing recorded
        assert await control.send(run_id, "and this", images=[png()])
        assert await handle == "got and this"
        sent = agent.model_client.messages
        assert [m for m in sent if m["role"] == "user"][-1] == {
            "role": "user", "content": "and this", "aimu_sent": True,
            "images": ["data:image/png;base64," + base64.b64encode(png()).decode()],
        }
        assert server.requests[-1].body["messages"][-1]["images"] == [
            base64.b64encode(png()).decode()
        ]
        validate(sent)


async def test_send_bad_input(control: aio.RedisControl) -> None:
    with pytest.raises(aio.UnknownRunError):
        await control.send("nosuchrun", "hello")
    with pytest.raises(TypeError):
        await control.send("nosuchrun", 3)  # type: ignore[arg-type]


async def test_a_worker_takes_images_only_as_data_urls(tmp_path: Path) -> None:
    """A send's images cross Redis as data: URLs; anything else in a request (a path a
    writer to Redis put there) is dropped, never read from the worker's disk."""
    (tmp_path / "secret.png").write_bytes(png())
    waiting = asyncio.Event()
    handle = aio.RunHandle.start(waiting.wait())
    try:
        url = "data:image/png;base64," + base64.b64encode(png()).decode()
        bad = steering.Steer.from_json({"kind": "send", "content": "look",
                                        "images": [str(tmp_path / "secret.png")]})
        with pytest.raises(ValueError, match="image 0: send it as a data:"):
            steering.steer(handle, bad, asyncio.ensure_future)  # the worker drops it
        assert handle.take_sent() == []  # nothing joins the run
        good = steering.Steer.from_json({"kind": "send", "content": "look", "images": [url]})
        assert steering.steer(handle, good, asyncio.ensure_future)
        assert handle.take_sent() == [
            {"role": "user", "content": "look", "images": [url], "aimu_sent": True}
        ]
    finally:
        waiting.set()
        await handle
