"""One session through every wire in turn: ollama -> openai -> anthropic -> gemini ->
openai-responses -> bedrock -> ollama. Each leg adds a tool round and a reply cut by a cancel; the
next wire gets the whole transcript in its own shape (calls, results, cut text; native
data only on its own wire), and each loopback endpoint refuses what the real API refuses,
so every leg's request is one that provider accepts."""

from __future__ import annotations

import asyncio
import json

import pytest

from aimu import aio
from aimu.aio.events import TextChunk
from aimu.aio.transcript import validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from aimu.testing.server.bedrock import CREDENTIALS, REGION, TEST_KEY_ID

WIRES = ("ollama", "openai", "anthropic", "gemini", "openai-responses", "bedrock", "ollama")
LONG = " ".join(f"w{n}" for n in range(60))


def lookup(city: str) -> str:
    """The weather in a city."""
    return f"snow in {city}"


def make(wire: str, server: LoopbackServer) -> aio.ModelClient:
    if wire == "ollama":
        return aio.client("ollama:m", host=server.url)
    if wire == "anthropic":
        return aio.client("anthropic:m", base_url=server.url, api_key="sk-ant")
    if wire == "gemini":
        return aio.client("gemini:m", base_url=server.gemini_base_url, api_key="AIza")
    if wire == "bedrock":
        return aio.client("bedrock:m", region=REGION, base_url=server.url,
                          aws_access_key_id=TEST_KEY_ID,
                          aws_secret_access_key=CREDENTIALS[TEST_KEY_ID])
    return aio.client(f"{wire}:m", base_url=server.openai_base_url, api_key="sk")


async def test_a_session_goes_through_every_wire_and_back() -> None:
    messages: list[aio.Message] = []
    async with LoopbackServer() as server:
        for leg, wire in enumerate(WIRES):
            server.script = [
                Turn(thinking=f"leg {leg}", tool_calls=[ScriptedCall("lookup", {"city": wire})]),
                Turn(text=LONG, delay=0.01),
            ]
            model = make(wire, server)
            agent = aio.Agent(model, tools=[lookup])
            if messages:
                agent.restore(messages)
            handle = aio.RunHandle.start(agent.run(f"leg {leg}"))
            async for event in handle.events():
                if isinstance(event, TextChunk):
                    handle.cancel()  # the reply is cut on this wire
                    break
            with pytest.raises(asyncio.CancelledError):
                await handle
            messages = model.messages
            validate(messages)
            assert messages[-1].get("aimu_partial") is True
            assert messages[-1]["aimu_model"] == f"{wire}:m"  # type: ignore[typeddict-item]
            sent = json.dumps(server.requests[-1].body)
            assert "aimu_" not in sent
            await model.aclose()
        writers = {m.get("aimu_model") for m in messages if m["role"] == "assistant"}
        assert writers == {f"{wire}:m" for wire in WIRES}
        assert sum(m["role"] == "tool" for m in messages) == len(WIRES)
