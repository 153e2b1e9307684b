"""Context policies: what a long session sends, while the transcript stays whole."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from aimu import aio
from aimu.aio.client import ModelClient
from aimu.aio.providers.ollama import OllamaClient
from aimu.aio.providers.openai import OpenAIClient
from aimu.aio.transcript import Message, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer


def lookup(city: str) -> str:
    """Look a city up."""
    return f"{city} is sunny"


def with_tool(request: dict[str, object]) -> Turn:
    """Each task: one tool call, then an answer."""
    messages = request["messages"]
    assert isinstance(messages, list)
    if messages[-1]["role"] == "user":
        return Turn(tool_calls=[ScriptedCall("lookup", {"city": messages[-1]["content"]})])
    return Turn(text=f"answered {len(messages)}")


async def test_keep_last_turns_sends_the_system_prompt_and_the_last_turns() -> None:
    model = ScriptedModel(with_tool)
    agent = aio.Agent(model, tools=[lookup], system="be brief",
                      context=aio.KeepLastTurns(2))
    for city in ("Oslo", "Rome", "Lima", "Kyiv"):
        await agent.run(city)
    sent = model.requests[-1]["messages"]
    assert sent[0] == {"role": "system", "content": "be brief"}
    users = [m["content"] for m in sent if m["role"] == "user"]
    assert users == ["Lima", "Kyiv"]
    assert sent[1]["role"] == "user"  # the cut falls before a user message, never inside
    whole = agent.model_client.messages
    assert [m["content"] for m in whole if m["role"] == "user"] == ["Oslo", "Rome", "Lima", "Kyiv"]
    validate(whole)


@pytest.fixture
async def server() -> AsyncIterator[LoopbackServer]:
    async with LoopbackServer(with_tool) as loopback:  # type: ignore[arg-type]
        yield loopback


@pytest.mark.parametrize("provider", ["ollama", "openai"])
async def test_the_server_accepts_every_view_and_the_store_keeps_it_all(
    provider: str, server: LoopbackServer, tmp_path: Path
) -> None:
    client: ModelClient = (
        OllamaClient("m", host=server.url) if provider == "ollama"
        else OpenAIClient("m", base_url=server.openai_base_url)
    )
    store = aio.SQLiteStore(tmp_path / "s.db")
    async with client, aio.Agent(client, tools=[lookup], store=store, session="s",
                                 context=aio.KeepLastTurns(1)) as agent:
        for city in ("Oslo", "Rome", "Lima"):
            assert (await agent.run(city)).startswith("answered")
        assert await store.load("s") == agent.model_client.messages
        assert len(agent.model_client.messages) == 12  # 3 x (user, call, result, answer)
    last = server.requests[-1].body["messages"]
    assert [m["role"] for m in last] == ["user", "assistant", "tool"]
    await store.aclose()


async def test_a_policy_of_your_own() -> None:
    class LastMessageOnly:
        def view(self, messages: Sequence[Message]) -> Sequence[Message]:
            return messages[-1:]

    model = ScriptedModel([Turn(text="a"), Turn(text="b")])
    agent = aio.Agent(model, context=LastMessageOnly())
    await agent.run("one")
    await agent.run("two")
    assert model.requests[-1]["messages"] == [{"role": "user", "content": "two"}]


async def test_the_context_window_is_checked_against_what_is_sent() -> None:
    model = ScriptedModel([Turn(text="ok")] * 6)
    model.context_window = 60
    agent = aio.Agent(model, context=aio.KeepLastTurns(1))
    for _ in range(5):
        assert await agent.run("x" * 150) == "ok"  # the whole would not fit; the view does
    whole = aio.Agent(ScriptedModel([Turn(text="ok")] * 6))
    whole.model_client.context_window = 60
    assert await whole.run("x" * 150) == "ok"
    await whole.run("x" * 150)  # all of it: 2 x 150 characters: about 80 tokens
    assert whole.last_run is not None and whole.last_run.stop_reason == "limit:context_window"


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="positive int"):
        aio.KeepLastTurns(0)
    with pytest.raises(TypeError, match="context policy"):
        aio.Agent(ScriptedModel([]), context=3)  # type: ignore[arg-type]
