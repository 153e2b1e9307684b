"""External tools (a call answered from outside: a web page's tool, the run paused for it)
and the state a session shares with its frontend."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.approvals import PAUSED, Approvals
from aimu.aio.errors import StaleDecisionError
from aimu.aio.transcript import validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel

LOCATE = aio.external_tool(
    "locate", "Where the user is, from the browser",
    {"type": "object", "properties": {"precise": {"type": "boolean"}}},
)


def lookup(city: str) -> str:
    """Look a city up."""
    return f"{city} is sunny"


def script() -> list[Turn]:
    return [
        Turn(tool_calls=[ScriptedCall("lookup", {"city": "Oslo"}),
                         ScriptedCall("locate", {"precise": True})]),
        Turn(text="you are in Bergen"),
    ]


async def test_a_call_waits_for_its_result_and_the_run_goes_on_with_it() -> None:
    model = ScriptedModel(script())
    agent = aio.Agent(model, [lookup, LOCATE], approve=lambda name, args: True)
    assert await agent.run("where am I?") == PAUSED  # the policy does not run it
    (pending,) = agent.pending_approvals
    assert (pending.tool, pending.arguments, pending.external) == (
        "locate", {"precise": True}, True
    )
    assert model.requests[0]["tools"] == ["lookup", "locate"]
    with pytest.raises(ValueError, match=r"external tool .locate.*answer"):
        agent.approve(pending)  # nothing here can run it
    agent.answer(pending, "Bergen, Norway")
    assert await agent.resume() == "you are in Bergen"
    assert len(model.requests) == 2  # the model was not asked the paused turn again
    tool_messages = [m for m in agent.messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == ["Oslo is sunny", "Bergen, Norway"]
    validate(agent.messages)


async def test_deny_refuses_it_and_a_result_is_refused_for_an_approval() -> None:
    @aio.tool(approval=True)
    def charge(amount: int) -> str:
        """Charge."""
        return "charged"

    agent = aio.Agent(ScriptedModel([
        Turn(tool_calls=[ScriptedCall("charge", {"amount": 1}),
                         ScriptedCall("locate", {})]),
        Turn(text="ok"),
    ]), [charge, LOCATE])
    await agent.run("go")
    charge_call, locate_call = agent.pending_approvals
    with pytest.raises(ValueError, match="waits for approval, not for a result"):
        agent.answer(charge_call, "fake")
    with pytest.raises(TypeError, match="text"):
        agent.answer(locate_call, 42)  # type: ignore[arg-type]
    agent.deny(locate_call, "the user closed the page")
    agent.approve(charge_call)
    assert await agent.resume() == "ok"
    results = {m["name"]: m["content"] for m in agent.messages if m["role"] == "tool"}
    assert results == {"charge": "charged", "locate": "[denied: the user closed the page]"}


async def test_a_result_is_kept_as_a_decision_across_processes(tmp_path: Path) -> None:
    model = ScriptedModel(script())
    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        first = aio.Agent(model, [lookup, LOCATE], store=store, session="t")
        assert await first.run("where?") == PAUSED
        await first.aclose()
        second = aio.Agent(model.fork(), [lookup, LOCATE], store=store, session="t")
        await second.open()
        (pending,) = second.pending_approvals
        assert pending.external
        second.answer(pending.call_id, "Bergen")
        await second.aclose()  # the decision is stored with its result
        state = await store.load_state("t")
        assert Approvals.from_state(state, "t").decisions[pending.call_id].result == "Bergen"
        third = aio.Agent(model.fork(), [lookup, LOCATE], store=store, session="t")
        assert await third.resume() == "you are in Bergen"
        assert third.messages[-2]["content"] == "Bergen"
        await third.aclose()


async def test_a_stale_result_changes_nothing() -> None:
    agent = aio.Agent(ScriptedModel(script()), [lookup, LOCATE])
    await agent.run("where?")
    (pending,) = agent.pending_approvals
    with pytest.raises(ValueError, match="no call 'nope' waits"):
        agent.answer("nope", "x")
    agent.answer(pending, "Bergen")
    with pytest.raises(ValueError, match="already decided"):
        agent.answer(pending.call_id, "Oslo")  # a duplicate: the first result holds
    replaced = aio.PendingApproval(pending.call_id, "locate", {}, pause_id="old", external=True)
    with pytest.raises(StaleDecisionError):
        agent.answer(replaced, "x")
    assert await agent.resume() == "you are in Bergen"
    assert agent.messages[-2]["content"] == "Bergen"


async def test_external_tools_set_on_a_session_are_offered_and_kept(tmp_path: Path) -> None:
    model = ScriptedModel(script())
    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        agent = aio.Agent(model, [lookup], store=store, session="t")
        await agent.open()
        with pytest.raises(TypeError, match="external tools"):
            agent.set_external_tools([aio.tool(lookup, name="other")])
        with pytest.raises(ValueError, match="clashes"):
            agent.set_external_tools([aio.external_tool("lookup")])
        agent.set_external_tools([LOCATE])
        assert [t.name for t in agent.external_tools] == ["locate"]
        assert await agent.run("where?") == PAUSED
        assert model.requests[0]["tools"] == ["lookup", "locate"]
        await agent.aclose()
        # Another process opens the session: the page's tool is known there too.
        later = aio.Agent(model.fork(), [lookup], store=store, session="t")
        await later.open()
        assert [t.name for t in later.external_tools] == ["locate"]
        (pending,) = later.pending_approvals
        later.answer(pending, "Bergen")
        assert await later.resume() == "you are in Bergen"
        assert model.requests[1]["tools"] == ["lookup", "locate"]
        later.set_external_tools([])
        await later.aclose()
        again = aio.Agent(model.fork(), [lookup], store=store, session="t")
        await again.open()
        assert again.external_tools == ()
        await again.aclose()


async def test_a_new_task_is_refused_while_a_call_waits_for_its_result() -> None:
    agent = aio.Agent(ScriptedModel(script()), [lookup, LOCATE])
    await agent.run("where?")
    # A new task instead of the result: the waiting call is refused to start one.
    with pytest.raises(ValueError, match="wait for a decision"):
        await agent.run("never mind")
    validate(agent.messages)


async def test_shared_state_reaches_tools_and_instructions_and_is_kept(tmp_path: Path) -> None:
    def note(text: str, ctx: aio.ToolContext) -> str:
        """Note something."""
        assert ctx.shared_state is not None
        ctx.shared_state.setdefault("notes", []).append(text)
        return "noted"

    seen: list[object] = []

    def system(ctx: aio.RunContext) -> str:
        seen.append(ctx.shared_state)
        return "be brief"

    model = ScriptedModel([Turn(tool_calls=[ScriptedCall("note", {"text": "milk"})]),
                           Turn(text="ok")])
    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        agent = aio.Agent(model, [note], system=system, store=store, session="t")
        await agent.open()
        assert agent.shared_state is None
        with pytest.raises(ValueError, match="JSON"):
            agent.set_shared_state({"bad": object()})
        agent.set_shared_state({"notes": ["eggs"]})
        assert await agent.run("note milk") == "ok"
        assert seen == [{"notes": ["eggs", "milk"]}]  # the same dict, changed by the tool
        await agent.aclose()
        later = aio.Agent(model.fork(), [note], store=store, session="t")
        await later.open()
        assert later.shared_state == {"notes": ["eggs", "milk"]}
        later.set_shared_state(None)
        await later.aclose()
        assert "shared_state" not in await store.load_state("t")


@pytest.mark.parametrize("stored", [False, True])
async def test_a_stop_at_each_event_of_the_resumed_run_keeps_the_result(
    stored: bool, tmp_path: Path
) -> None:
    """A cancel and an interrupt landing at every event of the run that goes on with the
    result: the transcript stays valid (in the store too), nothing waits, and the result
    is kept."""
    store = aio.SQLiteStore(tmp_path / "s.db") if stored else None
    sessions = iter(range(1000))

    async def paused() -> aio.Agent:
        model = ScriptedModel([*script()[:1], Turn(text="you are in Bergen, far north",
                                                   delay=0.001)])
        name = f"s{next(sessions)}" if store is not None else None
        agent = aio.Agent(model, [lookup, LOCATE], store=store, session=name)
        await agent.run("where?")
        agent.answer(agent.pending_approvals[0], "Bergen")
        return agent

    events = [type(e).__name__ async for e in (await paused()).resume(stream=True)]
    assert events[:2] == ["RunStarted", "ToolCallStarted"] and len(events) > 5
    for stop in ("cancel", "interrupt"):
        for at in range(len(events) - 1):
            agent = await paused()

            async def consume(agent: aio.Agent = agent, at: int = at, stop: str = stop) -> None:
                seen = 0
                async for _ in agent.resume(stream=True):
                    if seen == at:
                        if stop == "cancel":
                            current = asyncio.current_task()
                            assert current is not None
                            current.cancel()  # lands at the stream's next await
                        else:
                            agent.interrupt()
                    seen += 1

            task = asyncio.create_task(consume())
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert task.cancelled() == (stop == "cancel" and at < len(events) - 1)
            validate(agent.messages)
            results = [m["content"] for m in agent.messages if m["role"] == "tool"]
            assert results == ["Oslo is sunny", "Bergen"], (stop, at, results)
            assert agent.pending_approvals == []
            if store is not None:
                await agent.aclose()
                assert agent.session is not None
                kept = await store.load(agent.session)
                validate(kept)
                assert [m["content"] for m in kept if m["role"] == "tool"] == results
    if store is not None:
        await store.aclose()


async def test_a_call_of_an_agent_called_as_a_tool_is_answered_at_the_top() -> None:
    def child_script(request: dict[str, Any]) -> Turn:
        last = request["messages"][-1]
        if last["role"] == "tool":
            return Turn(text=f"found: {last['content']}")
        return Turn(tool_calls=[ScriptedCall("locate", {})])

    child = aio.Agent(ScriptedModel(child_script), [LOCATE], name="child")
    parent = aio.Agent(ScriptedModel([Turn(tool_calls=[ScriptedCall("child", {"task": "x"})]),
                                      Turn(text="done")]), [child.as_tool()], name="parent")
    assert await parent.run("go") == PAUSED
    (pending,) = parent.pending_approvals
    assert pending.external and pending.path and pending.tool == "locate"
    with pytest.raises(ValueError, match="answer"):
        parent.approve(pending)
    parent.answer(pending, "Oslo")
    assert await parent.resume() == "done"
    assert [m["content"] for m in parent.messages if m["role"] == "tool"] == ["found: Oslo"]
    validate(parent.messages)


async def test_a_workflow_answers_the_call_an_agent_inside_waits_on() -> None:
    chain = aio.Chain([aio.Agent(ScriptedModel(script()), [lookup, LOCATE]),
                       aio.Agent(ScriptedModel([Turn(text="summed up")]))])
    assert await chain.run("where?") == PAUSED
    (pending,) = chain.pending_approvals
    assert pending.external
    chain.answer(pending, "Bergen")
    assert await chain.resume() == "summed up"
    assert chain.status == "completed"
