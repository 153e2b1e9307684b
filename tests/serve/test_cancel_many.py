"""``POST /runs/cancel``: a cancel-all in one request, on one server and on two sharing
their runs through Redis. Each run is cancelled as its own ``/cancel`` would be (its
partial reply kept, its stream closed at the model); a run that cannot be is refused with
that request's error; a malformed body cancels nothing."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from aimu.serve.models import MAX_CANCEL_MANY
from aimu.testing.server import LoopbackServer
from tests.serve.harness import collect, first_text, make_app, start, uvicorn_serving

UNKNOWN = "A" * 22  # a well-formed run id no server issued


@pytest.fixture(params=["local", "redis"])
async def servers(
    request: pytest.FixtureRequest, model_server: LoopbackServer, tmp_path: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """Where runs start and where the cancel is sent: one server twice, or two servers
    on one store and one Redis (the cancel crosses Redis to the process holding each run)."""
    store = tmp_path / "s.db"
    if request.param == "local":
        with uvicorn_serving(make_app(model_server, store)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                yield http, http
        return
    redis_url = request.getfixturevalue("redis_url")
    prefix = f"aimu_test_many-{secrets.token_hex(4)}"
    first = make_app(model_server, store, redis=redis_url, redis_prefix=prefix)
    second = make_app(model_server, store, redis=redis_url, redis_prefix=prefix)
    with uvicorn_serving(first) as one, uvicorn_serving(second) as other:
        async with httpx.AsyncClient(base_url=one, timeout=30) as starts, \
                httpx.AsyncClient(base_url=other, timeout=30) as cancels:
            yield starts, cancels


async def _untouched_then_cancelled(
    starts: httpx.AsyncClient, cancels: httpx.AsyncClient, run_id: str
) -> None:
    """``run_id`` streams on, untouched by what came before; its own cancel ends it."""
    assert (await starts.get(f"/runs/{run_id}")).json()["status"] == "running"
    assert (await cancels.post(f"/runs/{run_id}/cancel")).status_code == 202
    assert (await collect(starts, run_id))[-1].data["status"] == "cancelled"


async def test_many_runs_cancelled_in_one_request_keep_their_partials(
    servers: tuple[httpx.AsyncClient, httpx.AsyncClient], model_server: LoopbackServer
) -> None:
    starts, cancels = servers
    abandoned = len([s for s in model_server.streams if s.abandoned])
    runs = [await start(starts, f"many-{i}", "long story") for i in range(3)]
    for run_id in runs:
        await first_text(starts, run_id)  # each streams its reply now
    finished = await start(starts, "many-done", "short 2")
    assert (await collect(starts, finished))[-1].data["status"] == "completed"

    response = await cancels.post("/runs/cancel", json={
        "run_ids": [runs[0], UNKNOWN, finished, runs[1]], "reason": "cancel all",
    })
    assert response.status_code == 202, response.text
    body = response.json()
    assert [run["run_id"] for run in body["runs"]] == [runs[0], runs[1]]  # the request's order
    assert [(r["run_id"], r["status"]) for r in body["refused"]] == [(UNKNOWN, 404),
                                                                     (finished, 409)]
    assert all(r["error"] for r in body["refused"])
    for run_id in runs[:2]:
        events = await collect(starts, run_id)
        assert events[-1].data["status"] == "cancelled"
        assert events[-1].data["reason"] == "cancel all"
    await model_server.wait_abandoned(abandoned + 2)
    for i in range(2):
        messages = (await starts.get(f"/sessions/many-{i}")).json()["messages"]
        assert messages[-1]["role"] == "assistant" and messages[-1]["content"]  # the partial
    await _untouched_then_cancelled(starts, cancels, runs[2])  # the run not named


async def test_a_bad_body_refuses_the_whole_request_and_cancels_nothing(
    servers: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    starts, cancels = servers
    run_id = await start(starts, "many-bad", "long story")
    await first_text(starts, run_id)
    bad_bodies: list[tuple[object, str]] = [
        ({"run_ids": [run_id, "not an id"]}, "run_ids"),  # one malformed id among good ones
        ({"run_ids": [run_id, run_id]}, "twice"),
        ({"run_ids": []}, "run_ids"),
        ({"run_ids": [UNKNOWN] * (MAX_CANCEL_MANY + 1)}, "run_ids"),
        ({"run_ids": [run_id], "extra": 1}, "extra"),
        ({"run_ids": run_id}, "run_ids"),  # not a list
        ({"run_ids": [run_id], "reason": 3}, "reason"),
        ({}, "run_ids"),
    ]
    for body, says in bad_bodies:
        response = await cancels.post("/runs/cancel", json=body)
        assert response.status_code in (400, 422), (body, response.text)
        error = response.json()
        assert error["status"] == response.status_code and says in error["error"], error
    await _untouched_then_cancelled(starts, cancels, run_id)


async def test_a_cross_site_cancel_all_is_refused(
    servers: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    starts, cancels = servers
    run_id = await start(starts, "many-site", "long story")
    await first_text(starts, run_id)
    for headers in ({"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
        response = await cancels.post("/runs/cancel", json={"run_ids": [run_id]},
                                      headers=headers)
        assert response.status_code == 403, response.text
    await _untouched_then_cancelled(starts, cancels, run_id)
