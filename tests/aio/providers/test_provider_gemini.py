"""What only the Gemini provider does: its request (contents, systemInstruction, function
declarations, tool config, typed output), calls answered by name and in order, thought
signatures kept and sent back unchanged, finish reasons (safety stops with their reason,
a blocked prompt, a malformed call the model can correct), usage, and the key kept
secret. Against the loopback server's Gemini wire, which refuses what Gemini refuses."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from provider_support import (
    RawServer,
    assert_key_hidden,
    closed_after_test,
    closed_port,
    http_response,
    lookup,
    turn,
)

from aimu import aio
from aimu.aio.client import (
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    TurnDone,
    TurnRequest,
    client,
)
from aimu.aio.errors import ModelConnectionError, ModelHTTPError, ModelProtocolError
from aimu.aio.events import RunFinished
from aimu.aio.providers._http import TurnInput
from aimu.aio.providers.base import NativeData
from aimu.aio.providers.gemini import DEFAULT_BASE_URL, SKIP_SIGNATURE, GeminiClient, to_request
from aimu.aio.transcript import Message, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer

KEY = "AIzaSy-very-secret-0123456789"
USER: list[Message] = [{"role": "user", "content": "x"}]


def gemini(server: LoopbackServer, **options: Any) -> GeminiClient:
    options.setdefault("api_key", KEY)
    made = GeminiClient("gemini-test", base_url=server.gemini_base_url, **options)
    return closed_after_test(made)



def sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(event).encode() + b"\r\n\r\n" for event in events)


# -- configuration --------------------------------------------------------------------


def test_key_and_base_url_come_from_arguments_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("GEMINI_API_KEY", "GOOGLE_API_KEY", "GEMINI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    assert GeminiClient("m").host == DEFAULT_BASE_URL
    assert not GeminiClient("m").has_api_key
    monkeypatch.setenv("GOOGLE_API_KEY", "google-key")
    assert GeminiClient("m")._pool.headers["x-goog-api-key"] == "google-key"
    monkeypatch.setenv("GEMINI_API_KEY", KEY)  # GEMINI_API_KEY wins
    monkeypatch.setenv("GEMINI_BASE_URL", "http://proxy:9/v1beta/")
    model = GeminiClient("models/gemini-2.5-flash")
    assert model._pool.headers["x-goog-api-key"] == KEY
    assert model.host == "http://proxy:9/v1beta" and model.model == "gemini-2.5-flash"
    assert model.url_for(True) == (
        "http://proxy:9/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse"
    )
    assert model.url_for(False).endswith("/models/gemini-2.5-flash:generateContent")
    assert KEY not in repr(model) and KEY not in model.url_for(True)
    assert GeminiClient("m", base_url="http://h:1").host == "http://h:1/v1beta"
    assert GeminiClient("m", base_url="http://h:1/v1alpha").host == "http://h:1/v1alpha"
    with pytest.raises(ValueError, match="needs a scheme"):
        GeminiClient("m", base_url="proxy:9")
    made = client("gemini:gemini-2.5-pro", api_key="k")
    assert isinstance(made, GeminiClient) and made.model == "gemini-2.5-pro"


def test_the_transcript_in_gemini_s_shape() -> None:
    """System prompt apart; calls and results paired by name in the calls' order (results
    recorded out of order are put back in it); adjacent same-role turns merged; our keys,
    thinking and empty partial replies left out; calls another wire wrote get the
    placeholder signature."""
    messages: list[Message] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "look", "images": ["data:image/png;base64,iVBOR"]},
        {"role": "assistant", "content": "", "thinking": "hm", "aimu_partial": True},
        {"role": "assistant", "content": "checking", "thinking": "plan", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": {}}},
        ]},
        {"role": "tool", "content": "G", "tool_call_id": "b", "name": "g"},
        {"role": "tool", "content": "F", "tool_call_id": "a", "name": "f"},
        {"role": "user", "content": "and?"},
    ]
    system, contents = to_request(messages)
    assert system == {"parts": [{"text": "be brief"}]}
    assert contents == [
        {"role": "user", "parts": [
            {"text": "look"}, {"inlineData": {"mimeType": "image/png", "data": "iVBOR"}}]},
        {"role": "model", "parts": [
            {"text": "checking"},
            {"functionCall": {"name": "f", "args": {"x": 1}}, "thoughtSignature": SKIP_SIGNATURE},
            {"functionCall": {"name": "g", "args": {}}},
        ]},
        {"role": "user", "parts": [
            {"functionResponse": {"name": "f", "response": {"output": "F"}}},
            {"functionResponse": {"name": "g", "response": {"output": "G"}}},
            {"text": "and?"},
        ]},
    ]


async def test_the_request_body_and_the_key_header(server: LoopbackServer) -> None:
    server.script = [Turn(text='{"city": "Oslo"}'), Turn(text="ok")]
    async with gemini(server, options={"temperature": 0.1}) as model:
        request = TurnRequest(output_schema={"type": "object"}, tool_choice="lookup")
        spec: Any = {"type": "function", "function": {
            "name": "lookup", "description": "d", "parameters": {"type": "object"}}}
        await turn(model, USER, tools=[spec], request=request)
        await turn(model, USER, tools=[spec], request=TurnRequest(tool_choice="required"))
    first, second = server.requests
    assert first.path == "/v1beta/models/gemini-test:streamGenerateContent"
    assert first.headers["x-goog-api-key"] == "***"  # sent, and redacted in the record
    assert first.body["tools"] == [{"functionDeclarations": [
        {"name": "lookup", "description": "d", "parametersJsonSchema": {"type": "object"}}]}]
    assert first.body["toolConfig"] == {
        "functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["lookup"]}}
    assert first.body["generationConfig"] == {
        "temperature": 0.1, "responseMimeType": "application/json",
        "responseJsonSchema": {"type": "object"}}
    assert second.body["toolConfig"] == {"functionCallingConfig": {"mode": "ANY"}}


# -- replies ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_thoughts_text_calls_usage_and_signatures(
    server: LoopbackServer, stream: bool
) -> None:
    server.script = [Turn(thinking="plan it", text="on it", input_tokens=12, output_tokens=3,
                          tool_calls=[ScriptedCall("lookup", {"city": "Oslo"}),
                                      ScriptedCall("lookup", {"city": "Rome"})])]
    async with gemini(server) as model:
        chunks = await turn(model, USER, stream=stream)
    assert [c.text for c in chunks if isinstance(c, ThinkingDelta)] == ["plan it"]
    assert "".join(c.text for c in chunks if isinstance(c, TextDelta)) == "on it"
    calls = [c.call for c in chunks if isinstance(c, ToolCallDelta)]
    assert [c["function"]["arguments"] for c in calls] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert len({c["id"] for c in calls}) == 2
    native, done = chunks[-2], chunks[-1]
    assert isinstance(native, NativeData) and isinstance(done, TurnDone)
    assert list(native.data["calls"]) == [calls[0]["id"]]  # Gemini signs the first call
    assert native.data["wire"] == "gemini"
    # 12 prompt tokens; output: 3 of the reply and 2 of its thoughts, as the server said.
    assert done.usage == {"input_tokens": 12, "output_tokens": 5}
    assert done.stop_reason == "tool_calls"


async def test_signatures_go_back_unchanged_and_forged_ones_are_refused(
    server: LoopbackServer,
) -> None:
    server.script = [Turn(tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})]),
                     Turn(thinking="so", text="sunny"), Turn(text="again")]
    async with gemini(server) as model:
        agent = aio.Agent(model, tools=[lookup])
        assert await agent.run("weather?") == "sunny"
        messages = agent.model_client.messages
        signed = messages[1]["aimu_native"]["calls"]  # type: ignore[typeddict-item]
        (signature,) = [kept["thoughtSignature"] for kept in signed.values()]
        assert "text_signature" in messages[-1]["aimu_native"]  # type: ignore[typeddict-item]
        assert await agent.run("and now?") == "again"
        sent = server.requests[-1].body["contents"]
        assert sent[1]["parts"][0]["thoughtSignature"] == signature
        assert sent[3]["parts"][-1]["thoughtSignature"] == (
            messages[-3]["aimu_native"]["text_signature"])  # type: ignore[typeddict-item]
        forged = [dict(m) for m in messages]
        forged[1] = {**forged[1], "aimu_native": {"wire": "gemini", "calls": {
            messages[1]["tool_calls"][0]["id"]: {"thoughtSignature": "Zm9yZ2Vk"}}}}  # type: ignore[typeddict-item]
        with pytest.raises(ModelHTTPError, match=r"HTTP 400.*corrupted thought signature"):
            await turn(model, forged)  # type: ignore[arg-type]


async def test_a_call_without_its_response_is_refused_as_gemini_does(
    server: LoopbackServer,
) -> None:
    dangling: list[Message] = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": {}}}]},
        {"role": "user", "content": "go on"},
    ]
    async with gemini(server) as model:
        with pytest.raises(ModelHTTPError, match=r"HTTP 400.*function response"):
            await turn(model, dangling)
        unsigned = {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {}}}]}
        answer = {"role": "user", "parts": [
            {"functionResponse": {"name": "f", "response": {"output": "1"}}}]}
        body = {"contents": [{"role": "user", "parts": [{"text": "x"}]}, unsigned, answer]}
        response = await model._pool.bind()  # type: ignore[attr-defined]
        refused = await response.post(model.url_for(False), json=body)
        assert refused.status_code == 400
        assert "missing a `thought_signature`" in refused.json()["error"]["message"]


@pytest.mark.parametrize(
    ("reason", "stop_reason"),
    [("SAFETY", "safety"), ("RECITATION", "recitation"), ("length", "length"),
     ("blocked:PROHIBITED_CONTENT", "prompt_prohibited_content")],
)
async def test_safety_stops_and_limits_end_the_run_incomplete_with_their_reason(
    server: LoopbackServer, reason: str, stop_reason: str
) -> None:
    server.script = [Turn(text="partial answer", stop_reason=reason, input_tokens=4)]
    async with gemini(server) as model:
        agent = aio.Agent(model)
        events = [e async for e in agent.run("tell me", stream=True)]
    final = events[-1]
    assert isinstance(final, RunFinished)
    assert final.status == "incomplete" and final.stop_reason == stop_reason
    last = agent.model_client.messages[-1]
    assert last["role"] == "assistant" and last.get("aimu_stop_reason") == stop_reason
    blocked = reason.startswith("blocked:")
    assert last["content"] == ("" if blocked else "partial answer")
    validate(agent.model_client.messages)


async def test_a_malformed_function_call_is_an_error_the_model_can_correct(
    server: LoopbackServer,
) -> None:
    server.script = [
        Turn(text="print(default_api.lookup(city=Oslo", stop_reason="MALFORMED_FUNCTION_CALL"),
        Turn(tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})]),
        Turn(text="sunny it is"),
    ]
    async with gemini(server) as model:
        agent = aio.Agent(model, tools=[lookup])
        assert await agent.run("weather?") == "sunny it is"
    messages = agent.model_client.messages
    refused = messages[2]
    assert refused["role"] == "tool" and refused["name"] == "lookup"
    assert "malformed" in refused["content"] and "default_api.lookup(city=Oslo" in (
        refused["content"])
    assert messages[4]["content"] == "sunny in Oslo"
    validate(messages)


async def test_an_error_event_mid_stream_keeps_the_partial_text(server: LoopbackServer) -> None:
    server.script = [Turn(text="one two three", fault="error_event", fault_after=2)]
    messages: list[Message] = []
    async with gemini(server, retries=0) as model:  # else asked again (test_broken_streams)
        with pytest.raises(ModelHTTPError, match=r"mid-reply.*scripted error_event") as caught:
            await _drain(model, messages)
    assert caught.value.status_code == 500  # the status the error's code names
    assert messages[-1] == {"role": "assistant", "content": "one two ", "aimu_partial": True}


async def _drain(model: aio.ModelClient, messages: list[Message] | None = None) -> None:
    async for _ in await aio.chat(model, "x", messages=messages, stream=True):
        pass


async def test_odd_but_valid_streams_are_understood() -> None:
    """CRLF framing, usage in a last event of its own (cached tokens counted apart too),
    a part with a foreign field."""
    body = sse(
        {"candidates": [{"content": {"role": "model", "parts": [{"text": "hi "}]}}],
         "responseId": "r1"},
        {"candidates": [{"content": {"parts": [{"text": "there", "videoMetadata": {}}]},
                         "finishReason": "STOP"}]},
        {"usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 2,
                           "cachedContentTokenCount": 1}},
    )
    response = http_response(body, content_type="text/event-stream")
    async with RawServer(response) as raw, GeminiClient("m", base_url=raw.url) as model:
        chunks = await turn(model, USER)
    assert "".join(c.text for c in chunks if isinstance(c, TextDelta)) == "hi there"
    usage = {"input_tokens": 3, "output_tokens": 2, "cached_input_tokens": 1}
    assert chunks[-1] == TurnDone(usage, "stop")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "words"),
    [(b'data: {"candidates": [{"content": {"parts": [{"text": "a"}]}}]}\r\n\r\n',
      "without a finishReason"),
     (b"data: {not json\r\n\r\n", "could not be understood")],
)
async def test_broken_streams_are_protocol_errors(body: bytes, words: str) -> None:
    response = http_response(body, content_type="text/event-stream")
    async with RawServer(response) as raw, GeminiClient("m", base_url=raw.url) as model:
        with pytest.raises(ModelProtocolError, match=words):
            await turn(model, USER)


async def test_the_key_never_appears_in_errors_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    echo = json.dumps({"error": {"code": 400, "status": "INVALID_ARGUMENT",
                                 "message": f"API key not valid: {KEY}"}}).encode()
    response = http_response(echo, status="400 Bad Request", content_type="application/json")
    errors: list[BaseException] = []
    async with RawServer(response) as raw, GeminiClient("m", base_url=raw.url, api_key=KEY) as m:
        for stream in (True, False):
            with pytest.raises(ModelHTTPError) as caught:
                await turn(m, USER, stream=stream)
            errors.append(caught.value)
        head = raw.requests[0][0]
    assert f"x-goog-api-key: {KEY}" in head and KEY not in head.split("\r\n")[0]
    refused = GeminiClient("m", base_url=f"http://127.0.0.1:{closed_port()}", api_key=KEY,
                           retries=0)
    with pytest.raises(ModelConnectionError) as caught_refused:
        await aio.chat(refused, "x")
    await refused.aclose()
    errors.append(caught_refused.value)
    assert_key_hidden(errors, KEY)
    assert "API key not valid: ***" in str(errors[0])
    assert "GEMINI_API_KEY" in str(errors[0])
    assert KEY not in caplog.text


def test_a_growing_transcript_encodes_as_a_fresh_one() -> None:
    """The encoded contents are reused as the transcript grows; what goes out is what a
    fresh client sends, merges across the boundary (results, then a user message) and a
    replaced message included."""
    call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    grown: list[Message] = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "cut", "aimu_partial": True},
        {"role": "assistant", "content": "on", "tool_calls": [call]},  # type: ignore[list-item]
        {"role": "tool", "content": "1", "tool_call_id": "a", "name": "f"},
        {"role": "user", "content": "and"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "more"},
    ]
    model = GeminiClient("m", base_url="http://h/v1beta")
    for end in range(1, len(grown) + 1):
        fresh = GeminiClient("m", base_url="http://h/v1beta")
        sent = TurnInput(grown[:end])
        assert model.body(sent) == fresh.body(sent), end
    replaced = TurnInput([*grown[:-1], {"role": "user", "content": "other"}])
    fresh = GeminiClient("m", base_url="http://h/v1beta")
    assert model.body(replaced) == fresh.body(replaced)
    assert json.loads(model.body(replaced))["contents"][-1] == {
        "role": "user", "parts": [{"text": "other"}]}
