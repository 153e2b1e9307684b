"""Followers of a run's events through Redis (issue 35: ``aimu serve --redis`` with 1,000
SSE followers, 804 of them saw no text): a follower that attaches at any moment sees
every event from the start, then live; a quiet follower costs little while it waits."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from aimu import aio
from aimu.aio.control import following as following_module
from aimu.aio.control.redis_control import RedisControl
from aimu.aio.errors import ControlConnectionError
from aimu.aio.events import TextChunk
from aimu.aio.scope import current_scope
from tests.aio.control.helpers import LEASE


async def published(control: aio.RedisControl, run_id: str, count: int) -> None:
    """Return once ``count`` events of the run are in Redis (a provable point)."""
    while (await control.status(run_id)).events < count:  # noqa: ASYNC110 - read off Redis
        await asyncio.sleep(0.005)


async def follow(control: aio.RedisControl, run_id: str) -> list[tuple[int, str]]:
    return [(seen.seq, seen.data) async for seen in control.events(run_id)]


async def test_a_follower_attaching_at_any_moment_sees_every_event_from_the_start(
    worker: aio.RedisControl, control: aio.RedisControl
) -> None:
    gates = [asyncio.Event() for _ in range(4)]

    async def body() -> str:
        scope = current_scope.get()
        assert scope is not None
        for i, gate in enumerate(gates):
            scope.emit(TextChunk("writer", f"part {i}"))
            await gate.wait()
        return "done"

    handle = aio.RunHandle.start(body(), control=worker)
    run_id = await worker.registered(handle)
    followers = [asyncio.ensure_future(follow(control, run_id))]  # before any event
    for i, gate in enumerate(gates):
        await published(control, run_id, i + 1)
        # Several at once, at each moment: the first event, the middle, the last.
        followers += [asyncio.ensure_future(follow(control, run_id)) for _ in range(5)]
        gate.set()
    await handle
    await worker.flush()
    followers.append(asyncio.ensure_future(follow(control, run_id)))  # after the end
    async with asyncio.timeout(60):
        seen = await asyncio.gather(*followers)
    first = seen[0]
    assert [seq for seq, _ in first] == [1, 2, 3, 4, 5]
    assert [f"part {i}" in data for i, (_, data) in enumerate(first[:4])] == [True] * 4
    assert '"handle_finished"' in first[-1][1]
    assert all(each == first for each in seen), [len(each) for each in seen]


async def test_a_quiet_follower_waits_in_reads_shorter_than_its_socket_timeout(
    redis_url: str, prefix: str, worker: aio.RedisControl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower of a run that emits nothing waits in XREAD BLOCK, checking between two
    reads (one round trip) that the run is still there. Each read blocks for most of the
    socket timeout: longer fails (the read times out), much shorter costs the follower's
    process CPU (1 s blocks: 1,000 quiet followers took most of a loaded core, and their
    runs stalled)."""
    reads: list[Any] = []
    checks: list[str] = []
    three = asyncio.Event()
    standing = RedisControl._standing

    async def checked(self: RedisControl, run_id: str) -> Any:
        checks.append(run_id)
        return await standing(self, run_id)

    monkeypatch.setattr(RedisControl, "_standing", checked)
    release = asyncio.Event()
    handle = aio.RunHandle.start(release.wait(), control=worker)
    run_id = await worker.registered(handle)
    async with aio.RedisControl(redis_url, prefix, lease=LEASE, timeout=0.5) as control:
        xread = control._reads.xread

        async def counted(*args: Any, **kwargs: Any) -> Any:
            reads.append(kwargs.get("block"))
            if len(reads) == 3:
                three.set()
            return await xread(*args, **kwargs)

        monkeypatch.setattr(control._reads, "xread", counted)
        following = asyncio.ensure_future(follow(control, run_id))
        async with asyncio.timeout(60):
            # Two quiet reads have ended, each followed by one check (or the follower failed).
            await asyncio.wait([asyncio.ensure_future(three.wait()), following],
                               return_when=asyncio.FIRST_COMPLETED)
            assert not following.done(), following.result()
            assert reads == [250, 250, 250]  # half the 0.5 s socket timeout
            assert len(checks) == 2
            release.set()
            await handle
            events = await following
    assert events[-1][0] == 1 and '"handle_finished"' in events[-1][1]
    assert following_module.IDLE_BLOCK_MS == 2500  # with the default 5 s socket timeout


async def test_a_follower_reads_again_after_a_read_timed_out(
    worker: aio.RedisControl, control: aio.RedisControl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy process takes Redis's reply late (its event loop lags): the read times out
    though Redis answered. The follower reads again from its cursor, twice in a row at
    most, and misses nothing; a third timeout in a row is an error."""
    xread = control._reads.xread
    timeouts = [2]

    async def late(*args: Any, **kwargs: Any) -> Any:
        if timeouts[0]:
            timeouts[0] -= 1
            raise RedisTimeoutError("Timeout reading from 127.0.0.1:6379")
        return await xread(*args, **kwargs)

    monkeypatch.setattr(control._reads, "xread", late)
    handle = aio.RunHandle.start(asyncio.sleep(0, "done"), control=worker)
    run_id = await worker.registered(handle)
    await handle
    await worker.flush()
    async with asyncio.timeout(60):
        assert [seq for seq, _ in await follow(control, run_id)] == [1]
        timeouts[0] = 3
        with pytest.raises(ControlConnectionError, match="Timeout reading"):
            await follow(control, run_id)


async def test_a_follower_waits_out_a_lease_renewed_late_and_gives_up_a_lease_later(
    redis_url: str, prefix: str, worker: aio.RedisControl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35 on a loaded machine: a worker holding 1,000 runs renewed its leases late,
    each follower found its run ``lost`` at once and ended with an error, before any
    text (1,000 of 1,000 in one run). A run lost for less than a lease goes on being
    followed; one lost a whole lease more is an error (its worker is gone)."""
    standing = RedisControl._standing
    lost_checks = [2]

    async def lapsed(self: RedisControl, run_id: str) -> Any:
        status, holder = await standing(self, run_id)
        if lost_checks[0] and status == "running":  # its worker renews the lease late
            lost_checks[0] -= 1
            return "lost", holder
        return status, holder

    monkeypatch.setattr(RedisControl, "_standing", lapsed)
    release = asyncio.Event()
    handle = aio.RunHandle.start(release.wait(), control=worker)
    run_id = await worker.registered(handle)
    async with aio.RedisControl(redis_url, prefix, lease=60, timeout=0.5) as control:
        following = asyncio.ensure_future(follow(control, run_id))
        async with asyncio.timeout(60):
            while lost_checks[0] and not following.done():  # noqa: ASYNC110 - seen lost twice
                await asyncio.sleep(0.01)
            assert not following.done(), following.result()
            release.set()
            events = await following
    assert [seq for seq, _ in events] == [1] and '"handle_finished"' in events[0][1]
    quiet = aio.RunHandle.start(asyncio.Event().wait(), control=worker)
    quiet_id = await worker.registered(quiet)
    lost_checks[0] = 1_000_000
    async with aio.RedisControl(redis_url, prefix, lease=0.3, timeout=0.5) as control:
        async with asyncio.timeout(60):
            with pytest.raises(aio.RunLostError, match="claim"):
                await follow(control, quiet_id)
    assert lost_checks[0] <= 1_000_000 - 2  # not at the first check
    # Followed through the control that runs it (aimu serve --redis, one process): its
    # run is never lost, however late its lease (the run is right here).
    async with aio.RedisControl(redis_url, prefix, lease=0.3, timeout=0.5) as here:
        gate = asyncio.Event()
        mine = aio.RunHandle.start(gate.wait(), control=here)
        mine_id = await here.registered(mine)
        before = lost_checks[0]
        following = asyncio.ensure_future(follow(here, mine_id))
        async with asyncio.timeout(60):
            while lost_checks[0] > before - 3 and not following.done():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            assert not following.done(), following.result()
            gate.set()
            await mine
            assert [seq for seq, _ in await following] == [1]
    quiet.cancel()
