"""Structured output (``output_type=``) and the tool-only request options, over the wire.

The Ollama and OpenAI-compatible clients run against the loopback server, so what is
asserted is what a model server would have received; the embedded test model answers
a requested schema offline.
"""

from __future__ import annotations

import asyncio
import json
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ollama
import pytest
from pydantic import BaseModel, TypeAdapter
from typing_extensions import TypedDict

from aimu import aio
from aimu.aio.events import RunFinished, TextChunk
from aimu.aio.output import CORRECTION_PREFIX, OutputSpec
from aimu.aio.transcript import validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer, requested_schema


class Weather(BaseModel):
    city: str
    temperature: float


@dataclass
class Forecast:
    days: int
    summary: list[str]


class Place(TypedDict):
    city: str
    country: str


GOOD = '{"city": "Oslo", "temperature": 3.5}'
OSLO = Weather(city="Oslo", temperature=3.5)


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def openai(server: LoopbackServer) -> aio.ModelClient:
    return aio.client("openai:m", base_url=server.openai_base_url, api_key="sk-test")


def ollama_client(server: LoopbackServer) -> aio.ModelClient:
    return aio.client("ollama:m", host=server.url)


def gemini(server: LoopbackServer) -> aio.ModelClient:
    return aio.client("gemini:m", base_url=server.gemini_base_url, api_key="AIza-test")


CLIENTS = {"openai": openai, "ollama": ollama_client, "gemini": gemini}


def schema_sent(body: dict[str, Any]) -> Any:
    """The output schema a request carried, in its protocol's field."""
    if "contents" in body:  # Gemini
        config = body["generationConfig"]
        assert config["responseMimeType"] == "application/json"
        return config["responseJsonSchema"]
    if "format" in body:
        return body["format"]
    return body["response_format"]["json_schema"]["schema"]


# -- the test model, in process -------------------------------------------------------------


@pytest.mark.parametrize(
    ("output_type", "expected"),
    [
        (Weather, Weather(city="Paris", temperature=1.5)),
        (Forecast, Forecast(days=1, summary=["Paris"])),
        (Place, {"city": "Paris", "country": "Paris"}),
        (list[int], [1]),
    ],
)
async def test_the_test_model_answers_the_schema(output_type: Any, expected: Any) -> None:
    agent = aio.Agent(aio.client("test"), output_type=output_type)
    assert await agent.run("the weather in Paris") == expected
    assert agent.last_status == "completed"


async def test_tools_first_then_the_structured_answer() -> None:
    agent = aio.Agent(aio.client("test"), [get_weather], output_type=Weather)
    events = [event async for event in agent.run("the weather in Paris", stream=True)]
    final = events[-1]
    assert isinstance(final, RunFinished) and final.status == "completed"
    assert Weather.model_validate_json(final.reply) == Weather(city="Paris", temperature=1.5)
    # The tool turns carry no schema (see test_tools_and_output_on_the_wire): the test
    # model answers the tool round in prose, is corrected, and answers the schema.
    roles = [m["role"] for m in agent.model_client.messages]
    assert roles == ["user", "assistant", "tool", "assistant", "user", "assistant"]


def test_run_sync_and_a_session_return_the_typed_value() -> None:
    agent = aio.Agent(aio.client("test"), output_type=Weather)
    assert agent.run_sync("weather in Rome") == Weather(city="Rome", temperature=1.5)
    session = agent.start()
    assert session.run_sync("weather in Lima") == Weather(city="Lima", temperature=1.5)


async def test_a_handle_over_a_typed_run_gives_the_value() -> None:
    agent = aio.Agent(aio.client("test"), output_type=Weather)
    handle = aio.RunHandle.start(agent.run("weather in Bern"))
    assert await handle == Weather(city="Bern", temperature=1.5)
    assert handle.status == "completed"


def test_bad_output_types_and_options_are_refused() -> None:
    model = aio.client("test")
    with pytest.raises(TypeError, match="output_type"):
        aio.Agent(model, output_type=object())
    with pytest.raises(ValueError, match="output_retries"):
        aio.Agent(model, output_type=Weather, output_retries=-1)
    with pytest.raises(ValueError, match="tool_choice must be one of auto, required, none"):
        aio.Agent(model, [get_weather], tool_choice="get_wether")


class StdPlace(typing.TypedDict):
    """A place (typing's TypedDict, which pydantic refuses before Python 3.12)."""

    city: str
    country: typing.NotRequired[str]


class StdTrip(typing.TypedDict, total=False):
    stops: list[StdPlace]
    note: typing.Annotated[str | None, "free text"]


def test_typing_typeddict_works_as_output_type() -> None:
    """Issue 21 item 25: on Python 3.11 ``typing.TypedDict`` was refused."""
    spec = OutputSpec(StdPlace, 0)
    assert spec.schema["required"] == ["city"] and spec.name == "StdPlace"
    assert spec.schema["description"].startswith("A place")
    assert spec.parse('{"city": "Oslo"}') == {"city": "Oslo"}
    with pytest.raises(ValueError, match="city: Field required"):
        spec.parse('{"country": "NO"}')
    trip = OutputSpec(list[StdTrip] | None, 0)
    assert trip.parse('[{"stops": [{"city": "Oslo", "country": "NO"}], "note": null}]') == [
        {"stops": [{"city": "Oslo", "country": "NO"}], "note": None}
    ]
    with pytest.raises(ValueError, match="city"):
        trip.parse('[{"stops": [{"country": "NO"}]}]')


async def test_an_agent_answers_a_typing_typeddict() -> None:
    agent = aio.Agent(aio.client("test"), output_type=StdPlace)
    assert await agent.run("the weather in Paris") == {"city": "Paris"}  # only the required


# -- over the wire ----------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["ollama", "openai", "gemini"])
async def test_the_request_carries_the_schema(protocol: str) -> None:
    async with LoopbackServer() as server, CLIENTS[protocol](server) as model:
        agent = aio.Agent(model, output_type=Weather)
        assert await agent.run("weather in Oslo") == Weather(city="Oslo", temperature=1.5)
        body = server.requests[-1].body
        assert schema_sent(body) == TypeAdapter(Weather).json_schema()
        if protocol == "openai":
            assert body["response_format"]["type"] == "json_schema"
            assert body["response_format"]["json_schema"]["name"] == "Weather"
            assert body["response_format"]["json_schema"]["strict"] is False


async def test_a_text_agent_asks_for_no_schema() -> None:
    async with LoopbackServer() as server, openai(server) as model:
        assert await aio.Agent(model).run("hello") == "You said: hello"
        assert "response_format" not in server.requests[-1].body


async def test_the_official_ollama_client_gets_json_of_its_format() -> None:
    # The loopback server's test model honours `format` for any client that sends it.
    schema = TypeAdapter(Weather).json_schema()
    async with LoopbackServer() as server, ollama.AsyncClient(host=server.url) as client:
        reply = await client.chat(
            model="test", messages=[{"role": "user", "content": "Oslo?"}], format=schema
        )
        assert Weather.model_validate_json(reply.message.content or "") == Weather(
            city="Oslo", temperature=1.5
        )
        assert server.requests[-1].body["format"] == schema


@pytest.mark.parametrize(
    ("body", "schema"),
    [
        ({"format": {"type": "integer"}}, {"type": "integer"}),
        ({"format": "json"}, {}),
        ({"response_format": {"type": "json_object"}}, {}),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "null"}},
                }
            },
            {"type": "null"},
        ),
        ({"response_format": {"type": "text"}}, None),
        ({}, None),
    ],
)
def test_the_loopback_server_reads_the_schema_of_either_protocol(
    body: dict[str, Any], schema: dict[str, Any] | None
) -> None:
    assert requested_schema(body) == schema


@pytest.mark.parametrize("protocol", ["ollama", "openai", "gemini"])
async def test_invalid_answers_are_corrected_a_bounded_number_of_times(protocol: str) -> None:
    script = [Turn(text="It is cold."), Turn(text='{"city": "Oslo"}'), Turn(text=GOOD)]
    async with LoopbackServer(script) as server, CLIENTS[protocol](server) as model:
        agent = aio.Agent(model, output_type=Weather, output_retries=2)
        assert await agent.run("weather in Oslo") == OSLO
        corrections = [
            m["content"]
            for m in agent.model_client.messages
            if m["role"] == "user" and m["content"].startswith(CORRECTION_PREFIX)
        ]
        assert len(corrections) == 2
        assert "Invalid JSON" in corrections[0]
        assert "temperature: Field required" in corrections[1]
        # Each correction went to the model, with the schema asked for again.
        assert server.requests[2].messages[-1]["content"] == corrections[1]
        assert all(schema_sent(r.body) for r in server.requests)


async def test_a_fenced_answer_is_accepted() -> None:
    async with (
        LoopbackServer([Turn(text=f"```json\n{GOOD}\n```")]) as server,
        openai(server) as model,
    ):
        assert await aio.Agent(model, output_type=Weather).run("weather") == OSLO


async def test_corrections_used_up_raise_and_the_transcript_stays_resumable() -> None:
    long_bad = "no " * 2000
    script = [Turn(text=long_bad, chunks=1)] * 2
    async with LoopbackServer(script) as server, openai(server) as model:
        agent = aio.Agent(model, output_type=Weather, output_retries=1)
        with pytest.raises(
            aio.OutputValidationError, match="not a valid Weather after 2"
        ) as caught:
            await agent.run("weather in Oslo")
        assert caught.value.problem.startswith("Invalid JSON")
        assert len(str(caught.value)) < 600 and len(caught.value.text) <= 300
        assert isinstance(caught.value, aio.OutputError) and isinstance(caught.value, ValueError)
        assert agent.last_status == "failed"
        messages = agent.model_client.messages
        validate(messages)
        assert messages[-1]["role"] == "user"
        assert messages[-1]["content"].startswith(CORRECTION_PREFIX)
        server.script = [Turn(text=GOOD)]
        assert await agent.resume() == OSLO  # a fresh budget of corrections
        assert json.dumps(server.requests[-1].body).count("weather in Oslo") == 1


def carries_schema(body: Mapping[str, Any]) -> bool:
    config = body.get("generationConfig") or {}
    return "format" in body or "response_format" in body or "responseJsonSchema" in config


@pytest.mark.parametrize("protocol", ["ollama", "openai", "gemini"])
async def test_tools_and_output_on_the_wire(protocol: str) -> None:
    """Issue 21 item 20: a request with tools never carries the output schema (llama.cpp
    then builds only the answer's grammar and drops tool calls); the turn that must
    answer (after a correction, or the last one) carries it, without tools."""
    script = [
        Turn(tool_calls=[ScriptedCall("get_weather", {"city": "Oslo"})]),
        Turn(text=GOOD),
    ]
    async with LoopbackServer(script) as server, CLIENTS[protocol](server) as model:
        # output_retries=0: the prose answer below, given without the schema, costs none.
        agent = aio.Agent(model, [get_weather], output_type=Weather, output_retries=0)
        assert await agent.run("weather in Oslo") == OSLO
        first, second = (r.body for r in server.requests)
        assert first["tools"] and second["tools"]
        assert not carries_schema(first) and not carries_schema(second)
        # A prose answer on a tool turn is corrected; the correction's turn must answer.
        server.script = [Turn(text="It is sunny."), Turn(text=GOOD)]
        assert await agent.run("and now?") == OSLO
        prose, answer = (r.body for r in server.requests[2:])
        assert prose["tools"] and not carries_schema(prose)
        assert "tools" not in answer and schema_sent(answer) == TypeAdapter(Weather).json_schema()
        last = server.requests[-1].messages[-1]  # in the chat shape, whatever the wire
        assert last["content"].startswith(CORRECTION_PREFIX)


async def test_the_last_turn_without_tools_still_answers_the_schema() -> None:
    async with LoopbackServer() as server, ollama_client(server) as model:
        agent = aio.Agent(model, [get_weather], output_type=Weather, max_rounds=1)
        assert isinstance(await agent.run("weather in Oslo"), Weather)
        last = server.requests[-1].body
        assert "tools" not in last and schema_sent(last)


async def test_a_workflow_passes_the_answer_json_on() -> None:
    typed = aio.Agent(aio.client("test"), output_type=Weather, name="typed")
    text = aio.Agent(aio.client("test"), name="text")
    reply = await aio.Chain([typed, text]).run("weather in Oslo")
    assert reply == 'You said: {"city": "Oslo", "temperature": 1.5}'


# -- stops during an output turn ------------------------------------------------------------


def slow_answer(text: str = GOOD) -> Turn:
    return Turn(text=text, chunks=6, delay=0.02)


@pytest.mark.parametrize("where", ["before_reply", "mid_reply", "after_correction"])
async def test_a_cancel_during_an_output_turn_keeps_a_resumable_transcript(where: str) -> None:
    script = {
        "before_reply": [Turn(text=GOOD, first_byte_delay=30)],
        "mid_reply": [Turn(text=GOOD, chunks=6, fault="hang", fault_after=2)],
        "after_correction": [Turn(text="nope"), Turn(text=GOOD, first_byte_delay=30)],
    }[where]
    async with LoopbackServer(script) as server, openai(server) as model:
        agent = aio.Agent(model, output_type=Weather)
        handle = aio.RunHandle.start(agent.run("weather in Oslo"))
        if where == "mid_reply":
            async for event in handle.events():
                if isinstance(event, TextChunk):
                    break
        else:
            await server.wait_requests(2 if where == "after_correction" else 1)
        assert handle.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handle
        assert handle.status == "cancelled" and agent.last_status == "cancelled"
        messages = agent.model_client.messages
        validate(messages)
        last = messages[-1]
        if where == "mid_reply":
            assert last["role"] == "assistant" and last.get("aimu_partial") is True
            assert GOOD.startswith(last["content"]) and last["content"] != GOOD
        elif where == "after_correction":
            assert last["content"].startswith(CORRECTION_PREFIX)
        await server.wait_abandoned(1)
        server.script = [Turn(text=GOOD)]
        assert await agent.resume() == OSLO


async def test_a_deadline_mid_answer_keeps_the_partial_answer() -> None:
    # Two chunks, then the server goes silent: the deadline can only land mid-answer.
    script = [Turn(text=GOOD, chunks=6, fault="hang", fault_after=2)]
    async with LoopbackServer(script) as server, openai(server) as model:
        agent = aio.Agent(model, output_type=Weather)
        handle = aio.RunHandle.start(agent.run("weather in Oslo"), timeout=1.0)
        chunks = [e async for e in handle.events() if isinstance(e, TextChunk)]
        with pytest.raises(TimeoutError):
            await handle
        assert handle.status == "timed_out" and len(chunks) == 2
        last = agent.model_client.messages[-1]
        assert last.get("aimu_partial") is True
        assert last["content"] == "".join(c.text for c in chunks)
        validate(agent.model_client.messages)
        server.script = [Turn(text=GOOD)]
        assert await agent.resume() == OSLO


async def test_an_interrupt_during_the_answer_turn_returns_the_value() -> None:
    async with LoopbackServer([slow_answer()]) as server, openai(server) as model:
        agent = aio.Agent(model, output_type=Weather)
        async for event in agent.run("weather in Oslo", stream=True):
            if isinstance(event, TextChunk) and not agent.interrupt_requested:
                assert agent.interrupt()  # the run waits at this chunk's yield
        # The step in flight was the answer: it finishes and the run has its output.
        assert isinstance(event, RunFinished) and event.status == "completed"
        assert await agent.resume() == OSLO  # a finished run gives its answer at once
        assert len(server.requests) == 1


async def test_an_interrupt_during_an_invalid_answer_stops_before_the_retry() -> None:
    async with LoopbackServer([slow_answer("not json at all")]) as server, openai(server) as model:
        agent = aio.Agent(model, output_type=Weather)
        async for event in agent.run("weather in Oslo", stream=True):
            if isinstance(event, TextChunk) and not agent.interrupt_requested:
                assert agent.interrupt()
        assert isinstance(event, RunFinished) and event.status == "interrupted"
        messages = agent.model_client.messages
        validate(messages)
        # The step finished: the answer and its correction are recorded, not yet sent.
        assert messages[-1]["content"].startswith(CORRECTION_PREFIX)
        assert len(server.requests) == 1
        server.script = [Turn(text=GOOD)]
        assert await agent.resume() == OSLO
        assert server.requests[-1].body["messages"][-1]["content"].startswith(CORRECTION_PREFIX)


async def test_a_handle_over_a_typed_run_interrupted_before_its_answer() -> None:
    gate = asyncio.Event()

    async def slow_weather(city: str) -> str:
        """The weather, once the test lets it through."""
        await gate.wait()
        return f"rain in {city}"

    agent = aio.Agent(aio.client("test"), [slow_weather], output_type=Weather)
    handle = aio.RunHandle.start(agent.run("weather in Oslo"))
    async for event in handle.events():
        if event.type == "tool_call":  # the tool round is in flight
            assert handle.interrupt()
            gate.set()
        last = event
    # The run stopped at the boundary after the tool round: interrupted, with no value.
    assert handle.status == "interrupted"
    assert last.type == "handle_finished" and last.status == "interrupted"
    assert last.error is not None and "NoOutputError" in last.error
    with pytest.raises(aio.NoOutputError):
        await handle
    assert isinstance(handle.exception(), aio.NoOutputError)
    assert await agent.resume() == Weather(city="Oslo", temperature=1.5)


# -- tool-only request options ---------------------------------------------------------------


async def test_tool_options_go_with_tools_and_required_is_reset_after_a_round() -> None:
    async with LoopbackServer() as server, openai(server) as model:
        agent = aio.Agent(model, [get_weather], tool_choice="required", parallel_tool_calls=False)
        assert await agent.run("weather in Oslo") == "I called get_weather: sunny in Oslo."
        first, second = (r.body for r in server.requests)
        assert first["tool_choice"] == "required" and first["parallel_tool_calls"] is False
        # After a tool round the model may answer: "required" is not sent again.
        assert "tool_choice" not in second and second["parallel_tool_calls"] is False


async def test_tool_options_are_not_sent_when_tools_are_withheld() -> None:
    async with LoopbackServer() as server, openai(server) as model:
        agent = aio.Agent(
            model, [get_weather], tool_choice="auto", parallel_tool_calls=True, max_rounds=1
        )
        await agent.run("weather in Oslo")
        first, last = server.requests[0].body, server.requests[-1].body
        assert first["tool_choice"] == "auto" and first["parallel_tool_calls"] is True
        assert not {"tools", "tool_choice", "parallel_tool_calls"} & set(last)
        await aio.Agent(model.fork(), tool_choice="none", parallel_tool_calls=True).run("hi")
        assert not {"tools", "tool_choice", "parallel_tool_calls"} & set(server.requests[-1].body)


async def test_a_named_tool_choice_and_none() -> None:
    def get_time(city: str) -> str:
        """The time in a city."""
        return "noon"

    async with LoopbackServer() as server, openai(server) as model:
        agent = aio.Agent(model, [get_weather, get_time], tool_choice="get_time")
        assert await agent.run("time in Oslo") == "I called get_time: noon."
        assert [m["name"] for m in agent.model_client.messages if m["role"] == "tool"] == [
            "get_time"
        ]
        assert server.requests[0].body["tool_choice"] == {
            "type": "function",
            "function": {"name": "get_time"},
        }
        quiet = aio.Agent(model.fork(), [get_weather], tool_choice="none")
        assert await quiet.run("weather in Oslo") == "You said: weather in Oslo"
        assert server.requests[-1].body["tool_choice"] == "none"


async def test_the_test_model_in_process_honours_tool_choice() -> None:
    def get_time(city: str) -> str:
        """The time in a city."""
        return "noon"

    named = aio.Agent(aio.client("test"), [get_weather, get_time], tool_choice="get_time")
    assert await named.run("time in Oslo") == "I called get_time: noon."
    none = aio.Agent(aio.client("test"), [get_weather], tool_choice="none", output_type=Weather)
    assert await none.run("weather in Oslo") == Weather(city="Oslo", temperature=1.5)
    assert [m["role"] for m in none.model_client.messages] == ["user", "assistant"]


async def test_ollama_gets_no_tool_options() -> None:
    async with LoopbackServer() as server, ollama_client(server) as model:
        agent = aio.Agent(model, [get_weather], tool_choice="required", parallel_tool_calls=False)
        await agent.run("weather in Oslo")
        for request in server.requests:
            assert not {"tool_choice", "parallel_tool_calls"} & set(request.body)


# -- a stop at every await point of a typed run, with a store ---------------------------------


def typed_script(request: Mapping[str, Any]) -> Turn:
    """Calls the tool, then answers badly once, then well: whatever the transcript holds."""
    asked = request.get("request")
    schema = None if asked is None else asked.output_schema
    assert schema == (None if request["tools"] else TypeAdapter(Weather).json_schema())
    messages = request["messages"]
    if request["tools"] and not any(m["role"] == "tool" for m in messages):
        return Turn(tool_calls=[ScriptedCall("get_weather", {"city": "Oslo"})])
    if not any(m["role"] == "user" and CORRECTION_PREFIX in m["content"] for m in messages):
        return Turn(text="not json at all", chunks=3)
    return Turn(text=GOOD, chunks=4)


def typed_agent(model: aio.ModelClient, store: aio.Store) -> aio.Agent[Weather]:
    return aio.Agent(model, [get_weather], output_type=Weather, store=store, session="s")


async def events_of_a_whole_run(tmp_path: Path) -> int:
    async with aio.SQLiteStore(tmp_path / "count.db") as store:
        agent = typed_agent(ScriptedModel(typed_script), store)
        count = len([event async for event in agent.run("weather in Oslo", stream=True)])
        await agent.aclose()
    return count


async def test_a_cancel_at_every_event_of_a_typed_run_resumes_in_a_new_agent(
    tmp_path: Path,
) -> None:
    total = await events_of_a_whole_run(tmp_path)
    assert total >= 12  # started, the tool round, two answers in chunks, finished
    for stop_at in range(1, total):
        model = ScriptedModel(typed_script)
        async with aio.SQLiteStore(tmp_path / f"{stop_at}.db") as store:
            agent = typed_agent(model, store)

            async def consume(agent: aio.Agent[Weather] = agent, stop_at: int = stop_at) -> None:
                seen = 0
                async for _ in agent.run("weather in Oslo", stream=True):
                    seen += 1
                    if seen == stop_at:  # the run waits at this event's yield
                        current = asyncio.current_task()
                        assert current is not None
                        current.cancel()

            with pytest.raises(asyncio.CancelledError):
                await asyncio.ensure_future(consume())
            # The last chunk's turn ends, is recorded and answered without a suspension:
            # a cancel asked for there finds no await left in the run.
            expected = "cancelled" if stop_at < total - 2 else agent.last_status
            assert agent.last_status == expected, stop_at
            validate(agent.model_client.messages)
            await agent.aclose()
            fresh = typed_agent(model.fork(), store)
            assert await fresh.resume() == OSLO, stop_at
            validate(fresh.model_client.messages)
            await fresh.aclose()


async def test_an_interrupt_at_every_event_of_a_typed_run_then_resume(tmp_path: Path) -> None:
    total = await events_of_a_whole_run(tmp_path)
    for stop_at in range(1, total):
        async with aio.SQLiteStore(tmp_path / f"{stop_at}.db") as store:
            agent = typed_agent(ScriptedModel(typed_script), store)
            events: list[Any] = []
            async for event in agent.run("weather in Oslo", stream=True):
                events.append(event)
                if len(events) == stop_at:
                    agent.interrupt()
            event = events[-1]
            assert isinstance(event, RunFinished)
            assert event.status in ("completed", "interrupted"), stop_at
            validate(agent.model_client.messages)
            if event.status == "completed":
                assert Weather.model_validate_json(event.reply) == OSLO
            else:
                assert await agent.resume() == OSLO, stop_at
            await agent.aclose()


# -- resuming an answer: cut off, or not a valid typed answer ---------------------------------


@pytest.mark.parametrize("protocol", ["ollama", "openai"])
async def test_resuming_a_cut_off_answer_says_incomplete(protocol: str, tmp_path: Path) -> None:
    """The stop reason is kept with the answer, so a resumed run (another agent, another
    process) does not take a cut-off answer as completed; it never goes on the wire."""
    async with (
        LoopbackServer([Turn(text="half an", stop_reason="length"), Turn(text="more")]) as server,
        aio.SQLiteStore(tmp_path / "s.db") as store,
    ):
        agent = aio.Agent(CLIENTS[protocol](server), store=store, session="s")
        assert await agent.run("write") == "half an" and agent.last_status == "incomplete"
        await agent.aclose()
        again = aio.Agent(CLIENTS[protocol](server), store=store, session="s")
        assert await again.resume() == "half an"
        assert again.last_status == "incomplete"
        assert again.last_run is not None and again.last_run.stop_reason == "length"
        assert await again.run("go on") == "more"
        sent = server.requests[-1].body["messages"]
        assert sent[1] == {"role": "assistant", "content": "half an"}  # no aimu_ key on the wire
        await again.aclose()
        await agent.model_client.aclose()


async def test_resuming_a_transcript_ending_in_an_invalid_typed_answer_asks_again() -> None:
    async with LoopbackServer([Turn(text=GOOD)]) as server, openai(server) as model:
        agent = aio.Agent(model, output_type=Weather, output_retries=0)
        agent.restore([{"role": "user", "content": "weather in Oslo"},
                       {"role": "assistant", "content": "It is cold."}])
        assert await agent.resume() == OSLO  # it raised OutputValidationError
        (request,) = server.requests
        assert request.body["messages"][-1]["content"].startswith(CORRECTION_PREFIX)
        assert schema_sent(request.body) == TypeAdapter(Weather).json_schema()
