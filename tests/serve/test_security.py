"""The bearer token, CORS, and what `aimu serve` refuses to do."""

from __future__ import annotations

import asyncio
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
    aimu_serve,
    clean_env,
    make_app,
    sse_events,
    start,
    uvicorn_serving,
)
from tests.services import free_port

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
        for method, path in [
            ("GET", "/sessions"),
            ("GET", "/sessions/a"),
            ("DELETE", "/sessions/a"),
            ("POST", "/sessions/a/runs"),
            ("POST", "/sessions/a/resume"),
            ("GET", "/openapi.json"),
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
    dead = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    done = aimu("--redis", dead, "--store", str(tmp_path / "s.db"), "--port", str(free_port()),
                env=clean_env())
    assert done.returncode != 0
    assert "cannot reach Redis at redis://" in done.stderr and "hunter2" not in done.stderr


async def test_the_command_serves_and_sigterm_stops_runs_keeping_them(
    model_server: LoopbackServer, tmp_path: Path
) -> None:
    store = tmp_path / "s.db"
    async with aimu_serve(model_server, tmp_path, "--store", str(store)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
            abandoned = len([s for s in model_server.streams if s.abandoned])
            run_id = await start(http, "kept", "long tale")
            follower = sse_events(http, f"/runs/{run_id}/events")
            seen = [await anext(follower)]
            while seen[-1].type != "text":
                seen.append(await anext(follower))
            server.process.send_signal(signal.SIGTERM)
            rest = [event async for event in follower]  # ends: the server closes it
            assert all(e.type != "handle_finished" for e in rest)
        # Uvicorn shuts down gracefully, then re-raises the signal it caught.
        assert await asyncio.wait_for(server.process.wait(), 30) in (0, -signal.SIGTERM)
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
