"""Answers that continue: after a stop mid-answer, ``resume(continue_partial=True)`` sends
the partial answer as the assistant's prefix where the server continues one, and the
final transcript holds one assistant message; elsewhere it re-asks, and says so."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aimu import aio
from aimu.aio.client import ModelClient
from aimu.aio.events import RunFinished, TextChunk
from aimu.aio.providers._wire import PrefillEcho, prefill
from aimu.aio.providers.base import Chunk, TextDelta, ThinkingDelta, ToolCallDelta, TurnDone
from aimu.aio.providers.ollama import OllamaClient
from aimu.aio.providers.openai import OpenAIClient
from aimu.aio.transcript import validate, zero_usage
from aimu.testing.script import Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer

WORDS = "one two three four five six seven eight"


async def cut_after(agent: aio.Agent, chunks: int, task: str | None = "count") -> str:
    """Run (or resume) ``agent`` as a stream and stop reading once ``chunks`` text chunks
    came (the stream closed there: the run settles at that exact point); the text seen."""
    seen: list[str] = []
    stream = agent.run(task, stream=True) if task is not None else agent.resume(
        continue_partial=True, stream=True
    )
    async with contextlib.aclosing(stream):
        async for event in stream:
            if isinstance(event, TextChunk):
                seen.append(event.text)
                if len(seen) == chunks:
                    break
    assert agent.last_status == "cancelled"
    return "".join(seen)


def assistants(agent: aio.Agent) -> list[dict[str, Any]]:
    return [dict(m) for m in agent.model_client.messages if m["role"] == "assistant"]


# -- scripted -----------------------------------------------------------------------------------


async def test_a_cut_answer_is_continued_and_kept_as_one_message() -> None:
    model = ScriptedModel(
        [Turn(text=WORDS), Turn(text="four five six seven eight")],
        continues_partial=True,
    )
    agent = aio.Agent(model)
    assert await cut_after(agent, 3) == "one two three "
    assert await agent.resume(continue_partial=True) == WORDS
    assert agent.last_run is not None and agent.last_run.continuation == "continued"
    sent = model.requests[-1]["messages"]
    assert sent[-1] == {"role": "assistant", "content": "one two three "}  # the prefix
    assert assistants(agent) == [{"role": "assistant", "content": WORDS}]
    validate(agent.model_client.messages)


async def test_a_model_that_cannot_continue_is_re_asked_and_the_result_says_so() -> None:
    model = ScriptedModel([Turn(text=WORDS), Turn(text=WORDS)])
    agent = aio.Agent(model)
    await cut_after(agent, 2)
    assert await agent.resume(continue_partial=True) == WORDS
    assert agent.last_run is not None and agent.last_run.continuation == "re-asked"
    assert model.requests[-1]["messages"][-1]["role"] == "user"  # the cut answer left out
    kept = assistants(agent)
    assert kept[0].get("aimu_partial") is True and kept[-1] == {
        "role": "assistant", "content": WORDS, "aimu_model": "scripted:scripted"}


async def test_by_default_a_resume_re_asks() -> None:
    model = ScriptedModel([Turn(text=WORDS), Turn(text=WORDS)],
                          continues_partial=True)
    agent = aio.Agent(model)
    await cut_after(agent, 2)
    assert await agent.resume() == WORDS
    assert agent.last_run is not None and agent.last_run.continuation == "re-asked"
    assert model.requests[-1]["messages"][-1]["role"] == "user"


async def test_a_continuation_cut_again_stays_one_partial_answer_and_continues_again() -> None:
    model = ScriptedModel(
        [
            Turn(text=WORDS),
            Turn(text="three four five six seven eight"),
            Turn(text="five six seven eight"),
        ],
        continues_partial=True,
    )
    agent = aio.Agent(model)
    await cut_after(agent, 2)
    assert await cut_after(agent, 2, task=None) == "three four "
    kept = assistants(agent)
    assert kept == [{"role": "assistant", "content": "one two three four ",
                     "aimu_partial": True}]
    validate(agent.model_client.messages)
    assert await agent.resume(continue_partial=True) == WORDS
    assert assistants(agent) == [{"role": "assistant", "content": WORDS}]


@pytest.mark.parametrize("cut", range(1, 6))
async def test_a_stop_at_every_chunk_of_a_continuation_keeps_one_valid_answer(cut: int) -> None:
    def words(request: dict[str, Any]) -> Turn:
        """The rest of WORDS after the prefix the request ends with, if any."""
        last = request["messages"][-1]
        said = len(last["content"].split()) if last["role"] == "assistant" else 0
        return Turn(text=" ".join(WORDS.split()[said:]), )

    model = ScriptedModel(words, continues_partial=True)
    agent = aio.Agent(model)
    await cut_after(agent, 1)
    await cut_after(agent, cut, task=None)
    (partial,) = assistants(agent)
    assert partial.get("aimu_partial") is True and WORDS.startswith(partial["content"])
    assert len(partial["content"].split()) == 1 + cut
    validate(agent.model_client.messages)
    assert await agent.resume(continue_partial=True) == WORDS
    assert assistants(agent) == [{"role": "assistant", "content": WORDS}]


async def test_an_answer_cut_by_a_token_limit_continues(tmp_path: Path) -> None:
    store = aio.SQLiteStore(tmp_path / "s.db")
    model = ScriptedModel(
        [Turn(text=WORDS, output_tokens=8), Turn(text="five six seven eight")],
        continues_partial=True,
    )
    async with aio.Agent(model, store=store, session="s",
                         limits=aio.UsageLimits(output_tokens=4)) as agent:
        partial = await agent.run("count")
        assert agent.last_status == "limited" and WORDS.startswith(partial)
        answer = await agent.resume(continue_partial=True, limits=aio.UsageLimits())
        assert answer.startswith(partial) and agent.last_run is not None
        assert agent.last_run.continuation == "continued"
        assert await store.load("s") == agent.model_client.messages  # the answer replaced
        assert len(assistants(agent)) == 1
    await store.aclose()


# -- over the loopback server: a server that can, and one that cannot -------------------------


@pytest.fixture(params=["ollama", "openai"])
def provider(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def make(provider: str, server: LoopbackServer, continues: bool) -> ModelClient:
    if provider == "ollama":
        return OllamaClient("llama-test", host=server.url, continues_partial=continues)
    return OpenAIClient("llama-cpp", base_url=server.openai_base_url,
                        continues_partial=continues)


@pytest.fixture
async def server() -> AsyncIterator[LoopbackServer]:
    async with LoopbackServer() as loopback:
        yield loopback


async def test_a_server_that_continues_gets_the_prefix(
    provider: str, server: LoopbackServer
) -> None:
    server.script = [Turn(text=WORDS), Turn(text="four five six seven eight")]
    async with make(provider, server, True) as client:
        agent = aio.Agent(client)
        await cut_after(agent, 3)
        assert await agent.resume(continue_partial=True) == WORDS
        last = server.requests[-1].body["messages"][-1]
        assert last == {"role": "assistant", "content": "one two three "}
        assert assistants(agent) == [{"role": "assistant", "content": WORDS}]


async def test_a_server_that_cannot_continue_is_re_asked(provider: str) -> None:
    async with LoopbackServer(continues_partial=False) as server:
        server.script = [Turn(text=WORDS), Turn(text=WORDS)]
        async with make(provider, server, False) as client:
            agent = aio.Agent(client)
            await cut_after(agent, 3)
            assert await agent.resume(continue_partial=True) == WORDS  # no 400: re-asked
            assert agent.last_run is not None and agent.last_run.continuation == "re-asked"
        # The same server refuses a trailing assistant message: it models one that cannot.
        async with make(provider, server, True) as wrong:
            agent = aio.Agent(wrong)
            agent.restore([{"role": "user", "content": "count"},
                           {"role": "assistant", "content": "one ", "aimu_partial": True}])
            with pytest.raises(aio.ModelHTTPError, match="cannot continue"):
                await agent.resume(continue_partial=True)


def test_continue_partial_must_be_a_bool() -> None:
    agent = aio.Agent(ScriptedModel([]))
    with pytest.raises(TypeError, match="continue_partial"):
        agent.resume(continue_partial="yes")  # type: ignore[call-overload]


async def test_a_workflow_refuses_continue_partial() -> None:
    chain = aio.Chain([aio.Agent(ScriptedModel([Turn(text="x")]))])
    await chain.run("go")
    with pytest.raises(TypeError, match="continue_partial"):
        await chain.resume(continue_partial=True)



# -- a server that echoes the prefix (llama.cpp's) ------------------------------------------------
#
# llama.cpp's server (as a real ``llama-server`` was found to behave, issue 29) continues a
# trailing assistant message, but sends that message's text back first. Given
#   {"messages": [..., {"role": "assistant", "content": "Once upon a time XQZ"}], "stream": true}
# its SSE stream's first delta is the prefix, the continuation follows:
#   data: {"choices":[{"index":0,"delta":{"content":"Once upon a time XQZ"}, ...}], ...}
#   data: {"choices":[{"index":0,"delta":{"content":" and"}, ...}], ...}
#   ...
# and with "stream": false, choices[0].message.content is "Once upon a time XQZ and ..."
# (the prefix, then the continuation). ``LoopbackServer(echoes_prefill=True)`` does the same
# on both of its wires (on Ollama's, the first NDJSON line's message.content is the prefix;
# a whole reply's message.content starts with it). The client strips the echo once, and
# only when the reply's text starts with the whole prefix.

CONTINUATION = "four five six seven eight"


async def test_a_server_that_echoes_the_prefix_is_continued_once(provider: str) -> None:
    async with LoopbackServer(echoes_prefill=True) as server:
        server.script = [Turn(text=WORDS), Turn(text=CONTINUATION)]
        async with make(provider, server, True) as client:
            agent = aio.Agent(client)
            await cut_after(agent, 3)
            events = [e async for e in agent.resume(continue_partial=True, stream=True)]
            seen = "".join(e.text for e in events if isinstance(e, TextChunk))
            assert seen == CONTINUATION  # the echo is not shown either
            assert isinstance(events[-1], RunFinished) and events[-1].reply == WORDS
            assert assistants(agent) == [{"role": "assistant", "content": WORDS}]
            validate(agent.model_client.messages)


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "whole"])
async def test_the_echo_is_stripped_from_a_streamed_and_a_whole_reply(
    provider: str, streamed: bool
) -> None:
    prefix = "Once upon a time XQZ"
    sent: list[Any] = [{"role": "user", "content": "a story"},
                       {"role": "assistant", "content": prefix}]
    async with LoopbackServer(echoes_prefill=True) as server:
        server.script = [Turn(text=" and then")] * 3
        # The server does what llama.cpp's does: the prefix comes back first.
        assert await first_text(provider, server, sent, streamed) == (
            prefix if streamed else prefix + " and then"
        )
        async with make(provider, server, True) as client:
            texts = [chunk.text async for chunk in client.stream_turn(sent, stream=streamed)
                     if isinstance(chunk, TextDelta)]
            assert "".join(texts) == " and then"
            # Without the echo nothing is taken away: the same reply from a plain server.
            server.echoes_prefill = False
            texts = [chunk.text async for chunk in client.stream_turn(sent, stream=streamed)
                     if isinstance(chunk, TextDelta)]
            assert "".join(texts) == " and then"


async def first_text(
    provider: str, server: LoopbackServer, messages: list[Any], streamed: bool
) -> str:
    """The text of the first delta (streamed) or of the whole reply, read off the wire."""
    path = "/api/chat" if provider == "ollama" else "/v1/chat/completions"
    body = {"model": "m", "messages": messages, "stream": streamed}
    async with httpx.AsyncClient() as http:
        response = await http.post(server.url + path, json=body)
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    first = json.loads(lines[0])
    if provider == "ollama":
        return str(first["message"]["content"])
    choice = first["choices"][0]
    return str(choice["delta"]["content"] if streamed else choice["message"]["content"])


@pytest.mark.parametrize(
    ("deltas", "passed"),
    [
        (["Once upon", " a time", " and then"], " and then"),  # an echo in pieces
        (["Once upon a time and then"], " and then"),  # echo and continuation in one delta
        (["Once upon a time"], ""),  # only the echo
        (["Once ", "more"], "Once more"),  # starts like the prefix, then differs: kept
        (["Once upon"], "Once upon"),  # ends before the whole prefix came: kept
        ([" and then, Once upon a time"], " and then, Once upon a time"),
        (["Once upon a time", "Once upon a time"], "Once upon a time"),  # stripped once only
    ],
)
def test_the_echo_is_stripped_only_when_the_text_starts_with_the_whole_prefix(
    deltas: list[str], passed: str
) -> None:
    echo = PrefillEcho("Once upon a time")
    chunks: list[Chunk] = [ThinkingDelta("hm")]
    for delta in deltas:
        chunks += echo.chunks([TextDelta(delta)])
    chunks += echo.chunks([TurnDone(zero_usage())])
    assert chunks[0] == ThinkingDelta("hm") and isinstance(chunks[-1], TurnDone)
    assert "".join(c.text for c in chunks if isinstance(c, TextDelta)) == passed


def test_a_tool_call_before_the_whole_prefix_releases_the_held_text() -> None:
    echo = PrefillEcho("Once upon a time")
    call = ToolCallDelta({"id": "c", "type": "function",
                          "function": {"name": "look", "arguments": {}}})
    assert echo.chunks([TextDelta("Once"), call]) == [TextDelta("Once"), call]
    assert echo.settled


def test_the_prefix_is_the_trailing_assistant_text_as_sent() -> None:
    cut: list[Any] = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "a"},
                      {"role": "assistant", "content": "b"}]
    assert prefill(cut, merge_roles=True) == "a\n\nb"
    assert prefill(cut, merge_roles=False) == "b"
    assert prefill(cut[:1], merge_roles=True) == ""


@pytest.mark.parametrize("cut", range(1, 4))
async def test_a_stop_in_an_echoed_continuation_keeps_one_valid_answer(
    provider: str, cut: int
) -> None:
    def rest(request: Any) -> Turn:
        last = request["messages"][-1]
        said = len(last["content"].split()) if last["role"] == "assistant" else 0
        return Turn(text=" ".join(WORDS.split()[said:]))

    async with (
        LoopbackServer(rest, echoes_prefill=True) as server,
        make(provider, server, True) as client,
    ):
        agent = aio.Agent(client)
        await cut_after(agent, 1)
        assert await cut_after(agent, cut, task=None) == " ".join(
            WORDS.split()[1:1 + cut]) + " "
        (partial,) = assistants(agent)
        assert partial["content"] == " ".join(WORDS.split()[:1 + cut]) + " "
        validate(agent.model_client.messages)
        assert await agent.resume(continue_partial=True) == WORDS
        assert assistants(agent) == [{"role": "assistant", "content": WORDS}]
