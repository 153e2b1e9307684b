"""The Responses provider (``openai-responses:``) over the loopback server: reasoning items
kept and sent back, usage, incomplete and failed responses, typed output, retries, the
key kept secret, background responses (a stop cancels them on the server, a dropped
stream is re-attached, a crashed run's response is re-attached), a cancel and an
interrupt at every event of a run with tool calls, and a session that moves between
wires and back."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from provider_support import RawServer, assert_only_current_task, closed_after_test, http_response
from pydantic import BaseModel

from aimu import aio
from aimu.aio.errors import ModelHTTPError
from aimu.aio.events import RunFinished, TextChunk
from aimu.aio.providers.openai_responses import BackgroundResponse, OpenAIResponsesClient
from aimu.aio.transcript import Message, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer

KEY = "sk-responses-secret-0123456789"
ROOT = Path(__file__).resolve().parents[3]
LONG = " ".join(f"w{n}" for n in range(60))


@pytest.fixture
async def server() -> AsyncIterator[LoopbackServer]:
    async with LoopbackServer() as loopback:
        yield loopback


def make(server: LoopbackServer, **options: Any) -> OpenAIResponsesClient:
    return closed_after_test(OpenAIResponsesClient(
        "gpt-test", base_url=server.openai_base_url, api_key="sk-x", **options
    ))



def lookup(city: str) -> str:
    """Weather for a city."""
    return f"snow in {city}"


async def test_reasoning_items_go_back_unchanged_and_a_cut_turn_keeps_none(
    server: LoopbackServer,
) -> None:
    server.script = [
        Turn(thinking="I should look it up.",
             tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})]),
        Turn(text="Snow.", input_tokens=30, output_tokens=2),
    ]
    async with OpenAIResponsesClient("gpt-5-mini", base_url=server.openai_base_url) as model:
        agent = aio.Agent(model, tools=[lookup], system="Be brief.")
        assert await agent.run("weather?") == "Snow."
        first = model.messages[2]
        assert first["role"] == "assistant"
        assert first["thinking"] == "I should look it up."  # type: ignore[typeddict-item]
        native = first["aimu_native"]  # type: ignore[typeddict-item]
        assert native["wire"] == "openai-responses"
        (item,) = native["reasoning"]
        assert item["type"] == "reasoning" and item["encrypted_content"]
        sent = server.requests[-1].body
        assert sent["instructions"] == "Be brief." and sent["store"] is False
        assert sent["include"] == ["reasoning.encrypted_content"]
        kinds = [i.get("type", i.get("role")) for i in sent["input"]]
        assert kinds == ["user", "reasoning", "function_call", "function_call_output"]
        assert sent["input"][1] == item  # exactly as it came
        assert agent.last_run is not None
        assert agent.last_run.usage["output_tokens"] == 2
    # A model that does not reason is not asked for encrypted reasoning (it would refuse).
    async with make(server) as plain:
        server.script = [Turn(text="hi")]
        await aio.chat(plain, "x")
        assert "include" not in server.requests[-1].body


async def test_usage_incomplete_and_failed_responses(server: LoopbackServer) -> None:
    server.script = [
        Turn(text="one two", input_tokens=11, output_tokens=7),
        Turn(text="cut off here", stop_reason="length"),
        Turn(text="a b c", fault="error_event", fault_after=1),
    ]
    async with make(server, retries=0) as model:  # else asked again (test_broken_streams)
        agent = aio.Agent(model)
        assert await agent.run("x") == "one two"
        assert agent.last_run is not None
        assert agent.last_run.usage == {"input_tokens": 11, "output_tokens": 7}
        await agent.run("y")
        assert agent.last_run.stop_reason == "length"
        assert model.messages[-1]["aimu_stop_reason"] == "length"  # type: ignore[typeddict-item]
        with pytest.raises(ModelHTTPError, match="scripted error_event fault"):
            await agent.run("z")
        assert model.messages[-1].get("aimu_partial") is True
        validate(model.messages)


async def test_typed_output_goes_as_text_format(server: LoopbackServer) -> None:
    class Weather(BaseModel):
        city: str
        temperature: float

    async with make(server) as model:
        value = await aio.Agent(model, output_type=Weather).run("weather in Oslo")
        assert isinstance(value, Weather)
        fmt = server.requests[-1].body["text"]["format"]
        assert fmt["type"] == "json_schema" and fmt["name"] == "Weather"
        assert fmt["schema"]["properties"]["city"] == {"title": "City", "type": "string"}


async def test_a_503_is_retried_then_answered(server: LoopbackServer) -> None:
    server.script = [Turn(fault="http_503", retry_after="0"), Turn(text="fine")]
    async with make(server) as model:
        agent = aio.Agent(model)
        assert await agent.run("x") == "fine"
        assert agent.last_run is not None and agent.last_run.retries == 1


async def test_the_key_never_appears_in_errors_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    echo = json.dumps({"error": {"message": f"Incorrect API key provided: {KEY}"}}).encode()
    response = http_response(echo, status="401 Unauthorized", content_type="application/json")
    async with RawServer(response) as raw, OpenAIResponsesClient(
        "m", base_url=raw.url + "/v1", api_key=KEY
    ) as model:
        with pytest.raises(ModelHTTPError) as caught:
            await aio.chat(model, "x")
        head, _ = raw.requests[0]
    assert "POST /v1/responses" in head
    assert KEY not in str(caught.value) and KEY not in caught.value.body
    assert "check api_key= / OPENAI_API_KEY" in str(caught.value)
    assert KEY not in repr(model) and KEY not in caplog.text


# -- background responses -----------------------------------------------------------------


async def test_a_stop_cancels_the_background_response_on_the_server(
    server: LoopbackServer,
) -> None:
    server.script = [Turn(text=LONG, delay=0.02)]
    async with make(server, background=True) as model:
        agent = aio.Agent(model)
        handle = aio.RunHandle.start(agent.run("go"))
        async for event in handle.events():
            if isinstance(event, TextChunk):
                assert model.in_flight is not None  # what a run keeps to re-attach
                handle.cancel()
                break
        with pytest.raises(asyncio.CancelledError):
            await handle
        (record,) = await server.wait_abandoned(1)
        assert record.path == "/v1/responses" and not record.completed
        (response_id,) = server.background.cancelled  # the server's work stopped
        assert server.background.stored[response_id].status == "cancelled"
        assert server.requests[0].body["background"] is True
        assert server.requests[0].body["store"] is True
        assert server.requests[-1].path == f"/v1/responses/{response_id}/cancel"
        assert model.in_flight is None
        message = model.messages[-1]
        assert message["aimu_partial"] is True  # type: ignore[typeddict-item]
        validate(model.messages)
    await assert_only_current_task()


async def test_a_dropped_background_stream_is_re_attached_not_asked_again(
    server: LoopbackServer,
) -> None:
    server.script = [Turn(text="one two three four five six", fault="drop", fault_after=2,
                          input_tokens=4)]
    async with make(server, background=True) as model:
        agent = aio.Agent(model)
        assert await agent.run("go") == "one two three four five six"
        paths = [(r.method, r.path) for r in server.requests]
        response_id = next(iter(server.background.stored))
        assert paths == [("POST", "/v1/responses"), ("GET", f"/v1/responses/{response_id}")]
        assert server.background.cancelled == []
        assert agent.last_run is not None and agent.last_run.usage["input_tokens"] == 4


async def test_a_crashed_runs_background_response_is_re_attached(
    server: LoopbackServer,
) -> None:
    """A run that died mid-response left its id and last event number; the next turn of
    a new client re-attaches from there instead of asking the model again."""
    server.script = [Turn(text="alpha beta gamma delta", delay=0.01, input_tokens=6)]
    async with httpx.AsyncClient() as http:  # the run that crashed: it only created it
        created = await http.post(
            f"{server.openai_base_url}/responses",
            json={"model": "gpt-test", "input": "go", "background": True, "store": True},
        )
    response_id = created.json()["id"]
    async with make(server, background=True) as model:
        model.messages = [{"role": "user", "content": "go"}]
        model.reattach(BackgroundResponse(response_id, 3))
        agent = aio.Agent(model)
        agent.restore(model.messages)
        assert await agent.resume() == "alpha beta gamma delta"
        get = server.requests[-1]
        assert (get.method, get.path) == ("GET", f"/v1/responses/{response_id}")
        assert len([r for r in server.requests if r.method == "POST"]) == 1  # not asked again
        assert model.messages[-1]["content"] == "alpha beta gamma delta"
    with pytest.raises(ValueError, match="background=True"):
        make(server).reattach(BackgroundResponse(response_id, 0))
    # A response that is gone (expired, deleted): the model is asked again.
    server.script = [Turn(text="asked again")]
    async with make(server, background=True) as model:
        model.reattach(BackgroundResponse("resp_gone", 3))
        messages: list[Message] = []
        async for _ in await aio.chat(model, "go", messages=messages, stream=True):
            pass
        assert messages[-1]["content"] == "asked again"
        assert [(r.method, r.path) for r in server.requests[-2:]] == [
            ("GET", "/v1/responses/resp_gone"), ("POST", "/v1/responses")]


# -- stops at every event, over the wire ------------------------------------------------------


def sweep_turns() -> list[Turn]:
    return [
        Turn(text="looking it up", thinking="hm",
             tool_calls=[ScriptedCall("lookup", {"city": "Oslo"}),
                         ScriptedCall("lookup", {"city": "Rome"})]),
        Turn(text="Snow in Oslo, sun in Rome."),
    ]


@pytest.mark.parametrize("mode", ["cancel", "interrupt"])
async def test_a_stop_at_every_event_leaves_a_transcript_the_api_accepts(mode: str) -> None:
    """Stop after the n-th event of a run with tool calls, for every n: the transcript is
    valid, the Responses endpoint accepts it, a stopped stream was closed, and a cut
    reply is kept marked partial."""
    stops = 0
    for n in range(1, 100):
        async with LoopbackServer(sweep_turns()) as server:
            model = make(server)
            agent = aio.Agent(model, tools=[lookup])
            handle = aio.RunHandle.start(agent.run("weather?"))
            seen = 0
            async for event in handle.events():
                if isinstance(event, RunFinished):
                    break
                seen += 1
                if seen == n:
                    handle.cancel() if mode == "cancel" else handle.interrupt()
                    break
            try:
                result = await handle
            except asyncio.CancelledError:
                result = None
            messages = model.messages
            validate(messages)
            if result == "Snow in Oslo, sun in Rome.":
                break
            stops += 1
            for record in server.streams:
                assert record.completed or record.abandoned
            partial = [m for m in messages if m.get("aimu_partial")]
            assert all(m["role"] == "assistant" and "aimu_native" not in m for m in partial)
            server.script = [Turn(text="ok")]
            follow = aio.Agent(model.fork(), tools=[lookup])
            follow.restore(messages)
            assert await follow.run("continue") == "ok"  # the server accepted it
            await model.aclose()
    assert stops >= 6


# -- one session, several wires ---------------------------------------------------------------


async def test_a_session_moves_from_ollama_to_responses_and_back() -> None:
    """Started on Ollama (a tool round, then a reply cut by a cancel), continued on the
    Responses wire (its reasoning kept as native data), and back on Ollama, which gets
    the Responses turns in its own shape and never the reasoning items."""
    async with LoopbackServer() as server:
        server.script = [
            Turn(tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})]),
            Turn(text=LONG, delay=0.02),
        ]
        ollama = aio.client("ollama:llama", host=server.url)
        first = aio.Agent(ollama, tools=[lookup])
        handle = aio.RunHandle.start(first.run("weather?"))
        async for event in handle.events():
            if isinstance(event, TextChunk):
                handle.cancel()
                break
        with pytest.raises(asyncio.CancelledError):
            await handle
        cut = ollama.messages
        assert cut[-1].get("aimu_partial") is True

        server.script = [Turn(thinking="resuming", text="Snow in Oslo.")]
        responses = make(server)
        second = aio.Agent(responses, tools=[lookup])
        second.restore(cut)
        assert await second.resume() == "Snow in Oslo."
        sent = server.requests[-1].body["input"]
        # The settled call crosses; by default a resume asks again without the cut answer.
        assert [i.get("type", i.get("role")) for i in sent][:3] == [
            "user", "function_call", "function_call_output"]
        moved = responses.messages
        assert moved[-1]["aimu_model"] == "openai-responses:gpt-test"  # type: ignore[typeddict-item]
        assert "aimu_native" in moved[-1]

        server.script = [Turn(text="Still snowing.")]
        back = aio.client("ollama:llama", host=server.url)
        third = aio.Agent(back, tools=[lookup])
        third.restore(moved)
        assert await third.run("and now?") == "Still snowing."
        wire = server.requests[-1].body["messages"]
        assert "reasoning" not in json.dumps(wire) and "encrypted" not in json.dumps(wire)
        assert [m["role"] for m in wire][:3] == ["user", "assistant", "tool"]
        writers = [m.get("aimu_model") for m in back.messages if m["role"] == "assistant"]
        assert writers[-2:] == ["openai-responses:gpt-test", "ollama:llama"]
        validate(back.messages)
        for client in (ollama, responses, back):
            await client.aclose()


CRASHING_RUN = """
import asyncio, sys
from aimu import aio

async def main():
    model = aio.client("openai-responses:gpt-test", base_url=sys.argv[1], api_key="k",
                       background=True)
    agent = aio.Agent(model, store=aio.SQLiteStore(sys.argv[2]), session="s")
    await agent.run("tell me")

asyncio.run(main())
"""


async def test_after_a_kill_9_resume_re_attaches_to_the_background_response(
    tmp_path: Path,
) -> None:
    """A run killed mid-response kept the response's handle in its session's state; a
    new process's resume() streams the rest of that same response: no second request."""
    words = " ".join(f"w{n}" for n in range(40))
    async with LoopbackServer([Turn(text=words, delay=0.02, input_tokens=5)]) as server:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CRASHING_RUN, server.openai_base_url, str(tmp_path / "s.db"),
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            await server.wait_until(
                lambda: bool(server.streams) and server.streams[0].chunks_sent >= 10, 30
            )
        finally:
            child.kill()  # kill -9: no finally of the run's runs, nothing cancelled
            await child.wait()
        (response_id,) = server.background.stored
        assert server.background.cancelled == []
        async with make(server, background=True) as model:
            agent = aio.Agent(model, store=aio.SQLiteStore(tmp_path / "s.db"), session="s")
            assert await agent.resume() == words
            posts = [r for r in server.requests if r.method == "POST"]
            assert len(posts) == 1  # the model was not asked again
            assert server.requests[-1].path == f"/v1/responses/{response_id}"
            assert model.messages[-1]["content"] == words
            await agent.aclose()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_refusal_is_the_answer(stream: bool) -> None:
    done = {"id": "resp_1", "status": "completed", "output": [
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "refusal", "refusal": "I can't help with that."}]}],
            "usage": {"input_tokens": 3, "output_tokens": 6,
                      "input_tokens_details": {"cached_tokens": 2}}}
    if stream:
        events = [
            {"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1"}},
            {"type": "response.refusal.delta", "sequence_number": 1, "item_id": "msg_1",
             "output_index": 0, "content_index": 0, "delta": "I can't help with that."},
            {"type": "response.completed", "sequence_number": 2, "response": done},
        ]
        body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        response = http_response(body, content_type="text/event-stream")
    else:
        response = http_response(json.dumps(done).encode(), content_type="application/json")
    async with RawServer(response) as raw, OpenAIResponsesClient(
        "m", base_url=raw.url + "/v1", api_key="k"
    ) as model:
        messages: list[Message] = []
        if stream:
            reply = await aio.chat(model, "x", messages=messages, stream=True)
            chunks = [chunk async for chunk in reply]
            assert chunks[-1].usage == {  # type: ignore[union-attr]
                "input_tokens": 3, "output_tokens": 6, "cached_input_tokens": 2}
        else:
            await aio.chat(model, "x", messages=messages)
        assert messages[-1]["content"] == "I can't help with that."
