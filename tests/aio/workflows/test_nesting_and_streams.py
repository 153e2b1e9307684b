"""Nested workflows, the streamed form of every workflow, and what a stop leaves behind."""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing
from typing import Any

import pytest
from workflow_support import agent, check_state, scripted, stop_after, sweep

from aimu import aio
from aimu.aio.agent import INTERRUPTED
from aimu.aio.events import Event, HandleFinished, RunFinished, TextChunk
from aimu.aio.workflows import Chain, EvaluatorOptimizer, Parallel, Resumable, Router, Workflow
from aimu.testing.scripted import ScriptedModel


def nested(model: ScriptedModel) -> Chain:
    return Chain([
        agent(model, "plan"),
        Parallel([agent(model, "left"), agent(model, "right")], combine=" & ".join),
        agent(model, "write"),
    ])


EXPECTED = "write<left<plan<go>> & right<plan<go>>>"


def protocol_holders(a: aio.Agent, w: Chain) -> list[Resumable]:
    return [a, w]  # agents and workflows are both steps (checked by mypy)


async def test_a_chain_with_a_parallel_step() -> None:
    model = scripted()
    chain = nested(model)
    assert await chain.run("go") == EXPECTED
    state = check_state(chain.state)
    inner = state["steps"][1]
    assert inner["kind"] == "parallel" and inner["status"] == "finished"
    assert [b["answer"] for b in inner["state"]["branches"]] == ["left<plan<go>>",
                                                                "right<plan<go>>"]
    assert chain.local_usage["output_tokens"] > 0
    assert len(protocol_holders(agent(model, "x"), chain)) == 2


@pytest.mark.parametrize("mode", ["cancel", "interrupt"])
async def test_nested_stopped_at_every_point_resumes(mode: str) -> None:
    stops = await sweep(nested, "go", mode)
    assert stops >= 15


async def test_nested_cancel_by_handle_then_resume_in_a_new_workflow() -> None:
    model = scripted(delays={"right": 0.02})
    chain = nested(model)
    handle = aio.RunHandle.start(chain.run("go"))
    finished: list[str] = []

    def on_event(event: Event) -> None:
        # Called as the event is emitted: the cancel lands while "right" still runs.
        if isinstance(event, RunFinished):
            finished.append(event.source)
            if event.source == "left":
                handle.cancel()

    handle.scope.add_listener(on_event)
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert handle.status == "cancelled"
    assert finished == ["plan", "left", "right", "parallel", "chain"]
    state = check_state(chain.state)
    inner = state["steps"][1]
    assert inner["status"] == "in_flight"
    assert inner["state"]["status"] == "cancelled"
    assert [b["status"] for b in inner["state"]["branches"]] == ["finished", "in_flight"]
    fresh_model = scripted()
    fresh = nested(fresh_model)
    fresh.restore(json.loads(json.dumps(state)))
    assert await fresh.resume() == EXPECTED
    roles = {r["messages"][0]["content"] for r in fresh_model.requests}
    assert roles == {"right", "write"}


async def test_nested_shape_mismatch_names_the_inner_workflow() -> None:
    model = scripted()
    chain = nested(model)
    await chain.run("go")
    other = Chain([
        agent(model, "plan"),
        Parallel([agent(model, "left")], combine=" & ".join),
        agent(model, "write"),
    ])
    with pytest.raises(ValueError, match=r"chain 'chain' step 2: parallel 'parallel' has 1 "
                                         r"branches and the state has 2"):
        other.restore(chain.state)


async def test_other_nestings_run_and_resume() -> None:
    model = scripted()
    fan = Parallel([Chain([agent(model, "a1"), agent(model, "a2")]),
                    Router({"x": agent(model, "x")}, classifier=lambda task: "x")],
                   combine=" | ".join)
    assert await fan.run("t") == "a2<a1<t>> | x<t>"
    polish = EvaluatorOptimizer(Chain([agent(model, "draft"), agent(model, "edit")]),
                                lambda task, draft: (True, ""))
    assert await polish.run("t") == "edit<draft<t>>"
    state = check_state(polish.state)
    assert state["rounds"][0]["generate"]["kind"] == "chain"


# -- streams ------------------------------------------------------------------------


def every_workflow(model: ScriptedModel) -> list[Workflow]:
    return [
        nested(model),
        Parallel([agent(model, "b1"), agent(model, "b2")]),
        Router({"r": agent(model, "r")}, classifier=agent(model, "c"), default="r"),
        EvaluatorOptimizer(agent(model, "g"), lambda task, draft: (True, "")),
    ]


async def test_every_stream_ends_with_the_workflows_one_terminal_event() -> None:
    for workflow in every_workflow(scripted()):
        events = [event async for event in workflow.run("go", stream=True)]
        final = events[-1]
        assert isinstance(final, RunFinished) and final.source == workflow.name
        assert final.status == "completed"
        assert final.reply == workflow.state["answer"]
        own = [e for e in events if isinstance(e, RunFinished) and e.source == workflow.name]
        assert own == [final]
        resumed = [event async for event in workflow.resume(stream=True)]
        assert [type(e).__name__ for e in resumed] == ["RunStarted", "RunFinished"]


async def test_a_stream_cancelled_at_every_point() -> None:
    for n in range(1, 500):
        model = scripted()
        chain = nested(model)
        seen: list[Event] = []

        async def consume(chain: Chain = chain, seen: list[Event] = seen) -> None:
            async for event in chain.run("go", stream=True):
                seen.append(event)

        task = asyncio.ensure_future(consume())
        if await stop_after(task, n):
            break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Cancelled, or completed just before while the consumer had events left to read.
        assert not chain.running and chain.last_status in ("cancelled", "completed")
        own = [e for e in seen if isinstance(e, RunFinished) and e.source == "chain"]
        assert len(own) == 1 and seen[-1] is own[0] and own[0].status == chain.last_status
        assert model.open_streams == 0
        assert asyncio.all_tasks() == {asyncio.current_task()}
        state = check_state(chain.state)
        fresh = nested(scripted())
        fresh.restore(state)
        assert await fresh.resume() == EXPECTED
    else:
        raise AssertionError("the stream never completed")
    assert n > 15


async def test_a_consumer_that_stops_reading_cancels_the_run() -> None:
    model = scripted(delay=0.001)
    chain = nested(model)
    async with aclosing(chain.run("go", stream=True)) as events:
        async for event in events:
            if isinstance(event, TextChunk) and event.source == "left":
                break
    assert not chain.running and chain.last_status == "cancelled"
    assert model.open_streams == 0
    assert asyncio.all_tasks() == {asyncio.current_task()}
    state = check_state(chain.state)
    assert state["steps"][1]["status"] == "in_flight"


async def test_a_failure_in_a_stream_comes_after_the_terminal_event() -> None:
    model = scripted()
    router = Router({"a": agent(model, "a")}, classifier=lambda task: "b")
    seen: list[Event] = []
    with pytest.raises(ValueError, match="chose 'b'"):
        async for event in router.run("x", stream=True):
            seen.append(event)
    final = seen[-1]
    assert isinstance(final, RunFinished) and final.status == "failed"
    assert final.error is not None and "chose 'b'" in final.error


async def test_handle_events_of_a_workflow_and_interrupt_through_the_handle() -> None:
    model = scripted(delay=0.001)
    parallel = Parallel([agent(model, "b1"), agent(model, "b2")])
    handle = aio.RunHandle.start(parallel.run("go"))
    events: list[Any] = []
    async for event in handle.events():
        events.append(event)
        if isinstance(event, TextChunk):
            handle.interrupt()
    assert await handle == INTERRUPTED and handle.status == "interrupted"
    assert isinstance(events[-1], HandleFinished)
    own = [e for e in events if isinstance(e, RunFinished) and e.source == "parallel"]
    assert len(own) == 1 and own[0].status == "interrupted" and events[-2] is own[0]
    assert parallel.interrupt() is False


async def test_a_consumer_cancelled_in_its_own_code_stops_the_run_too() -> None:
    # The cancel lands in the consumer's loop body, not in the stream: the stream is left
    # unclosed, and the run must not go on calling models in the background.
    model = scripted(delay=0.001)
    chain = nested(model)
    stream = chain.run("go", stream=True)
    reading = asyncio.Event()

    async def consume() -> None:
        async for _ in stream:
            reading.set()
            await asyncio.sleep(1)

    task = asyncio.ensure_future(consume())
    await reading.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(5):
        await asyncio.sleep(0)
    assert not chain.running and chain.last_status == "cancelled"
    served = model.turns_served
    await asyncio.sleep(0.01)
    assert model.turns_served == served and model.open_streams == 0
    await stream.aclose()
    check_state(chain.state)


async def test_a_consumer_that_ends_right_after_the_first_event_ends_the_run() -> None:
    # The consumer ends before the run's task ever ran a step: the run must still end.
    model = scripted()
    chain = nested(model)
    stream = chain.run("go", stream=True)

    async def consume() -> None:
        async for _ in stream:
            return

    await asyncio.ensure_future(consume())
    for _ in range(5):
        await asyncio.sleep(0)
    assert not chain.running and chain.last_status == "cancelled"
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert model.turns_served == 0
    await stream.aclose()
    check_state(chain.state)
    assert await chain.run("go") == EXPECTED


@pytest.mark.parametrize("close", [False, True])
async def test_a_second_cancel_still_waits_for_the_run_to_stop(close: bool) -> None:
    # Cancelled again while the stream waits for its run to stop: it keeps waiting, so
    # the consumer never ends while the run's task still works on the transcripts.
    model = scripted(delay=0.001)
    chain = nested(model)
    stream = chain.run("go", stream=True)
    in_parallel = asyncio.Event()

    async def consume() -> None:
        try:
            async for event in stream:
                if isinstance(event, TextChunk) and event.source == "left":
                    in_parallel.set()
                    if close:
                        break
        finally:
            if close:
                await stream.aclose()

    task = asyncio.ensure_future(consume())
    await in_parallel.wait()
    if not close:
        task.cancel()
        await asyncio.sleep(0)  # the first cancel lands in the stream, which starts waiting
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert not chain.running and chain.last_status == "cancelled"
    assert model.open_streams == 0
    state = check_state(chain.state)
    assert state["steps"][1]["status"] == "in_flight"
    await stream.aclose()


@pytest.mark.parametrize("mode", ["interrupt", "cancel"])
async def test_a_handle_around_a_stream_interrupts_or_cancels_its_run(mode: str) -> None:
    # The run goes on in the stream's own task: the handle's scope and cancel reach it.
    model = scripted(delay=0.001)
    parallel = Parallel([agent(model, "b1"), agent(model, "b2")])
    handles: list[aio.RunHandle[str]] = []
    seen: list[Event] = []

    async def consume() -> str:
        async for event in parallel.run("go", stream=True):
            seen.append(event)
            if isinstance(event, TextChunk) and len(handles) == 1:
                if mode == "interrupt":
                    handles[0].interrupt()
                else:
                    handles[0].cancel()
                handles.append(handles[0])  # once
        return "done"

    handles.append(aio.RunHandle.start(consume()))
    if mode == "interrupt":
        assert await handles[0] == "done"
        assert handles[0].status == "interrupted"
        assert parallel.last_status == "interrupted"
    else:
        with pytest.raises(asyncio.CancelledError):
            await handles[0]
        assert handles[0].status == "cancelled"
        assert parallel.last_status == "cancelled"
    final = seen[-1]
    assert isinstance(final, RunFinished) and final.source == "parallel"
    assert final.status == parallel.last_status
    assert model.open_streams == 0
    assert asyncio.all_tasks() == {asyncio.current_task()}
    check_state(parallel.state)
