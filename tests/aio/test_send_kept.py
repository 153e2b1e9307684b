"""A send kept in the store before it is answered (issue 42 item 3): ``send_kept`` is
accepted once the run took it, refused (and taken back) when the run did not, and never
both: an input a run joined meanwhile is accepted whatever the delivery said."""

from __future__ import annotations

from pathlib import Path

import pytest

from aimu import aio
from aimu.aio.steering import Steer, send_kept
from aimu.aio.store import SQLiteStore


@pytest.fixture
async def store(tmp_path: Path) -> SQLiteStore:
    return aio.SQLiteStore(tmp_path / "s.db")


async def test_taken_stays_pending_until_joined_refused_is_taken_back(store: SQLiteStore) -> None:
    seen: list[Steer] = []

    async def takes(kept: Steer) -> bool:
        seen.append(kept)
        return True

    assert await send_kept(store, "s", Steer("send", text="hi"), takes)
    [pending] = await store.inputs("s")
    assert pending.id == seen[0].input_id
    assert pending.message == {"role": "user", "content": "hi", "aimu_sent": pending.id}

    async def refuses(kept: Steer) -> bool:
        return False

    assert not await send_kept(store, "s", Steer("send", text="late"), refuses)
    assert [p.id for p in await store.inputs("s")] == [pending.id]  # only the taken one
    await store.aclose()


async def test_a_delivery_that_fails_is_taken_back_unless_a_run_joined_it(
    store: SQLiteStore,
) -> None:
    async def fails(kept: Steer) -> bool:
        raise aio.ControlError("Redis went away", url="redis://x")

    with pytest.raises(aio.ControlError):
        await send_kept(store, "s", Steer("send", text="lost"), fails)
    assert await store.inputs("s") == []

    writer = await store.open_session("s")

    async def joined_then_fails(kept: Steer) -> bool:
        assert await writer.join_input(kept.message())  # the run took it meanwhile
        raise aio.ControlError("no answer in time", url="redis://x")

    async def joined_then_refused(kept: Steer) -> bool:
        assert await writer.join_input(kept.message())
        return False

    assert await send_kept(store, "s", Steer("send", text="one"), joined_then_fails)
    assert await send_kept(store, "s", Steer("send", text="two"), joined_then_refused)
    await writer.aclose()
    assert [m["content"] for m in await store.load("s")] == ["one", "two"]
    assert await store.inputs("s") == []
    await store.aclose()


async def test_asend_keeps_nothing_without_a_run_and_is_send_without_a_store(
    store: SQLiteStore,
) -> None:
    async with aio.Agent(aio.client("test"), store=store, session="s") as agent:
        assert not await agent.asend("nobody listens")
    assert await store.inputs("s") == []
    agent = aio.Agent(aio.client("test", delay=0.01))
    handle = aio.RunHandle.start(agent.run("a long story"))
    async for event in handle.events():
        if isinstance(event, aio.TextChunk):
            assert await agent.asend("shorter")
            break
    await handle
    assert [m.get("aimu_sent") for m in agent.messages if m["role"] == "user"] == [None, True]
    await store.aclose()


async def test_a_reset_drops_the_text_sent_to_earlier_runs(store: SQLiteStore) -> None:
    await store.add_input("s", {"role": "user", "content": "old", "aimu_sent": "i1"})
    async with aio.Agent(aio.client("test"), store=store, session="s") as agent:
        await agent.run("new start", reset=True)
        assert [m["content"] for m in agent.messages if m["role"] == "user"] == ["new start"]
    assert await store.inputs("s") == []
    await store.aclose()


async def test_text_kept_for_a_session_joins_its_next_run_once(store: SQLiteStore) -> None:
    await store.add_input("s", {"role": "user", "content": "kept", "aimu_sent": "i1"})
    for task in ("first", "second"):
        async with aio.Agent(aio.client("test"), store=store, session="s") as agent:
            await agent.run(task)
    users = [m["content"] for m in await store.load("s") if m["role"] == "user"]
    assert users == ["first", "kept", "second"]
    await store.aclose()
