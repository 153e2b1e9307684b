"""Steering runs over real HTTP: input sent into a running run, and tool calls a person
approves or denies on a paused run, which then resumes as a new run.

A send lands at a provable point (the follower saw a text event of the run in flight).
"""

from __future__ import annotations

import base64

import httpx
import pytest

from aimu.aio.transcript import validate
from tests.aio.test_images import png
from tests.serve.harness import MAILED, Served, collect, first_text, hurried, start

PNG_URL = "data:image/png;base64," + base64.b64encode(png()).decode()


async def ended(http: httpx.AsyncClient, run_id: str) -> dict[str, object]:
    events = await collect(http, run_id)
    assert events[-1].type == "handle_finished"
    body: dict[str, object] = (await http.get(f"/runs/{run_id}")).json()
    return body


async def transcript(http: httpx.AsyncClient, session: str) -> list[dict[str, object]]:
    response = await http.get(f"/sessions/{session}")
    assert response.status_code == 200
    messages: list[dict[str, object]] = response.json()["messages"]
    validate(messages)  # type: ignore[arg-type]
    return messages


async def paused(http: httpx.AsyncClient, session: str, task: str) -> tuple[str, str]:
    """Start ``task`` (a mail) and follow it to its pause; return (run id, call id)."""
    run_id = await start(http, session, task)
    run = await ended(http, run_id)
    assert run["status"] == "paused", run
    pending = run["pending"]
    assert isinstance(pending, list) and len(pending) == 1
    assert pending[0]["name"] == "send_email" and pending[0]["arguments"] == {"to": task}
    return run_id, str(pending[0]["call_id"])


async def test_send_joins_the_running_run_once(http: httpx.AsyncClient, served: Served) -> None:
    # "long" streams for seconds: the send lands while the first turn is provably in flight.
    run_id = await start(http, "steer", "long please")
    await first_text(http, run_id)
    response = await http.post(f"/runs/{run_id}/send", json={"text": "and in French"})
    assert response.status_code == 202, response.text
    with hurried(served.model):  # the send landed: the rest of the turn need not crawl
        run = await ended(http, run_id)
    assert run["status"] == "completed"
    assert run["reply"] == "answer to and in French"
    messages = await transcript(http, "steer")
    sent = [m for m in messages if m["role"] == "user" and m["content"] == "and in French"]
    assert len(sent) == 1
    # The send joined this run: no second run on the session.
    assert [m["content"] for m in messages if m["role"] == "user"] == [
        "long please", "and in French",
    ]


async def test_send_to_an_ended_run_is_409_and_changes_nothing(http: httpx.AsyncClient) -> None:
    run_id = await start(http, "late", "hello")
    await ended(http, run_id)
    before = await transcript(http, "late")
    response = await http.post(f"/runs/{run_id}/send", json={"text": "too late"})
    assert response.status_code == 409
    assert "already ended" in response.json()["error"]
    assert await transcript(http, "late") == before


async def test_send_bad_inputs(http: httpx.AsyncClient) -> None:
    run_id = await start(http, "badsend", "hello")
    await ended(http, run_id)
    assert (await http.post(f"/runs/{run_id}/send", json={})).status_code == 422
    assert (await http.post(f"/runs/{run_id}/send", json={"text": 3})).status_code == 422
    assert (await http.post(f"/runs/{run_id}/send", json={"text": "  "})).status_code == 400
    assert (await http.post("/runs/nosuchrun/send", json={"text": "x"})).status_code == 404


async def test_a_send_with_images_joins_the_run_once_as_content_parts(
    http: httpx.AsyncClient, served: Served
) -> None:
    run_id = await start(http, "seeing", "long please")
    await first_text(http, run_id)  # the first turn is provably in flight
    requests = len(served.model.requests)
    response = await http.post(
        f"/runs/{run_id}/send", json={"text": "and this?", "images": [PNG_URL]}
    )
    assert response.status_code == 202, response.text
    with hurried(served.model):  # the send landed: the rest of the turn need not crawl
        run = await ended(http, run_id)
    assert run["status"] == "completed", run
    messages = await transcript(http, "seeing")
    sent = [m for m in messages if m["role"] == "user" and m["content"] == "and this?"]
    # aimu_sent: the id it was kept under in the store before the send was answered
    assert [isinstance(m.pop("aimu_sent"), str) for m in sent] == [True]
    assert sent == [{"role": "user", "content": "and this?", "images": [PNG_URL]}]
    # The next model request carried the image once, as an OpenAI content part.
    (request,) = served.model.requests[requests:]
    wire = [m for m in request.body["messages"] if m["role"] == "user"]
    assert wire[-1]["content"] == [
        {"type": "text", "text": "and this?"},
        {"type": "image_url", "image_url": {"url": PNG_URL}},
    ]
    assert sum(str(m).count(PNG_URL) for m in request.body["messages"]) == 1


@pytest.mark.parametrize(
    ("images", "status", "words"),
    [
        (["/etc/hostname"], 400, "data:image/...;base64"),  # never a file of the server's
        (["data:text/plain;base64,aGVsbG8="], 400, "not an image aimu can send"),
        (["data:image/png;base64,%%%"], 400, "does not decode"),
        ([3], 422, ""),
        ("data:image/png;base64,AAAA", 422, ""),
    ],
)
async def test_a_send_with_a_bad_image_is_refused_and_changes_nothing(
    http: httpx.AsyncClient, served: Served, images: object, status: int, words: str
) -> None:
    run_id = await start(http, "badimage", "long please")
    await first_text(http, run_id)
    response = await http.post(f"/runs/{run_id}/send", json={"text": "x", "images": images})
    assert response.status_code == status, response.text
    assert words in response.json()["error"]
    assert "/etc" not in response.text
    assert (await http.post(f"/runs/{run_id}/cancel", json={})).status_code == 202
    assert (await ended(http, run_id))["status"] == "cancelled"
    messages = await transcript(http, "badimage")
    assert [m["content"] for m in messages if m["role"] == "user"] == ["long please"]


async def test_images_past_the_body_limit_are_413(http: httpx.AsyncClient) -> None:
    big = "data:image/png;base64," + "A" * (1 << 20)
    response = await http.post("/runs/r1/send", json={"text": "x", "images": [big]})
    assert response.status_code == 413
    assert "limit" in response.json()["error"]


async def test_approve_resumes_the_paused_run(http: httpx.AsyncClient) -> None:
    MAILED.clear()
    run_id, call_id = await paused(http, "ok", "mail alice")
    assert MAILED == []
    session = (await http.get("/sessions/ok")).json()  # what a page opening it reads
    assert session["paused_run_id"] == run_id
    assert [p["call_id"] for p in session["pending"]] == [call_id]
    response = await http.post(f"/runs/{run_id}/approvals/{call_id}", json={"approve": True})
    assert response.status_code == 202, response.text
    answer = response.json()
    assert answer["pending"] == [] and answer["approve"] is True
    resumed = await ended(http, answer["resumed_run_id"])
    assert resumed["status"] == "completed"
    assert resumed["reply"] == "mail result: sent to mail alice"
    assert MAILED == ["mail alice"]
    session = (await http.get("/sessions/ok")).json()
    assert session["paused_run_id"] is None and session["pending"] == []
    # The paused run no longer lists the call; deciding again is a conflict.
    assert (await http.get(f"/runs/{run_id}")).json()["pending"] == []
    again = await http.post(f"/runs/{run_id}/approvals/{call_id}", json={"approve": False})
    assert again.status_code == 409 and "decided already" in again.json()["error"]
    assert MAILED == ["mail alice"]


async def test_deny_gives_the_model_the_reason(http: httpx.AsyncClient) -> None:
    MAILED.clear()
    run_id, call_id = await paused(http, "no", "mail bob")
    response = await http.post(
        f"/runs/{run_id}/approvals/{call_id}", json={"approve": False, "reason": "not today"}
    )
    assert response.status_code == 202, response.text
    resumed = await ended(http, response.json()["resumed_run_id"])
    assert resumed["status"] == "completed"
    assert "denied" in str(resumed["reply"]) and "not today" in str(resumed["reply"])
    assert MAILED == []
    tool_results = [m for m in await transcript(http, "no") if m["role"] == "tool"]
    assert len(tool_results) == 1 and "not today" in str(tool_results[0]["content"])


async def test_decision_bad_inputs_change_nothing(http: httpx.AsyncClient) -> None:
    MAILED.clear()
    run_id, call_id = await paused(http, "bad", "mail carol")
    url = f"/runs/{run_id}/approvals/{call_id}"
    assert (await http.post(f"/runs/{run_id}/approvals/nosuchcall",
                            json={"approve": True})).status_code == 404
    assert (await http.post(url, json={})).status_code == 422
    assert (await http.post(url, json={"approve": "yes"})).status_code == 422
    assert (await http.post(url, json={"approve": True, "extra": 1})).status_code == 422
    unknown = await http.post("/runs/nosuchrun/approvals/x", json={"approve": True})
    assert unknown.status_code == 404
    # Not paused: a completed run waits on nothing.
    done = await start(http, "bad2", "hello")
    await ended(http, done)
    conflict = await http.post(f"/runs/{done}/approvals/{call_id}", json={"approve": True})
    assert conflict.status_code == 409 and "not paused" in conflict.json()["error"]
    # Nothing changed: the call still waits, and approving it still works.
    waiting = (await http.get(f"/runs/{run_id}")).json()["pending"]
    assert [p["call_id"] for p in waiting] == [call_id]
    assert MAILED == []
    response = await http.post(url, json={"approve": True})
    assert response.status_code == 202
    await ended(http, response.json()["resumed_run_id"])
    assert MAILED == ["mail carol"]


async def test_a_new_task_on_a_paused_session_is_refused(http: httpx.AsyncClient) -> None:
    run_id, _ = await paused(http, "wait", "mail dave")
    response = await http.post("/sessions/wait/runs", json={"task": "something else"})
    assert response.status_code == 409, response.text
    assert "wait for a decision" in response.json()["error"]
    assert (await http.get(f"/runs/{run_id}")).json()["pending"]
