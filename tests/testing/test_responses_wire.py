"""The loopback server's OpenAI Responses wire, driven by OpenAI's own SDK
(``client.responses``): streamed events and their numbers, function calls, reasoning
items, whole responses, the requests the real API refuses, and background mode
(create, cancel, retrieve and stream again from an event)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer

WEATHER = {
    "type": "function", "name": "weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture
async def server() -> AsyncIterator[LoopbackServer]:
    async with LoopbackServer() as loopback:
        yield loopback


@pytest.fixture
async def sdk(server: LoopbackServer) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=server.openai_base_url, api_key="sk-test", max_retries=0)
    yield client
    await client.close()


async def test_a_streamed_response_parses_event_by_event(
    server: LoopbackServer, sdk: openai.AsyncOpenAI
) -> None:
    server.script = [Turn(text="one two three", thinking="I count.", input_tokens=9)]
    stream = await sdk.responses.create(
        model="gpt-test", input="count", stream=True, include=["reasoning.encrypted_content"]
    )
    events = [event async for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "one two three"
    summary = [e.delta for e in events if e.type == "response.reasoning_summary_text.delta"]
    assert summary == ["I count."]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status == "completed" and final.output_text == "one two three"
    reasoning = final.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    assert final.usage is not None and final.usage.input_tokens == 9
    assert final.usage.output_tokens == 3


async def test_function_calls_and_their_outputs_round_trip(
    server: LoopbackServer, sdk: openai.AsyncOpenAI
) -> None:
    server.script = [
        Turn(tool_calls=[ScriptedCall("weather", {"city": "Oslo"})]),
        Turn(text="Snow."),
    ]
    stream = await sdk.responses.create(
        model="gpt-test", input="weather?", tools=[WEATHER], stream=True  # type: ignore[list-item]
    )
    events = [event async for event in stream]
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert json.loads(arguments) == {"city": "Oslo"}
    (call,) = [
        e.item for e in events
        if e.type == "response.output_item.done" and e.item.type == "function_call"
    ]
    assert call.name == "weather" and call.call_id  # type: ignore[union-attr]
    reply = await sdk.responses.create(
        model="gpt-test", tools=[WEATHER],  # type: ignore[list-item]
        input=[
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": call.call_id,  # type: ignore[union-attr]
             "name": "weather", "arguments": call.arguments},  # type: ignore[union-attr]
            {"type": "function_call_output", "call_id": call.call_id,  # type: ignore[union-attr]
             "output": "snow"},
        ],
    )
    assert reply.output_text == "Snow."
    # The script saw the request in the chat shape: the call and its result.
    chat = server.requests[-1].messages
    assert [m["role"] for m in chat] == ["user", "assistant", "tool"]


async def test_a_function_call_without_its_output_is_refused(
    server: LoopbackServer, sdk: openai.AsyncOpenAI
) -> None:
    with pytest.raises(openai.BadRequestError, match="No tool output found for function call"):
        await sdk.responses.create(
            model="gpt-test",
            input=[
                {"role": "user", "content": "x"},
                {"type": "function_call", "call_id": "call_1", "name": "weather",
                 "arguments": "{}"},
            ],
        )
    assert server.streams == []  # refused before any reply


async def test_a_reasoning_item_goes_back_only_unchanged(
    server: LoopbackServer, sdk: openai.AsyncOpenAI
) -> None:
    server.script = [Turn(text="hi", thinking="greeting"), Turn(text="again")]
    first = await sdk.responses.create(
        model="gpt-test", input="hi", store=False, include=["reasoning.encrypted_content"]
    )
    item = first.output[0].model_dump(exclude_none=True)
    again = await sdk.responses.create(
        model="gpt-test", store=False, input=[{"role": "user", "content": "hi"}, item]  # type: ignore[list-item]
    )
    assert again.output_text == "again"
    tampered = {**item, "encrypted_content": "bm90IG91cnM="}
    with pytest.raises(openai.BadRequestError, match="not found"):
        await sdk.responses.create(model="gpt-test", store=False, input=[tampered])  # type: ignore[list-item]


async def test_an_incomplete_response_says_why(
    server: LoopbackServer, sdk: openai.AsyncOpenAI
) -> None:
    server.script = [Turn(text="cut off", stop_reason="length")]
    reply = await sdk.responses.create(model="gpt-test", input="long")
    assert reply.status == "incomplete"
    assert reply.incomplete_details is not None
    assert reply.incomplete_details.reason == "max_output_tokens"


async def test_an_error_event_mid_stream_reaches_the_sdk(
    server: LoopbackServer, sdk: openai.AsyncOpenAI
) -> None:
    server.script = [Turn(text="a b c", fault="error_event", fault_after=1)]
    stream = await sdk.responses.create(model="gpt-test", input="x", stream=True)
    events = [event async for event in stream]
    assert [e.type for e in events][-2:] == ["response.output_text.delta", "error"]
    last = events[-1]
    assert last.type == "error" and "scripted error_event fault" in last.message


async def test_background_create_cancel_and_retrieve(
    server: LoopbackServer, sdk: openai.AsyncOpenAI
) -> None:
    server.script = [Turn(text=" ".join(["word"] * 50), delay=0.05)]
    stream = await sdk.responses.create(
        model="gpt-test", input="go", background=True, stream=True
    )
    seen = []
    async for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta":
            break
    await stream.close()
    response_id = seen[0].response.id  # type: ignore[union-attr]
    # Our socket went; the response goes on being made on the server.
    await server.wait_abandoned(1)
    current = await sdk.responses.retrieve(response_id)
    assert current.status == "in_progress" and current.background
    # Stream it again from the event after the last one we read.
    after = seen[-1].sequence_number
    again = await sdk.responses.retrieve(
        response_id, stream=True, starting_after=after
    )
    first = await anext(aiter(again))
    assert first.sequence_number == after + 1
    cancelled = await sdk.responses.cancel(response_id)
    assert cancelled.status == "cancelled"
    async for _ in again:  # the cancelled response's stream ends
        pass
    assert server.background.cancelled == [response_id]
    assert (await sdk.responses.retrieve(response_id)).status == "cancelled"


async def test_background_needs_store_and_unknown_ids_are_404(
    server: LoopbackServer, sdk: openai.AsyncOpenAI
) -> None:
    with pytest.raises(openai.BadRequestError, match="store"):
        await sdk.responses.create(model="gpt-test", input="x", background=True, store=False)
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve("resp_nope")
    server.script = [Turn(text="done")]
    queued = await sdk.responses.create(model="gpt-test", input="x", background=True)
    assert queued.status == "queued"
    async with httpx.AsyncClient() as http:  # a finished response cannot be cancelled
        await server.wait_until(lambda: server.background.stored[queued.id].finished)
        answer = await http.post(f"{server.openai_base_url}/responses/{queued.id}/cancel")
    assert answer.status_code == 400
    assert (await sdk.responses.retrieve(queued.id)).output_text == "done"
