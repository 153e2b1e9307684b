"""A run paused on a server without Redis that then went away is found on the next
servers sharing its store (the local backend adopts it from its record), and decided
there exactly once (issue 42: the crossing cell approvals:drain:serve:0).

Server A pauses the run and shuts down. Servers B and C (no Redis, the same store) each
know the run: its view, its waiting call, its end as one event, a stop or a send refused
as A would have. Both are given the decision at once, while the test holds the session's
write lock (as a decision in progress elsewhere would); once both provably wait for it,
the lock goes, they race, and the run resumes once: one answers the resumed run, the other
409 "decided already"; the tool ran once, the model was asked once more.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from aimu.aio import SQLiteStore
from aimu.aio.transcript import validate
from aimu.testing.server import LoopbackServer
from tests.serve.harness import MAILED, collect, make_app, start, store_of, uvicorn_serving
from tests.serve.test_decisions import decide_both_while_locked


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Path | str]:
    async with store_of(request.param, tmp_path) as made:
        yield made


async def test_a_run_paused_on_a_server_gone_is_decided_once_on_the_next_ones(
    model_server: LoopbackServer, store: Path | str
) -> None:
    MAILED.clear()
    with uvicorn_serving(make_app(model_server, store)) as a_url:
        async with httpx.AsyncClient(base_url=a_url, timeout=30) as on_a:
            run_id = await start(on_a, "race", "mail Bob")
            assert (await collect(on_a, run_id))[-1].data["status"] == "paused"
            shown = (await on_a.get(f"/runs/{run_id}")).json()
    (call,) = shown["pending"]

    with (uvicorn_serving(make_app(model_server, store)) as b_url,
          uvicorn_serving(make_app(model_server, store)) as c_url):
        async with (httpx.AsyncClient(base_url=b_url, timeout=30) as on_b,
                    httpx.AsyncClient(base_url=c_url, timeout=30) as on_c):
            # B knows the run as A did.
            session = (await on_b.get("/sessions/race")).json()
            assert (session["paused_run_id"], session["pending"]) == (run_id, [call])
            run = (await on_b.get(f"/runs/{run_id}")).json()
            assert (run["status"], run["pending"]) == ("paused", [call]), run
            (end,) = await collect(on_b, run_id)
            assert (end.type, end.data["status"]) == ("handle_finished", "paused")
            for path, body in ((f"/runs/{run_id}/stop", None),
                               (f"/runs/{run_id}/send", {"text": "and Carol"})):
                refused = await on_b.post(path, json=body)
                assert refused.status_code == 409, refused.text
                assert "already ended (paused)" in refused.json()["error"]
            assert (await on_c.get(f"/runs/{run_id}")).json()["status"] == "paused"

            requests = len(model_server.requests)
            decision = f"/runs/{run_id}/approvals/{call['call_id']}"
            body = {"approve": True, "pause_id": call["pause_id"]}
            answers = await decide_both_while_locked(
                store, on_b.post(decision, json=body), on_c.post(decision, json=body),
                {call["call_id"]},
            )
            codes = sorted(answer.status_code for answer in answers)
            assert codes == [202, 409], [answer.text for answer in answers]
            won = next(a for a in answers if a.status_code == 202).json()
            lost = next(a for a in answers if a.status_code == 409).json()
            assert "decided already" in lost["error"], lost
            resumed = won["resumed_run_id"]
            assert resumed not in (None, run_id)
            server = on_b if answers[0].status_code == 202 else on_c
            assert (await collect(server, resumed))[-1].data["status"] == "completed"
            # The other server finds the resumed run too, from the store.
            other = on_c if server is on_b else on_b
            assert (await other.get(f"/runs/{resumed}")).json()["status"] == "completed"
            assert (await other.get("/sessions/race")).json()["paused_run_id"] is None

    assert MAILED == ["mail Bob"]
    assert len(model_server.requests) == requests + 1
    if isinstance(store, Path):
        async with SQLiteStore(store) as check:
            messages = await check.load("race")
            records = await check.runs(session="race")
        validate(messages)
        assert [r.status for r in records] == ["completed", "paused"]
        assert len([m for m in messages if m["role"] == "tool"]) == 1
