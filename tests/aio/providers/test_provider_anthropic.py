"""What only the Anthropic provider does: its request (top-level system, content blocks,
tool results merged into the next user turn, tools, tool choice, structured output,
prompt caching), signed thinking kept and sent back unchanged (a cut one dropped), stop
reasons (refusal as such), usage from message_start and message_delta, the overloaded
error retried before any byte of the turn and not after, a session moved to Anthropic
from another wire, and the key kept secret. Against the loopback server's Anthropic wire,
which refuses what the API refuses."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from typing import Any

import pytest
from provider_support import RawServer, closed_after_test, http_response, lookup, turn
from pydantic import BaseModel

from aimu import aio
from aimu.aio.client import (
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    TurnDone,
    TurnRequest,
)
from aimu.aio.errors import ModelHTTPError, ModelProtocolError
from aimu.aio.events import TextChunk
from aimu.aio.providers.anthropic import DEFAULT_BASE_URL, AnthropicClient
from aimu.aio.providers.base import NativeData
from aimu.aio.transcript import Message, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer

KEY = "sk-ant-api03-very-secret-0123456789"
USER: list[Message] = [{"role": "user", "content": "x"}]


def claude(server: LoopbackServer, **options: Any) -> AnthropicClient:
    options.setdefault("api_key", KEY)
    return closed_after_test(AnthropicClient("claude-test", base_url=server.url, **options))



@pytest.fixture
async def server() -> Any:
    async with LoopbackServer() as loopback:
        yield loopback


# -- configuration and request ------------------------------------------------------------


def test_key_and_base_url_come_from_arguments_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)
    bare = aio.client("anthropic:claude-x")
    assert isinstance(bare, AnthropicClient)
    assert bare.base_url == DEFAULT_BASE_URL and not bare.has_api_key
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9/")
    from_env = aio.client("anthropic:claude-x")
    assert isinstance(from_env, AnthropicClient)
    assert from_env.has_api_key and from_env.base_url == "http://127.0.0.1:9"
    assert KEY not in repr(from_env) and KEY not in repr(vars(from_env))
    with pytest.raises(ValueError, match="needs a scheme"):
        AnthropicClient("m", base_url="localhost:1")
    with pytest.raises(ValueError, match="names no model"):
        aio.client("anthropic:")


async def test_the_transcript_in_anthropic_s_turns(server: LoopbackServer) -> None:
    """System on top; tool results first in one user turn with the user text after them;
    an empty reply left out; a partial reply's thinking (unsigned) never sent."""
    model = claude(server)
    calls: list[Any] = [
        {"id": "toolu_a", "type": "function", "function": {"name": "lookup",
                                                          "arguments": {"city": "Oslo"}}},
        {"id": "toolu_b", "type": "function", "function": {"name": "lookup",
                                                          "arguments": {"city": "Rome"}}},
    ]
    messages: list[Message] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "looking", "tool_calls": calls, "thinking": "hm"},
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_a", "name": "lookup"},
        {"role": "tool", "content": "", "tool_call_id": "toolu_b", "name": "lookup"},
        {"role": "user", "content": "and Paris?"},
        {"role": "assistant", "content": "", "aimu_partial": True, "thinking": "cut"},
        {"role": "user", "content": "continue"},
    ]
    await turn(model, messages)
    body = server.requests[-1].body
    assert body["system"] == "be brief" and body["max_tokens"] == 4096
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "go"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "looking"},
            {"type": "tool_use", "id": "toolu_a", "name": "lookup", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "toolu_b", "name": "lookup", "input": {"city": "Rome"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_b"},
            {"type": "text", "text": "and Paris?"},
            {"type": "text", "text": "continue"},
        ]},
    ]
    # The encoded turns are cached: a grown transcript encodes only what is new.
    messages.append({"role": "assistant", "content": "fine"})
    messages.append({"role": "user", "content": "more"})
    await turn(model, messages)
    assert server.requests[-1].body["messages"][-2:] == [
        {"role": "assistant", "content": [{"type": "text", "text": "fine"}]},
        {"role": "user", "content": [{"type": "text", "text": "more"}]},
    ]
    await model.aclose()


async def test_tools_tool_choice_caching_and_structured_output(server: LoopbackServer) -> None:
    model = claude(server, cache=True, options={"max_tokens": 99, "temperature": 0})
    tools: Any = [{"type": "function", "function": {
        "name": "lookup", "description": "The weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    server.script = [Turn(text='{"n": 1}')] * 3
    await turn(model, [{"role": "system", "content": "sys"}, *USER], tools=tools,
               request=TurnRequest(output_schema={"type": "object"}, tool_choice="required",
                                   parallel_tool_calls=False))
    body = server.requests[-1].body
    assert body["max_tokens"] == 99 and body["temperature"] == 0
    cached = {"type": "ephemeral"}
    assert body["system"] == [{"type": "text", "text": "sys", "cache_control": cached}]
    assert body["tools"][0]["name"] == "lookup" and "input_schema" in body["tools"][0]
    assert body["tools"][-1]["cache_control"] == {"type": "ephemeral"}
    assert body["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    schema = {"type": "json_schema", "schema": {"type": "object"}}
    assert body["output_config"] == {"format": schema}
    await turn(model, USER, tools=tools, request=TurnRequest(tool_choice="lookup"))
    assert server.requests[-1].body["tool_choice"] == {"type": "tool", "name": "lookup"}
    await turn(model, USER, request=TurnRequest(tool_choice="none"))
    assert "tool_choice" not in server.requests[-1].body  # only with tools, as the API wants
    await model.aclose()


async def test_typed_output_over_the_wire(server: LoopbackServer) -> None:
    class City(BaseModel):
        name: str
        people: int

    agent = aio.Agent(claude(server), output_type=City)
    result = await agent.run("a city")
    assert isinstance(result, City)
    assert "output_config" in server.requests[-1].body
    await agent.aclose()


# -- thinking -----------------------------------------------------------------------------


async def test_signed_thinking_goes_back_unchanged_and_a_forged_one_is_refused(
    server: LoopbackServer,
) -> None:
    server.script = [
        Turn(thinking="two cities", text="looking",
             tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})]),
        Turn(text="sunny"),
        Turn(text="never"),
    ]
    agent = aio.Agent(claude(server), tools=[lookup])
    assert await agent.run("weather?") == "sunny"
    asked = agent.model_client.messages[1]
    assert asked["role"] == "assistant" and asked.get("thinking") == "two cities"
    native = asked["aimu_native"]
    assert native["wire"] == "anthropic"
    thinking = native["content"][0]
    assert thinking["type"] == "thinking" and thinking["signature"]
    sent = server.requests[1].body["messages"][1]["content"]
    assert sent[0] == thinking  # exactly as it came, signature and all
    # The loopback server checks the signature as the API does.
    forged = json.loads(json.dumps(agent.model_client.messages))
    forged[1]["aimu_native"]["content"][0]["thinking"] = "three cities"
    other = aio.Agent(claude(server), tools=[lookup])
    other.restore(forged)
    with pytest.raises(ModelHTTPError, match="signature") as caught:
        await other.run("again")
    assert caught.value.status_code == 400
    # A whole (not streamed) reply keeps its signed thinking the same way.
    server.script = [Turn(thinking="whole thought", text="done")]
    chunks = await turn(claude(server), USER, stream=False)
    (native,) = [c for c in chunks if isinstance(c, NativeData)]
    assert native.data["content"][0]["signature"] and chunks[-1] == TurnDone(
        {"input_tokens": 0, "output_tokens": 1}, "stop"
    )
    await agent.aclose()
    await other.aclose()


async def test_a_cut_thinking_block_is_dropped_not_sent_half_signed(
    server: LoopbackServer,
) -> None:
    server.script = [Turn(thinking="deep thought", text="one two three four", delay=0.05),
                     Turn(text="ok")]
    agent = aio.Agent(claude(server))
    seen = asyncio.Event()

    async def consume() -> None:
        async for event in agent.run("go", stream=True):
            if isinstance(event, TextChunk):
                seen.set()

    task = asyncio.ensure_future(consume())
    await seen.wait()  # the thinking block has ended, the text began
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (record,) = await server.wait_abandoned()
    assert record.protocol == "anthropic"
    cut = agent.model_client.messages[-1]
    assert cut["aimu_partial"] is True and cut["thinking"] == "deep thought"
    assert "aimu_native" not in cut
    assert await agent.run("continue") == "ok"
    sent = server.requests[-1].body["messages"][1]["content"]
    assert all(block["type"] != "thinking" for block in sent)
    await agent.aclose()


async def test_a_session_from_another_wire_goes_on_on_anthropic(server: LoopbackServer) -> None:
    """Started on OpenAI's chat (thinking unsigned, a call cancelled mid-tool), restored
    on Anthropic: the thinking is left out, the settled call answered as the API wants."""
    release = asyncio.Event()
    entered = asyncio.Event()

    async def slow(city: str) -> str:
        """Slow weather."""
        entered.set()
        await release.wait()
        return "never"

    server.script = [
        Turn(thinking="plain thought", text="calling",
             tool_calls=[ScriptedCall("slow", {"city": "Oslo"})]),
        Turn(text="resumed on claude"),
    ]
    first = aio.Agent(aio.client("openai:gpt", base_url=server.openai_base_url, api_key="k"),
                      tools=[slow])
    task = asyncio.ensure_future(first.run("go"))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    moved = aio.Agent(claude(server), tools=[slow])
    moved.restore(first.model_client.messages)
    assert await moved.resume() == "resumed on claude"
    body = server.requests[-1].body
    assert body["messages"][1]["content"] == [
        {"type": "text", "text": "calling"},
        {"type": "tool_use", "id": body["messages"][1]["content"][1]["id"], "name": "slow",
         "input": {"city": "Oslo"}},
    ]
    assert body["messages"][2]["content"][0]["type"] == "tool_result"
    validate(moved.model_client.messages)
    await first.aclose()
    await moved.aclose()


async def test_a_cut_answer_is_continued_as_a_prefill_without_its_trailing_space(
    server: LoopbackServer,
) -> None:
    """The API refuses a prefill that ends in whitespace (so does the loopback server):
    the cut "one two three " goes as "one two three", and the continuation's leading
    space (the model writes it) is taken out once, so the answer is whole."""
    words = "one two three four five"
    server.script = [Turn(text=words), Turn(text=" four five", chunks=2)]
    agent = aio.Agent(claude(server, continues_partial=True))
    seen: list[str] = []
    async with aclosing(agent.run("count", stream=True)) as events:
        async for event in events:
            if isinstance(event, TextChunk):
                seen.append(event.text)
                if len(seen) == 3:
                    break
    assert "".join(seen) == "one two three "
    assert await agent.resume(continue_partial=True) == words
    assert server.requests[-1].body["messages"][-1] == {
        "role": "assistant", "content": [{"type": "text", "text": "one two three"}],
    }
    assert agent.last_run is not None and agent.last_run.continuation == "continued"
    assert agent.model_client.messages[-1]["content"] == words  # one answer, no double space
    await agent.aclose()


# -- stop reasons, usage, errors ------------------------------------------------------------


@pytest.mark.parametrize(
    ("scripted", "reason", "status"),
    [(None, "stop", "completed"), ("length", "length", "incomplete"),
     ("refusal", "refusal", "incomplete")],
)
async def test_stop_reasons_in_aimu_s_words(
    server: LoopbackServer, scripted: str | None, reason: str, status: str
) -> None:
    server.script = [Turn(text="partial answer", stop_reason=scripted)]
    chunks = await turn(claude(server), USER)
    assert isinstance(chunks[-1], TurnDone) and chunks[-1].stop_reason == reason
    server.script = [Turn(text="partial answer", stop_reason=scripted)]
    handle = aio.RunHandle.start(aio.Agent(claude(server)).run("x"))
    await handle.wait()
    assert handle.status == status


async def test_usage_is_the_servers_cached_tokens_included(server: LoopbackServer) -> None:
    """The input tokens include those read from the prompt cache (the loopback server
    says half the prompt was, once it is asked to cache), which are counted apart too,
    in the turn's usage and in the run's."""
    server.script = [Turn(thinking="t", text="a b c", input_tokens=41, output_tokens=7)] * 3
    for cache in (False, True):
        async with claude(server, cache=cache) as model:
            chunks = await turn(model, [{"role": "system", "content": "s"}, *USER])
        done = chunks[-1]
        assert isinstance(done, TurnDone) and done.usage_reported
        cached = {"cached_input_tokens": 20} if cache else {}
        assert done.usage == {"input_tokens": 41, "output_tokens": 7, **cached}
        assert isinstance(chunks[-2], NativeData)
        assert [type(c) for c in chunks[:2]] == [ThinkingDelta, TextDelta]
    async with aio.Agent(claude(server, cache=True), system="s") as agent:
        await agent.run("x")
    assert agent.last_run is not None
    assert agent.last_run.usage == {"input_tokens": 41, "output_tokens": 7,
                                    "cached_input_tokens": 20}


async def test_an_overloaded_error_before_the_turn_or_mid_reply_is_retried(
    server: LoopbackServer,
) -> None:
    server.script = [Turn(text="x", fault="overloaded_event"), Turn(text="hello"),
                     Turn(text="x", fault="http_529"), Turn(text="again")]
    model = claude(server, retry_delay=0)
    assert "".join(c.text for c in await turn(model, USER) if isinstance(c, TextDelta)) == "hello"
    assert "".join(c.text for c in await turn(model, USER) if isinstance(c, TextDelta)) == "again"
    with pytest.deprecated_call():  # a run counts its own: RunResult.retries
        assert model.retry_count == 2
    # Mid-reply (issue 44): the turn is asked again and its answer replaces the cut one.
    server.script = [Turn(text="one two three", fault="overloaded_event", fault_after=1),
                     Turn(text="asked again")]
    agent = aio.Agent(claude(server, retry_delay=0))
    assert await agent.run("x") == "asked again"
    assert agent.last_run is not None and agent.last_run.retries == 1
    assert agent.model_client.messages[-1] == {
        "role": "assistant", "content": "asked again", "aimu_model": "anthropic:claude-test",
    }
    assert len(server.requests) == 6
    # With no retry left, the run fails as before: the partial kept and marked.
    server.script = [Turn(text="one two three", fault="overloaded_event", fault_after=1)]
    agent = aio.Agent(claude(server, retries=0))
    with pytest.raises(ModelHTTPError, match="Overloaded") as caught:
        await agent.run("x")
    assert caught.value.status_code == 529
    assert agent.model_client.messages[-1] == {
        "role": "assistant", "content": "one ", "aimu_partial": True,
        "aimu_model": "anthropic:claude-test",
    }
    await model.aclose()
    await agent.aclose()


async def test_a_tool_call_streams_whole_and_bad_input_is_a_tool_error() -> None:
    events = [
        ("message_start", {"message": {"usage": {"input_tokens": 3, "output_tokens": 1}}}),
        ("content_block_start", {"index": 0, "content_block": {
            "type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}}),
        ("content_block_delta", {"index": 0, "delta": {
            "type": "input_json_delta", "partial_json": '{"city": '}}),
        ("content_block_delta", {"index": 0, "delta": {
            "type": "input_json_delta", "partial_json": "Oslo}"}}),
        ("content_block_stop", {"index": 0}),
        ("message_delta", {"delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}}),
        ("ping", {}),
        ("some_future_event", {}),
        ("message_stop", {}),
    ]
    body = b"".join(
        f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()
        for kind, data in events
    )
    async with RawServer(http_response(body, content_type="text/event-stream")) as raw:
        model = AnthropicClient("m", base_url=raw.url, api_key=KEY)
        chunks = await turn(model, USER)
        await model.aclose()
    (call,) = [c for c in chunks if isinstance(c, ToolCallDelta)]
    assert call.call["id"] == "toolu_1" and call.call["function"]["arguments"] == {}
    assert call.error is not None and "not valid JSON" in call.error
    done = chunks[-1]
    assert isinstance(done, TurnDone) and done.stop_reason == "tool_calls"
    assert done.usage == {"input_tokens": 3, "output_tokens": 9}


@pytest.mark.parametrize(
    ("events", "words"),
    [
        ([("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "x"}})],
         "before its start"),
        ([("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
          ("message_stop", {})], "still open"),
        ([("message_start", {"message": {}})], "before message_stop"),
    ],
)
async def test_broken_streams_are_protocol_errors(
    events: list[tuple[str, dict[str, Any]]], words: str
) -> None:
    body = b"".join(
        f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()
        for kind, data in events
    )
    async with RawServer(http_response(body, content_type="text/event-stream")) as raw:
        model = AnthropicClient("m", base_url=raw.url, api_key=KEY)
        with pytest.raises(ModelProtocolError, match=words):
            await turn(model, USER)
        await model.aclose()


async def test_the_key_never_appears_in_errors_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    echoed = json.dumps({"type": "error", "error": {
        "type": "authentication_error", "message": f"invalid x-api-key: {KEY}"}}).encode()
    reply = http_response(echoed, status="401 Unauthorized", content_type="application/json")
    caplog.set_level(logging.DEBUG)
    async with RawServer(reply) as raw:
        model = AnthropicClient("m", base_url=raw.url, api_key=KEY)
        with pytest.raises(ModelHTTPError) as caught:
            await turn(model, USER)
        await model.aclose()
        head = raw.requests[0][0].lower()
    assert f"x-api-key: {KEY}".lower() in head and "anthropic-version: 2023-06-01" in head
    error = caught.value
    assert caught.value.status_code == 401 and "ANTHROPIC_API_KEY" in str(error)
    for text in (str(error), repr(error), error.body, caplog.text):
        assert KEY not in text
