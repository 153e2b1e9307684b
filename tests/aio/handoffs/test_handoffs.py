"""Handoffs (issue 33 item 2): a transfer tool per target; the target answers from then on
in the same session; who spoke is recorded, kept by the store and a resume; stops during
and after a handoff keep the invariants; an unknown target is a tool error."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.transcript import Message, dangling_calls, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel


def _valid(messages: list[Message]) -> None:
    validate(messages)
    assert dangling_calls(messages) == []


def _agents(turns: list[Turn], **options: Any) -> tuple[aio.Agent[str], ScriptedModel]:
    model = ScriptedModel(turns)
    billing = aio.Agent(model.fork(), system="You are billing.", name="billing")
    support = aio.Agent(model.fork(), system="You are support.", name="support")
    triage = aio.Agent(model, system="You are triage.", name="triage",
                       handoffs=[billing, support], **options)
    return triage, model


def _transfer(to: str, call_id: str = "t1", text: str = "") -> Turn:
    return Turn(text=text, tool_calls=[ScriptedCall(f"transfer_to_{to}", {}, id=call_id)])


async def test_the_target_answers_from_then_on() -> None:
    triage, model = _agents([
        _transfer("billing"), Turn(text="billing here"), Turn(text="billing again"),
    ])
    assert await triage.run("my invoice") == "billing here"
    assert model.requests[0]["tools"] == ["transfer_to_billing", "transfer_to_support"]
    second = model.requests[1]
    assert second["messages"][0] == {"role": "system", "content": "You are billing."}
    assert second["tools"] == ["transfer_back_to_triage"]
    speakers = [m.get("aimu_agent") for m in triage.messages if m["role"] == "assistant"]
    assert speakers == ["triage", "billing"]
    # the next run of the session goes on with billing
    assert await triage.run("and another thing") == "billing again"
    assert triage.messages[-1].get("aimu_agent") == "billing"
    _valid(triage.messages)


async def test_the_target_hands_back() -> None:
    triage, model = _agents([
        _transfer("support"),
        Turn(tool_calls=[ScriptedCall("transfer_back_to_triage", {}, id="b1")]),
        Turn(text="triage again"),
    ])
    assert await triage.run("help") == "triage again"
    assert model.requests[2]["messages"][0]["content"] == "You are triage."
    assert [m.get("aimu_agent") for m in triage.messages if m["role"] == "assistant"] == [
        "triage", "support", "triage",
    ]


async def test_an_unknown_target_is_a_tool_error_the_model_reads() -> None:
    triage, model = _agents([_transfer("nobody"), Turn(text="sorry")])
    assert await triage.run("x") == "sorry"
    result = triage.messages[3]
    assert result["role"] == "tool" and "transfer_to_nobody" in result["content"]
    assert model.requests[1]["messages"][0]["content"] == "You are triage."  # no switch
    _valid(triage.messages)


async def test_an_input_filter_chooses_what_the_target_is_sent() -> None:
    model = ScriptedModel([_transfer("billing"), Turn(text="ok")])
    billing = aio.Agent(model.fork(), system="You are billing.", name="billing")

    def last_user_only(messages: list[Message]) -> list[Message]:
        users = [m for m in messages if m["role"] == "user"]
        return [messages[0], users[-1]]

    triage = aio.Agent(model, name="triage", system="You are triage.",
                       handoffs=[aio.Handoff(billing, input_filter=last_user_only)])
    await triage.run("pay")
    assert [m["role"] for m in model.requests[1]["messages"]] == ["system", "user"]
    assert len(triage.messages) == 5  # the transcript itself stays whole


async def test_who_spoke_survives_the_store_and_a_new_process(tmp_path: Path) -> None:
    store = aio.SQLiteStore(tmp_path / "h.db")
    triage, _ = _agents([_transfer("billing"), Turn(text="billing here")],
                        store=store, session="h1")
    async with triage:
        await triage.run("invoice")
    # a new object on the stored session: billing has the conversation
    again, model2 = _agents([Turn(text="billing, resumed")], store=store, session="h1")
    async with again:
        assert again.messages[-1].get("aimu_agent") == "billing"
        assert await again.run("more") == "billing, resumed"
    assert model2.requests[0]["messages"][0]["content"] == "You are billing."
    await store.aclose()


async def test_a_crash_after_the_transfer_resumes_with_the_target(tmp_path: Path) -> None:
    """The run stops right after the transfer's result is stored (a cancel at the next
    turn's first await: as good as a kill there); a resume in a new object continues
    with billing, whose turn had not started."""
    store = aio.SQLiteStore(tmp_path / "c.db")
    triage, _ = _agents([_transfer("billing"), Turn(text="x", fault="hang")],
                        store=store, session="c1")
    stream = triage.run("invoice", stream=True)
    async for event in stream:
        if isinstance(event, aio.ToolResult):
            break  # the consumer leaves: the run is cancelled, settled
    await triage.aclose()
    again, model2 = _agents([Turn(text="billing after the crash")], store=store, session="c1")
    async with again:
        _valid(again.messages)
        assert await again.resume() == "billing after the crash"
    assert model2.requests[0]["messages"][0]["content"] == "You are billing."
    await store.aclose()


async def test_a_cancel_while_the_target_streams_keeps_the_invariants() -> None:
    triage, _ = _agents([_transfer("billing"), Turn(text="billing is typing", chunks=3,
                                                   fault="hang", fault_after=2)])
    seen = asyncio.Event()

    async def consume() -> None:
        async for event in triage.run("invoice", stream=True):
            if isinstance(event, aio.TextChunk) and event.source == "billing":
                seen.set()

    task = asyncio.create_task(consume())
    await seen.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    last = triage.messages[-1]
    assert last.get("aimu_partial") is True and last.get("aimu_agent") == "billing"
    _valid(triage.messages)


async def test_an_interrupt_during_the_transfer_round() -> None:
    triage, model = _agents([_transfer("billing"), Turn(text="billing here")])
    handle = aio.RunHandle.start(triage.run("invoice"))
    async for event in handle.events():
        if isinstance(event, aio.ToolCallStarted):
            handle.interrupt()  # the round finishes; the run stops at the boundary
    assert await handle == aio.agent.INTERRUPTED
    _valid(triage.messages)
    # the transfer was taken: the resume goes on with billing
    assert await triage.resume() == "billing here"
    assert model.requests[1]["messages"][0]["content"] == "You are billing."


async def test_bad_handoffs_are_refused() -> None:
    with pytest.raises(TypeError, match="handoffs"):
        aio.Agent(aio.client("test"), handoffs=["billing"])  # type: ignore[list-item]
    a = aio.Agent(aio.client("test"), name="a")
    with pytest.raises(ValueError, match="transfer_to_a"):
        aio.Agent(aio.client("test"), handoffs=[a, a])


async def test_a_clean_start_goes_back_to_the_home_agent() -> None:
    triage, model = _agents([_transfer("billing"), Turn(text="billing"), Turn(text="fresh")])
    await triage.run("invoice")
    assert await triage.run("new topic", reset=True) == "fresh"
    assert model.requests[2]["messages"][0]["content"] == "You are triage."
    assert triage.messages[-1].get("aimu_agent") == "triage"


def _sweep_script() -> list[Turn]:
    return [
        _transfer("billing", text="passing you on"),
        Turn(text="let me look", chunks=2, tool_calls=[ScriptedCall("lookup", {"q": "x"})]),
        Turn(text="billing answer", chunks=2),
    ]


def lookup(q: str) -> str:
    """Look something up."""
    return f"found {q}"


def _swept() -> aio.Agent[str]:
    model = ScriptedModel(_sweep_script())
    billing = aio.Agent(model.fork(), [lookup], system="You are billing.", name="billing")

    async def slow_check(ctx: Any, text: str) -> None:
        await asyncio.sleep(0)  # decides a loop turn later: beside the first turn

    return aio.Agent(model, system="You are triage.", name="triage", handoffs=[billing],
                     input_guardrails=[slow_check])


async def test_a_stop_at_every_event_of_a_handoff_run() -> None:
    """Leaving the stream (a cancel) and an interrupt at each event of a run that hands
    over, runs a tool as the target and answers: the transcript is valid, calls settled,
    nothing left running; an interrupted run resumes to the answer with billing."""
    count = len([e async for e in _swept().run("invoice", stream=True)])
    current = asyncio.current_task()
    for stop_at in range(count - 1):
        agent = _swept()
        seen = 0
        async with agent.run("invoice", stream=True) as stream:
            async for _event in stream:
                seen += 1
                if seen > stop_at:
                    break  # leaving: a cancel of the run, landing here, settled on exit
        _valid(agent.messages)
        assert agent.last_run is not None and agent.last_run.status == "cancelled"
        agent = _swept()
        handle = aio.RunHandle.start(agent.run("invoice"))
        seen = 0
        async for _event in handle.events():
            seen += 1
            if seen == stop_at + 1:
                handle.interrupt()
        reply = await handle
        _valid(agent.messages)
        if handle.status == "interrupted":
            assert await agent.resume() == "billing answer"
        else:
            assert reply == "billing answer"
        assert agent.messages[-1].get("aimu_agent") == "billing"
        left = {t for t in asyncio.all_tasks() if t is not current and not t.done()}
        assert left == set()


async def test_every_record_field_stays_right_across_a_handoff(tmp_path: Path) -> None:
    """The run's record (and its start and end events) name the session's agent, the
    models that wrote its replies, how it ended and why, through a handoff, a run that
    starts handed over, and a cancel while the target streams."""
    store = aio.SQLiteStore(tmp_path / "s.db")
    billing = aio.Agent(
        ScriptedModel([Turn(text="billing here"), Turn(text="billing again"),
                       Turn(text="billing is typing", chunks=3, fault="hang", fault_after=2)],
                      model="billing-m"),
        system="You are billing.", name="billing",
    )
    triage = aio.Agent(ScriptedModel([_transfer("billing")], model="triage-m"),
                       system="You are triage.", name="triage", handoffs=[billing],
                       store=store, session="s")

    async def run(task: str, stop_at: str | None = None) -> list[aio.Event]:
        handle = aio.RunHandle.start(triage.run(task))
        seen: list[aio.Event] = []
        async for event in handle.events():
            seen.append(event)
            if stop_at is not None and isinstance(event, aio.TextChunk):
                handle.cancel(stop_at)
        return seen

    try:
        ends = [await run("my invoice"), await run("and another thing"),
                await run("one more", stop_at="the person pressed stop")]
        assert triage.messages[-1].get("aimu_partial") is True
        records = list(reversed(await store.runs(session="s")))
        assert [(r.agent, r.status, r.reason, r.parent, r.models) for r in records] == [
            ("triage", "completed", None, None, ("scripted:triage-m", "scripted:billing-m")),
            ("triage", "completed", None, None, ("scripted:billing-m",)),
            ("triage", "cancelled", "the person pressed stop", None, ("scripted:billing-m",)),
        ]
        for events, record in zip(ends, records, strict=True):
            [started] = [e for e in events if isinstance(e, aio.RunStarted)]
            [finished] = [e for e in events if isinstance(e, aio.RunFinished)]
            assert started.source == finished.source == record.agent
            assert finished.status == record.status
        assert triage.last_run is not None and triage.last_run.source == "triage"
        _valid(await store.load("s"))
    finally:
        await triage.aclose()
        await store.aclose()


async def test_no_client_holds_the_conversation_across_a_handoff() -> None:
    """The session owns the transcript: the home client, the target's client and the fork
    that speaks for the target hold none (a fork once emptied a list of its own, and the
    run's record read the emptied one); ``model_client.messages`` is the user's view."""
    triage, model = _agents([_transfer("billing"), Turn(text="billing here")])
    billing = triage.config.handoffs[0].agent
    assert await triage.run("my invoice") == "billing here"
    speaking = triage._session.client  # the fork of billing's client
    assert speaking is not model and isinstance(speaking, ScriptedModel)
    for client in (model, billing.model_client, speaking):
        assert "messages" not in vars(client), client
    assert triage.model_client.messages is triage.messages
    assert billing.model_client.messages is billing.messages  # its own session's: unused
    assert billing.messages == [{"role": "system", "content": "You are billing."}]
    assert speaking.messages == []  # given to no session
    assert triage.last_run is not None
    assert [m.get("aimu_agent") for m in triage.last_run.messages
            if m["role"] == "assistant"] == ["triage", "billing"]
