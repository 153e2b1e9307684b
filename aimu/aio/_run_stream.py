"""A streamed run (``run(task, stream=True)``): leaving its ``async for`` loop stops it.

A consumer that leaves the loop (``break``, ``return``, an exception in the loop body)
reads no more events: that is a stop, as a cancel. Python closes a generator only when
it is garbage collected (never, while a variable still holds it), a loop turn later.
So each ``async for`` gets its own iterator (:class:`_Loop`), held only by the loop:
when the loop drops it, the run's closing starts in a task at once, and the run has
settled (``cancelled``, its transcript valid and stored) by the next turn of the event
loop, or once a store over the network has answered; ``aclose()`` and ``async with``
wait for it. The closing runs in a task of its own, as asyncio's own finalizer does:
its awaits (an HTTP response closed, a store written) cannot run inside ``__del__``.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Coroutine
from types import AsyncGeneratorType, TracebackType
from typing import Any, Final, Protocol, cast, overload

from aimu.aio._tasks import wait_through_cancels
from aimu.aio.events import Event

__all__ = ["RunStream"]

#: Closings that had to wait, kept until done (the event loop holds tasks weakly).
_CLOSING: Final[set[asyncio.Task[None]]] = set()


class Leaver(Protocol):
    """What runs the stream (an agent, a workflow): told of a closing still going on, so
    its next run waits for it instead of finding the session busy."""

    _leaving: asyncio.Task[None] | None


class RunStream(AsyncGenerator[Event, None]):
    """The events of one run. ``async for event in stream`` reads them; leaving the loop
    stops the run there (it settles ``cancelled`` before the next line runs, its
    transcript valid and stored). ``async with stream:`` (or ``contextlib.aclosing``)
    closes it on exit, waiting for the settling to be written."""

    __slots__ = ("_closing", "_events", "_owner")

    def __init__(self, events: AsyncGenerator[Event, None], owner: Leaver | None = None) -> None:
        self._events = cast("AsyncGeneratorType[Event, None]", events)
        self._closing: asyncio.Task[None] | None = None
        self._owner = owner

    def __aiter__(self) -> AsyncGenerator[Event, None]:
        return _Loop(self)

    def __anext__(self) -> Coroutine[Any, Any, Event]:
        return self._events.__anext__()

    def asend(self, value: None, /) -> Coroutine[Any, Any, Event]:
        return self._events.asend(value)

    @overload
    def athrow(
        self, kind: type[BaseException], value: object = None,
        traceback: TracebackType | None = None, /,
    ) -> Coroutine[Any, Any, Event]: ...

    @overload
    def athrow(
        self, kind: BaseException, value: None = None, traceback: TracebackType | None = None, /
    ) -> Coroutine[Any, Any, Event]: ...

    def athrow(
        self, kind: Any, value: Any = None, traceback: TracebackType | None = None, /
    ) -> Coroutine[Any, Any, Event]:
        if value is None and traceback is None:
            return self._events.athrow(kind)
        return self._events.athrow(kind, value, traceback)

    async def aclose(self) -> None:
        """Stop the run (if it still runs) and wait until it has settled: cancelled
        meanwhile, it still waits (the run may not be left half-settled), then raises."""
        closing = self._closing
        if closing is None:
            await self._events.aclose()
            return
        again = await wait_through_cancels(closing)
        closing.result()
        if again is not None:
            raise again

    async def __aenter__(self) -> RunStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def left(self) -> None:
        """The consumer left its loop: close the run in a task of its own, started now
        (its first step runs at the next turn of the event loop)."""
        events = self._events
        if events.ag_frame is None or self._closing is not None:
            return  # ended, or closed already
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop here: the loop's own shutdown closes it
        task = loop.create_task(_closed(events))
        self._closing = task
        if self._owner is not None:
            self._owner._leaving = task
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)


async def _closed(events: AsyncGeneratorType[Event, None]) -> None:
    await events.aclose()


class _Loop(RunStream):
    """The iterator of one ``async for`` over a :class:`RunStream`; only the loop holds
    it, so it goes away exactly when the loop is left."""

    __slots__ = ("_stream",)

    def __init__(self, stream: RunStream) -> None:
        super().__init__(stream._events)
        self._stream = stream

    def __aiter__(self) -> AsyncGenerator[Event, None]:
        return self

    def aclose(self) -> Coroutine[Any, Any, None]:
        return self._stream.aclose()

    def __del__(self) -> None:
        self._stream.left()
