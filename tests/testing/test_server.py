"""The loopback protocol server, driven over real sockets by raw httpx (and the ollama client)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

import httpx
import ollama
import pytest

from aimu import aio
from aimu.aio._sse import SSEParser
from aimu.testing.script import Script, ScriptedCall, Turn
from aimu.testing.server import LoopbackServer, StreamRecord

CHAT = {"ollama": "/api/chat", "openai": "/v1/chat/completions"}
PROTOCOLS = ["ollama", "openai"]


async def no_other_tasks() -> None:
    """Assert that only the test's task is left.

    httpx nests async generators that the loop finalizes one per turn after a stream
    is closed early; those get a few turns. A task the server left behind stays.
    """
    others: set[asyncio.Task[Any]] = set()
    for _ in range(50):
        gc.collect()
        others = {task for task in asyncio.all_tasks() if task is not asyncio.current_task()}
        if not others:
            break
        await asyncio.sleep(0)
    assert not others


@contextlib.asynccontextmanager
async def serving(script: Script | None = None) -> AsyncIterator[LoopbackServer]:
    """A started server; after it stops, no task of it may be left."""
    async with LoopbackServer(script) as server:
        yield server
    await no_other_tasks()


def chat_url(server: LoopbackServer, protocol: str) -> str:
    return server.url + CHAT[protocol]


def body(protocol: str, *, stream: bool, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "hello"}]
    return {"model": "m", "messages": messages, "stream": stream, **extra}


def ndjson(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line]


def sse(text: str) -> list[Any]:
    """The data of each SSE event: parsed JSON, or the literal "[DONE]"."""
    parser = SSEParser()
    found = [parser.feed(line) for line in text.splitlines()] + [parser.flush()]
    datas = [event.data for event in found if event is not None]
    return [data if data == "[DONE]" else json.loads(data) for data in datas]


def content_deltas(events: list[Any]) -> list[str]:
    return [
        e["choices"][0]["delta"]["content"]
        for e in events
        if e != "[DONE]" and e["choices"] and "content" in e["choices"][0]["delta"]
    ]


async def first_line_then_close(
    http: httpx.AsyncClient, url: str, payload: dict[str, Any]
) -> str:
    """Read one line of a streamed reply, then close the response (and so the connection)."""
    async with (
        http.stream("POST", url, json=payload) as response,
        contextlib.aclosing(cast(AsyncGenerator[str, None], response.aiter_lines())) as lines,
    ):
        return await anext(lines)


# -- plain and streamed replies ---------------------------------------------------------


async def test_ollama_streams_ndjson_by_default() -> None:
    turn = Turn("one two three", input_tokens=7)
    async with serving([turn]) as server, httpx.AsyncClient() as http:
        payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        response = await http.post(chat_url(server, "ollama"), json=payload)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/x-ndjson"
    assert response.headers["transfer-encoding"] == "chunked"
    lines = ndjson(response.text)
    assert [line["message"]["content"] for line in lines[:-1]] == ["one ", "two ", "three"]
    assert not any(line["done"] for line in lines[:-1])
    assert all(line["model"] == "m" and line["message"]["role"] == "assistant" for line in lines)
    last = lines[-1]
    assert (last["done"], last["done_reason"]) == (True, "stop")
    assert (last["prompt_eval_count"], last["eval_count"]) == (7, 3)
    (record,) = server.streams
    assert (record.protocol, record.path, record.streamed) == ("ollama", "/api/chat", True)
    assert record.completed and not record.abandoned and record.abandoned_at is None
    assert record.chunks_sent == 4
    assert record.finished_at is not None and record.finished_at >= record.started_at


async def test_ollama_non_stream_is_one_object() -> None:
    turn = Turn("one two three", input_tokens=2, output_tokens=9)
    async with serving([turn]) as server, httpx.AsyncClient() as http:
        response = await http.post(chat_url(server, "ollama"), json=body("ollama", stream=False))
    reply = response.json()
    assert response.headers["content-type"] == "application/json"
    assert reply["message"] == {"role": "assistant", "content": "one two three"}
    assert reply["done"] is True and reply["done_reason"] == "stop"
    assert (reply["prompt_eval_count"], reply["eval_count"]) == (2, 9)
    assert server.streams[0].completed and not server.streams[0].streamed


async def test_openai_streams_sse_with_usage_when_asked() -> None:
    turn = Turn("abcdef", chunks=3, input_tokens=4)
    async with serving([turn, turn]) as server, httpx.AsyncClient() as http:
        asked = body("openai", stream=True, stream_options={"include_usage": True})
        with_usage = await http.post(chat_url(server, "openai"), json=asked)
        without = await http.post(chat_url(server, "openai"), json=body("openai", stream=True))
    assert with_usage.headers["content-type"] == "text/event-stream"
    events = sse(with_usage.text)
    assert content_deltas(events) == ["ab", "cd", "ef"]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[-1] == "[DONE]"
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["choices"] == []
    assert events[-2]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    plain = sse(without.text)
    assert plain[-1] == "[DONE]" and not any("usage" in e for e in plain[:-1])
    assert [r.completed for r in server.streams] == [True, True]


async def test_openai_non_stream_always_carries_usage() -> None:
    async with serving([Turn("hi there")]) as server, httpx.AsyncClient() as http:
        response = await http.post(chat_url(server, "openai"), json=body("openai", stream=False))
    reply = response.json()
    assert reply["object"] == "chat.completion"
    (choice,) = reply["choices"]
    assert choice["message"] == {"role": "assistant", "content": "hi there"}
    assert choice["finish_reason"] == "stop"
    assert reply["usage"] == {"prompt_tokens": 0, "completion_tokens": 2, "total_tokens": 2}


async def test_openai_stream_is_off_unless_asked() -> None:
    async with serving([Turn("hi")]) as server, httpx.AsyncClient() as http:
        payload = {"model": "m", "messages": []}
        response = await http.post(chat_url(server, "openai"), json=payload)
    assert response.json()["choices"][0]["message"]["content"] == "hi"
    assert not server.streams[0].streamed


# -- tool calls and thinking ------------------------------------------------------------

CALLS = (ScriptedCall("add", {"a": 1, "b": 2}), ScriptedCall("lookup", {"q": "x" * 40}, id="abc"))


async def test_ollama_tool_calls_in_one_chunk_with_ids_only_when_given() -> None:
    script = [Turn(tool_calls=CALLS), Turn(tool_calls=CALLS)]
    async with serving(script) as server, httpx.AsyncClient() as http:
        url = chat_url(server, "ollama")
        streamed = ndjson((await http.post(url, json=body("ollama", stream=True))).text)
        whole = (await http.post(url, json=body("ollama", stream=False))).json()
    expected = [
        {"function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
        {"function": {"name": "lookup", "arguments": {"q": "x" * 40}}, "id": "abc"},
    ]
    with_calls = [line for line in streamed if "tool_calls" in line["message"]]
    assert len(with_calls) == 1 and with_calls[0]["message"]["tool_calls"] == expected
    assert streamed[-1]["done"] is True
    assert whole["message"]["tool_calls"] == expected


async def test_openai_streamed_tool_calls_arrive_as_fragments_by_index() -> None:
    script = [Turn("ok", tool_calls=CALLS), Turn(tool_calls=CALLS[:1])]
    async with serving(script) as server, httpx.AsyncClient() as http:
        url = chat_url(server, "openai")
        first = sse((await http.post(url, json=body("openai", stream=True))).text)
        second = sse((await http.post(url, json=body("openai", stream=True))).text)
    deltas = [
        delta
        for event in first[:-1]
        for delta in event["choices"][0]["delta"].get("tool_calls", [])
    ]
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"fragments": []})
        if "id" in delta:
            call.update(id=delta["id"], name=delta["function"]["name"], type=delta["type"])
        call["fragments"].append(delta["function"]["arguments"])
    assert sorted(calls) == [0, 1]
    for index, scripted in enumerate(CALLS):
        assert calls[index]["name"] == scripted.name and calls[index]["type"] == "function"
        assert len(calls[index]["fragments"]) >= 2
        assert json.loads("".join(calls[index]["fragments"])) == scripted.arguments
    assert calls[1]["id"] == "abc"
    generated = calls[0]["id"]
    assert re.fullmatch(r"call_\d+", generated)
    assert first[-2]["choices"][0]["finish_reason"] == "tool_calls"
    (second_id,) = [
        d["id"] for e in second[:-1] for d in e["choices"][0]["delta"].get("tool_calls", [])
        if "id" in d
    ]
    assert second_id != generated  # generated ids never repeat across turns


async def test_openai_non_stream_tool_calls_carry_json_strings() -> None:
    async with serving([Turn(tool_calls=CALLS)]) as server, httpx.AsyncClient() as http:
        response = await http.post(chat_url(server, "openai"), json=body("openai", stream=False))
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [c.arguments for c in CALLS]
    assert calls[1]["id"] == "abc" and calls[0]["id"].startswith("call_")


async def test_thinking_goes_to_its_own_field() -> None:
    turn = Turn("answer", thinking="let me think")
    async with serving([turn] * 4) as server, httpx.AsyncClient() as http:
        o_url, a_url = chat_url(server, "ollama"), chat_url(server, "openai")
        o_stream = ndjson((await http.post(o_url, json=body("ollama", stream=True))).text)
        o_whole = (await http.post(o_url, json=body("ollama", stream=False))).json()
        a_stream = sse((await http.post(a_url, json=body("openai", stream=True))).text)
        a_whole = (await http.post(a_url, json=body("openai", stream=False))).json()
    thinking_line = {"role": "assistant", "content": "", "thinking": "let me think"}
    assert o_stream[0]["message"] == thinking_line
    assert "".join(line["message"]["content"] for line in o_stream) == "answer"
    assert o_whole["message"]["thinking"] == "let me think"
    assert o_whole["message"]["content"] == "answer"
    assert a_stream[0]["choices"][0]["delta"]["reasoning_content"] == "let me think"
    assert "".join(content_deltas(a_stream)) == "answer"
    assert a_whole["choices"][0]["message"]["reasoning_content"] == "let me think"


async def test_official_ollama_client_reads_the_stream() -> None:
    turn = Turn("two words", thinking="hmm", tool_calls=CALLS[:1])
    async with serving([turn]) as server, ollama.AsyncClient(host=server.url) as client:
        parts = [part async for part in await client.chat("m", messages=[], stream=True)]
    assert "".join(p.message.content or "" for p in parts) == "two words"
    assert "".join(p.message.thinking or "" for p in parts) == "hmm"
    calls = [c for p in parts for c in p.message.tool_calls or ()]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("add", CALLS[0].arguments)
    ]
    assert parts[-1].done and parts[-1].done_reason == "stop"


# -- faults ---------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(("fault", "status"), [("http_500", 500), ("http_429", 429)])
async def test_http_faults_answer_an_error_body_per_protocol(
    protocol: str, fault: Any, status: int
) -> None:
    async with serving([Turn("never", fault=fault)]) as server, httpx.AsyncClient() as http:
        response = await http.post(chat_url(server, protocol), json=body(protocol, stream=True))
    assert response.status_code == status
    error = response.json()["error"]
    message = error if protocol == "ollama" else error["message"]
    assert isinstance(message, str) and fault in message
    assert "never" not in response.text
    assert not server.streams[0].completed


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_bad_json_comes_after_the_good_chunks(protocol: str) -> None:
    turn = Turn("a b c d", fault="bad_json", fault_after=2)
    async with serving([turn]) as server, httpx.AsyncClient() as http:
        response = await http.post(chat_url(server, protocol), json=body(protocol, stream=True))
    lines = [line for line in response.text.splitlines() if line]
    assert len(lines) == 3
    for line in lines[:2]:
        json.loads(line.removeprefix("data: "))
    with pytest.raises(json.JSONDecodeError):
        json.loads(lines[2].removeprefix("data: "))
    (record,) = server.streams
    assert record.chunks_sent == 3 and not record.completed and not record.abandoned


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_drop_closes_the_connection_mid_stream(protocol: str) -> None:
    turn = Turn("a b c d", fault="drop", fault_after=2)
    received: list[str] = []
    async with serving([turn]) as server, httpx.AsyncClient() as http:
        with pytest.raises(httpx.RemoteProtocolError):
            url, payload = chat_url(server, protocol), body(protocol, stream=True)
            async with http.stream("POST", url, json=payload) as response:
                async for line in response.aiter_lines():
                    if line:
                        received.append(line)
    assert len(received) == 2
    (record,) = server.streams
    assert record.chunks_sent == 2 and not record.completed and not record.abandoned
    assert record.finished_at is not None


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_no_done_ends_the_body_without_the_marker(protocol: str) -> None:
    turn = Turn("a b c", fault="no_done")
    async with serving([turn, Turn("next")]) as server, httpx.AsyncClient() as http:
        url = chat_url(server, protocol)
        response = await http.post(url, json=body(protocol, stream=True))
        follow_up = await http.post(url, json=body(protocol, stream=False))
    if protocol == "ollama":
        lines = ndjson(response.text)
        assert len(lines) == 3 and not any(line["done"] for line in lines)
    else:
        events = sse(response.text)
        assert len(content_deltas(events)) == 3 and "[DONE]" not in events
        assert all(e["choices"][0]["finish_reason"] is None for e in events)
    assert not server.streams[0].completed and not server.streams[0].abandoned
    # The body itself ended properly, so the connection stays usable.
    assert follow_up.status_code == 200
    assert server.requests[0].connection == server.requests[1].connection


async def test_faults_in_non_stream_replies() -> None:
    script = [
        Turn("x", fault="bad_json"),
        Turn("x", fault="no_done"),
        Turn("x", fault="drop"),
    ]
    async with serving(script) as server, httpx.AsyncClient() as http:
        url = chat_url(server, "ollama")
        bad = await http.post(url, json=body("ollama", stream=False))
        unfinished = await http.post(url, json=body("ollama", stream=False))
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post(url, json=body("ollama", stream=False))
    with pytest.raises(json.JSONDecodeError):
        bad.json()
    assert unfinished.json()["done"] is False
    assert [r.completed for r in server.streams] == [False, False, False]


# -- abandoned streams ----------------------------------------------------------------------


def assert_abandoned(record: StreamRecord, chunks: int) -> None:
    assert record.abandoned and not record.completed
    assert record.abandoned_at is not None and record.abandoned_at >= record.started_at
    assert record.finished_at is not None and record.finished_at >= record.abandoned_at
    assert record.chunks_sent == chunks


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_close_during_a_delay_is_recorded(protocol: str) -> None:
    turn = Turn("a b c d", delay=60)
    async with serving([turn, Turn("after")]) as server, httpx.AsyncClient() as http:
        url = chat_url(server, protocol)
        first = await first_line_then_close(http, url, body(protocol, stream=True))
        (record,) = await server.wait_abandoned()
        # The client opens a new connection and the server goes on serving.
        after = await http.post(url, json=body(protocol, stream=False))
    assert "a " in first
    assert_abandoned(record, chunks=1)
    assert after.status_code == 200 and server.connections_accepted == 2


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_hurried_server_streams_without_the_delays_until_it_is_not(
    protocol: str,
) -> None:
    slow = Turn("abcdef", chunks=3, delay=3600)  # an hour between chunks unless hurried
    async with serving([slow, slow]) as server, httpx.AsyncClient() as http:
        url = chat_url(server, protocol)
        server.hurried = True
        async with asyncio.timeout(60):  # a safety net: unhurried, it would take two hours
            whole = await http.post(url, json=body(protocol, stream=True))
        server.hurried = False
        first = await first_line_then_close(http, url, body(protocol, stream=True))
        await server.wait_abandoned()
    assert whole.status_code == 200 and "ef" in whole.text
    assert "ab" in first
    hurried, calm = server.streams
    assert hurried.completed and hurried.chunks_sent > 3
    assert not calm.completed and calm.chunks_sent == 1  # it waited its hour, and was left


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_close_during_a_hang_is_recorded(protocol: str) -> None:
    turn = Turn("a b c", fault="hang", fault_after=1)
    async with serving([turn]) as server, httpx.AsyncClient() as http:
        await first_line_then_close(http, chat_url(server, protocol), body(protocol, stream=True))
        (record,) = await server.wait_abandoned()
    assert_abandoned(record, chunks=1)
    assert record.fault == "hang"


async def test_slow_first_byte_then_client_timeout_is_recorded() -> None:
    turn = Turn("late", first_byte_delay=60)
    async with serving([turn]) as server, httpx.AsyncClient(timeout=0.2) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(chat_url(server, "ollama"), json=body("ollama", stream=True))
        (record,) = await server.wait_abandoned()
    assert_abandoned(record, chunks=0)


async def test_non_stream_reply_abandoned_while_generating() -> None:
    turn = Turn("a b c", delay=60)
    async with serving([turn]) as server, httpx.AsyncClient(timeout=0.2) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(chat_url(server, "openai"), json=body("openai", stream=False))
        (record,) = await server.wait_abandoned()
    assert_abandoned(record, chunks=0)
    assert not record.streamed


async def test_cancelling_the_reading_task_reaches_the_server() -> None:
    turn = Turn("a b c d", delay=60)
    first_line = asyncio.Event()

    async def read_all(http: httpx.AsyncClient, url: str) -> None:
        async with http.stream("POST", url, json=body("ollama", stream=True)) as response:
            async for _ in response.aiter_lines():
                first_line.set()

    async with serving([turn]) as server, httpx.AsyncClient() as http:
        reader = asyncio.create_task(read_all(http, chat_url(server, "ollama")))
        await first_line.wait()
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        (record,) = await server.wait_abandoned()
    assert_abandoned(record, chunks=1)


async def test_wait_abandoned_times_out_with_a_count() -> None:
    async with serving([Turn("a")]) as server, httpx.AsyncClient() as http:
        await http.post(chat_url(server, "ollama"), json=body("ollama", stream=True))
        with pytest.raises(TimeoutError, match="0 of 1 expected streams"):
            await server.wait_abandoned(timeout=0.05)
    assert server.streams[0].completed


# -- requests, routes, keep-alive -------------------------------------------------------------


async def test_requests_are_recorded_with_secrets_redacted() -> None:
    payload = body("openai", stream=True, temperature=0.5)
    headers = {"Authorization": "Bearer sk-secret-key", "X-Trace": "t1"}
    async with serving([Turn("a")]) as server, httpx.AsyncClient() as http:
        before = time.monotonic()
        await http.post(chat_url(server, "openai"), json=payload, headers=headers)
        after = time.monotonic()
    (request,) = server.requests
    assert (request.method, request.path, request.protocol) == (
        "POST",
        "/v1/chat/completions",
        "openai",
    )
    assert request.body == payload
    assert before <= request.time <= after
    assert request.headers["authorization"] == "***" == request.headers["Authorization"]
    assert request.headers.get("X-TRACE") == "t1" and "x-trace" in request.headers
    assert "sk-secret-key" not in repr(server.requests)


async def test_a_server_that_keeps_no_records_serves_every_wire_and_holds_nothing() -> None:
    """``keep_records=False`` (benchmarks, ``python -m aimu.testing.server``): the
    replies are the same, and no request body stays alive to slow the server's GC."""
    gemini = {"contents": [{"role": "user", "parts": [{"text": "hello"}]}]}
    paths = [
        ("/api/chat", body("ollama", stream=True)),
        ("/v1/chat/completions", body("openai", stream=True)),
        ("/v1/messages", {**body("openai", stream=True), "max_tokens": 10}),
        ("/v1/responses", {"model": "m", "input": "hello", "stream": True}),
        ("/v1beta/models/m:streamGenerateContent?alt=sse", gemini),
    ]
    async with LoopbackServer([Turn("a")] * 5, keep_records=False) as server:
        async with httpx.AsyncClient() as http:
            for path, payload in paths:
                reply = await http.post(server.url + path, json=payload)
                assert reply.status_code == 200 and b'"a"' in reply.content, path
        assert server.connections_accepted == 1
        assert server.requests == [] and server.streams == []
    await no_other_tasks()


async def test_keep_alive_serves_both_protocols_on_one_connection_and_one_script() -> None:
    async with serving([Turn("first"), Turn("second")]) as server, httpx.AsyncClient() as http:
        one = await http.post(chat_url(server, "ollama"), json=body("ollama", stream=True))
        two = await http.post(chat_url(server, "openai"), json=body("openai", stream=True))
    assert ndjson(one.text)[0]["message"]["content"] == "first"
    assert content_deltas(sse(two.text)) == ["second"]
    assert server.connections_accepted == 1
    assert server.requests[0].connection == server.requests[1].connection


async def test_info_routes_and_errors() -> None:
    async with serving([Turn("x")]) as server, httpx.AsyncClient(base_url=server.url) as http:
        version = await http.get("/api/version")
        await http.post("/api/chat", json={"model": "qwen3:8b", "stream": False})
        tags = await http.get("/api/tags")
        models = await http.get("/v1/models")
        missing = await http.get("/api/nope")
        missing_openai = await http.post("/v1/nope", json={})
        wrong_method = await http.get("/api/chat")
        bad_json = await http.post("/api/chat", content=b"{not json")
        not_object = await http.post("/v1/chat/completions", json=[1, 2])
        root = await http.get("/")
    assert version.status_code == 200 and isinstance(version.json()["version"], str)
    assert [m["name"] for m in tags.json()["models"]] == ["test", "qwen3:8b"]
    assert [m["id"] for m in models.json()["data"]] == ["test", "qwen3:8b"]
    assert missing.status_code == 404 and "/api/nope" in missing.json()["error"]
    assert missing_openai.status_code == 404
    assert "/v1/nope" in missing_openai.json()["error"]["message"]
    assert wrong_method.status_code == 405 and "POST" in wrong_method.json()["error"]
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]
    assert not_object.status_code == 400
    assert "JSON object" in not_object.json()["error"]["message"]
    assert root.text == "Ollama is running"
    assert len(server.streams) == 1  # only the one good chat request took a turn


async def test_raw_pipelined_and_chunked_requests() -> None:
    chat_body = json.dumps({"model": "m", "stream": False}).encode()
    chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        5, chat_body[:5], len(chat_body) - 5, chat_body[5:]
    )
    wire = (
        b"POST /api/chat HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
        + b"GET /api/version HTTP/1.1\r\nHost: x\r\n\r\n"
        + b"GET /api/version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    async with serving([Turn("piped")]) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(wire)
        data = await reader.read()  # the server closes after the third response
        writer.close()
        await writer.wait_closed()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"NONSENSE\r\n\r\n")
        garbage = await reader.read()
        writer.close()
        await writer.wait_closed()
    assert data.count(b"HTTP/1.1 200 OK") == 3 and b'"content":"piped"' in data
    assert data.rstrip().endswith(b"}") and b"Connection: close" in data
    assert garbage.startswith(b"HTTP/1.1 400 Bad Request") and b"request line" in garbage


async def raw_exchange(server: LoopbackServer, *parts: bytes) -> bytes:
    """Send ``parts`` (each after the server's answer so far), read until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        received = b""
        for position, part in enumerate(parts):
            writer.write(part)
            if position < len(parts) - 1:
                received += await reader.readuntil(b"\r\n\r\n")
        return received + await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()


async def test_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    chat_body = json.dumps({"model": "m", "stream": False}).encode()
    head = (
        b"POST /api/chat HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(chat_body)
    )
    async with serving([Turn("after the wait")]) as server:
        data = await raw_exchange(server, head, chat_body)
    assert data.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")
    assert b'"content":"after the wait"' in data


async def test_head_answers_the_head_without_a_body() -> None:
    async with serving() as server, httpx.AsyncClient(base_url=server.url) as http:
        head = await http.head("/")
        after = await http.get("/api/version")  # the same connection still reads right
    assert head.status_code == 200 and head.content == b""
    assert after.json() == {"version": "0.6.0"} and server.connections_accepted == 1


@pytest.mark.parametrize(
    ("wire", "said"),
    [
        (b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n", b"Content-Length"),
        (b"GET /api/version HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", b"header"),
        (b"GET /api/version HTTP/1.1\r\nX: " + b"a" * 70_000, b"too long"),
    ],
    ids=["bad length", "bad header", "head too long"],
)
async def test_malformed_requests_get_a_400_that_says_why(wire: bytes, said: bytes) -> None:
    async with serving() as server:
        data = await raw_exchange(server, wire)
        assert not server.requests
    assert data.startswith(b"HTTP/1.1 400 Bad Request") and b"Connection: close" in data
    assert said.lower() in data.lower()


async def test_a_client_gone_mid_request_is_no_request_and_no_error() -> None:
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        writer.write_eof()
        data = await reader.read()
        writer.close()
        await writer.wait_closed()
    assert data == b"" and not server.requests and not server.streams


async def test_an_http_1_0_client_gets_the_stream_unchunked_until_the_close() -> None:
    chat_body = json.dumps({"model": "m", "stream": True}).encode()
    request = b"POST /api/chat HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(chat_body)
    async with serving([Turn("a b")]) as server:
        data = await raw_exchange(server, request + chat_body)
    head, _, streamed = data.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding" not in head and b"Connection: close" in head
    assert [line["message"]["content"] for line in ndjson(streamed.decode())] == ["a ", "b", ""]
    assert server.streams[0].completed


async def test_a_request_pipelined_during_a_streamed_reply_is_served_after_it() -> None:
    chat_body = json.dumps({"model": "m", "stream": True}).encode()
    chat = b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(chat_body)
    version = b"GET /api/version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    async with serving([Turn("a b c", delay=0.01)]) as server:
        # The second request arrives while the first reply is being streamed (its head
        # was read): the watcher keeps those bytes for the parser.
        data = await raw_exchange(server, chat + chat_body, version)
    first, _, second = data.partition(b"0\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in first and first.count(b'"content":') == 4
    assert second.startswith(b"HTTP/1.1 200 OK") and second.endswith(b'{"version":"0.6.0"}')
    assert server.streams[0].completed and not server.streams[0].abandoned


# -- scripts ------------------------------------------------------------------------------------


async def test_exhausted_script_answers_500_and_replacing_it_restarts() -> None:
    async with serving([Turn("only")]) as server, httpx.AsyncClient() as http:
        url = chat_url(server, "ollama")
        await http.post(url, json=body("ollama", stream=False))
        exhausted = await http.post(url, json=body("ollama", stream=False))
        server.script = [Turn("fresh")]
        fresh = await http.post(url, json=body("ollama", stream=False))
    assert exhausted.status_code == 500
    assert "script exhausted" in exhausted.json()["error"]
    assert "1 turns" in exhausted.json()["error"]
    assert fresh.json()["message"]["content"] == "fresh"


async def test_callable_script_gets_the_request_body() -> None:
    def script(request: Any) -> Turn:
        if request.get("boom"):
            raise LookupError("no such turn")
        return Turn(f"{len(request['messages'])} messages")

    async with serving(script) as server, httpx.AsyncClient() as http:
        url = chat_url(server, "openai")
        good = await http.post(url, json=body("openai", stream=False))
        bad = await http.post(url, json=body("openai", stream=False, boom=True))
    assert good.json()["choices"][0]["message"]["content"] == "1 messages"
    assert bad.status_code == 500
    assert "LookupError: no such turn" in bad.json()["error"]["message"]


async def test_default_script_is_the_test_model() -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    async with serving() as server, httpx.AsyncClient() as http:
        url = chat_url(server, "ollama")
        plain = await http.post(url, json=body("ollama", stream=False))
        called = await http.post(url, json=body("ollama", stream=False, tools=[tool]))
    assert plain.status_code == 200 and plain.json()["message"]["content"]
    (call,) = called.json()["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(call["function"]["arguments"]["city"], str)


# -- lifecycle: stop lands at each await ----------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "turn"),
    [
        ("first byte", Turn("a b", first_byte_delay=60)),
        ("between chunks", Turn("a b", delay=60)),
        ("hang", Turn("a b", fault="hang", fault_after=1)),
        ("non-stream delay", Turn("a b", delay=60)),
    ],
)
async def test_stop_during_a_reply_leaves_nothing_behind(phase: str, turn: Turn) -> None:
    server = LoopbackServer([turn])
    await server.start()
    started = asyncio.Event()

    async def client(http: httpx.AsyncClient) -> None:
        stream = phase != "non-stream delay"
        payload = body("ollama", stream=stream)
        async with http.stream("POST", chat_url(server, "ollama"), json=payload) as response:
            async for _ in response.aiter_lines():
                started.set()

    async with httpx.AsyncClient() as http:
        task = asyncio.create_task(client(http))
        await server.wait_until(lambda: bool(server.streams))
        if phase in ("between chunks", "hang"):
            await started.wait()
        await server.stop()
        with pytest.raises(httpx.HTTPError):
            await task
    await no_other_tasks()
    (record,) = server.streams
    assert record.finished_at is not None and not record.completed and not record.abandoned


async def test_stop_closes_idle_keep_alive_connections_and_is_idempotent() -> None:
    server = LoopbackServer([Turn("a")])
    with pytest.raises(RuntimeError, match="not running"):
        _ = server.url
    async with httpx.AsyncClient() as http:
        await server.start()
        with pytest.raises(RuntimeError, match="starts only once"):
            await server.start()
        await http.post(chat_url(server, "ollama"), json=body("ollama", stream=False))
        await server.stop()
        await server.stop()
        await no_other_tasks()
        with pytest.raises(httpx.ConnectError):
            await http.get(f"http://127.0.0.1:{server.port}/api/version")


# -- thread and command line -----------------------------------------------------------------------


async def test_in_thread_server_serves_another_loop() -> None:
    turn = Turn("a b c", delay=60)
    with LoopbackServer.in_thread([Turn("sync hello"), turn]) as server:
        assert any(t.name == "aimu-loopback-server" for t in threading.enumerate())
        reply = await asyncio.to_thread(
            httpx.post, chat_url(server, "ollama"), json=body("ollama", stream=False)
        )
        assert reply.json()["message"]["content"] == "sync hello"
        # Waiting on this loop wakes up from the server's thread.
        waiter = asyncio.create_task(server.wait_abandoned())
        async with httpx.AsyncClient() as http:
            url, payload = chat_url(server, "ollama"), body("ollama", stream=True)
            await first_line_then_close(http, url, payload)
        (record,) = await waiter
        assert record.abandoned and record.chunks_sent == 1
    assert not any(t.name == "aimu-loopback-server" for t in threading.enumerate())


def test_cli_serves_until_sigint(monkeypatch: pytest.MonkeyPatch) -> None:
    command = [sys.executable, "-m", "aimu.testing.server", "--port", "0", "--delay", "0"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        banner = process.stdout.readline()
        match = re.fullmatch(r"listening on (http://127\.0\.0\.1:\d+)\n", banner)
        assert match, banner
        payload = {"model": "test", "messages": [{"role": "user", "content": "hi"}]}
        reply = httpx.post(match.group(1) + "/api/chat", json={**payload, "stream": False})
        assert reply.status_code == 200 and reply.json()["done"] is True
        # A line per wire, each base URL one a client of that wire answers through.
        wires = [process.stdout.readline().split() for _ in range(5)]
        assert [prefix for prefix, _ in wires] == [
            "ollama:", "openai:", "openai-responses:", "anthropic:", "gemini:"]
        for prefix, setting in wires:
            variable, _, url = setting.partition("=")
            assert url.startswith(match.group(1)), setting
            monkeypatch.setenv(variable, url)
            asyncio.run(_answers(prefix + "test"))
        process.send_signal(signal.SIGINT)
        _, errors = process.communicate(timeout=10)
        assert process.returncode == 0, errors
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


async def _answers(spec: str) -> None:
    """A client of ``spec``, pointed at the server by its variable alone, gets an answer."""
    from aimu.aio.client import client

    keyed = {} if spec.startswith("ollama") else {"api_key": "k"}
    async with client(spec, retries=0, **keyed) as model:
        reply = await aio.chat(model, "hi")
    assert reply["content"], (spec, reply)


def _call(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([{"role": "assistant", "content": "", "tool_calls": [_call("a"), _call("b")]},
          {"role": "tool", "content": "x", "tool_call_id": "a"}],
         "these had no response: b"),
        ([{"role": "assistant", "content": "", "tool_calls": [_call("a")]},
          {"role": "user", "content": "next"}],
         "these had no response: a"),
        ([{"role": "user", "content": "hi"},
          {"role": "tool", "content": "x", "tool_call_id": "zz"}],
         "must be a response to a preceding message"),
    ],
)
async def test_openai_rejects_dangling_tool_calls_like_a_real_server(
    messages: list[dict[str, Any]], expected: str
) -> None:
    async with LoopbackServer([Turn(text="never served")]) as server, httpx.AsyncClient() as http:
        response = await http.post(
            f"{server.openai_base_url}/chat/completions", json={"model": "m", "messages": messages}
        )
        assert response.status_code == 400
        assert expected in response.json()["error"]["message"]
        answered = [
            {"role": "assistant", "content": "", "tool_calls": [_call("a")]},
            {"role": "tool", "content": "x", "tool_call_id": "a"},
            {"role": "user", "content": "go on"},
        ]
        ok = await http.post(
            f"{server.openai_base_url}/chat/completions", json={"model": "m", "messages": answered}
        )
        assert ok.status_code == 200


# -- strict templates, retryable faults, stop reasons --------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_strict_alternation_refuses_two_turns_of_one_role(protocol: str) -> None:
    async with serving([Turn(text="ok")]) as server:
        server.strict_alternation = True
        payload = body(protocol, stream=False)
        payload["messages"] = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "a"},
            {"role": "user", "content": "b"},
        ]
        async with httpx.AsyncClient() as http:
            refused = await http.post(chat_url(server, protocol), json=payload)
            payload["messages"][2] = {"role": "assistant", "content": "b"}
            accepted = await http.post(chat_url(server, protocol), json=payload)
    assert refused.status_code == 400
    assert "messages 1 and 2 are both 'user'" in refused.text
    assert accepted.status_code == 200 and not server.streams[0].fault


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("fault", "status", "retry_after"),
    [("http_502", 502, None), ("http_503", 503, "7"), ("http_504", 504, None),
     ("http_429", 429, "1")],
)
async def test_retryable_http_faults_answer_their_status(
    protocol: str, fault: Any, status: int, retry_after: str | None
) -> None:
    turn = Turn(fault=fault, retry_after="7" if status == 503 else None)
    async with serving([turn]) as server, httpx.AsyncClient() as http:
        response = await http.post(chat_url(server, protocol), json=body(protocol, stream=True))
    assert response.status_code == status
    assert response.headers.get("retry-after") == retry_after


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_reset_closes_the_connection_before_any_byte(protocol: str) -> None:
    async with serving([Turn(fault="reset")]) as server, httpx.AsyncClient() as http:
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            await http.post(chat_url(server, protocol), json=body(protocol, stream=True))
        await server.wait_requests(1)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_scripted_stop_reason_is_sent(protocol: str) -> None:
    turn = Turn(text="cut", stop_reason="length")
    async with serving([turn]) as server, httpx.AsyncClient() as http:
        url = chat_url(server, protocol)
        reply = (await http.post(url, json=body(protocol, stream=False))).json()
    if protocol == "ollama":
        assert reply["done_reason"] == "length"
    else:
        assert reply["choices"][0]["finish_reason"] == "length"
