"""Runs on Temporal against a real dev server: complete, cancel (through Temporal and
through Redis), cancel before any worker, pause with every worker gone, unreachable."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aimu import aio
from aimu.aio.errors import ControlConnectionError
from aimu.aio.store import SQLiteStore
from aimu.temporal import RequestRefused, RunsClient
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from tests.aio.test_images import png
from tests.serve.test_steer import PNG_URL
from tests.services import free_port, redis_url
from tests.temporal.conftest import Workers

PNG_HEAD = b"\x89PNG\r\n\x1a\n"
SLOW = Turn("one two three four five six seven eight nine ten " * 20, delay=0.05)
#: A reply that outlasts every wait of a test (200 s): a test that stops it mid-stream
#: never bets that the stop lands before the reply ends (SLOW's 10 s did not, on a host
#: with three busy loops beside the suite).
HELD = Turn("one two three four five six seven eight nine ten " * 20, delay=1.0)


async def restorable(store: SQLiteStore, session: str) -> list[dict[str, object]]:
    """The stored transcript, after checking that an agent accepts it."""
    messages = await store.load(session)
    aio.Agent(aio.client("test")).restore(messages)  # raises on an invalid transcript
    return messages  # type: ignore[return-value]


@pytest.mark.parametrize("sandboxed", [True, False], ids=["sandboxed", "no sandbox"])
async def test_a_run_completes_with_its_events_and_transcript(
    sandboxed: bool, runs: RunsClient, workers: Workers, store: SQLiteStore
) -> None:
    await workers.start(sandboxed=sandboxed)
    run_id = await runs.start("s1", "hello there")
    events = [event async for _, event in runs.events(run_id)]
    assert events[0]["type"] == "run_started", events
    assert events[-1]["type"] == "handle_finished" and events[-1]["status"] == "completed"
    state = await runs.wait(run_id)
    assert state["status"] == "completed" and state["reply"] == "You said: hello there"
    messages = await restorable(store, "s1")
    assert [m["role"] for m in messages] == ["user", "assistant"]  # the task stored once
    assert (await store.info("s1")).status == "completed"  # type: ignore[union-attr]


@pytest.mark.parametrize("through", ["temporal", "redis"])
async def test_cancel_mid_stream_closes_the_stream_and_keeps_a_valid_transcript(
    through: str, temporal: str, queue: str, workers: Workers, store: SQLiteStore,
    model_server: LoopbackServer,
) -> None:
    model_server.script = [HELD, Turn("resumed")]
    control = None
    if through == "redis":
        control = aio.RedisControl(redis_url(), f"aimu_test_t-{queue}")
        await control.connect()
    try:
        runs = await RunsClient.connect(temporal, queue, redis=control, heartbeat_timeout=2.0)
        await workers.start(redis=control)
        run_id = await runs.start("s1", "talk")
        async for _, event in runs.events(run_id):
            if event["type"] == "text":
                break  # provably mid-stream: the worker read a chunk of the reply
        assert await runs.cancel(run_id, "the user pressed Stop")
        await model_server.wait_abandoned(1, timeout=30)
        state = await runs.wait(run_id, timeout=60)
        assert state["status"] == "cancelled"
        assert state["reason"] == "the user pressed Stop"
        assert (await store.info("s1")).status == "cancelled"  # type: ignore[union-attr]
        record = await store.run(run_id)  # the caller's reason reached the run
        assert record is not None and record.reason == "the user pressed Stop"
        if control is not None:
            assert (await control.wait(run_id, timeout=30)).status == "cancelled"
        messages = await restorable(store, "s1")
        assert messages[-1]["role"] == "assistant" and messages[-1].get("aimu_partial")
        assert not await runs.cancel(run_id), "a second cancel finds the run ended"
        # resumable: a resume run continues from the stored transcript
        resumed = await runs.resume(run_id)
        assert (await runs.wait(resumed, timeout=60))["status"] == "completed"
        assert (await store.load("s1"))[-1]["content"] == "resumed"
    finally:
        if control is not None:
            await control.aclose()


async def test_cancel_before_any_worker_takes_the_run_never_calls_the_model(
    runs: RunsClient, workers: Workers, model_server: LoopbackServer, store: SQLiteStore
) -> None:
    run_id = await runs.start("s1", "never asked")
    assert await runs.cancel(run_id, "changed my mind")
    await workers.start()
    state = await runs.wait(run_id, timeout=60)
    assert state["status"] == "cancelled"
    assert model_server.requests == []
    assert await store.load("s1") == []


async def test_a_paused_run_holds_no_worker_and_a_later_worker_completes_it(
    runs: RunsClient, workers: Workers, store: SQLiteStore
) -> None:
    done: list[str] = []

    @aio.tool(approval=True)
    def transfer(amount: int) -> str:
        """Move money."""
        done.append("transfer")
        return "moved"

    worker = await workers.start(tools=[transfer])
    run_id = await runs.start("s1", "pay")
    async for _, event in runs.events(run_id):
        if event["type"] == "run_finished":
            assert event["status"] == "paused"
            break
    state = await runs.status(run_id)
    assert state["status"] == "paused"
    [pending] = state["pending"]
    with pytest.raises(RequestRefused, match="waits on no tool call"):
        await runs.approve(run_id, "no-such-call")
    await workers.stop(worker)  # every worker gone: the pause waits in Temporal
    assert await runs.approve(run_id, pending["call_id"]) is None  # nobody could say
    await workers.start(tools=[transfer])
    state = await runs.wait(run_id, timeout=60)
    assert state["status"] == "completed"
    assert done == ["transfer"]
    await restorable(store, "s1")


async def test_an_external_tools_call_waits_for_its_result_and_the_worker_goes_on_with_it(
    temporal: str, queue: str, workers: Workers, store: SQLiteStore,
    model_server: LoopbackServer,
) -> None:
    """Serve's runs on Temporal: the external tools a request sets (AG-UI's page tools)
    reach the worker through the session's state, and the call's result travels in the
    decision; the worker goes on with it without asking the model again."""
    from aimu.serve.agents import agent_factory
    from aimu.serve.backends.temporal import TemporalBackend
    from aimu.serve.runs import Runs

    model_server.script = [Turn(tool_calls=[ScriptedCall("locate", {})]), Turn("in Oslo")]
    await workers.start()
    backend = TemporalBackend(temporal, queue, store)
    await backend.connect()
    agents, close = agent_factory(aio.client("test"), store)
    served = Runs(backend, store, agents)
    try:
        view = await served.start("ext", "where am I?", lambda agent: agent.set_external_tools(
            [aio.external_tool("locate", "Where the user is")]))
        record = backend.record(view.run_id)
        async with asyncio.timeout(60):
            while not record.ended:
                await record.changed(5)
        paused, [pending] = await served.paused_on("ext")
        assert paused == view.run_id and pending["external"] is True
        tools = model_server.requests[0].body["tools"]
        assert [t["function"]["name"] for t in tools] == ["locate"]
        decided = await served.decide(view.run_id, pending["call_id"], True, None,
                                      pending["pause_id"], "Oslo")
        resumed = backend.record(decided["resumed_run_id"])
        async with asyncio.timeout(60):
            while not resumed.ended:
                await resumed.changed(5)
        assert resumed.view.status == "completed" and resumed.view.reply == "in Oslo"
        assert len(model_server.requests) == 2  # the paused turn was not asked again
    finally:
        await served.aclose()
        await close()
    messages = await restorable(store, "ext")
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["Oslo"]


async def test_send_and_interrupt_reach_the_running_turn(
    runs: RunsClient, workers: Workers, model_server: LoopbackServer, store: SQLiteStore
) -> None:
    model_server.script = [SLOW, Turn("joined")]
    await workers.start()
    run_id = await runs.start("s1", "talk")
    async for _, event in runs.events(run_id):
        if event["type"] == "text":
            break
    # Bad images, and images past what a run on Temporal may be sent in a turn, are
    # refused at the call (by the workflow for the sum of several sends): none is recorded.
    with pytest.raises(ValueError, match="not an image"):
        await runs.send(run_id, "a bad one", images=[b"text"])
    with pytest.raises(ValueError, match="more than the 1 MB"):
        await runs.send(run_id, "a big one", images=[PNG_HEAD + bytes(800_000)])
    requests = len(model_server.requests)
    await runs.send(run_id, "also this", images=[png(), PNG_HEAD + bytes(400_000)])
    with pytest.raises(RequestRefused, match=r"this turn's come to 1\.1 MB"):
        await runs.send(run_id, "and this", images=[PNG_HEAD + bytes(400_000)])
    # The workflow takes images only as data: URLs: a path sent by another client would
    # be read from a worker's disk.
    with pytest.raises(RequestRefused, match="must be data: URLs"):
        await runs._update(run_id, "aimu.send", "a path", ["/etc/hostname"])
    state = await runs.wait(run_id, timeout=60)
    assert state["status"] == "completed"
    messages = await restorable(store, "s1")
    contents = [m.get("content") for m in messages]
    assert contents.count("also this") == 1 and contents[-1] == "joined"
    assert not {"a bad one", "a big one", "and this", "a path"} & set(contents)
    [sent] = [m for m in messages if m.get("content") == "also this"]
    assert sent["images"][0] == PNG_URL and len(sent["images"]) == 2
    # The images went on the wire once (Ollama's bare base64), in the request after the send.
    (request,) = model_server.requests[requests:]
    assert request.body["messages"][-1]["images"] == [
        url.partition(",")[2] for url in sent["images"]
    ]
    with pytest.raises(RequestRefused, match="not sent"):
        await runs.send(run_id, "too late")


async def test_unreachable_temporal_is_a_prompt_error_naming_the_address() -> None:
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ControlConnectionError, match=address.replace(".", r"\.")):
        await RunsClient.connect(address, "q")
    assert time.monotonic() - started < 30  # never a hang (a generous bound, not a timing)


@pytest.mark.parametrize("address", ["127.0.0.1:\u00b2", "127.0.0.1:\u0667233", "7233"])
async def test_an_address_whose_port_is_no_ascii_number_is_refused_as_such(address: str) -> None:
    with pytest.raises(ValueError, match="give HOST:PORT"):
        await RunsClient.connect(address, "q")


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_the_commands_say_in_one_line_that_temporal_is_unreachable(
    command: str, tmp_path: Path
) -> None:
    address = f"127.0.0.1:{free_port()}"
    extra = ["--port", str(free_port())] if command == "serve" else []
    done = subprocess.run(
        [sys.executable, "-m", "aimu", command, "--temporal", address, "--task-queue", "q",
         "--store", str(tmp_path / "s.db"), "--no-tools", *extra],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"aimu {command}: cannot reach Temporal at {address}"), line


async def test_a_second_server_reports_and_stops_a_run_the_first_started(
    temporal: str, queue: str, workers: Workers, store: SQLiteStore,
    model_server: LoopbackServer,
) -> None:
    from aimu.aio.steering import Steer
    from aimu.serve.backends.temporal import TemporalBackend
    from aimu.serve.errors import Conflict, NotFound

    model_server.script = [HELD]
    await workers.start()
    first, second = (TemporalBackend(temporal, queue, store) for _ in range(2))
    for server in (first, second):
        await server.connect()
    try:
        started = await first.start("s1", "talk", None)
        await model_server.wait_requests(1, timeout=60)  # streaming on the worker
        view = await second.view(started.run_id)
        assert (view.session, view.task) == ("s1", "talk")
        await second.request(started.run_id, Steer("cancel", reason="from the other server"))
        record = first.record(started.run_id)
        async with asyncio.timeout(60):
            while not record.ended:
                await record.changed(5)
        assert record.view.status == "cancelled"
        assert record.view.reason == "from the other server"
        await model_server.wait_abandoned(1, timeout=30)
        with pytest.raises(Conflict, match="already ended"):
            await second.request(started.run_id, Steer("cancel"))
        with pytest.raises(NotFound):
            await second.view("no-such-run")
    finally:
        await first.aclose()
        await second.aclose()


@pytest.mark.parametrize("how", ["interrupt", "stop", "older interrupt", "older stop"])
async def test_interrupt_ends_at_the_step_boundary_and_stop_cancels_after_its_grace(
    how: str, runs: RunsClient, workers: Workers, model_server: LoopbackServer,
    store: SQLiteStore,
) -> None:
    """``older``: as an aimu before Steer traveled as itself asked (the signals
    ``aimu.interrupt`` and ``aimu.stop``, which a run's history may hold too)."""
    older, how = how.startswith("older "), how.removeprefix("older ")

    async def lookup(ctx: aio.ToolContext, query: str) -> str:
        """Look it up; with an interrupt to land, only once the turn has it (the step it
        ends is provably this one, however late the control arrives)."""
        while how == "interrupt" and not ctx.interrupt_requested:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        return "found"

    model_server.script = [
        Turn("let me look " * 12, tool_calls=(ScriptedCall("lookup", {"query": "x"}),),
             delay=0.05),
        HELD,
    ]
    await workers.start(tools=[lookup])
    run_id = await runs.start("s1", "talk")
    async for _, event in runs.events(run_id):
        if event["type"] == "text":
            break  # mid-stream on the worker
    workflow = runs.client.get_workflow_handle(run_id)
    if how == "interrupt":
        if older:
            await workflow.signal("aimu.interrupt")
        else:
            assert await runs.interrupt(run_id)
        state = await runs.wait(run_id, timeout=60)
        assert state["status"] == "interrupted"
        assert len(model_server.streams) == 1  # the step finished, no second turn began
        assert model_server.streams[0].completed
        assert [m["role"] for m in await store.load("s1")][-1] == "tool"  # its tool round
    else:
        if older:
            await workflow.signal("aimu.stop", 0.0)
            state = await runs.wait(run_id, timeout=60)
        else:
            state = await runs.stop(run_id, grace=0)
        assert state["status"] == "cancelled"  # the grace ran out: cancelled, not retried
        await model_server.wait_abandoned(1, timeout=30)
        assert (await store.info("s1")).status == "cancelled"  # type: ignore[union-attr]
    await restorable(store, "s1")
    assert not await runs.interrupt(run_id), "the run has ended"


#: The model's first turn: it calls ``transfer``, which waits for approval.
PAY = Turn("", tool_calls=(ScriptedCall("transfer", {"amount": 5}),))


def approval_tool() -> tuple[aio.Tool, list[str]]:
    """A ``transfer`` tool that needs approval, and the list each of its runs adds to."""
    done: list[str] = []

    @aio.tool(approval=True)
    def transfer(amount: int) -> str:
        """Move money."""
        done.append("transfer")
        return "moved"

    return transfer, done


async def paused(runs: RunsClient, run_id: str) -> dict[str, object]:
    """The run's state once the workflow holds it paused (its turn has returned)."""
    async for _, event in runs.events(run_id):
        if event["type"] == "run_finished":
            assert event["status"] == "paused", event
            break
    async with asyncio.timeout(60):
        while (state := await runs.status(run_id))["status"] != "paused":  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # the turn's outcome is on its way to the workflow
    return state


@pytest.mark.parametrize("with_redis", [False, True])
async def test_a_run_cancelled_while_paused_is_cancelled_in_temporal_redis_and_the_store(
    with_redis: bool, temporal: str, queue: str, workers: Workers, store: SQLiteStore,
    model_server: LoopbackServer,
) -> None:
    transfer, done = approval_tool()
    model_server.script = [PAY]
    control = aio.RedisControl(redis_url(), f"aimu_test_t-{queue}") if with_redis else None
    if control is not None:
        await control.connect()
    try:
        runs = await RunsClient.connect(temporal, queue, redis=control, heartbeat_timeout=2.0)
        await workers.start(tools=[transfer], redis=control)
        run_id = await runs.start("s1", "pay")
        await paused(runs, run_id)
        assert (await store.info("s1")).status == "paused"  # type: ignore[union-attr]
        if control is not None:
            assert (await control.status(run_id)).status == "paused"
        assert await runs.cancel(run_id, "not today")  # no activity runs: the workflow waits
        state = await runs.wait(run_id, timeout=60)
        assert (state["status"], state["reason"]) == ("cancelled", "not today")
        assert (await store.info("s1")).status == "cancelled"  # type: ignore[union-attr]
        record = await store.run(run_id)
        assert record is not None and (record.status, record.reason) == (
            "cancelled", "not today")
        if control is not None:
            info = await control.status(run_id)
            assert (info.status, info.reason) == ("cancelled", "not today")
        assert done == [] and len(model_server.requests) == 1  # never resumed
        await restorable(store, "s1")
        assert not await runs.cancel(run_id), "a second cancel finds the run ended"
    finally:
        if control is not None:
            await control.aclose()


async def test_the_part_resumed_after_a_pause_is_cancelled_through_redis(
    temporal: str, queue: str, workers: Workers, store: SQLiteStore,
    model_server: LoopbackServer, caplog: pytest.LogCaptureFixture,
) -> None:
    transfer, done = approval_tool()
    model_server.script = [PAY, HELD]
    control = aio.RedisControl(redis_url(), f"aimu_test_t-{queue}")
    await control.connect()
    try:
        runs = await RunsClient.connect(temporal, queue, redis=control, heartbeat_timeout=2.0)
        await workers.start(tools=[transfer], redis=control)
        run_id = await runs.start("s1", "pay")
        [pending] = (await paused(runs, run_id))["pending"]  # type: ignore[misc]
        await runs.approve(run_id, pending["call_id"])
        async for _, event in runs.events(run_id):
            if event["type"] == "text":
                break  # the resumed part streams its reply on the worker
        info = await control.status(run_id)
        assert (info.status, info.attempt) == ("running", 2)  # registered again, same id
        # Redis alone: no cancel request reaches Temporal, the worker's run gets it.
        assert await control.cancel(run_id, "stop it now")
        await model_server.wait_abandoned(1, timeout=30)
        state = await runs.wait(run_id, timeout=60)
        assert (state["status"], state["reason"]) == ("cancelled", "stop it now")
        info = await control.wait(run_id, timeout=30)
        assert (info.status, info.reason) == ("cancelled", "stop it now")
        assert (await store.info("s1")).status == "cancelled"  # type: ignore[union-attr]
        assert done == ["transfer"]
        messages = await restorable(store, "s1")
        assert messages[-1]["role"] == "assistant" and messages[-1].get("aimu_partial")
        # The turn's failure (cancelled through Redis) and the workflow's cancel came in
        # one activation: the SDK raises the cancel and leaves the failure unread in its
        # future, which the workflow's loop reported when it was collected.
        gc.collect()
        unread = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
        assert unread == []
    finally:
        await control.aclose()


async def test_a_decision_on_a_pause_the_store_no_longer_holds_runs_nothing(
    temporal: str, queue: str, runs: RunsClient, workers: Workers, store: SQLiteStore,
    model_server: LoopbackServer,
) -> None:
    """Issue 29 item 6 on Temporal: the run pauses on transfer to Alice; another process
    replaces the session in the store, pausing on transfer to Mallory under the same call
    id. serve refuses the decision (409); given to the workflow anyway, the worker finds
    the pause gone and the run fails saying so: nothing runs, Mallory's call stays
    undecided."""
    from aimu.aio.approvals import PAUSED, Approvals
    from aimu.serve.backends.temporal import TemporalBackend
    from aimu.serve.errors import Conflict
    from aimu.serve.runs import Verdict

    done: list[str] = []

    @aio.tool(approval=True)
    def transfer(to: str) -> str:
        """Move money."""
        done.append(to)
        return "moved"

    model_server.script = [
        Turn(tool_calls=[ScriptedCall("transfer", {"to": "Alice"}, "call-x")]),
        Turn(tool_calls=[ScriptedCall("transfer", {"to": "Mallory"}, "call-x")]),
    ]
    await workers.start(tools=[transfer])
    server = TemporalBackend(temporal, queue, store)
    await server.connect()
    try:
        started = await server.start("s1", "pay Alice", None)
        record = server.record(started.run_id)
        async with asyncio.timeout(60):
            while not record.ended:
                await record.changed(5)
        assert record.view.status == "paused"
        [shown] = (await runs.status(started.run_id))["pending"]
        assert shown["arguments"] == {"to": "Alice"} and shown["pause_id"]

        assert await store.delete("s1")  # another process replaces the session
        other = aio.Agent(aio.client("ollama:test", host=model_server.url), tools=[transfer],
                          store=store, session="s1")
        assert await other.run("pay Mallory") == PAUSED
        await other.aclose()

        with pytest.raises(Conflict, match="no longer waits"):
            await server.decide(record.view, Verdict("call-x", True))
        with pytest.raises(RequestRefused, match="asked again"):
            await runs.approve(started.run_id, "call-x", pause_id="another")
        assert await runs.approve(started.run_id, "call-x") == []  # the workflow's own pause
        state = await runs.wait(started.run_id, timeout=60)
        assert state["status"] == "failed"
        assert "no longer waits" in state["error"] and "nothing ran" in state["error"]
        assert done == []
        approvals = Approvals.from_state(await store.load_state("s1"), "s1")
        assert [p.arguments for p in approvals.waiting()] == [{"to": "Mallory"}]
        assert approvals.decisions == {}
    finally:
        await server.aclose()


@pytest.mark.parametrize("grace", [10**400, float("nan"), float("inf"), -1.0],
                         ids=["10**400", "nan", "inf", "-1"])
async def test_stop_with_a_grace_that_is_not_finite_seconds_asks_nothing(grace: float) -> None:
    """Issue 29 item 5: refused before Temporal is asked (no client is needed for that)."""
    runs = RunsClient(None, "agents")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grace"):
        await runs.request_stop("run-1", grace)


@pytest.mark.parametrize(
    ("kind", "message", "reported"),
    [
        ("AimuRunCancelled", "Future exception was never retrieved", False),
        ("AimuRunCancelled", "Unhandled exception in event loop", True),
        ("SomethingElse", "Future exception was never retrieved", True),
    ],
)
def test_the_workflow_loop_keeps_every_report_but_the_cancelled_turns_unread_failure(
    kind: str, message: str, reported: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from temporalio.exceptions import ActivityError, ApplicationError

    from aimu.temporal._workflow import report_unread

    error = ActivityError("Activity task failed", scheduled_event_id=1, started_event_id=2,
                          identity="w", activity_type="turn", activity_id="1",
                          retry_state=None)
    error.__cause__ = ApplicationError("stop it now", type=kind)
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level("ERROR", logger="asyncio"):
            report_unread(loop, {"message": message, "exception": error})
    finally:
        loop.close()
    assert [r.getMessage() for r in caplog.records] == ([message] if reported else [])
