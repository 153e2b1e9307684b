"""EventTap (``handle.tap()``): every event from the tap on, then one HandleFinished; a
reader cancelled at any await loses nothing and never touches the run; batches; nothing
left attached to the run once it ends or the reader closes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aimu import aio
from aimu.aio._event_tap import EventTap
from aimu.aio.events import Event, HandleFinished, RunStarted, TextChunk
from aimu.aio.scope import current_scope


class Writer:
    """A run that emits what the test asks for, when it asks."""

    def __init__(self) -> None:
        self.orders: asyncio.Queue[list[Event] | None] = asyncio.Queue()

    async def run(self) -> str:
        scope = current_scope.get()
        assert scope is not None
        while (events := await self.orders.get()) is not None:
            for event in events:
                scope.emit(event)
        return "done"

    def emit(self, *events: Event) -> None:
        self.orders.put_nowait(list(events))

    def end(self) -> None:
        self.orders.put_nowait(None)


def chunks(count: int, start: int = 0) -> list[Event]:
    return [TextChunk("w", str(i)) for i in range(start, start + count)]


async def emitted(tap: EventTap, count: int) -> None:
    """Return once the tap holds ``count`` events (the run's emit runs in its task)."""
    while tap.held < count:  # noqa: ASYNC110 - a provable point, read off the tap
        await asyncio.sleep(0)


async def waiting(tap: EventTap) -> None:
    """Return once a reader waits on ``tap`` (a provable point)."""
    while tap._waiter is None:  # noqa: ASYNC110 - a provable point, read off the tap
        await asyncio.sleep(0)


def attached(handle: aio.RunHandle[Any]) -> int:
    """Taps (and listeners) still attached to the run."""
    observers = handle._observers
    return len(handle._listeners or ()) + (0 if observers is None else len(observers.taps))


async def test_a_tap_holds_every_event_then_one_terminal_and_detaches() -> None:
    writer = Writer()
    handle = aio.RunHandle.start(writer.run())
    tap = handle.tap()
    writer.emit(*chunks(3))
    writer.end()
    events = [event async for event in tap]
    assert events[:3] == chunks(3)
    assert isinstance(events[3], HandleFinished) and events[3].status == "completed"
    assert len(events) == 4 and tap.exhausted
    assert attached(handle) == 0
    late = handle.tap()  # of a run that has ended: its terminal only
    assert [event async for event in late] == [handle.final]


async def test_a_reader_cancelled_while_it_waits_loses_nothing_and_the_run_goes_on() -> None:
    writer = Writer()
    handle = aio.RunHandle.start(writer.run())
    tap = handle.tap()
    for read in (anext(tap), tap.wait(), tap.batch(5), tap.ready(5)):
        reader = asyncio.ensure_future(read)
        await waiting(tap)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert tap._waiter is None and handle.status == "running"
    writer.emit(*chunks(2))
    await emitted(tap, 2)
    assert await tap.batch(10) == chunks(2)
    # Cancelled while a batch is not due yet (its pacing wait): the events stay held.
    writer.emit(*chunks(2, 2))
    await emitted(tap, 2)
    pacing = asyncio.ensure_future(tap.batch(10, every=3600))
    await waiting(tap)
    pacing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pacing
    assert tap.peek() == chunks(2, 2) and handle.status == "running"
    writer.end()
    assert (await handle) == "done"
    assert [e async for e in tap][:2] == chunks(2, 2)


async def test_a_run_cancelled_while_a_reader_waits_ends_the_reader_with_its_terminal() -> None:
    writer = Writer()
    handle = aio.RunHandle.start(writer.run())
    tap = handle.tap()
    reading = asyncio.ensure_future(anext(tap))
    await waiting(tap)
    handle.cancel("stop")
    terminal = await reading
    assert isinstance(terminal, HandleFinished)
    assert (terminal.status, terminal.reason) == ("cancelled", "stop")
    with pytest.raises(StopAsyncIteration):
        await anext(tap)
    assert attached(handle) == 0


async def test_batches_hold_at_most_n_and_come_at_most_every_t_seconds() -> None:
    writer = Writer()
    handle = aio.RunHandle.start(writer.run())
    tap = handle.tap()
    writer.emit(*chunks(25))
    await emitted(tap, 25)
    assert [len(await tap.batch(10)) for _ in range(3)] == [10, 10, 5]
    # The next batch waits for its due time (an hour away) until 4 events are held ...
    early = asyncio.ensure_future(tap.batch(4, every=3600))
    await waiting(tap)
    writer.emit(*chunks(3))
    await emitted(tap, 3)
    assert not early.done()
    writer.emit(*chunks(1, 3))
    assert await early == chunks(4)
    # ... or until the run ends, whose events then all go at once.
    last = asyncio.ensure_future(tap.batch(10, every=3600))
    writer.emit(*chunks(1))
    await emitted(tap, 1)
    await waiting(tap)
    writer.end()
    batch = await last
    assert batch[0] == chunks(1)[0] and isinstance(batch[1], HandleFinished)
    assert await tap.batch(10) == [] and tap.exhausted


async def test_peek_then_advance_takes_only_what_was_delivered() -> None:
    writer = Writer()
    handle = aio.RunHandle.start(writer.run())
    tap = handle.tap()
    writer.emit(*chunks(5))
    await emitted(tap, 5)
    assert tap.peek(3) == chunks(3) and tap.held == 5 and tap.taken == 0
    tap.advance(2)  # two delivered; the third failed: read again
    assert tap.peek(3) == chunks(3, 2) and tap.taken == 2
    tap.advance(-1)  # nothing
    assert tap.take() == chunks(3, 2) and tap.taken == 5
    writer.end()
    await handle


async def test_a_bounded_tap_drops_only_chunks_and_keeps_the_terminal() -> None:
    writer = Writer()
    handle = aio.RunHandle.start(writer.run())
    tap = handle.tap(maxsize=3)
    started = RunStarted("w", "task")
    writer.emit(*chunks(5), started)
    writer.end()
    await handle
    events = tap.take()
    assert events[:4] == [*chunks(3), started] and isinstance(events[4], HandleFinished)
    assert tap.dropped == 2
    with pytest.raises(ValueError, match="maxsize=0"):
        handle.tap(maxsize=0)


async def test_closing_a_tap_detaches_it_and_ends_its_reader() -> None:
    writer = Writer()
    handle = aio.RunHandle.start(writer.run())
    async with handle.tap() as tap:
        reading = asyncio.ensure_future(tap.wait())
        await waiting(tap)
        assert attached(handle) == 2  # its listener, and its place among the taps
    assert await reading is False
    assert attached(handle) == 0 and tap.exhausted
    writer.emit(*chunks(2))
    writer.end()
    await handle
    assert tap.held == 0  # nothing after it was closed, not even the terminal


async def test_notify_hears_each_event_and_the_end_and_one_reader_is_enforced() -> None:
    writer = Writer()
    handle = aio.RunHandle.start(writer.run())
    heard: list[int] = []
    tap = handle.tap(notify=lambda: heard.append(tap.held))
    first = asyncio.ensure_future(tap.wait())
    await waiting(tap)
    with pytest.raises(RuntimeError, match="one reader"):
        await tap.wait()
    writer.emit(*chunks(2))
    writer.end()
    await handle
    assert await first is True
    assert heard == [1, 2, 3]
