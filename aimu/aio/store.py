"""Durable sessions: every message on disk the moment it is recorded.

A :class:`Store` holds named sessions, each a transcript plus metadata. Writing goes
through a :class:`SessionWriter` from :meth:`Store.open_session`, which holds the
session's write lock (an ``fcntl.flock``, released by the OS even on ``kill -9``), so
two writers never interleave; reading with :meth:`Store.load` is always allowed.
When ``append`` returns, the message survives the process being killed.

Two stores: :class:`SQLiteStore` (the default; one file, stdlib ``sqlite3`` in WAL
mode) and :class:`JSONLStore` (a directory, one append-only ``<session>.jsonl`` per
session). A torn last record (the process died mid-write) is ignored on load with a
``RuntimeWarning`` and repaired by the next writer; corruption before it is a
:class:`~aimu.aio.errors.StoreFormatError` naming the file and line.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import fcntl
import json
import os
import re
import sqlite3
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import (
    Any,
    Final,
    Generic,
    Literal,
    Protocol,
    Self,
    TypeAlias,
    TypeVar,
    cast,
    get_args,
    runtime_checkable,
)

from aimu.aio.errors import SessionLockedError, StoreError, StoreFormatError, TranscriptError
from aimu.aio.transcript import Message, validate

__all__ = [
    "JSONLStore",
    "SQLiteStore",
    "SessionInfo",
    "SessionStatus",
    "SessionWriter",
    "Store",
    "validate_session_name",
]

SessionStatus: TypeAlias = Literal[
    "in_progress", "completed", "interrupted", "cancelled", "failed", "max_rounds"
]
_STATUSES: Final = frozenset(get_args(SessionStatus))

_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def validate_session_name(name: str) -> str:
    """Return ``name`` if it is a valid session name, else raise ``ValueError`` naming it.

    Valid: 1-128 characters from ``[A-Za-z0-9._-]``, and not ``.`` or ``..``; so a name
    can never reach outside a store's directory.
    """
    if not isinstance(name, str):
        raise TypeError(f"a session name is a str, got {type(name).__name__}")
    if _NAME.fullmatch(name) is None or name in (".", ".."):
        raise ValueError(
            f"invalid session name {name!r:.150}: use 1-128 characters from A-Z a-z 0-9 . _ - "
            "(not '.' or '..')"
        )
    return name


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """What a store knows about one session; times are ``time.time()`` seconds."""

    name: str
    created: float
    updated: float
    message_count: int
    status: SessionStatus | None
    """The last status a writer set, or None if none was set."""


@runtime_checkable
class SessionWriter(Protocol):
    """The write side of one session; holds its lock until :meth:`close`."""

    session: str

    def load(self) -> list[Message]:
        """The session's transcript as stored now."""
        ...

    def append(self, message: Message) -> None:
        """Add one message; once this returns it survives the process being killed."""
        ...

    def replace(self, messages: Sequence[Message]) -> None:
        """Atomically rewrite the whole transcript (all or nothing)."""
        ...

    def set_status(self, status: SessionStatus) -> None:
        """Record the session's status, as durably as :meth:`append`."""
        ...

    def close(self) -> None:
        """Release the write lock; idempotent."""
        ...


@runtime_checkable
class Store(Protocol):
    """Named, durable sessions."""

    def open_session(self, session: str) -> SessionWriter:
        """Take the session's write lock; ``SessionLockedError`` if a writer holds it."""
        ...

    def load(self, session: str) -> list[Message]:
        """The stored transcript (``[]`` if unknown); allowed even while a writer holds it."""
        ...

    def sessions(self) -> list[SessionInfo]:
        """Every stored session, by name."""
        ...

    def info(self, session: str) -> SessionInfo | None:
        """The session's metadata, or None if it was never written."""
        ...

    def delete(self, session: str) -> bool:
        """Remove the session; False if it did not exist; ``SessionLockedError`` if open."""
        ...

    def close(self) -> None:
        """Close every writer still open and release the store's resources; idempotent."""
        ...


# --------------------------------------------------------------------------- helpers


def _check_status(status: str) -> SessionStatus:
    if status not in _STATUSES:
        raise ValueError(
            f"unknown session status {status!r}; expected one of {', '.join(sorted(_STATUSES))}"
        )
    return cast(SessionStatus, status)


# The compact form of transcript.dumps, built once; NaN is refused, as validate() would
# refuse it on load (a stored NaN would make the session unreadable).
_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _encode(message: Message, session: str, index: int) -> str:
    try:
        return _ENCODER.encode(message)
    except (TypeError, ValueError) as error:
        raise TranscriptError(
            f"session {session!r}: message {index} cannot be stored as JSON: {error}", index=index
        ) from error


def _parse_array(items: Sequence[str | bytes]) -> list[Any] | None:
    """Parse many JSON texts in one C call; None if any of them is bad."""
    if not items:
        return []
    if isinstance(items[0], bytes):
        text: str | bytes = b"[" + b",".join(cast(Sequence[bytes], items)) + b"]"
    else:
        text = "[" + ",".join(cast(Sequence[str], items)) + "]"
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    # A corrupt record can still join into valid JSON (e.g. '1,2'): check the count.
    if not isinstance(parsed, list) or len(parsed) != len(items):
        return None
    return parsed


def _first_bad(items: Sequence[str | bytes]) -> tuple[int, str] | None:
    """The first record that is not one JSON value, and why."""
    for position, item in enumerate(items):
        try:
            json.loads(item)
        except ValueError as error:
            return position, str(error)
    return None


def _warn_torn(where: str, what: str) -> None:
    warnings.warn(
        f"{where}: ignoring a torn last record ({what}); it was cut short when the writing "
        "process died, and the next writer of this session removes it",
        RuntimeWarning,
        stacklevel=4,
    )


class _SessionLock:
    """An exclusive ``flock`` on ``<directory>/<session>.lock``.

    ``flock`` locks belong to an open file, so a second lock in the same process
    conflicts too, and the OS drops the lock when the holder dies (even ``kill -9``).
    The holder's pid is written into the file, only to name it in the error.
    """

    __slots__ = ("_fd", "path", "session")

    def __init__(self, directory: Path, session: str) -> None:
        self.session = session
        self.path = directory / f"{session}.lock"
        self._fd: int | None = None
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                holder = _read_holder(fd)
                os.close(fd)
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise StoreError(
                        f"session {session!r}: cannot lock {self.path}: {error}"
                    ) from error
                raise SessionLockedError(
                    f"session {session!r} is already open for writing by {holder} "
                    f"(lock file {self.path}); close that writer first. Reading the session "
                    "with store.load() is always allowed."
                ) from None
            # delete() unlinks lock files while holding them: make sure we locked the
            # file that is at the path now, not one that was just removed.
            try:
                current = os.stat(self.path)
            except FileNotFoundError:
                os.close(fd)
                continue
            mine = os.fstat(fd)
            if (mine.st_dev, mine.st_ino) != (current.st_dev, current.st_ino):
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._fd = fd
            return

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, *, unlink: bool = False) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if unlink:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
            else:
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the file releases the flock


def _read_holder(fd: int) -> str:
    try:
        pid = int(os.pread(fd, 32, 0).decode().strip() or "0")
    except (OSError, ValueError):
        pid = 0
    if pid == os.getpid():
        return "another writer in this process"
    return f"process {pid}" if pid else "another process"


class _WriterBase(abc.ABC):
    """What both stores' writers share: the session, its lock, and the closed check."""

    def __init__(self, session: str, lock: _SessionLock, where: str) -> None:
        self.session = session
        self._lock = lock
        self._label = f"{where} writer of {session!r}"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{self._label}, {'open' if self._lock.held else 'closed'}>"

    @abc.abstractmethod
    def close(self) -> None:
        ...

    def _check_open(self, what: str) -> None:
        if not self._lock.held:
            raise StoreError(f"the writer of session {self.session!r} is closed; cannot {what}")


_W = TypeVar("_W", bound=_WriterBase)


class _StoreBase(abc.ABC, Generic[_W]):
    """What both stores share: use as a context manager; writers open under a session lock."""

    _mutex: threading.RLock
    _writers: set[_W]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @abc.abstractmethod
    def close(self) -> None:
        ...

    def _add_writer(self, lock: _SessionLock, make: Callable[[_SessionLock], _W]) -> _W:
        """Build a writer holding ``lock`` (released if building fails); call under the mutex."""
        try:
            writer = make(lock)
        except BaseException:
            lock.release()
            raise
        self._writers.add(writer)
        return writer


# --------------------------------------------------------------------------- SQLite

_SCHEMA_VERSION: Final = 1
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
#: Commits between two checkpoints (each one writes a few 4 KiB pages to the WAL).
_CHECKPOINT_EVERY: Final = 256


def _info_row(row: tuple[Any, ...]) -> SessionInfo:
    name, created, updated, status, last_seq, last_at = row
    count = 0 if last_seq is None else last_seq + 1
    if last_at is not None:
        updated = max(updated, last_at)
    return SessionInfo(name, created, updated, count, status)


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


class SQLiteStore(_StoreBase["_SQLiteWriter"]):
    """Sessions in one SQLite file (stdlib ``sqlite3``), one row per message.

    WAL mode with ``synchronous=NORMAL``: a committed message survives the process
    being killed (``kill -9``), but not necessarily a power loss or OS crash, which may
    lose the last commits (never corrupt the file). An ``append`` is one short INSERT
    (tens of microseconds) and checkpoints run on a background thread, so writing from
    the event loop is cheap. The file (and its directory) is created if missing; write
    locks live in ``<path>-locks/``. Thread-safe.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock_dir = self.path.with_name(self.path.name + "-locks")
        self._mutex = threading.RLock()
        self._writers: set[_SQLiteWriter] = set()
        self._conn: sqlite3.Connection | None = None
        self._commits = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
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
            if version < _SCHEMA_VERSION:
                # Several processes may create the schema at once: IF NOT EXISTS, one step.
                try:
                    conn.executescript(
                        f"BEGIN IMMEDIATE;{_SCHEMA}PRAGMA user_version={_SCHEMA_VERSION};COMMIT;"
                    )
                except BaseException:
                    if conn.in_transaction:
                        conn.rollback()
                    raise
        except sqlite3.DatabaseError as error:
            if isinstance(error, sqlite3.OperationalError):
                raise StoreError(f"cannot open SQLite store {self.path}: {error}") from error
            raise StoreFormatError(
                f"{self.path} is not a readable aimu SQLite store: {error}"
            ) from error

    def __repr__(self) -> str:
        return f"<SQLiteStore {str(self.path)!r}>"

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
            self._checkpointer.request()

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
                try:
                    yield conn
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.rollback()
                    raise
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

    def open_session(self, session: str) -> _SQLiteWriter:
        validate_session_name(session)
        with self._mutex:
            self._connection(f"open session {session!r}")
            self._lock_dir.mkdir(parents=True, exist_ok=True)
            return self._add_writer(
                _SessionLock(self._lock_dir, session),
                lambda lock: _SQLiteWriter(self, session, lock),
            )

    def _decode(self, session: str, rows: list[tuple[int, str]]) -> list[Message]:
        """The messages of ``rows``; a corrupt last row is left out with a warning."""
        bodies = [body for _, body in rows]
        parsed = _parse_array(bodies)
        if parsed is None:
            bad = _first_bad(bodies)
            position, why = bad if bad is not None else (len(rows) - 1, "not one JSON value")
            where = f"{self.path}: session {session!r} row seq={rows[position][0]}"
            if position != len(rows) - 1:
                raise StoreFormatError(f"{where} is corrupt ({why}); the session cannot be read")
            _warn_torn(where, why)
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

    def load(self, session: str) -> list[Message]:
        validate_session_name(session)
        rows = self._query(
            "SELECT seq, body FROM messages WHERE session = ? ORDER BY seq",
            (session,),
            f"load session {session!r}",
        )
        return self._decode(session, rows)

    def info(self, session: str) -> SessionInfo | None:
        validate_session_name(session)
        rows = self._query(f"{_INFO} WHERE s.name = ?", (session,), f"read session {session!r}")
        return _info_row(rows[0]) if rows else None

    def sessions(self) -> list[SessionInfo]:
        return [_info_row(row) for row in self._query(f"{_INFO} ORDER BY s.name", (), "list")]

    def delete(self, session: str) -> bool:
        validate_session_name(session)
        with self._mutex:
            self._connection(f"delete session {session!r}")
            self._lock_dir.mkdir(parents=True, exist_ok=True)
            lock = _SessionLock(self._lock_dir, session)
            try:
                with self._transaction(f"delete session {session!r}") as conn:
                    conn.execute("DELETE FROM messages WHERE session = ?", (session,))
                    existed = conn.execute(
                        "DELETE FROM sessions WHERE name = ?", (session,)
                    ).rowcount
            finally:
                lock.release(unlink=True)
            return existed > 0

    def close(self) -> None:
        with self._mutex:
            for writer in list(self._writers):
                writer.close()
            conn, self._conn = self._conn, None
        if conn is None:
            return
        self._checkpointer.stop()
        conn.close()  # the last connection to close checkpoints and removes the WAL


class _SQLiteWriter(_WriterBase):
    """The writer of one session of a :class:`SQLiteStore`."""

    def __init__(self, store: SQLiteStore, session: str, lock: _SessionLock) -> None:
        super().__init__(session, lock, f"SQLiteStore {str(store.path)!r}")
        self._store = store
        # Only the last row can be torn; rows before it are checked on load.
        with store._transaction(f"open session {session!r}") as conn:
            last = conn.execute(_LAST.format("seq, body", "?"), (session,)).fetchone()
            self._has_row = conn.execute(
                "SELECT 1 FROM sessions WHERE name = ?", (session,)
            ).fetchone() is not None
            if last is not None:
                try:
                    json.loads(last[1])
                except ValueError as error:
                    _warn_torn(f"{store.path}: session {session!r} row seq={last[0]}", str(error))
                    conn.execute(
                        "DELETE FROM messages WHERE session = ? AND seq = ?", (session, last[0])
                    )
                    last = (last[0] - 1, None)
        self._next_seq = 0 if last is None else last[0] + 1

    def load(self) -> list[Message]:
        self._check_open("load")
        return self._store.load(self.session)

    def append(self, message: Message) -> None:
        if not self._lock.held:
            self._check_open("append")
        seq = self._next_seq
        body = _encode(message, self.session, seq)
        now = time.time()
        if self._has_row:
            self._store._write(
                _INSERT, (self.session, seq, now, body), lambda: f"append to {self.session!r}"
            )
        else:
            with self._store._transaction(f"append to session {self.session!r}") as conn:
                conn.execute(_UPSERT_SESSION, (self.session, now))
                conn.execute(_INSERT, (self.session, seq, now, body))
            self._has_row = True
        self._next_seq = seq + 1

    def replace(self, messages: Sequence[Message]) -> None:
        self._check_open("replace")
        bodies = [_encode(m, self.session, i) for i, m in enumerate(messages)]
        now = time.time()
        with self._store._transaction(f"replace session {self.session!r}") as conn:
            conn.execute(_UPSERT_SESSION, (self.session, now))
            conn.execute("DELETE FROM messages WHERE session = ?", (self.session,))
            conn.executemany(
                _INSERT, ((self.session, seq, now, body) for seq, body in enumerate(bodies))
            )
        self._has_row = True
        self._next_seq = len(bodies)

    def set_status(self, status: SessionStatus) -> None:
        self._check_open("set the status")
        _check_status(status)
        self._store._write(
            "INSERT INTO sessions (name, created, updated, status) VALUES (?1, ?2, ?2, ?3) "
            "ON CONFLICT (name) DO UPDATE SET updated = ?2, status = ?3",
            (self.session, time.time(), status),
            lambda: f"set the status of session {self.session!r}",
        )
        self._has_row = True

    def close(self) -> None:
        with self._store._mutex:
            self._lock.release()
            self._store._writers.discard(self)


# --------------------------------------------------------------------------- JSONL

_META: Final = b'{"aimu_meta":'
_JSONL_VERSION: Final = 1


def _meta_line(**fields: object) -> bytes:
    return json.dumps({"aimu_meta": fields}, separators=(",", ":")).encode() + b"\n"


#: Seconds the fsync thread lets lines gather before syncing them together.
_SYNC_GATHER: Final = 0.002


class _FileSyncer:
    """One background thread per store that fsyncs appended files, in order.

    ``append`` writes and returns (the line is in the OS page cache: safe from
    ``kill -9``); this thread then fsyncs, coalescing the lines of a few milliseconds
    into one fsync, so the event loop never waits for the disk. A file handed over for
    closing is fsynced one last time and closed here.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._pending: dict[_DataFile, None] = {}  # an ordered set
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._idle = False

    def request(self, file: _DataFile) -> None:
        with self._cond:
            if self._stopping:
                raise StoreError(f"{self._name} is closed")
            self._pending[file] = None
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"aimu-fsync {self._name}", daemon=True
                )
                self._thread.start()
            elif self._idle:
                self._cond.notify()

    def wait(self, file: _DataFile) -> None:
        with self._cond:
            while file.synced < file.written and file.error is None:
                if file not in self._pending and self._thread is None:
                    break
                self._cond.wait()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._idle = True
                    self._cond.wait()
                    self._idle = False
                if not self._pending:
                    return
            # Let lines gather: one wake-up (and GIL hand-off) per batch, not per line.
            if not self._stopping:
                time.sleep(_SYNC_GATHER)
            with self._cond:
                batch = list(self._pending)
                self._pending.clear()
            for file in batch:
                target = file.written  # lines written before this fsync starts
                error: OSError | None = None
                if target > file.synced or file.dir_dirty:
                    try:
                        if file.dir_dirty:
                            file.dir_dirty = False
                            _fsync_dir(file.path.parent)
                        os.fsync(file.fd)
                    except OSError as failure:
                        error = failure
                with self._cond:
                    file.synced = max(file.synced, target)
                    if error is not None and file.error is None:
                        file.error = error
                    if file.closing and not file.closed and file.synced >= file.written:
                        file.closed = True
                        with contextlib.suppress(OSError):
                            os.close(file.fd)
                    self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None:
            thread.join()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _DataFile:
    """An append-only file descriptor and how much of it is known to be on disk."""

    __slots__ = ("closed", "closing", "dir_dirty", "error", "fd", "path", "synced", "written")

    def __init__(self, path: Path, fd: int, *, dir_dirty: bool) -> None:
        self.path = path
        self.fd = fd
        self.written = 0  # lines written, counted after each write() returned
        self.synced = 0  # lines known fsynced
        self.error: OSError | None = None
        self.closing = False
        self.closed = False
        self.dir_dirty = dir_dirty


@dataclass(slots=True)
class _Scan:
    """One JSONL session file, split into records."""

    messages: list[bytes]
    message_lines: list[int]  # 1-based line number of each message
    meta: list[dict[str, Any]]
    good_length: int  # bytes up to the end of the last good line
    torn: str | None  # why the last record was ignored


class JSONLStore(_StoreBase["_JSONLWriter"]):
    """Sessions as files in ``directory``: one append-only ``<session>.jsonl`` each.

    Each line is one message as compact JSON, or a ``{"aimu_meta": ...}`` record (the
    header with the format version and creation time, and each status change), so the
    file alone is the whole session. ``append`` writes the line with one ``write()``
    before returning: the message survives ``kill -9``. With ``fsync=True`` a
    background thread fsyncs every line within a few milliseconds (one fsync per batch),
    so a power loss can lose only those last milliseconds; ``writer.sync()``,
    ``replace()`` and ``store.close()`` wait for the disk.
    """

    def __init__(self, directory: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.directory = Path(directory)
        self.fsync = fsync
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StoreError(
                f"cannot create the JSONL store directory {self.directory}: {error}"
            ) from error
        self._mutex = threading.RLock()
        self._writers: set[_JSONLWriter] = set()
        self._syncer = _FileSyncer(str(self.directory)) if fsync else None
        self._closed = False

    def __repr__(self) -> str:
        return f"<JSONLStore {str(self.directory)!r}>"

    def _path(self, session: str) -> Path:
        return self.directory / f"{validate_session_name(session)}.jsonl"

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise StoreError(f"{self!r} is closed; cannot {what}")

    def _read(self, path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            raise StoreError(f"cannot read {path}: {error}") from error

    def _scan(self, path: Path, data: bytes) -> _Scan:
        """Split a session file into records; only the last line may be torn."""
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline
        torn: str | None = None
        good_length = len(data) - len(tail)
        if tail:
            torn = f"line {len(lines) + 1} has no line end"
        elif lines and lines[-1] and not lines[-1].isspace():
            try:
                json.loads(lines[-1])
            except ValueError as error:
                torn = f"line {len(lines)}: {error}"
                good_length -= len(lines.pop()) + 1
        messages: list[bytes] = []
        message_lines: list[int] = []
        meta: list[dict[str, Any]] = []
        for number, line in enumerate(lines, 1):
            if line.startswith(_META):
                try:
                    record = json.loads(line)["aimu_meta"]
                    if not isinstance(record, dict):
                        raise ValueError("aimu_meta is not an object")
                except (ValueError, TypeError, KeyError) as error:
                    raise StoreFormatError(
                        f"{path} line {number} is a corrupt metadata record ({error}); "
                        "the session cannot be read"
                    ) from None
                meta.append(record)
            elif line and not line.isspace():
                messages.append(line)
                message_lines.append(number)
        if meta:
            version = meta[0].get("version", 1)
            if not isinstance(version, int) or version > _JSONL_VERSION:
                raise StoreFormatError(
                    f"{path} has store format version {version!r}, newer than the "
                    f"{_JSONL_VERSION} this aimu reads; upgrade aimu to open it"
                )
        return _Scan(messages, message_lines, meta, good_length, torn)

    def _decode(self, path: Path, scan: _Scan) -> list[Message]:
        parsed = _parse_array(scan.messages)
        if parsed is None:
            bad = _first_bad(scan.messages)
            position, why = bad if bad is not None else (0, "records run together")
            raise StoreFormatError(
                f"{path} line {scan.message_lines[position]} is corrupt ({why}); the session "
                "cannot be read"
            )
        try:
            validate(parsed)
        except TranscriptError as error:
            index = error.index
            where = (
                f"line {scan.message_lines[index]}"
                if index is not None and index < len(scan.message_lines)
                else "content"
            )
            raise StoreFormatError(f"{path} {where} is not a valid message: {error}") from error
        return cast(list[Message], parsed)

    def _load(self, session: str, *, warn: bool) -> tuple[list[Message], _Scan | None]:
        path = self._path(session)
        data = self._read(path)
        if data is None:
            return [], None
        scan = self._scan(path, data)
        if scan.torn is not None and warn:
            _warn_torn(str(path), scan.torn)
        return self._decode(path, scan), scan

    def load(self, session: str) -> list[Message]:
        return self._load(session, warn=True)[0]

    def info(self, session: str) -> SessionInfo | None:
        path = self._path(session)
        try:
            stat = path.stat()
        except FileNotFoundError:
            return None
        data = self._read(path)
        if data is None:
            return None
        scan = self._scan(path, data)
        created = stat.st_mtime
        status: SessionStatus | None = None
        for record in scan.meta:
            if "created" in record and isinstance(record["created"], int | float):
                created = float(record["created"])
            if record.get("status") in _STATUSES:
                status = record["status"]
        return SessionInfo(session, created, stat.st_mtime, len(scan.messages), status)

    def sessions(self) -> list[SessionInfo]:
        found: list[SessionInfo] = []
        for path in sorted(self.directory.glob("*.jsonl")):
            name = path.name[: -len(".jsonl")]
            try:
                validate_session_name(name)
            except ValueError:
                continue
            info = self.info(name)
            if info is not None:
                found.append(info)
        return found

    def open_session(self, session: str) -> _JSONLWriter:
        path = self._path(session)
        with self._mutex:
            self._check_open(f"open session {session!r}")
            return self._add_writer(
                _SessionLock(self.directory, session),
                lambda lock: _JSONLWriter(self, session, path, lock),
            )

    def delete(self, session: str) -> bool:
        path = self._path(session)
        with self._mutex:
            self._check_open(f"delete session {session!r}")
            lock = _SessionLock(self.directory, session)
            try:
                try:
                    path.unlink()
                except FileNotFoundError:
                    return False
                if self.fsync:
                    _fsync_dir(self.directory)
                return True
            finally:
                lock.release(unlink=True)

    def close(self) -> None:
        with self._mutex:
            if self._closed:
                return
            for writer in list(self._writers):
                writer.close(wait=False)
            self._closed = True
        if self._syncer is not None:
            self._syncer.stop()


class _JSONLWriter(_WriterBase):
    """The writer of one session of a :class:`JSONLStore`."""

    def __init__(self, store: JSONLStore, session: str, path: Path, lock: _SessionLock) -> None:
        super().__init__(session, lock, f"JSONLStore {str(store.directory)!r}")
        self._store = store
        self._path = path
        self._mutex = threading.Lock()
        self._file: _DataFile | None = None
        self._count = 0
        self._created: float | None = None
        self._status: SessionStatus | None = None
        self._temporary = path.with_name(path.name + ".tmp")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._temporary)  # left by a replace() that died half-way
        data = store._read(path)
        if data is None:
            return
        scan = store._scan(path, data)
        self._count = len(scan.messages)
        for record in scan.meta:
            if isinstance(record.get("created"), int | float):
                self._created = float(record["created"])
            if record.get("status") in _STATUSES:
                self._status = record["status"]
        if scan.torn is not None:
            _warn_torn(str(path), scan.torn)
            # Cut the torn tail off before appending after it.
            try:
                with open(path, "r+b") as handle:
                    handle.truncate(scan.good_length)
                    if store.fsync:
                        os.fsync(handle.fileno())
            except OSError as error:
                raise StoreError(
                    f"session {session!r}: cannot repair the torn end of {path}: {error}"
                ) from error

    def _data_file(self) -> _DataFile:
        file = self._file
        if file is not None:
            if file.error is not None:
                raise StoreError(
                    f"session {self.session!r}: syncing {self._path} to disk failed: {file.error}"
                )
            return file
        try:
            fd = os.open(
                self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644
            )
            empty = os.fstat(fd).st_size == 0
        except OSError as error:
            raise StoreError(
                f"session {self.session!r}: cannot open {self._path}: {error}"
            ) from error
        file = self._file = _DataFile(self._path, fd, dir_dirty=empty)
        if empty:
            self._created = time.time()
            self._write(
                file, _meta_line(format="aimu.jsonl", version=_JSONL_VERSION, created=self._created)
            )
        return file

    def _write(self, file: _DataFile, line: bytes) -> None:
        done = 0
        try:
            while done < len(line):
                done += os.write(file.fd, line[done:] if done else line)
        except OSError as error:
            if done:
                # Never leave half a line that the next append would bury mid-file.
                with contextlib.suppress(OSError):
                    os.ftruncate(file.fd, os.fstat(file.fd).st_size - done)
            raise StoreError(
                f"session {self.session!r}: cannot write to {self._path}: {error}"
            ) from error
        file.written += 1
        syncer = self._store._syncer
        if syncer is not None:
            syncer.request(file)

    def load(self) -> list[Message]:
        self._check_open("load")
        return self._store._load(self.session, warn=True)[0]

    def append(self, message: Message) -> None:
        with self._mutex:
            self._check_open("append")
            line = _encode(message, self.session, self._count).encode() + b"\n"
            self._write(self._data_file(), line)
            self._count += 1

    def set_status(self, status: SessionStatus) -> None:
        with self._mutex:
            self._check_open("set the status")
            line = _meta_line(status=_check_status(status), at=time.time())
            self._write(self._data_file(), line)
            self._status = status

    def replace(self, messages: Sequence[Message]) -> None:
        with self._mutex:
            self._check_open("replace")
            lines = [_encode(m, self.session, i).encode() + b"\n" for i, m in enumerate(messages)]
            created = self._created if self._created is not None else time.time()
            head = [_meta_line(format="aimu.jsonl", version=_JSONL_VERSION, created=created)]
            if self._status is not None:
                head.append(_meta_line(status=self._status, at=time.time()))
            temporary = self._temporary
            try:
                with open(temporary, "wb") as handle:
                    handle.writelines(head + lines)
                    handle.flush()
                    if self._store.fsync:
                        os.fsync(handle.fileno())
                os.replace(temporary, self._path)
                if self._store.fsync:
                    _fsync_dir(self._path.parent)
            except OSError as error:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise StoreError(
                    f"session {self.session!r}: cannot rewrite {self._path}: {error}"
                ) from error
            # The old descriptor points at the replaced file: drop it, reopen lazily.
            self._drop_file(wait=False)
            self._created = created
            self._count = len(lines)

    def sync(self) -> None:
        """Block until every line written so far is fsynced (no-op with ``fsync=False``)."""
        syncer = self._store._syncer
        file = self._file
        if syncer is not None and file is not None:
            syncer.wait(file)
            if file.error is not None:
                raise StoreError(
                    f"session {self.session!r}: syncing {self._path} to disk failed: {file.error}"
                )

    def _drop_file(self, *, wait: bool) -> None:
        file, self._file = self._file, None
        if file is None:
            return
        syncer = self._store._syncer
        if syncer is None:
            os.close(file.fd)
            return
        file.closing = True
        syncer.request(file)  # the syncer fsyncs it one last time, then closes it
        if wait:
            syncer.wait(file)

    def close(self, *, wait: bool = False) -> None:
        """Release the lock; the last fsync finishes in the background unless ``wait``."""
        with self._store._mutex, self._mutex:
            if not self._lock.held:
                return
            try:
                self._drop_file(wait=wait)
            finally:
                self._lock.release()
                self._store._writers.discard(self)

