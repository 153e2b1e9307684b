"""Redis going away under a worker: runs go on, local stops work, callers get a clear
error at once, and everything the runs emitted reaches Redis when it is back."""

from __future__ import annotations

import asyncio
import time

import pytest

from aimu import aio
from aimu.aio.events import TextChunk
from aimu.aio.transcript import validate
from aimu.testing.server import LoopbackServer
from tests.aio.control.helpers import LEASE, DurableRedis
from tests.aio.control.scripts import TOOLS, Answers


async def whole(control: aio.RedisControl, run_id: str) -> list[aio.RunEvent]:
    events = [e async for e in control.events(run_id)]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[-1].event.type == "handle_finished"
    return events


async def test_runs_go_on_and_publish_everything_after_redis_comes_back(
    durable_redis: DurableRedis, prefix: str
) -> None:
    async with (
        LoopbackServer(Answers()) as server,
        aio.RedisControl(durable_redis.url, prefix, lease=LEASE) as worker,
        aio.RedisControl(durable_redis.url, prefix, lease=LEASE) as control,
    ):
        endless = aio.Agent(aio.client("ollama:m", host=server.url), TOOLS)
        quick = aio.Agent(aio.client("ollama:m", host=server.url), TOOLS)
        handle = aio.RunHandle.start(endless.run("endless"), control=worker)
        run_id = await worker.registered(handle)
        async for seen in control.events(run_id):
            if isinstance(seen.event, TextChunk):
                break
        durable_redis.kill()

        # Callers: a clear error, promptly, never a hang.
        began = time.monotonic()
        with pytest.raises(aio.ControlConnectionError, match=str(durable_redis.port)):
            await control.status(run_id)
        assert time.monotonic() - began < worker.timeout
        # A run started while Redis is away runs; a local cancel stops a running one.
        other = aio.RunHandle.start(quick.run("quick"), control=worker)
        assert await other == "quick answer"
        assert handle.cancel("stopped locally")
        with pytest.raises(asyncio.CancelledError):
            await handle
        await server.wait_abandoned(1)

        durable_redis.start()
        async with asyncio.timeout(30):
            await worker.flush()
        info = await control.status(run_id)
        assert (info.status, info.reason) == ("cancelled", "stopped locally")
        assert (await control.status(other.run_id or "")).status == "completed"
        events = await whole(control, run_id)
        assert sum(isinstance(e.event, TextChunk) for e in events) >= 1
        finished = await whole(control, other.run_id or "")
        assert finished[-1].event.result == "quick answer"
        validate(endless.model_client.messages)
        await endless.aclose()
        await quick.aclose()


async def test_a_local_cancel_before_registration_still_reaches_redis(
    redis_url: str, control: aio.RedisControl
) -> None:
    agent = aio.Agent(aio.client("test"))
    handle = aio.RunHandle.start(agent.run("hello"), control=control)
    assert handle.cancel("at once")  # before the worker has even registered the run
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert handle.run_id is not None
    info = await control.wait(await control.registered(handle), timeout=10)
    assert (info.status, info.reason) == ("cancelled", "at once")
    await agent.aclose()


async def test_cancelling_a_follower_or_a_waiter_leaves_the_control_usable(
    control: aio.RedisControl,
) -> None:
    run_id = await control.reserve()

    async def follow() -> None:
        async for _ in control.events(run_id):
            raise AssertionError("a reserved run has no events")

    follower = asyncio.ensure_future(follow())
    waiter = asyncio.ensure_future(control.wait(run_id))
    # Provable point: Redis lists two of this control's connections blocked in XREAD.
    mine = f"aimu-{control.worker_id}"
    while True:
        clients = await control._client.client_list()
        blocked = [c for c in clients if c["name"] == mine and c["cmd"] == "xread"]
        if sum("b" in c["flags"] for c in blocked) >= 2:
            break
        await asyncio.sleep(0.01)
    for task in (follower, waiter):
        task.cancel()
    for task in (follower, waiter):
        with pytest.raises(asyncio.CancelledError):
            await task
    assert (await control.status(run_id)).status == "pending"
    assert await control.cancel(run_id)


async def test_a_password_works_and_never_shows(
    prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = DurableRedis(password="s3cret-pw")
    try:
        url = f"redis://:s3cret-pw@127.0.0.1:{server.port}/0"
        async with aio.RedisControl(url, prefix, lease=LEASE) as control:
            agent = aio.Agent(aio.client("test"))
            handle = aio.RunHandle.start(agent.run("hello"), control=control)
            await handle
            run_id = await control.registered(handle)
            assert (await control.wait(run_id, timeout=10)).status == "completed"
            server.kill()  # the worker logs the outage: without the password
            with pytest.raises(aio.ControlConnectionError) as down:
                await control.status(run_id)
            await agent.aclose()
        wrong = aio.RedisControl(f"redis://:wrong-pw@127.0.0.1:{server.port}/0", prefix)
        server.start()
        with pytest.raises(aio.ControlConnectionError, match="refused the credentials") as refused:
            await wrong.connect()
        await wrong.aclose()
        tls = aio.RedisControl(f"rediss://user:s3cret-pw@127.0.0.1:{server.port}/0", prefix)
        assert tls.url == f"rediss://***@127.0.0.1:{server.port}/0"
        await tls.aclose()
        shown = [str(down.value), str(refused.value), repr(control), repr(tls), caplog.text]
        assert not [text for text in shown if "s3cret" in text or "wrong-pw" in text]
    finally:
        server.close()
