"""Runs as records in every store (SQLite, JSONL, PostgreSQL): written ``running`` as a
run starts and again as it ends; a run killed mid-way stays ``running``; listed newest
first, by session and status, a page at a time; old files and tables migrate."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aimu import aio
from aimu.aio.store import RunRecord, Store
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from tests import services
from tests.aio.store.store_backends import KINDS, Backend, backend, drop_schema

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(params=KINDS)
async def where(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    async with backend(str(request.param), tmp_path) as location:
        yield location


@pytest.fixture
async def store(where: Backend) -> AsyncIterator[Store]:
    made = where.make()
    try:
        yield made
    finally:
        await made.aclose()


async def test_runs_recorded_as_they_start_and_end(store: Store) -> None:
    """A completed run, a cancelled one (with its reason), runs of two sessions; read
    back newest first, filtered, a page at a time; bad input refused, nothing changed."""
    entered = asyncio.Event()

    async def hang() -> str:
        """Wait forever."""
        entered.set()
        await asyncio.Event().wait()
        return "never"

    script = [
        Turn(text="hello"),
        Turn(tool_calls=(ScriptedCall("hang", {}, id="call_1"),)),
    ]
    agent = aio.Agent(ScriptedModel(script, model="m1"), tools=[hang], store=store,
                      session="one", name="greeter")
    async with agent:
        assert await agent.run("hi") == "hello"
        done = await store.runs()
        assert [r.status for r in done] == ["completed"]
        task = asyncio.ensure_future(agent.run("wait"))
        await entered.wait()
        running = await store.runs(status="running")
        assert len(running) == 1 and running[0].ended is None  # stored as it started
        task.cancel("stopped by the test")
        with pytest.raises(asyncio.CancelledError):
            await task
    other = aio.Agent(ScriptedModel([Turn(text="bye")]), store=store, session="two")
    async with other:
        await other.run("go")

    runs = await store.runs()
    assert [(r.session, r.status) for r in runs] == [
        ("two", "completed"), ("one", "cancelled"), ("one", "completed"),
    ]
    cancelled, first = runs[1], runs[2]
    assert (first.messages_from, cancelled.messages_from, runs[0].messages_from) == (0, 2, 0)
    assert cancelled.reason == "stopped by the test" and cancelled.ended is not None
    assert first.agent == "greeter" and first.parent is None and not first.recover
    assert first.models == ("scripted:m1",) and first.stop_reason == "stop"
    assert first.usage == {"input_tokens": 0, "output_tokens": 1}
    assert first.spend is not None and first.spend["requests"] == 1
    assert first.started <= first.ended  # type: ignore[operator]
    assert await store.run(first.id) == first
    assert await store.run("no-such-run") is None

    assert [r.id for r in await store.runs(session="one")] == [cancelled.id, first.id]
    assert await store.runs(status="cancelled") == [cancelled]
    assert await store.runs(session="two", status="cancelled") == []
    page = await store.runs(limit=2)
    assert page == runs[:2]
    assert await store.runs(limit=2, before=page[-1].id) == runs[2:]
    assert await store.runs(session="one", before=cancelled.id) == [first]

    for bad, message in [
        ({"status": "done"}, "unknown run status 'done'"),
        ({"before": "nope"}, "unknown run id 'nope'"),
        ({"before": "../x"}, "invalid run id"),
        ({"session": "a/b"}, "invalid session name"),
        ({"limit": 0}, "limit must be an int from 1 to 1000"),
    ]:
        with pytest.raises(ValueError, match=message):
            await store.runs(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid run id"):
        await store.run("a/../b")
    writer = await store.open_session("one")
    try:
        with pytest.raises(ValueError, match="not of 'one'"):
            await writer.record_run(RunRecord("x", "two", "a", 1.0, "running"))
        with pytest.raises(ValueError, match="unknown run status"):
            await writer.record_run(RunRecord("x", "one", "a", 1.0, "bogus"))  # type: ignore[arg-type]
    finally:
        await writer.aclose()
    assert await store.runs() == runs  # nothing changed

    assert await store.delete("one")
    assert [r.session for r in await store.runs()] == ["two"]


KILLED_CHILD = """
import asyncio, sys
from aimu import aio
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel

async def hang() -> str:
    "Wait forever."
    print("in the tool", flush=True)
    await asyncio.Event().wait()
    return "never"

async def main():
    store = eval(sys.argv[1], {"aio": aio})
    model = ScriptedModel([Turn(tool_calls=(ScriptedCall("hang", {}, id="call_1"),))])
    agent = aio.Agent(model, tools=[hang], store=store, session="killed")
    await agent.run("go")

asyncio.run(main())
"""


def _kill_in_tool(spec: str) -> None:
    """Run the child until it is inside its tool (it said so), then kill -9 it."""
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_CHILD), spec],
        stdout=subprocess.PIPE, cwd=ROOT,
    )
    assert child.stdout is not None
    try:
        assert child.stdout.readline() == b"in the tool\n"
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


async def test_killed_run_stays_running(where: Backend) -> None:
    """kill -9 mid-run (inside a tool): the record still says ``running``, no end; that
    is what recovery reads."""
    await asyncio.to_thread(_kill_in_tool, where.spec)
    store = where.make()
    try:
        (record,) = await store.runs()
        assert record.status == "running" and record.ended is None
        assert record.session == "killed" and record.agent == "agent"
        assert await store.runs(status="running") == [record]
    finally:
        await store.aclose()


# The SQLite schema version 2 (before runs), as aimu 56cbb0b wrote it.
OLD_SQLITE = """
CREATE TABLE sessions (name TEXT PRIMARY KEY, created REAL NOT NULL, updated REAL NOT NULL,
    status TEXT);
CREATE TABLE messages (session TEXT NOT NULL, seq INTEGER NOT NULL, at REAL NOT NULL,
    body TEXT NOT NULL, PRIMARY KEY (session, seq)) WITHOUT ROWID;
CREATE TABLE tool_starts (session TEXT NOT NULL, call_id TEXT NOT NULL, name TEXT NOT NULL,
    arguments TEXT NOT NULL, at REAL NOT NULL, PRIMARY KEY (session, call_id)) WITHOUT ROWID;
CREATE TABLE states (session TEXT PRIMARY KEY, body TEXT NOT NULL);
INSERT INTO sessions VALUES ('old', 1.0, 2.0, 'completed');
INSERT INTO messages VALUES ('old', 0, 1.0, '{"role":"user","content":"hi"}');
INSERT INTO messages VALUES ('old', 1, 2.0, '{"role":"assistant","content":"hello"}');
PRAGMA user_version = 2;
"""

# The PostgreSQL schema version 1 (before runs).
OLD_POSTGRES = """
CREATE SCHEMA {s};
CREATE TABLE {s}.aimu_schema (version integer NOT NULL);
INSERT INTO {s}.aimu_schema VALUES (1);
CREATE TABLE {s}.sessions (name text PRIMARY KEY, created double precision NOT NULL,
    updated double precision NOT NULL, status text, state text);
CREATE TABLE {s}.messages (session text NOT NULL, seq integer NOT NULL,
    at double precision NOT NULL, body text NOT NULL, PRIMARY KEY (session, seq));
CREATE TABLE {s}.tool_starts (session text NOT NULL, call_id text NOT NULL,
    name text NOT NULL, arguments text NOT NULL, at double precision NOT NULL,
    PRIMARY KEY (session, call_id));
INSERT INTO {s}.sessions VALUES ('old', 1.0, 2.0, 'completed', NULL);
INSERT INTO {s}.messages VALUES ('old', 0, 1.0, '{{"role":"user","content":"hi"}}');
INSERT INTO {s}.messages VALUES ('old', 1, 2.0, '{{"role":"assistant","content":"hello"}}');
"""


# A run row of the schema before messages_from (SQLite 3, PostgreSQL 2).
OLD_RUN = ("'r0', 'old', 'agent', NULL, 1.0, 2.0, 'completed', NULL, 'stop', NULL, NULL, "
           "NULL, '[]', {false}")
OLD_RUNS_TABLE = """
CREATE TABLE {s}runs (id text PRIMARY KEY, session text NOT NULL, agent text NOT NULL,
    parent text, started double precision NOT NULL, ended double precision,
    status text NOT NULL, reason text, stop_reason text, usage text, spend text,
    run_limit text, models text NOT NULL, recover {boolean} NOT NULL);
INSERT INTO {s}runs VALUES ({row});
"""


async def _check_migrated(store: Store, had_runs: bool = False) -> None:
    assert await store.load("old") == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
    ]
    info = await store.info("old")
    assert info is not None and info.status == "completed" and info.message_count == 2
    old = await store.runs()
    assert [(r.id, r.status, r.messages_from) for r in old] == (
        [("r0", "completed", None)] if had_runs else []
    )
    agent = aio.Agent(ScriptedModel([Turn(text="again")]), store=store, session="old")
    async with agent:
        await agent.run("more")
    record, *_ = await store.runs(session="old")
    assert (record.status, record.messages_from) == ("completed", 2)
    assert len(await store.load("old")) == 4


@pytest.mark.parametrize("version", [2, 3])
async def test_sqlite_file_of_an_older_schema_migrates(tmp_path: Path, version: int) -> None:
    path = tmp_path / "old.db"
    script = OLD_SQLITE
    if version == 3:  # the runs table, without messages_from
        table = OLD_RUNS_TABLE.format(s="", boolean="INTEGER", row=OLD_RUN.format(false=0))
        script = script.replace("PRAGMA user_version = 2;", table + "PRAGMA user_version = 3;")
    with sqlite3.connect(path) as conn:
        conn.executescript(script)
    conn.close()
    store = aio.SQLiteStore(path)
    try:
        await _check_migrated(store, had_runs=version == 3)
    finally:
        await store.aclose()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 5
    conn.close()


@pytest.mark.parametrize("version", [1, 2])
async def test_postgres_schema_of_an_older_version_migrates(version: int) -> None:
    import asyncpg

    dsn = services.postgres_dsn()
    schema = f"aimu_test_{uuid.uuid4().hex[:12]}"
    script = OLD_POSTGRES.format(s=f'"{schema}"')
    if version == 2:  # the runs table, without messages_from
        script += OLD_RUNS_TABLE.format(s=f'"{schema}".', boolean="boolean",
                                        row=OLD_RUN.format(false="false"))
        script = script.replace("aimu_schema VALUES (1)", "aimu_schema VALUES (2)")
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(script)
    finally:
        await conn.close()
    try:
        store = aio.PostgresStore(dsn, schema=schema)
        try:
            await _check_migrated(store, had_runs=version == 2)
        finally:
            await store.aclose()
        conn = await asyncpg.connect(dsn)
        try:
            assert await conn.fetchval(f'SELECT max(version) FROM "{schema}".aimu_schema') == 4
        finally:
            await conn.close()
    finally:
        await drop_schema(dsn, schema)


async def test_a_handle_names_its_first_run_and_a_limit_is_recorded(store: Store) -> None:
    """The record of a run started by a handle has the handle's run id (as GET /runs/{id}
    does); a second run in the same handle gets an id of its own; a limited run names
    its limit."""
    step = Turn(tool_calls=(ScriptedCall("noop", {}),))

    async def noop() -> str:
        """Do nothing."""
        return "done"

    agent = aio.Agent(
        ScriptedModel([Turn(text="a"), Turn(text="b"), step, Turn(text="never")]),
        tools=[noop], store=store, session="h",
    )

    async def two_runs() -> None:
        await agent.run("one")
        await agent.run("two")

    async with agent:
        await aio.RunHandle.start(two_runs(), run_id="handle-1")
        await agent.run("three", limits=aio.UsageLimits(requests=1))
    limited, second, first = await store.runs(session="h")
    assert first.id == "handle-1" and first.status == "completed"
    assert second.id not in ("handle-1", first.id) and second.status == "completed"
    assert limited.status == "limited" and limited.limit is not None
    assert "requests limit of 1" in limited.limit and limited.ended is not None


async def test_interrupted_and_paused_runs_say_why(tmp_path: Path) -> None:
    """A run interrupted at a step boundary and one paused for approval: each record ends
    so, with its reason (the paused one names the call it waits on)."""
    entered = asyncio.Event()
    release = asyncio.Event()

    async def slow() -> str:
        """Wait until released."""
        entered.set()
        await release.wait()
        return "ok"

    @aio.tool(approval=True)
    async def pay(amount: int) -> str:
        """Pay."""
        return "paid"

    script = [
        Turn(tool_calls=(ScriptedCall("slow", {}, id="s1"),)),
        Turn(tool_calls=(ScriptedCall("pay", {"amount": 3}, id="p1"),)),
    ]
    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        agent = aio.Agent(ScriptedModel(script), tools=[slow, pay], store=store, session="s")
        async with agent:
            task = asyncio.ensure_future(agent.run("work"))
            await entered.wait()
            agent.interrupt()  # lands at the boundary after the tool round
            release.set()
            await task
            await agent.resume()
        paused, interrupted = await store.runs()
    assert interrupted.status == "interrupted" and "interrupt" in (interrupted.reason or "")
    assert paused.status == "paused" and "pay (p1)" in (paused.reason or "")


async def test_runs_to_recover_are_found_by_their_mark(store: Store) -> None:
    """``runs(recover=True)`` lists the records marked to go on (a drain marks them),
    ``recover=False`` the others, with the other filters; a mark written again is
    cleared."""
    writer = await store.open_session("marks")
    try:
        for n, marked in enumerate((True, False, True)):
            await writer.record_run(RunRecord(
                id=f"mark-{n}", session="marks", agent="a", started=1000.0 + n,
                status="interrupted", recover=marked,
            ))
        assert [r.id for r in await store.runs(recover=True)] == ["mark-2", "mark-0"]
        assert [r.id for r in await store.runs(recover=False)] == ["mark-1"]
        assert [r.id for r in await store.runs(status="interrupted", recover=True, limit=1)
                ] == ["mark-2"]
        spent = await store.run("mark-2")
        assert spent is not None
        await writer.record_run(RunRecord(**{**spent.to_json(), "recover": False,
                                             "models": ()}))
        assert [r.id for r in await store.runs(session="marks", recover=True)] == ["mark-0"]
    finally:
        await writer.aclose()
