"""With Redis control, an interrupt (and a stop) reaches the running turn through Redis
at once, not at the turn's next read of its controls from the workflow (a query the
worker answers: every ``--heartbeat``, and late on a busy worker)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from aimu import aio
from aimu.aio.store import SQLiteStore
from aimu.serve.agents import agent_factory
from aimu.temporal import AgentWorker, RunsClient, _client
from aimu.temporal._activities import CONTROL_READS, HEARTBEATS, Activities, _Running
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from tests.services import redis_url


async def test_an_interrupt_lands_through_redis_between_two_reads_of_the_controls(
    temporal: str, queue: str, store: SQLiteStore, model_server: LoopbackServer,
) -> None:
    running, interrupted = asyncio.Event(), asyncio.Event()

    async def work(ctx: aio.ToolContext) -> str:
        """Work until interrupted."""
        running.set()
        while not ctx.interrupt_requested:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        interrupted.set()
        return "stopped working"

    model_server.script = [Turn(tool_calls=(ScriptedCall("work", {}),)), Turn("never")]
    agents, close = agent_factory(aio.client("ollama:test", host=model_server.url), store,
                                  tools=[aio.tool(work)])
    async with aio.RedisControl(redis_url(), f"aimu_test_t-{queue}") as control:
        # The turn reads its controls as it starts, then 60 s later: only Redis is quick.
        worker = AgentWorker(agents, store, temporal=temporal, task_queue=queue,
                             redis=control, heartbeat=60)
        runs = await RunsClient.connect(temporal, queue, redis=control, heartbeat_timeout=300)
        try:
            await worker.start()
            run_id = await runs.start("s1", "work")
            await asyncio.wait_for(running.wait(), 60)
            assert await runs.interrupt(run_id)
            await asyncio.wait_for(interrupted.wait(), 30)
            state = await runs.wait(run_id, timeout=60)
            assert state["status"] == "interrupted"
            assert len(model_server.requests) == 1
        finally:
            await worker.aclose()
            await close()


async def test_a_client_following_many_runs_reads_each_less_often(runs: RunsClient) -> None:
    """Each read of a run's events is a query a worker answers: at 200 followed runs every
    0.1 s (2,000 a second) they swamped the worker and its dev server, and runs started
    slowly (bench_serve_scale --n 200: 41 followers of 200 saw text in 300 s; with the
    budget, all 200 in 60 s)."""
    assert runs.poll_every() == 0.1
    runs._following = 1000
    assert runs.poll_every() == 1000 / _client.EVENT_QUERIES == 10.0


async def test_the_turns_of_a_busy_worker_read_their_controls_and_heartbeat_less_often(
    store: SQLiteStore,
) -> None:
    """Each turn read its controls (a query the worker answers) and heartbeat (a call to
    Temporal) every ``heartbeat``: 1,000 of each a second at 1,000 turns and ``--heartbeat
    1``. Together they do at most CONTROL_READS and HEARTBEATS a second, each turn still
    heartbeating three times a heartbeat timeout (a turn registered in Redis only that:
    at 200 turns and ``--heartbeat 1`` the dev server answered 128 heartbeats a second,
    its biggest load)."""
    agents, close = agent_factory(aio.client("ollama:test", host="http://127.0.0.1:9"), store)
    activities = Activities(agents, store, tick=1.0)
    try:
        assert activities.read_every() == 1.0
        assert activities.beat_every(timedelta(seconds=10)) == 1.0
        activities._turns = {f"run-{i}": _Running() for i in range(1000)}
        assert activities.read_every() == 1000 / CONTROL_READS == 10.0
        assert activities.beat_every(None) == 1000 / HEARTBEATS == 5.0
        assert activities.beat_every(timedelta(seconds=60)) == 5.0
        assert activities.beat_every(timedelta(seconds=10)) == 10 / 3
        # Registered in Redis (its cancel comes through Redis): only to show it is alive.
        activities._turns = {}
        assert activities.beat_every(timedelta(seconds=10), redis=True) == 10 / 3
        assert activities.beat_every(timedelta(seconds=2), redis=True) == 1.0
    finally:
        await close()


async def test_a_cancel_goes_to_redis_before_anything_goes_to_temporal(
    runs: RunsClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through Redis a cancel lands in milliseconds; sent from a task of its own it waited
    a turn of the loop behind Temporal's calls (68 ms p50 of 360 ms, cancel to the model
    stream closed, at 100 runs cancelled over HTTP at once on a busy server)."""
    sent: list[str] = []

    async def cancel(run_id: str, reason: str | None = None) -> bool:
        sent.append(f"redis {reason}")
        return True

    async def is_open(run_id: str) -> bool:
        sent.append("temporal")
        return False  # ended: nothing more is sent to Temporal

    async with aio.RedisControl(redis_url(), f"aimu_test_t-{runs.task_queue}") as control:
        monkeypatch.setattr(control, "cancel", cancel)
        monkeypatch.setattr(runs, "redis", control)
        monkeypatch.setattr(runs, "_open", is_open)
        assert not await runs.cancel("run-1", "now")
    assert sent == ["redis now", "temporal"]


async def test_a_worker_keeps_the_workflows_of_all_its_runs_cached(
    temporal: str, queue: str, store: SQLiteStore,
) -> None:
    """Temporal's SDK caches 1,000 workflows by default: a worker running 1,000 runs (and
    the runs that paused or ended beside them) evicted some, and each query or signal of
    an evicted one replayed its whole history."""
    agents, close = agent_factory(aio.client("ollama:test", host="http://127.0.0.1:9"), store)
    worker = AgentWorker(agents, store, temporal=temporal, task_queue=queue, concurrency=1500)
    try:
        await worker.start()
        assert worker._worker is not None
        assert worker._worker.config()["max_cached_workflows"] == 3000
    finally:
        await worker.aclose()
        await close()


async def test_many_starts_at_once_reach_temporal_a_few_at_a_time(
    runs: RunsClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 runs started at once through aimu serve on a loaded machine: Temporal did not
    answer 725 of the starts within their 10 s, and each was refused 503. A start waits
    its turn before its time starts."""
    in_flight, most = 0, 0

    async def start_workflow(*args: object, **kwargs: object) -> None:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        try:
            await asyncio.sleep(0)  # the other starts get their turn meanwhile
        finally:
            in_flight -= 1

    monkeypatch.setattr(runs.client, "start_workflow", start_workflow)
    started = await asyncio.gather(*(runs.start(f"s{i}", "go") for i in range(200)))
    assert len(set(started)) == 200
    assert 1 < most <= _client.STARTS
