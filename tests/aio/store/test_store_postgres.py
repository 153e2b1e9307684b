"""What only PostgresStore has: a server to lose, a DSN to keep secret, many hosts.

Each test works in a schema of its own, dropped afterwards. "Hosts" are processes that
share the DSN; the lock between them is PostgreSQL's, not the operating system's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from aimu import aio
from aimu.aio.store import PostgresStore
from aimu.aio.transcript import Message, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from tests import services
from tests.aio.store.store_backends import Backend, backend, conversation

ROOT = Path(__file__).resolve().parents[3]
SECRET = "pw-Zq81-never-shown"
STEPS = 5


@pytest.fixture
async def where(tmp_path: Path) -> AsyncIterator[Backend]:
    async with backend("postgres", tmp_path) as location:
        yield location


def _schema(where: Backend) -> str:
    store = where.make()
    assert isinstance(store, PostgresStore)
    return store.schema


def _with_password(dsn: str, password: str) -> str:
    scheme, rest = dsn.split("://", 1)
    credentials, _, place = rest.rpartition("@")
    user = credentials.split(":", 1)[0] or "postgres"
    return f"{scheme}://{user}:{password}@{place}"


def _chain(error: BaseException | None) -> str:
    """The error, its causes and contexts, as text."""
    seen = []
    while error is not None and len(seen) < 10:
        seen.append(f"{type(error).__name__}: {error} {error!r}")
        error = error.__cause__ or error.__context__
    return "\n".join(seen)


# --------------------------------------------------------------------------- faults and secrets


async def test_an_unreachable_database_names_host_and_database_never_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = services.free_port()
    dsn = f"postgresql://aimu:{SECRET}@127.0.0.1:{port}/payments"
    caplog.set_level(logging.DEBUG)
    store = PostgresStore(dsn, connect_timeout=5)
    assert SECRET not in repr(store) and "payments" in repr(store)
    for call in (store.load("s"), store.sessions(), store.open_session("s")):
        with pytest.raises(aio.StoreError) as caught:
            await call
        message = str(caught.value)
        assert f"127.0.0.1:{port}" in message and "'payments'" in message, message
        assert SECRET not in _chain(caught.value)
    await store.aclose()
    assert SECRET not in caplog.text


async def test_a_missing_database_is_a_clear_error_without_the_password() -> None:
    dsn = _with_password(services.postgres_dsn(), SECRET).rsplit("/", 1)[0] + "/no_such_db"
    store = PostgresStore(dsn)
    with pytest.raises(aio.StoreError, match="database 'no_such_db'") as caught:
        await store.load("s")
    assert SECRET not in _chain(caught.value)
    await store.aclose()


async def test_the_password_never_appears_in_repr_or_errors_of_a_working_store(
    where: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    schema = _schema(where)
    store = PostgresStore(_with_password(services.postgres_dsn(), SECRET), schema=schema)
    async with store:
        writer = await store.open_session("s")
        await writer.append({"role": "user", "content": "hi"})
        with pytest.raises(aio.SessionLockedError) as locked:
            await store.open_session("s")
        texts = [repr(store), repr(writer), _chain(locked.value)]
        await writer.aclose()
        with pytest.raises(aio.StoreError) as closed:
            await writer.append({"role": "user", "content": "late"})
        texts.append(_chain(closed.value))
    assert all(SECRET not in text for text in texts), texts
    assert SECRET not in caplog.text


async def test_the_schema_is_created_once_versioned_and_a_newer_one_refused(
    where: Backend,
) -> None:
    schema = _schema(where)
    first, second = where.make(), where.make()
    # Two stores setting the schema up at once: one creates it, neither fails.
    await asyncio.gather(first.sessions(), second.sessions())
    conn = await asyncpg.connect(services.postgres_dsn())
    try:
        assert await conn.fetchval(f'SELECT max(version) FROM "{schema}".aimu_schema') == 4
        await conn.execute(f'UPDATE "{schema}".aimu_schema SET version = 99')
    finally:
        await conn.close()
    newer = where.make()
    with pytest.raises(aio.StoreFormatError, match=r"schema version 99, newer than the 4.*upgrade"):
        await newer.load("s")
    for store in (first, second, newer):
        await store.aclose()


# --------------------------------------------------------------------------- lost mid-run


def _model_turn(request: Mapping[str, Any]) -> Turn:
    """A model that is a function of the transcript, so any host can continue a run."""
    messages = request["messages"]
    start = max(i for i, m in enumerate(messages) if m["role"] == "user")
    done = sum(1 for m in messages[start:] if m["role"] == "tool")
    if done < STEPS:
        call = ScriptedCall("step", {"n": done}, id=f"call_{len(messages)}")
        return Turn(text=f"step {done}", tool_calls=(call,))
    return Turn(text=f"finished after {STEPS} steps")


async def _terminate_writer(schema: str, session: str) -> int:
    """Kill the server side of the connection that holds ``session``'s lock."""
    conn = await asyncpg.connect(services.postgres_dsn())
    try:
        return int(
            await conn.fetchval(
                "SELECT count(pg_terminate_backend(l.pid)) FROM pg_locks l WHERE "
                "l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND "
                "((l.classid::bigint << 32) | l.objid::bigint) = hashtextextended($1, 0)",
                f"aimu:{schema}:{session}",
            )
        )
    finally:
        await conn.close()


async def test_a_database_lost_mid_run_fails_the_run_and_keeps_what_was_acknowledged(
    where: Backend,
) -> None:
    schema = _schema(where)
    store = where.make()
    acknowledged: list[Message] = []

    async def step(n: int) -> str:
        """One step of the task."""
        if n == 2:  # the database goes away while this tool runs
            assert await _terminate_writer(schema, "lost") == 1
        return f"step {n} done"

    agent = aio.Agent(ScriptedModel(_model_turn), tools=[step], store=store, session="lost")
    with pytest.raises(aio.StoreError, match="lost the connection to PostgreSQL at") as caught:
        async for event in agent.run("work", stream=True):
            if isinstance(event, aio.ToolResult):
                acknowledged = list(agent.model_client.messages)
            if isinstance(event, aio.RunFinished):
                assert event.status == "failed" and "StoreError" in (event.error or "")
    assert "'lost'" in str(caught.value)
    assert agent.last_status == "failed" and not agent.running
    memory = agent.model_client.messages
    validate(memory)  # the transcript in memory is whole: settled, valid, restorable
    assert [m["content"] for m in memory if m["role"] == "tool"][:2] == [
        "step 0 done", "step 1 done"
    ]
    await agent.aclose()  # a dead writer closes without hanging or raising
    stored = await store.load("lost")
    assert stored == memory[: len(stored)], "the database holds a prefix of the run"
    assert stored[: len(acknowledged)] == acknowledged, "every acknowledged message is stored"
    # Restorable: into a new session (the old one stays as the database kept it).
    again = aio.Agent(ScriptedModel(_model_turn), tools=[step], store=store, session="again")
    await again.restore(memory)
    assert await again.resume() == f"finished after {STEPS} steps"
    validate(await store.load("again"))
    await again.aclose()
    await store.aclose()


# --------------------------------------------------------------------------- two hosts


HOST = """
import asyncio, json, sys
from aimu import aio
from tests.aio.store.test_store_postgres import _model_turn
from aimu.testing.scripted import ScriptedModel

SPEC, ROLE = sys.argv[1:3]


async def step(n: int) -> str:
    "One step of the task."
    if ROLE == "first" and n == 2:
        print(json.dumps(["blocked"]), flush=True)
        await asyncio.Event().wait()  # until this host is killed
    return f"step {n} done"


async def main():
    store = eval(SPEC, {"aio": aio})
    agent = aio.Agent(ScriptedModel(_model_turn), tools=[step], store=store, session="moving")
    try:
        if ROLE == "intruder":
            try:
                await agent.open()
            except aio.SessionLockedError as error:
                print(json.dumps(["locked", str(error)]), flush=True)
            return
        if ROLE == "first":
            events = agent.run("move me", stream=True)
        else:
            await agent.open()
            events = agent.resume(stream=True)
        async for event in events:
            if isinstance(event, aio.ToolResult):
                print(json.dumps(["result", event.call_id, event.content]), flush=True)
            elif isinstance(event, aio.RunFinished):
                print(json.dumps(["finished", event.status, event.reply]), flush=True)
    finally:
        await agent.aclose()
        await store.aclose()


asyncio.run(main())
"""


def _host(where: Backend, role: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOST), where.spec, role],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )


def _line(host: subprocess.Popen[str]) -> list[Any]:
    assert host.stdout is not None
    line = host.stdout.readline()
    assert line, f"the host exited ({host.poll()}) before printing"
    return list(json.loads(line))


def test_a_run_started_on_one_host_resumes_on_another_after_a_kill(where: Backend) -> None:
    with _host(where, "first") as first:
        try:
            acknowledged = []
            while (line := _line(first))[0] != "blocked":
                acknowledged.append(line)
            assert [line[2] for line in acknowledged] == ["step 0 done", "step 1 done"]
        finally:
            first.kill()  # SIGKILL: the connection drops, and the lock with it
            first.wait()
    assert first.returncode == -9
    with _host(where, "second") as second:
        out, _ = second.communicate(timeout=120)
    lines = [json.loads(line) for line in out.splitlines()]
    assert second.returncode == 0, lines
    assert lines[-1] == ["finished", "completed", f"finished after {STEPS} steps"]

    async def stored() -> list[Message]:
        store = where.make()
        try:
            return await store.load("moving")
        finally:
            await store.aclose()

    transcript = asyncio.run(stored())
    validate(transcript)
    results = {m["tool_call_id"]: m["content"] for m in transcript if m["role"] == "tool"}
    for _, call_id, content in acknowledged:
        assert results[call_id] == content, "an acknowledged result was lost"
    assert [m["content"] for m in transcript if m["role"] == "user"] == ["move me"]
    steps = [m["tool_calls"][0]["function"]["arguments"]["n"]
             for m in transcript if m["role"] == "assistant" and m.get("tool_calls")]
    assert steps == list(range(STEPS)), "each step once, none repeated"


def test_a_second_concurrent_writer_on_another_host_is_refused(where: Backend) -> None:
    with _host(where, "first") as first:
        try:
            while _line(first)[0] != "blocked":
                pass
            with _host(where, "intruder") as intruder:
                out, _ = intruder.communicate(timeout=60)
            assert intruder.returncode == 0
            kind, message = json.loads(out)
            assert kind == "locked"
            assert f"already open for writing by process {first.pid} on host" in message
            assert "session 'moving'" in message and "store.load() is always allowed" in message
        finally:
            first.kill()
            first.wait()


async def test_reading_is_allowed_while_another_host_writes(where: Backend) -> None:
    store = where.make()
    async with await store.open_session("busy") as writer:
        for message in conversation(1):
            await writer.append(message)
        other = where.make()
        assert await other.load("busy") == conversation(1)
        info = await other.info("busy")
        assert info is not None and info.message_count == len(conversation(1))
        with pytest.raises(aio.SessionLockedError):
            await other.delete("busy")
        await other.aclose()
    await store.aclose()


async def test_a_writer_without_synchronous_commit_still_stores_every_write(
    where: Backend,
) -> None:
    fast = PostgresStore(services.postgres_dsn(), schema=_schema(where), synchronous_commit=False)
    async with fast, await fast.open_session("fast") as writer:
        for message in conversation(2):
            await writer.append(message)
    reader = where.make()
    assert await reader.load("fast") == conversation(2)
    await reader.aclose()


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("{not json", "a stored message is not JSON"),
        ("1,2", "a stored message is not JSON"),  # joins into valid JSON: the count tells
        ('{"role":"banana","content":"x"}', r"row seq=2 is not a valid message.*banana"),
    ],
)
async def test_a_corrupt_stored_message_is_a_format_error_naming_the_session(
    where: Backend, body: str, error: str
) -> None:
    store = where.make()
    async with await store.open_session("bad") as writer:
        for message in conversation(1):
            await writer.append(message)
    conn = await asyncpg.connect(services.postgres_dsn())
    try:
        await conn.execute(
            f'UPDATE "{_schema(where)}".messages SET body = $1 WHERE session = $2 AND seq = 2',
            body, "bad",
        )
    finally:
        await conn.close()
    with pytest.raises(aio.StoreFormatError, match=rf"session 'bad'.*{error}"):
        await store.load("bad")
    await store.aclose()


# --------------------------------------------------------------------------- connections


async def test_writers_are_bounded_and_one_more_session_says_what_ran_out(
    where: Backend,
) -> None:
    """Issue 21 item 16: each open session holds a connection; the store bounds them."""
    spec = where.spec.replace(")", ", max_writers=2, pool_size=1)")
    store = eval(spec, {"aio": aio})
    assert isinstance(store, PostgresStore)
    first, second = await store.open_session("a"), await store.open_session("b")
    with pytest.raises(aio.StoreCapacityError, match=r"all 2 writer connections are in use"):
        await store.open_session("c")
    assert await store.info("c") is None  # nothing was written, reads still work
    await first.aclose()
    third = await store.open_session("c")  # a closed session gave its connection back
    await third.aclose()
    await second.aclose()
    await store.aclose()
    with pytest.raises(ValueError, match="max_writers"):
        PostgresStore(services.postgres_dsn(), max_writers=0)


async def test_a_server_out_of_connections_is_a_capacity_error_naming_the_limit(
    where: Backend,
) -> None:
    """The server's own limit (here a role's CONNECTION LIMIT) is named, not a bare 500."""
    dsn = services.postgres_dsn()
    store = where.make()
    assert isinstance(store, PostgresStore)
    role = f"{store.schema}_limited"
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 1')
        database = await admin.fetchval("SELECT current_database()")
        await admin.execute(f'GRANT CREATE ON DATABASE "{database}" TO "{role}"')
        limited_dsn = _with_user(dsn, role)
        limited = PostgresStore(limited_dsn, schema=store.schema, pool_size=1)
        await limited.sessions()  # the pool's one connection: the role's only one
        with pytest.raises(aio.StoreCapacityError, match="no connection left") as caught:
            await limited.open_session("s")
        assert "connection limit" in str(caught.value) and role in str(caught.value)
        await limited.aclose()
    finally:
        await admin.execute(f'DROP SCHEMA IF EXISTS "{store.schema}" CASCADE')
        await admin.execute(f'DROP OWNED BY "{role}"')
        await admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        await admin.close()


async def test_a_read_pool_that_stays_busy_is_a_capacity_error(where: Backend) -> None:
    spec = where.spec.replace(")", ", pool_size=1, connect_timeout=0.2)")
    store = eval(spec, {"aio": aio})
    assert isinstance(store, PostgresStore)
    await store.sessions()
    holding, release = asyncio.Event(), asyncio.Event()

    async def hold(conn: asyncpg.Connection) -> None:
        holding.set()
        await release.wait()

    held = asyncio.ensure_future(store._read("hold the pool", hold))
    await holding.wait()
    with pytest.raises(aio.StoreCapacityError, match="all 1 read connections stayed busy"):
        await store.load("s")
    release.set()
    await held
    assert await store.load("s") == []
    await store.aclose()


def _with_user(dsn: str, user: str) -> str:
    scheme, rest = dsn.split("://", 1)
    _, _, place = rest.rpartition("@")
    return f"{scheme}://{user}@{place}"
