"""Sessions in PostgreSQL, shared by every host that reaches the database (``asyncpg``).

One row per message keyed by (session, seq); a row of metadata, status and state per
session; the tool journal. The schema is created on first use and versioned; a newer
one is refused. A writer holds a session-level advisory lock on a connection of its
own, so a writer on any host excludes every other, and a killed writer's lock goes
with its connection. Reads use a small pool and are always allowed. So a store holds at
most ``max_writers + pool_size`` connections; running out of them, or of the server's,
is a :class:`~aimu.aio.errors.StoreCapacityError` naming the limit.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, TypeVar, cast
from urllib.parse import unquote, urlsplit

from aimu._extras import missing_extra
from aimu.aio.errors import (
    SessionLockedError,
    StoreCapacityError,
    StoreError,
    StoreFormatError,
    TranscriptError,
)
from aimu.aio.store._codec import decode_state, encode, encode_state, encode_value, parse_array
from aimu.aio.store._pages import RunPages, RunsPage, runs_query, unknown_run
from aimu.aio.store._postgres_inputs import StoreInputs, WriterInputs
from aimu.aio.store._protocol import (
    RUN_COLUMNS,
    RunRecord,
    SessionInfo,
    SessionStatus,
    ToolStart,
    check_run_id,
    check_run_of,
    check_status,
    run_record,
    run_row,
    session_info,
    validate_session_name,
)
from aimu.aio.store._report import note_locked, note_unfinished
from aimu.aio.transcript import Message, validate

try:
    import asyncpg
except ImportError as missing:  # pragma: no cover - the extra is in the test install
    raise missing_extra("PostgresStore", "postgres", missing) from missing

__all__ = ["PostgresStore"]

SCHEMA_VERSION: Final = 4
# Version 2 added the runs table: an older schema gets it on first use (IF NOT EXISTS);
# version 3 the runs' messages_from (ADD COLUMN IF NOT EXISTS); version 4 the pending
# inputs (IF NOT EXISTS).
_T = TypeVar("_T")

# {s} is the quoted schema name. Bodies are kept as text (not jsonb): stored byte for
# byte, and a load parses them all in one C call.
_SCHEMA_SQL: Final = """
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.aimu_schema (version integer NOT NULL);
CREATE TABLE IF NOT EXISTS {s}.sessions (
    name text PRIMARY KEY,
    created double precision NOT NULL,
    updated double precision NOT NULL,
    status text,
    state text
);
CREATE TABLE IF NOT EXISTS {s}.messages (
    session text NOT NULL,
    seq integer NOT NULL,
    at double precision NOT NULL,
    body text NOT NULL,
    PRIMARY KEY (session, seq)
);
CREATE TABLE IF NOT EXISTS {s}.tool_starts (
    session text NOT NULL,
    call_id text NOT NULL,
    name text NOT NULL,
    arguments text NOT NULL,
    at double precision NOT NULL,
    PRIMARY KEY (session, call_id)
);
CREATE TABLE IF NOT EXISTS {s}.runs (
    id text PRIMARY KEY,
    session text NOT NULL,
    agent text NOT NULL,
    parent text,
    started double precision NOT NULL,
    ended double precision,
    status text NOT NULL,
    reason text,
    stop_reason text,
    usage text,
    spend text,
    run_limit text,
    models text NOT NULL,
    recover boolean NOT NULL,
    messages_from integer
);
ALTER TABLE {s}.runs ADD COLUMN IF NOT EXISTS messages_from integer;
CREATE TABLE IF NOT EXISTS {s}.inputs (
    session text NOT NULL,
    id text NOT NULL,
    at double precision NOT NULL,
    body text NOT NULL,
    PRIMARY KEY (session, id)
);
CREATE INDEX IF NOT EXISTS runs_by_start ON {s}.runs (started, id);
CREATE INDEX IF NOT EXISTS runs_by_session ON {s}.runs (session, started, id);
CREATE INDEX IF NOT EXISTS runs_by_status ON {s}.runs (status, started, id);
"""

#: Connection failures that mean the database went away (the writer is then dead).
_LOST: Final = (OSError, TimeoutError)
#: Everything the driver raises for a failed statement or connection.
_DRIVER: Final = (*_LOST, asyncpg.PostgresError, asyncpg.InterfaceError)


class _Where:
    """The database a DSN names, for messages: host, port, database, user; no password."""

    def __init__(self, dsn: str) -> None:
        if not isinstance(dsn, str) or not dsn.startswith(("postgresql://", "postgres://")):
            raise ValueError(
                "PostgresStore takes a DSN like postgresql://user@host:5432/database"
            )
        parts = urlsplit(dsn)
        try:
            port = parts.port or 5432
        except ValueError:
            raise ValueError("the PostgreSQL DSN has an invalid port") from None
        self.host = parts.hostname or "localhost"
        self.port = port
        self.database = unquote(parts.path.lstrip("/")) or unquote(parts.username or "postgres")
        self.user = unquote(parts.username or "")
        self.password = unquote(parts.password or "")
        for item in parts.query.split("&"):
            key, _, value = item.partition("=")
            if key == "password" and value:
                self.password = unquote(value)

    def __str__(self) -> str:
        return f"PostgreSQL at {self.host}:{self.port}, database {self.database!r}"

    def url(self) -> str:
        user = f"{self.user}@" if self.user else ""
        return f"postgresql://{user}{self.host}:{self.port}/{self.database}"

    def scrub(self, text: str) -> str:
        """``text`` with the password masked, whatever put it there."""
        return text.replace(self.password, "***") if self.password else text


def _quote(identifier: str) -> str:
    if not identifier or len(identifier) > 63 or "\x00" in identifier:
        raise ValueError(f"invalid PostgreSQL schema name {identifier!r:.80}")
    return '"' + identifier.replace('"', '""') + '"'


def _lock_key(schema: str, session: str) -> str:
    return f"aimu:{schema}:{session}"


def _application_name() -> str:
    """Set on writer connections, so a refused second writer can name the holder."""
    return f"aimu writer pid={os.getpid()} host={socket.gethostname()}"[:63]


def _holder(application: str | None) -> str:
    if not application or not application.startswith("aimu writer pid="):
        return "another connection"
    fields = dict(part.split("=", 1) for part in application.split()[2:] if "=" in part)
    pid, host = fields.get("pid", "?"), fields.get("host", "?")
    if pid == str(os.getpid()) and host == socket.gethostname()[: len(host)]:
        return "another writer in this process"
    return f"process {pid} on host {host}"


class PostgresStore(StoreInputs, RunPages):
    """Sessions in PostgreSQL: one database (and schema) shared by many hosts.

    ``dsn`` is a ``postgresql://user:password@host:port/database`` URL; ``schema`` holds
    the tables (created on first use). Every write is one transaction, on the server's
    disk when it returns. ``synchronous_commit=False`` (opt-in) makes the writer's commits
    return before the server flushes them: still safe from the writing process being
    killed, but a crash of the database server may lose its last commits. Nothing
    connects until first use; an unreachable database is then a ``StoreError`` naming
    host and database, never the password. Use a store from one event loop.

    Each open session holds a connection of its own (its lock), at most ``max_writers``
    at once; reads share ``pool_size`` more. Opening one more session, a read that finds
    the pool busy for ``connect_timeout`` seconds, or a server out of connections raises
    ``StoreCapacityError`` saying which ran out.
    """

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = "aimu",
        pool_size: int = 4,
        max_writers: int = 32,
        connect_timeout: float = 10.0,
        command_timeout: float = 60.0,
        synchronous_commit: bool = True,
    ) -> None:
        for name, value in (("pool_size", pool_size), ("max_writers", max_writers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PostgresStore({name}=...) must be an int >= 1, got {value!r}")
        self._where = _Where(dsn)
        self._dsn = dsn
        self.schema = schema
        self._s = _quote(schema)
        self._pool_size = pool_size
        self.max_writers = max_writers
        #: Sessions being opened now (their connections count against max_writers).
        self._opening = 0
        self._connect_timeout = connect_timeout
        self._command_timeout = command_timeout
        self.synchronous_commit = synchronous_commit
        self._pool: asyncpg.Pool | None = None
        self._setup_lock: asyncio.Lock | None = None
        self._writers: set[_PostgresWriter] = set()
        self._closed = False

    def __repr__(self) -> str:
        return f"<PostgresStore {self._where.url()} schema={self.schema!r}>"

    # -- connecting ----------------------------------------------------------------

    def _fail(self, error: BaseException, what: str, *, lost: bool = False) -> StoreError:
        """A StoreError for ``error`` while doing ``what``; the password never in it."""
        detail = self._where.scrub(f"{type(error).__name__}: {error}")
        if isinstance(error, asyncpg.TooManyConnectionsError):
            return self._server_full(what, detail)
        if lost or isinstance(error, _LOST):
            return StoreError(
                f"lost the connection to {self._where} while trying to {what} ({detail}); "
                "what was written before is stored, this writer is closed"
            )
        return StoreError(f"{self._where}: cannot {what}: {detail}")

    def _server_full(self, what: str, detail: str) -> StoreCapacityError:
        return StoreCapacityError(
            f"{self._where} has no connection left to {what} (the server's max_connections "
            f"or the user's connection limit was reached: {detail}); close sessions, lower "
            "max_writers / pool_size here or raise the server's limit",
            ran_out="the database server's connections",
        )

    async def _connect(self, **options: Any) -> asyncpg.Connection:

        try:
            return await asyncpg.connect(
                self._dsn,
                timeout=self._connect_timeout,
                command_timeout=self._command_timeout,
                **options,
            )
        except asyncpg.TooManyConnectionsError as error:
            raise self._server_full(
                "connect", self._where.scrub(f"{type(error).__name__}: {error}")
            ) from None
        except (*_DRIVER, ValueError) as error:
            # from None: a driver error may echo the DSN it was given.
            raise StoreError(
                f"cannot connect to {self._where} as user {self._where.user or '(default)'!r}: "
                f"{self._where.scrub(f'{type(error).__name__}: {error}')}"
            ) from None

    async def _ready(self, what: str) -> asyncpg.Pool:
        """The read pool, after creating or checking the schema once."""
        if self._closed:
            raise StoreError(f"{self!r} is closed; cannot {what}")
        if self._pool is not None:
            return self._pool
        if self._setup_lock is None:
            self._setup_lock = asyncio.Lock()
        async with self._setup_lock:
            if self._pool is None:
                conn = await self._connect()
                try:
                    await self._setup(conn)
                finally:
                    await conn.close()

                try:
                    self._pool = await asyncpg.create_pool(
                        self._dsn, min_size=1, max_size=self._pool_size,
                        timeout=self._connect_timeout, command_timeout=self._command_timeout,
                    )
                except asyncpg.TooManyConnectionsError as error:
                    raise self._fail(error, "open the read pool") from None
                except _DRIVER as error:
                    raise StoreError(
                        f"cannot connect to {self._where}: "
                        f"{self._where.scrub(f'{type(error).__name__}: {error}')}"
                    ) from None
        if self._closed:  # closed while connecting
            raise StoreError(f"{self!r} is closed; cannot {what}")
        return self._pool

    async def _setup(self, conn: asyncpg.Connection) -> None:
        """Create the schema if missing (one creator at a time); refuse a newer one."""

        try:
            async with conn.transaction():
                await conn.execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", f"aimu:{self.schema}"
                )
                exists = await conn.fetchval(
                    "SELECT to_regclass($1) IS NOT NULL", f"{self._s}.aimu_schema"
                )
                version = (
                    await conn.fetchval(f"SELECT max(version) FROM {self._s}.aimu_schema")
                    if exists else None
                )
                if version is not None and version > SCHEMA_VERSION:
                    raise StoreFormatError(
                        f"{self._where}, schema {self.schema!r} has store schema version "
                        f"{version}, newer than the {SCHEMA_VERSION} this aimu reads; "
                        "upgrade aimu to open it"
                    )
                if version is None or version < SCHEMA_VERSION:
                    await conn.execute(_SCHEMA_SQL.format(s=self._s))
                    await conn.execute(f"DELETE FROM {self._s}.aimu_schema")
                    await conn.execute(
                        f"INSERT INTO {self._s}.aimu_schema VALUES ($1)", SCHEMA_VERSION
                    )
        except _DRIVER as error:
            raise self._fail(error, f"set up schema {self.schema!r}") from error

    async def _read(
        self, what: str, query: Callable[[asyncpg.Connection], Awaitable[_T]]
    ) -> _T:

        pool = await self._ready(what)
        try:
            acquired = pool.acquire(timeout=self._connect_timeout)
            conn = await acquired.__aenter__()
        except TimeoutError:
            raise StoreCapacityError(
                f"{self._where}: all {self._pool_size} read connections stayed busy for "
                f"{self._connect_timeout:g} s, so this could not {what}; raise "
                "PostgresStore(pool_size=...) or read less at once",
                ran_out=f"the {self._pool_size} read connections (all busy)",
            ) from None
        except _DRIVER as error:
            raise self._fail(error, what) from error
        try:
            return await query(cast("asyncpg.Connection", conn))
        except _DRIVER as error:
            raise self._fail(error, what) from error
        finally:
            await acquired.__aexit__(None, None, None)

    # -- reading -------------------------------------------------------------------

    async def load(self, session: str) -> list[Message]:
        # Bodies only (seq runs 0..n-1), joined and parsed in one C call here: cheaper
        # than asking the server to join them (measured in benchmarks/bench_store.py).
        rows = await self._session_rows(
            session, f"load session {session!r}",
            f"SELECT body FROM {self._s}.messages WHERE session = $1 ORDER BY seq",
        )
        parsed = parse_array([row[0] for row in rows])
        where = f"{self._where}, schema {self.schema!r}: session {session!r}"
        if parsed is None:
            raise StoreFormatError(f"{where}: a stored message is not JSON; cannot read it")
        try:
            validate(parsed)
        except TranscriptError as error:
            row_name = f"row seq={error.index}" if error.index is not None else "rows"
            raise StoreFormatError(f"{where} {row_name} is not a valid message: {error}") from error
        return cast(list[Message], parsed)

    async def load_state(self, session: str) -> dict[str, Any]:
        validate_session_name(session)
        text = await self._read(
            f"read the state of session {session!r}",
            lambda conn: conn.fetchval(
                f"SELECT state FROM {self._s}.sessions WHERE name = $1", session
            ),
        )
        if text is None:
            return {}
        return decode_state(text, f"{self._where}: session {session!r}")

    async def tool_starts(self, session: str) -> list[ToolStart]:
        rows = await self._session_rows(
            session, f"read the tool journal of session {session!r}",
            f"SELECT call_id, name, arguments, at FROM {self._s}.tool_starts "
            "WHERE session = $1 ORDER BY at, call_id",
        )
        return [ToolStart(r[0], r[1], json.loads(r[2]), r[3]) for r in rows]

    def _info_sql(self) -> str:
        last = f"FROM {self._s}.messages m WHERE m.session = s.name ORDER BY m.seq DESC LIMIT 1"
        return (
            f"SELECT s.name, s.created, s.updated, s.status, (SELECT m.seq {last}), "
            f"(SELECT m.at {last}) FROM {self._s}.sessions s"
        )

    async def info(self, session: str) -> SessionInfo | None:
        rows = await self._session_rows(
            session, f"read session {session!r}", f"{self._info_sql()} WHERE s.name = $1"
        )
        return session_info(tuple(rows[0])) if rows else None

    async def sessions(self) -> list[SessionInfo]:
        rows = await self._read(
            "list the sessions", lambda conn: conn.fetch(f"{self._info_sql()} ORDER BY s.name")
        )
        return [session_info(tuple(row)) for row in rows]

    async def _runs(self, page: RunsPage) -> list[RunRecord]:
        sql, parameters = runs_query(f"{self._s}.runs", page, lambda n: f"${n}")
        before = page.before

        async def read(conn: asyncpg.Connection) -> list[RunRecord]:
            if before is not None and not await conn.fetchval(
                f"SELECT EXISTS (SELECT 1 FROM {self._s}.runs WHERE id = $1)", before
            ):
                raise unknown_run(before)
            return [run_record(tuple(row)) for row in await conn.fetch(sql, *parameters)]

        return await self._read("read the runs", read)

    async def run(self, run_id: str) -> RunRecord | None:
        check_run_id(run_id)
        rows = await self._read(
            f"read run {run_id!r}",
            lambda conn: conn.fetch(
                f"SELECT {', '.join(RUN_COLUMNS)} FROM {self._s}.runs WHERE id = $1", run_id
            ),
        )
        return run_record(tuple(rows[0])) if rows else None

    # -- writing -------------------------------------------------------------------

    async def open_session(self, session: str) -> _PostgresWriter:
        validate_session_name(session)
        await self._ready(f"open session {session!r}")
        if len(self._writers) + self._opening >= self.max_writers:
            raise StoreCapacityError(
                f"{self!r}: cannot open session {session!r}: all {self.max_writers} writer "
                "connections are in use (each open session holds one); close a session "
                "(agent.aclose()) or raise PostgresStore(max_writers=...)",
                ran_out=f"the {self.max_writers} writer connections (one per open session)",
            )
        settings = {"application_name": _application_name()}
        if not self.synchronous_commit:
            settings["synchronous_commit"] = "off"
        self._opening += 1
        try:
            conn = await self._connect(server_settings=settings)
            try:
                await self._lock(conn, session)
                writer = _PostgresWriter(self, session, conn)
                await writer._start()
            except BaseException:
                conn.terminate()
                raise
        finally:
            self._opening -= 1
        if self._closed:
            conn.terminate()
            raise StoreError(f"{self!r} is closed; cannot open session {session!r}")
        self._writers.add(writer)
        return writer

    async def _lock(self, conn: asyncpg.Connection, session: str) -> None:

        key = _lock_key(self.schema, session)
        try:
            taken = await conn.fetchval(
                "SELECT pg_try_advisory_lock(hashtextextended($1, 0))", key
            )
            if taken:
                return
            holder = await conn.fetchval(
                "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a "
                "ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted AND "
                "l.objsubid = 1 AND ((l.classid::bigint << 32) | l.objid::bigint) = "
                "hashtextextended($1, 0) LIMIT 1",
                key,
            )
        except _DRIVER as error:
            raise self._fail(error, f"lock session {session!r}") from error
        note_locked(session, _holder(holder))
        raise SessionLockedError(
            f"session {session!r} is already open for writing by {_holder(holder)} "
            f"(an advisory lock in {self._where}, schema {self.schema!r}); close that writer "
            "first. Reading the session with store.load() is always allowed."
        )

    async def delete(self, session: str) -> bool:
        validate_session_name(session)

        async def delete(conn: asyncpg.Connection) -> bool:
            async with conn.transaction():
                free = await conn.fetchval(
                    "SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))",
                    _lock_key(self.schema, session),
                )
                if not free:
                    note_locked(session, "another writer")
                    raise SessionLockedError(
                        f"session {session!r} is open for writing (an advisory lock in "
                        f"{self._where}); close that writer before deleting it"
                    )
                for table in ("messages", "tool_starts", "runs", "inputs"):
                    await conn.execute(
                        f"DELETE FROM {self._s}.{table} WHERE session = $1", session
                    )
                status = await conn.execute(
                    f"DELETE FROM {self._s}.sessions WHERE name = $1", session
                )
            return bool(status != "DELETE 0")

        return await self._read(f"delete session {session!r}", delete)

    async def aclose(self) -> None:
        """Close every writer (releasing its lock) and the pool; idempotent."""
        self._closed = True
        for writer in list(self._writers):
            await writer.aclose()
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    async def __aenter__(self) -> PostgresStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class _PostgresWriter(WriterInputs):
    """The writer of one session: its own connection, holding the advisory lock.

    Writes run one at a time in call order, each as a task the caller waits for even
    when cancelled (the write completes, then the cancel is raised). A lost connection
    kills the writer: every later write is a ``StoreError``, never a silent reconnect,
    since another host may have taken the session over.
    """

    def __init__(self, store: PostgresStore, session: str, conn: asyncpg.Connection) -> None:
        self.session = session
        self._store = store
        self._s = store._s
        self._conn: asyncpg.Connection | None = conn
        self._order = asyncio.Lock()
        self._next_seq = 0
        self._has_row = False
        self._broken: StoreError | None = None

    def __repr__(self) -> str:
        state = "open" if self._conn is not None else "closed"
        return f"<PostgresStore {self._store._where.url()} writer of {self.session!r}, {state}>"

    async def __aenter__(self) -> _PostgresWriter:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _start(self) -> None:
        conn = self._live("open the session")
        row = await conn.fetchrow(
            f"SELECT (SELECT max(seq) FROM {self._s}.messages WHERE session = $1), "
            f"EXISTS (SELECT 1 FROM {self._s}.sessions WHERE name = $1), "
            f"(SELECT status FROM {self._s}.sessions WHERE name = $1)",
            self.session,
        )
        assert row is not None
        self._next_seq = 0 if row[0] is None else row[0] + 1
        self._has_row = bool(row[1])
        note_unfinished(str(self._store._where), self.session, row[2])

    def _live(self, what: str) -> asyncpg.Connection:
        if self._broken is not None:
            raise self._broken
        if self._conn is None:
            raise StoreError(f"the writer of session {self.session!r} is closed; cannot {what}")
        return self._conn

    async def _write(
        self, what: str, operation: Callable[[asyncpg.Connection], Awaitable[None]]
    ) -> None:
        """Run ``operation`` after the writes before it; a cancel never interrupts it."""
        self._live(what)
        task = asyncio.ensure_future(self._in_order(what, operation))
        cancelled = False
        while True:
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if task.cancelled():
                    raise  # the write itself was cancelled (the loop is closing)
                cancelled = True  # ours: let the write finish, then raise the cancel
                if not task.done():
                    continue
            break
        if cancelled:
            if not task.cancelled():
                task.exception()  # retrieved: the cancel is what the caller gets
            raise asyncio.CancelledError
        task.result()

    async def _in_order(
        self, what: str, operation: Callable[[asyncpg.Connection], Awaitable[None]]
    ) -> None:
        async with self._order:
            conn = self._live(what)
            try:
                await operation(conn)
            except Exception as error:
                # A closed connection took the lock with it: this writer is over.
                lost = conn.is_closed() or isinstance(error, _LOST)
                failure = self._store._fail(error, f"{what} session {self.session!r}", lost=lost)
                if lost:
                    self._broken = failure
                raise failure from error

    async def _upsert_session(self, conn: asyncpg.Connection, now: float) -> None:
        await conn.execute(
            f"INSERT INTO {self._s}.sessions (name, created, updated) VALUES ($1, $2, $2) "
            "ON CONFLICT (name) DO UPDATE SET updated = excluded.updated",
            self.session,
            now,
        )

    async def _statement(self, sql: str, *args: object, what: str) -> None:
        """One statement as its own transaction; the session row comes with the first."""

        async def run(conn: asyncpg.Connection) -> None:
            if self._has_row:
                await conn.execute(sql, *args)
                return
            async with conn.transaction():
                await self._upsert_session(conn, time.time())
                await conn.execute(sql, *args)
            self._has_row = True

        await self._write(what, run)

    async def load(self) -> list[Message]:
        self._live("load")
        return await self._store.load(self.session)

    async def append(self, message: Message) -> None:
        self._live("append")
        seq = self._next_seq
        body = encode(message, self.session, seq)
        self._next_seq = seq + 1  # before any await: concurrent appends keep call order
        try:
            await self._statement(
                f"INSERT INTO {self._s}.messages (session, seq, at, body) VALUES ($1, $2, $3, $4)",
                self.session, seq, time.time(), body, what="append to",
            )
        except StoreError:
            if self._next_seq == seq + 1:
                self._next_seq = seq  # nothing was written
            raise

    async def replace(self, messages: Sequence[Message]) -> None:
        self._live("replace")
        bodies = [encode(m, self.session, i) for i, m in enumerate(messages)]
        now = time.time()

        async def run(conn: asyncpg.Connection) -> None:
            async with conn.transaction():
                await self._upsert_session(conn, now)
                await conn.execute(
                    f"DELETE FROM {self._s}.messages WHERE session = $1", self.session
                )
                await conn.copy_records_to_table(
                    "messages",
                    schema_name=self._store.schema,
                    columns=("session", "seq", "at", "body"),
                    records=[(self.session, seq, now, body) for seq, body in enumerate(bodies)],
                )
            self._has_row = True
            self._next_seq = len(bodies)

        await self._write("replace", run)

    async def set_status(self, status: SessionStatus) -> None:
        self._live("set the status")
        await self._set_field("status", check_status(status), "set the status of")

    async def record_tool_start(self, call_id: str, name: str, arguments: Any) -> None:
        self._live("record a tool start")
        text = encode_value(arguments, f"the arguments of tool call {call_id!r}", self.session)
        await self._statement(
            f"INSERT INTO {self._s}.tool_starts (session, call_id, name, arguments, at) "
            "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (session, call_id) DO UPDATE SET "
            "name = excluded.name, arguments = excluded.arguments, at = excluded.at",
            self.session, call_id, name, text, time.time(), what="record a tool start in",
        )

    async def save_state(self, state: Mapping[str, Any]) -> None:
        self._live("save the state")
        await self._set_field("state", encode_state(state, self.session), "save the state of")

    async def record_run(self, record: RunRecord) -> None:
        self._live("record a run")
        row = run_row(check_run_of(record, self.session))
        columns = ", ".join(RUN_COLUMNS)
        marks = ", ".join(f"${n}" for n in range(1, len(RUN_COLUMNS) + 1))
        updates = ", ".join(f"{c} = excluded.{c}" for c in RUN_COLUMNS[1:])
        await self._statement(
            f"INSERT INTO {self._s}.runs ({columns}) VALUES ({marks}) "
            f"ON CONFLICT (id) DO UPDATE SET {updates}",
            *row, what=f"record run {record.id!r} of",
        )

    async def _set_field(self, column: str, value: str, what: str) -> None:
        """Set one column of the session's row (creating the row if needed)."""
        now = time.time()

        async def run(conn: asyncpg.Connection) -> None:
            await conn.execute(
                f"INSERT INTO {self._s}.sessions (name, created, updated, {column}) "
                f"VALUES ($1, $2, $2, $3) "
                f"ON CONFLICT (name) DO UPDATE SET updated = $2, {column} = $3",
                self.session, now, value,
            )
            self._has_row = True

        await self._write(what, run)

    async def aclose(self) -> None:
        """Release the lock (by closing the connection); idempotent."""
        conn, self._conn = self._conn, None
        self._store._writers.discard(self)
        if conn is None:
            return
        async with self._order:  # let writes in flight finish first
            pass
        try:
            await asyncio.wait_for(conn.close(), timeout=5)
        except Exception:
            conn.terminate()  # a broken connection: the server drops the lock with it
        except BaseException:
            conn.terminate()
            raise

