"""The loopback server's Gemini wire, driven by Google's own SDK (``google-genai``, a
test-only dependency): what the SDK reads from it is what a scripted turn says, and the
SDK's own multi-turn history (thought signatures, function responses) is accepted as
Gemini accepts it, while what Gemini refuses is refused with the errors the SDK raises."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from google import genai
from google.genai import errors, types

from aimu import aio
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer

LOOKUP = types.Tool(function_declarations=[types.FunctionDeclaration(
    name="lookup", description="The weather in a city.",
    parameters_json_schema={"type": "object", "properties": {"city": {"type": "string"}}},
)])


@contextlib.asynccontextmanager
async def sdk(server: LoopbackServer) -> AsyncIterator[genai.Client]:
    """The SDK pointed at the loopback server (the API version aimu uses), retrying
    nothing (so faults surface); its connections closed at the end."""
    options = types.HttpOptions(
        base_url=server.url, api_version="v1beta",
        retry_options=types.HttpRetryOptions(attempts=1),
    )
    client = genai.Client(api_key="AIza-sdk-test", http_options=options)
    try:
        yield client
    finally:
        await client.aio.aclose()
        client.close()


Chunks = AsyncIterator[types.GenerateContentResponse]


async def stream(client: genai.Client, contents: str) -> Chunks:
    return await client.aio.models.generate_content_stream(model="gemini-test", contents=contents)


async def test_streamed_text_thoughts_and_usage() -> None:
    turn = Turn(thinking="they greet me", text="hello there friend", input_tokens=5)
    async with LoopbackServer([turn]) as server, sdk(server) as client:
        chunks = [c async for c in await stream(client, "hi")]
    parts = [p for c in chunks if c.candidates and c.candidates[0].content
             for p in c.candidates[0].content.parts or ()]
    assert [p.text for p in parts if p.thought] == ["they greet me"]
    assert "".join(p.text or "" for p in parts if not p.thought) == "hello there friend"
    assert parts[-1].thought_signature  # the last part of a thinking reply is signed
    last = chunks[-1]
    assert last.candidates is not None
    assert last.candidates[0].finish_reason == types.FinishReason.STOP
    usage = last.usage_metadata
    assert usage is not None
    assert (usage.prompt_token_count, usage.candidates_token_count,
            usage.thoughts_token_count, usage.total_token_count) == (5, 3, 3, 11)
    assert server.requests[0].path == "/v1beta/models/gemini-test:streamGenerateContent"
    assert server.streams[0].completed


async def test_function_calls_with_signatures_round_trip_through_the_sdk_chat() -> None:
    script = [
        Turn(tool_calls=[ScriptedCall("lookup", {"city": "Oslo"}),
                         ScriptedCall("lookup", {"city": "Rome"})]),
        Turn(text="sunny in both"),
    ]
    async with LoopbackServer(script) as server, sdk(server) as client:
        chat = client.aio.chats.create(
            model="gemini-test", config=types.GenerateContentConfig(tools=[LOOKUP])
        )
        asked = await chat.send_message("weather?")
        calls = asked.function_calls or []
        assert [(c.name, c.args) for c in calls] == [
            ("lookup", {"city": "Oslo"}), ("lookup", {"city": "Rome"})]
        assert asked.candidates is not None and asked.candidates[0].content is not None
        first = (asked.candidates[0].content.parts or [])[0]
        assert first.thought_signature  # Gemini 3 signs a step's first call
        answers = [types.Part.from_function_response(name="lookup", response={"output": c})
                   for c in ("snow", "sun")]
        reply = await chat.send_message(answers)
        assert reply.text == "sunny in both"
        # The SDK sent the signature back as it got it, and the server took it.
        sent = server.requests[-1].body["contents"]
        assert sent[1]["parts"][0]["thoughtSignature"]
        assert server.requests[-1].messages[-2:] == [
            {"role": "tool", "tool_call_id": "gemini_1_0", "name": "lookup", "content": "snow"},
            {"role": "tool", "tool_call_id": "gemini_1_1", "name": "lookup", "content": "sun"},
        ]


async def test_what_gemini_refuses_the_sdk_sees_refused() -> None:
    async with LoopbackServer([Turn(text="never")]) as server, sdk(server) as client:
        unanswered = [
            types.Content(role="user", parts=[types.Part.from_text(text="x")]),
            types.Content(role="model", parts=[types.Part(
                function_call=types.FunctionCall(name="lookup", args={}),
                thought_signature=b"forged")]),
            types.Content(role="user", parts=[types.Part.from_text(text="and?")]),
        ]
        with pytest.raises(errors.ClientError) as caught:
            await client.aio.models.generate_content(model="gemini-test", contents=unanswered)
        assert caught.value.code == 400
        assert "corrupted thought signature" in str(caught.value.message)
        unanswered[1].parts[0].thought_signature = None  # type: ignore[index]
        with pytest.raises(errors.ClientError, match="function response"):
            await client.aio.models.generate_content(model="gemini-test", contents=unanswered)
        assert server.streams == []  # refused before any reply


@pytest.mark.parametrize(
    ("stop", "finish"),
    [("SAFETY", types.FinishReason.SAFETY), ("length", types.FinishReason.MAX_TOKENS),
     ("MALFORMED_FUNCTION_CALL", types.FinishReason.MALFORMED_FUNCTION_CALL)],
)
async def test_finish_reasons(stop: str, finish: types.FinishReason) -> None:
    script = [Turn(text="print(default_api.x(", stop_reason=stop)]
    async with LoopbackServer(script) as server, sdk(server) as client:
        reply = await client.aio.models.generate_content(model="gemini-test", contents="x")
    assert reply.candidates is not None
    assert reply.candidates[0].finish_reason == finish
    if stop == "MALFORMED_FUNCTION_CALL":  # no content (the SDK drops finishMessage)
        assert reply.candidates[0].content is None
    if stop == "SAFETY":
        assert reply.candidates[0].safety_ratings


async def test_a_blocked_prompt() -> None:
    async with LoopbackServer([Turn(stop_reason="blocked:SAFETY")]) as server, sdk(server) as c:
        chunks = [chunk async for chunk in await stream(c, "x")]
    (only,) = chunks
    assert only.prompt_feedback is not None
    assert only.prompt_feedback.block_reason == types.BlockedReason.SAFETY
    assert not only.candidates


@pytest.mark.parametrize(
    ("fault", "kind", "code"),
    [("http_429", errors.ClientError, 429), ("http_500", errors.ServerError, 500),
     ("http_503", errors.ServerError, 503)],
)
async def test_http_faults_are_the_sdk_s_errors(
    fault: str, kind: type[errors.APIError], code: int
) -> None:
    faulty = Turn(fault=fault)  # type: ignore[arg-type]
    async with LoopbackServer([faulty]) as server, sdk(server) as client:
        with pytest.raises(kind) as caught:
            [c async for c in await stream(client, "x")]
    assert caught.value.code == code
    assert "scripted" in str(caught.value.message)


async def test_an_error_mid_stream_and_a_broken_event() -> None:
    script = [Turn(text="one two three", fault="error_event", fault_after=2),
              Turn(text="one two three", fault="bad_json", fault_after=1)]
    async with LoopbackServer(script) as server, sdk(server) as client:
        seen: list[str] = []
        with pytest.raises(errors.ServerError, match="error_event"):
            async for chunk in await stream(client, "x"):
                seen.append(chunk.text or "")
        assert seen == ["one ", "two "]
        with pytest.raises(Exception, match=r"(?i)json|expecting"):
            [c async for c in await stream(client, "x")]


async def test_aimu_and_the_sdk_read_the_same_turns_alike() -> None:
    """One script, two readers: what aimu's provider keeps is what the SDK shows."""
    call = ScriptedCall("lookup", {"city": "Oslo"})
    turns = [Turn(thinking="plan", text="calling", tool_calls=[call], input_tokens=9)] * 2
    async with LoopbackServer(turns) as server, sdk(server) as client:
        reply = await client.aio.models.generate_content(
            model="gemini-test", contents="w", config=types.GenerateContentConfig(tools=[LOOKUP]))
        model = aio.client("gemini:gemini-test", base_url=server.gemini_base_url, api_key="k")
        async with model:
            message = await aio.chat(model, "w")
    assert reply.candidates is not None and reply.candidates[0].content is not None
    parts = reply.candidates[0].content.parts or []
    assert message["thinking"] == "".join(p.text or "" for p in parts if p.thought)
    assert message["content"] == "".join(p.text or "" for p in parts if p.text and not p.thought)
    (call,) = message.get("tool_calls", [])
    assert (call["function"]["name"], call["function"]["arguments"]) == (
        reply.function_calls[0].name, reply.function_calls[0].args)  # type: ignore[index]
    assert reply.usage_metadata is not None
    assert reply.usage_metadata.prompt_token_count == 9
