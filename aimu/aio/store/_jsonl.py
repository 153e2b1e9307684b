"""Sessions as files in a directory: one append-only ``<session>.jsonl`` each."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast

from aimu.aio.errors import StoreError, StoreFormatError, TranscriptError
from aimu.aio.store._base import StoreBase, WriterBase
from aimu.aio.store._codec import (
    encode,
    encode_state,
    encode_value,
    first_bad,
    parse_array,
)
from aimu.aio.store._files import fsync_dir, make_private_dirs, open_private
from aimu.aio.store._fsync import DataFile, FileSyncer
from aimu.aio.store._lock import SessionLock
from aimu.aio.store._pages import RunPages, RunsPage, unknown_run
from aimu.aio.store._protocol import (
    STATUSES,
    PendingInput,
    RunRecord,
    SessionInfo,
    SessionStatus,
    ToolStart,
    check_run_id,
    check_run_of,
    check_status,
    input_message,
    validate_session_name,
)
from aimu.aio.store._report import note_unfinished, warn_torn
from aimu.aio.transcript import Message, UserMessage, validate

__all__ = ["JSONLStore"]

_META: Final = b'{"aimu_meta":'
#: The runs of every session, beside the session files: one JSON line per write of a run
#: record (the last line of an id is its record), and a line ``{"deleted": session}``
#: when a session is deleted. Not a ``.jsonl`` name, so never taken for a session.
RUNS_FILE: Final = "runs.ndjson"
_JSONL_VERSION: Final = 1


_ENCODE: Final = json.JSONEncoder(separators=(",", ":")).encode


def _lock_file(fd: int) -> None:
    """Wait for the OS lock on the whole of ``fd`` (released when it is closed)."""
    if sys.platform == "win32":  # pragma: no cover - POSIX in the tests
        import msvcrt

        msvcrt.locking(fd, msvcrt.LK_LOCK, 1)
    else:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX)


def _meta_line(**fields: object) -> bytes:
    return _ENCODE({"aimu_meta": fields}).encode() + b"\n"


def _journal(meta: list[dict[str, Any]]) -> dict[str, ToolStart]:
    """The tool journal in ``meta`` records, by call id (a restarted call moves last)."""
    journal: dict[str, ToolStart] = {}
    for record in meta:
        start = record.get("tool_start")
        if isinstance(start, dict) and isinstance(start.get("call_id"), str):
            call_id = start["call_id"]
            journal.pop(call_id, None)
            journal[call_id] = ToolStart(
                call_id, str(start.get("name")), start.get("arguments"), float(start.get("at", 0))
            )
    return journal


@dataclass(slots=True)
class _Scan:
    """One JSONL session file, split into records."""

    messages: list[bytes]
    message_lines: list[int]  # 1-based line number of each message
    meta: list[dict[str, Any]]
    good_length: int  # bytes up to the end of the last good line
    torn: str | None  # why the last record was ignored


class JSONLStore(StoreBase["_JSONLWriter"], RunPages):
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
            make_private_dirs(self.directory)
        except OSError as error:
            raise StoreError(
                f"cannot create the JSONL store directory {self.directory}: {error}"
            ) from error
        self._mutex = threading.RLock()
        self._writers: set[_JSONLWriter] = set()
        self._syncer = FileSyncer(str(self.directory)) if fsync else None
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
        parsed = parse_array(scan.messages)
        if parsed is None:
            bad = first_bad(scan.messages)
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
            warn_torn(str(path), scan.torn)
        return self._decode(path, scan), scan

    async def load(self, session: str) -> list[Message]:
        return self._load(session, warn=True)[0]

    def _meta(self, session: str) -> list[dict[str, Any]]:
        path = self._path(session)
        data = self._read(path)
        return [] if data is None else self._scan(path, data).meta

    async def load_state(self, session: str) -> dict[str, Any]:
        states = [r["state"] for r in self._meta(session) if isinstance(r.get("state"), dict)]
        return states[-1] if states else {}

    async def tool_starts(self, session: str) -> list[ToolStart]:
        return list(_journal(self._meta(session)).values())

    async def info(self, session: str) -> SessionInfo | None:
        return self._info(session)

    def _info(self, session: str) -> SessionInfo | None:
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
            if record.get("status") in STATUSES:
                status = record["status"]
        return SessionInfo(session, created, stat.st_mtime, len(scan.messages), status)

    async def sessions(self) -> list[SessionInfo]:
        found: list[SessionInfo] = []
        for path in sorted(self.directory.glob("*.jsonl")):
            name = path.name[: -len(".jsonl")]
            try:
                validate_session_name(name)
            except ValueError:
                continue
            info = self._info(name)
            if info is not None:
                found.append(info)
        return found

    def _write_run_line(self, line: bytes) -> None:
        """Append one line to the runs file (one write: lines of several processes
        never interleave); fsynced in the background like a session's lines."""
        path = self.directory / RUNS_FILE
        try:
            fd = open_private(path, os.O_WRONLY | os.O_APPEND)
        except OSError as error:
            raise StoreError(f"cannot open {path}: {error}") from error
        file = DataFile(path, fd, dir_dirty=False)
        try:
            done = 0
            while done < len(line):
                done += os.write(fd, line[done:])
        except OSError as error:
            os.close(fd)
            raise StoreError(f"cannot write to {path}: {error}") from error
        file.written = 1
        if self._syncer is None:
            os.close(fd)
            return
        file.dir_dirty = True  # the file may be new
        file.closing = True
        self._syncer.request(file)  # fsynced, then closed, on the syncer's thread

    def _run_records(self) -> dict[str, RunRecord]:
        """Every run's last record, by id, in the order they were first written."""
        path = self.directory / RUNS_FILE
        data = self._read(path)
        records: dict[str, RunRecord] = {}
        if data is None:
            return records
        for number, line in enumerate(data.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                if isinstance(item, dict) and isinstance(item.get("deleted"), str):
                    deleted = item["deleted"]
                    records = {k: r for k, r in records.items() if r.session != deleted}
                    continue
                if not isinstance(item, dict):
                    raise ValueError("not a JSON object")
                record = RunRecord.from_json(item)
            except ValueError as error:  # a line a full disk or a crash cut: skipped
                warn_torn(f"{path} line {number}", str(error))
                continue
            records[record.id] = record
        return records

    async def _runs(self, page: RunsPage) -> list[RunRecord]:
        records = self._run_records()
        found = sorted(records.values(), key=lambda r: (r.started, r.id), reverse=True)
        if page.before is not None:
            if page.before not in records:
                raise unknown_run(page.before)
            mark = (records[page.before].started, page.before)
            found = [r for r in found if (r.started, r.id) < mark]
        session, status, recover = page.session, page.status, page.recover
        return [
            r for r in found
            if (session is None or r.session == session) and (status is None or r.status == status)
            and (recover is None or r.recover == recover)
        ][:page.limit]

    async def run(self, run_id: str) -> RunRecord | None:
        return self._run_records().get(check_run_id(run_id))

    async def open_session(self, session: str) -> _JSONLWriter:
        path = self._path(session)
        with self._mutex:
            self._check_open(f"open session {session!r}")
            return self._add_writer(
                SessionLock(self.directory, session),
                lambda lock: _JSONLWriter(self, session, path, lock),
            )

    # -- pending inputs: <session>.inputs, lines {"add": id, "at", "message"}, {"drop": id}
    # and {"join": id}, each written whole under an OS lock on that file ----------------

    @contextlib.contextmanager
    def _inputs_file(self, session: str) -> Iterator[int]:
        """The session's inputs file, open for appending, under its OS lock."""
        path = self.directory / f"{validate_session_name(session)}.inputs"
        try:
            fd = open_private(path, os.O_RDWR | os.O_APPEND)
        except OSError as error:
            raise StoreError(f"cannot open {path}: {error}") from error
        try:
            _lock_file(fd)
            yield fd
        finally:
            os.close(fd)  # releases the lock

    def _input_line(self, fd: int, record: dict[str, Any]) -> None:
        line = _ENCODE(record).encode() + b"\n"
        try:
            os.write(fd, line)
            if self.fsync:
                os.fsync(fd)
        except OSError as error:
            raise StoreError(f"cannot write an input record: {error}") from error

    def _pending(self, session: str, fd: int) -> dict[str, PendingInput]:
        """The pending inputs in the (locked) inputs file ``fd``, by id: added, not
        dropped or joined (a joiner that died before noting the join: its message is in
        the transcript)."""
        size = os.fstat(fd).st_size
        added: dict[str, PendingInput] = {}
        for line in os.pread(fd, size, 0).split(b"\n"):
            try:
                record = json.loads(line) if line.strip() else None
            except ValueError:
                continue  # a torn last line
            if not isinstance(record, dict):
                continue
            if isinstance(record.get("add"), str) and isinstance(record.get("message"), dict):
                added.setdefault(record["add"], PendingInput(
                    record["add"], cast(UserMessage, record["message"]),
                    float(record.get("at", 0)),
                ))
            for closed in (record.get("drop"), record.get("join")):
                if isinstance(closed, str):
                    added.pop(closed, None)
        if added:
            joined = {m.get("aimu_sent") for m in self._load(session, warn=False)[0]
                      if m["role"] == "user"}
            added = {key: value for key, value in added.items() if key not in joined}
        return added

    async def add_input(self, session: str, message: UserMessage) -> None:
        input_id = str(message.get("aimu_sent"))
        input_message(input_id, message)
        with self._inputs_file(session) as fd:
            if input_id not in self._pending(session, fd):
                encode(message, session, 0)  # checked as a stored message is
                self._input_line(fd, {"add": input_id, "at": time.time(), "message": message})

    async def inputs(self, session: str) -> list[PendingInput]:
        path = self.directory / f"{validate_session_name(session)}.inputs"
        if not path.exists():
            return []
        with self._inputs_file(session) as fd:
            return sorted(self._pending(session, fd).values(), key=lambda p: (p.at, p.id))

    async def drop_input(self, session: str, input_id: str) -> bool:
        with self._inputs_file(session) as fd:
            if input_id not in self._pending(session, fd):
                return False
            self._input_line(fd, {"drop": input_id})
            return True

    async def delete(self, session: str) -> bool:
        path = self._path(session)
        with self._mutex:
            self._check_open(f"delete session {session!r}")
            lock = SessionLock(self.directory, session)
            try:
                with contextlib.suppress(FileNotFoundError):
                    (self.directory / f"{session}.inputs").unlink()
                try:
                    path.unlink()
                except FileNotFoundError:
                    return False
                if self.fsync:
                    fsync_dir(self.directory)
                if (self.directory / RUNS_FILE).exists():
                    self._write_run_line(_ENCODE({"deleted": session}).encode() + b"\n")
                return True
            finally:
                lock.release(unlink=True)

    def close(self) -> None:
        with self._mutex:
            if self._closed:
                return
            for writer in list(self._writers):
                writer.release()
            self._closed = True
        if self._syncer is not None:
            self._syncer.stop()


class _JSONLWriter(WriterBase):
    """The writer of one session of a :class:`JSONLStore`."""

    def __init__(self, store: JSONLStore, session: str, path: Path, lock: SessionLock) -> None:
        super().__init__(session, lock, f"JSONLStore {str(store.directory)!r}")
        self._store = store
        self._path = path
        self._mutex = threading.Lock()
        self._file: DataFile | None = None
        self._count = 0
        self._created: float | None = None
        self._status: SessionStatus | None = None
        # Kept to carry them over when replace() rewrites the file.
        self._journal: dict[str, bytes] = {}
        self._state: bytes | None = None
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
            if record.get("status") in STATUSES:
                self._status = record["status"]
            start = record.get("tool_start")
            if isinstance(start, dict) and isinstance(start.get("call_id"), str):
                self._journal.pop(start["call_id"], None)
                self._journal[start["call_id"]] = _meta_line(tool_start=start)
            if isinstance(record.get("state"), dict):
                self._state = _meta_line(state=record["state"])
        note_unfinished(str(path), session, self._status)
        if scan.torn is not None:
            warn_torn(str(path), scan.torn, repaired=True)
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

    def _data_file(self) -> DataFile:
        file = self._file
        if file is not None:
            if file.error is not None:
                raise StoreError(
                    f"session {self.session!r}: syncing {self._path} to disk failed: {file.error}"
                )
            return file
        try:
            fd = open_private(self._path, os.O_WRONLY | os.O_APPEND)
            empty = os.fstat(fd).st_size == 0
        except OSError as error:
            raise StoreError(
                f"session {self.session!r}: cannot open {self._path}: {error}"
            ) from error
        file = self._file = DataFile(self._path, fd, dir_dirty=empty)
        if empty:
            self._created = time.time()
            self._write(
                file, _meta_line(format="aimu.jsonl", version=_JSONL_VERSION, created=self._created)
            )
        return file

    def _write(self, file: DataFile, line: bytes) -> None:
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

    async def load(self) -> list[Message]:
        self._check_open("load")
        return self._store._load(self.session, warn=True)[0]

    async def append(self, message: Message) -> None:
        with self._mutex:
            self._check_open("append")
            line = encode(message, self.session, self._count).encode() + b"\n"
            self._write(self._data_file(), line)
            self._count += 1

    async def join_input(self, message: UserMessage) -> bool:
        self._check_open("join an input")
        input_id = str(message.get("aimu_sent"))
        input_message(input_id, message)
        store = self._store
        with store._inputs_file(self.session) as fd:
            if input_id not in store._pending(self.session, fd):
                return False
            await self.append(message)
            store._input_line(fd, {"join": input_id})
        return True

    async def set_status(self, status: SessionStatus) -> None:
        with self._mutex:
            self._check_open("set the status")
            line = _meta_line(status=check_status(status), at=time.time())
            self._write(self._data_file(), line)
            self._status = status

    async def record_tool_start(self, call_id: str, name: str, arguments: Any) -> None:
        encode_value(arguments, f"the arguments of tool call {call_id!r}", self.session)
        start = {"call_id": call_id, "name": name, "arguments": arguments, "at": time.time()}
        line = _meta_line(tool_start=start)
        with self._mutex:
            self._check_open("record a tool start")
            self._write(self._data_file(), line)
            self._journal.pop(call_id, None)
            self._journal[call_id] = line

    async def save_state(self, state: Mapping[str, Any]) -> None:
        line = b'{"aimu_meta":{"state":' + encode_state(state, self.session).encode() + b"}}\n"
        with self._mutex:
            self._check_open("save the state")
            self._write(self._data_file(), line)
            self._state = line

    async def record_run(self, record: RunRecord) -> None:
        line = _ENCODE(check_run_of(record, self.session).to_json()).encode() + b"\n"
        with self._mutex:
            self._check_open("record a run")
            self._store._write_run_line(line)

    async def replace(self, messages: Sequence[Message]) -> None:
        with self._mutex:
            self._check_open("replace")
            lines = [encode(m, self.session, i).encode() + b"\n" for i, m in enumerate(messages)]
            created = self._created if self._created is not None else time.time()
            head = [_meta_line(format="aimu.jsonl", version=_JSONL_VERSION, created=created)]
            if self._status is not None:
                head.append(_meta_line(status=self._status, at=time.time()))
            head.extend(self._journal.values())
            if self._state is not None:
                head.append(self._state)
            self._rewrite(head + lines)
            # The old descriptor points at the replaced file: drop it, reopen lazily.
            self._drop_file(wait=False)
            self._created = created
            self._count = len(lines)

    def _rewrite(self, lines: list[bytes]) -> None:
        """Write ``lines`` to a new file and rename it over the session's, durably."""
        temporary = self._temporary
        try:
            fd = open_private(temporary, os.O_WRONLY | os.O_TRUNC)
            with open(fd, "wb") as handle:
                handle.writelines(lines)
                handle.flush()
                if self._store.fsync:
                    os.fsync(handle.fileno())
            os.replace(temporary, self._path)
            if self._store.fsync:
                fsync_dir(self._path.parent)
        except OSError as error:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise StoreError(
                f"session {self.session!r}: cannot rewrite {self._path}: {error}"
            ) from error

    async def sync(self) -> None:
        """Wait until every line written so far is fsynced (no-op with ``fsync=False``)."""
        syncer = self._store._syncer
        file = self._file
        if syncer is not None and file is not None:
            await asyncio.to_thread(syncer.wait, file)
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

    def release(self) -> None:
        """Release the lock; the last fsync finishes in the background."""
        with self._store._mutex, self._mutex:
            if not self._lock.held:
                return
            try:
                self._drop_file(wait=False)
            finally:
                self._lock.release()
                self._store._writers.discard(self)

