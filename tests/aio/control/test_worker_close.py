"""Closing a worker ends its tasks even when one takes a cancel for something else."""

from __future__ import annotations

import asyncio
import logging

import pytest

from aimu.aio.control.worker import _cancel_all


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
    await _cancel_all({task, broken})
    assert swallowed.is_set()
    assert task.cancelled()
    assert isinstance(broken.exception(), ValueError)


async def test_a_task_that_never_ends_is_named_in_a_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("aimu.aio.control.worker._CANCEL_ROUNDS", 2)
    monkeypatch.setattr("aimu.aio.control.worker._CANCEL_WAIT", 0.01)
    release = asyncio.Event()

    async def immortal() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(immortal(), name="immortal")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="aimu.control"):
        await _cancel_all({task})
    assert "immortal" in caplog.text and not task.done()
    release.set()
    await task
