"""Many runs through one model client (issue 35): every run starts or fails, never waits
forever; by default all of them are in flight at once, spread over small httpx pools;
past an explicit ``concurrency=`` a request waits for a slot, a warning says so, and it
fails clearly when none comes; a cancel of all of them closes every stream and keeps each
partial reply. Stops land at provable points (the server holds every stream mid-reply)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import httpcore
import httpcore._async.http11
import pytest
from provider_support import MakeClient, assert_only_current_task, lookup, open_connections

from aimu import aio
from aimu.aio.client import TextDelta
from aimu.aio.errors import ModelConnectionError
from aimu.aio.providers import _backend, _pool
from aimu.aio.providers._pool import KEEP_ALIVE, SHARD_SIZE
from aimu.aio.providers.openai import OpenAIClient
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer

#: More runs than two httpx pools hold, more than the old default of 16 slots.
RUNS = 2 * SHARD_SIZE + 8
ANSWER = " ".join(f"word{n}" for n in range(10))
HELD = Turn(text=ANSWER, chunks=10, fault="hang", fault_after=1)  # one chunk, then held


def tool_then_held_answer(body: Mapping[str, Any]) -> Turn:
    if any(message.get("role") == "tool" for message in body["messages"]):
        return HELD
    return Turn(tool_calls=[ScriptedCall("lookup", {"city": "Paris"})])


def held_count(server: LoopbackServer) -> int:
    return sum(record.fault == "hang" and record.chunks_sent >= 1 for record in server.streams)


async def test_every_run_is_in_flight_at_once_and_a_cancel_of_all_closes_every_stream() -> None:
    async with LoopbackServer(tool_then_held_answer) as server:
        model = aio.client("openai:test", base_url=server.openai_base_url)
        agent = aio.Agent(model, tools=[lookup])
        sessions = [agent.start() for _ in range(RUNS)]
        streamed = [0] * RUNS
        seen = asyncio.Event()

        async def run(index: int) -> None:
            async for event in sessions[index].run("weather?", stream=True):
                if isinstance(event, aio.TextChunk):
                    streamed[index] += 1
                    if all(streamed):
                        seen.set()

        tasks = [asyncio.create_task(run(index)) for index in range(RUNS)]
        # Every run holds its answer's stream open at once: none queues behind another
        # (the old default of 16 slots left the rest waiting until this timed out).
        await server.wait_until(lambda: held_count(server) == RUNS, timeout=30,
                                what=lambda: f"{held_count(server)} of {RUNS} streams held")
        await asyncio.wait_for(seen.wait(), timeout=30)
        pool: Any = model._pool  # type: ignore[attr-defined]
        assert pool.busy == RUNS
        assert len(pool._shards) >= RUNS // SHARD_SIZE
        for shard in pool._shards:  # no httpx pool grows past its small size
            assert len(shard.http._transport._pool.connections) <= SHARD_SIZE
        for task in tasks:
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
        abandoned = await server.wait_abandoned(RUNS, timeout=30)
        assert {record.fault for record in abandoned} == {"hang"}
        assert pool.busy == 0 and not pool._queue  # every slot given back
        assert all(shard.busy == 0 for shard in pool._shards)
        for session in sessions:  # each kept its partial reply, marked partial
            last = session.messages[-1]
            assert last["role"] == "assistant" and last.get("aimu_partial") is True
            assert last["content"] == "word0 "
        await model.aclose()
    await assert_only_current_task()


async def test_a_burst_after_a_pause_reuses_the_last_bursts_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Runs come in bursts (a tool round, an approval, the next task): after a pause
    longer than httpx's 5 s keep-alive, the next burst still finds its connections."""
    async with LoopbackServer(lambda body: Turn(text="sunny", chunks=2)) as server:
        model = aio.client("openai:test", base_url=server.openai_base_url)

        async def burst() -> None:
            async def one() -> str:
                turn = model.stream_turn([{"role": "user", "content": "weather?"}])
                return "".join([c.text async for c in turn if isinstance(c, TextDelta)])

            assert await asyncio.gather(*(one() for _ in range(3 * SHARD_SIZE))) == [
                "sunny"] * (3 * SHARD_SIZE)

        await burst()
        connected = server.connections_accepted
        pause = 30.0  # httpcore's clock moved on: past its 5 s default, within KEEP_ALIVE
        monkeypatch.setattr(httpcore._async.http11, "time",
                            SimpleNamespace(monotonic=lambda: time.monotonic() + pause))
        assert pause < KEEP_ALIVE
        await burst()
        assert server.connections_accepted == connected
        await model.aclose()
    await assert_only_current_task()


async def test_past_concurrency_a_request_waits_says_so_and_fails_clearly(
    server: LoopbackServer, make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    server.script = [HELD, Turn(text="late"), Turn(text="again")]
    model = make_client(concurrency=1, timeout=0.2)
    first = model.stream_turn([{"role": "user", "content": "one"}])
    assert isinstance(await anext(first), TextDelta)  # holds the only slot
    with caplog.at_level(logging.WARNING, logger="aimu"):
        second = model.stream_turn([{"role": "user", "content": "two"}])
        with pytest.raises(ModelConnectionError, match=r"waited 0.2s for a slot: "
                           r"concurrency=1 requests were in flight"):
            async with asyncio.timeout(10):  # the old semaphore waited for ever
                await anext(second)
    assert "concurrency=1" in caplog.text and "wait for a slot" in caplog.text
    assert len(server.requests) == 1  # the second never went out
    await first.aclose()  # the slot comes back: the next request goes
    chunks = [c async for c in model.stream_turn([{"role": "user", "content": "3"}])]
    assert "late" in "".join(c.text for c in chunks if isinstance(c, TextDelta))
    assert open_connections(model) == 1
    await model.aclose()
    await assert_only_current_task()


async def test_a_slot_handed_to_a_request_cancelled_meanwhile_passes_on(
    server: LoopbackServer, make_client: MakeClient
) -> None:
    server.script = [HELD, Turn(text="third")]
    model = make_client(concurrency=1)
    pool: Any = model._pool  # type: ignore[attr-defined]
    first = model.stream_turn([{"role": "user", "content": "one"}])
    await anext(first)

    async def take(name: str) -> str:
        chunks = model.stream_turn([{"role": "user", "content": name}])
        return "".join([c.text async for c in chunks if isinstance(c, TextDelta)])

    second = asyncio.create_task(take("two"))
    third = asyncio.create_task(take("three"))
    while len(pool._queue) < 2:  # noqa: ASYNC110 - both wait for the slot: provable
        await asyncio.sleep(0)
    await first.aclose()  # hands the slot to the second's waiter...
    second.cancel()  # ...which is cancelled before it runs: the third must get it
    with pytest.raises(asyncio.CancelledError):
        await second
    assert await asyncio.wait_for(third, timeout=10) == "third"
    assert pool.busy == 0 and not pool._queue
    await model.aclose()
    await assert_only_current_task()


def test_concurrency_is_checked() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="concurrency must be >= 1 or None"):
            OpenAIClient("m", base_url="http://127.0.0.1:9/v1", concurrency=bad)  # type: ignore[arg-type]
    unbounded = OpenAIClient("m", base_url="http://127.0.0.1:9/v1", concurrency=None)
    assert unbounded._pool.concurrency is None  # type: ignore[attr-defined]


async def test_a_cancel_landing_as_httpx_gives_the_connection_back_leaves_none_taken(
    server: LoopbackServer, make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # httpx marks a reply closed before httpcore gives its connection back: a cancel
    # landing in between (here at a provable point: httpcore's release, held open) used
    # to leave the connection taken for good, its socket open until the process ended.
    import httpcore._async.http11 as http11

    entered, release = asyncio.Event(), asyncio.Event()
    give_back = http11.AsyncHTTP11Connection._response_closed

    async def held_give_back(self: http11.AsyncHTTP11Connection) -> None:
        entered.set()
        await release.wait()
        await give_back(self)

    monkeypatch.setattr(http11.AsyncHTTP11Connection, "_response_closed", held_give_back)
    server.script = [Turn(text="a b"), Turn(text="c d")]
    model = make_client(concurrency=1)
    pool: Any = model._pool  # type: ignore[attr-defined]

    async def read() -> list[str]:
        chunks = model.stream_turn([{"role": "user", "content": "one"}])
        return [c.text async for c in chunks if isinstance(c, TextDelta)]

    reading = asyncio.create_task(read())
    await entered.wait()  # the reply was read to its end; httpcore is giving it back
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading  # the cancel still reaches the run
    release.set()
    httpcore_pool = pool._shards[0].http._transport._pool
    async with asyncio.timeout(10):  # the old code never gave it back
        while httpcore_pool._requests:  # noqa: ASYNC110 - the close ends in its task
            await asyncio.sleep(0)
    assert pool.busy == 0
    assert open_connections(model) == 1  # kept alive, idle, for the next request
    chunks = [c async for c in model.stream_turn([{"role": "user", "content": "2"}])]
    assert "c d" in "".join(c.text for c in chunks if isinstance(c, TextDelta))
    assert open_connections(model) == 1  # the same connection served it
    await model.aclose()
    await assert_only_current_task()


async def test_a_burst_opens_at_most_max_connecting_connections_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 5,000 runs at once started 5,000 TCP connects in one pass of the loop: the SYN queue
    # overflowed and connects timed out (4,738 runs failed). Now they take turns.
    monkeypatch.setattr(_pool, "MAX_CONNECTING", 2)
    inflight = peak = 0
    two_in, gate = asyncio.Event(), asyncio.Event()
    connect = _backend._connected  # the connect itself, under the pool's slot

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal inflight, peak
        inflight += 1
        peak = max(peak, inflight)
        if inflight == 2:
            two_in.set()
        try:
            await gate.wait()  # held until every request waits for a connect slot
            return await connect(*args, **kwargs)
        finally:
            inflight -= 1

    monkeypatch.setattr(_backend, "_connected", counted)
    server = LoopbackServer([Turn(text=f"answer {n}") for n in range(RUNS)])
    await server.start()
    model = aio.client("openai:test", base_url=server.openai_base_url)
    pool: Any = model._pool  # type: ignore[attr-defined]

    async def take(n: int) -> str:
        chunks = model.stream_turn([{"role": "user", "content": str(n)}])
        return "".join([c.text async for c in chunks if isinstance(c, TextDelta)])

    tasks = [asyncio.create_task(take(n)) for n in range(RUNS)]
    await asyncio.wait_for(two_in.wait(), timeout=30)
    # Provable: every other request waits on the pool's connect slots, none connecting.
    while len(pool.connecting._waiters or ()) < RUNS - 2:  # noqa: ASYNC110
        await asyncio.sleep(0)
    assert inflight == peak == 2
    gate.set()
    answers = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    assert sorted(answers) == sorted(f"answer {n}" for n in range(RUNS))
    assert peak == 2 and inflight == 0
    assert len(server.requests) == RUNS
    await model.aclose()
    await server.stop()
    await assert_only_current_task()
