"""The AI SDK's UI message stream at /api/chat, checked at the wire and by the AI SDK's own
client (npm ``ai``: its chat transport parses every chunk with its schema, and
readUIMessageStream builds the message as useChat does).

Stops land at provable points: a text delta seen, a gated tool entered, the model server's
record of an abandoned stream.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aimu.aio.transcript import validate
from tests.serve.harness import FLAKY, GATE, MAILED, Served
from tests.serve.protocols import node_client, restarted_after_a_kill, session, settled


def chat_body(chat: str, *messages: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"id": chat, "messages": list(messages), "trigger": "submit-message", **more}


def user(text: str) -> dict[str, Any]:
    return {"id": "u1", "role": "user", "parts": [{"type": "text", "text": text}]}


async def chunks(
    http: httpx.AsyncClient, method: str, path: str, body: dict[str, Any] | None = None,
    until: str | None = None,
) -> list[Any]:
    """The chunks of a UI message stream (``"[DONE]"`` last); with ``until``, the client
    leaves right after the first chunk of that type."""
    seen: list[Any] = []
    async for chunk in _stream(http, method, path, body):
        seen.append(chunk)
        if chunk["type"] == until:
            break
    return seen


async def _stream(
    http: httpx.AsyncClient, method: str, path: str, body: dict[str, Any] | None
) -> AsyncIterator[Any]:
    async with http.stream(method, path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["x-vercel-ai-ui-message-stream"] == "v1"
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                yield DONE if line == "data: [DONE]" else json.loads(line[6:])


#: The stream's last line, ``data: [DONE]``, as the tests list it.
DONE = {"type": "[DONE]"}


def types(seen: list[Any]) -> list[str]:
    kinds = [c["type"] for c in seen]
    return [kind for i, kind in enumerate(kinds) if i == 0 or kinds[i - 1] != kind]


async def test_a_chat_streams_its_answer(http: httpx.AsyncClient) -> None:
    seen = await chunks(http, "POST", "/api/chat", chat_body("sdk-hello", user("hello")))
    assert types(seen) == ["start", "start-step", "text-start", "text-delta", "text-end",
                           "finish-step", "finish", "[DONE]"]
    assert "".join(c["delta"] for c in seen if c.get("type") == "text-delta") == "answer to hello"
    assert seen[-2]["finishReason"] == "stop"
    assert seen[-2]["messageMetadata"]["aimuStatus"] == "completed"


async def test_a_reply_the_network_cut_and_restarted_is_a_new_text_part(
    http: httpx.AsyncClient,
) -> None:
    """Issue 44: a data-aimu-turn-retried part names the cut text part, which ends there;
    the restarted reply is a text part of its own, whole."""
    seen = await chunks(http, "POST", "/api/chat", chat_body("sdk-flaky", user("flaky sdk")))
    (retried,) = [c for c in seen if c["type"] == "data-aimu-turn-retried"]
    data = retried["data"]
    assert (data["mode"], data["kept"], data["attempt"]) == ("restarted", "", 1)
    cut = data["textId"]
    assert seen[seen.index(retried) + 1] == {"type": "text-end", "id": cut}
    starts = [c["id"] for c in seen if c["type"] == "text-start"]
    assert starts[0] == cut and len(starts) == 2
    texts = {part: "".join(c["delta"] for c in seen
                           if c["type"] == "text-delta" and c["id"] == part) for part in starts}
    assert FLAKY.startswith(texts[cut]) and texts[cut] and texts[starts[1]] == FLAKY
    assert seen[-2]["messageMetadata"]["aimuStatus"] == "completed"


async def test_tool_calls_and_outputs(http: httpx.AsyncClient) -> None:
    seen = await chunks(http, "POST", "/api/chat", chat_body("sdk-tool", user("tool please")))
    kinds = types(seen)
    assert kinds.count("start-step") == kinds.count("finish-step") == 2
    (call,) = [c for c in seen if c.get("type") == "tool-input-available"]
    assert call["toolName"] == "lookup" and call["input"] == {"query": "tool please"}
    (output,) = [c for c in seen if c.get("type") == "tool-output-available"]
    assert output["toolCallId"] == call["toolCallId"] and output["output"] == "found tool please"


async def test_leaving_the_stream_stops_the_run(http: httpx.AsyncClient, served: Served) -> None:
    abandoned = len([s for s in served.model.streams if s.abandoned])
    seen = await chunks(http, "POST", "/api/chat", chat_body("sdk-leave", user("long one")),
                        until="text-delta")
    await served.model.wait_abandoned(abandoned + 1)
    state = await settled(http, "sdk-leave")
    assert state["status"] == "cancelled"
    validate(state["messages"])
    assert state["messages"][-1]["aimu_partial"] is True
    assert state["messages"][-1]["content"].startswith(seen[-1]["delta"])


async def test_leaving_mid_tool_stops_the_run_and_settles_the_call(
    http: httpx.AsyncClient,
) -> None:
    GATE.reset()
    await chunks(http, "POST", "/api/chat", chat_body("sdk-midtool", user("gate 1 3")),
                 until="tool-input-available")
    await GATE.entered(1)  # the tool runs; the client has left
    state = await settled(http, "sdk-midtool")
    GATE.open()
    assert state["status"] == "cancelled"
    validate(state["messages"])
    assert state["messages"][-1]["role"] == "tool"
    assert "cancelled" in state["messages"][-1]["content"]


async def test_stop_route_stops_server_side_and_a_resumable_stream_only_detaches(
    http: httpx.AsyncClient, served: Served
) -> None:
    GATE.reset()
    body = chat_body("sdk-stop", user("gate 2 3"), resumable=True)
    await chunks(http, "POST", "/api/chat", body, until="tool-input-available")
    await GATE.entered(1)
    # The client left a resumable stream: the run goes on, and a reconnect finds it.
    assert (await session(http, "sdk-stop"))["run_id"] is not None
    reconnected = _stream(http, "GET", "/api/chat/sdk-stop/stream", None)
    async with contextlib.aclosing(reconnected):
        replay = [await anext(reconnected) for _ in range(4)]
        assert types(replay)[:3] == ["start", "start-step", "text-start"]  # from its start
        GATE.release()  # the first call returns; the second is held
        await GATE.entered(2)
        stop = await http.post("/api/chat/sdk-stop/stop", json={})
        assert stop.status_code == 202, stop.text
        replay += [chunk async for chunk in reconnected]
    GATE.open()
    # The first call answered; the second was cut (its result, "cancelled", is stored).
    assert [c["type"] for c in replay].count("tool-output-available") == 1
    assert replay[-2] == {"type": "abort", "reason": "stopped by the chat"}
    assert replay[-1] == DONE
    state = await settled(http, "sdk-stop")
    assert state["status"] == "cancelled"
    validate(state["messages"])
    assert "cancelled" in state["messages"][-1]["content"]

    nothing = await http.post("/api/chat/sdk-stop/stop", json={})
    assert nothing.status_code == 409
    assert (await http.get("/api/chat/sdk-stop/stream")).status_code == 204


async def test_a_second_message_while_the_chat_runs_is_refused(http: httpx.AsyncClient) -> None:
    GATE.reset()
    body = chat_body("sdk-busy", user("gate 1 2"))
    stream = _stream(http, "POST", "/api/chat", body)
    async with contextlib.aclosing(stream):
        async for chunk in stream:
            if chunk["type"] == "tool-input-available":
                break
        await GATE.entered(1)
        busy = await http.post("/api/chat", json=chat_body("sdk-busy", user("meanwhile")))
        assert busy.status_code == 409, busy.text
        GATE.open()
        rest = [chunk async for chunk in stream]
    assert rest[-2]["type"] == "finish"
    users = [m for m in (await session(http, "sdk-busy"))["messages"] if m["role"] == "user"]
    assert [m["content"] for m in users] == ["gate 1 2"]


async def test_an_approval_round_trip(http: httpx.AsyncClient) -> None:
    MAILED.clear()
    asked = await chunks(http, "POST", "/api/chat", chat_body("sdk-mail", user("mail kim")))
    (request,) = [c for c in asked if c.get("type") == "tool-approval-request"]
    (call,) = [c for c in asked if c.get("type") == "tool-input-available"]
    assert request["toolCallId"] == call["toolCallId"] and call["toolName"] == "send_email"
    assert asked[-2]["finishReason"] == "tool-calls" and MAILED == []

    answered = {"id": "a1", "role": "assistant", "parts": [
        {"type": "dynamic-tool", "toolName": "send_email", "toolCallId": call["toolCallId"],
         "state": "approval-responded", "input": call["input"],
         "approval": {"id": request["approvalId"], "approved": True}},
    ]}
    done = await chunks(http, "POST", "/api/chat", chat_body("sdk-mail", user("mail kim"),
                                                             answered))
    outputs = [c["output"] for c in done if c.get("type") == "tool-output-available"]
    assert outputs == ["sent to mail kim"] and MAILED == ["mail kim"]
    assert done[-2]["type"] == "finish"
    # The page has the call's part: the resumed stream gives its output, not the call again.
    assert [c["type"] for c in done if c.get("toolCallId") == call["toolCallId"]] == [
        "tool-output-available"]

    again = await http.post("/api/chat", json=chat_body("sdk-mail", answered))
    assert again.status_code == 409  # decided already: nothing waits


async def test_a_denied_approval_is_output_denied(http: httpx.AsyncClient) -> None:
    MAILED.clear()
    asked = await chunks(http, "POST", "/api/chat", chat_body("sdk-deny", user("mail rex")))
    (request,) = [c for c in asked if c.get("type") == "tool-approval-request"]
    (call,) = [c for c in asked if c.get("type") == "tool-input-available"]
    answered = {"id": "a1", "role": "assistant", "parts": [
        {"type": "dynamic-tool", "toolName": "send_email", "toolCallId": call["toolCallId"],
         "state": "approval-responded", "input": call["input"],
         "approval": {"id": request["approvalId"], "approved": False, "reason": "no"}},
    ]}
    done = await chunks(http, "POST", "/api/chat", chat_body("sdk-deny", user("mail rex"),
                                                             answered))
    assert [c for c in done if c.get("toolCallId") == call["toolCallId"]] == [
        {"type": "tool-output-denied", "toolCallId": call["toolCallId"]}]
    assert "tool-output-error" not in types(done) and done[-2]["type"] == "finish"
    assert MAILED == []
    # The model was told, as with any denial.
    stored = (await session(http, "sdk-deny"))["messages"]
    assert [m["content"] for m in stored if m["role"] == "tool"] == ["[denied: no]"]


async def test_a_client_side_tool_waits_for_the_pages_output(http: httpx.AsyncClient) -> None:
    locate = {"name": "locate", "description": "Where the user is"}
    seen = await chunks(http, "POST", "/api/chat",
                        chat_body("sdk-page", user("locate"), tools=[locate]))
    (call,) = [c for c in seen if c["type"] == "tool-input-available"]
    assert call["toolName"] == "locate" and "tool-approval-request" not in types(seen)
    assert seen[-2]["finishReason"] == "tool-calls"
    part = {"type": "dynamic-tool", "toolName": "locate", "toolCallId": call["toolCallId"],
            "state": "output-available", "input": {}, "output": "Oslo"}
    wrong = {**part, "toolCallId": "nope"}  # the output of a call the chat never had
    body = chat_body("sdk-page", user("locate"), {"id": "a1", "role": "assistant",
                                                  "parts": [wrong]})
    response = await http.post("/api/chat", json=body)
    assert response.status_code == 400, response.text
    for tools in ([{"name": "no spaces"}], [locate, locate], [{"name": "lookup"}]):
        response = await http.post("/api/chat", json=chat_body("sdk-page-bad", user("locate"),
                                                                tools=tools))
        assert response.status_code == 400, response.text
    assert (await http.get("/sessions/sdk-page-bad")).status_code == 404
    answered = chat_body("sdk-page", user("locate"),
                         {"id": "a1", "role": "assistant", "parts": [part]})
    resumed = await chunks(http, "POST", "/api/chat", answered)
    texts = "".join(c["delta"] for c in resumed if c["type"] == "text-delta")
    assert texts == "you are in Oslo"
    stored = (await session(http, "sdk-page"))["messages"]
    validate(stored)
    assert [m["content"] for m in stored if m["role"] == "tool"] == ["Oslo"]


async def test_bad_input_is_refused_and_changes_nothing(http: httpx.AsyncClient) -> None:
    cases: list[tuple[object, int]] = [
        ({"id": "sdk-bad"}, 422),
        (chat_body("sdk-bad"), 422),  # no messages
        (chat_body("../x", user("hi")), 400),
        (chat_body("sdk-bad", user("  ")), 400),
        (chat_body("sdk-bad", {"id": "u", "role": "user", "parts": [{"type": "file"}]}), 400),
        (chat_body("sdk-bad", user("hi"), trigger="regenerate-message"), 400),
        (chat_body("sdk-bad", {"id": "a", "role": "assistant", "parts": []}), 400),
        (chat_body("sdk-bad", {"id": "a", "role": "assistant", "parts": [
            {"type": "dynamic-tool", "toolCallId": "c1", "state": "approval-responded",
             "approval": {"id": "c1", "approved": True}}]}), 409),
    ]
    for body, status in cases:
        response = await http.post("/api/chat", json=body)
        assert response.status_code == status, (body, response.text)
    assert (await http.get("/sessions/sdk-bad")).status_code == 404
    assert (await http.get("/api/chat/..%2Fx/stream")).status_code in (400, 404)
    foreign = await http.post("/api/chat", json=chat_body("sdk-bad", user("hi")),
                              headers={"Origin": "https://evil.example"})
    assert foreign.status_code == 403
    assert (await http.get("/sessions/sdk-bad")).status_code == 404


# -- the AI SDK's own client (npm `ai`, in Node) --------------------------------------------

CLIENT = Path(__file__).with_name("ai_sdk_client.mjs")




async def test_the_ai_sdk_builds_the_message(served: Served) -> None:
    lines = await node_client(CLIENT, served, "run", "sdk-js", "tool please")
    end = lines[-1]["end"]
    assert end["error"] is None
    parts = end["message"]["parts"]
    tools = [p for p in parts if p["type"] == "dynamic-tool"]
    assert [(t["toolName"], t["state"], t["output"]) for t in tools] == [
        ("lookup", "output-available", "found tool please")]
    texts = [p["text"] for p in parts if p["type"] == "text"]
    assert texts[-1] == "answer to tool please"


async def test_the_ai_sdk_abort_stops_the_run_mid_text_and_mid_tool(
    served: Served, http: httpx.AsyncClient
) -> None:
    """One Node process: an abort mid-text, then one while a server-side tool runs."""
    GATE.reset()
    abandoned = len([s for s in served.model.streams if s.abandoned])

    async def on_line(line: Any) -> bytes | None:
        if "waiting" not in line:
            return None
        await GATE.entered(1)  # the server-side tool is running: the client aborts now
        return b"abort\n"

    lines = await node_client(CLIENT, served, "abort", "sdk-js-abort", "long yarn",
                              "gate 1 3", on_line=on_line)
    GATE.open()
    (stopped,) = [line["stopped"] for line in lines if "stopped" in line]
    assert stopped["error"] == "AbortError"
    await served.model.wait_abandoned(abandoned + 1)
    state = await settled(http, "sdk-js-abort")
    assert state["status"] == "cancelled" and state["messages"][-1]["aimu_partial"] is True

    assert lines[-1]["end"]["error"] == "AbortError"
    tooled = await settled(http, "sdk-js-abort-tool")
    assert tooled["status"] == "cancelled"
    validate(tooled["messages"])
    assert tooled["messages"][-1]["role"] == "tool"
    assert "cancelled" in tooled["messages"][-1]["content"]


async def test_the_ai_sdk_answers_an_approval(served: Served) -> None:
    MAILED.clear()
    lines = await node_client(CLIENT, served, "approve", "sdk-js-mail", "mail lee")
    (asked,) = [line["asked"] for line in lines if "asked" in line]
    assert [p["state"] for p in asked["parts"] if p["type"] == "dynamic-tool"] == [
        "approval-requested"]
    (approved,) = [line["approved"] for line in lines if "approved" in line]
    assert approved["error"] is None and MAILED == ["mail lee"]
    tools = [p for p in approved["message"]["parts"] if p["type"] == "dynamic-tool"]
    assert [t["state"] for t in tools] == ["output-available"]
    assert tools[0]["approval"]["approved"] is True  # the page's part, carried on

    # Then the page's own tool (same Node process): its call waits for the page.
    (called,) = [line["called"] for line in lines if "called" in line]
    assert called["error"] is None
    (part,) = [p for p in called["message"]["parts"] if p["type"] == "dynamic-tool"]
    assert (part["toolName"], part["state"]) == ("locate", "input-available")
    (located,) = [line["located"] for line in lines if "located" in line]
    assert located["error"] is None
    texts = [p["text"] for p in located["message"]["parts"] if p["type"] == "text"]
    assert texts[-1] == "you are in Bergen"
    again = lines[-1]["end"]  # the same output sent again: refused, nothing changed
    assert again["error"] == "AI_APICallError" and "has its result already" in again["detail"]


async def test_the_ai_sdk_shows_a_denied_approval_as_output_denied(served: Served) -> None:
    MAILED.clear()
    lines = await node_client(CLIENT, served, "deny", "sdk-js-deny", "mail max")
    (denied,) = [line["denied"] for line in lines if "denied" in line]
    assert denied["error"] is None and MAILED == []
    (part,) = [p for p in denied["message"]["parts"] if p["type"] == "dynamic-tool"]
    assert part["state"] == "output-denied"
    assert part["approval"]["approved"] is False and part["approval"]["reason"] == "not today"
    assert "errorText" not in part
    texts = [p["text"] for p in denied["message"]["parts"] if p["type"] == "text"]
    assert texts == ["mail result: [denied: not today]"]


async def test_the_ai_sdk_reconnects_to_a_resumable_run(
    served: Served, http: httpx.AsyncClient
) -> None:
    assert (await node_client(CLIENT, served, "reconnect", "sdk-js-none"))[-1] == {"end": None}
    GATE.reset()
    body = chat_body("sdk-js-back", user("gate 1 3"), resumable=True)
    await chunks(http, "POST", "/api/chat", body, until="tool-input-available")
    await GATE.entered(1)
    # The refreshed page reconnects while the run is held in its tool, which then goes on.
    lines = await node_client(CLIENT, served, "reconnect", "sdk-js-back", on_first_chunk=GATE.open)
    end = lines[-1]["end"]
    assert end["error"] is None
    assert [p["text"] for p in end["message"]["parts"] if p["type"] == "text"][-1] == "w0 w1 w2"


@pytest.mark.slow
async def test_a_reconnect_after_a_killed_server_finds_the_run_going_on(
    served: Served, tmp_path: Path
) -> None:
    def stream(http: httpx.AsyncClient) -> AsyncIterator[dict[str, Any]]:
        body = chat_body("sdk-kill", user("short 300"), resumable=True)
        return _stream(http, "POST", "/api/chat", body)

    async with restarted_after_a_kill(
        served, tmp_path, stream, lambda chunk: chunk["type"] == "text-delta"
    ) as http:
        # A GET only reads: the run died with its server, so none is in progress...
        assert (await http.get("/api/chat/sdk-kill/stream")).status_code == 204
        assert (await session(http, "sdk-kill"))["status"] == "in_progress"
        # ... and the POST (under the cross-site guard) resumes it, then streams it.
        replay = await chunks(http, "POST", "/api/chat/sdk-kill/stream")
        assert replay[-2]["type"] == "finish" and replay[-1] == DONE
        text = "".join(c["delta"] for c in replay if c["type"] == "text-delta")
        assert text.endswith("c299")
        stored = (await session(http, "sdk-kill"))["messages"]
        assert (await http.get("/api/chat/sdk-kill/stream")).status_code == 204
    validate(stored)
    assert [m["role"] for m in stored] == ["user", "assistant"]
