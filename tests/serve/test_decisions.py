"""Decisions on a paused run given to two servers at once resume it exactly once.

Two apps share Redis and a store (SQLite, PostgreSQL), each under its own Uvicorn. The
test holds the session's write lock (as a decision being recorded elsewhere would),
sends the last two decisions to A and B, and lets go only once both provably wait for
the lock (each logged it); then they race for the lock, and the run resumes once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest

from aimu import aio
from aimu.aio import PostgresStore, SQLiteStore, Store
from aimu.aio.approvals import PAUSED, Approvals
from aimu.aio.transcript import validate
from aimu.testing.server import LoopbackServer
from tests.serve.harness import (
    MAILED,
    collect,
    make_app,
    send_email,
    start,
    store_of,
    uvicorn_serving,
)


class LockWaits(logging.Handler):
    """Notes the calls whose decision logged that it waits for the session's lock."""

    def __init__(self, wanted: set[str]) -> None:
        super().__init__(logging.DEBUG)
        self.wanted = wanted
        self.seen: set[str] = set()
        self.all_seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "waits for the session's lock" in record.getMessage():
            self.seen.add(str(record.args[0]))  # type: ignore[index]
            if self.wanted <= self.seen:
                self.all_seen.set()


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Path | str]:
    """The store both servers share: a SQLite file, or a PostgreSQL database's URL."""
    async with store_of(request.param, tmp_path) as made:
        yield made


async def test_the_last_two_decisions_at_once_on_two_servers_resume_the_run_once(
    model_server: LoopbackServer, redis_url: str, store: Path | str
) -> None:
    MAILED.clear()
    options = {"redis": redis_url, "redis_prefix": f"aimu_test_race-{secrets.token_hex(4)}"}
    a_app = make_app(model_server, store, **options)
    b_app = make_app(model_server, store, **options)
    with uvicorn_serving(a_app) as a_url, uvicorn_serving(b_app) as b_url:
        async with (
            httpx.AsyncClient(base_url=a_url, timeout=30) as on_a,
            httpx.AsyncClient(base_url=b_url, timeout=30) as on_b,
        ):
            run_id = await start(on_a, "race", "mails race")
            assert (await collect(on_a, run_id))[-1].data["status"] == "paused"
            first, second = (p["call_id"] for p in (await on_a.get(f"/runs/{run_id}")).json()[
                "pending"
            ])
            requests = len(model_server.requests)
            responses = await decide_both_while_locked(
                store, on_a.post(f"/runs/{run_id}/approvals/{first}", json={"approve": True}),
                on_b.post(f"/runs/{run_id}/approvals/{second}", json={"approve": True}),
                {first, second},
            )
            assert [r.status_code for r in responses] == [202, 202], [r.text for r in responses]
            resumed = [r.json()["resumed_run_id"] for r in responses]
            assert resumed.count(None) == 1, resumed  # exactly one of them resumed the run
            run = next(r for r in resumed if r is not None)
            assert (await collect(on_b, run))[-1].data["status"] == "completed"
            assert len(model_server.requests) == requests + 1
            assert sorted(MAILED) == ["mails race 1", "mails race 2"]  # each call ran once
            messages = (await on_a.get("/sessions/race")).json()["messages"]
            validate(messages)
            assert len([m for m in messages if m["role"] == "tool"]) == 2


async def decide_both_while_locked(
    store: Path | str,
    on_a: Coroutine[Any, Any, httpx.Response],
    on_b: Coroutine[Any, Any, httpx.Response],
    calls: set[str],
) -> list[httpx.Response]:
    """Send both decisions while the session is locked; unlock once both wait for it."""
    waits = LockWaits(calls)
    logger = logging.getLogger("aimu.serve")
    level = logger.level
    logger.addHandler(waits)
    logger.setLevel(logging.DEBUG)
    holder: Store = SQLiteStore(store) if isinstance(store, Path) else PostgresStore(store)
    writer = await holder.open_session("race")
    try:
        sent = [asyncio.ensure_future(on_a), asyncio.ensure_future(on_b)]
        assert await asyncio.to_thread(waits.all_seen.wait, 30), waits.seen
    finally:
        await writer.aclose()
        await holder.aclose()
        logger.removeHandler(waits)
        logger.setLevel(level)
    return list(await asyncio.gather(*sent))


@pytest.mark.parametrize("shared", [False, True], ids=["local", "redis"])
async def test_a_decision_never_runs_the_call_that_replaced_the_one_shown(
    model_server: LoopbackServer, redis_url: str, tmp_path: Path, shared: bool
) -> None:
    """Issue 29 item 6: the server's run pauses on send_email to Alice; another process
    on the same store deletes the session and runs again, pausing on send_email to
    Mallory under the same call id. Approving the old run's call is refused (409), with
    or without the pause id shown, and nothing runs; the session stays as that process
    left it, its call undecided."""
    MAILED.clear()
    path = tmp_path / "sessions.db"
    options = {"redis": redis_url, "redis_prefix": f"aimu_test_stale-{secrets.token_hex(4)}"}
    with uvicorn_serving(make_app(model_server, path, **(options if shared else {}))) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            run_id = await start(http, "mail", "mailto Alice")
            assert (await collect(http, run_id))[-1].data["status"] == "paused"
            (shown,) = (await http.get(f"/runs/{run_id}")).json()["pending"]
            assert (shown["call_id"], shown["arguments"]) == ("call-mailto", {"to": "Alice"})

            # Another process on the same store (its own store object and connection).
            async with SQLiteStore(path) as other:
                assert await other.delete("mail")
                client = aio.client("openai:loop", base_url=model_server.openai_base_url,
                                    api_key="sk-test")
                async with aio.Agent(client, tools=[send_email], store=other,
                                     session="mail") as agent:
                    assert await agent.run("mailto Mallory") == PAUSED
                    (replaced,) = agent.pending_approvals
                assert (replaced.call_id, replaced.arguments) == ("call-mailto", {"to": "Mallory"})
                assert replaced.pause_id != shown["pause_id"]

            requests = len(model_server.requests)
            url_of = f"/runs/{run_id}/approvals/call-mailto"
            for body in ({"approve": True}, {"approve": True, "pause_id": shown["pause_id"]},
                         {"approve": False}):
                answer = await http.post(url_of, json=body)
                assert answer.status_code == 409, answer.text
                assert "no longer waits" in answer.json()["error"]
            # The old run shows no call of the other process as its own.
            assert (await http.get(f"/runs/{run_id}")).json()["pending"] == []
            assert MAILED == [] and len(model_server.requests) == requests
            async with SQLiteStore(path) as check:
                state = await check.load_state("mail")
                info = await check.info("mail")
            approvals = Approvals.from_state(state, "mail")
            assert [p.arguments for p in approvals.waiting()] == [{"to": "Mallory"}]
            assert approvals.decisions == {}
            assert info is not None and info.status == "paused"


async def test_a_decision_names_the_pause_it_was_shown_for(
    model_server: LoopbackServer, tmp_path: Path
) -> None:
    """The pending call's pause_id comes back with the decision; another one is refused
    (409) and nothing runs, the right one decides."""
    MAILED.clear()
    with uvicorn_serving(make_app(model_server, tmp_path / "sessions.db")) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            run_id = await start(http, "pause", "mail Bob")
            assert (await collect(http, run_id))[-1].data["status"] == "paused"
            (shown,) = (await http.get(f"/runs/{run_id}")).json()["pending"]
            decide = f"/runs/{run_id}/approvals/{shown['call_id']}"
            wrong = await http.post(decide, json={"approve": True, "pause_id": "other"})
            assert wrong.status_code == 409 and "asked again" in wrong.json()["error"]
            assert (await http.get(f"/runs/{run_id}")).json()["pending"] == [shown]
            right = await http.post(decide, json={"approve": True, "pause_id": shown["pause_id"]})
            assert right.status_code == 202, right.text
            resumed = right.json()["resumed_run_id"]
            assert (await collect(http, resumed))[-1].data["status"] == "completed"
            assert MAILED == ["mail Bob"]
