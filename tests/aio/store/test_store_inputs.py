"""Pending inputs (text sent to a session's run, stored before the send is answered) on
every store backend: kept without the write lock, joined to the transcript exactly once
and atomically, taken back only while still pending (issue 42 item 3)."""

from __future__ import annotations

import pytest

from aimu.aio.store import Store
from aimu.aio.transcript import UserMessage
from tests.aio.store.store_backends import Backend
from tests.aio.store.test_store_runs import store, where

__all__ = ["store", "where"]  # the fixtures: each backend, a store on it


def sent(input_id: str, text: str) -> UserMessage:
    return {"role": "user", "content": text, "aimu_sent": input_id}


async def test_inputs_are_kept_joined_once_and_taken_back_while_pending(
    store: Store, where: Backend
) -> None:
    writer = await store.open_session("s")
    try:
        await writer.append({"role": "user", "content": "task"})
        other = where.make()  # another process's store: no write lock needed to send
        try:
            await other.add_input("s", sent("i1", "first"))
            await other.add_input("s", sent("i2", "second"))
            await other.add_input("s", sent("i1", "first"))  # the same id: nothing more
        finally:
            await other.aclose()
        assert [(p.id, p.message["content"]) for p in await store.inputs("s")] == [
            ("i1", "first"), ("i2", "second")]
        assert await writer.join_input(sent("i1", "first"))
        assert not await writer.join_input(sent("i1", "first"))  # once
        assert [p.id for p in await store.inputs("s")] == ["i2"]
        assert await store.drop_input("s", "i2")
        assert not await store.drop_input("s", "i2")
        assert not await writer.join_input(sent("i2", "second"))  # taken back: never joins
        assert not await store.drop_input("s", "i1")  # joined: not to be taken back
        await writer.append({"role": "assistant", "content": "ok"})
        assert await store.inputs("s") == []
    finally:
        await writer.aclose()
    assert await store.load("s") == [
        {"role": "user", "content": "task"}, sent("i1", "first"),
        {"role": "assistant", "content": "ok"},
    ]
    await store.add_input("s", sent("i3", "late"))
    assert await store.delete("s")
    assert await store.inputs("s") == []


async def test_a_pending_input_must_be_a_sent_user_message(store: Store) -> None:
    with pytest.raises(ValueError, match="aimu_sent is its id"):
        await store.add_input("s", {"role": "user", "content": "no id"})
    with pytest.raises(ValueError, match="input id"):
        await store.add_input("s", sent("../x", "bad id"))
    assert await store.inputs("s") == []


async def test_a_delete_refused_while_a_writer_holds_the_session_keeps_its_inputs(
    store: Store,
) -> None:
    from aimu.aio.errors import SessionLockedError

    writer = await store.open_session("s")
    try:
        await writer.append({"role": "user", "content": "task"})
        await store.add_input("s", sent("i1", "kept"))
        with pytest.raises(SessionLockedError):
            await store.delete("s")
        assert [p.id for p in await store.inputs("s")] == ["i1"]
    finally:
        await writer.aclose()
