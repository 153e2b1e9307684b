"""Behaviour both HTTP providers share, through the real ollama client and httpx against
the loopback server: replies, tool rounds, thinking, each error kind, and that a cancel
or a closed iterator closes the connection at once (the server sees it abandoned)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator

import pytest
from provider_support import (
    MakeClient,
    assert_only_current_task,
    client_at,
    closed_port,
    open_connections,
)

from aimu import aio
from aimu.aio.client import (
    Chunk,
    ModelClient,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    TurnDone,
)
from aimu.aio.errors import ModelConnectionError, ModelHTTPError, ModelProtocolError
from aimu.aio.providers.ollama import OllamaClient
from aimu.aio.providers.openai import OpenAIClient
from aimu.aio.transcript import Message, ToolSpec, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer, RecordedRequest

WEATHER: ToolSpec = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
LONG = " ".join(f"word{n}" for n in range(40))


def asked_stream(request: RecordedRequest) -> bool:
    """Whether a chat request asked for a streamed reply (Gemini and Bedrock say so in
    its path)."""
    if request.protocol == "gemini":
        return request.path.endswith(":streamGenerateContent")
    if request.protocol == "bedrock":
        return request.path.endswith("/converse-stream")
    return bool(request.body["stream"])


async def collect(chunks: AsyncIterator[Chunk]) -> list[Chunk]:
    return [chunk async for chunk in chunks]


def texts(chunks: list[Chunk]) -> list[str]:
    return [c.text for c in chunks if isinstance(c, TextDelta)]


def make_for(provider: str, server: LoopbackServer, **options: object) -> ModelClient:
    return client_at(provider, server.url, **options)


# -- replies --------------------------------------------------------------------------


async def test_plain_reply_appends_user_and_assistant(
    server: LoopbackServer, make_client: MakeClient
) -> None:
    server.script = [Turn(text="Hello there, friend.", input_tokens=7, output_tokens=4)]
    model, messages = make_client(), list[Message]([{"role": "system", "content": "Be brief."}])
    reply = await aio.chat(model, "hi", messages=messages)
    assert reply == {"role": "assistant", "content": "Hello there, friend."}
    assert messages == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "hi"}, reply]
    assert model.messages == []  # the client keeps nothing
    assert asked_stream(server.requests[-1]) is False
    assert server.streams[-1].completed


async def test_streamed_reply_arrives_in_chunks(
    server: LoopbackServer, make_client: MakeClient
) -> None:
    server.script = [Turn(text="one two three four five", input_tokens=11, output_tokens=5)]
    model, messages = make_client(), list[Message]()
    chunks = await collect(await aio.chat(model, "count", messages=messages, stream=True))
    assert texts(chunks) == ["one ", "two ", "three ", "four ", "five"]
    done = chunks[-1]
    assert isinstance(done, TurnDone)
    assert done.usage == {"input_tokens": 11, "output_tokens": 5}
    assert done.done_reason == "stop"
    assert messages[-1] == {"role": "assistant", "content": "one two three four five"}
    assert asked_stream(server.requests[-1]) is True


async def test_tool_call_round_trip(
    server: LoopbackServer, make_client: MakeClient, provider: str
) -> None:
    server.script = [
        Turn(tool_calls=[ScriptedCall("weather", {"city": "Oslo"})]),
        Turn(text="It is snowing in Oslo."),
    ]
    model, messages = make_client(), list[Message]()
    reply = await aio.chat(model, "weather in Oslo?", messages=messages, tools=[WEATHER])
    (call,) = reply["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": {"city": "Oslo"}}
    assert call["id"]
    messages.append(
        {"role": "tool", "content": "snow, -3 C", "tool_call_id": call["id"], "name": "weather"}
    )
    chunks = await collect(model.stream_turn(messages, [WEATHER]))
    assert "".join(texts(chunks)) == "It is snowing in Oslo."
    validate(messages)

    first, second = server.requests[-2].body, server.requests[-1].body
    if provider == "openai-responses":  # flat function tools, and input items
        assert [tool["name"] for tool in first["tools"]] == ["weather"]
        assert second["input"][1:] == [
            {"type": "function_call", "call_id": call["id"], "name": "weather",
             "arguments": '{"city":"Oslo"}'},
            {"type": "function_call_output", "call_id": call["id"], "output": "snow, -3 C"},
        ]
        return
    if provider == "gemini":  # one functionCall turn, answered by the next user turn
        assert [d["name"] for d in first["tools"][0]["functionDeclarations"]] == ["weather"]
        asked, answered = second["contents"][1], second["contents"][2]
        assert asked["role"] == "model" and answered["role"] == "user"
        assert asked["parts"][0]["functionCall"] == {"name": "weather", "args": {"city": "Oslo"}}
        assert answered["parts"] == [
            {"functionResponse": {"name": "weather", "response": {"output": "snow, -3 C"}}}
        ]
        return
    if provider == "bedrock":  # a toolUse block, answered by a toolResult block
        assert [t["toolSpec"]["name"] for t in first["toolConfig"]["tools"]] == ["weather"]
        assert second["messages"][1:] == [
            {"role": "assistant", "content": [{"toolUse": {
                "toolUseId": call["id"], "name": "weather", "input": {"city": "Oslo"}}}]},
            {"role": "user", "content": [{"toolResult": {
                "toolUseId": call["id"], "content": [{"text": "snow, -3 C"}]}}]},
        ]
        return
    if provider == "anthropic":  # a tool_use block, answered by a tool_result block
        assert [tool["name"] for tool in first["tools"]] == ["weather"]
        assert second["messages"][1:] == [
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": call["id"], "name": "weather",
                 "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call["id"], "content": "snow, -3 C"}]},
        ]
        return
    assert [tool["function"]["name"] for tool in first["tools"]] == ["weather"]
    wire_call, wire_result = second["messages"][1], second["messages"][2]
    if provider == "ollama":
        assert wire_call["tool_calls"] == [
            {"function": {"name": "weather", "arguments": {"city": "Oslo"}}}
        ]
        assert wire_result == {"role": "tool", "content": "snow, -3 C", "tool_name": "weather"}
    else:
        assert wire_call["tool_calls"] == [
            {"id": call["id"], "type": "function",
             "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}
        ]
        assert wire_result == {"role": "tool", "tool_call_id": call["id"], "content": "snow, -3 C"}


async def test_several_calls_in_one_turn_get_distinct_ids(
    server: LoopbackServer, make_client: MakeClient
) -> None:
    server.script = [Turn(tool_calls=[ScriptedCall("weather", {"city": c}) for c in "ABC"])]
    model = make_client()
    chunks = await collect(model.stream_turn([{"role": "user", "content": "x"}], [WEATHER]))
    calls = [c.call for c in chunks if isinstance(c, ToolCallDelta)]
    assert [c["function"]["arguments"]["city"] for c in calls] == ["A", "B", "C"]
    assert len({c["id"] for c in calls}) == 3
    assert all(c.error is None for c in chunks if isinstance(c, ToolCallDelta))


@pytest.mark.parametrize("stream", [True, False])
async def test_thinking_is_kept_out_of_content(
    server: LoopbackServer, make_client: MakeClient, stream: bool
) -> None:
    server.script = [Turn(thinking="The user greets me.", text="Hello!")]
    model = make_client()
    chunks = await collect(model.stream_turn([{"role": "user", "content": "hi"}], stream=stream))
    assert [c.text for c in chunks if isinstance(c, ThinkingDelta)] == ["The user greets me."]
    assert "".join(texts(chunks)) == "Hello!"


async def test_a_partial_turn_is_sent_without_our_marker(
    server: LoopbackServer, make_client: MakeClient
) -> None:
    server.script = [Turn(text="fine")]
    model = make_client()
    model.messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "I was cut", "aimu_partial": True},
        {"role": "user", "content": "continue"},
    ]
    await collect(model.stream_turn(model.messages))
    body = server.requests[-1].body
    if "contents" in body:  # Gemini
        assert body["contents"][1] == {"role": "model", "parts": [{"text": "I was cut"}]}
        assert "aimu_" not in json.dumps(body)
        return
    sent = body["messages"] if "messages" in body else body["input"]  # Responses: input items
    blocks = "messages" in body and isinstance(sent[0]["content"], list)
    if blocks and "type" not in sent[0]["content"][0]:  # Bedrock's blocks
        assert sent[1] == {"role": "assistant", "content": [{"text": "I was cut"}]}
        assert "aimu_" not in json.dumps(body)
        return
    if blocks:  # Anthropic's blocks
        assert sent[1] == {"role": "assistant", "content": [{"type": "text", "text": "I was cut"}]}
        assert "aimu_" not in json.dumps(body)
        return
    assert sent[1] == {"role": "assistant", "content": "I was cut"}
    assert all(not key.startswith("aimu_") for message in sent for key in message)


# -- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_http_500_carries_status_and_server_text(
    server: LoopbackServer, make_client: MakeClient, stream: bool
) -> None:
    server.script = [Turn(fault="http_500")]
    model = make_client()
    with pytest.raises(ModelHTTPError) as caught:
        await collect(model.stream_turn([{"role": "user", "content": "x"}], stream=stream))
    error = caught.value
    assert error.status_code == 500
    assert "HTTP 500" in str(error)
    assert "internal server error (scripted http_500 fault)" in str(error)
    assert model.host in str(error) and error.host == model.host


async def test_http_429_says_rate_limited(
    server: LoopbackServer, make_client: MakeClient
) -> None:
    server.script = [Turn(fault="http_429")]
    model, messages = make_client(retries=0), list[Message]()
    with pytest.raises(ModelHTTPError, match=r"HTTP 429.*rate limited") as caught:
        await aio.chat(model, "x", messages=messages)
    assert caught.value.status_code == 429
    assert messages == [{"role": "user", "content": "x"}]  # nothing half-written


@pytest.mark.parametrize("stream", [True, False])
async def test_a_malformed_json_line_is_a_protocol_error(
    server: LoopbackServer, make_client: MakeClient, stream: bool
) -> None:
    server.script = [Turn(text="a b c", fault="bad_json", fault_after=1)]
    model = make_client()
    # Bedrock's binary wire: the fault is a message whose CRC32 does not match.
    words = r"not JSON|could not be understood|CRC32"
    with pytest.raises(ModelProtocolError, match=words) as caught:
        await collect(model.stream_turn([{"role": "user", "content": "x"}], stream=stream))
    assert model.host in str(caught.value)


async def test_a_dropped_connection_says_so(
    server: LoopbackServer, make_client: MakeClient
) -> None:
    server.script = [Turn(text="a b c d", fault="drop", fault_after=2)]
    model = make_client(retries=0)  # with a retry left it is asked again (test_broken_streams)
    seen: list[Chunk] = []
    with pytest.raises(ModelConnectionError, match="dropped mid-reply") as caught:
        async for chunk in model.stream_turn([{"role": "user", "content": "x"}]):
            seen.append(chunk)
    assert texts(seen) == ["a ", "b "]
    assert model.host in str(caught.value)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_stream_that_ends_without_its_final_marker(
    server: LoopbackServer, make_client: MakeClient, stream: bool
) -> None:
    server.script = [Turn(text="a b", fault="no_done")]
    model = make_client(retries=0)  # a streamed one is asked again while retries are left
    with pytest.raises(ModelProtocolError, match=r"done|finish") as caught:
        await collect(model.stream_turn([{"role": "user", "content": "x"}], stream=stream))
    assert model.host in str(caught.value)


async def test_a_silent_server_hits_the_read_timeout(
    server: LoopbackServer, make_client: MakeClient
) -> None:
    server.script = [Turn(text="a b", fault="hang", fault_after=1)]
    model = make_client(timeout=0.3, retries=0)  # else asked again (test_broken_streams)
    with pytest.raises(ModelConnectionError, match=r"sent nothing for 0\.3s"):
        await collect(model.stream_turn([{"role": "user", "content": "x"}]))
    await server.wait_abandoned(1, timeout=5)


async def test_a_refused_connection_fails_fast_naming_the_host(provider: str) -> None:
    port = closed_port()
    model: ModelClient
    if provider == "ollama":
        model = OllamaClient("llama-test", host=f"127.0.0.1:{port}", retries=0)
        hint = "is Ollama running there? host= or OLLAMA_HOST sets the address"
    elif provider == "gemini":
        model = client_at(provider, f"http://127.0.0.1:{port}", retries=0)
        hint = "GEMINI_BASE_URL"
    else:
        model = OpenAIClient(
            "gpt-test", base_url=f"http://127.0.0.1:{port}/v1", api_key="k", retries=0
        )
        hint = "OPENAI_BASE_URL"
    try:
        async with asyncio.timeout(3):  # a generous bound: never a hang
            with pytest.raises(ModelConnectionError) as caught:
                await aio.chat(model, "hello")
    finally:
        await model.aclose()
    message = str(caught.value)
    assert f"127.0.0.1:{port}" in message
    assert "refused" in message.lower()
    assert hint in message
    assert isinstance(caught.value, ConnectionError)


async def test_an_unresolvable_host_names_the_host(provider: str) -> None:
    model: ModelClient
    # Retried as always, without the backoff's waits (0.5 + 1 + 2 s of an idle test).
    fast = {"connect_timeout": 2, "retry_delay": 0.001}
    if provider == "ollama":
        model = OllamaClient("m", host="no-such-host.invalid:11434", **fast)
    elif provider == "gemini":
        model = client_at(provider, "http://no-such-host.invalid", **fast)
    else:
        model = OpenAIClient("m", base_url="http://no-such-host.invalid/v1", api_key="k", **fast)
    try:
        async with asyncio.timeout(10):
            with pytest.raises(ModelConnectionError, match=r"no-such-host\.invalid"):
                await aio.chat(model, "hello")
    finally:
        await model.aclose()


# -- closing and cancelling -----------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_cancelling_a_task_awaiting_a_reply_closes_the_connection(
    provider: str, stream: bool
) -> None:
    async with LoopbackServer([Turn(text=LONG, delay=0.05)]) as server:
        model, messages = make_for(provider, server), list[Message]()
        got_first = asyncio.Event()

        async def consume() -> None:
            if stream:
                async for _ in await aio.chat(model, "go", messages=messages, stream=True):
                    got_first.set()
            else:
                got_first.set()
                await aio.chat(model, "go", messages=messages)

        task = asyncio.create_task(consume())
        await got_first.wait()
        await server.wait_requests(1)  # the reply is under way: 40 chunks, 50 ms apart
        assert task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        (record,) = await server.wait_abandoned(1, timeout=5)
        assert record.abandoned and not record.completed
        assert record.abandoned_at is not None and record.abandoned_at >= record.started_at
        if stream:
            assert messages[-1].get("aimu_partial") is True
        else:  # the whole reply never came
            assert messages == [{"role": "user", "content": "go"}]
        validate(messages)
        await model.aclose()
    await assert_only_current_task()


async def test_cancel_before_the_first_byte_closes_the_connection(provider: str) -> None:
    async with LoopbackServer([Turn(text="late", first_byte_delay=30)]) as server:
        model, messages = make_for(provider, server), list[Message]()
        task = asyncio.create_task(
            collect(await aio.chat(model, "go", messages=messages, stream=True))
        )
        await server.wait_requests(1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        (record,) = await server.wait_abandoned(1, timeout=5)
        assert record.chunks_sent == 0
        assert messages == [{"role": "user", "content": "go"}]
        await model.aclose()
    await assert_only_current_task()


async def test_aclose_on_the_iterator_mid_stream_closes_the_connection(provider: str) -> None:
    async with LoopbackServer([Turn(text=LONG, delay=0.02)]) as server:
        model = make_for(provider, server)
        chunks = model.stream_turn([{"role": "user", "content": "go"}])
        assert isinstance(chunks, AsyncGenerator)
        assert await anext(chunks) == TextDelta("word0 ")
        assert open_connections(model) == 1
        await chunks.aclose()
        assert open_connections(model) == 0  # closed by aclose itself, not later
        (record,) = await server.wait_abandoned(1, timeout=5)
        assert not record.completed
        assert record.chunks_sent < 40
        await model.aclose()
    await assert_only_current_task()


async def test_aclose_on_a_chat_stream_closes_the_connection_at_once(provider: str) -> None:
    async with LoopbackServer([Turn(text=LONG, delay=0.02)]) as server:
        model, messages = make_for(provider, server), list[Message]()
        chunks = await aio.chat(model, "go", messages=messages, stream=True)
        assert isinstance(chunks, AsyncGenerator)
        assert await anext(chunks) == TextDelta("word0 ")
        await chunks.aclose()
        assert messages[-1] == {
            "role": "assistant", "content": "word0 ", "aimu_partial": True
        }
        try:
            assert open_connections(model) == 0
        finally:
            await server.wait_abandoned(1, timeout=5)
            await model.aclose()


async def test_a_finished_stream_leaves_the_connection_reusable(provider: str) -> None:
    async with LoopbackServer([Turn(text="a b"), Turn(text="c d")]) as server:
        model = make_for(provider, server)
        await collect(await aio.chat(model, "1", stream=True))
        await collect(await aio.chat(model, "2", stream=True))
        assert open_connections(model) == 1  # one keep-alive connection served both
        assert [r.completed for r in server.streams] == [True, True]
        assert not any(r.abandoned for r in server.streams)
        await model.aclose()
    await assert_only_current_task()


# -- forks ----------------------------------------------------------------------------


async def test_fork_shares_the_pool_and_its_settings_are_its_own(
    server: LoopbackServer, make_client: MakeClient
) -> None:
    server.script = [Turn(text="first"), Turn(text="second"), Turn(text="third")]
    model, messages = make_client(options={"temperature": 0.2}), list[Message]()
    await aio.chat(model, "to the original", messages=messages)
    twin = model.fork()
    assert type(twin) is type(model) and twin.model == model.model
    assert twin.host == model.host
    assert twin.messages == []
    assert twin._pool is model._pool  # type: ignore[attr-defined]
    twin.options["seed"] = 7  # type: ignore[attr-defined]
    assert model.options == {"temperature": 0.2}  # type: ignore[attr-defined]
    reply = await aio.chat(twin, "to the fork")
    assert reply["content"] == "second"
    assert [m["content"] for m in messages] == ["to the original", "first"]
    await twin.aclose()  # a fork leaves the shared pool open
    assert (await aio.chat(model, "again", messages=messages))["content"] == "third"
    assert [m["role"] for m in server.requests[-1].messages] == ["user", "assistant", "user"]
    body = server.requests[-1].body
    sent = body.get("options") or body.get("generationConfig") or body
    assert sent["temperature"] == 0.2
