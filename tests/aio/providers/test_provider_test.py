"""The embedded ``test`` model: deterministic replies, tool calls built from schemas,
summaries of tool results, streaming in chunks with room for a cancel between them."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest

from aimu import aio
from aimu.aio.client import TextDelta, ToolCallDelta, TurnDone, client
from aimu.aio.providers.test import TestModelClient, arguments_for, respond
from aimu.aio.transcript import Message, ToolSpec, validate


def spec(name: str, properties: dict[str, Any], required: list[str] | None = None,
         extra: dict[str, Any] | None = None) -> ToolSpec:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        **(extra or {}),
    }
    return {
        "type": "function",
        "function": {"name": name, "description": f"{name} tool", "parameters": parameters},
    }


WEATHER = spec("weather", {"city": {"type": "string"}})
ADD = spec("add", {"a": {"type": "integer"}, "b": {"type": "number"}})


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def test_reply_without_tools_echoes_the_user_text() -> None:
    text, calls = respond([user("tell me about otters")], None)
    assert calls == []
    assert "tell me about otters" in text


def test_reply_to_an_empty_transcript_is_still_text() -> None:
    text, calls = respond([], None)
    assert text and calls == []


def test_respond_is_deterministic() -> None:
    messages = [user("What is the weather in Paris?")]
    assert respond(messages, [WEATHER, ADD]) == respond(messages, [WEATHER, ADD])


def test_each_offered_tool_is_called_once_in_order() -> None:
    text, calls = respond([user("What is the weather in Paris?")], [WEATHER, ADD])
    assert text == ""
    assert calls == [("weather", {"city": "Paris"}), ("add", {"a": 1, "b": 1.5})]


def test_strings_take_a_word_of_the_user_text_or_example() -> None:
    assert arguments_for(WEATHER["function"]["parameters"], "look up zanzibar") == {
        "city": "zanzibar"
    }
    assert arguments_for(WEATHER["function"]["parameters"], "") == {"city": "example"}


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ({"type": "integer", "minimum": 5}, 5),
        ({"type": "integer", "maximum": -3}, -3),
        ({"type": "integer", "exclusiveMinimum": 1}, 2),
        ({"type": "number", "minimum": 2.5}, 2.5),
        ({"type": "number"}, 1.5),
        ({"type": "boolean"}, True),
        ({"type": "null"}, None),
        ({"enum": ["celsius", "fahrenheit"]}, "celsius"),
        ({"const": "fixed"}, "fixed"),
        ({"type": "string", "format": "date"}, "2024-01-01"),
        ({"type": "string", "maxLength": 3}, "wor"),
        ({"type": "string", "minLength": 8}, "wordword"),
        ({"type": "array", "items": {"type": "integer"}}, [1]),
        ({"type": "array", "items": {"type": "string"}, "minItems": 2}, ["word", "word"]),
        ({"anyOf": [{"type": "null"}, {"type": "integer"}]}, 1),
        ({"oneOf": [{"type": "boolean"}, {"type": "string"}]}, True),
        ({"type": ["null", "number"]}, 1.5),
        (
            {"type": "object", "properties": {"x": {"type": "integer"}, "y": {}},
             "required": ["x"]},
            {"x": 1},
        ),
        (
            {"type": "array", "items": {"type": "object", "properties": {
                "tag": {"type": "string"}}, "required": ["tag"]}},
            [{"tag": "word"}],
        ),
        ({"allOf": [{"type": "integer"}, {"minimum": 7}]}, 7),
    ],
)
def test_argument_values_follow_the_schema(schema: dict[str, Any], expected: Any) -> None:
    parameters = {"type": "object", "properties": {"value": schema}, "required": ["value"]}
    assert arguments_for(parameters, "word") == {"value": expected}


def test_only_required_properties_are_filled() -> None:
    tool = spec("search", {"query": {"type": "string"}, "limit": {"type": "integer"}},
                required=["query"])
    _, calls = respond([user("find Lisbon")], [tool])
    assert calls == [("search", {"query": "Lisbon"})]


def test_refs_to_defs_are_followed() -> None:
    tool = spec(
        "book",
        {"trip": {"$ref": "#/$defs/Trip"}},
        extra={"$defs": {"Trip": {"type": "object", "properties": {
            "nights": {"type": "integer", "minimum": 2}}, "required": ["nights"]}}},
    )
    _, calls = respond([user("book it")], [tool])
    assert calls == [("book", {"trip": {"nights": 2}})]


def test_a_tool_without_parameters_gets_empty_arguments() -> None:
    tool: Any = {"type": "function", "function": {"name": "now", "description": ""}}
    _, calls = respond([user("what time is it")], [tool])
    assert calls == [("now", {})]


def test_after_tool_results_it_summarises_each_result_and_calls_nothing() -> None:
    messages: list[Message] = [
        user("weather and sum"),
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {}}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": {}}},
        ]},
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "c1", "name": "weather"},
        {"role": "tool", "content": "3", "tool_call_id": "c2", "name": "add"},
    ]
    text, calls = respond(messages, [WEATHER, ADD])
    assert calls == []
    assert text == "I called weather: sunny, 21 C. I called add: 3."


def test_a_new_user_message_after_a_tool_round_calls_the_tools_again() -> None:
    messages: list[Message] = [
        user("first"),
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {}}},
        ]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "weather"},
        {"role": "assistant", "content": "I called weather: sunny."},
        user("and in Rome?"),
    ]
    _, calls = respond(messages, [WEATHER])
    assert calls == [("weather", {"city": "Rome"})]


async def test_a_full_tool_round_through_chat_is_valid_and_repeatable() -> None:
    async def run() -> list[Message]:
        messages: list[Message] = []
        async with TestModelClient() as model:
            reply = await aio.chat(
                model, "weather in Oslo and 2+2?", messages=messages, tools=[WEATHER, ADD]
            )
            calls = reply.get("tool_calls", [])
            assert len({call["id"] for call in calls}) == 2  # unique ids within the turn
            for call, result in zip(calls, ["snow", "4"], strict=True):
                messages.append({
                    "role": "tool", "content": result, "tool_call_id": call["id"],
                    "name": call["function"]["name"],
                })
            async for _ in model.stream_turn(messages, [WEATHER, ADD]):
                pass
            answer = await aio.chat(model, "thanks", messages=messages, tools=None)
            assert "thanks" in answer["content"]
            return messages

    first, second = await run(), await run()
    assert first == second  # ids included: the model is fully deterministic
    validate(first)
    assert [m["role"] for m in first] == ["user", "assistant", "tool", "tool", "user", "assistant"]


async def test_text_streams_one_word_per_chunk() -> None:
    model = TestModelClient()
    chunks = [c async for c in model.stream_turn([user("one two three four")])]
    texts = [c.text for c in chunks if isinstance(c, TextDelta)]
    assert len(texts) == len(["You", "said:", "one", "two", "three", "four"])
    assert "".join(texts) == "You said: one two three four"
    assert isinstance(chunks[-1], TurnDone) and chunks[-1].done_reason == "stop"


async def test_chunks_sets_the_number_of_pieces() -> None:
    model = TestModelClient(chunks=3)
    chunks = [c async for c in model.stream_turn([user("a fairly long sentence here")])]
    assert sum(isinstance(c, TextDelta) for c in chunks) == 3


async def test_tool_turn_ends_with_tool_calls_reason() -> None:
    model = TestModelClient()
    chunks = [c async for c in model.stream_turn([user("go")], [WEATHER])]
    assert [type(c) for c in chunks] == [ToolCallDelta, TurnDone]
    done = chunks[-1]
    assert isinstance(done, TurnDone) and done.done_reason == "tool_calls"


async def test_a_cancel_lands_between_chunks_and_keeps_the_partial_text() -> None:
    model = TestModelClient(delay=10.0)
    seen: list[str] = []
    messages: list[Message] = []
    first = asyncio.Event()

    async def consume() -> None:
        chunks = await aio.chat(model, "alpha beta gamma", messages=messages, stream=True)
        async for chunk in chunks:
            assert isinstance(chunk, TextDelta)
            seen.append(chunk.text)
            first.set()

    task = asyncio.create_task(consume())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["You "]
    assert messages[-1] == {"role": "assistant", "content": "You ", "aimu_partial": True}


async def test_zero_delay_still_yields_to_the_loop_between_chunks() -> None:
    model = TestModelClient()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    try:
        count = 0
        async for _ in model.stream_turn([user("one two three four five")]):
            count += 1
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert ticks >= count - 1


def test_client_factory_and_fork() -> None:
    model = client("test", delay=0.5, chunks=2)
    assert isinstance(model, TestModelClient)
    assert model.host == "embedded"
    assert repr(model) == "<TestModelClient test:test at embedded>"
    named = client("test:tiny")
    assert isinstance(named, TestModelClient) and named.model == "tiny"
    model.messages.append(user("hi"))
    twin = model.fork()
    assert (twin.model, twin.delay, twin.chunks) == ("test", 0.5, 2)
    assert twin.messages == []


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="delay"):
        TestModelClient(delay=-1)
    with pytest.raises(ValueError, match="chunks"):
        TestModelClient(chunks=0)


def test_the_test_model_imports_no_network_library() -> None:
    code = (
        "import sys\n"
        "from aimu.aio.client import client\n"
        "client('test')\n"
        "print(sorted(m for m in ('ollama', 'httpx') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        # tuple[int, str, bool] as tools.py writes it (draft 2020-12).
        (
            {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"},
             {"type": "boolean"}], "items": False, "minItems": 3, "maxItems": 3},
            [1, "word", True],
        ),
        ({"type": "array", "prefixItems": [], "items": False, "maxItems": 0}, []),
        # Items beyond the prefix follow "items" up to minItems.
        (
            {"type": "array", "prefixItems": [{"type": "string"}],
             "items": {"type": "integer"}, "minItems": 3},
            ["word", 1, 1],
        ),
        # The older tuple form: "items" as a list.
        ({"type": "array", "items": [{"type": "integer"}, {"type": "null"}]}, [1, None]),
    ],
)
def test_fixed_length_arrays_fill_each_position(schema: dict[str, Any], expected: Any) -> None:
    parameters = {"type": "object", "properties": {"value": schema}, "required": ["value"]}
    assert arguments_for(parameters, "word") == {"value": expected}


async def test_tuple_arguments_from_the_test_model_pass_tool_validation() -> None:
    from aimu.aio.tools import Tool, ToolContext, invoke

    def place(point: tuple[int, float, str]) -> str:
        """Mark a point."""
        return repr(point)

    tool = Tool(place)
    arguments = arguments_for(tool.parameters, "at Lisbon")
    call: Any = {"id": "c1", "type": "function",
                 "function": {"name": "place", "arguments": arguments}}
    ctx = ToolContext(agent="a", call_id="c1", tool_name="place")
    outcome = await invoke({"place": tool}, call, ctx)
    assert outcome.content == "(1, 1.5, 'Lisbon')"
    assert not outcome.is_error


async def test_every_reply_names_its_model_with_one_shared_string() -> None:
    """``aimu_model`` is the client's one ``provider:model`` string, not a copy in each
    assistant message (a long session keeps thousands); a new model gets its own."""
    from aimu import aio

    def lookup(city: str) -> str:
        return f"sun in {city}"

    agent = aio.Agent(aio.client("test"), tools=[lookup])
    await agent.run("weather in Oslo?")
    await agent.run("and again?")
    writers = [m["aimu_model"] for m in agent.model_client.messages  # type: ignore[typeddict-item]
               if m["role"] == "assistant"]
    assert len(writers) >= 3 and set(writers) == {"test:test"}
    assert all(writer is writers[0] for writer in writers)
    agent.model_client.model = "other"
    assert agent.model_client.answered_by == "test:other"
    await agent.aclose()
