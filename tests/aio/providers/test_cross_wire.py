"""A session started on one wire and continued on another: stopped mid-reply after a tool
round on the first, stored, then ``resume()``-d from the store (and a new task run) by an
agent on the second, against the loopback server, which refuses what each real server
refuses. What one wire needs back unchanged (Gemini's thought signatures) goes only to
that wire; calls another wire wrote reach Gemini with the placeholder signature its docs
name; the model that wrote each reply stays ``aimu_model``-free on the wire."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.events import StepFinished, TextChunk
from aimu.aio.providers.gemini import SKIP_SIGNATURE
from aimu.aio.transcript import validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer

FINAL = "done with both cities"


def lookup(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def make(provider: str, server: LoopbackServer) -> aio.ModelClient:
    if provider == "ollama":
        return aio.client("ollama:m", host=server.url)
    if provider == "gemini":
        return aio.client("gemini:m", base_url=server.gemini_base_url, api_key="AIza-test")
    return aio.client(f"{provider}:m", base_url=server.openai_base_url, api_key="sk-test")


def script(request: Mapping[str, Any], held: list[bool]) -> Turn:
    """Round 0: thinking, text and two calls; round 1 held after two chunks the first
    time (the stop lands there); then the answer."""
    messages = request["messages"]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    if messages[last_user]["content"].endswith("again"):
        return Turn(text="again ok")
    results = sum(m["role"] == "tool" for m in messages[last_user:])
    if results == 0:
        calls = [ScriptedCall("lookup", {"city": c}) for c in ("Oslo", "Rome")]
        return Turn(thinking="two cities", text="looking", tool_calls=calls)
    if not held:
        held.append(True)
        return Turn(text="one two three four", fault="hang", fault_after=2)
    return Turn(text=FINAL)


async def stopped_mid_reply(agent: aio.Agent) -> None:
    """Run until two chunks of the second reply were shown, then cancel."""
    shown = asyncio.Event()

    async def consume() -> None:
        chunks = steps = 0
        async with aclosing(agent.run("weather in two cities", stream=True)) as events:
            async for event in events:
                steps += isinstance(event, StepFinished)
                chunks += isinstance(event, TextChunk) and steps == 1
                if chunks == 2:
                    shown.set()

    task = asyncio.ensure_future(consume())
    await shown.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize(
    ("first", "then"),
    [("openai", "gemini"), ("ollama", "gemini"), ("gemini", "openai"),
     ("gemini", "openai-responses")],
)
async def test_a_session_started_on_one_wire_goes_on_on_another(
    first: str, then: str, tmp_path: Path
) -> None:
    held: list[bool] = []
    async with LoopbackServer(lambda request: script(request, held)) as server:
        store = aio.SQLiteStore(tmp_path / "s.db")
        agent = aio.Agent(make(first, server), tools=[lookup], store=store, session="s")
        await stopped_mid_reply(agent)
        await server.wait_abandoned(1)
        assert agent.model_client.messages[-1]["aimu_partial"] is True
        await agent.aclose()

        again = aio.Agent(make(then, server), tools=[lookup], store=store, session="s")
        assert await again.resume() == FINAL  # the second wire took the first's transcript
        assert await again.run("and again") == "again ok"
        messages = again.model_client.messages
        validate(messages)
        assert await store.load("s") == messages
        sent = [r for r in server.requests if r.protocol != first or first == then][-2:]
        wire = json.dumps([r.body for r in sent])
        assert "aimu_" not in wire
        if then == "gemini":  # the first wire's calls, signed with the placeholder
            calls = [p for c in sent[0].body["contents"] for p in c["parts"]
                     if "functionCall" in p]
            assert [p.get("thoughtSignature") for p in calls] == [SKIP_SIGNATURE, None]
        if first == "gemini":  # Gemini's signatures stay home
            assert "thoughtSignature" not in wire and "aimu-loopback" not in wire
            signed = [m for m in messages if m.get("aimu_native")]
            assert signed and all(m["aimu_native"]["wire"] == "gemini" for m in signed)  # type: ignore[typeddict-item]
        await again.aclose()
        await store.aclose()
