"""Parallel: branches under one TaskGroup; cancel, failure, interrupt, resume."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Mapping
from typing import Any

import pytest
from workflow_support import agent, check_state, note, scripted, split_request, sweep

from aimu import aio
from aimu.aio.agent import INTERRUPTED
from aimu.aio.events import RunFinished, TextChunk
from aimu.aio.transcript import validate
from aimu.aio.workflows import Chain, Parallel
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer


def three_branches(model: ScriptedModel) -> Parallel:
    return Parallel([agent(model, "b1"), agent(model, "b2"), agent(model, "b3")])


async def test_answers_in_branch_order_with_the_default_labels() -> None:
    model = scripted()
    parallel = three_branches(model)
    reply = await parallel.run("go")
    assert reply == "[1] b1:\nb1<go>\n\n[2] b2:\nb2<go>\n\n[3] b3:\nb3<go>"
    state = check_state(parallel.state)
    assert [b["answer"] for b in state["branches"]] == ["b1<go>", "b2<go>", "b3<go>"]
    assert state["combine"] == {"kind": "function", "status": "finished", "answer": reply}
    assert model.open_streams == 0


async def test_combine_by_function_or_agent() -> None:
    model = scripted()
    branches = [agent(model, "b1"), agent(model, "b2")]
    assert await Parallel(branches, combine=" | ".join).run("x") == "b1<x> | b2<x>"

    async def shout(answers: list[str]) -> str:
        await asyncio.sleep(0)
        return "!".join(answers).upper()

    assert await Parallel(branches, combine=shout).run("x") == "B1<X>!B2<X>"
    merger = Parallel(branches, combine=agent(model, "merge"))
    reply = await merger.run("x")
    assert reply.startswith("merge<Task:\nx\n\nAnswers to combine into one:\n\n[1] b1:\nb1<x>")
    assert merger.state["combine"]["status"] == "finished"
    with pytest.raises(TypeError, match="combine must return a string"):
        await Parallel(branches, combine=len).run("x")  # type: ignore[arg-type]


async def test_one_agent_in_three_branches_never_mixes_tool_results() -> None:
    # The regression: concurrent branches built from one agent object each keep their
    # own transcript, so each answer quotes only its own tool result.
    tickets = itertools.count(1)

    async def lookup(ticket: int) -> str:
        """Look a ticket up."""
        await asyncio.sleep(0.001 * (ticket % 3))
        return f"ticket-{ticket}-data"

    def script(request: Mapping[str, Any]) -> Turn:
        _, _, results = split_request(request)
        if len(results) < 2:  # two tool rounds per branch
            return Turn(text="checking", tool_calls=[
                ScriptedCall("lookup", {"ticket": next(tickets)})
            ], delay=0.001)
        return Turn(text="saw " + " ".join(r["content"] for r in results), delay=0.001)

    shared = aio.Agent(ScriptedModel(script), tools=[lookup], name="worker")
    parallel = Parallel([shared, shared, shared], combine=" | ".join)
    await parallel.run("same task for all")
    answers = [b["answer"] for b in parallel.state["branches"]]
    seen: set[str] = set()
    for branch in parallel.state["branches"]:
        own = [m["content"] for m in branch["messages"] if m["role"] == "tool"]
        assert len(own) == 2
        assert branch["answer"] == "saw " + " ".join(own)
        seen.update(own)
    assert len(seen) == 6, answers  # six distinct lookups, none shared between branches
    assert shared.model_client.messages == []


@pytest.mark.parametrize("mode", ["cancel", "interrupt"])
async def test_stopped_at_every_point_resumes_without_rerunning_finished_branches(
    mode: str,
) -> None:
    stops = await sweep(three_branches, "go", mode)
    assert stops >= 6


async def test_interrupt_lets_every_branch_finish_its_step() -> None:
    model = scripted(delay=0.001)
    parallel = three_branches(model)
    seen: list[Any] = []
    async for event in parallel.run("go", stream=True):
        seen.append(event)
        if isinstance(event, TextChunk):
            parallel.interrupt()
    final = seen[-1]
    assert isinstance(final, RunFinished) and final.source == "parallel"
    assert final.reply == INTERRUPTED and final.status == "interrupted"
    state = check_state(parallel.state)
    for branch in state["branches"]:
        assert branch["status"] == "in_flight"
        assert [m["role"] for m in branch["messages"]][-2:] == ["assistant", "tool"]
    fresh = three_branches(scripted())
    fresh.restore(state)
    assert (await fresh.resume()).startswith("[1] b1:\nb1<go>")


def fails_on_cue(script: Any, streaming: int, failing: int) -> ScriptedModel:
    """A model whose "bad" branches fail (HTTP 500) together, once ``streaming`` other
    branches' replies have provably begun (forks, as agents make, share the cue)."""
    begun = asyncio.Semaphore(0)
    together = asyncio.Barrier(failing) if failing else None

    class FailsOnCue(ScriptedModel):
        async def stream_turn(self, messages: Any, tools: Any = None, **options: Any) -> Any:
            if messages[0]["content"].startswith("bad"):
                for _ in range(streaming):
                    await begun.acquire()
                if together is not None:
                    await together.wait()
            first = True
            async for chunk in super().stream_turn(messages, tools, **options):
                yield chunk
                if first:  # the agent took the first chunk: its reply has begun
                    first = False
                    begun.release()

    return FailsOnCue(script)


async def test_a_failing_branch_cancels_the_others_and_its_error_surfaces() -> None:
    def script(request: Mapping[str, Any]) -> Turn:
        role, _, _ = split_request(request)
        if role.startswith("bad"):
            return Turn(text="oops", fault="http_500")
        return Turn(text="a slow answer in many words", fault="hang", fault_after=1)

    model = fails_on_cue(script, streaming=2, failing=1)
    parallel = Parallel([aio.Agent(model.fork(), system=r, name=r) for r in ("s1", "bad", "s2")])
    with pytest.raises(aio.ModelHTTPError, match="500"):
        await parallel.run("go")
    assert parallel.last_status == "failed"
    assert model.open_streams == 0
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0  # no stray cancel left behind
    state = check_state(parallel.state)
    assert [b["status"] for b in state["branches"]] == ["in_flight"] * 3
    assert "500" in state["branches"][1]["error"]
    for branch in (state["branches"][0], state["branches"][2]):
        assert branch["messages"][-1]["aimu_partial"] is True  # cancelled mid-stream
        assert "error" not in branch

    # Two failures at once: the ExceptionGroup, with both.
    bad = fails_on_cue(script, streaming=0, failing=2)
    twice = Parallel([aio.Agent(bad.fork(), system="bad", name=f"bad{i}") for i in (1, 2)])
    with pytest.raises(ExceptionGroup) as caught:
        await twice.run("go")
    assert len(caught.value.exceptions) == 2
    assert all(isinstance(e, aio.ModelHTTPError) for e in caught.value.exceptions)


async def test_an_outside_cancel_wins_over_a_branch_failing_at_the_same_moment() -> None:
    class CancelsAndFails(ScriptedModel):
        async def stream_turn(self, messages: Any, tools: Any = None, *,
                              stream: bool = True) -> Any:
            assert outer is not None
            outer.cancel()  # the cancel and the failure land in the same step
            raise aio.ModelConnectionError("gone", host="in-process")
            yield  # pragma: no cover - makes this an async generator

    slow = scripted(delay=0.01)
    parallel = Parallel([agent(slow, "s1"), aio.Agent(CancelsAndFails([]), name="bad")])
    outer: asyncio.Task[str] | None = None
    outer = asyncio.ensure_future(parallel.run("go"))
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert parallel.last_status == "cancelled"
    state = check_state(parallel.state)
    assert "gone" in state["branches"][1]["error"]


async def test_a_failing_combine_keeps_the_finished_branches() -> None:
    model = scripted()
    failures = 0

    def picky(answers: list[str]) -> str:
        nonlocal failures
        failures += 1
        if failures == 1:
            raise RuntimeError("combine broke")
        return "+".join(answers)

    parallel = Parallel([agent(model, "b1"), agent(model, "b2")], combine=picky)
    with pytest.raises(RuntimeError, match="combine broke"):
        await parallel.run("go")
    served = model.turns_served
    assert await parallel.resume() == "b1<go>+b2<go>"
    assert model.turns_served == served  # the branches were not run again


def slow_for(*systems: str, delay: float = 0.03) -> Any:
    """A loopback script: echo the task, slowly for the agents with these system prompts."""

    def script(request: Mapping[str, Any]) -> Turn:
        system, task, _ = split_request(request)
        text = "You said: " + task + " and some more words"
        return Turn(text=text, delay=delay if system in systems else 0.0)

    return script


async def test_cancel_abandons_every_branch_stream_at_the_server() -> None:
    async with LoopbackServer(slow_for("b1", "b2", "b3")) as server:
        client = aio.client("ollama:test", host=server.url)
        async with client:
            parallel = Parallel([aio.Agent(client, system=r, name=r) for r in ("b1", "b2", "b3")])
            handle = aio.RunHandle.start(parallel.run("hello"))
            streaming: set[str] = set()
            async for event in handle.events():
                if isinstance(event, TextChunk):
                    streaming.add(event.source)
                    if len(streaming) == 3:
                        handle.cancel()
            with pytest.raises(asyncio.CancelledError):
                await handle
            abandoned = await server.wait_abandoned(3)
        assert len(abandoned) == 3 and len(server.streams) == 3
        state = check_state(parallel.state)
        assert [b["status"] for b in state["branches"]] == ["in_flight"] * 3
        for branch in state["branches"]:
            assert branch["messages"][-1]["aimu_partial"] is True


async def test_finished_branches_are_not_rerun_on_resume() -> None:
    async with LoopbackServer(slow_for("b2", "b3")) as server:
        def build() -> tuple[aio.ModelClient, Parallel]:
            client = aio.client("openai:test", base_url=server.openai_base_url, api_key="x")
            agents = [aio.Agent(client, system=r, name=r) for r in ("b1", "b2", "b3")]
            return client, Parallel(agents, combine=" / ".join)

        client, parallel = build()
        async with client:
            handle = aio.RunHandle.start(parallel.run("hello"))
            async for event in handle.events():
                if isinstance(event, RunFinished) and event.source == "b1":
                    handle.cancel()
            with pytest.raises(asyncio.CancelledError):
                await handle
        await server.wait_abandoned(2)
        state = json.loads(json.dumps(parallel.state))
        assert [b["status"] for b in state["branches"]] == ["finished", "in_flight", "in_flight"]
        before = len(server.requests)
        server.script = slow_for()
        client, fresh = build()
        async with client:
            fresh.restore(state)
            reply = await fresh.resume()
        assert reply == " / ".join(["You said: hello and some more words"] * 3)
        systems = sorted(r.body["messages"][0]["content"] for r in server.requests[before:])
        assert systems == ["b2", "b3"]
        for branch in fresh.state["branches"]:
            validate(branch["messages"])


async def test_shape_mismatches() -> None:
    model = scripted()
    parallel = three_branches(model)
    await parallel.run("go")
    state = parallel.state
    with pytest.raises(ValueError, match="has 2 branches and the state has 3"):
        Parallel([agent(model, "a"), agent(model, "b")]).restore(state)
    with_agent = Parallel([agent(model, "a"), agent(model, "b"), agent(model, "c")],
                          combine=agent(model, "m"))
    with pytest.raises(ValueError, match="combine: the state has a function here"):
        with_agent.restore(state)
    with pytest.raises(ValueError, match="branch 2: the state has an agent here"):
        Parallel([agent(model, "a"), Chain([agent(model, "b")]), agent(model, "c")]).restore(
            state
        )
    with pytest.raises(ValueError, match="at least one branch"):
        Parallel([])
    with pytest.raises(TypeError, match="Parallel branch 1 must be"):
        Parallel([note])  # type: ignore[list-item]
