"""Sessions in one SQLite file (stdlib ``sqlite3``, WAL mode), one row per message."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, cast

from aimu.aio.errors import StoreError, StoreFormatError, TranscriptError
from aimu.aio.store._base import StoreBase, WriterBase
from aimu.aio.store._codec import (
    decode_state,
    encode,
    encode_state,
    encode_value,
    first_bad,
    parse_array,
)
from aimu.aio.store._files import make_private_dirs, open_private
from aimu.aio.store._lock import SessionLock
from aimu.aio.store._pages import RunPages, RunsPage, runs_query, unknown_run
from aimu.aio.store._protocol import (
    RUN_COLUMNS,
    PendingInput,
    RunRecord,
    SessionInfo,
    SessionStatus,
    ToolStart,
    check_run_id,
    check_run_of,
    check_status,
    input_message,
    run_record,
    run_row,
    session_info,
    validate_session_name,
)
from aimu.aio.store._report import note_unfinished, warn_torn
from aimu.aio.transcript import Message, UserMessage, validate

__all__ = ["SQLiteStore"]

_SCHEMA_VERSION: Final = 5
# Version 3 added the runs table: an older file gets it on open (CREATE IF NOT EXISTS);
# version 4 the runs' messages_from (added to a version 3 table on open); version 5 the
# pending inputs (CREATE IF NOT EXISTS).
# Message count and last-message time are derived from the messages table (seq runs
# 0..n-1), so an append is one INSERT: one short autocommit transaction.
_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS sessions (
    name TEXT PRIMARY KEY,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    status TEXT
);
CREATE TABLE IF NOT EXISTS messages (
    session TEXT NOT NULL,
    seq INTEGER NOT NULL,
    at REAL NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (session, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tool_starts (
    session TEXT NOT NULL,
    call_id TEXT NOT NULL,
    name TEXT NOT NULL,
    arguments TEXT NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY (session, call_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS states (
    session TEXT PRIMARY KEY,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    session TEXT NOT NULL,
    agent TEXT NOT NULL,
    parent TEXT,
    started REAL NOT NULL,
    ended REAL,
    status TEXT NOT NULL,
    reason TEXT,
    stop_reason TEXT,
    usage TEXT,
    spend TEXT,
    run_limit TEXT,
    models TEXT NOT NULL,
    recover INTEGER NOT NULL,
    messages_from INTEGER
);
CREATE TABLE IF NOT EXISTS inputs (
    session TEXT NOT NULL,
    id TEXT NOT NULL,
    at REAL NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (session, id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS runs_by_start ON runs (started, id);
CREATE INDEX IF NOT EXISTS runs_by_session ON runs (session, started, id);
CREATE INDEX IF NOT EXISTS runs_by_status ON runs (status, started, id);
"""
_LAST = "SELECT {} FROM messages WHERE session = {} ORDER BY seq DESC LIMIT 1"
_INFO = (
    "SELECT s.name, s.created, s.updated, s.status, "
    f"({_LAST.format('seq', 's.name')}), ({_LAST.format('at', 's.name')}) FROM sessions s"
)
_UPSERT_SESSION = (
    "INSERT INTO sessions (name, created, updated, status) VALUES (?1, ?2, ?2, NULL) "
    "ON CONFLICT (name) DO UPDATE SET updated = ?2"
)
_INSERT = "INSERT INTO messages (session, seq, at, body) VALUES (?, ?, ?, ?)"
_INSERT_START = (
    "INSERT INTO tool_starts (session, call_id, name, arguments, at) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (session, call_id) DO UPDATE SET name = excluded.name, "
    "arguments = excluded.arguments, at = excluded.at"
)
_SAVE_RUN = (
    f"INSERT OR REPLACE INTO runs ({', '.join(RUN_COLUMNS)}) "
    f"VALUES ({', '.join('?' * len(RUN_COLUMNS))})"
)
_SAVE_STATE = (
    "INSERT INTO states (session, body) VALUES (?, ?) "
    "ON CONFLICT (session) DO UPDATE SET body = excluded.body"
)
#: Commits between two checkpoints (each one writes a few 4 KiB pages to the WAL).
_CHECKPOINT_EVERY: Final = 256
#: Exclusive mode: how long without a commit counts as idle, for a checkpoint.
_IDLE_SECONDS: Final = 0.2


@contextlib.contextmanager
def _committed(conn: sqlite3.Connection) -> Iterator[None]:
    """The transaction the block began, committed when it ends, rolled back if it raised."""
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.rollback()
        raise


class _Checkpointer:
    """Copies the WAL into the database on a background thread, with its own connection.

    SQLite's automatic checkpoint runs inside a commit and fsyncs: milliseconds on the
    event loop every few hundred appends. A passive checkpoint here never blocks writers.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._wanted = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def request(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"aimu-checkpoint {self._path}", daemon=True
            )
            self._thread.start()
        self._wanted.set()

    def _run(self) -> None:
        conn = sqlite3.connect(self._path, isolation_level=None, timeout=10.0)
        try:
            while True:
                self._wanted.wait()
                self._wanted.clear()
                if self._stopping:
                    return
                # A checkpoint that fails (busy, I/O) only postpones shrinking the WAL.
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        finally:
            conn.close()

    def stop(self) -> None:
        self._stopping = True
        self._wanted.set()
        if self._thread is not None:
            self._thread.join()


class SQLiteStore(StoreBase["_SQLiteWriter"], RunPages):
    """Sessions in one SQLite file (stdlib ``sqlite3``), one row per message.

    WAL mode with ``synchronous=NORMAL``: a committed message survives the process
    being killed (``kill -9``), but not necessarily a power loss or OS crash, which may
    lose the last commits (never corrupt the file). An ``append`` is one short INSERT
    (tens of microseconds) and checkpoints run on a background thread, so writing from
    the event loop is cheap: the methods are coroutines but run their SQLite calls
    inline (a thread hop would cost more than the statement). The file (and its
    directory) is created if missing; write locks live in ``<path>-locks/``.

    ``exclusive=True`` (opt-in) keeps SQLite's file lock for as long as the store is
    open (``locking_mode=EXCLUSIVE``): no lock calls per commit, but no other process
    can read or write the file meanwhile, and checkpoints wait until the loop is idle.
    """

    def __init__(self, path: str | os.PathLike[str], *, exclusive: bool = False) -> None:
        self.path = Path(path)
        self.exclusive = exclusive
        self._idle_checkpoint: asyncio.TimerHandle | None = None
        self._lock_dir = self.path.with_name(self.path.name + "-locks")
        self._mutex = threading.RLock()
        self._writers: set[_SQLiteWriter] = set()
        self._conn: sqlite3.Connection | None = None
        self._commits = 0
        try:
            make_private_dirs(self.path.parent)
            # sqlite3 would create the file 0o644; its -wal and -shm files copy this mode.
            os.close(open_private(self.path, os.O_RDWR))
            conn = sqlite3.connect(
                self.path, check_same_thread=False, isolation_level=None, timeout=10.0
            )
        except (OSError, sqlite3.Error) as error:
            raise StoreError(f"cannot open SQLite store {self.path}: {error}") from error
        try:
            self._setup(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._checkpointer = _Checkpointer(self.path)

    def _setup(self, conn: sqlite3.Connection) -> None:
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > _SCHEMA_VERSION:
                raise StoreFormatError(
                    f"{self.path} has store schema version {version}, newer than the "
                    f"{_SCHEMA_VERSION} this aimu reads; upgrade aimu to open it"
                )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA wal_autocheckpoint=0")  # see _Checkpointer
            if self.exclusive:
                conn.execute("PRAGMA locking_mode=EXCLUSIVE")
            if version < _SCHEMA_VERSION:
                # Several processes may create the schema at once: IF NOT EXISTS, one step.
                with _committed(conn):
                    conn.executescript(f"BEGIN IMMEDIATE;{_SCHEMA}")
                    columns = {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
                    if "messages_from" not in columns:  # a version 3 file
                        conn.execute("ALTER TABLE runs ADD COLUMN messages_from INTEGER")
                    conn.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
        except sqlite3.DatabaseError as error:
            if isinstance(error, sqlite3.OperationalError):
                raise StoreError(f"cannot open SQLite store {self.path}: {error}") from error
            raise StoreFormatError(
                f"{self.path} is not a readable aimu SQLite store: {error}"
            ) from error

    def __repr__(self) -> str:
        return f"<SQLiteStore {str(self.path)!r}{' exclusive' if self.exclusive else ''}>"

    def _fail(self, error: sqlite3.Error, what: str) -> StoreError:
        kind = (
            StoreFormatError
            if isinstance(error, sqlite3.DatabaseError)
            and not isinstance(error, sqlite3.OperationalError)
            else StoreError
        )
        return kind(f"{self.path}: cannot {what}: {error}")

    def _connection(self, what: str) -> sqlite3.Connection:
        conn = self._conn
        if conn is None:
            raise StoreError(f"{self!r} is closed; cannot {what}")
        return conn

    def _committed(self) -> None:
        self._commits += 1
        if self._commits % _CHECKPOINT_EVERY == 0:
            if self.exclusive:
                self._checkpoint_when_idle()
            else:
                self._checkpointer.request()

    def _checkpoint_when_idle(self) -> None:
        """Exclusive mode: no other connection may checkpoint, so this one does, on the
        loop, once no commit came for a moment (never in the middle of a run's writes)."""
        if self._idle_checkpoint is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop to wait on: close() checkpoints
        seen = self._commits

        def check() -> None:
            nonlocal seen
            if self._commits != seen:  # still busy: look again later
                seen = self._commits
                self._idle_checkpoint = loop.call_later(_IDLE_SECONDS, check)
                return
            self._idle_checkpoint = None
            with self._mutex:
                if self._conn is not None:
                    with contextlib.suppress(sqlite3.Error):
                        self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

        self._idle_checkpoint = loop.call_later(_IDLE_SECONDS, check)

    def _write(self, sql: str, parameters: Sequence[object], what: Callable[[], str]) -> None:
        """One statement as its own transaction (the append path: keep it lean)."""
        with self._mutex:
            conn = self._conn
            if conn is None:
                raise StoreError(f"{self!r} is closed; cannot {what()}")
            try:
                conn.execute(sql, parameters)
            except sqlite3.Error as error:
                raise self._fail(error, what()) from error
            self._committed()

    @contextlib.contextmanager
    def _transaction(self, what: str) -> Iterator[sqlite3.Connection]:
        """Several statements as one immediate transaction, all or nothing."""
        with self._mutex:
            conn = self._connection(what)
            try:
                conn.execute("BEGIN IMMEDIATE")
                with _committed(conn):
                    yield conn
            except sqlite3.Error as error:
                raise self._fail(error, what) from error
            self._committed()

    def _query(self, sql: str, parameters: Sequence[object], what: str) -> list[Any]:
        with self._mutex:
            conn = self._connection(what)
            try:
                return conn.execute(sql, parameters).fetchall()
            except sqlite3.Error as error:
                raise self._fail(error, what) from error

    async def open_session(self, session: str) -> _SQLiteWriter:
        validate_session_name(session)
        with self._mutex:
            self._connection(f"open session {session!r}")
            make_private_dirs(self._lock_dir)
            return self._add_writer(
                SessionLock(self._lock_dir, session),
                lambda lock: _SQLiteWriter(self, session, lock),
            )

    def _decode(self, session: str, rows: list[tuple[int, str]]) -> list[Message]:
        """The messages of ``rows``; a corrupt last row is left out with a warning."""
        bodies = [body for _, body in rows]
        parsed = parse_array(bodies)
        if parsed is None:
            bad = first_bad(bodies)
            position, why = bad if bad is not None else (len(rows) - 1, "not one JSON value")
            where = f"{self.path}: session {session!r} row seq={rows[position][0]}"
            if position != len(rows) - 1:
                raise StoreFormatError(f"{where} is corrupt ({why}); the session cannot be read")
            warn_torn(where, why)
            parsed = [json.loads(body) for body in bodies[:-1]]
        try:
            validate(parsed)
        except TranscriptError as error:
            index = error.index
            where = (
                f"row seq={rows[index][0]}" if index is not None and index < len(rows) else "rows"
            )
            raise StoreFormatError(
                f"{self.path}: session {session!r} {where} is not a valid message: {error}"
            ) from error
        return cast(list[Message], parsed)

    async def load(self, session: str) -> list[Message]:
        return self._load(session)

    def _load(self, session: str) -> list[Message]:
        validate_session_name(session)
        rows = self._query(
            "SELECT seq, body FROM messages WHERE session = ? ORDER BY seq",
            (session,),
            f"load session {session!r}",
        )
        return self._decode(session, rows)

    async def load_state(self, session: str) -> dict[str, Any]:
        validate_session_name(session)
        rows = self._query(
            "SELECT body FROM states WHERE session = ?", (session,), f"read session {session!r}"
        )
        return decode_state(rows[0][0], f"{self.path}: session {session!r}") if rows else {}

    async def tool_starts(self, session: str) -> list[ToolStart]:
        validate_session_name(session)
        rows = self._query(
            "SELECT call_id, name, arguments, at FROM tool_starts WHERE session = ? ORDER BY at",
            (session,),
            f"read the tool journal of session {session!r}",
        )
        return [ToolStart(call_id, name, json.loads(arguments), at)
                for call_id, name, arguments, at in rows]

    async def info(self, session: str) -> SessionInfo | None:
        validate_session_name(session)
        rows = self._query(f"{_INFO} WHERE s.name = ?", (session,), f"read session {session!r}")
        return session_info(rows[0]) if rows else None

    async def sessions(self) -> list[SessionInfo]:
        return [session_info(row) for row in self._query(f"{_INFO} ORDER BY s.name", (), "list")]

    async def _runs(self, page: RunsPage) -> list[RunRecord]:
        with self._mutex:
            if page.before is not None and not self._query(
                "SELECT 1 FROM runs WHERE id = ?", (page.before,), "read the runs"
            ):
                raise unknown_run(page.before)
            sql, parameters = runs_query("runs", page, lambda _: "?")
            return [run_record(row) for row in self._query(sql, parameters, "read the runs")]

    async def run(self, run_id: str) -> RunRecord | None:
        check_run_id(run_id)
        rows = self._query(
            f"SELECT {', '.join(RUN_COLUMNS)} FROM runs WHERE id = ?", (run_id,),
            f"read run {run_id!r}",
        )
        return run_record(rows[0]) if rows else None

    async def add_input(self, session: str, message: UserMessage) -> None:
        validate_session_name(session)
        input_id = str(message.get("aimu_sent"))
        body = encode(input_message(input_id, message), session, 0)
        self._write(
            "INSERT OR IGNORE INTO inputs (session, id, at, body) VALUES (?, ?, ?, ?)",
            (session, input_id, time.time(), body),
            lambda: f"keep an input of session {session!r}",
        )

    async def inputs(self, session: str) -> list[PendingInput]:
        validate_session_name(session)
        rows = self._query(
            "SELECT id, at, body FROM inputs WHERE session = ? ORDER BY at, id", (session,),
            f"read the inputs of session {session!r}",
        )
        return [PendingInput(input_id, json.loads(body), at) for input_id, at, body in rows]

    async def drop_input(self, session: str, input_id: str) -> bool:
        validate_session_name(session)
        with self._transaction(f"take back an input of session {session!r}") as conn:
            dropped = conn.execute(
                "DELETE FROM inputs WHERE session = ? AND id = ?", (session, input_id)
            ).rowcount
        return dropped > 0

    async def delete(self, session: str) -> bool:
        validate_session_name(session)
        with self._mutex:
            self._connection(f"delete session {session!r}")
            make_private_dirs(self._lock_dir)
            lock = SessionLock(self._lock_dir, session)
            try:
                with self._transaction(f"delete session {session!r}") as conn:
                    for table in ("messages", "tool_starts", "states", "runs", "inputs"):
                        conn.execute(f"DELETE FROM {table} WHERE session = ?", (session,))
                    existed = conn.execute(
                        "DELETE FROM sessions WHERE name = ?", (session,)
                    ).rowcount
            finally:
                lock.release(unlink=True)
            return existed > 0

    def close(self) -> None:
        with self._mutex:
            for writer in list(self._writers):
                writer.release()
            conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._idle_checkpoint is not None:
            self._idle_checkpoint.cancel()
        self._checkpointer.stop()
        conn.close()  # the last connection to close checkpoints and removes the WAL


class _SQLiteWriter(WriterBase):
    """The writer of one session of a :class:`SQLiteStore`."""

    def __init__(self, store: SQLiteStore, session: str, lock: SessionLock) -> None:
        super().__init__(session, lock, f"SQLiteStore {str(store.path)!r}")
        self._store = store
        # Only the last row can be torn; rows before it are checked on load. Read with no
        # transaction of their own (no other writer of the session runs: this one holds
        # its lock); a torn row is deleted in one.
        what = f"open session {session!r}"
        found = store._query(_LAST.format("seq, body", "?"), (session,), what)
        row = next(iter(store._query("SELECT status FROM sessions WHERE name = ?", (session,),
                                     what)), None)
        self._has_row = row is not None
        last = found[0] if found else None
        if last is not None:
            try:
                json.loads(last[1])
            except ValueError as error:
                where = f"{store.path}: session {session!r} row seq={last[0]}"
                warn_torn(where, str(error), repaired=True)
                with store._transaction(what) as conn:
                    conn.execute(
                        "DELETE FROM messages WHERE session = ? AND seq = ?", (session, last[0])
                    )
                last = (last[0] - 1, None)
        self._next_seq = 0 if last is None else last[0] + 1
        note_unfinished(str(store.path), session, None if row is None else row[0])

    async def load(self) -> list[Message]:
        self._check_open("load")
        return self._store._load(self.session)

    async def append(self, message: Message) -> None:
        if not self._lock.held:
            self._check_open("append")
        seq = self._next_seq
        body = encode(message, self.session, seq)
        now = time.time()
        self._write(_INSERT, (self.session, seq, now, body), "append to", now)
        self._next_seq = seq + 1

    def _write(self, sql: str, parameters: Sequence[object], what: str, now: float) -> None:
        """One statement; the session's row is created along with its first write."""
        if self._has_row:
            self._store._write(sql, parameters, lambda: f"{what} session {self.session!r}")
            return
        with self._store._transaction(f"{what} session {self.session!r}") as conn:
            conn.execute(_UPSERT_SESSION, (self.session, now))
            conn.execute(sql, parameters)
        self._has_row = True

    async def replace(self, messages: Sequence[Message]) -> None:
        self._check_open("replace")
        bodies = [encode(m, self.session, i) for i, m in enumerate(messages)]
        now = time.time()
        with self._store._transaction(f"replace session {self.session!r}") as conn:
            conn.execute(_UPSERT_SESSION, (self.session, now))
            conn.execute("DELETE FROM messages WHERE session = ?", (self.session,))
            conn.executemany(
                _INSERT, ((self.session, seq, now, body) for seq, body in enumerate(bodies))
            )
        self._has_row = True
        self._next_seq = len(bodies)

    async def set_status(self, status: SessionStatus) -> None:
        self._check_open("set the status")
        check_status(status)
        self._store._write(
            "INSERT INTO sessions (name, created, updated, status) VALUES (?1, ?2, ?2, ?3) "
            "ON CONFLICT (name) DO UPDATE SET updated = ?2, status = ?3",
            (self.session, time.time(), status),
            lambda: f"set the status of session {self.session!r}",
        )
        self._has_row = True

    async def record_tool_start(self, call_id: str, name: str, arguments: Any) -> None:
        self._check_open("record a tool start")
        text = encode_value(arguments, f"the arguments of tool call {call_id!r}", self.session)
        now = time.time()
        self._write(_INSERT_START, (self.session, call_id, name, text, now),
                    "record a tool start in", now)

    async def save_state(self, state: Mapping[str, Any]) -> None:
        self._check_open("save the state")
        text = encode_state(state, self.session)
        self._write(_SAVE_STATE, (self.session, text), "save the state of", time.time())

    async def record_run(self, record: RunRecord) -> None:
        self._check_open("record a run")
        row = run_row(check_run_of(record, self.session))
        self._write(_SAVE_RUN, row, f"record run {record.id!r} of", time.time())

    async def join_input(self, message: UserMessage) -> bool:
        self._check_open("join an input")
        input_id = str(message.get("aimu_sent"))
        seq = self._next_seq
        body = encode(input_message(input_id, message), self.session, seq)
        now = time.time()
        with self._store._transaction(f"join an input to session {self.session!r}") as conn:
            taken = conn.execute(
                "DELETE FROM inputs WHERE session = ? AND id = ?", (self.session, input_id)
            ).rowcount
            if taken:
                conn.execute(_UPSERT_SESSION, (self.session, now))
                conn.execute(_INSERT, (self.session, seq, now, body))
        if taken:
            self._has_row = True
            self._next_seq = seq + 1
        return taken > 0

    def release(self) -> None:
        with self._store._mutex:
            self._lock.release()
            self._store._writers.discard(self)


