"""Stopping over the wire: the failures comparable libraries ship, as tests (PRIOR-ART.md).

Each test drives a real client against the loopback server, so what is asserted is
what a model API would have received.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from aimu import aio
from aimu.aio.agent import INTERRUPTED
from aimu.aio.events import RunFinished, TextChunk
from aimu.aio.transcript import CANCELLED_RESULT, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer


def openai_client(server: LoopbackServer) -> aio.ModelClient:
    return aio.client("openai:m", base_url=server.openai_base_url, api_key="sk-test")


def answered_ids(messages: list[dict[str, Any]]) -> tuple[set[str], set[str]]:
    """(ids of every tool call sent, ids of every tool result sent)."""
    calls = {c["id"] for m in messages if m["role"] == "assistant" for c in m.get("tool_calls", ())}
    results = {m["tool_call_id"] for m in messages if m["role"] == "tool"}
    return calls, results


async def test_a_cancel_mid_tool_never_sends_a_dangling_call() -> None:
    started = asyncio.Event()

    async def charge(amount: int) -> str:
        """Charge a card."""
        started.set()
        await asyncio.sleep(10)
        return "charged"

    def fast() -> str:
        """Answer at once."""
        return "fast done"

    script = [
        Turn(tool_calls=[ScriptedCall("fast"), ScriptedCall("charge", {"amount": 5})]),
        Turn(text="carried on"),
    ]
    async with LoopbackServer(script) as server, openai_client(server) as model:
        agent = aio.Agent(model, tools=[fast, charge])
        handle = aio.RunHandle.start(agent.run("pay"))
        await started.wait()
        assert handle.cancel("user pressed stop")
        with pytest.raises(asyncio.CancelledError):
            await handle
        assert handle.status == "cancelled" and handle.reason == "user pressed stop"
        assert await agent.run("go on") == "carried on"
        sent = server.requests[-1].body["messages"]
        calls, results = answered_ids(sent)
        assert calls == results and len(calls) == 2
        contents = {m["tool_call_id"]: m["content"] for m in sent if m["role"] == "tool"}
        assert sorted(contents.values()) == sorted([CANCELLED_RESULT, "fast done"])


async def test_stop_with_grace_bounds_the_wait_for_a_silent_model() -> None:
    # The model says nothing at all: an interrupt alone would wait forever.
    silent = LoopbackServer([Turn(text="never", fault="hang")])
    async with silent as server, openai_client(server) as model:
        agent = aio.Agent(model)
        handle = aio.RunHandle.start(agent.run("think hard"))
        for _ in range(10_000):  # until the server provably has the request
            if server.requests:
                break
            await asyncio.sleep(0.001)
        assert await handle.stop(grace=0.1) == "cancelled"
        assert (await server.wait_abandoned(1))[0].abandoned
        validate(agent.model_client.messages)
        server.script = [Turn(text="fresh")]
        # The interrupt asked for by stop() did not outlive its run.
        assert await agent.run("again") == "fresh"
        assert agent.last_status == "completed"


async def test_a_tool_timeout_never_fires_in_the_consumers_code() -> None:
    @aio.tool(timeout=0.05)
    async def quick() -> str:
        """Return at once."""
        return "quick"

    agent = aio.Agent(aio.client("test"), tools=[quick])
    seen: list[Any] = []
    async for event in agent.run("use the tool", stream=True):
        seen.append(event)
        await asyncio.sleep(0.1)  # slower than the tool's timeout, in our own code
    final = seen[-1]
    assert isinstance(final, RunFinished) and final.status == "completed"
    assert "quick" in final.reply


async def test_interrupt_mid_stream_over_the_wire_finishes_the_step() -> None:
    asked = asyncio.Event()

    async def lookup(city: str) -> str:
        """Look a city up."""
        await asked.wait()  # the step is still in flight when the interrupt comes
        return f"{city}: sunny"

    script = [
        Turn(text="let me look that up", delay=0.01,
             tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})]),
        Turn(text="Oslo is sunny"),
    ]
    async with LoopbackServer(script) as server:
        model = aio.client("ollama:m", host=server.url)
        try:
            agent = aio.Agent(model, tools=[lookup])
            handle = aio.RunHandle.start(agent.run("weather in Oslo?"))
            async for event in handle.events():
                if isinstance(event, TextChunk):
                    assert handle.interrupt()
                    asked.set()
            assert await handle == INTERRUPTED
            assert handle.status == "interrupted"
            assert len(server.requests) == 1  # no model call after the boundary
            assert [m["role"] for m in agent.model_client.messages] == [
                "user", "assistant", "tool",
            ]
            assert await agent.resume() == "Oslo is sunny"
            body = server.requests[-1].body
            assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool"]
            assert json.dumps(body).count("weather in Oslo?") == 1
        finally:
            await model.aclose()
