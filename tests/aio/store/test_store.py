"""The store contract, run against every backend: SQLite, JSONL and PostgreSQL.

Round trips, metadata, replace, delete, names, the write lock across processes, kill -9,
the tool journal and state, and cancels landing during writes. What only one backend
has (files, torn records, modes) is in test_store_local.py and test_store_postgres.py.
"""

# Blocking file calls in these async tests are the point: they inspect the store's files.

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from aimu.aio.errors import SessionLockedError, StoreError, TranscriptError
from aimu.aio.store import (
    SessionInfo,
    SessionWriter,
    Store,
    ToolStart,
    validate_session_name,
)
from aimu.aio.transcript import Message, validate
from aimu.testing.script import Turn
from tests.aio.store.store_backends import KINDS, Backend, backend, conversation

StoreFactory = Callable[[], Store]
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def where(kind: str, tmp_path: Path) -> AsyncIterator[Backend]:
    """Where this test's stores live (a PostgreSQL schema of its own, dropped after)."""
    async with backend(kind, tmp_path) as location:
        yield location


@pytest.fixture
async def make_store(where: Backend) -> AsyncIterator[StoreFactory]:
    """Opens stores on one location (several may be open at once); closes them all."""
    opened: list[Store] = []

    def make() -> Store:
        store = where.make()
        opened.append(store)
        return store

    try:
        yield make
    finally:
        for store in opened:
            await store.aclose()


@pytest.fixture
def store(make_store: StoreFactory) -> Store:
    return make_store()


# --------------------------------------------------------------------------- round trips


async def test_round_trip_appends_in_order(store: Store) -> None:
    messages = conversation(3)
    async with await store.open_session("chat") as writer:
        assert await writer.load() == []
        for message in messages:
            await writer.append(message)
        assert await writer.load() == messages
    assert await store.load("chat") == messages
    assert await store.load("unknown") == []
    # Loaded messages are fresh objects: mutating them changes nothing stored.
    loaded = await store.load("chat")
    loaded[1]["content"] = "changed"
    assert await store.load("chat") == messages


async def test_writers_satisfy_the_protocols(store: Store) -> None:
    assert isinstance(store, Store)
    writer = await store.open_session("p")
    try:
        assert isinstance(writer, SessionWriter)
        assert writer.session == "p"
    finally:
        await writer.aclose()


async def test_reopening_continues_after_the_stored_messages(make_store: StoreFactory) -> None:
    messages = conversation(2)
    first = make_store()
    writer = await first.open_session("s")
    for message in messages[:3]:
        await writer.append(message)
    await writer.aclose()
    await first.aclose()
    second = make_store()
    writer = await second.open_session("s")
    assert await writer.load() == messages[:3]
    for message in messages[3:]:
        await writer.append(message)
    await writer.aclose()
    assert await make_store().load("s") == messages


async def test_metadata_tracks_created_updated_count_and_status(store: Store) -> None:
    assert await store.info("m") is None
    writer = await store.open_session("m")
    assert await store.info("m") is None  # opening alone writes nothing
    before = time.time()
    await writer.append({"role": "user", "content": "hi"})
    info = await store.info("m")
    assert info is not None
    assert info.name == "m"
    assert info.message_count == 1
    assert info.status is None
    assert before - 1 <= info.created <= info.updated <= time.time() + 1
    await writer.set_status("in_progress")
    await writer.append({"role": "assistant", "content": "hello"})
    await asyncio.sleep(0.01)  # so "updated" can move on coarse-grained file times
    await writer.set_status("completed")
    later = await store.info("m")
    assert later is not None
    assert later.message_count == 2
    assert later.status == "completed"
    assert later.created == pytest.approx(info.created)
    assert later.updated >= info.updated
    with pytest.raises(ValueError, match="unknown session status 'done'"):
        await writer.set_status("done")  # type: ignore[arg-type]
    assert await store.info("m") == later  # the refused status changed nothing
    await writer.aclose()
    # A status set before any message creates the session too.
    async with await store.open_session("early") as early:
        await early.set_status("interrupted")
    early_info = await store.info("early")
    assert early_info is not None
    assert (early_info.message_count, early_info.status) == (0, "interrupted")


async def test_sessions_lists_every_written_session_by_name(store: Store) -> None:
    for name, count in (("b", 2), ("a", 1), ("c.d-e_F", 3)):
        async with await store.open_session(name) as writer:
            for message in conversation(1)[:count]:
                await writer.append(message)
    async with await store.open_session("never-written"):
        pass
    listed = await store.sessions()
    assert [(s.name, s.message_count) for s in listed] == [("a", 1), ("b", 2), ("c.d-e_F", 3)]
    assert all(isinstance(s, SessionInfo) for s in listed)


async def test_replace_rewrites_atomically_and_keeps_metadata(make_store: StoreFactory) -> None:
    store = make_store()
    writer = await store.open_session("r")
    for message in conversation(3):
        await writer.append(message)
    await writer.set_status("interrupted")
    created = (await store.info("r")).created  # type: ignore[union-attr]
    replacement = conversation(1)
    await writer.replace(replacement)
    assert await writer.load() == replacement
    await writer.append({"role": "user", "content": "next"})
    expected = [*replacement, {"role": "user", "content": "next"}]
    assert await store.load("r") == expected
    info = await store.info("r")
    assert info is not None
    assert (info.message_count, info.status) == (len(expected), "interrupted")
    assert info.created == pytest.approx(created)
    await writer.replace([])
    assert await store.load("r") == []
    await writer.aclose()
    assert await make_store().load("r") == []


async def test_replace_with_a_non_json_message_changes_nothing(store: Store) -> None:
    writer = await store.open_session("bad")
    messages = conversation(1)
    for message in messages:
        await writer.append(message)
    bad: Any = {"role": "user", "content": {1, 2}}
    with pytest.raises(TranscriptError, match="session 'bad': message 1"):
        await writer.replace([messages[0], bad])
    with pytest.raises(TranscriptError, match="message 5"):
        await writer.append(bad)
    await writer.aclose()
    assert await store.load("bad") == messages


async def test_delete(store: Store) -> None:
    assert await store.delete("gone") is False
    async with await store.open_session("gone") as writer:
        await writer.append({"role": "user", "content": "x"})
    holder = await store.open_session("gone")
    with pytest.raises(SessionLockedError, match="'gone'"):
        await store.delete("gone")
    assert await store.load("gone") == [{"role": "user", "content": "x"}]
    await holder.aclose()
    assert await store.delete("gone") is True
    assert await store.load("gone") == []
    assert await store.info("gone") is None
    assert await store.sessions() == []
    assert await store.delete("gone") is False
    async with await store.open_session("gone") as writer:
        await writer.append({"role": "user", "content": "again"})
    assert await store.load("gone") == [{"role": "user", "content": "again"}]


async def test_ten_thousand_messages_load_intact(store: Store) -> None:
    more: Message = {"role": "user", "content": "more"}
    messages = [*conversation(4998), more]
    assert len(messages) == 10_000
    async with await store.open_session("big") as writer:
        await writer.replace(messages[:5000])
        for message in messages[5000:]:
            await writer.append(message)
    loaded = await store.load("big")
    assert loaded == messages
    validate(loaded)
    assert (await store.info("big")).message_count == 10_000  # type: ignore[union-attr]


# --------------------------------------------------------------------------- names


BAD_NAMES = ["../x", "a/b", "", "x" * 129, ".", "..", "a\\b", "a b", "a\n", "ä", "a\x00"]


@pytest.mark.parametrize("name", BAD_NAMES)
async def test_invalid_session_names_are_refused_everywhere(store: Store, name: str) -> None:
    with pytest.raises(ValueError, match="invalid session name"):
        validate_session_name(name)
    calls = (store.open_session, store.load, store.info, store.delete, store.load_state,
             store.tool_starts)
    for call in calls:
        with pytest.raises(ValueError, match="invalid session name"):
            await call(name)
    assert await store.sessions() == []


async def test_valid_session_names(store: Store, tmp_path: Path) -> None:
    for name in ("x" * 128, ".hidden", "...", "a.b-c_D9", "a.jsonl", "a.lock"):
        assert validate_session_name(name) == name
        async with await store.open_session(name) as writer:
            await writer.append({"role": "user", "content": name})
    assert {s.name for s in await store.sessions()} == {
        "x" * 128, ".hidden", "...", "a.b-c_D9", "a.jsonl", "a.lock"
    }
    assert await store.load("a.lock") == [{"role": "user", "content": "a.lock"}]
    with pytest.raises(TypeError):
        validate_session_name(3)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- locks


async def test_second_writer_in_one_process_is_refused(make_store: StoreFactory) -> None:
    store = make_store()
    writer = await store.open_session("w")
    await writer.append({"role": "user", "content": "mine"})
    with pytest.raises(SessionLockedError, match=r"session 'w' is already open for writing by "
                       r"another writer in this process.*store\.load\(\)"):
        await store.open_session("w")
    other = make_store()  # a second store object on the same files
    with pytest.raises(SessionLockedError):
        await other.open_session("w")
    assert await other.load("w") == [{"role": "user", "content": "mine"}]
    await (await other.open_session("different")).aclose()  # other sessions are independent
    await writer.aclose()
    await writer.aclose()  # idempotent
    with pytest.raises(StoreError, match="closed; cannot append"):
        await writer.append({"role": "user", "content": "late"})
    again = await other.open_session("w")
    await again.append({"role": "assistant", "content": "theirs"})
    await again.aclose()
    assert (await store.load("w"))[-1] == {"role": "assistant", "content": "theirs"}


async def test_store_close_releases_its_writers(make_store: StoreFactory) -> None:
    store = make_store()
    writer = await store.open_session("c")
    await writer.append({"role": "user", "content": "x"})
    await store.aclose()
    await store.aclose()
    with pytest.raises(StoreError, match="closed"):
        await writer.append({"role": "user", "content": "y"})
    with pytest.raises(StoreError, match="closed"):
        await store.open_session("c")
    fresh = make_store()
    await (await fresh.open_session("c")).aclose()
    assert await fresh.load("c") == [{"role": "user", "content": "x"}]


HOLDER = """
import asyncio, sys
from aimu import aio

async def main():
    store = {spec}
    writer = await store.open_session("shared")
    await writer.append({{"role": "user", "content": "from the child"}})
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)

asyncio.run(main())
"""


def _child(source: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(source)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


async def test_writer_in_another_process_blocks_writes_not_reads(
    where: Backend, store: Store
) -> None:
    with _child(HOLDER.format(spec=where.spec)) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == "ready\n"
            with pytest.raises(SessionLockedError, match=f"by process {child.pid} "):
                await store.open_session("shared")
            with pytest.raises(SessionLockedError):
                await store.delete("shared")
            assert await store.load("shared") == [{"role": "user", "content": "from the child"}]
            # kill -9: the OS releases the lock with the process.
            child.send_signal(signal.SIGKILL)
            child.wait()
        finally:
            if child.poll() is None:
                child.kill()
    assert child.returncode == -signal.SIGKILL
    async with await store.open_session("shared") as writer:
        await writer.append({"role": "assistant", "content": "from the parent"})
    contents = [m["content"] for m in await store.load("shared")]
    assert contents == ["from the child", "from the parent"]


ACKER = """
import asyncio
from aimu import aio

async def main():
    store = {spec}
    writer = await store.open_session("acked")
    for i in range(10_000):
        await writer.append({{"role": "user", "content": f"message {{i}}"}})
        print(i, flush=True)

asyncio.run(main())
"""


async def test_appended_messages_survive_kill_9(where: Backend, store: Store) -> None:
    with _child(ACKER.format(spec=where.spec)) as child:
        try:
            assert child.stdout is not None
            for _ in range(200):
                acknowledged = int(child.stdout.readline())
            child.send_signal(signal.SIGKILL)
            child.wait()
        finally:
            if child.poll() is None:
                child.kill()
    loaded = await store.load("acked")
    assert len(loaded) > acknowledged
    assert loaded == [{"role": "user", "content": f"message {i}"} for i in range(len(loaded))]
    async with await store.open_session("acked") as writer:
        await writer.append({"role": "user", "content": "after"})
    assert (await store.load("acked"))[-1] == {"role": "user", "content": "after"}


# --------------------------------------------------------------------------- torn and corrupt


async def test_writes_after_an_error_leave_the_session_consistent(store: Store) -> None:
    """A message that cannot be encoded is refused before anything is written."""
    writer = await store.open_session("e")
    await writer.append({"role": "user", "content": "a"})
    unencodable: Any = {"role": "user", "content": object()}
    with pytest.raises(TranscriptError, match="session 'e': message 1 cannot be stored"):
        await writer.append(unencodable)
    not_finite: Any = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1e999}}}
        ],
    }
    with pytest.raises(TranscriptError, match="message 1 cannot be stored as JSON"):
        await writer.append(not_finite)  # it would make the session unreadable on load
    await writer.append({"role": "assistant", "content": "b"})
    await writer.aclose()
    assert [m["content"] for m in await store.load("e")] == ["a", "b"]
    assert (await store.info("e")).message_count == 2  # type: ignore[union-attr]


# --------------------------------------------------------------------------- platform




# --------------------------------------------------------------------------- journal and state


async def test_tool_journal_records_starts_in_order_and_survives_replace(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    assert await store.tool_starts("j") == []
    async with await store.open_session("j") as writer:
        before = time.time()
        await writer.record_tool_start("call_1", "charge", {"card": "x", "amount": 1.5})
        await writer.record_tool_start("call_2", "notify", ["a", None])
        await writer.replace(conversation(1))
        await writer.record_tool_start("call_3", "noop", {})
    starts = await make_store().tool_starts("j")
    assert [(s.call_id, s.name, s.arguments) for s in starts] == [
        ("call_1", "charge", {"card": "x", "amount": 1.5}),
        ("call_2", "notify", ["a", None]),
        ("call_3", "noop", {}),
    ]
    assert all(isinstance(s, ToolStart) and s.started >= before - 1 for s in starts)
    assert await store.load("j") == conversation(1)  # the journal is not in the transcript
    async with await store.open_session("j") as writer:
        with pytest.raises(ValueError, match="session 'j': the arguments of tool call 'bad'"):
            await writer.record_tool_start("bad", "f", {"x": float("nan")})
    assert len(await store.tool_starts("j")) == 3
    assert await store.delete("j") is True
    assert await store.tool_starts("j") == []


async def test_state_is_saved_whole_and_loaded_back(make_store: StoreFactory) -> None:
    store = make_store()
    assert await store.load_state("s") == {}
    pending = {"pending": [{"call_id": "c1", "tool": "pay", "arguments": {"n": 1}}],
               "decisions": {"c0": {"approved": False, "reason": "too much — ✓"}}}
    async with await store.open_session("s") as writer:
        await writer.save_state({"old": True})
        await writer.append({"role": "user", "content": "x"})
        await writer.save_state(pending)
        await writer.set_status("paused")
        await writer.replace(conversation(1))
        with pytest.raises(ValueError, match="session 's': the state cannot be stored"):
            await writer.save_state({"bad": {1, 2}})
        with pytest.raises(TypeError, match="a state is a dict"):
            await writer.save_state([1])  # type: ignore[arg-type]
    fresh = make_store()
    assert await fresh.load_state("s") == pending
    info = await fresh.info("s")
    assert info is not None and info.status == "paused"
    assert await fresh.load("s") == conversation(1)
    assert await fresh.delete("s") is True
    assert await fresh.load_state("s") == {}


async def test_a_cancel_landing_during_a_write_never_loses_it(store: Store) -> None:
    """The write completes and then the cancel is raised, wherever it lands."""
    writer = await store.open_session("c")
    written: list[Message] = []
    for attempt in range(30):
        message: Message = {"role": "user", "content": f"m{attempt}"}
        task = asyncio.ensure_future(writer.append(message))
        for _ in range(attempt % 6):  # land the cancel after 0..5 event-loop passes
            await asyncio.sleep(0)
        cancelled = task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            assert cancelled
        if cancelled and not task.cancelled():
            raise AssertionError("a cancelled write must re-raise the cancel")
        # Cancelled before it started, the write may not have happened; once it ran, it did.
        stored = await writer.load()
        if stored[-1:] == [message]:
            written.append(message)
    assert await writer.load() == written
    assert len(written) >= 25
    await writer.aclose()


async def test_concurrent_appends_of_one_writer_keep_their_call_order(store: Store) -> None:
    async with await store.open_session("o") as writer:
        messages: list[Message] = [{"role": "user", "content": str(i)} for i in range(40)]
        await asyncio.gather(*(writer.append(m) for m in messages))
        assert await writer.load() == messages


async def _noop_step(n: int) -> str:
    """One step."""
    await asyncio.sleep(0)
    return f"step {n}"


@pytest.mark.parametrize("passes", [*range(20), 30, 60, 120, 250, 500])
async def test_a_cancel_at_any_point_of_an_agent_run_leaves_store_and_memory_equal(
    store: Store, passes: int
) -> None:
    """Wherever the cancel lands (loop passes stand in for await points), every message
    recorded in memory is stored, the settled transcript included."""
    from aimu import aio
    from aimu.testing.scripted import ScriptedModel, tool_turn

    script = [*(tool_turn(("_noop_step", {"n": n})) for n in range(6)), Turn(text="done")]
    agent = aio.Agent(ScriptedModel(script), tools=[_noop_step], store=store, session="sweep")
    await agent.open()
    handle = aio.RunHandle.start(agent.run("go"))
    for _ in range(passes):
        await asyncio.sleep(0)
    handle.cancel()
    try:
        assert await handle == "done"  # the cancel came after the end
    except asyncio.CancelledError:
        assert handle.status == "cancelled" and agent.last_status == "cancelled"
    memory = agent.model_client.messages
    validate(memory)
    assert await store.load("sweep") == memory
    info = await store.info("sweep")
    assert info is not None and info.status == agent.last_status
    await agent.aclose()
