"""RunHandle: every state transition, the races between them, events, threads, signals."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Callable, Generator
from typing import Any

import pytest

from aimu import aio
from aimu.aio.agent import INTERRUPTED
from aimu.aio.events import (
    Event,
    HandleFinished,
    RunFinished,
    StepFinished,
    TextChunk,
    ThinkingChunk,
    ToolCallStarted,
    ToolResult,
)
from aimu.aio.run_handle import RunHandle, on_sigint
from aimu.aio.scope import RunScope, current_scope
from aimu.aio.transcript import validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer

# -- small runs ---------------------------------------------------------------------------


async def value(result: object = "done") -> object:
    return result


async def ticks(count: int, result: object = "done") -> object:
    for _ in range(count):
        await asyncio.sleep(0)
    return result


async def forever() -> None:
    await asyncio.Event().wait()


async def boom() -> None:
    await asyncio.sleep(0)
    raise ValueError("boom from the run")


async def fake_loop(name: str = "fake", steps: int | None = None) -> str:
    """A scope-aware loop like an agent's: a step per tick, events, stops when asked."""
    scope = current_scope.get()
    assert scope is not None
    step = 0
    while steps is None or step < steps:
        await asyncio.sleep(0)
        scope.emit(TextChunk(name, f"t{step} "))
        step += 1
        scope.emit(StepFinished(name, step))
        if scope.interrupt_requested:
            scope.note_interrupted()
            return INTERRUPTED
    return f"{name} finished {step} steps"


async def stubborn(name: str = "stubborn") -> None:
    """Emits forever and never honours an interrupt."""
    scope = current_scope.get()
    assert scope is not None
    while True:
        await asyncio.sleep(0)
        scope.emit(TextChunk(name, "x"))


@pytest.fixture(autouse=True)
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """Every call of the loop's exception handler ("never retrieved" included) fails."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    yield seen
    gc.collect()
    loop.set_exception_handler(previous)
    assert seen == []


async def drain(events: AsyncIterator[Event]) -> list[Event]:
    return [event async for event in events]


def terminals(events: list[Event]) -> list[HandleFinished]:
    return [e for e in events if isinstance(e, HandleFinished)]


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


# -- start --------------------------------------------------------------------------------


async def test_a_run_goes_pending_running_completed() -> None:
    seen: list[str] = []

    async def run() -> str:
        seen.append(handle.status)
        await asyncio.sleep(0)
        return "reply"

    handle = RunHandle.start(run())
    assert handle.status == "pending" and not handle.done and not handle.cancelled
    assert await handle == "reply"
    assert seen == ["running"]
    assert handle.status == "completed" and handle.done and not handle.cancelled
    assert await handle.result() == "reply"  # awaiting again: the same result
    assert handle.reason is None


async def test_the_run_sees_a_fresh_scope_named_after_it_and_the_context_stays_clean() -> None:
    async def run() -> RunScope | None:
        return current_scope.get()

    handle = RunHandle.start(run())
    assert handle.name.endswith(".<locals>.run")  # the coroutine's qualified name
    assert await handle is handle.scope
    assert current_scope.get() is None
    named = RunHandle.start(run(), name="mine")
    scope = await named
    assert scope is not None and scope.name == "mine" and scope.parent is None
    assert scope.deadline is None and not scope.interrupt_requested


async def test_start_builds_the_scope_that_runscope_would() -> None:
    # start() fills the scope's slots itself (speed); it must match RunScope().
    loop = asyncio.get_running_loop()
    outer = RunHandle.start(forever(), name="outer", timeout=30)

    async def inner() -> RunScope:
        handle = RunHandle.start(value(), name="inner", deadline=loop.time() + 60)
        await handle
        return handle.scope

    try:
        nested = RunHandle.start(inner())
        built = await nested
    finally:
        outer.cancel()
    parent = nested.scope
    reference = RunScope("inner", parent=parent, deadline=built.deadline)
    for slot in RunScope.__slots__:
        if slot != "parent":
            assert getattr(built, slot) == getattr(reference, slot), slot
    assert built.parent is parent


async def test_any_awaitable_runs_and_a_non_awaitable_is_refused() -> None:
    future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    on_future = RunHandle.start(future)
    assert on_future.name == "Future"
    future.set_result("from a future")
    assert await on_future == "from a future"

    class Custom:
        def __await__(self) -> Generator[Any, None, str]:
            yield from asyncio.sleep(0).__await__()
            return "custom"

    assert await RunHandle.start(Custom()) == "custom"
    inner = RunHandle.start(value("inner"))
    assert await RunHandle.start(inner) == "inner"  # a handle is awaitable too
    with pytest.raises(TypeError, match="coroutine or another awaitable, not function"):
        RunHandle.start(value)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"RunHandle\.start"):
        RunHandle()


def test_start_needs_a_running_loop_and_leaves_no_unawaited_coroutine() -> None:
    coroutine = value()
    with pytest.raises(RuntimeError, match="needs a running event loop"):
        RunHandle.start(coroutine)
    assert coroutine.cr_frame is None  # closed: no "never awaited" warning


@pytest.mark.parametrize("seconds", [10**400, math.nan, math.inf, -math.inf],
                         ids=["10**400", "nan", "inf", "-inf"])
async def test_a_timeout_or_grace_that_is_not_a_finite_number_is_refused(
    seconds: float,
) -> None:
    """Issue 29 item 5: ``10**400`` has no float (it raised OverflowError), NaN and inf
    no meaning; each is a ValueError, and the run is neither started nor stopped."""
    for given in ({"timeout": seconds}, {"deadline": seconds}):
        coroutine = value()
        with pytest.raises(ValueError, match=next(iter(given))):
            RunHandle.start(coroutine, **given)
        assert coroutine.cr_frame is None  # closed, not run: no "never awaited" warning
    release = asyncio.Event()
    handle = RunHandle.start(release.wait())
    for grace in (seconds, -1.0):
        with pytest.raises(ValueError, match="grace"):
            await handle.stop(grace)
    assert not handle.done and not handle.interrupt_requested
    release.set()
    assert await handle is True
    assert await RunHandle.start(value("far"), timeout=1e308) == "far"  # finite: fine


async def test_starting_one_coroutine_twice_fails_the_second_handle_only() -> None:
    coroutine = ticks(3, "first")
    first = RunHandle.start(coroutine)
    second = RunHandle.start(coroutine)
    with pytest.raises(RuntimeError, match="coroutine is being awaited already"):
        await second
    assert second.status == "failed"
    assert await first == "first" and first.status == "completed"


async def test_a_loop_task_factory_is_honoured() -> None:
    loop = asyncio.get_running_loop()
    made: list[object] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        made.append(coro)
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(factory)
    try:
        assert await RunHandle.start(value(7)) == 7
    finally:
        loop.set_task_factory(None)
    assert len(made) == 1


async def test_repr_names_status_age_and_reason() -> None:
    handle = RunHandle.start(forever(), name="job")
    assert repr(handle).startswith("<RunHandle 'job' pending age=")
    await settle()
    assert " running age=" in repr(handle)
    handle.cancel("user pressed stop")
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert repr(handle).endswith("s reason='user pressed stop'>")
    assert "cancelled" in repr(handle)


# -- failures -----------------------------------------------------------------------------


async def test_a_failing_run_raises_its_own_exception_to_every_waiter() -> None:
    handle = RunHandle.start(boom())
    waiters = [asyncio.ensure_future(handle.result()) for _ in range(2)]
    outcomes = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(o, ValueError) for o in outcomes)
    assert outcomes[0] is outcomes[1]  # the run's exception itself
    assert handle.status == "failed" and not handle.cancelled
    with pytest.raises(ValueError, match="boom from the run"):
        await handle
    assert terminals(await drain(handle.events())) == [
        HandleFinished(handle.name, "failed", None, None, "ValueError: boom from the run")
    ]


async def test_a_failed_run_nobody_awaits_logs_nothing(loop_errors: list[Any]) -> None:
    handles = [RunHandle.start(boom()) for _ in range(5)]
    await settle()
    assert all(h.status == "failed" for h in handles)
    del handles
    gc.collect()
    await settle()
    assert loop_errors == []  # no "Task exception was never retrieved"


# -- cancel ---------------------------------------------------------------------------------


async def test_cancel_stops_the_run_at_its_next_await() -> None:
    reached: list[str] = []

    async def run() -> None:
        reached.append("before")
        try:
            await forever()
        finally:
            reached.append("cleanup")

    handle = RunHandle.start(run())
    await settle()
    assert handle.cancel("user pressed stop") is True
    assert handle.status == "running"  # stopping, not stopped yet
    with pytest.raises(asyncio.CancelledError) as caught:
        await handle.result()
    assert caught.value.args == ("user pressed stop",)
    assert reached == ["before", "cleanup"]
    assert handle.status == "cancelled" and handle.cancelled and handle.done
    assert handle.reason == "user pressed stop"


async def test_cancel_after_done_and_twice_and_interrupt_after_cancel() -> None:
    done = RunHandle.start(value())
    await done
    assert done.cancel() is False and done.interrupt() is False and done.status == "completed"

    handle = RunHandle.start(forever())
    await settle()
    assert handle.cancel("first") is True
    assert handle.cancel("second") is True  # still stopping: nothing more happens
    assert handle.interrupt() is False  # a cancelled run is not asked to stop gracefully
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert handle.reason == "first"
    assert handle.cancel() is False and handle.interrupt() is False


async def test_a_cancel_before_the_first_step_lands_at_the_runs_first_await() -> None:
    opened: list[str] = []

    async def run() -> None:
        opened.append("task recorded")  # an agent records the user's task here
        await forever()

    handle = RunHandle.start(run())
    assert handle.cancel("at once") is True
    assert handle.status == "pending"
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert opened == ["task recorded"] and handle.status == "cancelled"

    # A run that never awaits has no await to stop at: it completes.
    quick = RunHandle.start(value("quick"))
    assert quick.cancel() is True
    assert await quick == "quick" and quick.status == "completed"


async def test_a_cancel_the_run_swallows_leaves_it_completed() -> None:
    async def run() -> str:
        try:
            await forever()
        except asyncio.CancelledError:
            return "kept going"
        return "unreachable"

    handle = RunHandle.start(run())
    await settle()
    handle.cancel("stop")
    assert await handle == "kept going"
    assert handle.status == "completed" and handle.reason == "stop"


async def test_an_outside_cancel_before_the_first_step_closes_the_coroutine() -> None:
    coroutine = forever()
    handle = RunHandle.start(coroutine)
    waiter = asyncio.ensure_future(handle.result())
    await asyncio.sleep(0)  # the waiter is waiting; the run's task has not stepped yet
    (task,) = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "RunHandle._drive"]
    task.cancel("from outside")
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert handle.status == "cancelled" and handle.reason == "from outside"
    assert coroutine.cr_frame is None  # closed, never "never awaited"


async def test_a_run_that_cancels_itself_is_cancelled() -> None:
    async def run() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(0)

    handle = RunHandle.start(run())
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert handle.status == "cancelled" and handle.reason is None


# -- interrupt --------------------------------------------------------------------------------


async def test_interrupt_stops_a_scope_aware_loop_at_its_next_step() -> None:
    handle = RunHandle.start(fake_loop())
    await settle()
    assert handle.interrupt() is True
    assert handle.interrupt() is True  # asking twice is harmless
    assert handle.scope.interrupt_requested
    assert await handle == INTERRUPTED
    assert handle.status == "interrupted" and not handle.cancelled
    assert handle.interrupt() is False


async def test_interrupt_before_the_first_step_is_seen_at_the_first_boundary() -> None:
    handle = RunHandle.start(fake_loop())
    assert handle.interrupt() is True and handle.status == "pending"
    assert await handle == INTERRUPTED and handle.status == "interrupted"


async def test_an_interrupt_the_run_does_not_honour_completes() -> None:
    # Asked while the run finishes its last step: it answers, and says so.
    async def run() -> str:
        await asyncio.sleep(0)
        assert handle.interrupt() is True  # arrives as the run returns its answer
        return "the whole answer"

    handle = RunHandle.start(run())
    assert await handle == "the whole answer"
    assert handle.status == "completed"
    assert handle.interrupt() is False  # and nothing is left set for later


async def test_interrupt_reaches_a_nested_handle_and_its_loop() -> None:
    async def outer() -> object:
        inner = RunHandle.start(fake_loop("inner"))
        assert inner.scope.parent is current_scope.get()
        return await inner

    handle = RunHandle.start(outer())
    await settle()
    handle.interrupt()
    assert await handle == INTERRUPTED
    assert handle.status == "interrupted"  # the inner loop's honoured interrupt counts


# -- stop ---------------------------------------------------------------------------------------


async def test_stop_interrupts_and_returns_the_final_status() -> None:
    handle = RunHandle.start(fake_loop())
    await settle()
    assert await handle.stop(grace=5) == "interrupted"
    assert await handle.stop() == "interrupted"  # stopping a stopped handle: its status
    assert await handle == INTERRUPTED


async def test_stop_cancels_when_the_grace_runs_out_and_twice_at_once_agrees() -> None:
    handle = RunHandle.start(stubborn())
    await settle()
    first, second = await asyncio.gather(handle.stop(grace=0.01), handle.stop(grace=0.01))
    assert first == second == "cancelled"
    assert handle.reason == "stop(): still running 0.01 s after the interrupt"
    with pytest.raises(asyncio.CancelledError):
        await handle

    now = RunHandle.start(stubborn())
    assert await now.stop(grace=0) == "cancelled"


async def test_cancelling_stop_only_stops_the_waiting() -> None:
    handle = RunHandle.start(stubborn())
    await settle()
    stopping = asyncio.ensure_future(handle.stop(grace=30))
    await settle()
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert handle.status == "running" and handle.scope.interrupt_requested
    handle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handle


# -- deadlines --------------------------------------------------------------------------------


async def test_a_deadline_times_the_run_out() -> None:
    handle = RunHandle.start(forever(), timeout=0.01)
    with pytest.raises(TimeoutError, match="passed its deadline"):
        await handle
    assert handle.status == "timed_out" and not handle.cancelled
    assert handle.reason == "deadline passed"
    events = await drain(handle.events())
    assert events == [
        HandleFinished(
            handle.name,
            "timed_out",
            "deadline passed",
            None,
            f"TimeoutError: run {handle.name!r} passed its deadline",
        )
    ]


async def test_deadline_and_timeout_take_the_earlier_and_a_passed_one_still_opens_the_run() -> None:
    loop = asyncio.get_running_loop()
    handle = RunHandle.start(forever(), timeout=100, deadline=loop.time() + 200)
    assert handle.scope.deadline is not None
    assert handle.scope.deadline - loop.time() == pytest.approx(100, abs=1)
    handle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handle

    opened: list[bool] = []

    async def run() -> None:
        opened.append(True)
        await forever()

    late = RunHandle.start(run(), deadline=loop.time() - 1)
    with pytest.raises(TimeoutError):
        await late
    assert opened == [True] and late.status == "timed_out"


async def test_a_run_finishing_before_its_deadline_completes() -> None:
    handle = RunHandle.start(ticks(2), timeout=30)
    assert await handle == "done" and handle.status == "completed"


async def test_cancel_and_deadline_in_one_loop_iteration_is_a_cancel() -> None:
    loop = asyncio.get_running_loop()
    # The deadline fires first, then the cancel, in the same iteration.
    at = loop.time() + 0.01
    handle = RunHandle.start(forever(), deadline=at)
    loop.call_at(at, handle.cancel, "user")
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert handle.status == "cancelled" and handle.reason == "user"

    # The cancel first, then the deadline.
    at = loop.time() + 0.01
    box: list[RunHandle[None]] = []
    loop.call_at(at, lambda: box[0].cancel("user"))
    box.append(RunHandle.start(forever(), deadline=at))
    with pytest.raises(asyncio.CancelledError):
        await box[0]
    assert box[0].status == "cancelled"


async def test_an_outside_cancel_at_the_deadline_is_a_cancel_not_a_timeout() -> None:
    loop = asyncio.get_running_loop()
    at = loop.time() + 0.01
    tasks: list[asyncio.Task[Any]] = []

    async def run() -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.append(task)
        loop.call_at(at, task.cancel)  # fires in the same iteration as the deadline
        await forever()

    handle = RunHandle.start(run(), deadline=at)
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert handle.status == "cancelled"


async def test_a_run_that_swallows_its_deadline_and_returns_completes() -> None:
    async def run() -> str:
        try:
            await forever()
        except asyncio.CancelledError:
            return "partial"
        return "unreachable"

    handle = RunHandle.start(run(), timeout=0.01)
    assert await handle == "partial" and handle.status == "completed"


async def test_the_deadline_counts_only_its_own_cancel() -> None:
    # An outside cancel the run swallowed earlier (without uncancel) does not turn the
    # later deadline into a "cancel": only the cancels since the deadline count.
    swallowed = asyncio.Event()

    async def run() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0)
        swallowed.set()
        await forever()

    handle = RunHandle.start(run(), timeout=60)
    await swallowed.wait()  # the deadline passes only once the outside cancel was swallowed
    handle.reschedule(asyncio.get_running_loop().time())
    with pytest.raises(TimeoutError):
        await handle
    assert handle.status == "timed_out"


async def test_a_cancel_after_the_deadline_fired_wins() -> None:
    cleaning = asyncio.Event()

    async def run() -> None:
        try:
            await forever()
        finally:
            cleaning.set()
            await asyncio.sleep(0.01)  # slow cleanup after the deadline's cancel

    handle = RunHandle.start(run(), timeout=0.001)
    await cleaning.wait()
    assert handle.interrupt() is False  # already stopping
    assert handle.cancel("user") is True
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert handle.status == "cancelled" and handle.reason == "user"


async def test_a_nested_handle_inherits_the_tighter_deadline() -> None:
    loop = asyncio.get_running_loop()
    inner_handles: list[RunHandle[Any]] = []

    async def outer(inner_timeout: float | None) -> None:
        inner = RunHandle.start(forever(), timeout=inner_timeout)
        inner_handles.append(inner)
        await inner

    handle = RunHandle.start(outer(60), timeout=0.02)
    with pytest.raises(TimeoutError):
        await handle
    inner = inner_handles.pop()
    assert inner.scope.deadline == handle.scope.deadline  # the outer one, tighter
    with pytest.raises(TimeoutError):
        await inner
    assert inner.status == "timed_out" and handle.status == "timed_out"

    handle = RunHandle.start(outer(0.001), timeout=60)
    with pytest.raises(TimeoutError):  # the inner timeout, raised through the outer run
        await handle
    inner = inner_handles.pop()
    assert inner.scope.deadline is not None and handle.scope.deadline is not None
    assert inner.scope.deadline < handle.scope.deadline - 50
    assert inner.status == "timed_out" and handle.status == "failed"
    assert handle.scope.deadline > loop.time() + 50  # outer deadline untouched


# -- awaiting -----------------------------------------------------------------------------------


async def test_a_waiter_that_gives_up_does_not_cancel_the_run() -> None:
    handle = RunHandle.start(ticks(50, "late reply"))
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0):
            await handle
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(handle.result(), 0)
    assert handle.status == "running"
    assert await handle == "late reply" and handle.status == "completed"


async def test_several_waiters_and_one_that_gives_up() -> None:
    handle = RunHandle.start(ticks(5, "shared"))
    waiters = [asyncio.ensure_future(handle.result()) for _ in range(4)]
    await asyncio.sleep(0)
    waiters[1].cancel()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert results[0] == results[2] == results[3] == "shared"
    assert isinstance(results[1], asyncio.CancelledError)
    assert handle.status == "completed"


async def test_a_waiter_cancelled_as_the_run_finishes_sees_its_own_cancel() -> None:
    loop = asyncio.get_running_loop()

    async def run() -> str:
        await asyncio.sleep(0)
        loop.call_soon(waiter.cancel)  # runs after the run's last step, before the wake-up
        return "finished"

    handle = RunHandle.start(run())
    waiter = asyncio.ensure_future(handle.result())
    other = asyncio.ensure_future(handle.result())
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert await other == "finished" and handle.status == "completed"


async def test_waiters_of_a_cancelled_run_see_cancelled_error() -> None:
    handle = RunHandle.start(forever())
    waiters = [asyncio.ensure_future(handle.result()) for _ in range(3)]
    await settle()
    handle.cancel("bye")
    outcomes = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)


# -- events -------------------------------------------------------------------------------------


async def test_events_from_the_call_on_then_exactly_one_terminal_event() -> None:
    handle = RunHandle.start(fake_loop(steps=3))
    events = await drain(handle.events())
    assert [e.type for e in events] == ["text", "step_finished"] * 3 + ["handle_finished"]
    assert events[-1] == HandleFinished(handle.name, "completed", None, "fake finished 3 steps")
    # After the end: only the terminal event.
    assert await drain(handle.events()) == [events[-1]]


async def test_events_replay_nothing_from_before_the_call() -> None:
    handle = RunHandle.start(fake_loop(steps=4))
    await settle()  # a step or two went by unobserved
    events = await drain(handle.events())
    texts = [e.text for e in events if isinstance(e, TextChunk)]
    assert texts and texts[0] != "t0 " and texts[-1] == "t3 "
    assert len(terminals(events)) == 1


def _outcomes() -> list[tuple[str, Callable[[RunHandle[Any]], None], Callable[[], Any]]]:
    return [
        ("completed", lambda h: None, lambda: fake_loop(steps=3)),
        ("interrupted", lambda h: h.interrupt() and None, lambda: fake_loop()),
        ("cancelled", lambda h: h.cancel("why") and None, lambda: fake_loop()),
        ("failed", lambda h: None, boom),
    ]


@pytest.mark.parametrize(("status", "act", "make"), _outcomes(), ids=lambda x: str(x)[:12])
async def test_every_outcome_ends_every_consumer_with_one_terminal_event(
    status: str, act: Callable[[RunHandle[Any]], None], make: Callable[[], Any]
) -> None:
    handle = RunHandle.start(make())
    consumers = [asyncio.ensure_future(drain(handle.events())) for _ in range(3)]
    await settle()
    act(handle)
    with contextlib.suppress(BaseException):
        await handle
    for consumer in consumers:
        events = await consumer
        assert len(terminals(events)) == 1 and events[-1] is terminals(events)[0]
        assert events[-1].status == status
    assert handle.status == status


async def test_a_timed_out_run_ends_its_stream_with_one_terminal_event() -> None:
    handle = RunHandle.start(stubborn(), timeout=0.01)
    events = await drain(handle.events(maxsize=10_000))
    assert len(terminals(events)) == 1 and events[-1].status == "timed_out"  # type: ignore[union-attr]


async def test_a_slow_consumer_loses_only_chunks_and_never_the_terminal_event() -> None:
    async def chatty() -> str:
        scope = current_scope.get()
        assert scope is not None
        for i in range(20):
            scope.emit(TextChunk("chatty", f"{i}"))
            scope.emit(ThinkingChunk("chatty", "hmm"))
        scope.emit(ToolCallStarted("chatty", "c1", "look", {}))
        scope.emit(ToolResult("chatty", "c1", "look", "seen", False))
        scope.emit(StepFinished("chatty", 1))
        return "said a lot"

    handle = RunHandle.start(chatty())
    stream = handle.events(maxsize=5)
    await handle  # the run never waited for the consumer
    events = await drain(stream)
    assert [e.type for e in events] == [
        "text",
        "thinking",
        "text",
        "thinking",
        "text",
        "tool_call",
        "tool_result",
        "step_finished",
        "handle_finished",
    ]
    assert stream.dropped == 40 - 5
    with pytest.raises(ValueError, match="maxsize=0"):
        handle.events(maxsize=0)


async def test_a_nested_handles_terminal_event_stays_its_own() -> None:
    async def outer() -> object:
        return await RunHandle.start(fake_loop("inner", steps=1), name="inner")

    handle = RunHandle.start(outer(), name="outer")
    events = await drain(handle.events())
    assert [e.type for e in events] == ["text", "step_finished", "handle_finished"]
    assert terminals(events)[0].name == "outer"


async def test_a_consumer_that_leaves_early_is_detached() -> None:
    handle = RunHandle.start(stubborn())
    stream = handle.events()
    async for _ in stream:
        break
    await stream.aclose()
    assert await drain(stream) == []
    waiting = asyncio.ensure_future(drain(handle.events()))
    await settle()
    waiting.cancel()  # a consumer cancelled while it waits: nothing else changes
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert handle.cancel() is True
    with pytest.raises(asyncio.CancelledError):
        await handle


# -- done callbacks -----------------------------------------------------------------------------


async def test_done_callbacks_run_once_soon_after_the_end() -> None:
    calls: list[tuple[str, str]] = []

    def note(handle: RunHandle[Any]) -> None:
        calls.append((handle.name, handle.status))

    async def run() -> None:
        await asyncio.sleep(0)
        loop.call_soon(lambda: calls.append(("last step", handle.status)))

    loop = asyncio.get_running_loop()
    handle = RunHandle.start(run(), name="cb")
    handle.add_done_callback(note)
    handle.add_done_callback(note)
    handle.add_done_callback(print)
    assert handle.remove_done_callback(print) == 1
    assert handle.remove_done_callback(print) == 0
    await handle
    # Soon after the end (not inside the run's last step), before waiters resume.
    assert calls == [("last step", "completed"), ("cb", "completed"), ("cb", "completed")]
    handle.add_done_callback(note)  # already done: called soon
    await asyncio.sleep(0)
    assert len(calls) == 4


# -- threads ------------------------------------------------------------------------------------


async def test_cancel_and_interrupt_from_another_thread() -> None:
    handle = RunHandle.start(fake_loop())
    await settle()
    answers: list[bool] = []
    thread = threading.Thread(target=lambda: answers.append(handle.interrupt()))
    thread.start()
    await asyncio.to_thread(thread.join)
    assert answers == [True]
    assert await handle == INTERRUPTED

    running = RunHandle.start(forever())
    await settle()
    assert await asyncio.to_thread(running.cancel, "from a thread") is True
    with pytest.raises(asyncio.CancelledError):
        await running
    assert running.reason == "from a thread"
    assert await asyncio.to_thread(running.cancel) is False  # finished: nothing queued


async def test_cancel_from_another_thread_while_the_run_completes() -> None:
    outcomes: set[str] = set()
    for spin in range(40):
        handle = RunHandle.start(ticks(spin % 8, "finished"))
        thread = threading.Thread(target=handle.cancel, args=("race",))
        thread.start()
        try:
            reply = await handle
        except asyncio.CancelledError:
            assert handle.status == "cancelled" and handle.reason == "race"
        else:
            assert reply == "finished" and handle.status == "completed"
        outcomes.add(handle.status)
        await asyncio.to_thread(thread.join)
    assert outcomes <= {"completed", "cancelled"}


async def test_stop_from_another_threads_loop() -> None:
    handle = RunHandle.start(fake_loop())
    await settle()
    status = await asyncio.to_thread(asyncio.run, handle.stop(grace=5))
    assert status == "interrupted" and handle.done


def test_a_call_after_the_loop_closed_is_refused() -> None:
    box: list[RunHandle[None]] = []

    async def main() -> None:
        box.append(RunHandle.start(forever()))

    loop = asyncio.new_event_loop()
    loop.run_until_complete(main())
    handle = box[0]
    loop.close()
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(handle.cancel()))
    thread.start()
    thread.join()
    assert result == [False] and handle.status == "running"


# -- signals ------------------------------------------------------------------------------------

_SIGINT_CHILD = textwrap.dedent(
    """
    import asyncio, signal, sys
    from aimu.aio.run_handle import RunHandle, on_sigint
    from aimu.aio.scope import current_scope

    async def work(honour):
        scope = current_scope.get()
        said = False
        while True:
            await asyncio.sleep(0.005)
            if scope.interrupt_requested and not said:
                print("interrupt seen", flush=True)
                said = True
                if honour:
                    scope.note_interrupted()
                    return "Run interrupted."

    async def main(honour):
        before = signal.getsignal(signal.SIGINT)
        handle = RunHandle.start(work(honour))
        on_sigint(handle)
        print("ready", flush=True)
        try:
            await handle
        except asyncio.CancelledError:
            pass
        print(handle.status, handle.reason, flush=True)
        print("restored", signal.getsignal(signal.SIGINT) is before, flush=True)

    asyncio.run(main(sys.argv[1] == "honour"))
    """
)


def _child(mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _SIGINT_CHILD, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def _expect(child: subprocess.Popen[str], line: str) -> None:
    assert child.stdout is not None
    got = child.stdout.readline().strip()
    assert got == line, (got, child.stderr.read() if child.stderr else "")


def test_on_sigint_first_press_interrupts_and_the_handler_goes_away() -> None:
    child = _child("honour")
    try:
        _expect(child, "ready")
        child.send_signal(signal.SIGINT)
        _expect(child, "interrupt seen")
        _expect(child, "interrupted None")
        _expect(child, "restored True")
        assert child.wait(timeout=10) == 0
    finally:
        child.kill()
        child.communicate()


def test_on_sigint_second_press_cancels() -> None:
    child = _child("ignore")
    try:
        _expect(child, "ready")
        child.send_signal(signal.SIGINT)
        _expect(child, "interrupt seen")
        child.send_signal(signal.SIGINT)
        _expect(child, "cancelled SIGINT")
        _expect(child, "restored True")
        assert child.wait(timeout=10) == 0
    finally:
        child.kill()
        child.communicate()


async def test_on_sigint_restores_the_previous_handler_when_the_run_ends() -> None:
    before = signal.getsignal(signal.SIGINT)
    handle = RunHandle.start(fake_loop())
    remove = on_sigint(handle)
    assert signal.getsignal(signal.SIGINT) is not before
    signal.raise_signal(signal.SIGINT)  # the first press: an interrupt, queued to the loop
    assert await handle == INTERRUPTED
    await asyncio.sleep(0)  # the done callback
    assert signal.getsignal(signal.SIGINT) is before
    remove()  # removing again changes nothing
    assert signal.getsignal(signal.SIGINT) is before
    assert on_sigint(handle)() is None  # a finished handle: nothing installed

    other = RunHandle.start(forever())
    with pytest.raises(RuntimeError, match="main thread"):
        await asyncio.to_thread(on_sigint, other)
    other.cancel()
    with pytest.raises(asyncio.CancelledError):
        await other


# -- many handles ---------------------------------------------------------------------------------


async def test_a_thousand_handles_cancelled_at_random_points_leave_nothing() -> None:
    rng = random.Random(4)

    async def work(steps: int, fails: bool) -> int:
        scope = current_scope.get()
        assert scope is not None
        for _ in range(steps):
            await asyncio.sleep(0)
            scope.emit(TextChunk("w", "."))
        if fails:
            raise ValueError("planned")
        return steps

    handles = []
    for _ in range(1000):
        handle = RunHandle.start(
            work(rng.randrange(6), rng.random() < 0.1), timeout=rng.choice([None, 0.001, 60])
        )
        if rng.random() < 0.2:
            handle.events(maxsize=2)  # a consumer that never reads
        handles.append((handle, rng.randrange(8), rng.random() < 0.7))
    for tick in range(8):
        for handle, at, cancels in handles:
            if cancels and at == tick:
                handle.cancel("random")
            elif at == tick and tick % 3 == 0:
                handle.interrupt()
        await asyncio.sleep(0)
    outcomes = await asyncio.gather(*(h.result() for h, _, _ in handles), return_exceptions=True)
    statuses = {h.status for h, _, _ in handles}
    assert statuses <= {"completed", "cancelled", "failed", "timed_out"}
    assert {"completed", "cancelled", "failed"} <= statuses
    for (handle, _, _), outcome in zip(handles, outcomes, strict=True):
        assert handle.done
        if handle.status == "cancelled":
            assert isinstance(outcome, asyncio.CancelledError)
    await settle()
    assert asyncio.all_tasks() == {asyncio.current_task()}


# -- with a real agent -------------------------------------------------------------------------


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


async def test_a_real_agent_under_a_handle_interrupts_between_steps() -> None:
    model = ScriptedModel(
        [
            Turn(tool_calls=(ScriptedCall("add", {"a": 1, "b": 2}),), delay=0.001),
            Turn(text="three it is", delay=0.001),
        ]
    )
    agent = aio.Agent(model, tools=[add])
    handle = RunHandle.start(agent.run("add 1 and 2"))
    events: list[Event] = []
    async for event in handle.events():
        events.append(event)
        if isinstance(event, ToolCallStarted):
            handle.interrupt()
    assert await handle == INTERRUPTED and handle.status == "interrupted"
    assert handle.name == agent.name
    assert [e.type for e in events][-2:] == ["run_finished", "handle_finished"]
    assert isinstance(events[-2], RunFinished) and events[-2].status == "interrupted"
    validate(agent.model_client.messages)
    assert await agent.resume() == "three it is"


async def test_an_interrupt_while_the_agents_last_turn_finishes_completes() -> None:
    model = ScriptedModel([Turn(text="a b c", delay=0.001), Turn(text="again")])
    agent = aio.Agent(model)
    handle = RunHandle.start(agent.run("spell"))
    async for event in handle.events():
        if isinstance(event, TextChunk) and event.text == "b ":
            assert handle.interrupt() is True  # the answer is still streaming
    assert await handle == "a b c"  # no step boundary was left: the answer stands
    assert handle.status == "completed" and handle.scope.halt is None
    assert await RunHandle.start(agent.run("once more")) == "again"  # nothing left set


async def test_a_real_agent_cancelled_mid_stream_keeps_a_valid_transcript() -> None:
    model = ScriptedModel([Turn(text="one two three four five", delay=0.001)])
    agent = aio.Agent(model)
    handle = RunHandle.start(agent.run("count"))
    async for event in handle.events():
        if isinstance(event, TextChunk):
            handle.cancel("user pressed stop")
    with pytest.raises(asyncio.CancelledError):
        await handle
    messages = agent.model_client.messages
    validate(messages)
    assert messages[-1].get("aimu_partial") is True
    assert model.open_streams == 0


@pytest.fixture
async def slow_server() -> AsyncIterator[LoopbackServer]:
    async with LoopbackServer([Turn(text="one two three four five six", delay=0.05)]) as server:
        yield server


async def test_cancel_while_awaiting_a_streamed_loopback_reply(
    slow_server: LoopbackServer,
) -> None:
    agent = aio.Agent(aio.client("ollama:test", host=slow_server.url))
    try:
        handle = RunHandle.start(agent.run("stream to me"))
        async for event in handle.events():
            if isinstance(event, TextChunk):
                handle.cancel("user pressed stop")
        with pytest.raises(asyncio.CancelledError):
            await handle
        (record,) = await slow_server.wait_abandoned(1)
        assert record.abandoned and not record.completed
        validate(agent.model_client.messages)
    finally:
        await agent.aclose()


async def test_a_deadline_while_awaiting_a_streamed_loopback_reply(
    slow_server: LoopbackServer,
) -> None:
    agent = aio.Agent(aio.client("ollama:test", host=slow_server.url))
    try:
        handle = RunHandle.start(agent.run("stream to me"), timeout=60)
        async for event in handle.events():
            if isinstance(event, TextChunk):  # the reply is provably streaming: now
                handle.reschedule(asyncio.get_running_loop().time())
        with pytest.raises(TimeoutError):
            await handle
        assert handle.status == "timed_out"
        assert (await slow_server.wait_abandoned(1))[0].abandoned
    finally:
        await agent.aclose()


async def test_a_workflow_under_a_handle_is_cancelled_everywhere() -> None:
    model = ScriptedModel([Turn(text="a b c d e f", delay=0.002)] * 2)
    first = aio.Agent(model, name="first")
    second = aio.Agent(model.fork(), name="second")
    chain = aio.Chain([first, second])
    handle = RunHandle.start(chain.run("go"))
    async for event in handle.events():
        if isinstance(event, TextChunk) and event.source == "first":
            handle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert handle.status == "cancelled"
    validate(first.model_client.messages)
    assert model.open_streams == 0


# -- nesting ----------------------------------------------------------------------------------


async def test_reschedule_moves_the_deadline_and_refuses_a_finished_run() -> None:
    loop = asyncio.get_running_loop()
    handle = RunHandle.start(forever(), timeout=60)
    assert handle.when() == handle.scope.deadline
    handle.reschedule(None)
    assert handle.when() is None
    handle.reschedule(loop.time())
    with pytest.raises(TimeoutError):
        await handle
    assert handle.status == "timed_out"
    with pytest.raises(RuntimeError, match="cannot reschedule run 'forever': it is timed_out"):
        handle.reschedule(None)


async def test_outer_cancel_reaches_an_inner_run_streaming_over_http(
    slow_server: LoopbackServer,
) -> None:
    # Regression (hardening issue, defect 6): the inner run kept streaming.
    agent = aio.Agent(aio.client("ollama:test", host=slow_server.url))
    inner: list[RunHandle[str]] = []
    streaming = asyncio.Event()

    async def supervisor() -> str:
        handle = RunHandle.start(agent.run("stream to me"), name="inner")
        inner.append(handle)
        async for event in handle.events():
            if isinstance(event, TextChunk):
                streaming.set()
        return await handle

    try:
        outer = RunHandle.start(supervisor(), name="outer")
        await streaming.wait()
        outer.cancel("supervisor stopped")
        with pytest.raises(asyncio.CancelledError):
            await outer
        assert inner[0].done and inner[0].status == "cancelled"
        assert inner[0].reason == "supervisor stopped"
        (record,) = await slow_server.wait_abandoned(1)
        assert record.abandoned and not record.completed
        validate(agent.model_client.messages)
    finally:
        await agent.aclose()


async def test_an_outer_deadline_ends_the_outer_run_after_the_inner_one_over_http(
    slow_server: LoopbackServer,
) -> None:
    # Regression (defect 6): the outer handle reported timed_out while the inner streamed.
    agent = aio.Agent(aio.client("ollama:test", host=slow_server.url))
    inner: list[RunHandle[str]] = []

    async def supervisor() -> str:
        handle = RunHandle.start(agent.run("stream to me"), name="inner", timeout=60)
        inner.append(handle)
        async for event in handle.events():
            if isinstance(event, TextChunk):  # streaming: the outer deadline passes now
                outer.reschedule(asyncio.get_running_loop().time())
        return await handle

    try:
        outer = RunHandle.start(supervisor(), name="outer", timeout=60)
        with pytest.raises(TimeoutError):
            await outer
        assert outer.status == "timed_out"
        assert inner[0].done and inner[0].status == "timed_out"  # ended before the outer
        (record,) = await slow_server.wait_abandoned(1)
        assert record.abandoned
    finally:
        await agent.aclose()


async def test_an_outer_run_that_returns_waits_for_the_inner_one() -> None:
    release = asyncio.Event()
    inner: list[RunHandle[Any]] = []

    async def worker() -> str:
        await release.wait()
        return "inner done"

    async def supervisor() -> str:
        inner.append(RunHandle.start(worker(), name="worker"))
        return "outer returned"

    outer = RunHandle.start(supervisor())
    done_at: list[str] = []
    outer.add_done_callback(lambda h: done_at.append(inner[0].status))
    await settle()
    assert outer.status == "running" and inner[0].status == "running"
    release.set()
    assert await outer == "outer returned"
    assert done_at == ["completed"] and await inner[0] == "inner done"


async def test_a_detached_run_outlives_its_starter() -> None:
    release = asyncio.Event()
    detached: list[RunHandle[Any]] = []

    async def worker() -> str:
        await release.wait()
        return "detached done"

    async def supervisor() -> None:
        detached.append(RunHandle.start(worker(), detached=True))
        await asyncio.Event().wait()

    outer = RunHandle.start(supervisor(), timeout=60)
    await settle()
    outer.interrupt()
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    handle = detached[0]
    assert handle.status == "running" and handle.scope.parent is None
    assert handle.when() is None and not handle.scope.interrupt_requested
    release.set()
    assert await handle == "detached done"


async def test_a_failing_outer_run_cancels_its_inner_runs() -> None:
    inner: list[RunHandle[Any]] = []

    async def supervisor() -> None:
        inner.append(RunHandle.start(forever(), name="left behind"))
        await asyncio.sleep(0)
        raise ValueError("supervisor broke")

    outer = RunHandle.start(supervisor())
    with pytest.raises(ValueError, match="supervisor broke"):
        await outer
    assert inner[0].status == "cancelled"


async def test_a_handle_is_a_good_asyncio_citizen() -> None:
    ok = RunHandle.start(value("fine"), name="ok")
    bad = RunHandle.start(boom(), name="bad")
    _, pending = await asyncio.wait([ok.task, bad.task])
    assert not pending and ok.done and bad.done
    assert ok.task.result() == "fine" and ok.exception() is None
    assert isinstance(bad.exception(), ValueError) and bad.task.exception() is bad.exception()
    assert ok.get_name() == "ok"
    assert await asyncio.gather(ok, ok.result()) == ["fine", "fine"]
    late = RunHandle.start(forever(), timeout=60)
    with pytest.raises(asyncio.InvalidStateError, match="still"):
        late.exception()
    gathered = asyncio.gather(late.task)
    await settle()
    gathered.cancel()  # a gather cancels its tasks: the task's cancel is the run's
    with pytest.raises(asyncio.CancelledError):
        await gathered
    assert late.status == "cancelled"
    with pytest.raises(asyncio.CancelledError):
        late.exception()
    timed = RunHandle.start(forever(), timeout=0)
    with pytest.raises(TimeoutError):
        await timed.task
    assert isinstance(timed.exception(), TimeoutError)


# -- wait() and final: the outcome without exceptions (issue 22) ------------------------------


async def test_wait_never_raises_and_returns_the_terminal_event_for_every_outcome() -> None:
    async def returns() -> str:
        return "done"

    async def fails() -> str:
        raise LookupError("no such thing")

    async def hangs() -> str:
        await asyncio.Event().wait()
        return "never"

    completed = RunHandle.start(returns())
    failed = RunHandle.start(fails())
    cancelled = RunHandle.start(hangs())
    timed_out = RunHandle.start(hangs(), timeout=0.01)
    assert completed.final is None  # still pending
    cancelled.cancel("the user pressed stop")
    finals = [await h.wait() for h in (completed, failed, cancelled, timed_out)]
    assert [f.status for f in finals] == ["completed", "failed", "cancelled", "timed_out"]
    assert finals[0].result == "done" and finals[0].error is None
    assert finals[1].error == "LookupError: no such thing"
    assert finals[2].reason == "the user pressed stop"
    assert finals[3].reason == "deadline passed"
    for handle, final in zip((completed, failed, cancelled, timed_out), finals, strict=True):
        assert handle.final is final  # the same event events() ends with
        assert [e async for e in handle.events()] == [final]
    with pytest.raises(LookupError):
        await failed  # awaiting the handle still raises, as before


async def test_a_cancelled_waiter_only_stops_waiting_and_wait_works_from_another_loop() -> None:
    release = asyncio.Event()

    async def held() -> str:
        await release.wait()
        return "released"

    handle = RunHandle.start(held())
    waiter = asyncio.ensure_future(handle.wait())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert handle.status == "running"
    loop = asyncio.get_running_loop()
    other = loop.run_in_executor(None, asyncio.run, handle.wait())  # another thread's loop
    release.set()
    final = await other
    assert final.status == "completed" and final.result == "released"
