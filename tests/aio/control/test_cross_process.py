"""Runs in worker OS processes, controlled from this one through Redis: stops, a worker
killed with SIGKILL and its run resumed elsewhere, and Redis itself restarted."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aimu import aio
from aimu.aio.events import TextChunk, ToolCallStarted, ToolResult
from aimu.aio.transcript import validate
from aimu.testing.server import LoopbackServer
from tests.aio.control.helpers import LEASE, DurableRedis, Workers
from tests.aio.control.scripts import Answers

pytestmark = pytest.mark.slow


async def seen_text(control: aio.RedisControl, run_id: str, kind: type[object] = TextChunk) -> str:
    """Follow the run (reserved, perhaps not started yet) until it emits ``kind``."""
    async for seen in control.events(run_id):
        if isinstance(seen.event, kind):
            return seen.id
    raise AssertionError(f"run {run_id} ended before a {kind.__name__}")


@contextlib.asynccontextmanager
async def worker_processes(
    url: str,
    prefix: str,
    control: aio.RedisControl,
    store: Path,
    count: int,
    lease: float = LEASE,
) -> AsyncIterator[tuple[LoopbackServer, Workers]]:
    """The model server, and ``count`` connected worker processes (stopped after)."""
    async with LoopbackServer(Answers()) as server:
        workers = Workers(url, prefix, server.url, store, lease)
        workers.spawn(count)
        try:
            await workers.ready(control, count)
            yield server, workers
        finally:
            await workers.stop(control)


async def whole_events(control: aio.RedisControl, run_id: str) -> list[aio.RunEvent]:
    """Every event of the finished run: numbered without a gap, ending with its end."""
    events = [e async for e in control.events(run_id)]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[-1].event.type == "handle_finished"
    return events


async def submit(control: aio.RedisControl, workers: Workers, run_id: str, task: str) -> None:
    """Reserve the run id (so it can be followed and stopped at once), then hand it out."""
    await control.reserve(run_id)
    await workers.push(control, {"run": run_id, "task": task})


async def test_a_controller_stops_runs_in_three_worker_processes(
    redis_url: str, prefix: str, control: aio.RedisControl, store_path: Path
) -> None:
    async with worker_processes(redis_url, prefix, control, store_path, 3) as (server, workers):
        plan = {f"c{i}": "endless" for i in range(3)}
        plan |= {f"i{i}": "tool then more" for i in range(3)}
        plan |= {f"s{i}": "endless" for i in range(3)}
        for run_id, task in plan.items():
            await submit(control, workers, run_id, task)
        # Provable points: the endless streams are streaming, hold() is holding.
        await asyncio.gather(
            *(
                seen_text(control, run_id, ToolCallStarted if run_id[0] == "i" else TextChunk)
                for run_id in plan
            )
        )
        where = {info.run_id: info.worker for info in await control.runs()}
        assert len(set(where.values())) > 1, f"every run went to one worker: {where}"

        async def interrupt(run_id: str) -> aio.RunInfo:
            assert await control.interrupt(run_id)
            return await control.wait(run_id, timeout=20)

        async def cancel(run_id: str) -> aio.RunInfo:
            assert await control.cancel(run_id, "stop pressed")
            return await control.wait(run_id, timeout=20)

        ended = await asyncio.gather(
            *(cancel(r) for r in plan if r[0] == "c"),
            *(interrupt(r) for r in plan if r[0] == "i"),
            *(control.stop(r, grace=0.05) for r in plan if r[0] == "s"),
        )
        statuses = {info.run_id: (info.status, info.reason) for info in ended}
        for run_id in plan:
            if run_id[0] == "c":
                assert statuses[run_id] == ("cancelled", "stop pressed")
            elif run_id[0] == "i":
                assert statuses[run_id] == ("interrupted", None)
            else:
                assert statuses[run_id][0] == "cancelled"
        # Every endless stream was abandoned by its client, none left streaming.
        await server.wait_abandoned(6, timeout=10)
        assert all(r.completed or r.abandoned for r in server.streams)
        async with aio.SQLiteStore(store_path) as store:
            for run_id in plan:
                messages = await store.load(run_id)
                validate(messages)
                roles = [m["role"] for m in messages]
                assert roles[0] == "user" and roles.count("user") == 1, roles
                if run_id[0] == "i":
                    assert roles == ["user", "assistant", "tool"]
        for run_id in plan:
            await whole_events(control, run_id)


async def test_a_killed_worker_s_run_is_lost_then_resumed_by_exactly_one_other(
    redis_url: str, prefix: str, control: aio.RedisControl, store_path: Path
) -> None:
    async with worker_processes(redis_url, prefix, control, store_path, 1) as (server, workers):
        await submit(control, workers, "r1", "resume me")
        # Provable point: the tool result is recorded and the next turn is streaming.
        tool_seen = False
        async for seen in control.events("r1"):
            tool_seen = tool_seen or isinstance(seen.event, ToolResult)
            if tool_seen and isinstance(seen.event, TextChunk):
                break
        workers.kill(0)
        await server.wait_abandoned(1)
        info = await control.wait("r1", timeout=LEASE * 5)
        assert info.status == "lost"
        with pytest.raises(aio.RunLostError, match="claim"):
            async for _ in control.events("r1", after=seen.id):
                pass
        workers.spawn(2)
        await workers.ready(control, 2)
        await workers.push(control, {"claim": "r1"})
        await workers.push(control, {"claim": "r1"})
        outcomes = [
            (await control._client.blpop([f"{prefix}:test:claims"], timeout=30))[1]
            for _ in range(2)
        ]
        assert sorted(outcomes) == ["lost", "won"]
        info = await control.wait("r1", timeout=20)
        assert (info.status, info.attempt) == ("completed", 2)
        events = await whole_events(control, "r1")
        assert events[-1].event.result == "done"
        async with aio.SQLiteStore(store_path) as store:
            messages = await store.load("r1")
        validate(messages)
        roles = [m["role"] for m in messages]
        assert roles.count("user") == 1 and roles[-1] == "assistant", roles
        assert messages[-1]["content"] == "done"


async def test_a_cancel_reaches_a_worker_after_redis_restarts(
    durable_redis: DurableRedis, prefix: str, store_path: Path
) -> None:
    async with (
        aio.RedisControl(durable_redis.url, prefix, lease=LEASE) as control,
        # A lease longer than the outage: the run is never lost, only cut off for a while.
        worker_processes(durable_redis.url, prefix, control, store_path, 1, lease=30.0) as (
            server,
            workers,
        ),
    ):
        await submit(control, workers, "r1", "endless")
        last = await seen_text(control, "r1")
        durable_redis.kill()
        with pytest.raises(aio.ControlConnectionError, match=str(durable_redis.port)):
            await control.cancel("r1", "while Redis is away")
        durable_redis.start()
        # The worker is reconnecting (backoff): the cancel is recorded and found.
        assert await control.cancel("r1", "after the restart")
        info = await control.wait("r1", timeout=20)
        assert (info.status, info.reason) == ("cancelled", "after the restart")
        await server.wait_abandoned(1)
        rest = [e async for e in control.events("r1", after=last)]
        ids = [e.id for e in await whole_events(control, "r1")]
        assert ids[ids.index(last) + 1 :] == [e.id for e in rest] and rest
