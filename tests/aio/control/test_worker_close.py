"""Closing a worker ends its tasks even when one takes a cancel for something else."""

from __future__ import annotations

import asyncio
import logging

import pytest

from aimu.aio._tasks import cancel_and_wait


async def test_a_task_that_swallows_a_cancel_is_cancelled_again_until_it_ends() -> None:
    # Like a redis-py read that takes a cancel for a lost connection and waits again.
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            swallowed.set()
        await asyncio.Event().wait()

    async def failing() -> None:
        raise ValueError("boom")

    task = asyncio.create_task(stubborn())
    broken = asyncio.create_task(failing())
    await asyncio.sleep(0)
    await cancel_and_wait({task, broken}, rounds=20, wait=1.0)
    assert swallowed.is_set()
    assert task.cancelled()
    assert isinstance(broken.exception(), ValueError)


async def test_a_task_that_never_ends_is_named_in_a_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = asyncio.Event()

    async def immortal() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(immortal(), name="immortal")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="aimu"):
        assert await cancel_and_wait({task}, rounds=2, wait=0.01) == {task}
    assert "immortal" in caplog.text and not task.done()
    release.set()
    await task
