"""Deps handed to tools (``ctx.deps``; never stored or sent) and ``system=`` as a function
evaluated at each run's start."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from aimu import aio
from aimu.aio.providers.openai import OpenAIClient
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer

MARKER = "deps-marker-7f3a"


@dataclass
class Bank:
    """App state that cannot be pickled or sent: a lock and a callback."""

    balance: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    notify: object = field(default=lambda: None)
    secret: str = MARKER


def balance(ctx: aio.ToolContext[Bank]) -> str:
    """The balance (a sync tool: runs in a worker thread)."""
    with ctx.deps.lock:
        return str(ctx.deps.balance)


async def deposit(amount: int, ctx: aio.ToolContext[Bank]) -> str:
    """Deposit (an async tool)."""
    ctx.deps.balance += amount
    return str(ctx.deps.balance)


def bank_script() -> list[Turn]:
    return [
        Turn(tool_calls=[ScriptedCall("deposit", {"amount": 5}), ScriptedCall("balance")]),
        Turn(text="done"),
    ]


def results(agent: aio.Agent) -> list[str]:
    return [m["content"] for m in agent.model_client.messages if m["role"] == "tool"]


# -- deps ----------------------------------------------------------------------------------------


async def test_tools_read_the_agents_deps_and_a_run_may_give_its_own() -> None:
    bank = Bank(10)
    model = ScriptedModel(bank_script() * 2)
    agent = aio.Agent(model, tools=[deposit, balance], deps=bank)
    assert await agent.run("pay in") == "done"
    assert results(agent) == ["15", "15"] and bank.balance == 15
    other = Bank(100)
    await agent.run("again", deps=other)
    assert results(agent)[2:] == ["105", "105"] and bank.balance == 15


async def test_a_new_session_and_a_workflow_hand_on_the_deps() -> None:
    bank = Bank(0)
    agent = aio.Agent(ScriptedModel(bank_script() * 2), tools=[deposit, balance], deps=bank)
    session = agent.start()
    await session.run("pay in")
    assert bank.balance == 5
    plain = aio.Agent(ScriptedModel(bank_script()), tools=[deposit, balance])
    given = Bank(1)
    assert await aio.Chain([plain]).run("pay in", deps=given) == "done"
    assert given.balance == 6


async def test_a_tool_given_no_deps_reads_none() -> None:
    seen: list[object] = []

    def look(ctx: aio.ToolContext) -> str:
        """Look."""
        seen.append(ctx.deps)
        return "ok"

    agent = aio.Agent(ScriptedModel([Turn(tool_calls=[ScriptedCall("look")]), Turn(text="x")]),
                      tools=[look])
    await agent.run("go")
    assert seen == [None]


@pytest.fixture
async def server() -> AsyncIterator[LoopbackServer]:
    async with LoopbackServer() as loopback:
        yield loopback


async def test_deps_are_never_stored_or_sent(server: LoopbackServer, tmp_path: Path) -> None:
    server.script = bank_script()
    store = aio.SQLiteStore(tmp_path / "s.db")
    client = OpenAIClient("m", base_url=server.openai_base_url)
    async with client, aio.Agent(client, tools=[deposit, balance], deps=Bank(1), store=store,
                                 session="s") as agent:
        assert await agent.run("pay in") == "done"
    for request in server.requests:
        assert MARKER not in repr(request.body)
    stored = repr(await store.load("s")) + repr(await store.load_state("s"))
    assert MARKER not in stored and "Lock" not in stored
    assert MARKER not in repr(agent.snapshot())
    await store.aclose()


# -- instructions per run ------------------------------------------------------------------------


async def test_a_system_function_is_evaluated_at_each_run_and_recorded() -> None:
    calls: list[aio.RunContext[Bank]] = []

    def instructions(context: aio.RunContext[Bank]) -> str:
        calls.append(context)
        return f"Balance {context.deps.balance}, run {len(calls)}."

    model = ScriptedModel([Turn(text="one"), Turn(text="two")])
    agent = aio.Agent(model, system=instructions, deps=Bank(7), name="teller")
    await agent.run("first")
    assert agent.model_client.messages[0] == {"role": "system", "content": "Balance 7, run 1."}
    assert agent.system == "Balance 7, run 1."
    await agent.run("second", deps=Bank(9))
    sent = model.requests[-1]["messages"][0]
    assert sent == {"role": "system", "content": "Balance 9, run 2."}
    assert agent.model_client.messages[0] == sent
    assert [m["role"] for m in agent.model_client.messages].count("system") == 1
    assert [(c.agent, c.task, c.session) for c in calls] == [
        ("teller", "first", None), ("teller", "second", None)
    ]


async def test_an_async_system_function_and_resume() -> None:
    async def instructions(context: aio.RunContext) -> str:
        await asyncio.sleep(0)
        return f"task: {context.task}"

    model = ScriptedModel([Turn(text="a b c", delay=3600), Turn(text="again")])
    agent = aio.Agent(model, system=instructions)
    handle = aio.RunHandle.start(agent.run("first", stream=False))
    async for event in handle.events():
        if isinstance(event, aio.TextChunk):  # the reply began: the cancel lands in it
            handle.cancel()
            break
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert await agent.resume() == "again"
    assert model.requests[-1]["messages"][0]["content"] == "task: None"


async def test_a_raising_system_function_fails_the_run_before_any_request(tmp_path: Path) -> None:
    store = aio.SQLiteStore(tmp_path / "s.db")
    fail = [False]

    def instructions(context: aio.RunContext) -> str:
        if fail[0]:
            raise LookupError("no such customer")
        return "be kind"

    model = ScriptedModel([Turn(text="hello")])
    async with aio.Agent(model, system=instructions, store=store, session="s") as agent:
        await agent.run("hi")
        before = await store.load("s")
        info = await store.info("s")
        fail[0] = True
        with pytest.raises(LookupError, match="no such customer") as caught:
            await agent.run("again")
        assert any("system= function of agent 'agent'" in note for note in caught.value.__notes__)
        assert model.turns_served == 1  # no request was made
        assert agent.model_client.messages == before
        assert await store.load("s") == before
        after = await store.info("s")
        assert after is not None and info is not None and after.status == info.status
        assert agent.last_run is not None and agent.last_run.status == "failed"
    await store.aclose()


async def test_a_system_function_must_give_text() -> None:
    agent = aio.Agent(ScriptedModel([Turn(text="x")]), system=lambda context: 42)  # type: ignore[arg-type, return-value]
    with pytest.raises(TypeError, match="must return the text"):
        await agent.run("hi")
    assert agent.model_client.messages == []
    with pytest.raises(TypeError, match="system must be"):
        aio.Agent(ScriptedModel([]), system=42)  # type: ignore[arg-type]


async def test_a_cancel_while_the_system_function_awaits_changes_nothing() -> None:
    entered = asyncio.Event()

    async def instructions(context: aio.RunContext) -> str:
        entered.set()
        await asyncio.Event().wait()
        return "never"

    model = ScriptedModel([Turn(text="x")])
    agent = aio.Agent(model, system=instructions)
    handle = aio.RunHandle.start(agent.run("hi"))
    await entered.wait()
    handle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert handle.status == "cancelled" and model.turns_served == 0
    assert agent.model_client.messages == [] and not agent.running
