"""AG-UI at POST /ag-ui: every event validated by the ``ag-ui-protocol`` package's models.

Stops land at provable points: the first TEXT_MESSAGE_CONTENT seen, a gated tool entered,
the model server's record of an abandoned stream.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import TypeAdapter

from aimu.aio.transcript import validate
from tests.serve.harness import FLAKY, GATE, MAILED, Served
from tests.serve.protocols import node_client, restarted_after_a_kill, session, settled

ag_ui_core = pytest.importorskip("ag_ui.core")
EVENT: TypeAdapter[Any] = TypeAdapter(ag_ui_core.Event)


def run_input(thread: str, run: str, *messages: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"threadId": thread, "runId": run, "messages": list(messages), **more}


def user(text: str, message_id: str = "u1") -> dict[str, Any]:
    return {"id": message_id, "role": "user", "content": text}


async def ag_ui_events(
    http: httpx.AsyncClient, body: dict[str, Any], until: str | None = None
) -> list[dict[str, Any]]:
    """The events of one POST /ag-ui, each validated; with ``until``, the client leaves
    (closes the stream) right after the first event of that type."""
    seen: list[dict[str, Any]] = []
    async for event in _stream(http, body):
        seen.append(event)
        if event["type"] == until:
            break
    return seen


async def _stream(http: httpx.AsyncClient, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    async with http.stream("POST", "/ag-ui", json=body,
                           headers={"Accept": "text/event-stream"}) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                EVENT.validate_python(event)  # the protocol's own models accept it
                yield event


def types(events: list[dict[str, Any]]) -> list[str]:
    return [event["type"] for event in events]


def shape(events: list[dict[str, Any]]) -> list[str]:
    """The event types with runs of one type (the deltas of a message) as one."""
    kinds = types(events)
    return [kind for i, kind in enumerate(kinds) if i == 0 or kinds[i - 1] != kind]


async def test_a_run_streams_text_and_finishes_with_its_answer(http: httpx.AsyncClient) -> None:
    events = await ag_ui_events(http, run_input("agui-hello", "r1", user("hello")))
    assert shape(events) == [
        "RUN_STARTED", "STEP_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT",
        "TEXT_MESSAGE_END", "STEP_FINISHED", "RUN_FINISHED",
    ]
    assert events[0]["threadId"] == "agui-hello" and events[0]["runId"] == "r1"
    assert events[-1]["outcome"] == {"type": "success"}
    assert events[-1]["result"] == "answer to hello"
    text = "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT")
    assert text == "answer to hello"
    assert events[-1]["usage"][0]["outputTokens"] > 0
    stored = (await session(http, "agui-hello"))["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant"]


async def test_a_reply_the_network_cut_and_restarted_is_a_new_message(
    http: httpx.AsyncClient,
) -> None:
    """Issue 44: a CUSTOM aimu.turn_retried names the cut message, which ends there; the
    restarted reply is a message of its own, whole."""
    events = await ag_ui_events(http, run_input("agui-flaky", "r1", user("flaky agui")))
    kinds = types(events)
    (retried,) = [e for e in events if e["type"] == "CUSTOM"]
    assert retried["name"] == "aimu.turn_retried"
    value = retried["value"]
    assert (value["mode"], value["kept"], value["attempt"]) == ("restarted", "", 1)
    cut = value["messageId"]
    at = events.index(retried)
    assert events[at + 1] == {"type": "TEXT_MESSAGE_END", "messageId": cut}
    starts = [e["messageId"] for e in events if e["type"] == "TEXT_MESSAGE_START"]
    assert starts[0] == cut and len(starts) == 2
    texts = {m: "".join(e["delta"] for e in events
                        if e["type"] == "TEXT_MESSAGE_CONTENT" and e["messageId"] == m)
             for m in starts}
    assert FLAKY.startswith(texts[cut]) and texts[cut] and texts[starts[1]] == FLAKY
    assert kinds[-1] == "RUN_FINISHED" and events[-1]["result"] == FLAKY


async def test_tool_calls_and_results(http: httpx.AsyncClient) -> None:
    events = await ag_ui_events(http, run_input("agui-tool", "r1", user("tool please")))
    kinds = types(events)
    start = kinds.index("TOOL_CALL_START")
    assert kinds[start:start + 3] == ["TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END"]
    call = events[start]
    assert call["toolCallName"] == "lookup"
    assert json.loads(events[start + 1]["delta"]) == {"query": "tool please"}
    result = events[kinds.index("TOOL_CALL_RESULT")]
    assert result["toolCallId"] == call["toolCallId"] and result["content"] == "found tool please"
    assert kinds.count("STEP_STARTED") == kinds.count("STEP_FINISHED") == 2
    assert events[-1]["outcome"] == {"type": "success"}


async def test_leaving_the_stream_mid_text_cancels_the_run_and_keeps_the_partial(
    http: httpx.AsyncClient, served: Served
) -> None:
    abandoned = len([s for s in served.model.streams if s.abandoned])
    seen = await ag_ui_events(http, run_input("agui-abort", "r1", user("long tale")),
                              until="TEXT_MESSAGE_CONTENT")
    assert seen[-1]["delta"]
    await served.model.wait_abandoned(abandoned + 1)  # the model's stream was closed
    state = await settled(http, "agui-abort")
    assert state["status"] == "cancelled"
    messages = state["messages"]
    validate(messages)
    assert messages[-1]["role"] == "assistant" and messages[-1]["aimu_partial"] is True
    assert messages[-1]["content"].startswith(seen[-1]["delta"])


async def test_leaving_the_stream_mid_tool_settles_the_call(
    http: httpx.AsyncClient, served: Served
) -> None:
    GATE.reset()
    body = run_input("agui-midtool", "r1", user("gate 1 3"))
    async with contextlib.aclosing(_stream(http, body)) as stream:
        async for event in stream:
            if event["type"] == "TOOL_CALL_END":
                await GATE.entered(1)  # the tool is running: leave now
                break
    state = await settled(http, "agui-midtool")
    GATE.open()
    assert state["status"] == "cancelled"
    validate(state["messages"])
    assert state["messages"][-1]["role"] == "tool"
    assert "cancelled" in state["messages"][-1]["content"]
    # The page comes back with what it was streamed, ending with the server's own tool
    # result: that is no client-side result, just a page coming back.
    call = state["messages"][-2]["tool_calls"][0]
    back = await ag_ui_events(http, run_input(
        "agui-midtool", "r2", user("gate 1 3"),
        {"id": "a1", "role": "assistant", "content": "calling ", "toolCalls": [
            {"id": call["id"], "type": "function",
             "function": {"name": "gated_lookup", "arguments": "{}"}}]},
        tool_result(call["id"], state["messages"][-1]["content"])))
    assert types(back) == ["RUN_STARTED", "MESSAGES_SNAPSHOT", "RUN_FINISHED"]


async def test_aimu_cancel_route_ends_the_stream_cancelled(
    http: httpx.AsyncClient, served: Served
) -> None:
    body = run_input("agui-route", "r7", user("long road"))
    events: list[dict[str, Any]] = []
    async for event in _stream(http, body):
        events.append(event)
        if event["type"] == "TEXT_MESSAGE_CONTENT" and types(events).count(event["type"]) == 1:
            run_id = (await session(http, "agui-route"))["run_id"]
            cancel = await http.post(f"/runs/{run_id}/cancel", json={"reason": "Stop"})
            assert cancel.status_code == 202, cancel.text
    assert events[-2]["type"] == "STEP_FINISHED" and events[-3]["type"] == "TEXT_MESSAGE_END"
    assert events[-1]["type"] == "RUN_FINISHED"
    assert events[-1]["outcome"] == {"type": "cancelled"}
    assert events[-1]["metadata"]["aimuStatus"] == "cancelled"
    assert events[-1]["metadata"]["reason"] == "Stop"


async def test_an_approval_pause_is_an_interrupt_and_resume_entries_decide_it(
    http: httpx.AsyncClient,
) -> None:
    MAILED.clear()
    paused = await ag_ui_events(http, run_input("agui-mail", "r1", user("mail bob")))
    outcome = paused[-1]["outcome"]
    assert outcome["type"] == "interrupt"
    (interrupt,) = outcome["interrupts"]
    assert interrupt["reason"] == "tool_approval" and "send_email" in interrupt["message"]
    # The interrupt names the call and the very pause it was shown for.
    assert interrupt["id"].startswith(interrupt["toolCallId"] + "@")
    assert MAILED == []
    # The call it names was started before it, its arguments given: the client has it.
    call = [e for e in paused if e.get("toolCallId") == interrupt["toolCallId"]]
    assert types(call) == ["TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END"]
    assert call[0]["toolCallName"] == "send_email"
    assert json.loads(call[1]["delta"]) == interrupt["metadata"]["arguments"]
    # A page that comes back has the call in its snapshot, and so is not started again.
    back = await ag_ui_events(http, run_input("agui-mail", "r1b"))
    (snapshot,) = [e for e in back if e["type"] == "MESSAGES_SNAPSHOT"]
    assert [c["id"] for m in snapshot["messages"] for c in m.get("toolCalls", [])] == [
        interrupt["toolCallId"]]
    assert "TOOL_CALL_START" not in types(back)
    assert back[-1]["outcome"]["interrupts"] == [interrupt]

    # A bad answer changes nothing.
    for resume, status in (
        ([{"interruptId": "nope", "status": "resolved", "payload": True}], 400),
        ([{"interruptId": interrupt["id"], "status": "resolved", "payload": "yes"}], 400),
        ([{"interruptId": interrupt["id"], "status": "resolved", "payload": True}] * 2, 400),
        # An answer for another pause of that call (the session went on meanwhile).
        ([{"interruptId": interrupt["toolCallId"] + "@an-older-pause", "status": "resolved",
           "payload": True}], 409),
    ):
        response = await http.post("/ag-ui", json=run_input("agui-mail", "r2", resume=resume))
        assert response.status_code == status, response.text
    assert (await session(http, "agui-mail"))["pending"]

    resume = [{"interruptId": interrupt["id"], "status": "resolved",
               "payload": {"approved": True}}]
    resumed = await ag_ui_events(http, run_input("agui-mail", "r2", resume=resume))
    assert resumed[0]["runId"] == "r2"
    assert "TOOL_CALL_RESULT" in types(resumed)
    # The resumed run does not start the call again: only its result follows.
    assert [e["type"] for e in resumed if e.get("toolCallId") == interrupt["toolCallId"]] == [
        "TOOL_CALL_RESULT"]
    assert resumed[-1]["outcome"] == {"type": "success"}
    assert resumed[-1]["result"] == "mail result: sent to mail bob"
    assert MAILED == ["mail bob"]

    again = await http.post("/ag-ui", json=run_input("agui-mail", "r3", resume=resume))
    assert again.status_code == 409  # nothing waits any more


async def test_a_dismissed_interrupt_denies_the_call(http: httpx.AsyncClient) -> None:
    MAILED.clear()
    paused = await ag_ui_events(http, run_input("agui-deny", "r1", user("mail eve")))
    (interrupt,) = paused[-1]["outcome"]["interrupts"]
    resume = [{"interruptId": interrupt["id"], "status": "cancelled"}]
    resumed = await ag_ui_events(http, run_input("agui-deny", "r2", resume=resume))
    assert resumed[-1]["outcome"] == {"type": "success"}
    assert "denied" in resumed[-1]["result"]
    assert MAILED == []


async def test_coming_back_gets_a_snapshot_with_the_partial_reply(
    http: httpx.AsyncClient, served: Served
) -> None:
    await ag_ui_events(http, run_input("agui-back", "r1", user("long way")),
                       until="TEXT_MESSAGE_CONTENT")
    await settled(http, "agui-back")
    back = await ag_ui_events(http, run_input("agui-back", "r2"))
    assert types(back) == ["RUN_STARTED", "MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    snapshot = back[1]["messages"]
    assert [m["role"] for m in snapshot] == ["user", "assistant"]
    assert snapshot[1]["metadata"] == {"aimuPartial": True} and snapshot[1]["content"]


async def test_coming_back_during_a_run_follows_it_from_its_start(
    http: httpx.AsyncClient, served: Served
) -> None:
    GATE.reset()
    first = _stream(http, run_input("agui-live", "r1", user("gate 1 3")))
    async with contextlib.aclosing(first):
        async for event in first:
            if event["type"] == "TOOL_CALL_END":
                break
        await GATE.entered(1)
        # The page came back (a second connection) while the first still follows.
        second = _stream(http, run_input("agui-live", "r2"))
        async with contextlib.aclosing(second):
            seen = [await anext(second), await anext(second)]
            assert types(seen) == ["RUN_STARTED", "MESSAGES_SNAPSHOT"]
            assert [m["role"] for m in seen[1]["messages"]] == []  # the run holds the rest
            GATE.open()
            async for event in second:
                seen.append(event)
    kinds = types(seen)
    assert kinds.index("TOOL_CALL_START") < kinds.index("TOOL_CALL_RESULT")
    assert seen[-1]["outcome"] == {"type": "success"}


async def test_bad_input_is_refused_and_changes_nothing(
    http: httpx.AsyncClient, served: Served
) -> None:
    cases: list[tuple[object, int]] = [
        ({"threadId": "x"}, 422),  # no runId, no messages
        (run_input("../etc", "r1", user("hi")), 400),
        (run_input("agui-bad", "r1", {"id": "u", "role": "wizard", "content": "hi"}), 422),
        (run_input("agui-bad", "r1", user("   ")), 400),
        (run_input("agui-bad", "r1", {"id": "u", "role": "user",
                                      "content": [{"type": "binary", "data": "x"}]}), 400),
        (run_input("agui-bad", "r1", user("hi"),
                   tools=[{"name": "no spaces", "description": "ask"}]), 400),
        (run_input("agui-bad", "r1", user("hi"),
                   tools=[{"name": "confirm", "description": "ask", "parameters": []}]), 400),
        (run_input("agui-bad", "r1", user("hi"), tools=[LOCATE, LOCATE]), 400),
        (run_input("agui-bad", "r1", user("hi"),  # the server's own tool's name
                   tools=[{"name": "lookup", "description": "mine"}]), 400),
        (run_input("agui-bad", "r1", user("hi"), tool_result("c1", "x")), 400),
        (run_input("agui-bad", "r1", resume=[{"interruptId": "c", "status": "resolved",
                                              "payload": True}]), 409),
    ]
    for body, status in cases:
        response = await http.post("/ag-ui", json=body)
        assert response.status_code == status, (body, response.text)
        assert "error" in response.json()
    assert (await http.get("/sessions/agui-bad")).status_code == 404

    # A second run on a busy thread is refused; the first goes on.
    GATE.reset()
    first = _stream(http, run_input("agui-busy", "r1", user("gate 1 2")))
    async with contextlib.aclosing(first):
        async for event in first:
            if event["type"] == "TOOL_CALL_END":
                break
        busy = await http.post("/ag-ui", json=run_input("agui-busy", "r2", user("meanwhile")))
        assert busy.status_code == 409, busy.text
        GATE.open()
        rest = [event async for event in first]
    assert rest[-1]["outcome"] == {"type": "success"}
    users = [m for m in (await session(http, "agui-busy"))["messages"] if m["role"] == "user"]
    assert [m["content"] for m in users] == ["gate 1 2"]


# -- client-side tools: declared by the page, run by the page --------------------------------

LOCATE = {"name": "locate", "description": "Where the user is, from the browser",
          "parameters": {"type": "object", "properties": {"precise": {"type": "boolean"}}}}


def tool_result(call_id: str, content: str, message_id: str = "t1") -> dict[str, Any]:
    return {"id": message_id, "role": "tool", "toolCallId": call_id, "content": content}


async def test_a_client_side_tool_call_ends_the_run_and_its_result_continues_it(
    http: httpx.AsyncClient, served: Served
) -> None:
    thread = "agui-locate"
    asked = run_input(thread, "r1", user("locate me"), tools=[LOCATE])
    # The page leaves once it has the call: the run paused on it, so nothing is cancelled.
    paused = await ag_ui_events(http, asked, until="TOOL_CALL_END")
    kinds = types(paused)
    start = paused[kinds.index("TOOL_CALL_START")]
    assert start["toolCallName"] == "locate"
    assert start["parentMessageId"] == paused[kinds.index("TEXT_MESSAGE_START")]["messageId"]
    assert json.loads(paused[kinds.index("TOOL_CALL_ARGS")]["delta"]) == {"precise": True}
    call_id = start["toolCallId"]
    waiting = await session(http, thread)
    assert waiting["status"] == "paused"
    (pending,) = waiting["pending"]
    assert pending["external"] is True and pending["call_id"] == call_id
    # Coming back shows the same end: the call (in the snapshot: not started again, as a
    # client would then have its arguments twice), and the outcome naming it.
    back = await ag_ui_events(http, run_input(thread, "r1b"))
    assert back[-1]["outcome"] == {"type": "success", "pendingToolCallIds": [call_id]}
    (snapshot,) = [e for e in back if e["type"] == "MESSAGES_SNAPSHOT"]
    assert [c for m in snapshot["messages"] for c in m.get("toolCalls", [])] == [
        {"id": call_id, "type": "function",
         "function": {"name": "locate", "arguments": '{"precise": true}'}}]
    assert "TOOL_CALL_START" not in types(back)
    requests = len(served.model.requests)

    # What changes nothing: an unknown call's result, a yes instead of the result, a new
    # message while the call waits, aimu's cancel route (the run is not running).
    assistant = {"id": "a1", "role": "assistant", "content": "let me see", "toolCalls": [
        {"id": call_id, "type": "function",
         "function": {"name": "locate", "arguments": '{"precise": true}'}}]}
    for body, status in (
        (run_input(thread, "r2", user("locate me"), assistant, tool_result("nope", "x")), 400),
        (run_input(thread, "r2", resume=[{"interruptId": call_id, "status": "resolved",
                                          "payload": True}]), 400),
        (run_input(thread, "r2", user("locate me"), assistant, tool_result(call_id, "x"),
                   user("never mind", "u2")), 409),
    ):
        response = await http.post("/ag-ui", json=body)
        assert response.status_code == status, response.text
        assert call_id not in response.text or "nope" not in response.text
    cancel = await http.post(f"/runs/{waiting['paused_run_id']}/cancel", json={})
    assert cancel.status_code == 409, cancel.text
    assert (await session(http, thread))["pending"] == waiting["pending"]
    assert len(served.model.requests) == requests

    answer = run_input(thread, "r2", user("locate me"), assistant,
                       tool_result(call_id, "Bergen"), tools=[LOCATE])
    resumed = await ag_ui_events(http, answer)
    # The page has the call and its result: neither is streamed back to it.
    assert "TOOL_CALL_START" not in types(resumed) and "TOOL_CALL_RESULT" not in types(resumed)
    assert resumed[-1]["outcome"] == {"type": "success"}
    assert resumed[-1]["result"] == "you are in Bergen"
    assert len(served.model.requests) == requests + 1  # the paused turn was not asked again
    stored = (await session(http, thread))["messages"]
    validate(stored)
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[2]["content"] == "Bergen" and stored[2]["tool_call_id"] == call_id

    duplicate = await http.post("/ag-ui", json=answer)  # the same result again
    assert duplicate.status_code == 409, duplicate.text
    assert "has its result already" in duplicate.json()["error"]
    assert (await session(http, thread))["messages"] == stored


async def test_a_client_side_call_dismissed_and_stops_before_and_after_its_result(
    http: httpx.AsyncClient, served: Served
) -> None:
    paused = await ag_ui_events(http, run_input("agui-dismiss", "r1", user("locate"),
                                                tools=[LOCATE]))
    (call_id,) = paused[-1]["outcome"]["pendingToolCallIds"]
    dismissed = await ag_ui_events(http, run_input(
        "agui-dismiss", "r2", resume=[{"interruptId": call_id, "status": "cancelled"}]))
    assert dismissed[-1]["result"].startswith("you are in [denied")

    # A stop in the run that goes on with the result: the result and the partial are kept.
    abandoned = len([s for s in served.model.streams if s.abandoned])
    ask = user("locate slowly")
    paused = await ag_ui_events(http, run_input("agui-slow", "r1", ask, tools=[LOCATE]))
    (call_id,) = paused[-1]["outcome"]["pendingToolCallIds"]
    body = run_input("agui-slow", "r2", ask, tool_result(call_id, "Oslo"), tools=[LOCATE])
    await ag_ui_events(http, body, until="TEXT_MESSAGE_CONTENT")
    await served.model.wait_abandoned(abandoned + 1)
    state = await settled(http, "agui-slow")
    assert state["status"] == "cancelled" and state["pending"] == []
    validate(state["messages"])
    assert [m["role"] for m in state["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert state["messages"][2]["content"] == "Oslo"
    assert state["messages"][3]["aimu_partial"] is True

    # Without the page's tools the model has no such tool to call.
    plain = await ag_ui_events(http, run_input("agui-notools", "r1", user("locate")))
    assert plain[-1]["result"].startswith("no locate tool")

    # A stop while the model is still making the turn that calls it: nothing waits.
    abandoned = len([s for s in served.model.streams if s.abandoned])
    body = run_input("agui-locate-stop", "r1", user("locate long"), tools=[LOCATE])
    await ag_ui_events(http, body, until="TEXT_MESSAGE_CONTENT")
    await served.model.wait_abandoned(abandoned + 1)
    state = await settled(http, "agui-locate-stop")
    assert state["status"] == "cancelled" and state["pending"] == []
    validate(state["messages"])


async def test_the_decision_route_takes_a_client_side_result(http: httpx.AsyncClient) -> None:
    """``POST /runs/{id}/approvals/{call}`` with ``result``: the REST way to answer."""
    MAILED.clear()
    await ag_ui_events(http, run_input("agui-rest", "r1", user("locate"), tools=[LOCATE]))
    waiting = await session(http, "agui-rest")
    run_id, (call,) = waiting["paused_run_id"], waiting["pending"]
    route = f"/runs/{run_id}/approvals/{call['call_id']}"
    for body, said in (({"approve": True}, "send its result"),
                       ({"approve": False, "result": "x"}, "a denial has no result")):
        refused = await http.post(route, json=body)
        assert refused.status_code == 400 and said in refused.json()["error"], refused.text
    assert (await session(http, "agui-rest"))["pending"] == waiting["pending"]
    answered = await http.post(route, json={"approve": True, "result": "Rome",
                                            "pause_id": call["pause_id"]})
    assert answered.status_code == 202, answered.text
    resumed = answered.json()["resumed_run_id"]
    async with http.stream("GET", f"/runs/{resumed}/events") as response:
        async for _ in response.aiter_lines():
            pass
    assert (await session(http, "agui-rest"))["messages"][-1]["content"] == "you are in Rome"

    # A result for a call that waits for approval is refused too.
    await ag_ui_events(http, run_input("agui-rest-mail", "r1", user("mail kim")))
    mail = await session(http, "agui-rest-mail")
    wrong = await http.post(f"/runs/{mail['paused_run_id']}/approvals/"
                            f"{mail['pending'][0]['call_id']}",
                            json={"approve": True, "result": "sent, trust me"})
    assert wrong.status_code == 400 and "not for a result" in wrong.json()["error"]
    assert MAILED == [] and (await session(http, "agui-rest-mail"))["pending"]


async def test_state_reaches_the_tools_and_comes_back_as_a_snapshot(
    http: httpx.AsyncClient,
) -> None:
    thread = "agui-state"
    first = await ag_ui_events(http, run_input(thread, "r1", user("remember milk"),
                                               state={"notes": ["eggs"], "theme": "dark"}))
    assert first[-1]["result"] == "noted; had ['eggs']"  # the tool read the page's state
    (snapshot,) = [e for e in first if e["type"] == "STATE_SNAPSHOT"]
    assert snapshot["snapshot"] == {"notes": ["eggs", "milk"], "theme": "dark"}
    assert types(first)[-2:] == ["STATE_SNAPSHOT", "RUN_FINISHED"]
    # No state sent: the thread's is kept (it lives in the session's state).
    second = await ag_ui_events(http, run_input(thread, "r2", user("remember tea", "u2")))
    assert second[-1]["result"] == "noted; had ['eggs', 'milk']"
    back = await ag_ui_events(http, run_input(thread, "r3"))
    assert back[-2]["snapshot"]["notes"] == ["eggs", "milk", "tea"]
    # State that is not an object is refused, and nothing changes.
    bad = await http.post("/ag-ui", json=run_input(thread, "r4", user("remember x", "u3"),
                                                   state=["not", "an", "object"]))
    assert bad.status_code == 400, bad.text
    again = await ag_ui_events(http, run_input(thread, "r5"))
    assert again[-2]["snapshot"]["notes"] == ["eggs", "milk", "tea"]
    # A thread without state: the tool is told, and no snapshot is sent.
    plain = await ag_ui_events(http, run_input("agui-nostate", "r1", user("remember x")))
    assert plain[-1]["result"] == "noted; no shared state"
    assert "STATE_SNAPSHOT" not in types(plain)


async def test_a_foreign_origin_is_refused(http: httpx.AsyncClient) -> None:
    response = await http.post(
        "/ag-ui", json=run_input("agui-x", "r1", user("hi")),
        headers={"Origin": "https://evil.example"},
    )
    assert response.status_code == 403
    assert (await http.get("/sessions/agui-x")).status_code == 404




# -- the AG-UI project's own client (@ag-ui/client from npm, in Node) ----------------------

CLIENT = Path(__file__).with_name("ag_ui_client.mjs")




def client_events(lines: list[Any]) -> list[dict[str, Any]]:
    return [line["event"] for line in lines if "event" in line]


async def test_the_ag_ui_client_runs_and_keeps_the_answer(served: Served) -> None:
    lines = await node_client(CLIENT, served, "run", "agui-js", "tool please")
    events = client_events(lines)
    assert events[0]["type"] == "RUN_STARTED" and events[-1]["type"] == "RUN_FINISHED"
    end = lines[-1]["end"]
    assert end["error"] is None
    roles = [m["role"] for m in end["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert end["messages"][2]["content"] == "found tool please"


async def test_the_ag_ui_clients_abort_stops_the_run_server_side(
    served: Served, http: httpx.AsyncClient
) -> None:
    abandoned = len([s for s in served.model.streams if s.abandoned])
    lines = await node_client(CLIENT, served, "abort", "agui-js-abort", "long saga")
    events = client_events(lines)
    # The client ends its side itself (RUN_ERROR "abort"); the server sent no end of its own.
    assert events[-1]["type"] == "RUN_ERROR" and events[-1]["code"] == "abort"
    assert "RUN_FINISHED" not in types(events)
    await served.model.wait_abandoned(abandoned + 1)
    state = await settled(http, "agui-js-abort")
    assert state["status"] == "cancelled"
    validate(state["messages"])
    assert state["messages"][-1]["aimu_partial"] is True

    # The page comes back: the client gets the session, the partial reply in it.
    back = await node_client(CLIENT, served, "back", "agui-js-abort")
    messages = back[-1]["end"]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["content"] == state["messages"][-1]["content"]


def tool_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [call for m in messages if m["role"] == "assistant" for call in m.get("toolCalls", [])]


async def test_the_ag_ui_client_answers_an_interrupt(served: Served) -> None:
    MAILED.clear()
    lines = await node_client(CLIENT, served, "approve", "agui-js-mail", "mail ann")
    (paused,) = [line for line in lines if "interrupts" in line]
    (interrupt,) = paused["interrupts"]
    assert interrupt["reason"] == "tool_approval"
    # The call the interrupt names is in the client's messages when it is asked: the
    # client applied its TOOL_CALL_START/ARGS/END, streamed before the outcome.
    (call,) = tool_calls(paused["messages"])
    assert call["id"] == interrupt["toolCallId"] and call["function"]["name"] == "send_email"
    assert json.loads(call["function"]["arguments"]) == {"to": "mail ann"}
    end = lines[-1]["end"]
    assert end["error"] is None and end["pending"] == []
    assert end["result"] == "mail result: sent to mail ann"
    assert MAILED == ["mail ann"]
    # The resumed run added its result, not the call a second time (or its arguments twice).
    assert tool_calls(end["messages"]) == [call]
    assert [(m["role"], m.get("toolCallId")) for m in end["messages"]] == [
        ("user", None), ("assistant", None), ("tool", call["id"]), ("assistant", None)]


async def test_the_ag_ui_client_stops_mid_tool_and_runs_a_client_side_tool(
    served: Served, http: httpx.AsyncClient
) -> None:
    """Two scenarios in one Node process (each costs its start-up): the client's abort
    while a server-side tool runs, and the page's own tool answered by a following run."""
    GATE.reset()

    async def on_line(line: Any) -> bytes | None:
        if "waiting" not in line:
            return None
        await GATE.entered(1)  # the server-side tool is running: the client aborts now
        return b"abort\n"

    lines = await node_client(CLIENT, served, "tools", "agui-js", "gate 1 3", on_line=on_line)
    GATE.open()
    cut = lines.index(next(line for line in lines if "stopped" in line))
    stop_events = client_events(lines[:cut])
    assert "TOOL_CALL_END" in types(stop_events) and "RUN_FINISHED" not in types(stop_events)
    state = await settled(http, "agui-js-stop")
    assert state["status"] == "cancelled"
    validate(state["messages"])
    assert state["messages"][-1]["role"] == "tool"
    assert "cancelled" in state["messages"][-1]["content"]

    (asked,) = [line["asked"] for line in lines if "asked" in line]
    assert asked["error"] is None and len(asked["outcome"]["pendingToolCallIds"]) == 1
    (answered,) = [line for line in lines if "answered" in line]
    assert answered["answered"]["error"] is None
    assert answered["answered"]["result"] == "you are in Bergen"
    assert answered["state"] == {"theme": "dark"}  # the page's state, kept by the thread
    assert [m["role"] for m in answered["messages"]] == ["user", "assistant", "tool", "assistant"]
    (call,) = answered["messages"][1]["toolCalls"]  # the client kept the call and its answer
    assert call["id"] == asked["outcome"]["pendingToolCallIds"][0]
    (duplicate,) = [line["again"] for line in lines if "again" in line]
    assert duplicate["result"] is None and "409" in duplicate["error"]
    (left,) = [line["left"] for line in lines if "left" in line]
    assert len(left["outcome"]["pendingToolCallIds"]) == 1
    (bogus,) = [line["bogus"] for line in lines if "bogus" in line]
    assert bogus["result"] is None and "400" in bogus["error"]
    assert lines[-1]["end"] == {"result": "you are in Oslo", "error": None,
                                "outcome": {"type": "success"}}
    stored = (await session(http, "agui-js-page"))["messages"]
    validate(stored)
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[2]["content"] == "Bergen"


@pytest.mark.slow
async def test_a_page_coming_back_after_a_killed_server_finds_its_run_going_on(
    served: Served, tmp_path: Path
) -> None:
    def stream(http: httpx.AsyncClient) -> AsyncIterator[dict[str, Any]]:
        return _stream(http, run_input("agui-kill", "r1", user("short 300")))

    async with restarted_after_a_kill(
        served, tmp_path, stream, lambda event: event["type"] == "TEXT_MESSAGE_CONTENT"
    ) as http:
        back = await ag_ui_events(http, run_input("agui-kill", "r2"))
        assert shape(back)[:2] == ["RUN_STARTED", "MESSAGES_SNAPSHOT"]
        assert [m["role"] for m in back[1]["messages"]] == ["user"]
        assert back[-1]["outcome"] == {"type": "success"}
        assert back[-1]["result"].endswith("c299")
        stored = (await session(http, "agui-kill"))["messages"]
    validate(stored)
    assert [m["role"] for m in stored] == ["user", "assistant"]
