"""The loopback server's Anthropic wire, driven by the official ``anthropic`` SDK.

If the vendor's own client reads our streams and errors as it reads Anthropic's, the
server is faithful enough to prove aimu's provider against: streamed text, tool use,
thinking with signatures (sent back unchanged, and refused when changed), usage, stop
reasons, and each error the API gives (status and mid-stream event).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer

MODEL = "claude-test"


@pytest.fixture
async def server() -> AsyncIterator[LoopbackServer]:
    async with LoopbackServer() as loopback:
        yield loopback


@pytest.fixture
async def sdk(server: LoopbackServer) -> AsyncIterator[anthropic.AsyncAnthropic]:
    client = anthropic.AsyncAnthropic(base_url=server.url, api_key="sk-ant-test", max_retries=0)
    yield client
    await client.close()


def ask(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


async def test_streamed_text_usage_and_stop_reason(
    server: LoopbackServer, sdk: anthropic.AsyncAnthropic
) -> None:
    server.script = [Turn(text="hello there you", input_tokens=12, output_tokens=3)]
    async with sdk.messages.stream(model=MODEL, max_tokens=64, messages=ask("hi")) as stream:
        pieces = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert pieces == ["hello ", "there ", "you"]
    assert [block.type for block in final.content] == ["text"]
    assert final.content[0].text == "hello there you"  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (12, 3)
    request = server.requests[-1]
    assert request.path == "/v1/messages" and request.protocol == "anthropic"
    assert "sk-ant-test" not in repr(request)  # the key's header is recorded redacted


async def test_a_tool_use_streams_its_input_and_the_result_goes_back(
    server: LoopbackServer, sdk: anthropic.AsyncAnthropic
) -> None:
    server.script = [
        Turn(tool_calls=[ScriptedCall("weather", {"city": "Oslo", "days": [1, 2]})]),
        Turn(text="snowing"),
    ]
    tools: Any = [{"name": "weather", "description": "Weather.",
                   "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    async with sdk.messages.stream(
        model=MODEL, max_tokens=64, messages=ask("weather?"), tools=tools
    ) as stream:
        final = await stream.get_final_message()
    (use,) = final.content
    assert use.type == "tool_use" and use.name == "weather"
    assert use.input == {"city": "Oslo", "days": [1, 2]}
    assert final.stop_reason == "tool_use"
    assert server.requests[-1].body["tools"][0]["name"] == "weather"
    follow: Any = [
        *ask("weather?"),
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "snow"}]},
    ]
    reply = await sdk.messages.create(model=MODEL, max_tokens=64, messages=follow, tools=tools)
    assert reply.content[0].text == "snowing"  # type: ignore[union-attr]
    assert server.requests[-1].messages[-1] == {
        "role": "tool", "tool_call_id": use.id, "name": "weather", "content": "snow",
    }


async def test_a_tool_use_without_its_result_is_refused_as_the_api_does(
    server: LoopbackServer, sdk: anthropic.AsyncAnthropic
) -> None:
    dangling: Any = [
        *ask("go"),
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "t", "input": {}}]},
        {"role": "user", "content": "and?"},
    ]
    with pytest.raises(anthropic.BadRequestError, match="without `tool_result`") as caught:
        await sdk.messages.create(model=MODEL, max_tokens=64, messages=dangling)
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    stray: Any = [*ask("go"), {"role": "assistant", "content": "hm"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]
    with pytest.raises(anthropic.BadRequestError, match="unexpected `tool_use_id`"):
        await sdk.messages.create(model=MODEL, max_tokens=64, messages=stray)
    prefill: Any = [*ask("count"), {"role": "assistant", "content": "one two "}]
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        await sdk.messages.create(model=MODEL, max_tokens=64, messages=prefill)
    with pytest.raises(anthropic.BadRequestError, match="top-level `system`"):
        await sdk.messages.create(
            model=MODEL, max_tokens=64,
            messages=[{"role": "system", "content": "x"}, *ask("go")],  # type: ignore[list-item]
        )
    assert server.streams == []  # nothing was answered


async def test_thinking_streams_signed_and_goes_back_unchanged_or_is_refused(
    server: LoopbackServer, sdk: anthropic.AsyncAnthropic
) -> None:
    server.script = [Turn(thinking="Let me think.", text="Done.")] + [Turn(text="ok")] * 2
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    async with sdk.messages.stream(
        model=MODEL, max_tokens=2048, messages=ask("hard"), thinking=thinking
    ) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert {"message_start", "content_block_start", "thinking", "signature", "text",
            "content_block_stop", "message_delta", "message_stop"} <= set(kinds)
    block, text = final.content
    assert block.type == "thinking" and block.thinking == "Let me think." and block.signature
    back: Any = [*ask("hard"), {"role": "assistant", "content": [block.model_dump(),
                                                                 text.model_dump()]},
                 *ask("more")]
    reply = await sdk.messages.create(model=MODEL, max_tokens=64, messages=back)
    assert reply.content[0].text == "ok"  # type: ignore[union-attr]
    back[1]["content"][0]["thinking"] = "Let me think!"
    with pytest.raises(anthropic.BadRequestError, match="signature"):
        await sdk.messages.create(model=MODEL, max_tokens=64, messages=back)


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ("http_429", anthropic.RateLimitError),
        ("http_529", anthropic.OverloadedError),
        ("http_500", anthropic.InternalServerError),
    ],
)
async def test_http_errors_are_the_sdks_own(
    server: LoopbackServer, sdk: anthropic.AsyncAnthropic, fault: Any, error: type[Exception]
) -> None:
    server.script = [Turn(text="x", fault=fault)]
    with pytest.raises(error) as caught:
        await sdk.messages.create(model=MODEL, max_tokens=64, messages=ask("x"))
    assert isinstance(caught.value, anthropic.APIStatusError)
    assert caught.value.body["type"] == "error"  # type: ignore[index]
    if fault == "http_429":
        assert caught.value.response.headers["retry-after"] == "1"


@pytest.mark.parametrize(("fault", "kind"), [("overloaded_event", "overloaded_error"),
                                              ("error_event", "api_error")])
async def test_an_error_event_mid_stream_is_raised_by_the_sdk(
    server: LoopbackServer, sdk: anthropic.AsyncAnthropic, fault: Any, kind: str
) -> None:
    server.script = [Turn(text="one two three", fault=fault, fault_after=1)]
    seen: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as caught:
        async with sdk.messages.stream(model=MODEL, max_tokens=64, messages=ask("x")) as stream:
            async for text in stream.text_stream:
                seen.append(text)
    assert seen == ["one "]
    assert caught.value.body["error"]["type"] == kind  # type: ignore[index]


async def test_a_malformed_event_fails_the_sdks_stream(
    server: LoopbackServer, sdk: anthropic.AsyncAnthropic
) -> None:
    server.script = [Turn(text="one two", fault="bad_json", fault_after=1)]
    with pytest.raises(ValueError):  # the SDK's JSON decoding error
        async with sdk.messages.stream(model=MODEL, max_tokens=64, messages=ask("x")) as stream:
            async for _ in stream:
                pass


async def test_closing_the_sdks_stream_is_seen_by_the_server(
    server: LoopbackServer, sdk: anthropic.AsyncAnthropic
) -> None:
    server.script = [Turn(text="a b c d e f", delay=0.05)]
    async with sdk.messages.stream(model=MODEL, max_tokens=64, messages=ask("x")) as stream:
        async for _ in stream.text_stream:
            break
    (record,) = await server.wait_abandoned()
    assert record.protocol == "anthropic" and not record.completed


async def test_a_whole_reply_and_the_test_model_behind_it(
    server: LoopbackServer, sdk: anthropic.AsyncAnthropic
) -> None:
    reply = await sdk.messages.create(
        model=MODEL, max_tokens=64, system="be kind", messages=ask("hello")
    )
    assert reply.type == "message" and reply.role == "assistant"
    assert "hello" in reply.content[0].text  # type: ignore[union-attr]
    assert reply.stop_reason == "end_turn"
    assert server.requests[-1].messages[0] == {"role": "system", "content": "be kind"}


async def test_typed_output_asks_the_test_model_for_the_schema(
    server: LoopbackServer, sdk: anthropic.AsyncAnthropic
) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    reply = await sdk.messages.create(
        model=MODEL, max_tokens=64, messages=ask("a number"),
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    import json

    assert isinstance(json.loads(reply.content[0].text)["n"], int)  # type: ignore[union-attr]
