"""Two `aimu serve` processes sharing Redis and a store (SQLite, PostgreSQL) behave as one.

A run started on A is followed from B, stopped from B (the model server sees A's stream
abandoned), and read from B; a follower moves from A to B with Last-Event-ID and sees
every event once; the session is busy on both while the run lasts. A run paused on A
takes its decisions on either server and resumes once.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aimu.aio.transcript import validate
from aimu.testing.server import LoopbackServer
from tests.serve.harness import (
    SSE,
    aimu_serve,
    collect,
    hurried,
    postgres_database,
    sse_events,
    start,
)
from tests.serve.test_steer import PNG_URL

pytestmark = pytest.mark.slow


@pytest.fixture
async def shared(
    redis_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[list[str]]:
    """Options of servers sharing one Redis prefix and one store: SQLite by default,
    or (``indirect`` "postgres") a PostgreSQL database made for the test and dropped."""
    prefix = f"aimu_test_serve-{secrets.token_hex(4)}"
    options = ["--redis", redis_url, "--redis-prefix", prefix]
    if getattr(request, "param", "sqlite") == "sqlite":
        yield [*options, "--store", str(tmp_path / "s.db")]
        return
    async with postgres_database() as url:
        yield [*options, "--store", url]


@pytest.fixture
async def pair(
    model_server: LoopbackServer, tmp_path: Path, shared: list[str]
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """Clients of two server processes, A and B, sharing Redis and the store."""
    options = [*shared, "--tool", "tests.serve.harness:send_email"]
    async with (
        aimu_serve(model_server, tmp_path, *options, name="a") as a,
        aimu_serve(model_server, tmp_path, *options, name="b") as b,
        httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
    ):
        yield on_a, on_b


async def until_text(http: httpx.AsyncClient, run_id: str) -> list[SSE]:
    seen: list[SSE] = []
    events = sse_events(http, f"/runs/{run_id}/events")
    async for event in events:
        seen.append(event)
        if event.type == "text":
            break
    await events.aclose()
    return seen


@pytest.mark.parametrize("shared", ["sqlite", "postgres"], indirect=True)
async def test_stop_on_one_server_reaches_a_run_in_the_other(
    model_server: LoopbackServer, pair: tuple[httpx.AsyncClient, httpx.AsyncClient]
) -> None:
    on_a, on_b = pair
    abandoned = len([s for s in model_server.streams if s.abandoned])
    run_id = await start(on_a, "shared", "long across")

    # B follows A's run: its events, with Redis stream ids.
    seen = await until_text(on_b, run_id)
    assert seen[0].type == "run_started" and "-" in seen[0].id

    # B knows the run and the busy session.
    run = (await on_b.get(f"/runs/{run_id}")).json()
    assert run["status"] == "running" and run["session"] == "shared"
    assert run["task"] == "long across"
    session = (await on_b.get("/sessions/shared")).json()
    assert session["run_id"] == run_id
    listed = {s["name"]: s["run_id"] for s in (await on_b.get("/sessions")).json()["sessions"]}
    assert listed["shared"] == run_id
    busy = await on_b.post("/sessions/shared/runs", json={"task": "meanwhile"})
    assert busy.status_code == 409

    # Stop pressed on B stops the run executing in A.
    response = await on_b.post(f"/runs/{run_id}/cancel", json={"reason": "stop from B"})
    assert response.status_code == 202, response.text
    await model_server.wait_abandoned(abandoned + 1)

    # A follower that read a few events on A continues on B, missing nothing.
    head = []
    events = sse_events(on_a, f"/runs/{run_id}/events")
    async for event in events:
        head.append(event)
        if len(head) == 3:
            break
    await events.aclose()
    tail = await collect(on_b, run_id, {"Last-Event-ID": head[-1].id})
    whole = await collect(on_a, run_id)
    assert [e.id for e in head + tail] == [e.id for e in whole]
    assert whole[-1].type == "handle_finished"
    assert whole[-1].data["status"] == "cancelled"
    assert whole[-1].data["reason"] == "stop from B"

    for http in (on_a, on_b):
        run = (await http.get(f"/runs/{run_id}")).json()
        assert run["status"] == "cancelled" and run["reason"] == "stop from B"
    messages = (await on_b.get("/sessions/shared")).json()["messages"]
    validate(messages)
    assert messages[-1].get("aimu_partial") and "w0" in messages[-1]["content"]

    # The session is free: the next run may go to either server.
    again = await start(on_b, "shared", "short 3")
    assert (await collect(on_a, again))[-1].data["status"] == "completed"
    assert (await on_b.post(f"/runs/{run_id}/cancel")).status_code == 409


async def test_interrupt_and_stop_from_the_other_server(
    pair: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    on_a, on_b = pair
    run_id = await start(on_a, "intr", "tool across")
    await until_text(on_b, run_id)
    assert (await on_b.post(f"/runs/{run_id}/interrupt")).status_code == 202
    events = await collect(on_b, run_id)
    assert events[-1].data["status"] == "interrupted"

    run_id = await start(on_b, "grace", "long across")
    await until_text(on_a, run_id)
    assert (await on_a.post(f"/runs/{run_id}/stop?grace=0")).status_code == 202
    events = await collect(on_a, run_id)
    assert events[-1].data["status"] == "cancelled"

    unknown = await on_a.get("/runs/" + "Z" * 24)
    assert unknown.status_code == 404
    bad = await on_a.get(f"/runs/{run_id}/events", headers={"Last-Event-ID": "7"})
    assert bad.status_code == 400


async def test_stop_pressed_on_a_page_served_by_one_process_stops_a_run_in_the_other(
    model_server: LoopbackServer,
    pair: tuple[httpx.AsyncClient, httpx.AsyncClient],
    page: object,
) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    on_a, on_b = pair
    abandoned = len([s for s in model_server.streams if s.abandoned])
    run_id = await start(on_a, "web-shared", "long for the page")  # executes in A
    await until_text(on_a, run_id)

    await page.goto(f"{on_b.base_url}/?session=web-shared")  # the page comes from B
    reply = page.locator(".msg.assistant").last
    await expect(reply).to_contain_text("w3 ")  # B's page follows A's run as it streams
    await page.locator("#stop").click()
    await expect(reply.locator(".mark")).to_have_text("(stopped)")
    await model_server.wait_abandoned(abandoned + 1)
    run = (await on_a.get(f"/runs/{run_id}")).json()
    assert run["status"] == "cancelled" and run["reason"] == "Stop pressed in the web chat"


async def test_send_on_one_server_joins_a_run_in_the_other(
    model_server: LoopbackServer, pair: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    on_a, on_b = pair
    run_id = await start(on_a, "steered", "long steer")
    await until_text(on_b, run_id)  # the long first turn is streaming in A
    # The image travels in the Redis request to A's run.
    response = await on_b.post(
        f"/runs/{run_id}/send", json={"text": "from B", "images": [PNG_URL]}
    )
    assert response.status_code == 202, response.text
    with hurried(model_server):  # the send landed: the rest of the turn need not crawl
        events = await collect(on_b, run_id)
    assert events[-1].data["status"] == "completed"
    run = (await on_a.get(f"/runs/{run_id}")).json()
    assert run["reply"].startswith("answer to [{'type': 'text', 'text': 'from B'}")
    messages = (await on_b.get("/sessions/steered")).json()["messages"]
    validate(messages)
    assert [m["content"] for m in messages if m["role"] == "user"] == ["long steer", "from B"]
    assert [m.get("images") for m in messages if m["role"] == "user"] == [None, [PNG_URL]]
    late = await on_b.post(f"/runs/{run_id}/send", json={"text": "too late"})
    assert late.status_code == 409


@pytest.mark.parametrize("shared", ["sqlite", "postgres"], indirect=True)
async def test_decisions_on_either_server_resume_a_run_paused_in_one(
    model_server: LoopbackServer, pair: tuple[httpx.AsyncClient, httpx.AsyncClient]
) -> None:
    on_a, on_b = pair
    run_id = await start(on_a, "approve-across", "mails across")
    assert (await collect(on_a, run_id))[-1].data["status"] == "paused"
    # B reads the waiting calls from the shared store.
    run = (await on_b.get(f"/runs/{run_id}")).json()
    assert run["status"] == "paused"
    first, second = (p["call_id"] for p in run["pending"])

    answer = await on_a.post(
        f"/runs/{run_id}/approvals/{first}", json={"approve": False, "reason": "not A"}
    )
    assert answer.status_code == 202, answer.text
    assert [p["call_id"] for p in answer.json()["pending"]] == [second]
    assert answer.json()["resumed_run_id"] is None
    # B sees A's decision, and refuses it twice.
    assert [p["call_id"] for p in (await on_b.get(f"/runs/{run_id}")).json()["pending"]] == [
        second
    ]
    again = await on_b.post(f"/runs/{run_id}/approvals/{first}", json={"approve": True})
    assert again.status_code == 409 and "decided already" in again.json()["error"]

    requests = len(model_server.requests)
    last = await on_b.post(f"/runs/{run_id}/approvals/{second}", json={"approve": True})
    assert last.status_code == 202, last.text
    resumed = last.json()["resumed_run_id"]
    events = await collect(on_a, resumed)  # A follows the run B resumed
    assert events[0].type == "run_started" and events[-1].data["status"] == "completed"
    assert len(model_server.requests) == requests + 1  # resumed once
    messages = (await on_a.get("/sessions/approve-across")).json()["messages"]
    validate(messages)
    results = sorted(m["content"] for m in messages if m["role"] == "tool")
    assert results == ["[denied: not A]", "sent to mails across 2"]
    for http in (on_a, on_b):
        assert (await http.get(f"/runs/{run_id}")).json()["pending"] == []
        late = await http.post(f"/runs/{run_id}/approvals/{second}", json={"approve": True})
        assert late.status_code == 409 and "decided already" in late.json()["error"]
    follow_up = await start(on_b, "approve-across", "short 2")
    assert (await collect(on_a, follow_up))[-1].data["status"] == "completed"

    # A page's own tool (AG-UI): the run pauses on A, the page's result goes to B.
    locate = {"name": "locate", "description": "Where the user is"}
    ask = {"id": "u1", "role": "user", "content": "locate"}
    paused = await ag_ui(on_a, {"threadId": "page-across", "runId": "r1", "messages": [ask],
                                "tools": [locate]})
    (call_id,) = paused[-1]["outcome"]["pendingToolCallIds"]
    assert (await on_b.get("/sessions/page-across")).json()["pending"][0]["external"]
    result = {"id": "t1", "role": "tool", "toolCallId": call_id, "content": "Oslo"}
    body = {"threadId": "page-across", "runId": "r2", "messages": [ask, result],
            "tools": [locate]}
    resumed = await ag_ui(on_b, body)
    assert resumed[-1]["result"] == "you are in Oslo"
    again = await on_a.post("/ag-ui", json=body)
    assert again.status_code == 409, again.text
    validate((await on_a.get("/sessions/page-across")).json()["messages"])


async def ag_ui(http: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    async with http.stream("POST", "/ag-ui", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


async def test_a_page_of_one_process_decides_on_a_run_paused_in_the_other(
    pair: tuple[httpx.AsyncClient, httpx.AsyncClient], page: object
) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    on_a, on_b = pair
    run_id = await start(on_a, "web-approve", "mails for the page")  # pauses in A
    assert (await collect(on_a, run_id))[-1].data["status"] == "paused"
    await page.goto(f"{on_b.base_url}/?session=web-approve")  # the page comes from B
    prompt = page.locator("#approvals .approval")
    await expect(prompt).to_have_count(2)
    await prompt.first.get_by_role("button", name="Deny").click()
    await expect(prompt).to_have_count(1)
    await prompt.get_by_role("button", name="Approve").click()
    reply = page.locator(".msg.assistant").last
    await expect(reply).to_contain_text("sent to mails for the page 2")
    await expect(reply).to_contain_text("denied in the web chat")
    await expect(page.locator("#status")).to_have_text("completed")
