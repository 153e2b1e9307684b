"""Tasks spawned in the background and owned: spawn, then cancel and wait.

:class:`Background` keeps the tasks it spawned until they end; :meth:`Background.aclose`
cancels those still running and waits for them, cancelling again any that go on (a
library's read can take one cancel as a lost connection and wait again). A task's
failure is retrieved there, so asyncio does not report it again at exit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from aimu.aio.run_handle import RunHandle

__all__ = ["Background", "cancel_and_wait", "ended", "wait_through_cancels"]

T = TypeVar("T")
_log = logging.getLogger("aimu")


class Background:
    """The tasks spawned here and still running."""

    __slots__ = ("tasks",)

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self.tasks)

    def spawn(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``work`` as a task of this group (on the running loop)."""
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def aclose(self, *, rounds: int = 1, wait: float | None = None) -> None:
        """Cancel the tasks still running and wait until they end (see
        :func:`cancel_and_wait`); tasks spawned meanwhile are cancelled too."""
        # A task that ended leaves the set only when its done-callback runs: the loop
        # must not spin on those (it would never yield to let them run).
        while live := {task for task in self.tasks if not task.done()}:
            await cancel_and_wait(live, rounds=rounds, wait=wait)
            if wait is not None:
                return


async def cancel_and_wait(
    tasks: Collection[asyncio.Task[Any]], *, rounds: int = 1, wait: float | None = None
) -> set[asyncio.Task[Any]]:
    """Cancel ``tasks`` and wait until they end; with ``rounds`` > 1, cancel again those
    still running after ``wait`` seconds, up to ``rounds`` times. The tasks that did not
    end (logged); each failure of the others is retrieved."""
    pending = {task for task in tasks if not task.done()}
    for _ in range(rounds):
        if not pending:
            break
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=wait)
    if pending:
        names = sorted(task.get_name() for task in pending)
        _log.warning("tasks %s did not end when cancelled", names)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: a task that failed is not reported again at exit
    return pending


async def wait_through_cancels(task: asyncio.Future[Any]) -> asyncio.CancelledError | None:
    """Wait until ``task`` is done, however often the waiter is cancelled meanwhile (as a
    TaskGroup does); the last such cancel, for the caller to raise once it is done."""
    again: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError as cancel:
            again = cancel
    return again


async def ended(handle: RunHandle[Any]) -> None:
    """Wait until ``handle`` ends, whatever ended it (its outcome is not ours to raise)."""
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def mark_ended(_: object) -> None:
        if not ended.done():
            ended.set_result(None)

    handle.add_done_callback(mark_ended)
    await ended
