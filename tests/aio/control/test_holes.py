"""Issue 21's Redis control holes, each against a real Redis (and real processes where a
process is the point): a test per hole that failed before its fix."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.control.redis_control import RedisControl
from aimu.aio.control.worker import Worker
from aimu.aio.events import TextChunk, ToolCallStarted
from aimu.aio.transcript import validate
from aimu.testing.server import LoopbackServer
from tests.aio.control.helpers import LEASE, ROOT, DurableRedis
from tests.aio.control.scripts import TOOLS, Answers, steer
from tests.services import PrivateRedis


async def connected(worker: aio.RedisControl) -> None:
    """Make ``worker`` a worker that is already connected (one run done and published)."""
    agent = aio.Agent(aio.client("test"))
    handle = aio.RunHandle.start(agent.run("warm up"), control=worker)
    await handle
    await worker.registered(handle)
    await worker.flush()
    await agent.aclose()


# -- item 9: a reserved run cancelled before it starts never starts -----------------------


async def test_a_reserved_run_cancelled_before_it_starts_never_starts(
    worker: aio.RedisControl, control: aio.RedisControl
) -> None:
    await connected(worker)
    async with LoopbackServer(Answers()) as server:
        for trial in range(5):
            run_id = await control.reserve(session=f"reserved-{trial}")
            assert await control.cancel(run_id, "changed my mind")
            agent = aio.Agent(aio.client("ollama:m", host=server.url), TOOLS)
            handle = aio.RunHandle.start(
                agent.run("tool never"), run_id=run_id, control=worker
            )
            with pytest.raises(asyncio.CancelledError):
                await handle
            assert server.requests == [], "the model was called for a cancelled run"
            info = await control.wait(run_id, timeout=10)
            assert (info.status, info.reason) == ("cancelled", "changed my mind")
            assert agent.model_client.messages == []
            await agent.aclose()


# -- item 10: a run that must be registered never starts while Redis is down --------------


async def test_a_required_run_with_redis_down_fails_at_once_and_never_starts(
    durable_redis: DurableRedis, prefix: str
) -> None:
    ran: list[str] = []
    async with aio.RedisControl(durable_redis.url, prefix, lease=LEASE) as worker:
        await connected(worker)
        durable_redis.kill()

        async def body() -> str:
            ran.append("started")
            return "done"

        handle = aio.RunHandle.start(body(), control=worker.required(session="s"))
        with pytest.raises(aio.ControlConnectionError, match=str(durable_redis.port)):
            await worker.registered(handle)
        with pytest.raises(asyncio.CancelledError):
            await handle
        assert ran == [] and handle.status == "cancelled"
        assert "not started" in (handle.reason or "")
        durable_redis.start()


# -- item 11: the listener survives bad messages; a forged id blocks nothing --------------


async def test_malformed_and_forged_messages_neither_kill_the_listener_nor_hide_requests(
    redis_url: str, prefix: str, control: aio.RedisControl
) -> None:
    # A lease so long that only the listener can deliver the cancel within the test.
    async with (
        LoopbackServer(Answers()) as server,
        aio.RedisControl(redis_url, prefix, lease=600) as worker,
    ):
        agent = aio.Agent(aio.client("ollama:m", host=server.url), TOOLS)
        handle = aio.RunHandle.start(agent.run("endless"), control=worker)
        run_id = await worker.registered(handle)
        channel = worker._keys.channel_base + worker.worker_id
        client = control._client
        # Redis holds the state: poll it (no race, only the wait for it).
        while (await client.pubsub_numsub(channel))[0][1] < 1:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        for payload in (
            json.dumps({"run": run_id}),  # no id
            "not json",
            json.dumps(["a", "list"]),
            json.dumps({"run": 7, "id": "1-0"}),
            json.dumps({"run": run_id, "id": "99999999999999-0", "kind": "noop", "data": "{}"}),
            json.dumps({"run": "bad:id"}),
        ):
            assert await client.publish(channel, payload) == 1  # the listener got it
        assert await control.cancel(run_id, "after the junk")
        async with asyncio.timeout(30):  # a hang guard: the heartbeat is 200 s away
            with pytest.raises(asyncio.CancelledError):
                await handle
        assert handle.reason == "after the junk"
        assert worker._worker is not None
        assert not any(task.done() for task in worker._worker._main)
        validate(agent.model_client.messages)
        await agent.aclose()


# -- item 12: one damaged run record breaks no listing --------------------------------------


async def test_a_damaged_run_record_reads_as_unknown_fields(control: aio.RedisControl) -> None:
    client, keys = control._client, control._keys
    await client.hset(
        keys.run("damaged"),
        mapping={"status": "weird", "seq": "x", "created_at": "y", "attempt": "z",
                 "ended_at": "nan", "info": "[1, 2]", "result": "{", "usage": "3"},
    )
    await client.zadd(keys.runs, {"damaged": 1})
    good = await control.reserve(session="fine")
    listed = {info.run_id: info for info in await control.runs()}
    assert set(listed) == {"damaged", good}
    damaged = listed["damaged"]
    assert (damaged.status, damaged.events, damaged.attempt) == ("failed", 0, 0)
    assert damaged.created_at is None and damaged.ended_at is None and damaged.info == {}
    assert (await control.status("damaged")).run_id == "damaged"
    assert (await control.latest(["fine"]))["fine"].run_id == good


# -- item 13: lost runs expire, close when their session goes on, pruning goes round ------


async def test_a_running_run_expires_unless_its_heartbeat_goes_on(
    worker: aio.RedisControl, control: aio.RedisControl
) -> None:
    release = asyncio.Event()
    handle = aio.RunHandle.start(release.wait(), control=worker.with_info(session="s"))
    run_id = await worker.registered(handle)
    client, keys = control._client, control._keys
    for key in (keys.run(run_id), keys.requests(run_id), keys.session("s")):
        assert await client.exists(key) == 0 or 0 < await client.ttl(key) <= worker.retention
    assert 0 < await client.ttl(keys.run(run_id)) <= worker.retention
    release.set()
    await handle


async def test_a_lost_run_whose_session_went_on_elsewhere_is_closed(
    worker: aio.RedisControl, control: aio.RedisControl
) -> None:
    client, keys = control._client, control._keys
    # What a killed worker leaves: the record says running, the lease has expired.
    await client.hset(
        keys.run("lostrun"),
        mapping={"status": "running", "worker": "dead-1", "created_at": "1", "attempt": "1",
                 "info": json.dumps({"session": "s"})},
    )
    await client.set(keys.session("s"), "lostrun")
    assert (await control.status("lostrun")).status == "lost"
    agent = aio.Agent(aio.client("test"))
    handle = aio.RunHandle.start(agent.run("again"), control=worker.with_info(session="s"))
    new = await worker.registered(handle)
    await handle
    old = await control.status("lostrun")
    assert old.status == "cancelled" and new in (old.reason or "")
    assert 0 < await client.ttl(keys.run("lostrun")) <= worker.retention
    assert await control.claim("lostrun") is None  # no one resumes it a second time
    assert (await control.latest(["s"]))["s"].run_id == new
    await agent.aclose()


async def test_pruning_goes_past_long_lived_runs_at_the_head(
    worker: aio.RedisControl, control: aio.RedisControl
) -> None:
    client, keys = control._client, control._keys
    for i in range(40):  # long-lived runs at the head of the list
        await client.hset(keys.run(f"old{i}"), mapping={"status": "pending"})
        await client.zadd(keys.runs, {f"old{i}": i + 1})
    await client.zadd(keys.runs, {f"gone{i}": 100 + i for i in range(40)})  # expired
    for _ in range(3):
        agent = aio.Agent(aio.client("test"))
        await aio.RunHandle.start(agent.run("hi"), control=worker)
        await worker.flush()
        await agent.aclose()
    left = await client.zrange(keys.runs, 0, -1)
    assert not [run_id for run_id in left if run_id.startswith("gone")]
    assert len([run_id for run_id in left if run_id.startswith("old")]) == 40


# -- item 14: a cancel just after Redis restarted empty finds the live run ---------------


async def test_a_cancel_just_after_an_empty_restart_reaches_the_live_run(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis_server = PrivateRedis()
    try:
        async with (
            LoopbackServer(Answers()) as server,
            aio.RedisControl(redis_server.url, prefix, lease=LEASE) as worker,
            aio.RedisControl(redis_server.url, prefix, lease=LEASE) as control,
        ):
            agent = aio.Agent(aio.client("ollama:m", host=server.url), TOOLS)
            handle = aio.RunHandle.start(agent.run("endless"), control=worker)
            run_id = await worker.registered(handle)
            async for seen in control.events(run_id):
                if isinstance(seen.event, TextChunk):
                    break
            # The worker registers again only once the cancel found the run unknown.
            gate = asyncio.Event()
            register = Worker._register

            async def held(self: Worker, pipe: Any, run: Any) -> None:
                await gate.wait()
                await register(self, pipe, run)

            reappeared = getattr(RedisControl, "_reappeared", None)

            async def opening(self: RedisControl, wanted: str) -> bool:
                gate.set()
                assert reappeared is not None
                return bool(await reappeared(self, wanted))

            monkeypatch.setattr(Worker, "_register", held)
            monkeypatch.setattr(RedisControl, "_reappeared", opening, raising=False)
            redis_server.stop()
            redis_server.start()  # empty: no persistence
            assert await control.cancel(run_id, "after the restart")
            async with asyncio.timeout(30):
                with pytest.raises(asyncio.CancelledError):
                    await handle
            assert handle.reason == "after the restart"
            monkeypatch.undo()
            async with asyncio.timeout(30):
                await worker.flush()
            assert (await control.status(run_id)).status == "cancelled"
            await agent.aclose()
    finally:
        redis_server.stop()


# -- item 15: a worker that never closes its control still publishes the end ------------


WORKER_THAT_FORGETS = """
import asyncio, logging, sys
from aimu import aio

logging.basicConfig(level=logging.WARNING)

async def main(url: str, prefix: str) -> None:
    control = aio.RedisControl(url, prefix)   # never closed
    agent = aio.Agent(aio.client("test"))
    handle = aio.RunHandle.start(agent.run("hello"), control=control)
    print(await control.registered(handle), flush=True)
    await handle  # and the loop closes at once: the end is still in the worker's hands

asyncio.run(main(*sys.argv[1:]))
"""


async def test_a_worker_that_exits_without_closing_publishes_the_end_and_warns(
    redis_url: str, prefix: str, control: aio.RedisControl, tmp_path: Path
) -> None:
    script = tmp_path / "forgets.py"
    script.write_text(WORKER_THAT_FORGETS)
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(script), redis_url, prefix],
        capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.strip()
    info = await control.status(run_id)
    assert info.status == "completed", (info, done.stderr)
    assert "Traceback" not in done.stderr
    events = [e async for e in control.events(run_id)]
    assert events[-1].event.type == "handle_finished"


# -- item 18: stop() validates before it sends ---------------------------------------------


@pytest.mark.parametrize("grace", [float("nan"), float("inf"), -1.0, 10**400],
                         ids=["nan", "inf", "-1", "10**400"])
async def test_stop_with_a_bad_grace_sends_nothing(control: aio.RedisControl, grace: float) -> None:
    run_id = await control.reserve()
    with pytest.raises(ValueError, match="grace"):
        await control.stop(run_id, grace)
    assert await control._client.xlen(control._keys.requests(run_id)) == 0
    assert (await control.status(run_id)).status == "pending"


# -- item 25: wait() sees an end that came while it started ---------------------------------


async def test_wait_sees_an_end_that_lands_as_it_starts(
    worker: aio.RedisControl, control: aio.RedisControl, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = asyncio.Event()
    handle = aio.RunHandle.start(release.wait(), control=worker)
    run_id = await worker.registered(handle)
    status = RedisControl.status

    async def ending(self: RedisControl, wanted: str) -> aio.RunInfo:
        info = await status(self, wanted)
        if not release.is_set():  # the run ends right after wait() read it running
            release.set()
            await handle
            await worker.flush()
        return info

    async def end_once_waiting() -> None:
        # Provable point: wait() blocks reading the run's events; then the run ends.
        mine = f"aimu-{control.worker_id}"
        while not release.is_set():
            clients = await worker._client.client_list()
            if any(c["name"] == mine and c["cmd"] == "xread" and "b" in c["flags"]
                   for c in clients):
                release.set()
            await asyncio.sleep(0.005)

    monkeypatch.setattr(RedisControl, "status", ending)
    # A read that blocks past the socket timeout fails: an end missed shows as an error.
    monkeypatch.setattr("aimu.aio.control.redis_control._FOLLOW_BLOCK_MS", 3_600_000)
    ender = asyncio.ensure_future(end_once_waiting())
    async with asyncio.timeout(60):
        info = await control.wait(run_id)
    await ender
    assert info.status == "completed"


async def waiting_in_xread(control: aio.RedisControl) -> None:
    """Return once ``control``'s connection blocks reading a run's events (a provable
    point, read off Redis's client list)."""
    mine = f"aimu-{control.worker_id}"
    while True:
        clients = await control._client.client_list()
        if any(c["name"] == mine and c["cmd"] == "xread" and "b" in c["flags"] for c in clients):
            return
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("seconds", [1e308, 10**300], ids=["1e308", "10**300"])
async def test_wait_and_stop_take_a_huge_finite_timeout(
    worker: aio.RedisControl, control: aio.RedisControl, seconds: float
) -> None:
    """Issue 29 item 5: a timeout or grace of 1e308 s waited in blocks of at most a few
    seconds (it raised OverflowError turning it into milliseconds)."""
    release = asyncio.Event()
    handle = aio.RunHandle.start(release.wait(), control=worker)
    run_id = await worker.registered(handle)
    waiter = asyncio.ensure_future(control.wait(run_id, timeout=seconds))
    blocked = asyncio.ensure_future(waiting_in_xread(control))
    async with asyncio.timeout(30):
        await asyncio.wait([waiter, blocked], return_when=asyncio.FIRST_COMPLETED)
        blocked.cancel()
        assert not waiter.done(), waiter.result()
        release.set()
        assert (await waiter).status == "completed"
        with pytest.raises(ValueError, match="timeout"):
            await control.wait(run_id, timeout=10**400)
        with pytest.raises(ValueError, match="timeout"):
            await control.stop(run_id, 1.0, timeout=float("nan"))


# -- item 2: a send near the run's end is taken, or refused, never both, never neither ---


async def test_a_send_near_the_end_is_stored_exactly_when_it_is_accepted(
    worker: aio.RedisControl, control: aio.RedisControl, monkeypatch: pytest.MonkeyPatch,
    send_arrived: asyncio.Event,
) -> None:
    arrived = send_arrived
    # Hold each run's end in the worker until the test lets it go.
    ends = asyncio.Event()
    publish = Worker._publish

    async def held(self: Worker, pipe: Any, run: Any) -> Any:
        if run.tap.ended:
            await ends.wait()
        return await publish(self, pipe, run)

    monkeypatch.setattr(Worker, "_publish", held)

    async def wait_for_send() -> str:
        """Wait until a send reached the worker."""
        await arrived.wait()
        return "a send arrived"

    outcomes: list[tuple[str, bool, bool]] = []
    async with LoopbackServer(steer) as server:
        for trial in range(24):
            arrived.clear()
            ends.clear()
            agent = aio.Agent(aio.client("ollama:m", host=server.url), [wait_for_send])
            handle = aio.RunHandle.start(agent.run(f"steer {trial}"), control=worker)
            run_id = await worker.registered(handle)
            text = f"text {trial}"
            if trial % 2 == 0:  # lands at the step boundary the run waits at
                ends.set()
                async for seen in control.events(run_id):
                    if isinstance(seen.event, ToolCallStarted):
                        break
                accepted = await control.send(run_id, text)
                await handle
            else:  # lands after the run ended, before its end reached Redis
                arrived.set()
                await handle
                sending = asyncio.ensure_future(control.send(run_id, text))
                requests = control._keys.requests(run_id)
                while not await control._client.xlen(requests):  # noqa: ASYNC110 - stored
                    await asyncio.sleep(0.005)
                ends.set()
                accepted = await sending
            await worker.flush()
            messages = agent.model_client.messages
            validate(messages)
            stored = any(m["role"] == "user" and m["content"] == text for m in messages)
            outcomes.append(("boundary" if trial % 2 == 0 else "ended", accepted, stored))
            await agent.aclose()
    assert all(accepted == stored for _, accepted, stored in outcomes), outcomes
    assert {(where, accepted) for where, accepted, _ in outcomes} == {
        ("boundary", True), ("ended", False)
    }
