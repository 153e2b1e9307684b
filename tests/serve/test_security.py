"""The bearer token, CORS, and what `aimu serve` refuses to do."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aimu.aio.store import SQLiteStore
from aimu.aio.transcript import validate
from aimu.serve.command import is_loopback
from aimu.testing.server import LoopbackServer
from tests.serve.harness import (
    Served,
    aimu_serve,
    clean_env,
    make_app,
    sse_events,
    start,
    uvicorn_serving,
)
from tests.services import free_port, refused_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "tok-7f3a9c"


@pytest.fixture
def guarded(model_server: LoopbackServer, tmp_path: Path) -> Iterator[str]:
    with uvicorn_serving(make_app(model_server, tmp_path / "s.db", token=TOKEN)) as url:
        yield url


async def test_every_route_but_health_needs_the_token(guarded: str) -> None:
    async with httpx.AsyncClient(base_url=guarded) as http:
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/")).status_code == 200  # the page shell: no data in it
        assert (await http.get("/openapi.json")).status_code == 200  # the contract, no data
        assert (await http.get("/docs")).status_code == 200
        for method, path in [
            ("GET", "/sessions"),
            ("GET", "/sessions/a"),
            ("DELETE", "/sessions/a"),
            ("POST", "/sessions/a/runs"),
            ("POST", "/sessions/a/resume"),
            ("GET", "/runs/" + "A" * 22),
            ("GET", "/runs/" + "A" * 22 + "/events"),
            ("POST", "/runs/" + "A" * 22 + "/cancel"),
            ("GET", "/nowhere"),
        ]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                response = await http.request(method, path, headers=headers, json={"task": "x"})
                assert response.status_code == 401, (method, path, headers)
                assert response.headers["www-authenticate"].startswith("Bearer")
                assert "bearer token" in response.json()["error"]
                assert TOKEN not in response.text
        assert (await http.get("/sessions/a")).status_code == 401  # nothing was started
    async with httpx.AsyncClient(
        base_url=guarded, headers={"Authorization": f"Bearer {TOKEN}"}
    ) as http:
        run_id = await start(http, "a", "hello")
        events = [e async for e in sse_events(http, f"/runs/{run_id}/events")]
        assert events[-1].data["status"] == "completed"


async def test_no_cors_unless_configured(
    model_server: LoopbackServer, tmp_path: Path
) -> None:
    preflight = {
        "Origin": "https://elsewhere.example",
        "Access-Control-Request-Method": "POST",
    }
    with uvicorn_serving(make_app(model_server, tmp_path / "a.db")) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            response = await http.options("/sessions/a/runs", headers=preflight)
            assert "access-control-allow-origin" not in response.headers
            response = await http.get("/health", headers={"Origin": "https://elsewhere.example"})
            assert "access-control-allow-origin" not in response.headers
    app = make_app(model_server, tmp_path / "b.db", cors_origins=["https://ok.example"])
    with uvicorn_serving(app) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            ok = await http.options(
                "/sessions/a/runs", headers={**preflight, "Origin": "https://ok.example"}
            )
            assert ok.headers["access-control-allow-origin"] == "https://ok.example"
            other = await http.options("/sessions/a/runs", headers=preflight)
            assert other.headers.get("access-control-allow-origin") != preflight["Origin"]


def test_loopback_addresses() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.2", "example.com", ""]))


def aimu(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aimu", "serve", *args],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1"])
def test_binding_elsewhere_without_a_token_refuses_to_start(host: str) -> None:
    done = aimu("--host", host, "--port", str(free_port()), env=clean_env())
    assert done.returncode == 2
    assert f"refusing to bind {host}" in done.stderr and "AIMU_API_TOKEN" in done.stderr


def test_an_unreachable_redis_stops_the_start_naming_it(tmp_path: Path) -> None:
    dead = f"redis://:hunter2@127.0.0.1:{refused_port()}/0"
    done = aimu("--redis", dead, "--store", str(tmp_path / "s.db"), "--port", str(free_port()),
                env=clean_env())
    assert done.returncode != 0
    assert "cannot reach Redis at redis://" in done.stderr and "hunter2" not in done.stderr


@pytest.mark.parametrize(
    ("stop", "drain"), [(signal.SIGTERM, "0"), (signal.SIGINT, "30")],
    ids=["SIGTERM --drain 0", "SIGINT"],
)
async def test_the_command_serves_and_a_signal_stops_runs_keeping_them_then_exits_0(
    model_server: LoopbackServer, tmp_path: Path, stop: signal.Signals, drain: str
) -> None:
    """Issue 29 item 20: Ctrl+C (and SIGTERM with no time to drain) stops the runs, keeps
    their transcripts, and the server exits 0: it did what it was asked. A SIGTERM that
    drains is tests/serve/test_drain_recover.py's."""
    store = tmp_path / "s.db"
    options = ("--store", str(store), "--drain", drain)
    async with aimu_serve(model_server, tmp_path, *options) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
            abandoned = len([s for s in model_server.streams if s.abandoned])
            run_id = await start(http, "kept", "long tale")
            follower = sse_events(http, f"/runs/{run_id}/events")
            seen = [await anext(follower)]
            while seen[-1].type != "text":
                seen.append(await anext(follower))
            server.process.send_signal(stop)
            rest = [event async for event in follower]  # ends: the server closes it
            assert all(e.type != "handle_finished" for e in rest)
        assert await asyncio.wait_for(server.process.wait(), 30) == 0
    await model_server.wait_abandoned(abandoned + 1)
    async with SQLiteStore(store) as opened:
        messages = await opened.load("kept")
        info = await opened.info("kept")
        assert info is not None and info.status == "cancelled"
    validate(messages)
    assert messages[-1].get("aimu_partial") and "w0" in messages[-1]["content"]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("no_colon", "give MODULE:NAME"),
        ("aimu_no_such_module:f", "cannot import it"),
        ("tests.serve.harness:nowhere", "cannot import it"),
        ("tests.serve.harness:LONG", "not a function or tool"),
    ],
)
def test_a_bad_tool_refuses_to_start(spec: str, says: str) -> None:
    done = aimu("--tool", spec, "--port", str(free_port()), env=clean_env())
    assert done.returncode == 2
    assert f"--tool {spec!r}" in done.stderr and says in done.stderr


# -- cross-site requests, Host names, headers (issue 21, items 4, 5, 8) ---------------------

JSON_BODY = {"Content-Type": "application/json"}


async def stopped_session(http: httpx.AsyncClient, name: str) -> int:
    """A session whose run was cancelled (so it could be resumed); its message count."""
    run_id = await start(http, name, "long enough to stop")
    events = sse_events(http, f"/runs/{run_id}/events")
    async for event in events:
        if event.type == "text":
            break
    await events.aclose()
    assert (await http.post(f"/runs/{run_id}/cancel")).status_code == 202
    async for _ in sse_events(http, f"/runs/{run_id}/events"):
        pass
    session = (await http.get(f"/sessions/{name}")).json()
    assert session["status"] == "cancelled" and session["run_id"] is None
    return len(session["messages"])


async def assert_untouched(http: httpx.AsyncClient, name: str, messages: int | None) -> None:
    """No run started on ``name``, no session made (None) or its messages unchanged."""
    response = await http.get(f"/sessions/{name}")
    if messages is None:
        assert response.status_code == 404, response.text
        return
    session = response.json()
    assert (session["run_id"], len(session["messages"])) == (None, messages)
    assert session["status"] == "cancelled"


async def test_cross_site_state_changes_are_refused(
    http: httpx.AsyncClient, served: Served
) -> None:
    kept = await stopped_session(http, "stopped")
    port = served.url.rsplit(":", 1)[1]
    other = f"http://127.0.0.1:{int(port) + 1}"
    attempts: list[tuple[str, dict[str, str], bytes, int, str]] = [
        # A no-cors fetch: text/plain, and the browser's Origin and Sec-Fetch-Site.
        ("/sessions/victim/runs",
         {"Origin": other, "Sec-Fetch-Site": "same-site", "Content-Type": "text/plain"},
         b'{"task": "x"}', 403, "cross-site"),
        # A form (enctype text/plain) on a page that sends no Origin: not JSON.
        ("/sessions/victim/runs", {"Content-Type": "text/plain"}, b'{"task": "x"}', 415,
         "application/json"),
        ("/sessions/victim/runs", {"Content-Type": "application/x-www-form-urlencoded"},
         b"task=x", 415, "application/json"),
        ("/sessions/victim/runs", {}, b'{"task": "x"}', 415, "application/json"),
        # JSON, but from another origin (a CORS request this server does not grant).
        ("/sessions/victim/runs", {"Origin": other, **JSON_BODY}, b'{"task": "x"}', 403,
         "cross-site"),
        ("/sessions/victim/runs", {"Origin": "null", **JSON_BODY}, b'{"task": "x"}', 403,
         "cross-site"),
        ("/sessions/victim/runs", {"Sec-Fetch-Site": "cross-site", **JSON_BODY},
         b'{"task": "x"}', 403, "Sec-Fetch-Site"),
        # A bodiless resume of a stopped session: only the origin can tell.
        ("/sessions/stopped/resume", {"Origin": other, "Sec-Fetch-Site": "same-site"}, b"",
         403, "cross-site"),
        ("/sessions/stopped/resume", {"Sec-Fetch-Site": "cross-site"}, b"", 403, "cross-site"),
    ]
    for path, headers, body, status, says in attempts:
        response = await http.post(path, headers=headers, content=body)
        assert response.status_code == status, (path, headers, response.text)
        assert response.json()["status"] == status and says in response.json()["error"]
    assert (await http.delete("/sessions/stopped", headers={"Origin": other})).status_code == 403
    await assert_untouched(http, "victim", None)
    await assert_untouched(http, "stopped", kept)
    assert (await http.get("/sessions")).status_code == 200  # reading is not refused

    # The server's own page: its origin and the browser's same-origin verdict.
    own = {"Origin": served.url, "Sec-Fetch-Site": "same-origin", **JSON_BODY}
    response = await http.post("/sessions/stopped/resume", headers=own)
    assert response.status_code == 202, response.text
    async for _ in sse_events(http, f"/runs/{response.json()['run_id']}/events"):
        pass


async def test_allowed_cors_origins_may_change_state(
    model_server: LoopbackServer, tmp_path: Path
) -> None:
    origin = "https://ok.example"
    with uvicorn_serving(make_app(model_server, tmp_path / "c.db", cors_origins=[origin])) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            allowed = {"Origin": origin, "Sec-Fetch-Site": "cross-site"}
            response = await http.post("/sessions/c/runs", headers=allowed, json={"task": "hi"})
            assert response.status_code == 202, response.text
            assert response.headers["access-control-allow-origin"] == origin
            denied = {"Origin": "https://other.example"}
            response = await http.post("/sessions/d/runs", headers=denied, json={"task": "hi"})
            assert response.status_code == 403


@pytest.mark.parametrize(
    ("host", "served_ok"),
    [
        ("localhost", True), ("LOCALHOST:8000", True), ("127.0.0.1:1", True),
        ("127.8.9.10", True), ("[::1]:8000", True), ("app.localhost", True),
        ("evil.example", False), ("evil.example:8000", False), ("10.0.0.1", False),
        ("127.0.0.1.evil.example", False), ("localhost.evil.example", False), ("", False),
    ],
)
async def test_only_loopback_host_names_without_a_token(
    http: httpx.AsyncClient, host: str, served_ok: bool
) -> None:
    for method, path in [("GET", "/sessions"), ("GET", "/health"), ("GET", "/"),
                         ("POST", "/sessions/rebound/runs")]:
        response = await http.request(
            method, path, headers={"Host": host}, json={"task": "x"} if method == "POST" else None
        )
        if served_ok:
            assert response.status_code in (200, 202), (host, path, response.text)
        else:
            assert response.status_code == 400, (host, path, response.text)
            assert "host name" in response.json()["error"] and "--allowed-host" in response.text


async def test_allowed_hosts_and_a_token_widen_the_names(
    model_server: LoopbackServer, tmp_path: Path
) -> None:
    named = make_app(model_server, tmp_path / "a.db", allowed_hosts=["chat.example", "*.corp"])
    with uvicorn_serving(named) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            for host, status in [("chat.example", 200), ("a.b.corp", 200), ("corp", 400),
                                 ("other.example", 400), ("localhost", 200)]:
                response = await http.get("/sessions", headers={"Host": host})
                assert response.status_code == status, (host, response.text)
    with uvicorn_serving(make_app(model_server, tmp_path / "b.db", token=TOKEN)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            bearer = {"Host": "anything.example", "Authorization": f"Bearer {TOKEN}"}
            assert (await http.get("/sessions", headers=bearer)).status_code == 200


async def test_security_headers_on_the_page_the_api_and_errors(http: httpx.AsyncClient) -> None:
    for path, page in [("/", True), ("/static/chat.js", True), ("/sessions", False),
                       ("/health", False), ("/runs/" + "A" * 22, False), ("/nowhere", False)]:
        response = await http.get(path)
        headers = response.headers
        assert headers["x-frame-options"] == "DENY", path
        assert "frame-ancestors 'none'" in headers["content-security-policy"], path
        assert headers["x-content-type-options"] == "nosniff", path
        assert headers["referrer-policy"] == "no-referrer", path
        assert headers["cross-origin-resource-policy"] == "same-origin", path
        if page:
            assert "default-src 'self'" in headers["content-security-policy"], path
        else:
            assert "default-src 'none'" in headers["content-security-policy"], path
            assert headers["cache-control"] == "no-store", path
    refused = await http.get("/sessions", headers={"Host": "evil.example"})
    assert refused.headers["x-frame-options"] == "DENY"


async def test_no_get_head_or_options_starts_or_revives_a_run(
    http: httpx.AsyncClient, served: Served
) -> None:
    """Every GET, HEAD and OPTIONS route (the runs API, the web chat's, AG-UI, the AI SDK,
    A2A, MCP), asked as a cross-site ``<img>`` asks (no Origin, ``Sec-Fetch-Site:
    cross-site``) about a session whose run died with its server: nothing runs, nothing
    is resumed, the store is as it was."""
    from fastapi.routing import APIRoute
    from starlette.routing import Mount, Route

    from aimu.aio.store import RunRecord

    store = SQLiteStore(served.store)
    try:
        writer = await store.open_session("crashed")
        await writer.append({"role": "user", "content": "hello"})
        await writer.record_run(RunRecord(id="R" * 22, session="crashed", agent="agent",
                                          started=1.0, status="running", messages_from=0))
        await writer.set_status("in_progress")  # as a server killed mid-run leaves it
        await writer.aclose()
        before = (await store.runs(session="crashed"), await store.load("crashed"))
    finally:
        await store.aclose()
    params = {"session": "crashed", "id": "crashed", "run_id": "R" * 22, "call_id": "c",
              "name": "x"}
    paths: set[str] = set()
    for route in _every_route(served.app.routes):
        if isinstance(route, APIRoute | Route) and {"GET", "HEAD"} & (route.methods or set()):
            paths.add(route.path.format(**params))
        elif isinstance(route, Mount):
            paths.add(route.path or "/")
    paths |= {"/mcp", "/a2a", "/ag-ui", "/api/chat", "/sessions/crashed/resume"}
    assert "/api/chat/crashed/stream" in paths and "/runs/RRRRRRRRRRRRRRRRRRRRRR/events" in paths
    asked = len(served.model.requests)
    img = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Dest": "image", "Accept": "image/*"}
    for path in sorted(paths):
        for method in ("GET", "HEAD", "OPTIONS"):
            async with http.stream(method, path, headers=img) as response:
                # The body is not read: what counts is what the request itself did.
                assert response.status_code < 500, (method, path, response.status_code)
    session = (await http.get("/sessions/crashed")).json()
    assert (session["run_id"], session["status"]) == (None, "in_progress")
    assert len(served.model.requests) == asked  # no model turn ran again
    store = SQLiteStore(served.store)
    try:
        assert (await store.runs(session="crashed"), await store.load("crashed")) == before
    finally:
        await store.aclose()
    # The same reconnect by POST (a page of this server's own) resumes the run.
    own = {"Origin": served.url, "Sec-Fetch-Site": "same-origin"}
    async with http.stream("POST", "/api/chat/crashed/stream", headers=own) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line[6:]) for line in lines]
    said = "".join(c["delta"] for c in chunks if c["type"] == "text-delta")
    assert said.startswith("answer to hello"), chunks
    assert chunks[-1]["messageMetadata"]["aimuStatus"] == "completed", chunks
    assert len(served.model.requests) == asked + 1


def _every_route(routes: list[object]) -> Iterator[object]:
    """The app's routes, those of the routers it includes too."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _every_route(inner.routes)
        else:
            yield route
