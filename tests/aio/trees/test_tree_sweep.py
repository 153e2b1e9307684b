"""The stop sweep over a three-level tree: a cancel, an interrupt and a consumer that
leaves the stream at every event of a run of root -> mid -> leaf -> fetch, with the
invariants checked at every level.

After each stop: every level's stored transcript is valid with no call left open; each
agent call's result in its caller's transcript agrees with how the agent's session
ended; every level that started also finished (its RunFinished reached the handle);
no task or stream is left behind; and (every third stop) the same tree goes on.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from aimu import aio
from aimu.aio.events import Event, HandleFinished, RunFinished, RunStarted
from aimu.aio.store import Store
from aimu.aio.transcript import Message
from tests.aio.trees.tree_support import ANSWERS, Tree, check_valid, tool_results

STATUS_OF = {"[cancelled: agent": "cancelled", "[interrupted: agent": "interrupted"}


async def check_levels(store: Store) -> dict[str, list[Message]]:
    """Every level valid; each agent call's result says how its agent's session ended."""
    infos = {info.name: info for info in await store.sessions()}
    levels = {name: await store.load(name) for name in infos}
    for name, messages in levels.items():
        check_valid(messages)
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            for call in message.get("tool_calls", ()):
                callee = f"{name}--{index}.{call['id']}"
                if callee not in infos:
                    continue  # the call never started its agent
                [result] = [r for r in tool_results_for(messages, call["id"])]
                ended = next((s for p, s in STATUS_OF.items() if result.startswith(p)),
                             "completed")
                if result == "[cancelled: the run was stopped before this call finished]":
                    ended = "cancelled"
                assert infos[callee].status == ended, (name, result, infos[callee].status)
    return levels


def tool_results_for(messages: list[Message], call_id: str) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "tool"
            and m["tool_call_id"] == call_id]


def every_level_closed(events: list[Event]) -> None:
    """Each run that started (by agent and path) finished, once."""
    started = sorted((e.source, e.path) for e in events if isinstance(e, RunStarted))
    finished = sorted((e.source, e.path) for e in events if isinstance(e, RunFinished))
    assert started == finished, (started, finished)


async def stopped_at(tmp_path: Path, k: int, mode: str) -> tuple[str | None, ...]:
    """Stop the tree at its ``k``-th event; how each level's session ended (top first)."""
    store = aio.SQLiteStore(tmp_path / f"{mode}-{k}.db")
    tree = Tree(store=store, session="top")
    try:
        seen: list[Event] = []
        handle: aio.RunHandle[str] | None = None

        def hear(event: Event) -> None:
            seen.append(event)
            if len(seen) == k and mode != "break":
                assert handle is not None
                handle.cancel("sweep") if mode == "cancel" else handle.interrupt()

        async def read_until_k() -> None:
            """The consumer leaves the stream at the k-th event (a break)."""
            read = 0
            async for _ in tree.root.run("go", stream=True):
                read += 1
                if read == k:
                    break

        run = read_until_k() if mode == "break" else tree.root.run("go")
        handle = aio.RunHandle.start(run)
        handle.add_listener(hear)
        events = handle.events()
        outcome = await handle.wait()
        heard = [event async for event in events]
        statuses = {"cancel": ("cancelled", "completed"), "break": ("completed",),
                    "interrupt": ("interrupted", "completed")}
        assert outcome.status in statuses[mode], (k, outcome)
        if mode == "break":  # the stream left settles the run a loop turn later
            leaving = tree.root._leaving
            if leaving is not None:
                await asyncio.wait((leaving,))
            assert tree.root.last_status in ("cancelled", "completed"), k
            every_level_closed(seen)
        else:
            every_level_closed(heard)
            assert isinstance(heard[-1], HandleFinished)
        await check_levels(store)
        ended = tuple(info.status for info in sorted(
            await store.sessions(), key=lambda info: info.name.count("--")))
        for model in tree.models.values():
            assert model.open_streams == 0  # type: ignore[attr-defined]
        assert asyncio.all_tasks() == {asyncio.current_task()}
        if k % 3 == 0:  # every third: the same tree goes on (each level's model takes it)
            assert await tree.root.run("again") == ANSWERS["root"], k
            levels = await check_levels(store)
            assert tool_results(levels["top"])[-1] == ANSWERS["mid"]
        return ended
    finally:
        await tree.root.aclose()
        await store.aclose()


@pytest.mark.parametrize("mode", ["cancel", "interrupt", "break"])
async def test_a_stop_at_every_event_of_a_three_level_tree(tmp_path: Path, mode: str) -> None:
    whole = Tree()
    handle = aio.RunHandle.start(whole.root.run("go"))
    heard = [event async for event in handle.events()]
    assert await handle == ANSWERS["root"]
    every_level_closed(heard)
    assert isinstance(heard[-1], HandleFinished) and len(heard) >= 30
    stopped = "interrupted" if mode == "interrupt" else "cancelled"
    # A consumer leaving is a cancel by another way: every other event is enough.
    every = range(1, len(heard), 2 if mode == "break" else 1)
    outcomes = {await stopped_at(tmp_path, k, mode) for k in every}
    # The stops landed at every level: before the agents below started, with all three
    # stopped, with the leaf done and the others stopped, with only the top stopped.
    assert {
        (stopped,), (stopped, stopped, stopped), (stopped, stopped, "completed"),
        (stopped, "completed", "completed"),
    } <= outcomes, outcomes
