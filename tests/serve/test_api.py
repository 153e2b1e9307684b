"""The runs API over real HTTP: every route, every error status, SSE resume, stops.

Stops land at provable points: after the follower saw a text event of the run, and the
model server is asked whether it saw the stream abandoned.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from aimu.aio.transcript import validate
from aimu.serve.application import openapi_document
from tests.serve.harness import (
    FLAKY,
    Served,
    collect,
    first_text,
    sse_events,
    start,
)


async def finished(http: httpx.AsyncClient, run_id: str) -> dict[str, object]:
    """Follow the run to its terminal event; return GET /runs/{id}."""
    events = await collect(http, run_id)
    assert events[-1].type == "handle_finished"
    response = await http.get(f"/runs/{run_id}")
    assert response.status_code == 200
    body: dict[str, object] = response.json()
    return body


# -- the happy path ----------------------------------------------------------------------


async def test_health_needs_nothing(http: httpx.AsyncClient) -> None:
    response = await http.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


ROUTES = {
    ("/health", "GET"), ("/sessions", "GET"), ("/sessions/{session}", "GET"),
    ("/sessions/{session}", "DELETE"), ("/sessions/{session}/runs", "POST"),
    ("/sessions/{session}/resume", "POST"), ("/runs", "GET"), ("/runs/{run_id}", "GET"),
    ("/runs/{run_id}/events", "GET"), ("/runs/{run_id}/cancel", "POST"), ("/runs/cancel", "POST"),
    ("/runs/{run_id}/interrupt", "POST"), ("/runs/{run_id}/stop", "POST"),
    ("/runs/{run_id}/send", "POST"), ("/runs/{run_id}/approvals/{call_id}", "POST"),
    # The protocols frontends speak (A2A and MCP have documents of their own: the agent
    # card, the MCP handshake).
    ("/ag-ui", "POST"), ("/api/chat", "POST"), ("/api/chat/{id}/stream", "GET"),
    ("/api/chat/{id}/stream", "POST"), ("/api/chat/{id}/stop", "POST"),
}


async def test_the_openapi_document_and_the_docs_page(
    http: httpx.AsyncClient, served: Served
) -> None:
    response = await http.get("/openapi.json")
    assert response.status_code == 200
    document = response.json()
    assert document == served.app.openapi() == openapi_document()  # written from the routes
    assert document["openapi"].startswith("3.1")
    documented = {
        (path, method.upper()) for path, item in document["paths"].items() for method in item
    }
    assert documented == ROUTES
    for path, method in ROUTES:  # every error a route answers has the one error shape
        for status, answer in document["paths"][path][method.lower()]["responses"].items():
            if status[0] in "45":
                schema = answer["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/Error"}, (path, method, status)
    page = await http.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "swagger" in page.text.lower() and "/openapi.json" in page.text


async def test_a_run_from_start_to_end(http: httpx.AsyncClient) -> None:
    response = await http.post("/sessions/alpha/runs", json={"task": "hello"})
    assert response.status_code == 202
    body = response.json()
    run_id = body["run_id"]
    assert body["session"] == "alpha"
    assert response.headers["location"] == f"/runs/{run_id}"

    events = await collect(http, run_id)
    assert [e.id for e in events] == [str(i) for i in range(1, len(events) + 1)]
    types = [e.type for e in events]
    assert types[0] == "run_started" and types[-2:] == ["run_finished", "handle_finished"]
    assert "".join(e.data["text"] for e in events if e.type == "text") == "answer to hello"
    assert events[-1].data["status"] == "completed"

    run = (await http.get(f"/runs/{run_id}")).json()
    assert run["status"] == "completed"
    assert run["reply"] == "answer to hello"
    assert run["task"] == "hello"
    assert run["usage"]["output_tokens"] > 0
    assert run["finished_at"] >= run["created_at"] and run["duration"] >= 0
    assert run["events"] == len(events)

    session = (await http.get("/sessions/alpha")).json()
    assert session["status"] == "completed" and session["run_id"] is None
    assert [m["role"] for m in session["messages"]] == ["user", "assistant"]
    listed = (await http.get("/sessions")).json()["sessions"]
    assert [(s["name"], s["message_count"]) for s in listed] == [("alpha", 2)]

    # The session is free again: the next run continues the conversation.
    second = await start(http, "alpha", "again")
    assert (await finished(http, second))["reply"] == "answer to again"
    messages = (await http.get("/sessions/alpha")).json()["messages"]
    assert [m["content"] for m in messages if m["role"] == "user"] == ["hello", "again"]


async def test_an_answer_cut_off_is_reported_incomplete(http: httpx.AsyncClient) -> None:
    run_id = await start(http, "cut", "cut it short")
    events = await collect(http, run_id)
    final = next(e.data for e in events if e.type == "run_finished")
    assert (final["status"], final["stop_reason"], final["requests"]) == ("incomplete", "length", 1)
    assert events[-1].data["status"] == "incomplete"
    run = (await http.get(f"/runs/{run_id}")).json()
    assert (run["status"], run["reply"]) == ("incomplete", "cut off in the mid")
    assert (await http.get("/sessions/cut")).json()["status"] == "incomplete"


async def test_a_tool_round_streams_its_events(http: httpx.AsyncClient) -> None:
    run_id = await start(http, "tools", "tool please")
    events = await collect(http, run_id)
    types = [e.type for e in events]
    assert types.index("tool_call") < types.index("tool_result") < types.index("step_finished")
    result = next(e for e in events if e.type == "tool_result")
    assert result.data["content"] == "found tool please"
    assert events[-1].data["status"] == "completed"


# -- stopping ------------------------------------------------------------------------------


async def test_the_stored_run_records_listed(http: httpx.AsyncClient) -> None:
    """GET /runs: the store's run records, newest first, filtered, a page at a time; bad
    filters answered 400 (422 for a limit out of range) in the one error shape."""
    started = []
    for task in ("one", "two"):
        started.append(await start(http, "listed", task))
        assert (await finished(http, started[-1]))["status"] == "completed"
    response = await http.get("/runs", params={"session": "listed"})
    assert response.status_code == 200
    body = response.json()
    runs = body["runs"]
    assert [r["status"] for r in runs] == ["completed", "completed"]
    assert [r["id"] for r in runs] == started[::-1]  # the run ids GET /runs/{id} knows
    assert runs[0]["started"] >= runs[1]["started"] and body["next_before"] is None
    assert runs[0]["session"] == "listed" and runs[0]["ended"] >= runs[0]["started"]
    assert runs[0]["usage"]["output_tokens"] > 0 and runs[0]["models"]
    page = (await http.get("/runs", params={"session": "listed", "limit": 1})).json()
    assert page["runs"] == runs[:1] and page["next_before"] == runs[0]["id"]
    rest = await http.get(
        "/runs", params={"session": "listed", "limit": 1, "before": page["next_before"]}
    )
    assert rest.json()["runs"] == runs[1:]
    assert (await http.get("/runs", params={"status": "cancelled", "session": "listed"})).json()[
        "runs"] == []
    for params, status, says in [
        ({"status": "done"}, 400, "unknown run status 'done'"),
        ({"before": "nope"}, 400, "unknown run id 'nope'"),
        ({"session": "a b"}, 400, "invalid session name"),
        ({"limit": 0}, 400, "limit"),
    ]:
        bad = await http.get("/runs", params=params)
        assert bad.status_code == status and says in bad.json()["error"], bad.json()


async def test_cancel_keeps_the_partial_reply_and_frees_the_session(
    http: httpx.AsyncClient, served: Served
) -> None:
    abandoned_before = len([s for s in served.model.streams if s.abandoned])
    run_id = await start(http, "stopme", "long story")
    await first_text(http, run_id)

    busy = await http.post("/sessions/stopme/runs", json={"task": "meanwhile"})
    assert busy.status_code == 409
    assert run_id in busy.json()["error"]

    response = await http.post(f"/runs/{run_id}/cancel", json={"reason": "user pressed Stop"})
    assert response.status_code == 202
    events = await collect(http, run_id)
    assert events[-1].type == "handle_finished"
    assert events[-1].data["status"] == "cancelled"
    assert events[-1].data["reason"] == "user pressed Stop"
    assert events[-2].type == "run_finished" and events[-2].data["status"] == "cancelled"
    await served.model.wait_abandoned(abandoned_before + 1)

    run = (await http.get(f"/runs/{run_id}")).json()
    assert run["status"] == "cancelled" and run["reason"] == "user pressed Stop"
    # A cancel somebody asked for is no error (the run ended by CancelledError inside).
    assert run["error"] is None
    assert events[-1].data["error"] is None and events[-2].data["error"] is None
    messages = (await http.get("/sessions/stopme")).json()["messages"]
    validate(messages)
    partial = messages[-1]
    assert partial["role"] == "assistant" and partial.get("aimu_partial")
    assert partial["content"] and "w0" in partial["content"]

    again = await http.post(f"/runs/{run_id}/cancel")
    assert again.status_code == 409
    assert "already ended" in again.json()["error"]
    assert (await finished(http, await start(http, "stopme", "next")))["status"] == "completed"


async def test_interrupt_stops_at_the_step_boundary(http: httpx.AsyncClient) -> None:
    run_id = await start(http, "intr", "tool then stop")
    await first_text(http, run_id)
    response = await http.post(f"/runs/{run_id}/interrupt")
    assert response.status_code == 202
    events = await collect(http, run_id)
    types = [e.type for e in events]
    assert "tool_result" in types  # the step in flight finished ...
    assert events[-1].data["status"] == "interrupted"  # ... and the run stopped after it
    assert events[-2].data["reply"] == "Run interrupted."
    messages = (await http.get("/sessions/intr")).json()["messages"]
    validate(messages)
    assert messages[-1]["role"] == "tool"

    # Resume continues exactly there, with no new user message.
    response = await http.post("/sessions/intr/resume")
    assert response.status_code == 202
    resumed = await finished(http, response.json()["run_id"])
    assert resumed["status"] == "completed" and resumed["task"] is None
    messages = (await http.get("/sessions/intr")).json()["messages"]
    assert [m["role"] for m in messages].count("user") == 1
    assert messages[-1]["role"] == "assistant"


async def test_stop_with_no_grace_cancels(http: httpx.AsyncClient, served: Served) -> None:
    abandoned_before = len([s for s in served.model.streams if s.abandoned])
    run_id = await start(http, "stop0", "long again")
    await first_text(http, run_id)
    response = await http.post(f"/runs/{run_id}/stop?grace=0")
    assert response.status_code == 202
    events = await collect(http, run_id)
    assert events[-1].data["status"] == "cancelled"
    assert "stop()" in events[-1].data["reason"]
    await served.model.wait_abandoned(abandoned_before + 1)


async def test_stop_with_grace_lets_the_step_finish(http: httpx.AsyncClient) -> None:
    run_id = await start(http, "stopg", "tool with grace")
    await first_text(http, run_id)
    assert (await http.post(f"/runs/{run_id}/stop?grace=60")).status_code == 202
    events = await collect(http, run_id)
    assert events[-1].data["status"] == "interrupted"


# -- following -------------------------------------------------------------------------------


async def test_last_event_id_resumes_without_loss_or_repeat(http: httpx.AsyncClient) -> None:
    run_id = await start(http, "follow", "short 30")
    head: list[str] = []
    stream = sse_events(http, f"/runs/{run_id}/events")
    async for event in stream:
        head.append(event.id)
        if len(head) == 5:
            break
    await stream.aclose()  # the follower drops mid-run
    tail = await collect(http, run_id, {"Last-Event-ID": head[-1]})
    whole = await collect(http, run_id)
    assert head + [e.id for e in tail] == [e.id for e in whole]
    assert whole[-1].type == "handle_finished"
    by_query = [e async for e in sse_events(http, f"/runs/{run_id}/events?after=3")]
    assert [e.id for e in by_query] == [e.id for e in whole[3:]]
    after_end = await collect(http, run_id, {"Last-Event-ID": whole[-1].id})
    assert after_end == []


async def test_a_dropped_follower_does_not_stop_the_run(
    http: httpx.AsyncClient, served: Served
) -> None:
    run_id = await start(http, "drop", "short 40")
    await first_text(http, run_id)  # ... and the connection closes
    async with httpx.AsyncClient(base_url=served.url) as other:
        events = await collect(other, run_id)
    assert events[-1].data["status"] == "completed"
    assert events[-2].data["reply"] == " ".join(f"c{i}" for i in range(40))


async def test_a_follower_is_told_when_the_network_cut_the_reply(
    http: httpx.AsyncClient,
) -> None:
    """Issue 44: the SSE stream carries one turn_retried; the text after it is the reply."""
    run_id = await start(http, "flaky-api", "flaky api")
    events = await collect(http, run_id)
    (retried,) = [e for e in events if e.type == "turn_retried"]
    assert (retried.data["mode"], retried.data["kept"]) == ("restarted", "")
    after = events[events.index(retried):]
    assert "".join(e.data["text"] for e in after if e.type == "text") == FLAKY
    assert events[-2].data["status"] == "completed" and events[-2].data["retries"] == 1


async def test_many_followers_see_the_same_events(http: httpx.AsyncClient) -> None:
    run_id = await start(http, "many", "short 20")
    runs = await asyncio.gather(*(collect(http, run_id) for _ in range(10)))
    assert all(r == runs[0] for r in runs)
    assert runs[0][-1].type == "handle_finished"


# -- sessions ---------------------------------------------------------------------------------


async def test_delete_a_session(http: httpx.AsyncClient) -> None:
    await finished(http, await start(http, "gone", "hello"))
    assert (await http.delete("/sessions/gone")).status_code == 204
    assert (await http.get("/sessions/gone")).status_code == 404
    assert (await http.delete("/sessions/gone")).status_code == 404


async def test_delete_while_running_is_refused(http: httpx.AsyncClient) -> None:
    run_id = await start(http, "busy", "long")
    await first_text(http, run_id)
    response = await http.delete("/sessions/busy")
    assert response.status_code == 409 and run_id in response.json()["error"]
    await http.post(f"/runs/{run_id}/cancel")
    await collect(http, run_id)
    assert (await http.get("/sessions/busy")).status_code == 200


async def test_resume_with_nothing_to_resume(http: httpx.AsyncClient) -> None:
    response = await http.post("/sessions/empty/resume")
    assert response.status_code == 409
    assert "nothing to resume" in response.json()["error"]


async def test_resume_a_finished_session_is_409(http: httpx.AsyncClient) -> None:
    await finished(http, await start(http, "done", "hello"))
    before = (await http.get("/sessions/done")).json()
    response = await http.post("/sessions/done/resume")
    assert response.status_code == 409, response.text
    assert "finished its last run (completed): nothing to resume" in response.json()["error"]
    assert (await http.get("/sessions/done")).json() == before  # no run, nothing added


# -- errors -------------------------------------------------------------------------------------

UNKNOWN_RUN = "A" * 22
JSON_BODY = {"Content-Type": "application/json"}


async def post_json(http: httpx.AsyncClient, path: str, body: object) -> httpx.Response:
    """POST ``body`` (bytes, or an async iterator of them) declared as JSON."""
    return await http.post(path, content=body, headers=JSON_BODY)  # type: ignore[arg-type]


async def expect(response: httpx.Response, status: int, words: str = "") -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["status"] == status
    assert words.lower() in body["error"].lower(), body


async def test_400s(http: httpx.AsyncClient) -> None:
    await expect(await post_json(http, "/sessions/a/runs", b"{nope"), 400, "not JSON")
    await expect(await post_json(http, "/sessions/a/runs", b"\xff\xfe"), 400, "not JSON")
    await expect(await http.post("/sessions/a b/runs", json={"task": "x"}), 400, "session name")
    await expect(await http.get("/sessions/%2E%2E"), 400, "session name")
    await expect(await http.get("/sessions/..%2F..%2Fetc"), 404, "no route")  # never a name
    await expect(await http.post("/sessions/a/runs", json={"task": "   "}), 400, "empty")
    run_id = await start(http, "errs", "short 3")
    bad_id = {"Last-Event-ID": "x1"}
    await expect(await http.get(f"/runs/{run_id}/events", headers=bad_id), 400, "Last-Event-ID")
    await collect(http, run_id)
    await expect(
        await http.get(f"/runs/{run_id}/events", headers={"Last-Event-ID": "999"}), 400, "past"
    )


async def test_stop_grace_is_checked(http: httpx.AsyncClient) -> None:
    run_id = await start(http, "grace", "long")
    await first_text(http, run_id)
    for bad in ("abc", "-1", "nan", "inf", "1e9", "1" + "0" * 400):
        await expect(await http.post(f"/runs/{run_id}/stop?grace={bad}"), 400, "grace")
    assert (await http.get(f"/runs/{run_id}")).json()["status"] == "running"
    await http.post(f"/runs/{run_id}/cancel")
    await collect(http, run_id)


async def test_404s(http: httpx.AsyncClient) -> None:
    await expect(await http.get(f"/runs/{UNKNOWN_RUN}"), 404, "no run")
    await expect(await http.get("/runs/not-an-id"), 404, "no run")
    await expect(await http.get(f"/runs/{UNKNOWN_RUN}/events"), 404, "no run")
    await expect(await http.post(f"/runs/{UNKNOWN_RUN}/cancel"), 404, "no run")
    await expect(await http.post(f"/runs/{UNKNOWN_RUN}/interrupt"), 404, "no run")
    await expect(await http.post(f"/runs/{UNKNOWN_RUN}/stop"), 404, "no run")
    await expect(await http.post(f"/runs/{UNKNOWN_RUN}/send", json={"text": "x"}), 404, "no run")
    await expect(
        await http.post(f"/runs/{UNKNOWN_RUN}/approvals/c1", json={"approve": True}), 404, "no run"
    )
    await expect(await http.get("/sessions/never"), 404, "no session")
    await expect(await http.delete("/sessions/never"), 404, "no session")
    await expect(await http.get("/nowhere"), 404, "no route")
    await expect(await http.delete("/runs/" + UNKNOWN_RUN), 405, "not allowed")


async def test_409s(http: httpx.AsyncClient) -> None:
    run_id = await start(http, "c409", "short 2")
    await collect(http, run_id)
    for action in ("cancel", "interrupt", "stop"):
        await expect(await http.post(f"/runs/{run_id}/{action}"), 409, "already ended")
    await expect(await http.post(f"/runs/{run_id}/send", json={"text": "hi"}), 409, "already ended")
    decision = {"approve": True}
    await expect(
        await http.post(f"/runs/{run_id}/approvals/call_1", json=decision), 409, "not paused"
    )


async def test_413_with_and_without_content_length(http: httpx.AsyncClient, served: Served) -> None:
    big = b'{"task": "' + b"x" * (2 << 20) + b'"}'
    await expect(await post_json(http, "/sessions/big/runs", big), 413, "limit")

    async def chunks():  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b" " * 65536

    await expect(await post_json(http, "/sessions/big/runs", chunks()), 413, "limit")
    assert (await http.get("/sessions/big")).status_code == 404  # nothing changed


async def test_422s(http: httpx.AsyncClient) -> None:
    await expect(await http.post("/sessions/a/runs", json={}), 422, "'task' is required")
    await expect(await http.post("/sessions/a/runs", json={"task": 3}), 422, "must be a string")
    await expect(await http.post("/sessions/a/runs", json=["task"]), 422, "JSON object")
    surrogate = b'{"task": "hi \\ud800"}'
    await expect(await post_json(http, "/sessions/a/runs", surrogate), 422, "lone surrogate")
    await expect(
        await http.post("/sessions/a/runs", json={"task": "x", "model": "y"}), 422, "unknown field"
    )
    await expect(await http.post("/sessions/a/resume", json={"task": "x"}), 422, "unknown field")
    run_id = await start(http, "v422", "long")
    await first_text(http, run_id)
    await expect(await http.post(f"/runs/{run_id}/send", json={}), 422, "'text' is required")
    decision = {"approve": "yes"}
    await expect(
        await http.post(f"/runs/{run_id}/approvals/c1", json=decision), 422, "true or false"
    )
    await expect(await http.post(f"/runs/{run_id}/cancel", json={"reason": 5}), 422, "string")
    assert (await http.get(f"/runs/{run_id}")).json()["status"] == "running"  # nothing changed
    await http.post(f"/runs/{run_id}/cancel")
    await collect(http, run_id)


# -- a stop landing at each point of a run --------------------------------------------------

ALLOWED = {
    "cancel": {"cancelled"},
    "interrupt": {"interrupted"},
    "stop?grace=0": {"cancelled", "interrupted"},
}
STOP_POINTS = ["accepted", "run_started", "text", "tool_call", "tool_result", "step_finished"]


@pytest.mark.parametrize("action", ["cancel", "interrupt", "stop?grace=0"])
@pytest.mark.parametrize("point", STOP_POINTS)
async def test_a_stop_landing_at_each_point(
    http: httpx.AsyncClient, served: Served, point: str, action: str
) -> None:
    session = f"sweep-{point}-{action[:4]}"
    run_id = await start(http, session, "tool sweep")
    if point != "accepted":
        events = sse_events(http, f"/runs/{run_id}/events")
        async for event in events:
            if event.type == point:
                break
        await events.aclose()
    response = await http.post(f"/runs/{run_id}/{action}")
    assert response.status_code in (202, 409), response.text  # 409: it had just ended
    whole = await collect(http, run_id)
    assert [e.type for e in whole].count("handle_finished") == 1
    assert whole[-1].type == "handle_finished"
    status = whole[-1].data["status"]
    assert status in ALLOWED[action] | {"completed"}, status
    if response.status_code == 409:
        assert status == "completed"
    messages = (await http.get(f"/sessions/{session}")).json()["messages"]
    validate(messages)  # a valid transcript wherever the stop landed
    assert [m["role"] for m in messages].count("user") == 1
    # The session is free again, and resuming it goes on from there.
    resumed = await http.post(f"/sessions/{session}/resume")
    if status == "completed":  # nothing to resume
        assert resumed.status_code == 409, resumed.text
        return
    assert resumed.status_code == 202, resumed.text
    assert (await finished(http, resumed.json()["run_id"]))["status"] == "completed"
    validate((await http.get(f"/sessions/{session}")).json()["messages"])
