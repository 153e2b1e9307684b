"""Drain on SIGTERM and ``--recover`` (issue 34 items 3 and 4), with real ``aimu serve``
processes under Uvicorn, on the loopback model, at provable points: a tool the run calls
says it runs (a file), the server says it drains (its log), the store says how each run
ended."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aimu import aio
from aimu._limit_options import limits_from, session_limits_from
from aimu.aio.approvals import Approvals
from aimu.aio.store import RunRecord, Store
from aimu.cli import build_parser, main
from aimu.serve import app, recovery
from aimu.serve.agents import open_store
from aimu.serve.command import run_serve
from aimu.serve.errors import Conflict
from aimu.serve.recovery import CRASHED, Recovery
from aimu.testing.server import LoopbackServer
from tests.serve import recover_tools
from tests.serve.harness import aimu_serve, last_user, start, store_of

TOOLS = (
    "--tool", "tests.serve.recover_tools:held", "--tool", "tests.serve.recover_tools:held_once",
    "--tool", "tests.serve.recover_tools:held_asked",
)


@pytest.fixture(scope="module")
def model() -> Iterator[LoopbackServer]:
    with LoopbackServer.in_thread(recover_tools.script) as server:
        yield server


@pytest.fixture
def held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    where = tmp_path / "held"
    where.mkdir()
    monkeypatch.setenv("AIMU_TEST_HELD", str(where))  # the servers inherit it
    return where


async def until(what: str, check: Callable[[], Any]) -> None:
    """Wait until ``check()`` is true: a state reached, never a time measured."""
    deadline = time.monotonic() + 60
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.05)


async def runs_of(store: Path | str | Store, session: str) -> list[RunRecord]:
    opened, close = open_store(store)
    try:
        return await opened.runs(session=session)
    finally:
        if close is not None:
            await close()


async def latest_is(store: Path | str | Store, session: str, status: str) -> bool:
    found = await runs_of(store, session)
    return bool(found) and found[0].status == status


def ran(held: Path) -> list[str]:
    """The completed calls of the held tools, as ``ran-<query>-<n>``."""
    return sorted(p.name for p in held.glob("ran-*"))


def said(log: Path, text: str) -> bool:
    return text in log.read_text(errors="replace")


async def test_sigterm_drains_then_recover_goes_on_with_the_run(
    tmp_path: Path, model: LoopbackServer, held: Path
) -> None:
    store = tmp_path / "sessions.db"
    async with aimu_serve(model, tmp_path, "--store", str(store), *TOOLS, "--drain", "60") as one:
        async with httpx.AsyncClient(base_url=one.url, timeout=30) as http:
            run_id = await start(http, "d1", "hold a")
            await until("the tool runs", (held / "entered-a").exists)
            one.process.send_signal(signal.SIGTERM)
            await until("the drain begins", lambda: said(one.log, "aimu serve: draining"))
            refused = await http.post("/sessions/d2/runs", json={"task": "hello"})
            assert refused.status_code == 503
            assert refused.headers["Retry-After"] == "5"
            body = refused.json()
            assert body["status"] == 503 and "shutting down" in body["error"]
            assert (await http.get(f"/runs/{run_id}")).json()["status"] == "running"
            (held / "open").touch()  # the tool ends: the run stops at that step boundary
        assert await asyncio.wait_for(one.process.wait(), 60) == 0
    [drained] = await runs_of(store, "d1")
    assert (drained.id, drained.status, drained.recover) == (run_id, "interrupted", True)
    assert await runs_of(store, "d2") == []
    assert ran(held) == ["ran-a-1"]

    async with aimu_serve(model, tmp_path, "--store", str(store), *TOOLS, "--recover",
                          name="recovering"):
        await until("the run goes on", lambda: latest_is(store, "d1", "completed"))
        await until("the mark is spent", lambda: runs_of(store, "d1"))
        new, old = await runs_of(store, "d1")
        await until("the mark is spent",
                    lambda: _not_marked(store, "d1", old.id))
    transcript = await _transcript(store, "d1")
    assert transcript[-1]["content"] == "done: held a"
    assert ran(held) == ["ran-a-1"]  # not run again
    assert new.status == "completed" and not new.recover


async def _not_marked(store: Path | str, session: str, run_id: str) -> bool:
    return not any(r.recover for r in await runs_of(store, session) if r.id == run_id)


async def _transcript(store: Path | str, session: str) -> list[Any]:
    opened, close = open_store(store)
    try:
        return list(await opened.load(session))
    finally:
        if close is not None:
            await close()


@pytest.mark.parametrize("how", ["second sigterm", "sigint in the drain", "drain seconds out"])
async def test_a_drain_cancels_what_is_left(
    tmp_path: Path, model: LoopbackServer, held: Path, how: str
) -> None:
    """A second SIGTERM, or a SIGINT, during the drain cancels the runs at once (the drain
    waits 60 s for them otherwise); --drain seconds passing does too. Each run so stopped
    is recorded cancelled and marked to be recovered; the server exits 0."""
    store = tmp_path / "sessions.db"
    drain = "0.5" if how == "drain seconds out" else "60"
    async with aimu_serve(model, tmp_path, "--store", str(store), *TOOLS, "--drain", drain) as one:
        async with httpx.AsyncClient(base_url=one.url, timeout=30) as http:
            run_id = await start(http, "c1", "hold b")
        await until("the tool runs", (held / "entered-b").exists)
        one.process.send_signal(signal.SIGTERM)
        await until("the drain begins", lambda: said(one.log, "aimu serve: draining"))
        if how != "drain seconds out":
            one.process.send_signal(signal.SIGINT if "sigint" in how else signal.SIGTERM)
        assert await asyncio.wait_for(one.process.wait(), 60) == 0
    [record] = await runs_of(store, "c1")
    assert (record.id, record.status, record.recover) == (run_id, "cancelled", True)
    # Cancelled by the drain's end, or at once by the shutdown the second signal began.
    why = "into its drain" if how == "drain seconds out" else "the server is shutting down"
    assert why in (record.reason or ""), record.reason
    assert ran(held) == []


async def test_kill_9_then_recover_resumes_and_in_doubt_calls_go_as_today(
    tmp_path: Path, model: LoopbackServer, held: Path
) -> None:
    """After a kill -9 mid-tool: an idempotent tool's call runs again, another's is
    answered 'outcome unknown' (never run twice), an approval tool's is asked again: the
    run pauses for a person, as when a session is loaded after any crash. A run killed
    at once after its 202 was recorded before it: it goes on, once."""
    store = tmp_path / "sessions.db"
    async with aimu_serve(model, tmp_path, "--store", str(store), *TOOLS) as one:
        async with httpx.AsyncClient(base_url=one.url, timeout=30) as http:
            again = await start(http, "k1", "hold x")
            once = await start(http, "k2", "once y")
            asked = await start(http, "k3", "ask z")
            await until("k3 asks", lambda: latest_is(store, "k3", "paused"))
            [call] = (await http.get(f"/runs/{asked}")).json()["pending"]
            decided = await http.post(f"/runs/{asked}/approvals/{call['call_id']}",
                                      json={"approve": True})
            approved = decided.json()["resumed_run_id"]
        await until("the three tools run", lambda: all(
            (held / f"entered-{q}").exists() for q in "xyz"))
        async with httpx.AsyncClient(base_url=one.url, timeout=30) as http:
            accepted = await start(http, "k4", "hold w")
        one.process.kill()  # at once after the 202: the run may not have taken a step yet
        await one.process.wait()
    assert [r.status for r in await runs_of(store, "k1")] == ["running"]
    assert [(r.id, r.status) for r in await runs_of(store, "k4")] == [(accepted, "running")]
    (held / "open").touch()
    async with aimu_serve(model, tmp_path, "--store", str(store), *TOOLS, "--recover",
                          name="recovering"):
        await until("k1 goes on", lambda: latest_is(store, "k1", "completed"))
        await until("k2 goes on", lambda: latest_is(store, "k2", "completed"))
        await until("k3 pauses", lambda: latest_is(store, "k3", "paused"))
        await until("k4 goes on", lambda: latest_is(store, "k4", "completed"))
    new, old = await runs_of(store, "k1")
    assert old.id == again and old.status == "failed" and new.status == "completed"
    assert (old.reason or "").startswith(f"{CRASHED} (1 in a row, at message ")
    assert (await runs_of(store, "k2"))[1].id == once
    assert "outcome unknown" in str((await _transcript(store, "k2"))[-2]["content"])
    paused = (await runs_of(store, "k3"))[0]  # not resumed: a person decides
    assert paused.id == approved and "wait for a decision" in (paused.reason or "")
    assert not paused.recover
    opened, close = open_store(store)
    try:
        waiting = Approvals.from_state(await opened.load_state("k3"), "k3").waiting()
    finally:
        assert close is not None
        await close()
    assert [p.in_doubt for p in waiting] == [True]
    assert [r.status for r in await runs_of(store, "k4")] == ["completed", "failed"]
    assert [m["role"] for m in await _transcript(store, "k4")] == [
        "user", "assistant", "tool", "assistant"]  # the task once, its tool once
    assert ran(held) == ["ran-w-1", "ran-x-1"]  # y, z never re-ran


async def _two(pending: Any) -> bool:
    return len(await pending) == 2


def _asked(model: LoopbackServer, task: str) -> int:
    """How many requests the model server received whose last user message is ``task``."""
    return sum(1 for r in model.requests if last_user(r.body) == task)


async def test_a_session_budget_holds_across_a_kill_9_and_recover(
    tmp_path: Path, model: LoopbackServer, held: Path
) -> None:
    """--session-max-requests: the request a killed server sent was counted in the store
    before it went out, so the run --recover resumes has no budget left for another."""
    store = tmp_path / "sessions.db"
    budget = ("--store", str(store), "--session-max-requests", "1")
    async with aimu_serve(model, tmp_path, *budget) as one:
        async with httpx.AsyncClient(base_url=one.url, timeout=30) as http:
            run_id = await start(http, "b1", "slow b")
        await until("the model has the request", lambda: _asked(model, "slow b") == 1)
        one.process.kill()
        await one.process.wait()
    async with aimu_serve(model, tmp_path, *budget, "--recover", name="recovering"):
        await until("the run goes on", lambda: latest_is(store, "b1", "limited"))
    new, old = await runs_of(store, "b1")
    assert old.id == run_id and (old.reason or "").startswith(CRASHED)
    assert (new.stop_reason, new.recover) == ("limit:requests", False)
    assert _asked(model, "slow b") == 1  # the resumed run sent none


@pytest.mark.slow
@pytest.mark.parametrize("shared", ["local", "redis"])
async def test_a_send_answered_202_survives_a_kill_9_and_joins_once(
    tmp_path: Path, model: LoopbackServer, held: Path, shared: str,
    request: pytest.FixtureRequest,
) -> None:
    """A send answered 202 is in the store before the answer: the server running the
    run killed before its next step boundary, ``--recover`` joins the text to the run
    exactly once (it was lost before). With --redis the send goes to the other server."""
    store = tmp_path / "sessions.db"
    session, task = f"s-{shared}", f"slow {shared}"  # the model server is the module's
    common: tuple[str, ...] = ("--store", str(store))
    if shared == "redis":
        common += ("--redis", request.getfixturevalue("redis_url"),
                   "--redis-prefix", f"aimu_test_send_{secrets.token_hex(4)}")
    async with contextlib.AsyncExitStack() as servers:
        one = await servers.enter_async_context(aimu_serve(model, tmp_path, *common))
        to = one
        if shared == "redis":
            to = await servers.enter_async_context(
                aimu_serve(model, tmp_path, *common, name="other"))
        async with httpx.AsyncClient(base_url=one.url, timeout=30) as http:
            run_id = await start(http, session, task)
        await until("the model streams the reply", lambda: _asked(model, task) == 1)
        async with httpx.AsyncClient(base_url=to.url, timeout=30) as http:
            sent = await http.post(f"/runs/{run_id}/send", json={"text": "and this"})
        assert sent.status_code == 202, sent.text
        one.process.kill()  # mid-reply: the run never reached its next step boundary
        await one.process.wait()
        recover_tools.LOOP_FAST.set()  # the resumed run's reply need not crawl
        try:
            async with aimu_serve(model, tmp_path, *common, "--recover", name="recovering"):
                await until("the run goes on", lambda: latest_is(store, session, "completed"))
        finally:
            recover_tools.LOOP_FAST.clear()
    transcript = await _transcript(store, session)
    users = [m["content"] for m in transcript if m["role"] == "user"]
    assert users == [task, "and this"]
    assert transcript[-1]["role"] == "assistant"
    assert "and this" in json.dumps(model.requests[-1].body["messages"])  # the model saw it
    opened, close = open_store(store)
    try:
        assert await opened.inputs(session) == []  # joined: no longer pending
    finally:
        assert close is not None
        await close()


async def test_a_decision_answered_202_survives_a_kill_9(
    tmp_path: Path, model: LoopbackServer, held: Path, redis_url: str
) -> None:
    """A decision answered 202 (one of two calls decided) is in the session's state
    before the answer: the server killed at once, another server (through Redis: it
    finds the paused run) takes the other decision and the run goes on with both, each
    call run once. (Decisions were kept so before issue 42; this pins it.)"""
    store = tmp_path / "sessions.db"
    shared = ("--store", str(store), "--redis", redis_url,
              "--redis-prefix", f"aimu_test_decide_{secrets.token_hex(4)}", *TOOLS)
    (held / "open").touch()  # the approved calls end at once
    async with aimu_serve(model, tmp_path, *shared) as one:
        async with httpx.AsyncClient(base_url=one.url, timeout=30) as http:
            run_id = await start(http, "a1", "asks z")
            async def waiting() -> list[dict[str, Any]]:
                pending: list[dict[str, Any]] = (await http.get(f"/runs/{run_id}")).json()[
                    "pending"]
                return pending

            await until("the run pauses on both calls", lambda: _two(waiting()))
            first, second = await waiting()
            decided = await http.post(f"/runs/{run_id}/approvals/{first['call_id']}",
                                      json={"approve": True})
            assert decided.status_code == 202, decided.text
            assert [p["call_id"] for p in decided.json()["pending"]] == [second["call_id"]]
        one.process.kill()
        await one.process.wait()
    async with (aimu_serve(model, tmp_path, *shared, name="next") as two,
                httpx.AsyncClient(base_url=two.url, timeout=30) as http):
        decided = await http.post(f"/runs/{run_id}/approvals/{second['call_id']}",
                                  json={"approve": True})
        assert decided.status_code == 202, decided.text
        assert decided.json()["pending"] == [] and decided.json()["resumed_run_id"]
        await until("the run goes on", lambda: latest_is(store, "a1", "completed"))
    assert ran(held) == ["ran-z1-1", "ran-z2-1"]
    results = [m["content"] for m in await _transcript(store, "a1") if m["role"] == "tool"]
    assert results == ["held z1", "held z2"]


@pytest.mark.slow
async def test_a_run_budget_holds_across_two_kill_9s_and_recover(
    tmp_path: Path, model: LoopbackServer, held: Path
) -> None:
    """--max-requests 4, the server killed mid-reply twice: each request was counted in
    the run's record before it went out, and each resume goes on with the budget of the
    run it continues, so the model sees exactly 4 requests for the one run (5 before)."""
    store = tmp_path / "sessions.db"
    budget = ("--store", str(store), "--max-requests", "4", "--recover",
              "--tool", "tests.serve.recover_tools:tick")
    recover_tools.LOOP_FAST.clear()
    try:
        for kill in range(2):
            async with aimu_serve(model, tmp_path, *budget, name=f"serve{kill}") as server:
                if kill == 0:
                    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                        await start(http, "r1", "loop")
                await until(f"request {kill + 1} streams",
                            lambda n=kill + 1: _asked(model, "loop") == n)
                server.process.kill()  # mid-reply: its answer is never stored
                await server.process.wait()
        recover_tools.LOOP_FAST.set()
        async with aimu_serve(model, tmp_path, *budget, name="serve2"):
            await until("the run is limited", lambda: latest_is(store, "r1", "limited"))
    finally:
        recover_tools.LOOP_FAST.clear()
    assert _asked(model, "loop") == 4
    last, second, first = await runs_of(store, "r1")
    assert [r.status for r in (first, second)] == ["failed", "failed"]
    assert (last.stop_reason, last.spend and last.spend["requests"]) == ("limit:requests", 4)


async def _crashed_session(store: Any, session: str, crashes: int) -> list[str]:
    """A session whose last ``crashes`` runs died with their process (the last one's
    record still says running, as a kill -9 leaves it)."""
    writer = await store.open_session(session)
    ids = []
    try:
        await writer.append({"role": "user", "content": "hello"})
        for n in range(crashes):
            run_id = f"{session}-r{n}"
            last = n == crashes - 1
            await writer.record_run(RunRecord(
                id=run_id, session=session, agent="agent", started=time.time() + n,
                status="running" if last else "failed",
                reason=None if last else f"{CRASHED} ({n + 1} in a row, at message 1); resumed",
            ))
            ids.append(run_id)
    finally:
        await writer.aclose()
    return ids


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_replicas_resume_a_crashed_run_exactly_once(
    tmp_path: Path, model: LoopbackServer, kind: str
) -> None:
    async with store_of(kind, tmp_path) as where:
        client = aio.client("openai:loop", base_url=model.openai_base_url, api_key="sk-test")
        apps = [app(client, store=where) for _ in range(3)]
        try:
            stores = [a.runs.store for a in apps]
            await _crashed_session(stores[0], "once", 1)
            ids = await _crashed_session(stores[0], "thrice", 3)
            looks = [Recovery(a.runs) for a in apps]
            started = await asyncio.gather(*(look.look() for look in looks))
            assert sorted(len(s) for s in started) == [0, 0, 1]  # one replica resumed it
            await until("it completes", lambda: latest_is(where, "once", "completed"))
            failed = (await stores[0].runs(session="thrice"))[0]
            assert failed.id == ids[-1] and failed.status == "failed" and not failed.recover
            assert "3 times in a row" in (failed.reason or "")
            assert (await stores[0].info("thrice")).status == "failed"  # type: ignore[union-attr]
            assert [await look.look() for look in looks] == [[], [], []]  # nothing left
        finally:
            for application in apps:
                await application.aclose()
            await client.aclose()


async def test_a_dead_run_behind_a_page_of_live_ones_is_found(
    tmp_path: Path, model: LoopbackServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A look reads every running record, a page at a time: a dead run older than a
    page of live ones (skipped at their locks) is still resumed."""
    monkeypatch.setattr(recovery, "_PAGE", 2)
    client = aio.client("openai:loop", base_url=model.openai_base_url, api_key="sk-test")
    application = app(client, store=tmp_path / "s.db")
    store = application.runs.store
    live = []
    try:
        await _crashed_session(store, "dead", 1)
        for n in range(2):  # newer, and alive: their writers hold their locks
            live.append(writer := await store.open_session(f"live{n}"))
            await writer.record_run(RunRecord(
                id=f"live-{n}", session=f"live{n}", agent="agent",
                started=time.time() + 10 + n, status="running",
            ))
        assert len(await Recovery(application.runs).look()) == 1
        await until("it completes", lambda: latest_is(store, "dead", "completed"))
    finally:
        for writer in live:
            await writer.aclose()
        await application.aclose()
        await client.aclose()


async def test_a_run_that_cannot_be_recovered_is_said_once_for_each_reason(
    tmp_path: Path, model: LoopbackServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A look every 0.1 s (``--recover-every``) at a run it cannot take yet (``--redis``
    keeps it live for its lease) says why once, at WARNING; a new reason is said again."""
    reasons = ["session 'held' has a run in progress (r); stop it or wait"] * 3 + ["gone"]

    class Refusing(Recovery):
        async def claim(self, record: RunRecord) -> str | None:
            raise Conflict(reasons.pop(0))

    client = aio.client("openai:loop", base_url=model.openai_base_url, api_key="sk-test")
    application = app(client, store=tmp_path / "s.db")
    try:
        await _crashed_session(application.runs.store, "held", 1)
        looks = Refusing(application.runs)
        with caplog.at_level(logging.DEBUG, logger="aimu.serve"):
            for _ in range(4):
                assert await looks.look() == []
        said = [(r.levelno, r.getMessage()) for r in caplog.records
                if r.getMessage().startswith("cannot recover run held-r0")]
        assert [level for level, _ in said] == [
            logging.WARNING, logging.DEBUG, logging.DEBUG, logging.WARNING], said
        assert said[-1][1].endswith(": gone")
    finally:
        await application.aclose()
        await client.aclose()


async def test_a_run_left_failed_goes_on_once_resumed_by_hand(
    tmp_path: Path, model: LoopbackServer
) -> None:
    """A run left failed after three deaths is resumed "by hand" from a terminal:
    ``aimu runs resume RUN --store`` marks it, and the next look of a recovering server
    goes on with it (once)."""
    client = aio.client("openai:loop", base_url=model.openai_base_url, api_key="sk-test")
    application = app(client, store=tmp_path / "s.db")
    try:
        ids = await _crashed_session(application.runs.store, "thrice", 3)
        look = Recovery(application.runs)
        assert await look.look() == []  # left failed, not resumed
        argv = ["runs", "resume", ids[-1], "--store", str(tmp_path / "s.db")]
        assert await asyncio.to_thread(main, argv) == 0
        [resumed] = await look.look()
        store = application.runs.store

        async def completed() -> bool:
            record = await store.run(resumed)
            return record is not None and record.status == "completed"

        await until("the resumed run completes", completed)
        assert await look.look() == []  # the mark is spent
    finally:
        await application.aclose()
        await client.aclose()


class HeldInstructions:
    """A system prompt the test holds: a run that reads it waits, before its record is
    stored, until :attr:`go` is set; :attr:`entered` says it waits (a provable point)."""

    def __init__(self) -> None:
        self.entered, self.go = asyncio.Event(), asyncio.Event()

    async def __call__(self, context: aio.RunContext[Any]) -> str:
        self.entered.set()
        await self.go.wait()
        return "be brief"


def _held_app(where: Path, held: HeldInstructions, **options: Any) -> Any:
    store = aio.SQLiteStore(where)
    model = aio.client("test")

    def agents(session: str) -> aio.Agent:
        return aio.Agent(model, system=held, store=store, session=session)

    return app(model, store=store, agents=agents, **options)


@pytest.mark.parametrize("backend", ["local", "redis"])
async def test_a_run_is_started_only_once_its_record_is_stored(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    """The 202 goes out when runs.start returns: by then the run's record says running
    and its task is stored, so a kill -9 right after it leaves the run to --recover."""
    held = HeldInstructions()
    options: dict[str, Any] = {}
    if backend == "redis":
        options = {"redis": request.getfixturevalue("redis_url"),
                   "redis_prefix": f"aimu_test_accept-{secrets.token_hex(4)}"}
    application = _held_app(tmp_path / "s.db", held, **options)
    store = application.runs.store
    try:
        starting = asyncio.ensure_future(application.runs.start("acc", "hello"))
        await held.entered.wait()  # the run reads its instructions: nothing stored yet
        assert not starting.done(), "started before the run was recorded"
        assert await store.runs(session="acc") == []
        held.go.set()
        view = await starting
        [record] = await store.runs(session="acc")
        assert record.id == view.run_id and record.status in ("running", "completed")
        assert {"role": "user", "content": "hello"} in await store.load("acc")
        await until("it ends", lambda: latest_is(store, "acc", "completed"))
    finally:
        held.go.set()
        await application.aclose()


async def test_a_start_cancelled_while_its_record_is_stored_leaves_the_run_going(
    tmp_path: Path,
) -> None:
    held = HeldInstructions()
    application = _held_app(tmp_path / "s.db", held)
    store = application.runs.store
    try:
        starting = asyncio.ensure_future(application.runs.start("gone", "hello"))
        await held.entered.wait()
        starting.cancel()  # the client went away, or the request was cut
        with pytest.raises(asyncio.CancelledError):
            await starting
        held.go.set()
        await until("the run ends", lambda: latest_is(store, "gone", "completed"))
        await until("the session is free", lambda: _free(application, "gone"))
        again = await application.runs.start("gone", "again")  # its session was released
        await until("the next one ends", lambda: _ended(store, "gone", again.run_id))
    finally:
        held.go.set()
        await application.aclose()


async def _free(application: Any, session: str) -> bool:
    return await application.runs.session_run(session) is None


async def _ended(store: Any, session: str, run_id: str) -> bool:
    latest = await store.runs(session=session, limit=1)
    return bool(latest) and latest[0].id == run_id and latest[0].status == "completed"


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "-inf", "soon"])
def test_drain_and_heartbeat_take_finite_seconds(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    commands = [["serve", f"--drain={value}"]]
    try:
        import temporalio  # noqa: F401
    except ImportError:
        pass
    else:
        commands += [
            ["worker", "--temporal", "x:1", "--task-queue", "q", f"--drain={value}"],
            ["worker", "--temporal", "x:1", "--task-queue", "q", f"--heartbeat={value}"],
        ]
    for argv in commands:
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args(argv)
        assert exited.value.code == 2
        assert "a finite number of seconds" in capsys.readouterr().err
    options = build_parser().parse_args(["serve"])
    assert isinstance(options, argparse.Namespace)
    assert (options.drain, options.recover) == (30.0, False)


def test_session_budget_options(capsys: pytest.CaptureFixture[str]) -> None:
    options = build_parser().parse_args(
        ["serve", "--max-requests", "9", "--session-max-requests", "3",
         "--session-max-tokens", "100"])
    assert session_limits_from(options) == aio.UsageLimits(requests=3, total_tokens=100)
    assert limits_from(options) == aio.UsageLimits(requests=9)
    for budget in (["--session-max-requests", "3"], ["--max-requests", "3"]):
        refused = build_parser().parse_args(
            ["serve", *budget, "--temporal", "127.0.0.1:1", "--task-queue", "q"])
        assert run_serve(refused) == 2  # a budget serve would parse and no worker keep
        assert "with --temporal the workers run them" in capsys.readouterr().err


async def test_a_workers_agents_keep_its_budgets(tmp_path: Path) -> None:
    """aimu worker's --max-* and --session-max-* reach the agents it runs (they were
    parsed and dropped)."""
    pytest.importorskip("temporalio")
    from aimu.temporal._command import worker_agents

    options = build_parser().parse_args(
        ["worker", "--temporal", "x:1", "--task-queue", "q", "--max-requests", "4",
         "--session-max-requests", "9", "--session-max-tokens", "100"])
    store, close_store = open_store(tmp_path / "s.db")
    agents, close_model = worker_agents(options, store, ())
    try:
        agent = agents("budgeted")
        assert agent.limits == aio.UsageLimits(requests=4)
        assert agent.session_limits == aio.UsageLimits(requests=9, total_tokens=100)
        await agent.aclose()
    finally:
        await close_model()
        if close_store is not None:
            await close_store()


@pytest.mark.parametrize(
    ("args", "said"),
    [(["--recover-every", "2"], "--recover-every goes with --recover"),
     (["--max-crashes", "2"], "--max-crashes takes a count, 1 or more, with --recover"),
     (["--recover", "--max-crashes", "0"], "--max-crashes takes a count"),
     (["--recover", "--temporal", "127.0.0.1:1", "--task-queue", "q"], "Temporal retries")],
)
async def test_recover_options_that_do_not_go_together_are_refused(
    tmp_path: Path, args: list[str], said: str
) -> None:
    from tests.serve.test_command import refused

    status, err = await refused(tmp_path, *args)
    assert status == 2 and said in err
