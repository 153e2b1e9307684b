"""Followers of a run attached to their own control (``aimu serve --redis``: a client
follows the run where it started it) take its events from the worker that publishes
them, reading Redis only to catch up: the same events, ids and seqs as a follower
through Redis, each once, in order, with no XREAD per event."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from aimu import aio
from aimu.aio.control import feed as feed_module
from aimu.aio.control import worker as control_worker
from aimu.aio.control.redis_control import RedisControl
from aimu.aio.events import HandleFinished, TextChunk
from aimu.aio.scope import current_scope
from tests.aio.control.helpers import LEASE, DurableRedis

Seen = list[tuple[str, int, str]]


def emitting(count: int, gates: list[asyncio.Event] | None = None) -> Any:
    """A run body that emits ``count`` text chunks, each after its gate (if any)."""

    async def body() -> str:
        scope = current_scope.get()
        assert scope is not None
        for i in range(count):
            if gates is not None:
                await gates[i].wait()
            scope.emit(TextChunk("writer", f"part {i}"))
        return "done"

    return body()


async def gated(
    worker: aio.RedisControl, count: int
) -> tuple[list[asyncio.Event], aio.RunHandle[str], str]:
    """A run of ``worker`` emitting ``count`` chunks, each once its gate is set: the
    gates, its handle and its id (registered)."""
    gates = [asyncio.Event() for _ in range(count)]
    handle = aio.RunHandle.start(emitting(count, gates), control=worker)
    return gates, handle, await worker.registered(handle)


def seen(events: list[aio.RunEvent]) -> Seen:
    return [(e.id, e.seq, e.data) for e in events]


async def collect(
    events: AsyncIterator[aio.RunEvent], on_event: Callable[[aio.RunEvent], None] | None = None
) -> list[aio.RunEvent]:
    got: list[aio.RunEvent] = []
    async for event in events:
        got.append(event)
        if on_event is not None:
            on_event(event)
    return got


def started(
    events: AsyncIterator[aio.RunEvent], count: int
) -> tuple[list[aio.RunEvent], asyncio.Event, asyncio.Future[list[aio.RunEvent]]]:
    """A follower in a task of its own: the events it saw so far, an event set once it
    saw ``count`` (a provable point), and the task."""
    got: list[aio.RunEvent] = []
    reached = asyncio.Event()

    def noted(event: aio.RunEvent) -> None:
        got.append(event)
        if len(got) == count:
            reached.set()

    return got, reached, asyncio.ensure_future(collect(events, noted))


def no_xread(control: RedisControl, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Record each XREAD ``control`` sends (a follower through Redis sends them)."""
    reads: list[object] = []
    xread = control._reads.xread

    async def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append(args)
        return await xread(*args, **kwargs)

    monkeypatch.setattr(control._reads, "xread", counted)
    return reads


async def test_a_local_follower_sees_what_a_follower_through_redis_sees(
    worker: aio.RedisControl, control: aio.RedisControl, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = no_xread(worker, monkeypatch)
    gates, _handle, run_id = await gated(worker, 30)
    followers = [asyncio.ensure_future(collect(c.events(run_id))) for c in (worker, control)]
    followers += [asyncio.ensure_future(collect(worker.events(run_id))) for _ in range(10)]
    assert worker._worker is not None
    feeds = worker._worker.runs[run_id].feeds
    while len(feeds) < 11:  # noqa: ASYNC110 - every local follower subscribed
        await asyncio.sleep(0.005)
    for gate in gates:
        gate.set()
        await asyncio.sleep(0)  # events in batches of one and of several
    async with asyncio.timeout(60):
        here, there, *many = await asyncio.gather(*followers)
    assert [e.seq for e in there] == list(range(1, 32))
    assert isinstance(there[-1].event, HandleFinished)
    assert seen(here) == seen(there)
    assert [e.event for e in here] == [e.event for e in there]
    assert all(seen(each) == seen(there) for each in many)
    assert reads == []  # none of the eleven local followers waited in Redis
    assert not feeds


async def test_a_follower_joining_mid_run_misses_nothing_and_repeats_nothing(
    worker: aio.RedisControl, control: aio.RedisControl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The joiner subscribes, then reads what came before from Redis: events published
    between the two (here: three, published while its read waits) are in both, and come
    once; those published after come from the feed."""
    gates, _handle, run_id = await gated(worker, 12)
    first_seen, five, first = started(worker.events(run_id), 5)
    for gate in gates[:5]:
        gate.set()
    async with asyncio.timeout(60):
        await five.wait()  # provable point: five events were published and seen
        xrange = worker._client.xrange
        delayed = [True]

        async def late(*args: Any, **kwargs: Any) -> Any:
            if delayed[0]:  # the joiner subscribed: three more land before it reads
                delayed[0] = False
                for gate in gates[5:8]:
                    gate.set()
                while len(first_seen) < 8:  # noqa: ASYNC110 - seen through the feed
                    await asyncio.sleep(0.005)
            return await xrange(*args, **kwargs)

        monkeypatch.setattr(worker._client, "xrange", late)
        joiner = asyncio.ensure_future(collect(worker.events(run_id)))
        while delayed[0]:  # noqa: ASYNC110 - the joiner reached its read
            await asyncio.sleep(0.005)
        for gate in gates[8:]:
            gate.set()
        joined, followed = await joiner, await first
    through_redis = [e async for e in control.events(run_id)]
    assert [e.seq for e in joined] == list(range(1, 14))
    assert seen(joined) == seen(followed) == seen(through_redis)


async def test_after_an_id_mid_stream_and_a_reconnect_elsewhere_go_on_exactly(
    worker: aio.RedisControl, control: aio.RedisControl, redis_url: str, prefix: str
) -> None:
    gates, _handle, run_id = await gated(worker, 10)
    head: list[aio.RunEvent] = []
    for gate in gates[:4]:
        gate.set()
    async with asyncio.timeout(60):
        async with contextlib.aclosing(worker.events(run_id)) as events:
            async for event in events:
                head.append(event)
                if len(head) == 4:
                    break
        # Mid-stream, from here: after= through the feed, and a reconnect to another
        # process's control with the last id the local follower gave.
        after = asyncio.ensure_future(collect(worker.events(run_id, head[1].id)))
        async with aio.RedisControl(redis_url, prefix, lease=LEASE) as elsewhere:
            reconnected = asyncio.ensure_future(collect(elsewhere.events(run_id, head[-1].id)))
            for gate in gates[4:]:
                gate.set()
            rest, from_second = await reconnected, await after
    whole = [e async for e in control.events(run_id)]
    assert [e.seq for e in whole] == list(range(1, 12))
    assert seen(head + rest) == seen(whole)
    assert seen(from_second) == seen(whole[2:])


async def test_a_cancel_mid_stream_ends_a_local_follower_with_the_end(
    worker: aio.RedisControl, control: aio.RedisControl
) -> None:
    opened = asyncio.Event()
    opened.set()
    handle = aio.RunHandle.start(emitting(2, [opened, asyncio.Event()]), control=worker)
    run_id = await worker.registered(handle)
    got: list[aio.RunEvent] = []
    async with asyncio.timeout(60):
        async with contextlib.aclosing(worker.events(run_id)) as events:
            async for event in events:
                if not got:  # the first chunk is here: cancel from another process
                    assert await control.cancel(run_id, "enough")
                got.append(event)
    assert [e.seq for e in got] == [1, 2]
    assert isinstance(got[-1].event, HandleFinished)
    assert (got[-1].event.status, got[-1].event.reason) == ("cancelled", "enough")
    assert seen(got) == seen([e async for e in control.events(run_id)])


async def test_a_follower_that_stops_early_leaves_no_feed_behind(
    worker: aio.RedisControl,
) -> None:
    gates, handle, run_id = await gated(worker, 4)
    assert worker._worker is not None
    feeds = worker._worker.runs[run_id].feeds
    gates[0].set()
    async with asyncio.timeout(60):
        for _ in range(3):
            async with contextlib.aclosing(worker.events(run_id)) as events:
                async for _event in events:
                    assert len(feeds) == 1  # its own, while it follows
                    break
            assert not feeds
        # A follower cancelled while it waits for the next event leaves none either.
        waiting = asyncio.ensure_future(collect(worker.events(run_id)))
        while not feeds:  # noqa: ASYNC110 - it subscribed
            await asyncio.sleep(0.005)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not feeds
        for gate in gates[1:]:
            gate.set()
        await handle


async def test_a_run_taken_over_mid_follow_is_followed_on_through_redis(
    worker: aio.RedisControl, redis_url: str, prefix: str
) -> None:
    """Another worker claims the run (its lease lapsed: here, deleted) and resumes it; the
    first worker's next write is refused (the run is cancelled there), and its local
    follower goes on through Redis with the new worker's events, to their end."""
    gates, handle, run_id = await gated(worker, 4)
    _, two, following = started(worker.events(run_id), 2)
    gates[0].set()
    gates[1].set()
    async with aio.RedisControl(redis_url, prefix, lease=LEASE) as other:
        async with asyncio.timeout(60):
            await two.wait()
            await other._client.delete(other._keys.lease(run_id))
            assert await other.claim(run_id) is not None
            resumed_gates = [asyncio.Event() for _ in range(3)]
            resumed = aio.RunHandle.start(emitting(3, resumed_gates), run_id=run_id,
                                          control=other)
            await other.registered(resumed)
            gates[2].set()  # the first worker's next write: refused, its run cancelled
            with pytest.raises(asyncio.CancelledError):
                await handle
            for gate in resumed_gates:
                gate.set()
            assert await resumed == "done"
            events = await following
            whole = [e async for e in other.events(run_id)]
    assert seen(events) == seen(whole)
    assert [e.seq for e in events] == [1, 2, 3, 4, 5, 6]
    assert [e.event.text for e in events[:5] if isinstance(e.event, TextChunk)] == [
        "part 0", "part 1", "part 0", "part 1", "part 2"
    ]
    assert isinstance(events[-1].event, HandleFinished) and events[-1].event.status == "completed"


async def test_a_local_follower_fails_when_redis_goes_away(
    durable_redis: DurableRedis, prefix: str
) -> None:
    """As a follower through Redis does: an error, never a wait without end."""
    async with aio.RedisControl(durable_redis.url, prefix, lease=LEASE) as worker:
        gates, handle, run_id = await gated(worker, 2)
        gates[0].set()
        async with asyncio.timeout(60):
            with pytest.raises(aio.ControlConnectionError, match=str(durable_redis.port)):
                async for event in worker.events(run_id):
                    assert event.seq == 1
                    durable_redis.kill()
            gates[1].set()
            await handle
            durable_redis.start()
            await worker.flush()
            assert [e.seq for e in await collect(worker.events(run_id))] == [1, 2, 3]


async def test_local_followers_of_streaming_runs_send_no_xread(
    durable_redis: DurableRedis, prefix: str
) -> None:
    """Fifty runs, each followed once, event by event in lockstep (each event emitted
    once every follower saw the one before, so a follower through Redis reads each in an
    XREAD of its own): through Redis, at least one XREAD per event; in the process that
    runs them, none (Redis' own count, ``INFO commandstats``)."""
    runs, chunks = 50, 10
    async with (
        aio.RedisControl(durable_redis.url, prefix, lease=LEASE) as worker,
        aio.RedisControl(durable_redis.url, prefix, lease=LEASE) as elsewhere,
    ):
        async def xreads() -> int:
            stats = await worker._client.info("commandstats")
            return int(stats.get("cmdstat_xread", {}).get("calls", 0))

        async def lockstep(follower: RedisControl) -> list[list[aio.RunEvent]]:
            gates = [asyncio.Event() for _ in range(chunks)]
            handles = [aio.RunHandle.start(emitting(chunks, gates), control=worker)
                       for _ in range(runs)]
            ids = [await worker.registered(h) for h in handles]
            counts = [0] * (chunks + 2)
            reached = [asyncio.Event() for _ in range(chunks + 2)]

            def noted(event: aio.RunEvent) -> None:
                counts[event.seq] += 1
                if counts[event.seq] == runs:
                    reached[event.seq].set()

            following = [asyncio.ensure_future(collect(follower.events(i), noted)) for i in ids]
            for i, gate in enumerate(gates):
                if i:
                    await reached[i].wait()
                gate.set()
            return await asyncio.gather(*following)

        async with asyncio.timeout(120):
            before = await xreads()
            there = await lockstep(elsewhere)
            through_redis = await xreads() - before
            before = await xreads()
            here = await lockstep(worker)
            local = await xreads() - before
    assert all(len(events) == chunks + 1 for events in there + here)
    assert through_redis >= runs * chunks
    assert local < 5, local


async def test_a_follower_that_falls_behind_catches_up_from_redis(
    worker: aio.RedisControl, control: aio.RedisControl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its feed holds a few events at most (here 3); past that it drops them, and the
    follower reads what it missed from Redis."""
    monkeypatch.setattr(feed_module, "LIMIT", 3)
    reads = no_xread(worker, monkeypatch)
    gates, handle, run_id = await gated(worker, 12)
    gates[0].set()
    async with asyncio.timeout(60), contextlib.aclosing(worker.events(run_id)) as events:
        got = [await anext(events)]
        for gate in gates[1:]:  # published while the follower reads nothing
            gate.set()
        await handle
        await worker.flush()
        got += [event async for event in events]
    assert [e.seq for e in got] == list(range(1, 14))
    assert seen(got) == seen([e async for e in control.events(run_id)])
    assert reads == []  # it caught up, and went on with its feed


async def test_a_batch_whose_answer_was_lost_is_read_from_redis(
    worker: aio.RedisControl, control: aio.RedisControl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis appended a batch, but its answer never came (the connection broke after):
    the worker sends it again, Redis appends nothing, and the feed is never handed those
    events; the local follower reads them from Redis, each once."""
    execute = control_worker._execute
    lose = [False]

    async def answer_lost(pipe: Any) -> list[Any]:
        results = await execute(pipe)
        task = asyncio.current_task()
        if lose[0] and task is not None and task.get_name() == "aimu-control-pump":
            lose[0] = False
            raise RedisConnectionError("the connection broke before the answer")
        return results

    monkeypatch.setattr(control_worker, "_execute", answer_lost)
    gates, _handle, run_id = await gated(worker, 3)
    gates[0].set()
    async with asyncio.timeout(60), contextlib.aclosing(worker.events(run_id)) as events:
        got = [await anext(events)]
        lose[0] = True
        gates[1].set()
        while lose[0]:  # noqa: ASYNC110 - the batch of event 2 was appended, unanswered
            await asyncio.sleep(0.005)
        gates[2].set()
        got += [event async for event in events]
    assert [e.seq for e in got] == [1, 2, 3, 4]
    assert seen(got) == seen([e async for e in control.events(run_id)])
