"""The wall-clock cut: a run's ``wall`` limit, one timer for the whole run.

When it comes, the step waiting in :meth:`WallTimer.guard` (a stream step, a tool call)
is cancelled and ``guard`` raises :class:`WallReached` in its place.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Coroutine
from typing import NoReturn, TypeVar

from aimu.aio._cut import Cut, cut_steps

__all__ = ["WallReached", "WallTimer", "walled"]

_T = TypeVar("_T")


class WallReached(Exception):
    """The run's ``wall`` limit came while a reply streamed or a tool call ran."""


class WallTimer:
    """A run's ``wall`` limit: one timer for the whole run, armed when it opens. When it
    comes, the step waiting in :meth:`guard` (a stream step, a tool call) is cancelled
    and :meth:`guard` raises WallReached in its place; a guard after that raises at
    once. The cancel accounting is asyncio.timeout's: a cancel from elsewhere in the same
    moment stays a CancelledError."""

    __slots__ = ("_cut", "_handle", "reached")

    def __init__(self, deadline: float) -> None:
        self.reached = False
        self._cut = Cut()
        self._handle = asyncio.get_running_loop().call_at(deadline, self._fire)

    def _fire(self) -> None:
        self.reached = True
        self._cut.fire()

    async def guard(self, awaitable: Awaitable[_T]) -> _T:
        """``awaitable``'s value, or WallReached (``awaitable`` cancelled) if the limit
        comes first."""
        if self.reached:
            if isinstance(awaitable, Coroutine):
                awaitable.close()
            raise WallReached
        return await self._cut.run(awaitable, _reached)

    def close(self) -> None:
        """The run has ended: the timer goes."""
        self._handle.cancel()


def _reached() -> NoReturn:
    raise WallReached from None  # not "during handling" of the cut's own cancel


def walled(chunks: AsyncGenerator[_T, None], wall: WallTimer) -> AsyncGenerator[_T, None]:
    """``chunks``, each step cut (WallReached, ``chunks`` closed) when the wall limit
    comes. Only runs with a ``wall`` limit pay for this frame."""
    return cut_steps(chunks, wall.guard)
