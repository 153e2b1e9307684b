"""What only the OpenAI-compatible provider does: SSE parsing, tool-call fragments joined
by index, malformed arguments as a tool error, error bodies, and the API key kept secret."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from provider_support import RawServer, assert_key_hidden, closed_port, http_response

from aimu import aio
from aimu.aio.client import Chunk, TextDelta, ThinkingDelta, ToolCallDelta, TurnDone, client
from aimu.aio.errors import ModelConnectionError, ModelHTTPError, ModelProtocolError
from aimu.aio.providers.openai import DEFAULT_BASE_URL, OpenAIClient, to_wire
from aimu.aio.transcript import Message
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer

KEY = "sk-very-secret-0123456789"
USER: list[Message] = [{"role": "user", "content": "x"}]


def sse(*events: object, done: bool = True, newline: str = "\n") -> bytes:
    lines = [
        f"data: {event if isinstance(event, str) else json.dumps(event)}{newline}{newline}"
        for event in events
    ]
    if done:
        lines.append(f"data: [DONE]{newline}{newline}")
    return "".join(lines).encode()


def delta(finish: str | None = None, **fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": finish}]}


async def play(body: bytes, **options: Any) -> list[Chunk]:
    """Stream one turn from a raw server that answers with ``body`` as SSE."""
    response = http_response(body, content_type="text/event-stream")
    async with (
        RawServer(response) as raw,
        OpenAIClient("m", base_url=raw.url + "/v1", **options) as model,
    ):
        return [chunk async for chunk in model.stream_turn(USER)]


# -- configuration --------------------------------------------------------------------


def test_base_url_and_key_come_from_arguments_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert OpenAIClient("m").host == DEFAULT_BASE_URL
    assert not OpenAIClient("m").has_api_key
    monkeypatch.setenv("OPENAI_BASE_URL", "http://gpu-box:8080/v1/")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    model = OpenAIClient("m")
    assert model.host == "http://gpu-box:8080/v1"
    assert model._pool.headers["Authorization"] == f"Bearer {KEY}"
    assert OpenAIClient("m", base_url="http://other/v1").host == "http://other/v1"


def test_a_base_url_without_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a scheme"):
        OpenAIClient("m", base_url="localhost:8080/v1")


def test_the_client_factory_makes_an_openai_client() -> None:
    model = client("openai:gpt-4o-mini", base_url="http://h:1/v1", api_key=KEY)
    assert isinstance(model, OpenAIClient) and model.model == "gpt-4o-mini"


def test_the_api_key_is_in_no_repr() -> None:
    model = OpenAIClient("m", base_url="http://user:pw@h:1/v1?token=t", api_key=KEY)
    for text in (repr(model), str(model), repr(vars(model))):
        assert KEY not in text
    assert model.host == "http://h:1/v1"  # user info and query stay out of messages too
    assert "pw" not in repr(model)


# -- wire format ----------------------------------------------------------------------


def test_wire_form_of_each_message() -> None:
    assert to_wire({
        "role": "assistant", "content": "", "thinking": "private", "aimu_partial": True,
        "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": "f", "arguments": {"q": "é"}}}],
    }) == {
        "role": "assistant", "content": "",
        "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": "f", "arguments": '{"q":"é"}'}}],
    }
    assert to_wire({"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"}) == {
        "role": "tool", "tool_call_id": "c1", "content": "42"
    }
    assert to_wire({"role": "system", "content": "be brief"}) == {
        "role": "system", "content": "be brief"
    }


async def test_request_body_and_headers(server: LoopbackServer) -> None:
    server.script = [Turn(text="a b", input_tokens=3), Turn(text="c")]
    async with OpenAIClient(
        "gpt-x", base_url=server.openai_base_url, api_key=KEY,
        options={"temperature": 0.3, "max_tokens": 64}, headers={"X-Team": "aimu"},
    ) as model:
        chunks = [c async for c in await aio.chat(model, "hi", stream=True)]
        await aio.chat(model, "again")
    streamed, whole = server.requests[-2], server.requests[-1]
    assert streamed.path == "/v1/chat/completions"
    assert streamed.body["temperature"] == 0.3 and streamed.body["max_tokens"] == 64
    assert streamed.body["stream"] is True
    assert streamed.body["stream_options"] == {"include_usage": True}
    assert "stream_options" not in whole.body and whole.body["stream"] is False
    assert streamed.headers["x-team"] == "aimu"
    assert streamed.headers["authorization"] == "***"  # present (the server redacts it)
    assert chunks[-1] == TurnDone({"input_tokens": 3, "output_tokens": 2}, "stop")


async def test_cached_prompt_tokens_are_counted_apart_too() -> None:
    """``prompt_tokens_details.cached_tokens`` (OpenAI's prompt cache): part of the input
    tokens, and ``cached_input_tokens`` in the usage; none when the server says 0."""
    for cached in (5, 0):
        usage = {"prompt_tokens": 12, "completion_tokens": 2,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        chunks = await play(sse(delta("stop", content="ok"), {"choices": [], "usage": usage}))
        expected = {"input_tokens": 12, "output_tokens": 2}
        if cached:
            expected["cached_input_tokens"] = cached
        assert chunks[-1] == TurnDone(expected, "stop")  # type: ignore[arg-type]


async def test_the_key_is_sent_as_a_bearer_header() -> None:
    response = http_response(sse(delta("stop", content="ok")), content_type="text/event-stream")
    async with (
        RawServer(response) as raw,
        OpenAIClient("m", base_url=raw.url + "/v1", api_key=KEY) as model,
    ):
        async for _ in model.stream_turn(USER):
            pass
    head, body = raw.requests[0]
    assert head.startswith("POST /v1/chat/completions HTTP/1.1")
    headers = dict(line.split(": ", 1) for line in head.strip().split("\r\n")[1:])
    assert {k.lower(): v for k, v in headers.items()}["authorization"] == f"Bearer {KEY}"
    assert json.loads(body)["messages"] == [{"role": "user", "content": "x"}]


async def test_server_sent_call_ids_are_kept(server: LoopbackServer) -> None:
    server.script = [Turn(tool_calls=[ScriptedCall("f", {"a": 1}, id="call_from_server")])]
    async with OpenAIClient("m", base_url=server.openai_base_url) as model:
        reply = await aio.chat(model, "x", stream=True)
        calls = [c.call for c in [c async for c in reply] if isinstance(c, ToolCallDelta)]
    assert calls[0]["id"] == "call_from_server"


# -- SSE ------------------------------------------------------------------------------


async def test_sse_with_comments_crlf_and_split_json_is_understood() -> None:
    body = (
        b": ping\r\n\r\n"
        b"event: chunk\r\ndata: {\"choices\": [{\"index\": 0, \"delta\":\r\n"
        b"data: {\"content\": \"Hel\"}}]}\r\n\r\n"
        b"data:" + json.dumps(delta(content="lo")).encode() + b"\r\n\r\n"
        + sse(delta("stop"), {"choices": [], "usage": {"prompt_tokens": 4,
                                                        "completion_tokens": 2}},
              newline="\r\n")
    )
    chunks = await play(body)
    assert chunks == [
        TextDelta("Hel"), TextDelta("lo"),
        TurnDone({"input_tokens": 4, "output_tokens": 2}, "stop"),
    ]


async def test_reasoning_deltas_are_thinking_not_content() -> None:
    chunks = await play(sse(
        delta(role="assistant", reasoning_content="step 1. "),
        delta(reasoning="step 2."),
        delta("stop", content="Done."),
    ))
    assert chunks[:3] == [ThinkingDelta("step 1. "), ThinkingDelta("step 2."), TextDelta("Done.")]


async def test_a_stream_with_finish_but_no_done_marker_still_ends_cleanly() -> None:
    chunks = await play(sse(delta(content="hi"), delta("length"), done=False))
    assert chunks == [TextDelta("hi"), TurnDone({"input_tokens": 0, "output_tokens": 0}, "length")]


async def test_an_event_that_is_not_json_is_a_protocol_error() -> None:
    with pytest.raises(ModelProtocolError, match=r"not JSON.*\{oops"):
        await play(sse(delta(content="a"), "{oops"))


async def test_an_error_event_mid_stream_carries_the_server_text() -> None:
    with pytest.raises(ModelHTTPError, match="context length exceeded") as caught:
        await play(sse(delta(content="a"), {"error": {"message": "context length exceeded"}}))
    assert caught.value.body == "context length exceeded"


# -- tool calls -----------------------------------------------------------------------


def call_fragments(index: int, call_id: str, name: str, *parts: str) -> list[dict[str, Any]]:
    first = delta(tool_calls=[{"index": index, "id": call_id, "type": "function",
                               "function": {"name": name, "arguments": parts[0]}}])
    rest = [delta(tool_calls=[{"index": index, "function": {"arguments": part}}])
            for part in parts[1:]]
    return [first, *rest]


async def test_interleaved_fragments_are_joined_by_index() -> None:
    a = call_fragments(0, "call_a", "weather", '{"ci', 'ty": "Os', 'lo"}')
    b = call_fragments(1, "call_b", "add", '{"a": 1,', ' "b": 2}')
    events = [a[0], b[0], a[1], b[1], a[2], delta("tool_calls")]
    chunks = await play(sse(*events))
    calls = [c for c in chunks if isinstance(c, ToolCallDelta)]
    assert [(c.call["id"], c.call["function"], c.error) for c in calls] == [
        ("call_a", {"name": "weather", "arguments": {"city": "Oslo"}}, None),
        ("call_b", {"name": "add", "arguments": {"a": 1, "b": 2}}, None),
    ]
    assert chunks[-1] == TurnDone({"input_tokens": 0, "output_tokens": 0}, "tool_calls")


async def test_malformed_arguments_become_a_tool_error_with_the_raw_text() -> None:
    events = call_fragments(0, "call_a", "weather", '{"city": "Par')
    chunks = await play(sse(*events, delta("tool_calls")))
    (call,) = [c for c in chunks if isinstance(c, ToolCallDelta)]
    assert call.call["function"] == {"name": "weather", "arguments": {}}
    assert call.error is not None
    assert call.error.startswith("the arguments for tool weather were not valid JSON: ")
    assert call.error.endswith('raw: {"city": "Par')


async def test_arguments_that_are_not_an_object_are_a_tool_error() -> None:
    chunks = await play(sse(*call_fragments(0, "c", "f", "[1, 2]"), delta("tool_calls")))
    (call,) = [c for c in chunks if isinstance(c, ToolCallDelta)]
    assert call.error is not None and "expected a JSON object, got list" in call.error


async def test_long_raw_arguments_are_clipped_in_the_error() -> None:
    raw = '{"text": "' + "x" * 5000
    chunks = await play(sse(*call_fragments(0, "c", "f", raw), delta("tool_calls")))
    (call,) = [c for c in chunks if isinstance(c, ToolCallDelta)]
    assert call.error is not None and len(call.error) < 400
    assert call.error.endswith("… (5010 characters)")


async def test_empty_arguments_mean_no_arguments_and_missing_ids_are_made() -> None:
    events = [delta(tool_calls=[{"index": 0, "function": {"name": "now", "arguments": ""}}]),
              delta("tool_calls")]
    (call, _) = await play(sse(*events))
    assert isinstance(call, ToolCallDelta) and call.error is None
    assert call.call["function"]["arguments"] == {}
    assert call.call["id"].startswith("call_")


async def test_a_tool_call_without_a_name_is_a_protocol_error() -> None:
    events = [delta(tool_calls=[{"index": 0, "function": {"arguments": "{}"}}]),
              delta("tool_calls")]
    with pytest.raises(ModelProtocolError, match="without a function name"):
        await play(sse(*events))


async def test_non_streamed_tool_calls_with_null_content() -> None:
    reply = {
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None, "reasoning_content": "hmm",
            "tool_calls": [{"id": "c9", "type": "function",
                            "function": {"name": "f", "arguments": "{\"k\": true}"}}],
        }}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 1},
    }
    response = http_response(json.dumps(reply).encode(), content_type="application/json")
    async with (
        RawServer(response) as raw,
        OpenAIClient("m", base_url=raw.url + "/v1") as model,
    ):
        message = await aio.chat(model, "x")
    assert message == {
        "role": "assistant", "content": "", "thinking": "hmm",
        "tool_calls": [{"id": "c9", "type": "function",
                        "function": {"name": "f", "arguments": {"k": True}}}],
    }


# -- errors and the key ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "text"),
    [
        ({"error": {"message": "model gpt-x does not exist", "type": "invalid_request"}},
         "model gpt-x does not exist"),
        ({"error": "bad things"}, "bad things"),
        ({"object": "error", "message": "vLLM says no"}, "vLLM says no"),
        ({"detail": "Not Found"}, "Not Found"),
        ("plain words", "plain words"),
    ],
)
async def test_http_error_bodies_give_the_server_text(body: object, text: str) -> None:
    raw_body = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    response = http_response(raw_body, status="404 Not Found", content_type="application/json")
    async with (
        RawServer(response) as raw,
        OpenAIClient("gpt-x", base_url=raw.url + "/v1") as model,
    ):
        with pytest.raises(ModelHTTPError) as caught:
            await aio.chat(model, "x")
    assert caught.value.status_code == 404
    assert f"HTTP 404 for model 'gpt-x': {text}" in str(caught.value)
    assert "check the model name" in str(caught.value)


async def test_the_key_never_appears_in_errors_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    echo = json.dumps({"error": {"message": f"Incorrect API key provided: {KEY}"}}).encode()
    response = http_response(echo, status="401 Unauthorized", content_type="application/json")
    errors: list[BaseException] = []
    async with (
        RawServer(response) as raw,
        OpenAIClient("m", base_url=raw.url + "/v1", api_key=KEY) as model,
    ):
        for stream in (True, False):
            with pytest.raises(ModelHTTPError) as caught:
                async for _ in model.stream_turn(USER, stream=stream):
                    pass
            errors.append(caught.value)
    refused = OpenAIClient(  # its retries logged too, without the backoff's ~3 s of waits
        "m", base_url=f"http://127.0.0.1:{closed_port()}/v1", api_key=KEY, retry_delay=0.001
    )
    with pytest.raises(ModelConnectionError) as caught_refused:
        await aio.chat(refused, "x")
    await refused.aclose()
    errors.append(caught_refused.value)
    assert_key_hidden(errors, KEY)
    assert "check api_key= / OPENAI_API_KEY" in str(errors[0])
    assert "Incorrect API key provided: ***" in str(errors[0])
    assert KEY not in caplog.text


async def test_a_429_says_when_to_retry(server: LoopbackServer) -> None:
    server.script = [Turn(fault="http_429")]
    async with OpenAIClient("m", base_url=server.openai_base_url, retries=0) as model:
        with pytest.raises(ModelHTTPError, match=r"rate limited.*retry after 1s"):
            await aio.chat(model, "x")


# -- a root URL, and no key ----------------------------------------------------------


@pytest.mark.parametrize("spec", ["openai:m", "openai-responses:m"])
async def test_a_root_base_url_reaches_the_api_under_v1(
    server: LoopbackServer, spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``OPENAI_BASE_URL=http://HOST:PORT`` (no ``/v1``), as the other wires take a
    server: the first 404 there moves the client to ``/v1``; it stays there."""
    server.script = [Turn(text="one"), Turn(text="two")]
    monkeypatch.setenv("OPENAI_BASE_URL", server.url)
    async with client(spec, api_key=KEY) as model:
        assert (await aio.chat(model, "a"))["content"] == "one"
        assert (await aio.chat(model, "b"))["content"] == "two"
        assert model.host == server.openai_base_url
    answered = [r.path for r in server.requests]
    assert answered[0] in ("/chat/completions", "/responses")  # the root: 404
    assert all(path.startswith("/v1/") for path in answered[1:]) and len(answered) == 3


async def test_a_base_url_with_a_path_is_taken_as_given(server: LoopbackServer) -> None:
    async with OpenAIClient("m", base_url=server.url + "/nowhere", api_key=KEY,
                            retries=0) as model:
        with pytest.raises(ModelHTTPError) as refused:
            await aio.chat(model, "a")
    assert refused.value.status_code == 404
    assert [r.path for r in server.requests] == ["/nowhere/chat/completions"]


@pytest.mark.parametrize(("spec", "variable"), [
    ("openai:m", "OPENAI_API_KEY"), ("openai-responses:m", "OPENAI_API_KEY"),
    ("anthropic:m", "ANTHROPIC_API_KEY"), ("gemini:m", "GEMINI_API_KEY"),
])
def test_no_api_key_is_said_once_naming_the_variable(
    spec: str, variable: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A warning (shown by default: a script with no logging set up sees it) and a log
    record, once per process and server; none for a local server, none with a key."""
    import warnings

    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    remote = f"https://models-{spec.partition(':')[0]}.example"
    with caplog.at_level(logging.WARNING, logger="aimu.aio.providers"), \
            warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for _ in range(3):  # said once per process and server, not per client
            client(spec, base_url=remote)
        for local in ("http://127.0.0.1:8080", "http://localhost:11434", "http://[::1]:1",
                      "http://192.168.1.20:8000", "http://10.0.0.5:80"):
            client(spec, base_url=local)  # a local server without a key: normal, no word
        client(spec, base_url=remote + ":444", api_key=KEY)  # a key: nothing to say
    said = [r.getMessage() for r in caplog.records if "API key" in r.getMessage()]
    assert len(said) == 1 and variable in said[0] and remote in said[0], said
    (warning,) = [w for w in warned if "API key" in str(w.message)]
    assert str(warning.message) == said[0] and warning.category is UserWarning
    assert warning.filename == __file__  # it points at the line that made the client
