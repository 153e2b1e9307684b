"""A tree run registered in Redis: its followers see every level's events with their
path, and a cancel or interrupt from another control reaches the grandchild."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

import pytest

from aimu import aio
from aimu.aio.events import HandleFinished, RunFinished, ToolCallStarted
from tests.aio.trees.test_tree_stops import Blocking
from tests.aio.trees.tree_support import Tree, check_valid, tool_results


@pytest.fixture
async def controls(redis_url: str) -> AsyncIterator[tuple[aio.RedisControl, aio.RedisControl]]:
    """A worker's control and a controller's, on a key prefix of this test's own."""
    prefix = f"aimu_test_{secrets.token_hex(4)}"
    async with aio.RedisControl(redis_url, prefix) as worker, \
            aio.RedisControl(redis_url, prefix) as control:
        yield worker, control
        keys = [key async for key in control._client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await control._client.delete(*keys)


@pytest.mark.parametrize("stop", ["cancel", "interrupt"])
async def test_a_stop_from_another_control_reaches_the_grandchild(
    controls: tuple[aio.RedisControl, aio.RedisControl], stop: str
) -> None:
    worker, control = controls
    fetch = Blocking()
    tree = Tree(given_fetch=aio.tool(fetch, name="fetch"))
    handle = aio.RunHandle.start(tree.root.run("go"), control=worker)
    run_id = await worker.registered(handle)
    seen = []
    async for item in control.events(run_id):
        seen.append(item.event)
        if isinstance(item.event, ToolCallStarted) and item.event.path == ("root", "mid"):
            break
    if stop == "cancel":
        assert await control.cancel(run_id, "from afar")
        with pytest.raises(asyncio.CancelledError):
            await handle
        assert fetch.cancelled
    else:
        assert await control.interrupt(run_id)
        for _ in range(10_000):  # until the worker has applied it: the provable point
            if handle.interrupt_requested:
                break
            await asyncio.sleep(0.001)
        fetch.release.set()
        await handle
        assert handle.status == "interrupted"
    info = await control.wait(run_id, timeout=10)
    assert info.status == handle.status
    followed = [item.event for item in [i async for i in control.events(run_id)]]
    finals = [(e.source, e.path, e.status) for e in followed if isinstance(e, RunFinished)]
    want = "cancelled" if stop == "cancel" else "interrupted"
    assert finals == [("leaf", ("root", "mid"), want), ("mid", ("root",), want),
                      ("root", (), want)]
    assert isinstance(followed[-1], HandleFinished)
    check_valid(tree.root.messages)
    assert tool_results(tree.root.messages)[0].startswith(f"[{want}: agent 'mid'")
