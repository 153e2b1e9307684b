"""The tool journal (issue 13 §3): a call's start is durable before the tool runs, and a
call a crash left *in doubt* follows its tool's policy on the next load.

A crash is the state ``kill -9`` leaves in a store: the assistant turn and some results
recorded, starts journalled, the rest missing; it is written here through a writer (the
kill -9 loop itself is in test_journal_crash.py). Every backend of the contract suite.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine, Sequence
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.journal import IN_DOUBT_RESULT, RERUN_NOTE
from aimu.aio.store import SessionWriter, Store
from aimu.aio.transcript import CANCELLED_RESULT, Message, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from tests.aio.store.store_backends import KINDS, Backend, backend

SESSION = "journal"


@pytest.fixture(params=KINDS)
async def where(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    async with backend(str(request.param), tmp_path) as location:
        yield location


class Ledger:
    """The side effects of the tools: every call that ran, by call id."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, str]] = []

    def tools(self) -> list[aio.Tool]:
        @aio.tool(idempotent=True)
        def lookup(key: str, ctx: aio.ToolContext) -> str:
            """Read a value (safe to run twice)."""
            self.ran.append(("lookup", ctx.call_id))
            return f"value of {key}"

        def charge(amount: int, ctx: aio.ToolContext) -> str:
            """Charge a card (never twice)."""
            self.ran.append(("charge", ctx.call_id))
            return f"charged {amount}"

        return [lookup, aio.tool(charge)]


def crashed_turn() -> list[Message]:
    """A task and the turn the crash cut: three calls, none answered."""
    return [
        {"role": "user", "content": "pay and report"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c_lookup", "type": "function",
             "function": {"name": "lookup", "arguments": {"key": "k"}}},
            {"id": "c_charge", "type": "function",
             "function": {"name": "charge", "arguments": {"amount": 5}}},
            {"id": "c_never", "type": "function",
             "function": {"name": "charge", "arguments": {"amount": 7}}},
        ]},
    ]


async def write_crash(store: Store, started: Sequence[str] = ("c_lookup", "c_charge")) -> None:
    """What a process killed while ``started`` ran leaves behind."""
    writer = await store.open_session(SESSION)
    try:
        for message in crashed_turn():
            await writer.append(message)
        calls = {c["id"]: c for c in crashed_turn()[1].get("tool_calls", [])}  # type: ignore[union-attr]
        for call_id in started:
            function = calls[call_id]["function"]
            await writer.record_tool_start(call_id, function["name"], function["arguments"])
        await writer.set_status("in_progress")
    finally:
        await writer.aclose()


def results(messages: Sequence[Message]) -> dict[str, str]:
    return {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}


async def stored(where: Backend) -> list[Message]:
    store = where.make()
    try:
        return await store.load(SESSION)
    finally:
        await store.aclose()


async def test_tool_flag_idempotent_every_spelling() -> None:
    def f() -> str:
        return "x"

    assert aio.tool(f).idempotent is False
    assert aio.tool(f, idempotent=True).idempotent is True
    assert aio.tool(idempotent=True)(f).idempotent is True
    # Re-wrapping a Tool keeps the flag unless it is overridden.
    assert aio.tool(aio.tool(f, idempotent=True), name="g").idempotent is True
    assert aio.tool(aio.tool(f, idempotent=True), idempotent=False).idempotent is False


async def test_the_start_is_durable_before_the_tool_runs_and_ctx_call_id_is_the_models(
    where: Backend,
) -> None:
    store = where.make()
    seen: list[Any] = []

    async def charge(amount: int, ctx: aio.ToolContext) -> str:
        """Charge a card."""
        # A second store instance reads what the journal holds now, while the tool runs.
        reader = where.make()
        try:
            seen.extend(await reader.tool_starts(SESSION))
        finally:
            await reader.aclose()
        return f"charged {amount} with key {ctx.call_id}"

    model = ScriptedModel([
        Turn(tool_calls=(ScriptedCall("charge", {"amount": 3}, id="pay-1"),)),
        Turn(text="done"),
    ])
    try:
        async with aio.Agent(model, tools=[charge], store=store, session=SESSION) as agent:
            assert await agent.run("pay") == "done"
            assert results(agent.model_client.messages) == {"pay-1": "charged 3 with key pay-1"}
    finally:
        await store.aclose()
    assert [(s.call_id, s.name, s.arguments) for s in seen] == [("pay-1", "charge", {"amount": 3})]


async def test_resume_after_a_crash_follows_each_tools_policy(where: Backend) -> None:
    store = where.make()
    await write_crash(store)
    ledger = Ledger()
    model = ScriptedModel([Turn(text="reported")])
    try:
        async with aio.Agent(
            model, tools=ledger.tools(), store=store, session=SESSION
        ) as agent:
            assert await agent.resume() == "reported"
            messages = agent.model_client.messages
    finally:
        await store.aclose()
    # Only the idempotent call ran again; the one that never started did not run either.
    assert ledger.ran == [("lookup", "c_lookup")]
    got = results(messages)
    assert got == {
        "c_lookup": f"{RERUN_NOTE}\nvalue of k",
        "c_charge": IN_DOUBT_RESULT,
        "c_never": CANCELLED_RESULT,
    }
    validate(messages)
    assert await stored(where) == messages
    # The model saw every call answered, the in-doubt one told as unknown.
    sent = model.requests[0]["messages"]
    assert {m["tool_call_id"]: m["content"] for m in sent if m["role"] == "tool"} == got


async def test_a_decision_survives_open_and_close_without_a_run(where: Backend) -> None:
    setup = where.make()
    await write_crash(setup)
    await setup.aclose()
    ledger = Ledger()
    # Open and close: the non-idempotent call is settled for good, the idempotent one
    # stays due (it has no result yet), so the next process still runs it again.
    first_store = where.make()
    first = aio.Agent(ScriptedModel([]), tools=ledger.tools(), store=first_store,
                      session=SESSION)
    await first.open()
    await first.aclose()
    await first_store.aclose()
    assert results(await stored(where)) == {"c_charge": IN_DOUBT_RESULT,
                                            "c_never": CANCELLED_RESULT}
    store = where.make()
    try:
        agent = aio.Agent(ScriptedModel([Turn(text="ok")]), tools=ledger.tools(), store=store,
                          session=SESSION)
        async with agent:
            assert await agent.resume() == "ok"
    finally:
        await store.aclose()
    assert ledger.ran == [("lookup", "c_lookup")]


async def test_a_new_task_instead_of_resume_runs_nothing_again(where: Backend) -> None:
    store = where.make()
    await write_crash(store)
    ledger = Ledger()
    try:
        agent = aio.Agent(ScriptedModel([Turn(text="fresh")]), tools=ledger.tools(),
                          store=store, session=SESSION)
        async with agent:
            assert await agent.run("something else") == "fresh"
            messages = agent.model_client.messages
    finally:
        await store.aclose()
    assert ledger.ran == []
    assert results(messages) == {"c_lookup": IN_DOUBT_RESULT, "c_charge": IN_DOUBT_RESULT,
                                 "c_never": CANCELLED_RESULT}
    validate(messages)
    assert await stored(where) == messages


async def test_a_crash_during_the_rerun_leaves_it_in_doubt_again(where: Backend) -> None:
    """The re-run journals its start again: a second crash makes it due once more."""
    store = where.make()
    await write_crash(store, started=("c_lookup",))
    writer: SessionWriter = await store.open_session(SESSION)
    await writer.record_tool_start("c_lookup", "lookup", {"key": "k"})  # the re-run began
    await writer.aclose()
    ledger = Ledger()
    try:
        agent = aio.Agent(ScriptedModel([Turn(text="ok")]), tools=ledger.tools(), store=store,
                          session=SESSION)
        async with agent:
            await agent.resume()
    finally:
        await store.aclose()
    assert ledger.ran == [("lookup", "c_lookup")]
    assert results(await stored(where))["c_never"] == CANCELLED_RESULT
    assert results(await stored(where))["c_charge"] == CANCELLED_RESULT  # never started


async def cancel_at(
    agent: aio.Agent, run: Coroutine[Any, Any, str], landed: asyncio.Event
) -> list[Message]:
    """Cancel ``run`` once ``landed`` is set; the transcript it leaves must be valid."""
    task = asyncio.ensure_future(run)
    await landed.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    messages = agent.model_client.messages
    validate(messages)
    return messages


class StallingStore:
    """A store whose writers stall in record_tool_start until released, keeping the
    contract: a cancel landing there lets the write complete, then raises. With
    ``fail``, the journal write fails instead (a full disk)."""

    def __init__(self, inner: Store, *, fail: bool = False) -> None:
        self.inner = inner
        self.entered = asyncio.Event()
        self.fail = fail

    async def open_session(self, session: str) -> SessionWriter:
        writer = await self.inner.open_session(session)
        outer = self

        class Stalling:
            def __getattr__(self, name: str) -> Any:
                return getattr(writer, name)

            async def record_tool_start(self, call_id: str, name: str, arguments: Any) -> None:
                outer.entered.set()
                if outer.fail:
                    raise aio.StoreError(f"disk full: cannot journal {call_id!r}")
                try:
                    await asyncio.Event().wait()
                finally:
                    await writer.record_tool_start(call_id, name, arguments)

        return Stalling()  # type: ignore[return-value]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("landing", ["record_tool_start", "tool"])
async def test_a_cancel_landing_during_the_start_or_the_tool_keeps_the_journal_right(
    where: Backend, landing: str
) -> None:
    inner = where.make()
    store = StallingStore(inner) if landing == "record_tool_start" else inner
    tool_running = asyncio.Event()
    ran: list[str] = []

    async def charge(amount: int) -> str:
        """Charge a card."""
        ran.append("charge")
        tool_running.set()
        await asyncio.Event().wait()
        return "unreachable"

    model = ScriptedModel([Turn(tool_calls=(ScriptedCall("charge", {"amount": 1}, id="p"),))])
    agent = aio.Agent(model, tools=[charge], store=store, session=SESSION)  # type: ignore[arg-type]
    try:
        landed = store.entered if isinstance(store, StallingStore) else tool_running
        messages = await cancel_at(agent, agent.run("pay"), landed)
        assert results(messages) == {"p": CANCELLED_RESULT}
        assert ran == ([] if landing == "record_tool_start" else ["charge"])
        await agent.aclose()
        # The start is journalled either way; the call has its result, so it is not in
        # doubt: a new process resumes without running anything again.
        assert [s.call_id for s in await inner.tool_starts(SESSION)] == ["p"]
        assert await inner.load(SESSION) == messages
        again = aio.Agent(ScriptedModel([Turn(text="ok")]), tools=[charge], store=inner,
                          session=SESSION)
        async with again:
            assert await again.resume() == "ok"
        assert ran == ([] if landing == "record_tool_start" else ["charge"])
        assert results(again.model_client.messages) == {"p": CANCELLED_RESULT}
    finally:
        await agent.aclose()
        await inner.aclose()


async def test_concurrent_tools_rerun_every_in_doubt_idempotent_call(where: Backend) -> None:
    store = where.make()
    writer = await store.open_session(SESSION)
    calls = [{"id": f"r{i}", "type": "function",
              "function": {"name": "lookup", "arguments": {"key": str(i)}}} for i in range(3)]
    await writer.append({"role": "user", "content": "look up three"})
    await writer.append({"role": "assistant", "content": "", "tool_calls": calls})  # type: ignore[typeddict-item]
    await writer.append({"role": "tool", "content": "value of 0", "tool_call_id": "r0",
                         "name": "lookup"})
    for call in calls:
        await writer.record_tool_start(call["id"], "lookup", call["function"]["arguments"])
    await writer.aclose()
    ledger = Ledger()
    try:
        agent = aio.Agent(ScriptedModel([Turn(text="ok")]), tools=ledger.tools(), store=store,
                          session=SESSION, concurrent_tools=True)
        async with agent:
            assert await agent.resume() == "ok"
            messages = agent.model_client.messages
    finally:
        await store.aclose()
    # r0 had its result before the crash: it is not in doubt and does not run again.
    assert sorted(ledger.ran) == [("lookup", "r1"), ("lookup", "r2")]
    assert results(messages) == {"r0": "value of 0", "r1": f"{RERUN_NOTE}\nvalue of 1",
                                 "r2": f"{RERUN_NOTE}\nvalue of 2"}
    validate(messages)
    assert await stored(where) == messages


async def test_a_cancel_during_the_rerun_settles_it_and_nothing_is_in_doubt_after(
    where: Backend,
) -> None:
    store = where.make()
    await write_crash(store, started=("c_lookup",))
    running = asyncio.Event()
    ran: list[str] = []

    @aio.tool(idempotent=True)
    async def lookup(key: str) -> str:
        """Read a value."""
        ran.append(key)
        running.set()
        await asyncio.Event().wait()
        return "unreachable"

    agent = aio.Agent(ScriptedModel([]), tools=[lookup, Ledger().tools()[1]], store=store,
                      session=SESSION)
    try:
        messages = await cancel_at(agent, agent.resume(), running)
        assert results(messages) == {"c_lookup": CANCELLED_RESULT,
                                     "c_charge": CANCELLED_RESULT, "c_never": CANCELLED_RESULT}
        await agent.aclose()
        assert await store.load(SESSION) == messages
        again = aio.Agent(ScriptedModel([Turn(text="ok")]), tools=[lookup], store=store,
                          session=SESSION)
        async with again:
            assert await again.resume() == "ok"
        assert ran == ["k"]  # the cancelled re-run has its result: not in doubt any more
    finally:
        await agent.aclose()
        await store.aclose()


async def test_a_tool_whose_start_cannot_be_journalled_does_not_run(where: Backend) -> None:
    inner = where.make()
    ran: list[int] = []

    def charge(amount: int) -> str:
        """Charge a card."""
        ran.append(amount)
        return "charged"

    model = ScriptedModel([Turn(tool_calls=(ScriptedCall("charge", {"amount": 1}, id="p"),))])
    store = StallingStore(inner, fail=True)
    agent = aio.Agent(model, tools=[charge], store=store, session=SESSION)  # type: ignore[arg-type]
    try:
        with pytest.raises(aio.StoreError, match="cannot journal 'p'"):
            await agent.run("pay")
        assert ran == []
        assert agent.last_status == "failed"
        validate(agent.model_client.messages)
        assert results(agent.model_client.messages) == {"p": CANCELLED_RESULT}
    finally:
        await agent.aclose()
        await inner.aclose()
