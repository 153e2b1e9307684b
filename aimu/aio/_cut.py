"""A cut: the task awaiting something is cancelled from a callback, and that cancel is
told from any other the way ``asyncio.timeout`` does (it counts its own cancel and
takes it back with ``uncancel()``): a cancel from elsewhere in the same moment stays a
CancelledError, and a cut that the awaited code swallowed is still reported."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["Cut", "cut_steps"]

_T = TypeVar("_T")


class Cut:
    """Cancels the task waiting in :meth:`run` when :meth:`fire` is called."""

    __slots__ = ("_fired", "_task")

    def __init__(self) -> None:
        self._task: asyncio.Task[Any] | None = None
        self._fired = False

    def fire(self) -> None:
        """Cancel the task waiting in :meth:`run`, if one is."""
        if self._task is not None:
            self._fired = True
            self._task.cancel()

    async def run(self, awaitable: Awaitable[_T], cut: Callable[[], object]) -> _T:
        """``awaitable``'s value; when :meth:`fire` cancelled it, ``cut()`` is called to
        raise in its place."""
        task = asyncio.current_task()
        assert task is not None
        cancelling = task.cancelling()
        self._task, self._fired = task, False
        try:
            result = await awaitable
        except asyncio.CancelledError:
            if self._fired and task.uncancel() <= cancelling:
                cut()
            raise
        finally:
            self._task = None
        if self._fired and task.uncancel() <= cancelling:  # the cut was swallowed below
            cut()
        return result


async def cut_steps(
    chunks: AsyncGenerator[_T, None], guard: Callable[[Awaitable[_T]], Awaitable[_T]]
) -> AsyncGenerator[_T, None]:
    """``chunks``, each step awaited through ``guard`` (a :meth:`Cut.run` that raises in
    the step's place); ``chunks`` closed however the stream ends."""
    try:
        while True:
            try:
                chunk = await guard(anext(chunks))
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        await chunks.aclose()
