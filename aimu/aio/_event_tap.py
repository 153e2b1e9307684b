"""EventTap: one reader's hold on a live run's events (``handle.tap()``, ``handle.events()``).

A tap hears every event the run emits from the moment it is made and holds them, in
order, until its reader takes them; when the run ends it holds exactly one
:class:`~aimu.aio.events.HandleFinished` after them and stops listening. The run never
waits for a tap, and nothing a reader does (read slowly, stop reading, be cancelled
while it waits) reaches the run.

The buffer: unbounded by default (``maxsize=None``), so nothing is ever lost, as a
publisher or a replay log needs. With ``maxsize``, a reader that falls behind loses the
text and thinking chunks that come while ``maxsize`` events are held (counted in
``dropped``); every other event, the terminal one included, is always held.

Reading: ``async for`` (one event at a time); :meth:`EventTap.batch` (up to N events,
at most one batch every T seconds, the first after a quiet while at once); or
:meth:`EventTap.peek` then :meth:`EventTap.advance` once the events were delivered (a
delivery that fails reads them again). Events are taken only after the last ``await``
of a read, so a reader cancelled at any of them loses none. One reader per tap.

A tap listens until the run ends (its terminal then held) or its reader closes it
(:meth:`EventTap.close`: what it held is discarded); either way it stops listening.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Final

from aimu.aio.events import Event, HandleFinished, TextChunk, ThinkingChunk

__all__ = ["EventTap"]

_DROPPABLE: Final = (TextChunk, ThinkingChunk)


def _nothing() -> None:
    pass


class EventTap(AsyncIterator[Event]):
    """The events of one run from the moment of tapping, then one HandleFinished; made
    by ``handle.tap()`` (or ``handle.events()``), read by one reader."""

    __slots__ = (
        "_closed", "_detach", "_ended", "_held", "_listening", "_loop", "_notify", "_paced",
        "_room", "_waiter", "dropped", "taken",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        maxsize: int | None = None,
        notify: Callable[[], object] | None = None,
    ) -> None:
        if maxsize is not None and maxsize < 1:
            raise ValueError(f"tap(maxsize={maxsize}): the buffer needs room for 1 event")
        self._loop = loop
        self._room = sys.maxsize if maxsize is None else maxsize
        self._notify = notify
        self._held: deque[Event] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._closed = False
        self._listening = True
        """Neither ended nor closed (one test per event pushed)."""
        self._detach: Callable[[], None] = _nothing
        self._paced = float("-inf")
        #: Text and thinking chunks dropped because the reader fell behind (``maxsize``).
        self.dropped = 0
        #: Events taken by take(), advance() and batch() (not counted while iterating, a
        #: cost per event): the next held event is then number ``taken + 1``.
        self.taken = 0

    # -- the run's side ----------------------------------------------------------------

    def _push(self, event: Event) -> None:
        if not self._listening:
            return
        held = self._held
        if len(held) >= self._room and isinstance(event, _DROPPABLE):
            self.dropped += 1
            return
        held.append(event)
        self._wake()

    def _end(self, terminal: HandleFinished) -> None:
        """The run ended: hold its terminal event (unless the reader closed the tap)."""
        if self._ended:
            return
        self._ended, self._listening = True, False
        if not self._closed:
            self._held.append(terminal)
        self._unlisten()
        self._wake()

    def _unlisten(self) -> None:
        detach, self._detach = self._detach, _nothing
        detach()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self._notify is not None:
            self._notify()

    # -- the reader's side ---------------------------------------------------------------

    @property
    def held(self) -> int:
        """How many events are held, not yet taken."""
        return len(self._held)

    @property
    def ended(self) -> bool:
        """True once the run has ended (its terminal event is held, or was taken)."""
        return self._ended

    @property
    def exhausted(self) -> bool:
        """True when nothing is held and nothing more will come."""
        return not self._held and (self._ended or self._closed)

    def peek(self, most: int | None = None) -> list[Event]:
        """The first ``most`` events held (all without ``most``), left held."""
        held = self._held
        count = len(held) if most is None else min(most, len(held))
        return [held[i] for i in range(count)]

    def advance(self, count: int) -> None:
        """Forget the first ``count`` events held: they were delivered."""
        held = self._held
        for _ in range(min(count, len(held))):
            held.popleft()
            self.taken += 1

    def take(self, most: int | None = None) -> list[Event]:
        """Take the first ``most`` events held (all without ``most``)."""
        events = self.peek(most)
        self.advance(len(events))
        return events

    async def wait(self) -> bool:
        """Wait until an event is held; False when none ever will be (the tap is
        exhausted). Cancelled, it loses nothing."""
        while not self._held:
            if self._ended or self._closed:
                return False
            await self._woken(None)
        return True

    def pace(self) -> None:
        """Count the pacing of :meth:`ready` from now (not from a batch due long ago):
        the first batch then gathers for ``every`` too."""
        self._paced = self._loop.time()

    async def ready(self, most: int, *, every: float = 0.0) -> bool:
        """Wait until a batch is due: an event is held, and ``every`` seconds have passed
        since the last batch was due (sooner once ``most`` are held or the run ended).
        False when the tap is exhausted. Cancelled, it loses nothing."""
        if not await self.wait():
            return False
        due = self._paced + every
        loop = self._loop
        while not self._ended and not self._closed and len(self._held) < most:
            left = due - loop.time()
            if left <= 0:
                break
            await self._woken(left)
        self._paced = loop.time()
        return bool(self._held)

    async def batch(self, most: int, *, every: float = 0.0) -> list[Event]:
        """Take the next batch (up to ``most`` events) when :meth:`ready` says it is
        due; ``[]`` once the tap is exhausted."""
        if not await self.ready(most, every=every):
            return []
        return self.take(most)

    async def _woken(self, seconds: float | None) -> None:
        """Wait for the next event or end (or ``seconds``)."""
        if self._waiter is not None:
            raise RuntimeError("an EventTap has one reader: tap the run again for another")
        self._waiter = waiter = self._loop.create_future()
        try:
            if seconds is None:
                await waiter
            else:
                await asyncio.wait((waiter,), timeout=seconds)
        finally:
            self._waiter = None

    def __aiter__(self) -> EventTap:
        return self

    async def __anext__(self) -> Event:
        held = self._held
        while not held:  # wait() and _woken() inlined: this runs for every event read
            if self._ended or self._closed:
                raise StopAsyncIteration
            if self._waiter is not None:
                raise RuntimeError("an EventTap has one reader: tap the run again for another")
            self._waiter = waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return held.popleft()

    def close(self) -> None:
        """Stop listening; the events held are discarded, a waiting reader ends."""
        self._closed, self._listening = True, False
        self._held.clear()
        self._unlisten()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def aclose(self) -> None:
        """:meth:`close`, for ``contextlib.aclosing`` and ``async with``."""
        self.close()

    async def __aenter__(self) -> EventTap:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()
