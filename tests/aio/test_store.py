"""Durable sessions: SQLiteStore and JSONLStore, round trips, locks, torn writes, bad input."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from aimu.aio.errors import SessionLockedError, StoreError, StoreFormatError, TranscriptError
from aimu.aio.store import (
    JSONLStore,
    SessionInfo,
    SessionWriter,
    SQLiteStore,
    Store,
    validate_session_name,
)
from aimu.aio.transcript import Message, validate

StoreFactory = Callable[[], Store]
ROOT = Path(__file__).resolve().parents[2]


def conversation(rounds: int) -> list[Message]:
    """A valid transcript: system, task, ``rounds`` tool rounds, an answer."""
    messages: list[Message] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "add things — ünïcode ✓"},
    ]
    for i in range(rounds):
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {"name": "add", "arguments": {"a": i, "b": [1.5, None]}},
                    }
                ],
            }
        )
        messages.append(
            {"role": "tool", "content": str(i), "tool_call_id": f"call_{i}", "name": "add"}
        )
    messages.append({"role": "assistant", "content": "done", "thinking": "easy"})
    return messages


@pytest.fixture(params=["sqlite", "jsonl"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(kind: str, tmp_path: Path) -> Iterator[StoreFactory]:
    """Opens stores on one location (several may be open at once); closes them all."""
    opened: list[Store] = []

    def make() -> Store:
        store: Store = (
            SQLiteStore(tmp_path / "sessions.db")
            if kind == "sqlite"
            else JSONLStore(tmp_path / "sessions")
        )
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def store(make_store: StoreFactory) -> Store:
    return make_store()


def spec(kind: str, tmp_path: Path) -> str:
    """Python source that builds the same store in a subprocess."""
    if kind == "sqlite":
        return f"SQLiteStore({str(tmp_path / 'sessions.db')!r})"
    return f"JSONLStore({str(tmp_path / 'sessions')!r})"


# --------------------------------------------------------------------------- round trips


def test_round_trip_appends_in_order(store: Store) -> None:
    messages = conversation(3)
    with closing(store.open_session("chat")) as writer:
        assert writer.load() == []
        for message in messages:
            writer.append(message)
        assert writer.load() == messages
    assert store.load("chat") == messages
    assert store.load("unknown") == []
    # Loaded messages are fresh objects: mutating them changes nothing stored.
    loaded = store.load("chat")
    loaded[1]["content"] = "changed"
    assert store.load("chat") == messages


def test_writers_satisfy_the_protocols(store: Store) -> None:
    assert isinstance(store, Store)
    writer = store.open_session("p")
    try:
        assert isinstance(writer, SessionWriter)
        assert writer.session == "p"
    finally:
        writer.close()


def test_reopening_continues_after_the_stored_messages(make_store: StoreFactory) -> None:
    messages = conversation(2)
    first = make_store()
    writer = first.open_session("s")
    for message in messages[:3]:
        writer.append(message)
    writer.close()
    first.close()
    second = make_store()
    writer = second.open_session("s")
    assert writer.load() == messages[:3]
    for message in messages[3:]:
        writer.append(message)
    writer.close()
    assert make_store().load("s") == messages


def test_metadata_tracks_created_updated_count_and_status(store: Store) -> None:
    assert store.info("m") is None
    writer = store.open_session("m")
    assert store.info("m") is None  # opening alone writes nothing
    before = time.time()
    writer.append({"role": "user", "content": "hi"})
    info = store.info("m")
    assert info is not None
    assert info.name == "m"
    assert info.message_count == 1
    assert info.status is None
    assert before - 1 <= info.created <= info.updated <= time.time() + 1
    writer.set_status("in_progress")
    writer.append({"role": "assistant", "content": "hello"})
    time.sleep(0.01)  # so "updated" can move on coarse-grained file times
    writer.set_status("completed")
    later = store.info("m")
    assert later is not None
    assert later.message_count == 2
    assert later.status == "completed"
    assert later.created == pytest.approx(info.created)
    assert later.updated >= info.updated
    with pytest.raises(ValueError, match="unknown session status 'done'"):
        writer.set_status("done")  # type: ignore[arg-type]
    assert store.info("m") == later  # the refused status changed nothing
    writer.close()
    # A status set before any message creates the session too.
    with closing(store.open_session("early")) as early:
        early.set_status("interrupted")
    early_info = store.info("early")
    assert early_info is not None
    assert (early_info.message_count, early_info.status) == (0, "interrupted")


def test_sessions_lists_every_written_session_by_name(store: Store) -> None:
    for name, count in (("b", 2), ("a", 1), ("c.d-e_F", 3)):
        with closing(store.open_session(name)) as writer:
            for message in conversation(1)[:count]:
                writer.append(message)
    with closing(store.open_session("never-written")):
        pass
    listed = store.sessions()
    assert [(s.name, s.message_count) for s in listed] == [("a", 1), ("b", 2), ("c.d-e_F", 3)]
    assert all(isinstance(s, SessionInfo) for s in listed)


def test_replace_rewrites_atomically_and_keeps_metadata(make_store: StoreFactory) -> None:
    store = make_store()
    writer = store.open_session("r")
    for message in conversation(3):
        writer.append(message)
    writer.set_status("interrupted")
    created = store.info("r").created  # type: ignore[union-attr]
    replacement = conversation(1)
    writer.replace(replacement)
    assert writer.load() == replacement
    writer.append({"role": "user", "content": "next"})
    expected = [*replacement, {"role": "user", "content": "next"}]
    assert store.load("r") == expected
    info = store.info("r")
    assert info is not None
    assert (info.message_count, info.status) == (len(expected), "interrupted")
    assert info.created == pytest.approx(created)
    writer.replace([])
    assert store.load("r") == []
    writer.close()
    assert make_store().load("r") == []


def test_replace_with_a_non_json_message_changes_nothing(store: Store) -> None:
    writer = store.open_session("bad")
    messages = conversation(1)
    for message in messages:
        writer.append(message)
    bad: Any = {"role": "user", "content": {1, 2}}
    with pytest.raises(TranscriptError, match="session 'bad': message 1"):
        writer.replace([messages[0], bad])
    with pytest.raises(TranscriptError, match="message 5"):
        writer.append(bad)
    writer.close()
    assert store.load("bad") == messages


def test_delete(store: Store) -> None:
    assert store.delete("gone") is False
    with closing(store.open_session("gone")) as writer:
        writer.append({"role": "user", "content": "x"})
    holder = store.open_session("gone")
    with pytest.raises(SessionLockedError, match="'gone'"):
        store.delete("gone")
    assert store.load("gone") == [{"role": "user", "content": "x"}]
    holder.close()
    assert store.delete("gone") is True
    assert store.load("gone") == []
    assert store.info("gone") is None
    assert store.sessions() == []
    assert store.delete("gone") is False
    with closing(store.open_session("gone")) as writer:
        writer.append({"role": "user", "content": "again"})
    assert store.load("gone") == [{"role": "user", "content": "again"}]


def test_ten_thousand_messages_load_intact(store: Store) -> None:
    more: Message = {"role": "user", "content": "more"}
    messages = [*conversation(4998), more]
    assert len(messages) == 10_000
    with closing(store.open_session("big")) as writer:
        writer.replace(messages[:5000])
        for message in messages[5000:]:
            writer.append(message)
    loaded = store.load("big")
    assert loaded == messages
    validate(loaded)
    assert store.info("big").message_count == 10_000  # type: ignore[union-attr]


# --------------------------------------------------------------------------- names


BAD_NAMES = ["../x", "a/b", "", "x" * 129, ".", "..", "a\\b", "a b", "a\n", "ä", "a\x00"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_invalid_session_names_are_refused_everywhere(store: Store, name: str) -> None:
    with pytest.raises(ValueError, match="invalid session name"):
        validate_session_name(name)
    for call in (store.open_session, store.load, store.info, store.delete):
        with pytest.raises(ValueError, match="invalid session name"):
            call(name)
    assert store.sessions() == []


def test_valid_session_names(store: Store, tmp_path: Path) -> None:
    for name in ("x" * 128, ".hidden", "...", "a.b-c_D9", "a.jsonl", "a.lock"):
        assert validate_session_name(name) == name
        with closing(store.open_session(name)) as writer:
            writer.append({"role": "user", "content": name})
    assert {s.name for s in store.sessions()} == {
        "x" * 128, ".hidden", "...", "a.b-c_D9", "a.jsonl", "a.lock"
    }
    assert store.load("a.lock") == [{"role": "user", "content": "a.lock"}]
    with pytest.raises(TypeError):
        validate_session_name(3)  # type: ignore[arg-type]


def test_jsonl_files_stay_inside_the_directory(tmp_path: Path) -> None:
    with JSONLStore(tmp_path / "d") as store:
        with store.open_session("s") as writer:
            writer.append({"role": "user", "content": "x"})
        with pytest.raises(ValueError):
            store.open_session("../outside")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    # The lock file stays: removing it on release would race with the next locker.
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["s.jsonl", "s.lock"]


# --------------------------------------------------------------------------- locks


def test_second_writer_in_one_process_is_refused(make_store: StoreFactory) -> None:
    store = make_store()
    writer = store.open_session("w")
    writer.append({"role": "user", "content": "mine"})
    with pytest.raises(SessionLockedError, match=r"session 'w' is already open for writing by "
                       r"another writer in this process.*store\.load\(\)"):
        store.open_session("w")
    other = make_store()  # a second store object on the same files
    with pytest.raises(SessionLockedError):
        other.open_session("w")
    assert other.load("w") == [{"role": "user", "content": "mine"}]
    other.open_session("different").close()  # other sessions are independent
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(StoreError, match="closed; cannot append"):
        writer.append({"role": "user", "content": "late"})
    again = other.open_session("w")
    again.append({"role": "assistant", "content": "theirs"})
    again.close()
    assert store.load("w")[-1] == {"role": "assistant", "content": "theirs"}


def test_store_close_releases_its_writers(make_store: StoreFactory) -> None:
    store = make_store()
    writer = store.open_session("c")
    writer.append({"role": "user", "content": "x"})
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        writer.append({"role": "user", "content": "y"})
    with pytest.raises(StoreError, match="closed"):
        store.open_session("c")
    fresh = make_store()
    fresh.open_session("c").close()
    assert fresh.load("c") == [{"role": "user", "content": "x"}]


HOLDER = """
import sys
from aimu.aio.store import JSONLStore, SQLiteStore
store = {spec}
writer = store.open_session("shared")
writer.append({{"role": "user", "content": "from the child"}})
print("ready", flush=True)
sys.stdin.readline()
"""


def _child(source: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(source)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def test_writer_in_another_process_blocks_writes_not_reads(
    kind: str, tmp_path: Path, store: Store
) -> None:
    with _child(HOLDER.format(spec=spec(kind, tmp_path))) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == "ready\n"
            with pytest.raises(SessionLockedError, match=f"by process {child.pid} "):
                store.open_session("shared")
            with pytest.raises(SessionLockedError):
                store.delete("shared")
            assert store.load("shared") == [{"role": "user", "content": "from the child"}]
            # kill -9: the OS releases the lock with the process.
            child.send_signal(signal.SIGKILL)
            child.wait()
        finally:
            if child.poll() is None:
                child.kill()
    assert child.returncode == -signal.SIGKILL
    with closing(store.open_session("shared")) as writer:
        writer.append({"role": "assistant", "content": "from the parent"})
    assert [m["content"] for m in store.load("shared")] == ["from the child", "from the parent"]


ACKER = """
import sys
from aimu.aio.store import JSONLStore, SQLiteStore
store = {spec}
writer = store.open_session("acked")
for i in range(10_000):
    writer.append({{"role": "user", "content": f"message {{i}}"}})
    print(i, flush=True)
"""


def test_appended_messages_survive_kill_9(kind: str, tmp_path: Path, store: Store) -> None:
    with _child(ACKER.format(spec=spec(kind, tmp_path))) as child:
        try:
            assert child.stdout is not None
            for _ in range(200):
                acknowledged = int(child.stdout.readline())
            child.send_signal(signal.SIGKILL)
            child.wait()
        finally:
            if child.poll() is None:
                child.kill()
    loaded = store.load("acked")
    assert len(loaded) > acknowledged
    assert loaded == [{"role": "user", "content": f"message {i}"} for i in range(len(loaded))]
    with closing(store.open_session("acked")) as writer:
        writer.append({"role": "user", "content": "after"})
    assert store.load("acked")[-1] == {"role": "user", "content": "after"}


# --------------------------------------------------------------------------- torn and corrupt


def _jsonl_session(tmp_path: Path, messages: list[Message]) -> Path:
    with JSONLStore(tmp_path / "j") as store, store.open_session("t") as writer:
        for message in messages:
            writer.append(message)
    return tmp_path / "j" / "t.jsonl"


@pytest.mark.parametrize(
    "tail", [b'{"role":"assistant","cont', b'{"role":"user"}garbage\n', b"\x00\x00\x00\x00"]
)
def test_jsonl_torn_last_line_is_ignored_then_repaired(tmp_path: Path, tail: bytes) -> None:
    messages = conversation(1)
    path = _jsonl_session(tmp_path, messages)
    intact = path.read_bytes()
    line = intact.count(b"\n") + 1
    path.write_bytes(intact + tail)
    with JSONLStore(tmp_path / "j") as store:
        torn = rf"t\.jsonl: ignoring a torn last record \(line {line}"
        with pytest.warns(RuntimeWarning, match=torn):
            assert store.load("t") == messages
        assert store.info("t").message_count == len(messages)  # type: ignore[union-attr]
        with pytest.warns(RuntimeWarning, match="torn"):
            writer = store.open_session("t")
        assert path.read_bytes() == intact  # cut off before anything is appended
        writer.append({"role": "user", "content": "next"})
        writer.close()
        assert store.load("t") == [*messages, {"role": "user", "content": "next"}]


def test_jsonl_corrupt_middle_line_is_a_format_error(tmp_path: Path) -> None:
    path = _jsonl_session(tmp_path, conversation(2))
    lines = path.read_bytes().split(b"\n")
    lines[3] = lines[3][:10]  # line 4: the first tool result
    path.write_bytes(b"\n".join(lines))
    with JSONLStore(tmp_path / "j") as store, pytest.raises(
        StoreFormatError, match=r"t\.jsonl line 4 is corrupt"
    ):
        store.load("t")


def test_jsonl_invalid_message_is_a_format_error_naming_the_line(tmp_path: Path) -> None:
    path = _jsonl_session(tmp_path, conversation(1))
    lines = path.read_bytes().split(b"\n")
    lines.insert(2, b'{"role":"banana","content":"x"}')
    path.write_bytes(b"\n".join(lines))
    with JSONLStore(tmp_path / "j") as store, pytest.raises(
        StoreFormatError, match=r"t\.jsonl line 3 .*unknown role 'banana'"
    ):
        store.load("t")


def test_jsonl_newer_format_version_is_refused(tmp_path: Path) -> None:
    path = _jsonl_session(tmp_path, conversation(1))
    header, rest = path.read_bytes().split(b"\n", 1)
    record = json.loads(header)
    assert record["aimu_meta"]["version"] == 1
    record["aimu_meta"]["version"] = 99
    path.write_bytes(json.dumps(record).replace(" ", "").encode() + b"\n" + rest)
    with JSONLStore(tmp_path / "j") as store:
        for call in (store.load, store.open_session, store.info):
            with pytest.raises(StoreFormatError, match=r"t\.jsonl has store format version 99"):
                call("t")


def test_jsonl_accepts_a_plain_transcript_file(tmp_path: Path) -> None:
    (tmp_path / "j").mkdir()
    messages = conversation(1)
    (tmp_path / "j" / "plain.jsonl").write_text("".join(json.dumps(m) + "\n" for m in messages))
    with JSONLStore(tmp_path / "j") as store:
        assert store.load("plain") == messages
        assert store.info("plain").message_count == len(messages)  # type: ignore[union-attr]


def test_jsonl_without_fsync_and_explicit_sync(tmp_path: Path) -> None:
    with JSONLStore(tmp_path / "fast", fsync=False) as store:
        with store.open_session("s") as writer:
            writer.append({"role": "user", "content": "x"})
            writer.sync()
        assert store.load("s") == [{"role": "user", "content": "x"}]
    with JSONLStore(tmp_path / "safe") as store, store.open_session("s") as writer:
        for i in range(50):
            writer.append({"role": "user", "content": str(i)})
        writer.sync()  # returns once the fsync thread caught up
        assert len(store.load("s")) == 50


def _sqlite_session(tmp_path: Path, messages: list[Message]) -> Path:
    path = tmp_path / "s.db"
    with SQLiteStore(path) as store, store.open_session("t") as writer:
        for message in messages:
            writer.append(message)
    return path


def _set_body(path: Path, seq: int, body: str) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE messages SET body = ? WHERE session = 't' AND seq = ?", (body, seq))
    conn.close()


def test_sqlite_corrupt_last_row_is_ignored_then_repaired(tmp_path: Path) -> None:
    messages = conversation(1)
    path = _sqlite_session(tmp_path, messages)
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO messages VALUES ('t', ?, 0, ?)", (len(messages), '{"role":"as'))
    conn.close()
    with SQLiteStore(path) as store:
        with pytest.warns(RuntimeWarning, match=rf"s\.db: session 't' row seq={len(messages)}"):
            assert store.load("t") == messages
        with pytest.warns(RuntimeWarning, match="torn"):
            writer = store.open_session("t")
        writer.append({"role": "user", "content": "next"})
        writer.close()
        assert store.load("t") == [*messages, {"role": "user", "content": "next"}]
        assert store.info("t").message_count == len(messages) + 1  # type: ignore[union-attr]


def test_sqlite_corrupt_middle_row_is_a_format_error(tmp_path: Path) -> None:
    path = _sqlite_session(tmp_path, conversation(2))
    _set_body(path, 2, "{not json")
    with SQLiteStore(path) as store, pytest.raises(
        StoreFormatError, match=r"s\.db: session 't' row seq=2 is corrupt"
    ):
        store.load("t")


def test_sqlite_invalid_message_is_a_format_error(tmp_path: Path) -> None:
    path = _sqlite_session(tmp_path, conversation(2))
    _set_body(path, 3, '{"role":"tool","content":"x","tool_call_id":"nope","name":"add"}')
    with SQLiteStore(path) as store, pytest.raises(
        StoreFormatError, match=r"row seq=3 is not a valid message.*'nope'"
    ):
        store.load("t")


def test_sqlite_newer_schema_is_refused(tmp_path: Path) -> None:
    path = _sqlite_session(tmp_path, conversation(1))
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version = 7")
    conn.close()
    with pytest.raises(StoreFormatError, match=r"s\.db has store schema version 7.*upgrade aimu"):
        SQLiteStore(path)


def test_stores_create_missing_directories(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "a" / "b" / "s.db") as store:
        assert store.sessions() == []
    with JSONLStore(tmp_path / "c" / "d") as jsonl:
        assert jsonl.sessions() == []
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError, match="cannot open SQLite store"):
        SQLiteStore(tmp_path / "file" / "s.db")
    with pytest.raises(StoreError, match="cannot create the JSONL store directory"):
        JSONLStore(tmp_path / "file" / "d")


def test_sqlite_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreFormatError, match=r"junk\.db is not a readable aimu SQLite store"):
        SQLiteStore(path)


KILLED_MID_WAL = """
import os, signal
from aimu.aio.store import SQLiteStore
store = SQLiteStore({path!r})
writer = store.open_session("t")
for i in range(40):
    writer.append({{"role": "user", "content": "m" * 300 + str(i)}})
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_sqlite_truncated_wal_loses_only_the_torn_transaction(tmp_path: Path) -> None:
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
    with SQLiteStore(path) as store:
        loaded = store.load("t")
        assert 30 <= len(loaded) < 40
        assert loaded == [{"role": "user", "content": "m" * 300 + str(i)} for i in
                          range(len(loaded))]
        assert store.info("t").message_count == len(loaded)  # type: ignore[union-attr]
        with store.open_session("t") as writer:
            writer.append({"role": "user", "content": "after"})
        assert store.load("t")[-1] == {"role": "user", "content": "after"}


def test_writes_after_an_error_leave_the_session_consistent(store: Store) -> None:
    """A message that cannot be encoded is refused before anything is written."""
    writer = store.open_session("e")
    writer.append({"role": "user", "content": "a"})
    unencodable: Any = {"role": "user", "content": object()}
    with pytest.raises(TranscriptError, match="session 'e': message 1 cannot be stored"):
        writer.append(unencodable)
    not_finite: Any = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1e999}}}
        ],
    }
    with pytest.raises(TranscriptError, match="message 1 cannot be stored as JSON"):
        writer.append(not_finite)  # it would make the session unreadable on load
    writer.append({"role": "assistant", "content": "b"})
    writer.close()
    assert [m["content"] for m in store.load("e")] == ["a", "b"]
    assert store.info("e").message_count == 2  # type: ignore[union-attr]


def test_sqlite_checkpoints_off_the_loop_and_close_removes_the_wal(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    store = SQLiteStore(path)
    with closing(store.open_session("c")) as writer:
        for i in range(600):  # enough commits to ask the background checkpointer twice
            writer.append({"role": "user", "content": str(i)})
    assert Path(f"{path}-wal").exists()
    store.close()  # joins the checkpoint thread; the last connection removes the WAL
    assert not Path(f"{path}-wal").exists()
    with SQLiteStore(path) as again:
        assert len(again.load("c")) == 600


def test_one_store_serves_writers_on_several_threads(store: Store) -> None:
    writers = [store.open_session(f"thread-{i}") for i in range(4)]

    def write(writer: SessionWriter) -> None:
        for n in range(150):
            writer.append({"role": "user", "content": f"{writer.session} {n}"})

    threads = [threading.Thread(target=write, args=(w,)) for w in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for writer in writers:
        writer.close()
    for i in range(4):
        assert [m["content"] for m in store.load(f"thread-{i}")] == [
            f"thread-{i} {n}" for n in range(150)
        ]


# --------------------------------------------------------------------------- platform


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_session_data_is_private_to_the_user_whatever_the_umask(
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
            with closing(store.open_session("private")) as writer:
                writer.append({"role": "user", "content": "secret"})
                writer.replace(conversation(1))
                writer.append({"role": "user", "content": "more"})
                modes = {
                    str(path.relative_to(root)): path.stat().st_mode & 0o777
                    for path in [root, *root.rglob("*")]
                }
        finally:
            store.close()
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
