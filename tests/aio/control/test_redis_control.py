"""RedisControl in one process with two controls (a worker's and a controller's) on a
real Redis: every request crosses Redis and pub/sub as it would between hosts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from aimu import aio
from aimu.aio.control.scripts import PRUNE
from aimu.aio.events import HandleFinished, TextChunk, ToolCallStarted
from aimu.aio.transcript import validate
from aimu.testing.script import Turn
from aimu.testing.server import LoopbackServer
from tests import services
from tests.aio.control.scripts import TOOLS, Answers


@pytest.fixture
async def server() -> AsyncIterator[LoopbackServer]:
    async with LoopbackServer(Answers()) as running:
        yield running


@pytest.fixture
async def agent(server: LoopbackServer) -> AsyncIterator[aio.Agent]:
    made = aio.Agent(aio.client("ollama:m", host=server.url), TOOLS)
    yield made
    await made.aclose()


async def start(
    agent: aio.Agent,
    worker: aio.RedisControl,
    control: aio.RedisControl,
    task: str,
    until: type[object] = TextChunk,
) -> tuple[aio.RunHandle[str], str]:
    """Start ``task`` under ``worker``; follow it from ``control`` until an ``until`` event."""
    handle = aio.RunHandle.start(agent.run(task), control=worker)
    run_id = await worker.registered(handle)
    async for seen in control.events(run_id):
        if isinstance(seen.event, until):
            return handle, run_id
    raise AssertionError(f"the run ended before a {until.__name__}")


async def test_a_cancel_from_another_control_stops_the_stream(
    server: LoopbackServer,
    agent: aio.Agent,
    worker: aio.RedisControl,
    control: aio.RedisControl,
) -> None:
    handle, run_id = await start(agent, worker, control, "endless")
    assert await control.cancel(run_id, "user pressed stop")
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert handle.status == "cancelled" and handle.reason == "user pressed stop"
    await server.wait_abandoned(1)
    info = await control.wait(run_id, timeout=10)
    assert (info.status, info.reason, info.attempt) == ("cancelled", "user pressed stop", 1)
    validate(agent.model_client.messages)
    # Repeats are harmless: refused as finished, nothing changes.
    assert not await control.cancel(run_id, "again")
    assert (await control.status(run_id)).reason == "user pressed stop"
    seen = [e async for e in control.events(run_id)]
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
    assert isinstance(seen[-1].event, HandleFinished) and seen[-1].event.status == "cancelled"
    assert sum(isinstance(e.event, HandleFinished) for e in seen) == 1


async def test_interrupt_lands_at_the_step_boundary(
    server: LoopbackServer,
    agent: aio.Agent,
    worker: aio.RedisControl,
    control: aio.RedisControl,
) -> None:
    # Provable point: hold() runs until the interrupt arrives.
    handle, run_id = await start(agent, worker, control, "tool first", ToolCallStarted)
    assert await control.interrupt(run_id)
    assert await handle == "Run interrupted."
    info = await control.wait(run_id, timeout=10)
    assert info.status == "interrupted"
    assert [m["role"] for m in agent.model_client.messages] == ["user", "assistant", "tool"]
    validate(agent.model_client.messages)


async def test_stop_cancels_a_run_that_outlives_its_grace(
    server: LoopbackServer,
    agent: aio.Agent,
    worker: aio.RedisControl,
    control: aio.RedisControl,
) -> None:
    handle, run_id = await start(agent, worker, control, "endless")
    info = await control.stop(run_id, grace=0.05)
    assert info.status == "cancelled" and info.reason is not None and "stop()" in info.reason
    assert handle.status == "cancelled"
    await server.wait_abandoned(1)
    validate(agent.model_client.messages)


async def test_a_cancel_before_the_run_starts_is_honoured_when_it_starts(
    server: LoopbackServer,
    agent: aio.Agent,
    worker: aio.RedisControl,
    control: aio.RedisControl,
) -> None:
    run_id = await control.reserve(session="s1")
    assert (await control.status(run_id)).status == "pending"
    assert await control.cancel(run_id, "changed my mind")
    assert await control.cancel(run_id, "changed my mind")  # repeats are harmless
    handle = aio.RunHandle.start(agent.run("endless"), run_id=run_id, control=worker)
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert handle.reason == "changed my mind"
    info = await control.wait(run_id, timeout=10)
    assert (info.status, info.reason) == ("cancelled", "changed my mind")
    assert info.info == {"session": "s1"}
    validate(agent.model_client.messages)


async def test_a_follower_that_reconnects_sees_every_event_once(
    server: LoopbackServer,
    agent: aio.Agent,
    worker: aio.RedisControl,
    control: aio.RedisControl,
) -> None:
    handle = aio.RunHandle.start(agent.run("quick"), control=worker)
    run_id = await worker.registered(handle)
    first: list[aio.RunEvent] = []
    async for seen in control.events(run_id):
        first.append(seen)
        if len(first) == 2:
            break  # the follower goes away mid-run
    await handle
    rest = [e async for e in control.events(run_id, after=first[-1].id)]
    whole = [e async for e in control.events(run_id)]
    assert [e.id for e in first + rest] == [e.id for e in whole]
    assert [e.seq for e in whole] == list(range(1, len(whole) + 1))
    assert whole[-1].event.type == "handle_finished" and whole[-1].event.result == "quick answer"


async def test_runs_lists_what_runs_where(
    server: LoopbackServer,
    agent: aio.Agent,
    worker: aio.RedisControl,
    control: aio.RedisControl,
) -> None:
    handle = aio.RunHandle.start(agent.run("endless"), control=worker.with_info(user="ann"))
    run_id = await worker.registered(handle)
    (listed,) = await control.runs()
    assert (listed.run_id, listed.status, listed.worker) == (run_id, "running", worker.worker_id)
    assert listed.info == {"user": "ann"}
    with pytest.raises(TimeoutError, match="still running"):
        await control.wait(run_id, timeout=0.05)
    handle.cancel()
    assert (await control.wait(run_id, timeout=10)).status == "cancelled"


async def test_bad_input_gets_a_clear_error_and_changes_nothing(
    redis_url: str, agent: aio.Agent, worker: aio.RedisControl, control: aio.RedisControl
) -> None:
    handle = aio.RunHandle.start(agent.run("quick"), control=worker)
    run_id = await worker.registered(handle)
    await handle
    await control.wait(run_id, timeout=10)
    client = control._client
    before = sorted([k async for k in client.scan_iter(match=f"{control.prefix}:*")])
    with pytest.raises(aio.UnknownRunError, match="no run 'nope' under prefix"):
        await control.cancel("nope")
    for call in (control.status, control.interrupt, control.claim):
        with pytest.raises(aio.UnknownRunError):
            await call("nope")
    with pytest.raises(aio.UnknownRunError):
        await control.wait("nope", timeout=1)
    with pytest.raises(aio.UnknownRunError):
        await anext(aiter(control.events("nope")))
    for bad in ("", "a b", "x" * 129, "../etc", f"{control.prefix}:run:{run_id}"):
        with pytest.raises(ValueError, match="run id"):
            await control.cancel(bad)
    with pytest.raises(TypeError):
        await control.cancel(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bad event id"):
        control.events(run_id, after="yesterday")
    with pytest.raises(ValueError, match="malformed run id"):
        aio.RunHandle.start(agent.run("quick"), run_id="no spaces", control=worker)
    # The same run seen through another prefix does not exist there.
    async with aio.RedisControl(redis_url, control.prefix + "-other") as other:
        with pytest.raises(aio.UnknownRunError, match="-other"):
            await other.status(run_id)
    after = sorted([k async for k in client.scan_iter(match=f"{control.prefix}:*")])
    assert after == before


async def test_urls_that_are_not_redis_fail_clearly_and_hide_the_password(
    server: LoopbackServer,
) -> None:
    with pytest.raises(ValueError, match=r"not a Redis URL: 'http://\*\*\*@127"):
        aio.RedisControl("http://user:s3cret@127.0.0.1:1/0")
    port = services.free_port()
    control = aio.RedisControl(f"redis://:s3cret@127.0.0.1:{port}/0")
    assert "s3cret" not in repr(control) and "***" in repr(control)
    with pytest.raises(aio.ControlConnectionError) as refused:
        await control.connect()
    assert f"127.0.0.1:{port}" in str(refused.value) and "s3cret" not in str(refused.value)
    assert refused.value.__cause__ is None and "s3cret" not in repr(refused.value.__context__)
    await control.aclose()
    # An HTTP server where Redis was expected.
    http = aio.RedisControl(f"redis://:s3cret@127.0.0.1:{server.port}/0", timeout=0.5)
    with pytest.raises(aio.ControlConnectionError, match="is this a Redis server") as wrong:
        await http.connect()
    assert "s3cret" not in str(wrong.value)
    await http.aclose()


@aio.tool(approval=True)
def hold() -> str:
    """Hold (a person approves it first)."""
    return "held"


async def paused(
    agent: aio.Agent, worker: aio.RedisControl, control: aio.RedisControl,
    task: str = "tool please",
) -> tuple[aio.RunHandle[str], str]:
    """Start a run that calls ``hold`` under ``worker``; once Redis says it paused."""
    handle = aio.RunHandle.start(agent.run(task), control=worker)
    run_id = await worker.registered(handle)
    info = await control.wait(run_id, timeout=30)
    assert info.status == "paused" and info.done
    return handle, run_id


async def test_a_paused_run_reads_paused_everywhere(
    server: LoopbackServer, worker: aio.RedisControl, control: aio.RedisControl
) -> None:
    async with aio.Agent(aio.client("ollama:m", host=server.url), [hold]) as agent:
        handle, run_id = await paused(agent, worker, control)
    assert handle.status == "paused"
    assert (await control.status(run_id)).status == "paused"


async def test_a_paused_run_is_reopened_for_its_resumed_part_or_recorded_cancelled(
    server: LoopbackServer, worker: aio.RedisControl, control: aio.RedisControl
) -> None:
    async with aio.Agent(aio.client("ollama:m", host=server.url), [hold]) as agent:
        # Its resumed part answers at once (not a 20 s stream raced against the wait).
        _, run_id = await paused(agent, worker, control, "tool then done")
        assert await control.reopen(run_id)
        assert (await control.status(run_id)).status == "pending"
        assert not await control.reopen(run_id), "only a paused run is reopened"
        [call] = agent.pending_approvals
        agent.approve(call.call_id)
        resumed = aio.RunHandle.start(agent.resume(), run_id=run_id, control=worker)
        await worker.registered(resumed)  # the same id, taken again
        info = await control.wait(run_id, timeout=30)
        assert (info.status, info.attempt) == ("completed", 2)
        assert not await control.cancel_paused(run_id, "late"), "it is not paused"

        _, other = await paused(agent, worker, control)
        assert await control.cancel_paused(other, "nobody decided")
        info = await control.status(other)
        assert (info.status, info.reason, info.done) == ("cancelled", "nobody decided", True)
        assert not await control.cancel(other), "a cancelled run takes no more requests"
    with pytest.raises(aio.UnknownRunError, match="no-such-run"):
        await control.reopen("no-such-run")


async def test_registering_a_run_drops_expired_runs_from_the_list(
    agent: aio.Agent, worker: aio.RedisControl, control: aio.RedisControl, prefix: str
) -> None:
    client = control._client
    alive = await control.reserve()  # listed, its record alive: kept
    # Runs whose records expired: listed until a registration (not only runs()) drops them.
    await client.zadd(f"{prefix}:runs", {f"gone{i}": 0.5 + i for i in range(40)})
    handle = aio.RunHandle.start(agent.run("quick"), control=worker)
    run_id = await worker.registered(handle)
    listed = set(await client.zrange(f"{prefix}:runs", 0, -1))
    assert {alive, run_id} <= listed
    assert len([i for i in listed if i.startswith("gone")]) == 40 - PRUNE
    await control.wait(run_id, timeout=10)


async def test_a_run_whose_answer_was_cut_off_ends_incomplete_and_done(
    control: aio.RedisControl, worker: aio.RedisControl
) -> None:
    async with LoopbackServer([Turn(text="cut in the mid", stop_reason="length")]) as cutting:
        agent = aio.Agent(aio.client("ollama:m", host=cutting.url))
        handle = aio.RunHandle.start(agent.run("go"), control=worker)
        run_id = await worker.registered(handle)
        assert await handle == "cut in the mid"
        info = await control.wait(run_id, timeout=10)
        await agent.aclose()
    assert info.status == "incomplete" and info.done
    assert agent.last_run is not None and agent.last_run.run_id == run_id


async def test_more_followers_than_redis_py_pools_by_default_leave_commands_working(
    control: aio.RedisControl, redis_url: str, prefix: str
) -> None:
    # redis-py 8 caps a connection pool at 100: with 100 followers waiting (each holds a
    # connection in XREAD BLOCK) every other command failed "Too many connections".
    run_id = await control.reserve(session="s1")
    followers = [asyncio.create_task(control.wait(run_id)) for _ in range(120)]
    async with aio.RedisControl(redis_url, prefix) as other:
        name = f"aimu-{control.worker_id}"

        async def mine() -> int:
            clients = await other._client.client_list()
            return sum(c.get("name") == name and c.get("cmd") == "xread" for c in clients)

        async with asyncio.timeout(30):  # (at most 100 got there before the fix)
            while await mine() < 120:  # noqa: ASYNC110 - every follower in XREAD: provable
                await asyncio.sleep(0.05)
        assert (await control.status(run_id)).status == "pending"
        assert await control.cancel(run_id)  # recorded, obeyed when the run starts
    for follower in followers:
        follower.cancel()
    outcomes = await asyncio.gather(*followers, return_exceptions=True)
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes[:3]
