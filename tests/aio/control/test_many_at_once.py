"""Many runs at once through one control (issue 35: ``aimu serve --redis`` with 1,000
runs): its commands share a few connections, a cancel-all is read by the worker in a
pipeline, and a lease is renewed whatever commands wait meanwhile."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio.connection import Connection

from aimu import aio
from aimu.aio.control import redis_control


async def connections(observer: aio.RedisControl, of: aio.RedisControl, cmd: str = "") -> int:
    """How many connections Redis lists for ``of`` (those running ``cmd``, if given)."""
    name = f"aimu-{of.worker_id}"
    clients: list[dict[str, Any]] = await observer._client.client_list()
    return sum(c.get("name") == name and (not cmd or c.get("cmd") == cmd) for c in clients)


async def test_many_commands_at_once_share_a_few_connections(
    control: aio.RedisControl, redis_url: str, prefix: str
) -> None:
    # One pool that grew with the commands in flight opened a connection for each of
    # 1,000 starts at once; a starved process timed out connecting them (503s).
    async with aio.RedisControl(redis_url, prefix) as busy:
        run_ids = await asyncio.gather(*(busy.reserve(session=f"s{i}") for i in range(300)))
        infos = await asyncio.gather(*(busy.status(run_id) for run_id in run_ids))
        assert [info.status for info in infos] == ["pending"] * 300
        assert await connections(control, busy) <= redis_control.COMMAND_CONNECTIONS


async def test_a_cancel_of_many_runs_is_read_by_their_worker_on_a_few_connections(
    control: aio.RedisControl, redis_url: str, prefix: str
) -> None:
    # Each message of a cancel-all had its run's requests read on a connection of its
    # own: 1,000 at once in the worker, beside the runs it was busy with.
    async with aio.RedisControl(redis_url, prefix) as worker:
        handles = [aio.RunHandle.start(asyncio.Event().wait(), control=worker)
                   for _ in range(100)]
        run_ids = await asyncio.gather(*(worker.registered(h) for h in handles))
        assert all(await asyncio.gather(*(control.cancel(r, "all at once") for r in run_ids)))
        async with asyncio.timeout(60):
            await asyncio.gather(*handles, return_exceptions=True)
        assert {h.status for h in handles} == {"cancelled"}
        assert {h.reason for h in handles} == {"all at once"}
        # The worker's own (pump, renewals, re-reads), its pub/sub, and connect()'s ping.
        assert await connections(control, worker) <= redis_control.WORKER_CONNECTIONS + 2


async def test_a_lease_is_renewed_while_every_command_connection_is_taken(
    control: aio.RedisControl, redis_url: str, prefix: str
) -> None:
    async with aio.RedisControl(redis_url, prefix, lease=2.0, timeout=60) as worker:
        release = asyncio.Event()
        handle = aio.RunHandle.start(release.wait(), control=worker)
        run_id = await worker.registered(handle)
        lease = worker._keys.lease(run_id)
        assert await control._client.exists(lease)
        # Every command connection of the worker's control waits (BLPOP), and more
        # commands queue for one: the renewals go on regardless.
        jam = f"{prefix}:test:jam"
        size = redis_control.COMMAND_CONNECTIONS
        waiting = [asyncio.ensure_future(worker._client.blpop([jam], timeout=0))
                   for _ in range(size + 10)]
        async with asyncio.timeout(60):
            while await connections(control, worker, "blpop") < size:  # noqa: ASYNC110 - read off Redis
                await asyncio.sleep(0.01)
            left = await control._client.pttl(lease)
            while (now := await control._client.pttl(lease)) <= left:  # renewed: a provable point
                left = now
                await asyncio.sleep(0.01)
        assert not any(w.done() for w in waiting)
        await control._client.rpush(jam, *range(size + 10))
        await asyncio.gather(*waiting)
        release.set()
        await handle


async def test_many_followers_at_once_connect_a_few_at_a_time(
    control: aio.RedisControl, redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 1,000 followers connecting at once in a process starved of CPU: each connect's
    # timeout ran while it waited for the loop, and past 5 s they failed.
    in_flight, most = 0, 0
    connect = Connection._connect

    async def counted(self: Connection) -> None:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        try:
            await asyncio.sleep(0)  # the other connects get their turn meanwhile
            await connect(self)
        finally:
            in_flight -= 1

    run_id = await control.reserve(session="s1")
    async with aio.RedisControl(redis_url, prefix) as busy:
        monkeypatch.setattr(Connection, "_connect", counted)
        followers = [asyncio.ensure_future(busy.wait(run_id)) for _ in range(100)]
        async with asyncio.timeout(60):
            while await connections(control, busy, "xread") < 100:  # noqa: ASYNC110 - read off Redis
                await asyncio.sleep(0.01)
        for follower in followers:
            follower.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
    assert 1 < most <= redis_control.CONNECTING
