"""Long runs continue as new (issue 34 item 5): with a history limit of one event, every
turn of a run is handed off at its first step boundary, so a run of a few tool rounds
crosses several continue-as-new boundaries; and a cancel, an interrupt, a stop or a send
lands right at one (the handoff asked for, the turn still running), and is not lost."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from aimu import aio
from aimu.aio.store import SQLiteStore
from aimu.temporal import RunsClient
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer
from tests.services import redis_url
from tests.temporal.conftest import HEARTBEAT_TIMEOUT, Workers
from tests.temporal.test_runs import PAY, approval_tool, paused, restorable

STEPS = 3


def rounds(steps: int = STEPS) -> list[Turn]:
    """The model's turns: ``steps`` calls of ``step``, one a turn, then "done"."""
    return [Turn(f"step {n} ", tool_calls=(ScriptedCall("step", {"n": n}),))
            for n in range(1, steps + 1)] + [Turn("done")]


class Steps:
    """The ``step`` tool: counts its calls, and waits until its turn is asked to end (the
    handoff, ``asked()``: the run provably crosses a boundary at each step; the tool
    itself never sees it); at step ``hold`` it says so, and returns only once the test
    lets it."""

    def __init__(self, asked: Callable[[], bool], hold: int = 0) -> None:
        self.calls: list[int] = []
        self.hold = hold
        self.reached = asyncio.Event()
        self.go = asyncio.Event()
        self.saw_interrupt: list[bool] = []

        async def step(ctx: aio.ToolContext, n: int) -> str:
            """Do step n."""
            self.calls.append(n)
            while not asked():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            self.saw_interrupt.append(ctx.interrupt_requested)
            if n == self.hold:
                self.reached.set()
                await self.go.wait()
            return f"did {n}"

        self.tool = aio.tool(step)


@pytest.fixture
async def short(temporal: str, queue: str) -> RunsClient:
    """A client whose runs continue as new at every turn's first events."""
    return await RunsClient.connect(
        temporal, queue, heartbeat_timeout=HEARTBEAT_TIMEOUT, history_events=1
    )


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


@pytest.mark.slow
async def test_a_run_crosses_several_boundaries_and_goes_on_where_it_stopped(
    short: RunsClient, workers: Workers, store: SQLiteStore, model_server: LoopbackServer
) -> None:
    steps = Steps(workers.handing_off)
    model_server.script = rounds()
    await workers.start(tools=[steps.tool])
    run_id = await short.start("s1", "do the steps")
    live = [event async for _, event in short.events(run_id)]  # followed across them
    state = await short.wait(run_id, timeout=60)
    assert state["status"] == "completed" and state["reply"] == "done"
    assert state["executions"] > STEPS  # one a turn: each handed off at its first step
    assert steps.calls == list(range(1, STEPS + 1))  # each step ran once
    assert steps.saw_interrupt == [False] * STEPS  # the handoff is not an interrupt for tools
    assert len(model_server.requests) == STEPS + 1  # no model turn asked twice
    messages = await restorable(store, "s1")
    assert [m["role"] for m in messages] == ["user"] + ["assistant", "tool"] * STEPS + [
        "assistant"]
    assert messages[-1]["content"] == "done"
    assert (await store.info("s1")).status == "completed"  # type: ignore[union-attr]
    # One run to its followers: started once, ended once, nothing lost or doubled;
    # read again from the start, the earlier executions' histories give the same.
    again = [event async for _, event in short.events(run_id)]
    for events in (live, again):
        assert kinds(events).count("run_started") == 1 and events[0]["type"] == "run_started"
        assert kinds(events).count("run_finished") == 1
        assert events[-1]["type"] == "handle_finished" and events[-1]["status"] == "completed"
        results = [e["content"] for e in events if e["type"] == "tool_result"]
        assert results == [f"did {n}" for n in range(1, STEPS + 1)]
    assert again == live
    assert state["event_count"] == len(live)
    assert state["usage"]["output_tokens"] > 0


@pytest.mark.parametrize("how", ["cancel", "interrupt", "stop", "send"])
async def test_a_request_at_the_boundary_is_not_lost(
    how: str, short: RunsClient, workers: Workers, store: SQLiteStore,
    model_server: LoopbackServer,
) -> None:
    steps = Steps(workers.handing_off, hold=2)
    model_server.script = rounds()
    await workers.start(tools=[steps.tool])
    run_id = await short.start("s1", "do the steps")
    await asyncio.wait_for(steps.reached.wait(), 60)  # the handoff is asked for
    if how == "cancel":
        assert await short.cancel(run_id, "the user pressed Stop")
    elif how == "interrupt":
        assert await short.interrupt(run_id)
    elif how == "stop":
        assert await short.request_stop(run_id, grace=0)
    else:
        await short.send(run_id, "also this")
    steps.go.set()
    state = await short.wait(run_id, timeout=60)
    messages = await restorable(store, "s1")
    if how == "cancel":
        assert (state["status"], state["reason"]) == ("cancelled", "the user pressed Stop")
        assert steps.calls == [1, 2]
    elif how == "send":
        assert state["status"] == "completed"
        assert [m.get("content") for m in messages].count("also this") == 1
        assert steps.calls == list(range(1, STEPS + 1))
    else:  # taken by the turn that ends, or by the next one at its first boundary
        assert state["status"] in ({"interrupted"} if how == "interrupt" else
                                   {"interrupted", "cancelled"}), state
        assert steps.calls in ([1, 2], [1, 2, 3])
    assert (await store.info("s1")).status == state["status"]  # type: ignore[union-attr]
    record = await store.run(run_id)
    assert record is not None and record.status == state["status"]
    if how == "cancel":  # the caller's reason, not "cancelled through Temporal"
        assert record.reason == "the user pressed Stop"
    assert sorted(set(steps.calls)) == steps.calls  # no step ran twice


async def test_a_decision_crosses_the_boundary_with_the_run(
    short: RunsClient, workers: Workers, store: SQLiteStore, model_server: LoopbackServer
) -> None:
    """The run pauses in a later execution; the decision, recorded there, goes with the
    turn that resumes it into the next execution (the history is full by then)."""
    steps = Steps(workers.handing_off)
    transfer, done = approval_tool()
    model_server.script = [*rounds(1)[:1], PAY, Turn("done")]
    await workers.start(tools=[steps.tool, transfer])
    run_id = await short.start("s1", "step, then pay")
    state = await paused(short, run_id)
    assert state["executions"] >= 2  # it paused after a boundary
    [pending] = state["pending"]  # type: ignore[misc]
    assert await short.approve(run_id, pending["call_id"]) == []
    state = await short.wait(run_id, timeout=60)
    assert state["status"] == "completed" and state["reply"] == "done"
    assert state["executions"] >= 3  # the resumed turn ran in a new execution
    assert steps.calls == [1] and done == ["transfer"]
    messages = await restorable(store, "s1")
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["did 1", "moved"]


@pytest.mark.parametrize("how", ["handoff", "interrupt"])
async def test_an_agent_called_as_a_tool_never_sees_the_handoff_but_sees_an_interrupt(
    how: str, short: RunsClient, workers: Workers, store: SQLiteStore,
    model_server: LoopbackServer,
) -> None:
    """The run is asked to continue as new while an agent it calls works: the callee
    finishes its steps (it never sees the handoff) and the run goes on in a new
    execution; a person's interrupt that comes then stops the tree as in a local run,
    the callee at its next step boundary and then the caller."""
    started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    saw: list[bool] = []

    async def step(ctx: aio.ToolContext, n: int) -> str:
        """Do step n."""
        while not workers.handing_off():  # noqa: ASYNC110 - asked while the callee works
            await asyncio.sleep(0.01)
        if how == "interrupt" and n == 1:
            assert await short.interrupt(await started)
            async with asyncio.timeout(30):
                while not ctx.interrupt_requested:  # noqa: ASYNC110 - it reaches the callee
                    await asyncio.sleep(0.01)
        saw.append(ctx.interrupt_requested)
        return f"did {n}"

    child = aio.Agent(ScriptedModel([Turn(tool_calls=(ScriptedCall("step", {"n": 1}),)),
                                     Turn(tool_calls=(ScriptedCall("step", {"n": 2}),)),
                                     Turn("child done")]), [aio.tool(step)], name="child")
    model_server.script = [Turn("asking ", tool_calls=(ScriptedCall("child", {"task": "go"}),)),
                           Turn("done")]
    await workers.start(tools=[child.as_tool()])
    run_id = await short.start("s1", "ask the child")
    started.set_result(run_id)
    state = await short.wait(run_id, timeout=60)
    [result] = [m["content"] for m in await restorable(store, "s1") if m["role"] == "tool"]
    if how == "handoff":
        assert (state["status"], state["reply"]) == ("completed", "done")
        assert saw == [False, False] and result == "child done"
        assert state["executions"] >= 2  # it went on in a new execution after the call
    else:
        assert state["status"] == "interrupted"
        assert saw == [True] and result != "child done"  # the callee stopped after step 1


async def test_redis_shows_the_run_running_across_the_boundaries(
    short: RunsClient, workers: Workers, model_server: LoopbackServer, queue: str
) -> None:
    """With Redis control, each execution's turn registers the run again: Redis shows
    it running in every execution, and its end once it ends (not ``interrupted`` from
    the first handoff on)."""
    started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    seen: list[str] = []

    async def step(n: int) -> str:
        """Do step n."""
        while not workers.handing_off():  # noqa: ASYNC110 - a boundary after each step
            await asyncio.sleep(0.01)
        seen.append((await control.status(await started)).status)
        return f"did {n}"

    model_server.script = rounds(2)
    async with aio.RedisControl(redis_url(), f"aimu_test_t-{queue}") as control:
        await workers.start(tools=[aio.tool(step)], redis=control)
        run_id = await short.start("s1", "do the steps")
        started.set_result(run_id)
        state = await short.wait(run_id, timeout=60)
        assert state["status"] == "completed" and state["executions"] >= 3
        assert seen == ["running", "running"]
        assert (await control.status(run_id)).status == "completed"
        await workers.aclose()
