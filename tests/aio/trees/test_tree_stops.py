"""One stop for the whole tree: cancel, interrupt, stop(grace), a deadline and budgets
reach every level, and each level's transcript stays valid and says what happened."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aimu import aio
from aimu.aio.agent import INTERRUPTED
from aimu.aio.events import RunFinished, ToolResult
from aimu.aio.store import Store
from aimu.aio.transcript import CANCELLED_RESULT, Message
from tests.aio.trees.tree_support import ANSWERS, Tree, check_valid, tool_results


async def transcripts(store: Store) -> dict[str, list[Message]]:
    """Every stored session's transcript, each checked valid; by level (root, mid, leaf)."""
    found: dict[str, list[Message]] = {}
    for info in await store.sessions():
        messages = await store.load(info.name)
        check_valid(messages)
        found[("root", "mid", "leaf")[info.name.count("--")]] = messages
    return found


class Blocking:
    """The leaf's tool: it waits until released (or cancelled)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = False
        self.calls = 0
        self.both = asyncio.Event()  # a second call is in the tool too

    async def __call__(self) -> str:
        self.calls += 1
        self.started.set()
        if self.calls == 2:
            self.both.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return "the page"


@pytest.fixture
async def blocking(tmp_path: Path) -> AsyncIterator[tuple[Tree, Blocking, Store]]:
    """A stored tree whose leaf's tool blocks; closed at teardown."""
    store = aio.SQLiteStore(tmp_path / "tree.db")
    fetch = Blocking()
    tree = Tree(given_fetch=aio.tool(fetch, name="fetch"), store=store, session="top")
    try:
        yield tree, fetch, store
    finally:
        await tree.root.aclose()
        await store.aclose()


def models_closed(tree: Tree) -> None:
    for model in tree.models.values():
        assert model.open_streams == 0  # type: ignore[attr-defined]


async def test_a_cancel_reaches_the_grandchild_and_every_level_says_so(
    blocking: tuple[Tree, Blocking, Store]
) -> None:
    tree, fetch, store = blocking
    handle = aio.RunHandle.start(tree.root.run("go"))
    await fetch.started.wait()
    assert handle.cancel("stop all")
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert fetch.cancelled and handle.status == "cancelled"
    levels = await transcripts(store)
    assert tool_results(levels["leaf"]) == [CANCELLED_RESULT]
    mid_result = tool_results(levels["mid"])
    assert len(mid_result) == 1 and mid_result[0].startswith(
        "[cancelled: agent 'leaf' was stopped; 1 tool call made; its last text: asking fetch"
    )
    root_result = tool_results(levels["root"])
    assert len(root_result) == 1 and root_result[0].startswith(
        "[cancelled: agent 'mid' was stopped; 1 tool call made; its last text: asking leaf"
    )
    assert tool_results(tree.root.messages) == root_result
    statuses = {info.name.count("--"): info.status for info in await store.sessions()}
    assert statuses == {0: "cancelled", 1: "cancelled", 2: "cancelled"}
    # Each level's record says it was cancelled, why, and inside which run.
    records = {info.name.count("--"): await store.runs(session=info.name)
               for info in await store.sessions()}
    [root], [mid], [leaf] = records[0], records[1], records[2]
    assert [(r.status, r.reason) for r in (root, mid, leaf)] == [("cancelled", "stop all")] * 3
    assert (root.parent, mid.parent, leaf.parent) == (None, root.id, mid.id)
    models_closed(tree)
    # The same session goes on: every level's transcript is one a model takes.
    fetch.release.set()
    assert await tree.root.run("again") == ANSWERS["root"]


async def test_an_interrupt_stops_each_level_at_its_next_boundary(
    blocking: tuple[Tree, Blocking, Store]
) -> None:
    tree, fetch, store = blocking
    handle = aio.RunHandle.start(tree.root.run("go"))
    await fetch.started.wait()
    assert handle.interrupt()
    fetch.release.set()  # the step in flight finishes, then each level stops
    assert await handle == INTERRUPTED
    assert handle.status == "interrupted" and not fetch.cancelled
    levels = await transcripts(store)
    assert tool_results(levels["leaf"]) == ["the page"]
    assert tool_results(levels["mid"])[0].startswith(
        "[interrupted: agent 'leaf' was interrupted before it finished; 1 tool call made"
    )
    assert tool_results(levels["root"])[0].startswith(
        "[interrupted: agent 'mid' was interrupted before it finished;"
    )
    # Each level made the one request it had made before the interrupt.
    for level in ("root", "mid", "leaf"):
        assert len(tree.models[level].requests) == 1, level  # type: ignore[attr-defined]
    models_closed(tree)


async def test_stop_with_grace_then_cancels_and_a_deadline_times_out(
    blocking: tuple[Tree, Blocking, Store]
) -> None:
    tree, fetch, store = blocking
    handle = aio.RunHandle.start(tree.root.run("go"))
    await fetch.started.wait()
    assert await handle.stop(grace=0.01) == "cancelled"  # the leaf's tool never ends
    assert fetch.cancelled
    await transcripts(store)
    fetch.started.clear()
    fetch.cancelled = False
    timed = aio.RunHandle.start(tree.root.run("again"), timeout=30)
    await fetch.started.wait()
    timed.reschedule(asyncio.get_running_loop().time())  # the deadline, now
    with pytest.raises(TimeoutError):
        await timed
    assert timed.status == "timed_out" and fetch.cancelled
    levels = await transcripts(store)
    assert tool_results(levels["root"])[-1].startswith("[cancelled: agent 'mid'")
    statuses = sorted(info.status or "" for info in await store.sessions())
    assert statuses.count("timed_out") >= 2, statuses
    models_closed(tree)


async def test_a_childs_own_limit_ends_it_and_the_caller_reads_that() -> None:
    tree = Tree()
    limited_leaf = aio.Agent(
        tree.models["leaf"], tree.leaf.tools, name="leaf", limits=aio.UsageLimits(requests=1)
    )
    mid = aio.Agent(tree.models["mid"], [limited_leaf.as_tool()], name="mid")
    root = aio.Agent(tree.models["root"], [mid.as_tool()], name="root")
    events = [e async for e in root.run("go", stream=True)]
    assert root.last_status == "completed" and root.last_run is not None
    assert root.last_run.reply == ANSWERS["root"]
    [mid_saw] = [e for e in events if isinstance(e, ToolResult) and e.source == "mid"]
    assert mid_saw.is_error and mid_saw.content.startswith(
        "[limited: agent 'leaf' stopped at a limit (the run's requests limit of 1 would be "
        "crossed (2)); 1 tool call made; its last text: asking fetch]"
    )
    assert tree.fetched == 1
    assert tool_results(root.messages) == [ANSWERS["mid"]]


async def test_a_budget_is_counted_across_the_tree(tmp_path: Path) -> None:
    store = aio.SQLiteStore(tmp_path / "tree.db")
    tree = Tree(store=store, session="top")
    try:
        handle = aio.RunHandle.start(
            tree.root.run("go", limits=aio.UsageLimits(requests=3))
        )
        await handle
        assert handle.status == "limited"
        run = tree.root.last_run
        assert run is not None and run.status == "limited"
        assert run.spend is not None and run.spend.requests == 3  # root 1, mid 1, leaf 1
        assert run.limit == "the run's requests limit of 3 would be crossed (4)"
        levels = await transcripts(store)
        assert tool_results(levels["mid"])[0].startswith(
            "[limited: agent 'leaf' stopped at a limit (the parent's requests limit of 3 "
            "would be crossed (4))"
        )
        assert tool_results(levels["root"])[0].startswith("[limited: agent 'mid' stopped")
        for level in ("root", "mid", "leaf"):
            assert len(tree.models[level].requests) == 1, level  # type: ignore[attr-defined]
    finally:
        await tree.root.aclose()
        await store.aclose()


async def test_side_by_side_calls_are_each_stopped_and_recorded(tmp_path: Path) -> None:
    """Two calls of the same agent in one turn run side by side, in two sessions; a
    cancel stops both and the caller records each."""
    from aimu.testing.script import ScriptedCall, Turn
    from aimu.testing.scripted import ScriptedModel

    store = aio.SQLiteStore(tmp_path / "pair.db")
    fetch = Blocking()
    tree = Tree(given_fetch=aio.tool(fetch, name="fetch"))
    root = aio.Agent(ScriptedModel([Turn(tool_calls=[
        ScriptedCall("leaf", {"task": "a"}), ScriptedCall("leaf", {"task": "b"}),
    ])]), [tree.leaf.as_tool()], name="root", concurrent_tools=True, store=store,
        session="pair")
    try:
        handle = aio.RunHandle.start(root.run("go"))
        await fetch.both.wait()  # both calls are in their tools: the provable point
        handle.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handle
        levels = {info.name: await store.load(info.name) for info in await store.sessions()}
        assert len(levels) == 3
        for messages in levels.values():
            check_valid(messages)
        results = tool_results(levels["pair"])
        assert len(results) == 2 and all(r.startswith("[cancelled: agent 'leaf'") for r in results)
    finally:
        await root.aclose()
        await store.aclose()


async def test_the_callers_wall_limit_ends_the_tree_limited(tmp_path: Path) -> None:
    store = aio.SQLiteStore(tmp_path / "wall.db")
    fetch = Blocking()
    tree = Tree(given_fetch=aio.tool(fetch, name="fetch"), store=store, session="top")
    try:
        handle = aio.RunHandle.start(tree.root.run("go", limits=aio.UsageLimits(wall=0.2)))
        assert await handle is not None
        assert handle.status == "limited" and fetch.cancelled
        assert tree.root.last_run is not None and tree.root.last_run.stop_reason == "limit:wall"
        levels = await transcripts(store)
        assert tool_results(levels["root"])[0].startswith(("[cancelled: agent 'mid'",
                                                           "[limited: agent 'mid'"))
    finally:
        await tree.root.aclose()
        await store.aclose()


async def test_an_interrupt_cuts_a_grandchilds_retry_wait_short() -> None:
    """The leaf's request fails with a 503 and Retry-After: 50; an interrupt at the top,
    once the leaf waits to retry, ends that wait at once: no second request is made."""
    from collections.abc import Mapping
    from typing import Any

    from aimu.aio.events import ModelRetry
    from aimu.testing.script import Turn
    from aimu.testing.server import LoopbackServer
    from tests.aio.trees.tree_support import level_script

    mid_script = level_script("leaf", "fetch", ANSWERS["mid"])
    root_script = level_script("mid", "research", ANSWERS["root"])

    def script(body: Mapping[str, Any]) -> Turn:
        offered = [t["function"]["name"] for t in body.get("tools") or ()]
        if offered == ["mid"]:
            return root_script(body)
        if offered == ["leaf"]:
            return mid_script(body)
        return Turn(fault="http_503", retry_after="50")

    async with LoopbackServer(script) as server:
        def model() -> aio.ModelClient:
            return aio.client("openai:m", base_url=server.openai_base_url, api_key="sk-test")

        leaf = aio.Agent(model(), name="leaf")
        mid = aio.Agent(model(), [leaf.as_tool()], name="mid")
        root = aio.Agent(model(), [mid.as_tool()], name="root")
        handle = aio.RunHandle.start(root.run("go"))
        waiting = asyncio.Event()
        ends: list[RunFinished] = []

        def hear(event: object) -> None:
            if isinstance(event, ModelRetry):
                waiting.set()
            elif isinstance(event, RunFinished):
                ends.append(event)

        handle.add_listener(hear)
        await waiting.wait()  # the leaf waits out its Retry-After
        assert handle.interrupt()
        assert await handle == INTERRUPTED
        leaf_requests = [r for r in server.requests if not r.body.get("tools")]
        assert len(leaf_requests) == 1
        # The wait was cut, not waited out (a wait waited out counts a retry).
        assert [(e.source, e.status, e.retries) for e in ends] == [
            ("leaf", "interrupted", 0), ("mid", "interrupted", 0), ("root", "interrupted", 0)
        ]
        check_valid(root.messages)
        assert tool_results(root.messages)[0].startswith("[interrupted: agent 'mid'")
        for agent in (leaf, mid, root):
            await agent.aclose()


async def test_a_handle_started_deep_in_the_tree_belongs_to_the_top_run() -> None:
    """A tool of the leaf starts a run of its own with RunHandle.start(): it belongs to the
    run at the top (as nested handles do), so the top's cancel reaches it too."""
    inner: list[aio.RunHandle[None]] = []
    started = asyncio.Event()

    async def fetch() -> str:
        """Fetch the page in a run of its own."""
        handle = aio.RunHandle.start(asyncio.sleep(60))
        inner.append(handle)
        started.set()
        await handle  # awaiting a handle never cancels it: only ownership does
        return "never"

    tree = Tree(given_fetch=aio.tool(fetch))
    top = aio.RunHandle.start(tree.root.run("go"))
    await started.wait()
    top.cancel("stop all")
    with pytest.raises(asyncio.CancelledError):
        await top
    assert inner[0].status == "cancelled"
    assert asyncio.all_tasks() == {asyncio.current_task()}
    check_valid(tree.root.messages)
