"""aio.chat: one model turn over the caller's conversation, the client keeping nothing.

A stop lands at a provable point (the server recorded the request, a chunk was seen);
whatever stopped the turn, what the caller's list holds is a valid transcript.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from aimu import aio
from aimu.aio.client import TextDelta, TurnDone
from aimu.aio.errors import TranscriptError
from aimu.aio.providers.ollama import OllamaClient
from aimu.aio.transcript import Message, validate
from aimu.testing.script import Turn
from aimu.testing.server import LoopbackServer

LONG = " ".join(f"word{n}" for n in range(40))


@pytest.fixture
async def model(server: LoopbackServer) -> AsyncIterator[OllamaClient]:
    async with OllamaClient("m", host=server.url) as client:
        yield client


async def test_a_one_shot_turn_sends_the_message_alone_and_keeps_nothing(
    server: LoopbackServer, model: OllamaClient
) -> None:
    server.script = [Turn(text="first"), Turn(text="second")]
    assert await aio.chat(model, "hi") == {"role": "assistant", "content": "first"}
    assert await aio.chat(model, "again") == {"role": "assistant", "content": "second"}
    assert server.requests[-1].messages == [{"role": "user", "content": "again"}]
    assert model.messages == []


async def test_the_conversation_is_the_callers_list(
    server: LoopbackServer, model: OllamaClient
) -> None:
    server.script = [Turn(text="Oslo."), Turn(text="Snow.")]
    messages: list[Message] = [{"role": "system", "content": "Be brief."}]
    first = await aio.chat(model, "where?", messages=messages)
    asked: Message = {"role": "user", "content": "weather?"}
    second = await aio.chat(model, asked, messages=messages)
    assert messages == [messages[0], {"role": "user", "content": "where?"}, first, asked, second]
    assert messages[3] is asked  # the caller's message, appended as given
    assert [m["content"] for m in server.requests[-1].messages] == [
        "Be brief.",
        "where?",
        "Oslo.",
        "weather?",
    ]
    assert model.messages == []


async def test_a_streamed_reply_is_appended_when_the_stream_ends(
    server: LoopbackServer, model: OllamaClient
) -> None:
    server.script = [Turn(text="one two three")]
    messages: list[Message] = []
    chunks = await aio.chat(model, "count", messages=messages, stream=True)
    assert messages == [{"role": "user", "content": "count"}]  # the reply not yet
    seen = [chunk async for chunk in chunks]
    assert [c.text for c in seen if isinstance(c, TextDelta)] == ["one ", "two ", "three"]
    assert isinstance(seen[-1], TurnDone)
    assert messages[-1] == {"role": "assistant", "content": "one two three"}
    validate(messages)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_cancel_during_the_request_propagates_and_leaves_the_message_last(
    server: LoopbackServer, model: OllamaClient, stream: bool
) -> None:
    server.script = [Turn(text="late", first_byte_delay=30)]
    messages: list[Message] = [
        {"role": "user", "content": "before"},
        {"role": "assistant", "content": "ok"},
    ]

    async def ask() -> None:
        if stream:
            async for _ in await aio.chat(model, "go", messages=messages, stream=True):
                pass
        else:
            await aio.chat(model, "go", messages=messages)

    task = asyncio.create_task(ask())
    await server.wait_requests(1)  # the request is at the server, no byte back yet
    assert task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (record,) = await server.wait_abandoned(1, timeout=5)
    assert record.chunks_sent == 0
    assert messages[2:] == [{"role": "user", "content": "go"}]
    validate(messages)


async def test_a_cancel_mid_stream_propagates_and_keeps_the_text_so_far(
    server: LoopbackServer, model: OllamaClient
) -> None:
    server.script = [Turn(text=LONG, delay=0.05)]
    messages: list[Message] = []
    seen: list[str] = []
    first = asyncio.Event()

    async def consume() -> None:
        async for chunk in await aio.chat(model, "go", messages=messages, stream=True):
            if isinstance(chunk, TextDelta):
                seen.append(chunk.text)
                first.set()

    task = asyncio.create_task(consume())
    await first.wait()
    assert task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await server.wait_abandoned(1, timeout=5)
    (user, cut) = messages
    assert user == {"role": "user", "content": "go"}
    assert cut == {"role": "assistant", "content": "".join(seen), "aimu_partial": True}
    assert cut["content"].startswith("word0 ")
    validate(messages)


async def test_a_stream_closed_half_way_keeps_the_text_so_far(
    server: LoopbackServer, model: OllamaClient
) -> None:
    server.script = [Turn(text=LONG, delay=0.02), Turn(text="next")]
    messages: list[Message] = []
    chunks = await aio.chat(model, "go", messages=messages, stream=True)
    assert await anext(chunks) == TextDelta("word0 ")
    await chunks.aclose()
    assert messages[-1] == {"role": "assistant", "content": "word0 ", "aimu_partial": True}
    validate(messages)
    # The conversation goes on from the partial reply.
    assert (await aio.chat(model, "more", messages=messages))["content"] == "next"
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]


@pytest.mark.parametrize(
    ("message", "error", "match"),
    [
        (42, TypeError, r"a str or a message dict .*got int"),
        (b"hi", TypeError, r"got bytes"),
        (None, TypeError, r"got NoneType"),
        ({"role": "bot", "content": "hi"}, TranscriptError, r"message 1: unknown role 'bot'"),
        ({"role": "user"}, TranscriptError, r"message 1: user message needs string 'content'"),
        (
            {"role": "tool", "content": "4", "tool_call_id": "c9", "name": "add"},
            TranscriptError,
            r"message 1: tool result for 'c9' answers no tool call",
        ),
        ({"role": "system", "content": "late"}, TranscriptError, r"only be the first message"),
    ],
    ids=["int", "bytes", "none", "bad-role", "no-content", "stray-tool-result", "late-system"],
)
async def test_a_bad_message_is_refused_before_anything_changes(
    server: LoopbackServer,
    model: OllamaClient,
    message: object,
    error: type[Exception],
    match: str,
) -> None:
    messages: list[Message] = [{"role": "user", "content": "hi"}]
    for stream in (False, True):
        with pytest.raises(error, match=match):
            await aio.chat(model, message, messages=messages, stream=stream)  # type: ignore[call-overload]
    assert messages == [{"role": "user", "content": "hi"}]
    assert server.requests == []


async def test_a_bad_conversation_is_refused_before_anything_changes(
    server: LoopbackServer, model: OllamaClient
) -> None:
    with pytest.raises(TypeError, match=r"messages=.*as a list .*got tuple"):
        await aio.chat(model, "hi", messages=())  # type: ignore[call-overload]
    broken: list[Message] = [{"role": "user", "content": "a"}, {"role": "user"}]  # type: ignore[list-item]
    with pytest.raises(TranscriptError, match=r"message 1: user message needs string"):
        await aio.chat(model, "hi", messages=broken)
    assert len(broken) == 2 and server.requests == []


async def test_the_deprecated_client_chat_warns_and_keeps_its_conversation(
    server: LoopbackServer, model: OllamaClient
) -> None:
    server.script = [Turn(text="first"), Turn(text="streamed"), Turn(text="from the agent")]
    with pytest.warns(DeprecationWarning, match=r"use aimu\.aio\.chat\(client, \.\.\., messages="):
        reply = await model.chat("hi")
    with pytest.warns(DeprecationWarning):
        chunks = [chunk async for chunk in await model.chat("more", stream=True)]
    assert isinstance(chunks[-1], TurnDone)
    assert [m["content"] for m in model.messages] == ["hi", "first", "more", "streamed"]
    assert model.messages[1] == reply
    agent = aio.Agent(model)  # an agent given the client goes on with that conversation
    assert await agent.run("and now?") == "from the agent"
    assert agent.messages is model.messages and len(agent.messages) == 6
