"""Chain: steps in order; stopped at any point, restored, resumed without redoing a step."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
from workflow_support import agent, check_state, note, scripted, sweep

from aimu import aio
from aimu.aio.agent import INTERRUPTED
from aimu.aio.events import (
    Event,
    RunFinished,
    RunStarted,
    StepFinished,
    TextChunk,
    ToolCallStarted,
    ToolResult,
)
from aimu.aio.scope import RunScope, current_scope
from aimu.aio.transcript import validate
from aimu.aio.workflows import Chain, Parallel
from aimu.testing.script import Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer


def three_steps(model: ScriptedModel) -> Chain:
    return Chain([agent(model, "s1"), agent(model, "s2"), agent(model, "s3")])


async def test_each_answer_is_the_next_task() -> None:
    model = scripted()
    chain = three_steps(model)
    assert await chain.run("go") == "s3<s2<s1<go>>>"
    assert chain.last_status == "completed"
    state = check_state(chain.state)
    assert [s["status"] for s in state["steps"]] == ["finished"] * 3
    assert [s["answer"] for s in state["steps"]] == ["s1<go>", "s2<s1<go>>", "s3<s2<s1<go>>>"]
    assert state["task"] == "go" and state["answer"] == "s3<s2<s1<go>>>"
    assert model.turns_served == 6 and model.open_streams == 0
    # Every step ran in a session of its own: the configured agents are untouched.
    assert all(step.model_client.messages == [{"role": "system", "content": step.name}]
               for step in chain.steps if isinstance(step, aio.Agent))


async def test_stream_has_the_agents_events_and_one_terminal_event_last() -> None:
    chain = three_steps(scripted())
    events = [event async for event in chain.run("go", stream=True)]
    assert isinstance(events[0], RunStarted) and events[0].source == "chain"
    final = events[-1]
    assert isinstance(final, RunFinished) and final.source == "chain"
    assert final.status == "completed" and final.reply == "s3<s2<s1<go>>>"
    finals = [e for e in events if isinstance(e, RunFinished)]
    assert [e.source for e in finals] == ["s1", "s2", "s3", "chain"]
    steps = [e.step for e in events if isinstance(e, StepFinished) and e.source == "chain"]
    assert steps == [1, 2, 3]
    assert sum(isinstance(e, ToolResult) for e in events) == 3
    assert any(isinstance(e, TextChunk) for e in events)
    assert final.usage == chain.local_usage


async def test_one_agent_in_every_step_gets_a_session_per_step() -> None:
    model = scripted()
    same = agent(model, "same")
    chain = Chain([same, same, same])
    assert await chain.run("x") == "same<same<same<x>>>"
    transcripts = [s["messages"] for s in chain.state["steps"]]
    assert [t[1]["content"] for t in transcripts] == ["x", "same<x>", "same<same<x>>"]
    assert all(len(t) == 5 for t in transcripts)  # system, user, call, result, answer


@pytest.mark.parametrize("mode", ["cancel", "interrupt"])
async def test_stopped_at_every_point_resumes_to_the_same_answer(mode: str) -> None:
    stops = await sweep(three_steps, "go", mode)
    assert stops >= 15  # three steps, each a streamed tool turn, a tool round and an answer


async def test_interrupt_finishes_the_step_in_flight_then_stops() -> None:
    model = scripted()
    chain = three_steps(model)
    seen: list[Any] = []
    async for event in chain.run("go", stream=True):
        seen.append(event)
        if isinstance(event, TextChunk) and event.source == "s2":
            assert chain.interrupt() is True
    final = seen[-1]
    assert isinstance(final, RunFinished) and final.source == "chain"
    assert final.status == "interrupted" and final.reply == INTERRUPTED
    state = check_state(chain.state)
    assert [s["status"] for s in state["steps"]] == ["finished", "in_flight", "pending"]
    # s2 finished its model turn and tool round, and made no further turn.
    assert [m["role"] for m in state["steps"][1]["messages"]] == [
        "system", "user", "assistant", "tool",
    ]
    assert state["steps"][2]["messages"] == []
    assert chain.interrupt() is False  # no run: nothing to interrupt, nothing leaks
    assert await chain.resume() == "s3<s2<s1<go>>>"
    assert model.turns_served == 6  # s1's two turns and s2's first turn were not repeated


async def test_interrupt_through_a_handle_reaches_the_agents() -> None:
    model = scripted(delay=0.002)
    chain = three_steps(model)
    handle = aio.RunHandle.start(chain.run("go"))
    async for event in handle.events():
        if isinstance(event, ToolCallStarted):
            assert handle.interrupt() is True
    assert await handle == INTERRUPTED
    assert handle.status == "interrupted"
    state = check_state(chain.state)
    assert [s["status"] for s in state["steps"]] == ["in_flight", "pending", "pending"]
    assert model.turns_served == 1


@pytest.mark.parametrize("stop_at", ["s2", "s3"])
async def test_an_interrupt_during_an_answer_stops_at_the_next_boundary(stop_at: str) -> None:
    # The scope a handle would give the run, made by hand: only the scope matters here.
    outer = RunScope("outer")
    chain = three_steps(scripted())
    answered_tools: list[str] = []

    def on_event(event: Event) -> None:
        if isinstance(event, ToolResult):
            answered_tools.append(event.source)
        if answered_tools[-1:] == [stop_at] and isinstance(event, TextChunk):
            outer.request_interrupt()  # while stop_at streams its answer

    outer.add_listener(on_event)
    token = current_scope.set(outer)
    try:
        running = asyncio.ensure_future(chain.run("go"))  # its context holds the scope
    finally:
        current_scope.reset(token)
    reply = await running
    if stop_at == "s3":  # no boundary is left to stop at: the chain completes
        assert reply == "s3<s2<s1<go>>>" and chain.last_status == "completed"
        assert outer.halt is None
    else:  # s2 answers; the chain stops before s3, and tells the scope it did
        assert reply == INTERRUPTED and chain.last_status == "interrupted"
        assert [s["status"] for s in chain.state["steps"]] == ["finished", "finished", "pending"]
        assert outer.halt is not None and outer.halt.status == "interrupted"


async def test_handle_cancel_keeps_the_partial_transcript_and_resumes() -> None:
    def answer(role: str, task: str) -> str:
        return f"{role} says {task}"

    model = scripted(answer, delay=0.002)
    chain = three_steps(model)
    handle = aio.RunHandle.start(chain.run("go"))
    tool_done = False
    async for event in handle.events():
        tool_done = tool_done or (isinstance(event, ToolResult) and event.source == "s2")
        if tool_done and isinstance(event, TextChunk):
            assert handle.cancel() is True  # during s2's streamed answer
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert handle.status == "cancelled" and chain.last_status == "cancelled"
    state = check_state(chain.state)
    assert [s["status"] for s in state["steps"]] == ["finished", "in_flight", "pending"]
    assert state["steps"][1]["messages"][-1].get("aimu_partial") is True
    fresh_model = scripted(answer)
    fresh = three_steps(fresh_model)
    fresh.restore(json.loads(json.dumps(state)))
    assert await fresh.resume() == "s3 says s2 says s1 says go"
    assert fresh_model.turns_served == 3  # s2's answer again, then s3's two turns


async def test_the_loopback_server_never_sees_a_finished_step_again() -> None:
    async with LoopbackServer() as server:
        # The embedded test model behind the server: no tools, so it echoes the task.
        def build() -> tuple[aio.ModelClient, Chain]:
            client = aio.client("ollama:test", host=server.url)
            steps = [aio.Agent(client, system=f"step {i}", name=f"step{i}") for i in (1, 2, 3)]
            return client, Chain(steps)

        client, chain = build()
        async with client:
            reference = await chain.run("hello")
        assert reference == "You said: You said: You said: hello"
        served = len(server.requests)
        assert served == 3

        def slow_second_step(request: Any) -> Turn:
            system = request["messages"][0]["content"]
            text = "You said: " + request["messages"][-1]["content"]
            return Turn(text=text, delay=0.05 if system == "step 2" else 0.0)

        server.script = slow_second_step
        client, chain = build()
        async with client:
            handle = aio.RunHandle.start(chain.run("hello"))
            async for event in handle.events():
                if isinstance(event, TextChunk) and event.source == "step2":
                    handle.cancel()  # mid-stream: the server is between chunks
            with pytest.raises(asyncio.CancelledError):
                await handle
        await server.wait_abandoned(1)
        state = check_state(chain.state)
        assert [s["status"] for s in state["steps"]] == ["finished", "in_flight", "pending"]
        server.script = None
        before = len(server.requests)
        client, fresh = build()
        async with client:
            fresh.restore(state)
            assert await fresh.resume() == reference
        systems = [r.body["messages"][0]["content"] for r in server.requests[before:]]
        assert systems == ["step 2", "step 3"]


async def test_shape_mismatches_are_clear_and_change_nothing() -> None:
    model = scripted()
    chain = three_steps(model)
    await chain.run("go")
    state = chain.state
    two = Chain([agent(model, "a"), agent(model, "b")])
    with pytest.raises(ValueError, match="has 2 steps and the state has 3"):
        two.restore(state)
    assert two.state["task"] is None and two.state["status"] == "pending"
    nested = Chain([agent(model, "a"), Parallel([agent(model, "b")]), agent(model, "c")])
    with pytest.raises(ValueError, match=r"step 2: the state has an agent here .* a parallel"):
        nested.restore(state)
    with pytest.raises(ValueError, match="the state is of a parallel workflow"):
        chain.restore(Parallel([agent(model, "b")]).state)
    broken = json.loads(json.dumps(state))
    broken["steps"][1]["messages"].append({"role": "banana", "content": "x"})
    fresh = three_steps(model)
    with pytest.raises(ValueError, match=r"chain 'chain' step 2: .*unknown role"):
        fresh.restore(broken)
    assert fresh.state["steps"][0]["status"] == "pending"  # nothing was loaded
    with pytest.raises(ValueError, match="version"):
        fresh.restore({**state, "version": 99})


async def test_misuse_is_refused_clearly() -> None:
    model = scripted()
    with pytest.raises(ValueError, match="at least one step"):
        Chain([])
    with pytest.raises(TypeError, match=re.escape("Chain step 2 must be an aio.Agent")):
        Chain([agent(model, "a"), note])  # type: ignore[list-item]
    chain = three_steps(model)
    with pytest.raises(ValueError, match="nothing to resume"):
        chain.resume()  # type: ignore[unused-coroutine]
    running = asyncio.ensure_future(chain.run("go"))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="chain 'chain': a run is already in progress"):
        chain.run("again")  # type: ignore[unused-coroutine]
    with pytest.raises(RuntimeError,
                       match=r"restore\(\) chain 'chain' while a run is in progress"):
        chain.restore(chain.state)
    assert await running == "s3<s2<s1<go>>>"
    assert await chain.resume() == "s3<s2<s1<go>>>"  # finished: no model call
    assert model.turns_served == 6


async def test_a_failing_step_stops_the_chain_and_resume_retries_it() -> None:
    calls = 0

    def answer(role: str, task: str) -> str:
        nonlocal calls
        if role == "s2":
            calls += 1
            if calls == 1:
                raise aio.ModelConnectionError("scripted outage", host="in-process")
        return f"{role}<{task}>"

    def script(request: Any) -> Turn:
        messages = request["messages"]
        return Turn(text=answer(messages[0]["content"], messages[-1]["content"]))

    model = ScriptedModel(script)
    steps = [aio.Agent(model.fork(), system=r, name=r) for r in ("s1", "s2", "s3")]
    chain = Chain(steps)
    with pytest.raises(aio.ModelConnectionError):
        await chain.run("go")
    assert chain.last_status == "failed"
    state = check_state(chain.state)
    assert [s["status"] for s in state["steps"]] == ["finished", "in_flight", "pending"]
    assert "scripted outage" in state["steps"][1]["error"]
    assert await chain.resume() == "s3<s2<s1<go>>>"
    validate(chain.state["steps"][1]["messages"])
