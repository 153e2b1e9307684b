"""Issue 21's holes in serve's runs service, against real servers (Uvicorn in threads)
sharing a store, with and without Redis: a decision binds to the run it was shown for,
a decision after a delete says so, a start while Redis is down fails at once and runs
nothing, a damaged run record breaks no listing, and GET /sessions reads no runs list."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from aimu import aio
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from tests.serve.harness import GATE, MAILED, collect, make_app, start, uvicorn_serving
from tests.services import PrivateRedis


async def paused(http: httpx.AsyncClient, session: str, task: str) -> tuple[str, list[str]]:
    run_id = await start(http, session, task)
    assert (await collect(http, run_id))[-1].data["status"] == "paused"
    calls = [p["call_id"] for p in (await http.get(f"/runs/{run_id}")).json()["pending"]]
    return run_id, calls


def same_call(request: Mapping[str, Any]) -> Turn:
    """Every pause asks for the same call id (as a model's own numbering may)."""
    messages = request.get("messages") or []
    if messages and messages[-1].get("role") == "tool":
        return Turn(text=f"mailed: {messages[-1].get('content')}")
    return Turn(tool_calls=(ScriptedCall("send_email", {"to": "stale"}, id="call_same"),))


async def test_a_stale_decision_never_decides_a_new_pause_with_the_same_call_ids(
    tmp_path: Path,
) -> None:
    # Two servers on one store, no Redis: B pauses the session again after A's pause.
    MAILED.clear()
    store = tmp_path / "s.db"
    with (
        LoopbackServer.in_thread(same_call) as model_server,
        uvicorn_serving(make_app(model_server, store)) as a_url,
        uvicorn_serving(make_app(model_server, store)) as b_url,
    ):
        async with (
            httpx.AsyncClient(base_url=a_url, timeout=30) as on_a,
            httpx.AsyncClient(base_url=b_url, timeout=30) as on_b,
        ):
            first, calls = await paused(on_a, "again", "mail stale")
            assert (await on_b.delete("/sessions/again")).status_code == 204
            # Deciding after the delete says what happened.
            gone = await on_a.post(f"/runs/{first}/approvals/{calls[0]}", json={"approve": True})
            assert gone.status_code == 404, gone.text
            assert "deleted" in gone.json()["error"] and "decided already" not in gone.text
            second, again = await paused(on_b, "again", "mail stale")
            assert again == calls  # the same call id, shown for another run
            stale = await on_a.post(f"/runs/{first}/approvals/{calls[0]}", json={"approve": True})
            assert stale.status_code == 409, stale.text
            assert second in stale.json()["error"]
            assert MAILED == []  # the new call did not run
            waiting = (await on_b.get(f"/runs/{second}")).json()["pending"]
            assert [p["call_id"] for p in waiting] == calls  # still waits for its own decision
            ok = await on_b.post(f"/runs/{second}/approvals/{calls[0]}", json={"approve": True})
            assert ok.status_code == 202, ok.text
            resumed = ok.json()["resumed_run_id"]
            assert (await collect(on_b, resumed))[-1].data["status"] == "completed"
            assert MAILED == ["stale"]


async def test_a_start_while_redis_is_down_fails_at_once_and_runs_nothing(
    model_server: LoopbackServer, tmp_path: Path
) -> None:
    redis = PrivateRedis()
    try:
        GATE.reset()
        application = make_app(
            model_server, tmp_path / "s.db", redis=redis.url,
            redis_prefix=f"aimu_test_down-{secrets.token_hex(4)}",
        )
        with uvicorn_serving(application) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                assert (await collect(http, await start(http, "s", "short 2")))[-1].data[
                    "status"] == "completed"
                requests = len(model_server.requests)
                redis.stop()
                refused = await http.post("/sessions/s/runs", json={"task": "gate 1 3"})
                assert refused.status_code == 503, refused.text
                assert len(model_server.requests) == requests  # the model was never asked
                redis.start()
                GATE.open()
                run_id = await start(http, "s", "gate 1 3")  # the session was released
                assert (await collect(http, run_id))[-1].data["status"] == "completed"
                assert len([m for m in model_server.requests[requests:]]) == 2
    finally:
        GATE.reset()
        redis.stop()


async def test_a_damaged_run_record_and_a_long_runs_list_break_no_listing(
    model_server: LoopbackServer, tmp_path: Path
) -> None:
    redis = PrivateRedis()  # its own: the command counts below are this server's alone
    prefix = f"aimu_test_holes-{secrets.token_hex(4)}"
    application = make_app(model_server, tmp_path / "s.db", redis=redis.url, redis_prefix=prefix)
    async with aio.RedisControl(redis.url, prefix) as control:
        client = control._client
        try:
            with uvicorn_serving(application) as url:
                async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                    run_id = await start(http, "kept", "short 2")
                    assert (await collect(http, run_id))[-1].data["status"] == "completed"
                    # A damaged record as the session's latest run, and many runs kept.
                    await client.hset(
                        f"{prefix}:run:damaged",
                        mapping={"status": "running", "seq": "x", "created_at": "y",
                                 "info": json.dumps({"session": "kept", "messages_from": "z"})},
                    )
                    await client.set(f"{prefix}:session:kept", "damaged")
                    await client.zadd(f"{prefix}:runs", {f"r{i}": i for i in range(500)})
                    before = await client.info("commandstats")
                    listed = await http.get("/sessions")
                    assert listed.status_code == 200, listed.text
                    after = await client.info("commandstats")
                    for command in ("cmdstat_zrange", "cmdstat_zrangebyscore", "cmdstat_scan"):
                        calls = after.get(command, {}).get("calls", 0)
                        assert calls == before.get(command, {}).get("calls", 0), command
                    assert (await http.get("/sessions/kept")).status_code == 200
                    damaged = await http.get("/runs/damaged")
                    assert damaged.status_code == 200, damaged.text
                    assert damaged.json()["status"] == "lost"
                    assert (await http.get(f"/runs/{run_id}")).status_code == 200
        finally:
            redis.stop()


@pytest.mark.parametrize("grace", ["nan", "inf", "-1"])
async def test_stop_with_a_bad_grace_is_refused_before_anything(
    http: httpx.AsyncClient, grace: str
) -> None:
    run_id = await start(http, "grace", "short 2")
    response = await http.post(f"/runs/{run_id}/stop?grace={grace}", json={})
    assert response.status_code == 400, response.text
    assert (await collect(http, run_id))[-1].data["status"] == "completed"
