"""What only the local stores have: files, modes, torn records, the WAL, threads.

SQLiteStore and JSONLStore keep their I/O synchronous under the async protocol; these
tests reach into their files to tear, corrupt and inspect them.
"""

# Blocking file calls in these async tests are the point: they inspect the store's files.
# ruff: noqa: ASYNC240

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from aimu.aio.errors import StoreError, StoreFormatError
from aimu.aio.store import JSONLStore, SessionWriter, SQLiteStore, Store
from aimu.aio.transcript import Message
from tests.aio.store.store_backends import conversation

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(params=["sqlite", "jsonl"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _child(source: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(source)], stdout=subprocess.PIPE, text=True,
        cwd=ROOT,
    )


async def test_jsonl_files_stay_inside_the_directory(tmp_path: Path) -> None:
    async with JSONLStore(tmp_path / "d") as store:
        async with await store.open_session("s") as writer:
            await writer.append({"role": "user", "content": "x"})
        with pytest.raises(ValueError):
            await store.open_session("../outside")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    # The lock file stays: removing it on release would race with the next locker.
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["s.jsonl", "s.lock"]


async def _jsonl_session(tmp_path: Path, messages: list[Message]) -> Path:
    async with JSONLStore(tmp_path / "j") as store, await store.open_session("t") as writer:
        for message in messages:
            await writer.append(message)
    return tmp_path / "j" / "t.jsonl"


@pytest.mark.parametrize(
    "tail", [b'{"role":"assistant","cont', b'{"role":"user"}garbage\n', b"\x00\x00\x00\x00"]
)
async def test_jsonl_torn_last_line_is_ignored_then_repaired(tmp_path: Path, tail: bytes) -> None:
    messages = conversation(1)
    path = await _jsonl_session(tmp_path, messages)
    intact = path.read_bytes()
    line = intact.count(b"\n") + 1
    path.write_bytes(intact + tail)
    async with JSONLStore(tmp_path / "j") as store:
        torn = rf"t\.jsonl: ignoring a torn last record \(line {line}"
        with pytest.warns(RuntimeWarning, match=torn):
            assert await store.load("t") == messages
        assert (await store.info("t")).message_count == len(messages)  # type: ignore[union-attr]
        with pytest.warns(RuntimeWarning, match="torn"):
            writer = await store.open_session("t")
        assert path.read_bytes() == intact  # cut off before anything is appended
        await writer.append({"role": "user", "content": "next"})
        await writer.aclose()
        assert await store.load("t") == [*messages, {"role": "user", "content": "next"}]


async def test_jsonl_corrupt_middle_line_is_a_format_error(tmp_path: Path) -> None:
    path = await _jsonl_session(tmp_path, conversation(2))
    lines = path.read_bytes().split(b"\n")
    lines[3] = lines[3][:10]  # line 4: the first tool result
    path.write_bytes(b"\n".join(lines))
    async with JSONLStore(tmp_path / "j") as store:
        with pytest.raises(StoreFormatError, match=r"t\.jsonl line 4 is corrupt"):
            await store.load("t")


async def test_jsonl_invalid_message_is_a_format_error_naming_the_line(tmp_path: Path) -> None:
    path = await _jsonl_session(tmp_path, conversation(1))
    lines = path.read_bytes().split(b"\n")
    lines.insert(2, b'{"role":"banana","content":"x"}')
    path.write_bytes(b"\n".join(lines))
    async with JSONLStore(tmp_path / "j") as store:
        with pytest.raises(StoreFormatError, match=r"t\.jsonl line 3 .*unknown role 'banana'"):
            await store.load("t")


async def test_jsonl_newer_format_version_is_refused(tmp_path: Path) -> None:
    path = await _jsonl_session(tmp_path, conversation(1))
    header, rest = path.read_bytes().split(b"\n", 1)
    record = json.loads(header)
    assert record["aimu_meta"]["version"] == 1
    record["aimu_meta"]["version"] = 99
    path.write_bytes(json.dumps(record).replace(" ", "").encode() + b"\n" + rest)
    async with JSONLStore(tmp_path / "j") as store:
        for call in (store.load, store.open_session, store.info):
            with pytest.raises(StoreFormatError, match=r"t\.jsonl has store format version 99"):
                await call("t")


async def test_jsonl_accepts_a_plain_transcript_file(tmp_path: Path) -> None:
    (tmp_path / "j").mkdir()
    messages = conversation(1)
    (tmp_path / "j" / "plain.jsonl").write_text("".join(json.dumps(m) + "\n" for m in messages))
    async with JSONLStore(tmp_path / "j") as store:
        assert await store.load("plain") == messages
        assert (await store.info("plain")).message_count == len(messages)  # type: ignore[union-attr]


async def test_jsonl_without_fsync_and_explicit_sync(tmp_path: Path) -> None:
    async with JSONLStore(tmp_path / "fast", fsync=False) as store:
        async with await store.open_session("s") as writer:
            await writer.append({"role": "user", "content": "x"})
            await writer.sync()
        assert await store.load("s") == [{"role": "user", "content": "x"}]
    async with JSONLStore(tmp_path / "safe") as store, await store.open_session("s") as writer:
        for i in range(50):
            await writer.append({"role": "user", "content": str(i)})
        await writer.sync()  # returns once the fsync thread caught up
        assert len(await store.load("s")) == 50


async def _sqlite_session(tmp_path: Path, messages: list[Message]) -> Path:
    path = tmp_path / "s.db"
    async with SQLiteStore(path) as store, await store.open_session("t") as writer:
        for message in messages:
            await writer.append(message)
    return path


def _set_body(path: Path, seq: int, body: str) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE messages SET body = ? WHERE session = 't' AND seq = ?", (body, seq))
    conn.close()


async def test_sqlite_corrupt_last_row_is_ignored_then_repaired(tmp_path: Path) -> None:
    messages = conversation(1)
    path = await _sqlite_session(tmp_path, messages)
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO messages VALUES ('t', ?, 0, ?)", (len(messages), '{"role":"as'))
    conn.close()
    async with SQLiteStore(path) as store:
        with pytest.warns(RuntimeWarning, match=rf"s\.db: session 't' row seq={len(messages)}"):
            assert await store.load("t") == messages
        with pytest.warns(RuntimeWarning, match="torn"):
            writer = await store.open_session("t")
        await writer.append({"role": "user", "content": "next"})
        await writer.aclose()
        assert await store.load("t") == [*messages, {"role": "user", "content": "next"}]
        assert (await store.info("t")).message_count == len(messages) + 1  # type: ignore[union-attr]


async def test_sqlite_corrupt_middle_row_is_a_format_error(tmp_path: Path) -> None:
    path = await _sqlite_session(tmp_path, conversation(2))
    _set_body(path, 2, "{not json")
    async with SQLiteStore(path) as store:
        with pytest.raises(StoreFormatError, match=r"s\.db: session 't' row seq=2 is corrupt"):
            await store.load("t")


async def test_sqlite_invalid_message_is_a_format_error(tmp_path: Path) -> None:
    path = await _sqlite_session(tmp_path, conversation(2))
    _set_body(path, 3, '{"role":"tool","content":"x","tool_call_id":"nope","name":"add"}')
    async with SQLiteStore(path) as store:
        with pytest.raises(StoreFormatError, match=r"row seq=3 is not a valid message.*'nope'"):
            await store.load("t")


async def test_sqlite_newer_schema_is_refused(tmp_path: Path) -> None:
    path = await _sqlite_session(tmp_path, conversation(1))
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version = 7")
    conn.close()
    with pytest.raises(StoreFormatError, match=r"s\.db has store schema version 7.*upgrade aimu"):
        SQLiteStore(path)


async def test_stores_create_missing_directories(tmp_path: Path) -> None:
    async with SQLiteStore(tmp_path / "a" / "b" / "s.db") as store:
        assert await store.sessions() == []
    async with JSONLStore(tmp_path / "c" / "d") as jsonl:
        assert await jsonl.sessions() == []
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError, match="cannot open SQLite store"):
        SQLiteStore(tmp_path / "file" / "s.db")
    with pytest.raises(StoreError, match="cannot create the JSONL store directory"):
        JSONLStore(tmp_path / "file" / "d")


async def test_sqlite_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreFormatError, match=r"junk\.db is not a readable aimu SQLite store"):
        SQLiteStore(path)


KILLED_MID_WAL = """
import asyncio, os, signal
from aimu.aio.store import SQLiteStore

async def main():
    store = SQLiteStore({path!r})
    writer = await store.open_session("t")
    for i in range(40):
        await writer.append({{"role": "user", "content": "m" * 300 + str(i)}})
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


async def test_sqlite_truncated_wal_loses_only_the_torn_transaction(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    SQLiteStore(path).close()
    with _child(KILLED_MID_WAL.format(path=str(path))) as child:
        child.communicate()
    assert child.returncode == -signal.SIGKILL
    wal = Path(f"{path}-wal")
    size = wal.stat().st_size
    assert size > 4096
    # Cut the last WAL frame in half, as a crash in the middle of a commit would.
    os.truncate(wal, size - 2000)
    async with SQLiteStore(path) as store:
        loaded = await store.load("t")
        assert 30 <= len(loaded) < 40
        assert loaded == [{"role": "user", "content": "m" * 300 + str(i)} for i in
                          range(len(loaded))]
        assert (await store.info("t")).message_count == len(loaded)  # type: ignore[union-attr]
        async with await store.open_session("t") as writer:
            await writer.append({"role": "user", "content": "after"})
        assert (await store.load("t"))[-1] == {"role": "user", "content": "after"}


async def test_sqlite_checkpoints_off_the_loop_and_close_removes_the_wal(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    store = SQLiteStore(path)
    async with await store.open_session("c") as writer:
        for i in range(600):  # enough commits to ask the background checkpointer twice
            await writer.append({"role": "user", "content": str(i)})
    assert Path(f"{path}-wal").exists()
    store.close()  # joins the checkpoint thread; the last connection removes the WAL
    assert not Path(f"{path}-wal").exists()
    async with SQLiteStore(path) as again:
        assert len(await again.load("c")) == 600


async def test_one_store_serves_writers_on_several_threads(kind: str, tmp_path: Path) -> None:
    """Each thread runs its own event loop on the one store object."""
    store: Store = SQLiteStore(tmp_path / "t.db") if kind == "sqlite" else JSONLStore(tmp_path)
    writers = [await store.open_session(f"thread-{i}") for i in range(4)]

    async def write_all(writer: SessionWriter) -> None:
        for n in range(150):
            await writer.append({"role": "user", "content": f"{writer.session} {n}"})

    def write(writer: SessionWriter) -> None:
        asyncio.run(write_all(writer))

    threads = [threading.Thread(target=write, args=(w,)) for w in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for writer in writers:
        await writer.aclose()
    try:
        for i in range(4):
            assert [m["content"] for m in await store.load(f"thread-{i}")] == [
                f"thread-{i} {n}" for n in range(150)
            ]
    finally:
        await store.aclose()


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
async def test_session_data_is_private_to_the_user_whatever_the_umask(
    kind: str, tmp_path: Path, umask: int
) -> None:
    """Defect 10: data files 0o600 and directories 0o700, after append and replace too."""
    root = tmp_path / "home"
    previous = os.umask(umask)
    try:
        store: Store = (
            SQLiteStore(root / "deep" / "sessions.db")
            if kind == "sqlite"
            else JSONLStore(root / "deep" / "sessions")
        )
        try:
            async with await store.open_session("private") as writer:
                await writer.append({"role": "user", "content": "secret"})
                await writer.replace(conversation(1))
                await writer.append({"role": "user", "content": "more"})
                modes = {
                    str(path.relative_to(root)): path.stat().st_mode & 0o777
                    for path in [root, *root.rglob("*")]
                }
        finally:
            await store.aclose()
    finally:
        os.umask(previous)
    assert {p for p, mode in modes.items() if mode not in (0o600, 0o700)} == set(), modes
    for path, mode in modes.items():
        assert mode == (0o700 if (root / path).is_dir() else 0o600), path
    if kind == "sqlite":
        assert {"deep/sessions.db", "deep/sessions.db-wal", "deep/sessions.db-locks"} <= set(modes)


def test_stores_and_the_cli_import_where_fcntl_does_not_exist() -> None:
    """Defect 15: no unconditional ``fcntl`` import (Windows has none)."""
    source = textwrap.dedent(
        """
        import sys
        sys.modules["fcntl"] = None  # importing it now raises ImportError, as on Windows
        import aimu.cli
        from aimu import aio
        from aimu.aio.store import JSONLStore, SQLiteStore
        print(aio.SQLiteStore is SQLiteStore, aio.JSONLStore is JSONLStore)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "True True\n"


async def test_sqlite_exclusive_mode_round_trips_and_shuts_others_out(tmp_path: Path) -> None:
    path = tmp_path / "x.db"
    store = SQLiteStore(path, exclusive=True)
    assert "exclusive" in repr(store)
    messages = conversation(3)
    async with await store.open_session("x") as writer:
        for i in range(600):  # past two checkpoint intervals
            await writer.append({"role": "user", "content": str(i)})
        await writer.replace(messages)
        await writer.record_tool_start("c", "f", {})
    assert await store.load("x") == messages
    wal = Path(f"{path}-wal")
    assert wal.exists() and not Path(f"{path}-shm").exists()  # the WAL index is in memory
    # Another connection is shut out while the store is open (that is the trade-off).
    other = sqlite3.connect(path, timeout=0)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        other.execute("SELECT count(*) FROM messages").fetchall()
    other.close()
    store.close()
    assert not wal.exists()
    async with SQLiteStore(path) as shared:  # and a normal store reads it afterwards
        assert await shared.load("x") == messages
        assert [s.call_id for s in await shared.tool_starts("x")] == ["c"]
