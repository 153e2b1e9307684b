"""RunHandle: a run scheduled as a task that can be cancelled, interrupted or stopped.

:meth:`RunHandle.start` runs any awaitable in a task whose context holds a fresh
:class:`~aimu.aio.scope.RunScope` (``current_scope``); every aimu loop inside finds it,
stops at its next step boundary when asked to (``interrupt()``) and emits its events
there (``events()``). ``cancel()`` is the hard stop; a deadline cancels on its own.

The state machine (``_State``)::

    PENDING ──first step──▶ RUNNING ──the run returns──▶ COMPLETED, or INTERRUPTED
       │                      │     ──the run raises───▶ FAILED
       │                      │     ──CancelledError───▶ CANCELLED
       ├──cancel()────────────┴──▶ CANCELLING ──the run ends──▶ CANCELLED (COMPLETED or
       │                      │        ▲                        FAILED if it returned or
       │                      │        │ cancel()               raised instead)
       └──deadline────────────┴──▶ EXPIRING ──the run ends──▶ TIMED_OUT, or CANCELLED
                                                              if another cancel came too

The five on the right are final. Moves the diagram lacks are refused: ``cancel()`` and
``interrupt()`` answer False on a final handle, and a second finish raises
``RuntimeError`` naming the state it found. A cancel (or deadline)
that comes while PENDING is delivered at the task's first step, so it lands at the
run's first ``await``: its opening lines (an agent recording the task) still run.
``interrupt()`` is a request, not a state: it sets the scope's ``interrupt_requested``
while PENDING or RUNNING. A run that returns ends INTERRUPTED when a loop in its scope
honoured an interrupt (``scope.interrupt_honoured``: agents and workflows record it, a
loop of your own calls ``scope.note_interrupted()``), else COMPLETED, even if one was
asked for. The deadline counts its cancel as ``asyncio.timeout`` does: TIMED_OUT only
when its cancel is the task's only one (``task.cancelling()``), so a cancel from
anywhere else, even in the same loop iteration, is reported as CANCELLED.

Awaiting a handle never cancels the run. Unlike awaiting a task, a waiter that is itself
cancelled only stops waiting::

    handle = RunHandle.start(agent.run(task))
    try:
        async with asyncio.timeout(2):
            reply = await handle          # gives up after 2 s ...
    except TimeoutError:
        print(handle.status)              # ... and the run is still "running"
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import inspect
import signal
import threading
import time
import types
from asyncio import CancelledError, Future, InvalidStateError, Task
from asyncio.events import _get_running_loop
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast, final

from aimu.aio.events import Event, HandleFinished, HandleStatus, TextChunk, ThinkingChunk
from aimu.aio.scope import RunScope, current_scope

__all__ = ["EventStream", "RunControl", "RunHandle", "on_sigint"]

T = TypeVar("T")
DoneCallback = Callable[["RunHandle[Any]"], object]


class _State(enum.Enum):
    # Members are singletons: identity hashing keeps ``state in _LIVE`` in C.
    __hash__ = object.__hash__

    PENDING = "pending"
    RUNNING = "running"
    CANCELLING = "cancelling"
    EXPIRING = "expiring"
    COMPLETED = "completed"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    FAILED = "failed"


# Module-level names: the hot path reads globals, not enum class attributes.
_PENDING = _State.PENDING
_RUNNING = _State.RUNNING
_CANCELLING = _State.CANCELLING
_EXPIRING = _State.EXPIRING
_COMPLETED = _State.COMPLETED
_INTERRUPTED = _State.INTERRUPTED
_LIVE = frozenset({_PENDING, _RUNNING, _CANCELLING, _EXPIRING})
_DROPPABLE = (TextChunk, ThinkingChunk)
_new = object.__new__
_monotonic = time.monotonic
_CoroutineType = types.CoroutineType


class _Suspend(tuple[None]):
    """``await _SUSPEND`` yields once, with no Python frame (a tuple iterator)."""

    __slots__ = ()
    if TYPE_CHECKING:

        def __await__(self) -> Generator[None, None, None]: ...

    else:
        __await__ = tuple.__iter__


_SUSPEND = _Suspend((None,))


async def _await(awaitable: Awaitable[T]) -> T:
    return await awaitable


def _noop() -> None:
    pass


def _close_unstarted(coro: types.CoroutineType[Any, Any, Any]) -> None:
    """Close a run coroutine that a stop reached before it began (no "never awaited")."""
    if coro.cr_frame is not None and not coro.cr_suspended and not coro.cr_running:
        coro.close()


class RunControl(Protocol):
    """What ``RunHandle.start(control=...)`` needs: a run id, then the handle to watch.

    ``run_id(wanted)`` checks (or, for None, makes) the id before anything is scheduled,
    raising on a bad one; ``attach(handle)`` must not raise. ``aio.RedisControl`` is one.
    """

    def run_id(self, wanted: str | None) -> str: ...

    def attach(self, handle: RunHandle[Any]) -> None: ...


class _Extra:
    """What only some runs need, made on first use so that ``start()`` stays thin."""

    __slots__ = (
        "callbacks",
        "cancels",
        "reason",
        "run_id",
        "started",
        "streams",
        "terminal",
        "timer",
        "waiters",
        "watchers",
    )

    def __init__(self) -> None:
        self.reason: str | None = None
        self.started = True
        """False when a cancel or the deadline came before the first step."""
        self.timer: asyncio.TimerHandle | None = None
        self.cancels = 0
        """``task.cancelling()`` just before the deadline's own cancel."""
        self.callbacks: list[tuple[DoneCallback, contextvars.Context]] | None = None
        self.streams: list[EventStream] | None = None
        self.waiters: list[Future[Any]] | None = None
        """Awaiters after the first (the first is ``RunHandle._waiter``)."""
        self.watchers: list[Future[None]] | None = None
        """Futures set to None when the run ends (stop() waits on these)."""
        self.terminal: HandleFinished | None = None
        self.run_id: str | None = None


@final
class RunHandle(Generic[T]):
    """A run scheduled as a task: cancel, interrupt, stop, await, observe.

    Make one with :meth:`start`. ``await handle`` (or ``await handle.result()``) returns
    the run's result or raises ``CancelledError``, ``TimeoutError`` or the run's error.
    """

    __slots__ = (
        "__weakref__",
        "_error",
        "_extra",
        "_loop",
        "_result",
        "_scope",
        "_started_at",
        "_state",
        "_task",
        "_waiter",
    )

    _loop: asyncio.AbstractEventLoop
    _task: Task[None]
    _scope: RunScope
    _state: _State
    _waiter: Future[T] | None
    _extra: _Extra | None
    _started_at: float
    _result: T
    _error: BaseException | None

    def __init__(self) -> None:
        raise TypeError("use RunHandle.start(coro) to make a RunHandle")

    @classmethod
    def start(
        cls,
        coro: Awaitable[T],
        *,
        name: str | None = None,
        timeout: float | None = None,
        deadline: float | None = None,
        run_id: str | None = None,
        control: RunControl | None = None,
    ) -> RunHandle[T]:
        """Schedule ``coro`` (any awaitable) as a task in a fresh run scope; return its handle.

        ``timeout`` (seconds) or ``deadline`` (``loop.time()``) cancel the run when they
        pass (the earlier wins, and so does a deadline of the scope around). Needs a
        running event loop; a non-awaitable raises ``TypeError``. ``control`` (such as
        ``aio.RedisControl``) registers the run under ``run_id`` (made when None).
        """
        run: types.CoroutineType[Any, Any, T]
        if type(coro) is _CoroutineType:
            run = coro
            if name is None:
                name = coro.__qualname__
        elif inspect.isawaitable(coro):
            run = cast("types.CoroutineType[Any, Any, T]", _await(coro))
            if name is None:
                name = getattr(coro, "__qualname__", None) or type(coro).__qualname__
        else:
            raise TypeError(
                f"RunHandle.start() needs a coroutine or another awaitable, "
                f"not {type(coro).__name__}"
            )
        loop = _get_running_loop()
        if loop is None:
            run.close()  # no "coroutine was never awaited" warning
            raise RuntimeError(
                "RunHandle.start() needs a running event loop: call it from async code "
                "(for example inside asyncio.run())"
            )
        if control is not None:
            try:
                run_id = control.run_id(run_id)
            except BaseException:
                run.close()
                raise
        self = _new(cls)
        self._loop = loop
        self._state = _PENDING
        self._waiter = None
        self._extra = None
        self._started_at = _monotonic()
        if timeout is not None:
            at = loop.time() + timeout
            deadline = at if deadline is None else min(at, deadline)
        parent = current_scope.get()
        if parent is not None and parent.deadline is not None:
            deadline = parent.deadline if deadline is None else min(deadline, parent.deadline)
        # RunScope(name, parent=parent, deadline=deadline), field by field: its Python
        # __init__ would cost a twentieth of a trivial run (tests hold the two equal).
        self._scope = scope = _new(RunScope)
        scope.name = name
        scope.parent = parent
        scope.deadline = deadline
        scope._interrupt_requested = False
        scope.interrupt_honoured = False
        scope._listeners = None
        # Started here up to its first await, so that a cancel from outside landing before
        # the task's first step (asyncio.run() cancelling every task as it ends) still
        # runs _drive's handlers, which settle the handle and close the run's coroutine.
        drive = self._drive(run)
        drive.send(None)
        try:  # BaseEventLoop keeps it here; other loops answer get_task_factory()
            factory = loop._task_factory  # type: ignore[attr-defined]
        except AttributeError:
            factory = loop.get_task_factory()
        if factory is None:
            self._task = Task(drive, loop=loop)  # what loop.create_task() does, less a call
        else:
            self._task = loop.create_task(drive)
        if deadline is not None:
            self._more().timer = loop.call_at(deadline, self._expire)
        if run_id is not None:
            self._more().run_id = run_id
            if control is not None:
                control.attach(self)
        return self

    # -- the run -------------------------------------------------------------------

    async def _drive(self, coro: types.CoroutineType[Any, Any, T]) -> None:
        try:
            await _SUSPEND
            current_scope.set(self._scope)
            if self._state is _PENDING:
                self._state = _RUNNING
            else:
                # cancel() or the deadline came before this first step: deliver it now,
                # so that it lands at the run's first await (its opening lines still run).
                extra = self._more()
                extra.started = True
                extra.cancels = self._task.cancelling()
                self._task.cancel(extra.reason if self._state is _CANCELLING else None)
            result = await coro
        except CancelledError as stop:
            _close_unstarted(coro)
            self._cancelled(stop)
            raise
        except GeneratorExit:
            # The task was destroyed unfinished (its loop closed): nothing to report to.
            _close_unstarted(coro)
            raise
        except (KeyboardInterrupt, SystemExit) as error:
            self._failed(error)
            raise  # asyncio stops the loop with these; they are not the run's to keep
        except BaseException as error:
            # Kept on the handle (and raised to its waiters), not left in the task: a
            # handle nobody awaits never logs "Task exception was never retrieved".
            self._failed(error)
        else:
            # Inline, not a method: this is every run's way out.
            self._result = result
            self._state = _INTERRUPTED if self._scope.interrupt_honoured else _COMPLETED
            if self._extra is not None:
                self._finish_extra()
            waiter = self._waiter
            if waiter is not None:
                try:  # noqa: SIM105 - cheaper than contextlib.suppress on this path
                    waiter.set_result(result)
                except InvalidStateError:  # its awaiter gave up waiting
                    pass

    def _failed(self, error: BaseException) -> None:
        state = self._state
        if state not in _LIVE:
            raise RuntimeError(f"RunHandle {self.name!r} is already {state.value}")
        self._error = error
        self._state = _State.FAILED
        self._settle_waiters()

    def _cancelled(self, stop: CancelledError) -> None:
        state = self._state
        if state not in _LIVE:
            raise RuntimeError(f"RunHandle {self.name!r} is already {state.value}")
        extra = self._extra
        if state is _EXPIRING and extra is not None and self._task.uncancel() <= extra.cancels:
            # No cancel came besides the deadline's own: a timeout (as in asyncio.timeout).
            self._state = _State.TIMED_OUT
            if extra.reason is None:
                extra.reason = "deadline passed"
            self._error = TimeoutError(f"run {self.name!r} passed its deadline")
        else:
            self._state = _State.CANCELLED
            if state is not _CANCELLING and stop.args and isinstance(stop.args[0], str):
                self._more().reason = stop.args[0]  # a cancel from outside, with a message
            self._error = None
        self._settle_waiters()

    def _settle_waiters(self) -> None:
        if self._extra is not None:
            self._finish_extra()
        if self._waiter is not None:
            self._settle(self._waiter)

    def _settle(self, waiter: Future[T]) -> None:
        """Give ``waiter`` the outcome of the finished run (unless its awaiter gave up)."""
        if waiter.done():
            return
        state = self._state
        if state is _COMPLETED or state is _INTERRUPTED:
            waiter.set_result(self._result)
        elif state is _State.CANCELLED:
            waiter.cancel(self.reason)
        else:
            assert self._error is not None
            waiter.set_exception(self._error)

    def _finish_extra(self) -> None:
        """End what only some runs have, in the order they hear of it: done callbacks
        (on_sigint's restore among them), event streams, stop() and then the waiters."""
        extra = self._extra
        assert extra is not None
        if extra.timer is not None:
            extra.timer.cancel()
            extra.timer = None
        if extra.callbacks is not None:
            for callback, context in extra.callbacks:
                self._loop.call_soon(callback, self, context=context)
            extra.callbacks = None
        if extra.streams is not None:
            terminal = self._terminal()
            for stream in extra.streams:
                stream._end(terminal)
            extra.streams = None
        if extra.watchers is not None:
            for watcher in extra.watchers:
                if not watcher.done():
                    watcher.set_result(None)
            extra.watchers = None
        if extra.waiters is not None:
            for waiter in extra.waiters:
                self._settle(waiter)
            extra.waiters = None

    def _more(self) -> _Extra:
        extra = self._extra
        if extra is None:
            extra = self._extra = _Extra()
        return extra

    def _terminal(self) -> HandleFinished:
        extra = self._more()
        if extra.terminal is None:
            returned = self._state in _RETURNED
            error = None if returned else self._error
            extra.terminal = HandleFinished(
                self.name,
                self.status,
                extra.reason,
                self._result if returned else None,
                None if error is None else f"{type(error).__name__}: {error}",
            )
        return extra.terminal

    def _expire(self) -> None:
        state = self._state
        if state is _PENDING or state is _RUNNING:
            extra = self._more()
            extra.timer = None
            self._state = _EXPIRING
            if state is _RUNNING:
                extra.cancels = self._task.cancelling()
                self._task.cancel()
            else:
                extra.started = False  # _drive delivers the cancel at the task's first step

    # -- requests ------------------------------------------------------------------

    def cancel(self, reason: str | None = None) -> bool:
        """Stop the run at its next ``await``; False if it had already finished.

        ``reason`` is kept in ``reason`` and the terminal event. A second cancel changes
        nothing and returns True while the run is still stopping. Off the loop's thread
        the cancel is queued (``call_soon_threadsafe``): True means the run had not
        finished when asked, False that it had (or that its loop is closed).
        """
        loop = self._loop
        if _get_running_loop() is not loop:
            return self._queue(self._cancel, reason)
        accepted = self._cancel(reason)
        if accepted and asyncio.current_task(loop) is None:
            # Called from a plain callback, or from a signal handler while the loop
            # sleeps in select(): wake it so the cancel is seen now.
            loop.call_soon_threadsafe(_noop)
        return accepted

    def _cancel(self, reason: str | None) -> bool:
        state = self._state
        if state is _CANCELLING:
            return True
        if state is not _PENDING and state is not _RUNNING and state is not _EXPIRING:
            return False
        extra = self._more()
        extra.reason = reason
        self._state = _CANCELLING
        if state is _PENDING:
            extra.started = False  # _drive delivers the cancel at the task's first step
        elif state is _RUNNING:
            self._task.cancel(reason)
        # EXPIRING: the deadline's cancel is on its way; this one only changes the verdict.
        return True

    def interrupt(self) -> bool:
        """Ask every aimu loop in the run to stop at its next step boundary.

        True if asked; False if the run had finished or is being cancelled. Off the
        loop's thread it is queued as for :meth:`cancel`, with the same return values.
        """
        if _get_running_loop() is not self._loop:
            return self._queue(self._interrupt)
        return self._interrupt()

    def _interrupt(self) -> bool:
        state = self._state
        if state is _PENDING or state is _RUNNING:
            self._scope.request_interrupt()
            return True
        return False

    def _queue(self, request: Callable[..., bool], *args: object) -> bool:
        if self._state not in _LIVE:
            return False
        try:
            self._loop.call_soon_threadsafe(request, *args)
        except RuntimeError:  # the loop is closed: nothing will ever run the request
            return False
        return True

    async def stop(self, grace: float = 5.0) -> HandleStatus:
        """Interrupt, wait up to ``grace`` seconds, then cancel; return the final status.

        Safe from another thread's event loop (it runs on the handle's loop). Stopping a
        finished handle returns its status at once; cancelling ``stop()`` itself only
        stops the waiting.
        """
        loop = self._loop
        if _get_running_loop() is not loop:
            future = asyncio.run_coroutine_threadsafe(self._stop(grace), loop)
            return await asyncio.wrap_future(future)
        return await self._stop(grace)

    async def _stop(self, grace: float) -> HandleStatus:
        if self._state in _LIVE:
            self._interrupt()
            if not await self._wait_done(grace):
                self._cancel(f"stop(): still running {grace:g} s after the interrupt")
                await self._wait_done(None)
        return self.status

    async def _wait_done(self, seconds: float | None) -> bool:
        """Wait until the run ends or ``seconds`` pass; True if it ended."""
        if self._state not in _LIVE:
            return True
        if seconds is not None and seconds <= 0:
            return False
        watcher: Future[None] = self._loop.create_future()
        extra = self._more()
        if extra.watchers is None:
            extra.watchers = []
        extra.watchers.append(watcher)
        try:
            done, _ = await asyncio.wait((watcher,), timeout=seconds)
        finally:
            if not watcher.done():
                watcher.cancel()
                if extra.watchers is not None:
                    extra.watchers.remove(watcher)
        return bool(done)

    # -- results -------------------------------------------------------------------

    def __await__(self) -> Generator[Any, None, T]:
        # Our own future, settled by _drive: cancelling the awaiter cancels only it.
        waiter: Future[T] = Future(loop=self._loop)
        state = self._state
        if state is _PENDING or state is _RUNNING or state is _CANCELLING or state is _EXPIRING:
            if self._waiter is None:
                self._waiter = waiter
            else:
                extra = self._more()
                if extra.waiters is None:
                    extra.waiters = []
                extra.waiters.append(waiter)
        else:
            self._settle(waiter)
        return waiter.__await__()

    async def result(self) -> T:
        """The run's result; raises ``CancelledError``, ``TimeoutError`` or its error."""
        return await self

    # -- observing -------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The ``name=`` given to start(), else the coroutine's qualified name."""
        return self._scope.name

    @property
    def run_id(self) -> str | None:
        """The ``run_id`` given to start() (made by its ``control`` when not given)."""
        extra = self._extra
        return None if extra is None else extra.run_id

    @property
    def scope(self) -> RunScope:
        """The run scope the loops inside this run find in ``current_scope``."""
        return self._scope

    @property
    def done(self) -> bool:
        """True once the run has ended, whatever ended it."""
        return self._state not in _LIVE

    @property
    def cancelled(self) -> bool:
        """True when the run ended by a cancel (awaiting raises ``CancelledError``).

        A run stopped by its deadline is ``timed_out``, not cancelled.
        """
        return self._state is _State.CANCELLED

    @property
    def status(self) -> HandleStatus:
        """pending, running, completed, interrupted, cancelled, timed_out or failed."""
        state = self._state
        if state is _CANCELLING or state is _EXPIRING:
            extra = self._extra
            return "running" if extra is None or extra.started else "pending"
        return _STATUS[state]

    @property
    def reason(self) -> str | None:
        """Why the run was cancelled (the reason given, "SIGINT", "deadline passed")."""
        extra = self._extra
        return None if extra is None else extra.reason

    def add_done_callback(self, fn: DoneCallback) -> None:
        """Call ``fn(handle)`` on the loop soon after the run ends (soon, if it has ended).

        Callbacks run before the handle's waiters resume; call it on the loop's thread.
        """
        context = contextvars.copy_context()
        if self._state not in _LIVE:
            self._loop.call_soon(fn, self, context=context)
            return
        extra = self._more()
        if extra.callbacks is None:
            extra.callbacks = []
        extra.callbacks.append((fn, context))

    def remove_done_callback(self, fn: DoneCallback) -> int:
        """Remove every registration of ``fn``; return how many were removed."""
        extra = self._extra
        if extra is None or not extra.callbacks:
            return 0
        kept = [(f, c) for f, c in extra.callbacks if f != fn]
        removed = len(extra.callbacks) - len(kept)
        extra.callbacks = kept
        return removed

    def events(self, *, maxsize: int = 1024) -> EventStream:
        """Iterate the events emitted in this run from now on, then one HandleFinished.

        Nothing emitted before the call is replayed; called after the run ended it
        yields only the terminal event. See :class:`EventStream` for the buffer.
        """
        stream = EventStream(self._loop, maxsize)
        if self._state not in _LIVE:
            stream._end(self._terminal())
            return stream
        extra = self._more()
        if extra.streams is None:
            extra.streams = []
        extra.streams.append(stream)
        stream._remove = self._scope.add_listener(stream._push)
        return stream

    def __repr__(self) -> str:
        age = _monotonic() - self._started_at
        reason = self.reason
        extra = f" reason={reason!r}" if reason else ""
        return f"<RunHandle {self.name!r} {self.status} age={age:.3f}s{extra}>"


_RETURNED = frozenset({_State.COMPLETED, _State.INTERRUPTED})
_STATUS: dict[_State, HandleStatus] = {
    _PENDING: "pending",
    _RUNNING: "running",
    _State.COMPLETED: "completed",
    _State.INTERRUPTED: "interrupted",
    _State.CANCELLED: "cancelled",
    _State.TIMED_OUT: "timed_out",
    _State.FAILED: "failed",
}


@final
class EventStream(AsyncIterator[Event]):
    """One consumer's view of a run's events, ending with exactly one HandleFinished.

    The run never waits for a consumer. The buffer holds ``maxsize`` events; when it is
    full, new TextChunk and ThinkingChunk events are dropped (counted in ``dropped``),
    while every other event, the terminal one included, is always kept.
    """

    __slots__ = ("_buffer", "_ended", "_loop", "_maxsize", "_remove", "_waiter", "dropped")

    def __init__(self, loop: asyncio.AbstractEventLoop, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"events(maxsize={maxsize}): the buffer needs room for 1 event")
        self._loop = loop
        self._maxsize = maxsize
        self._buffer: deque[Event] = deque()
        self._waiter: Future[None] | None = None
        self._ended = False
        self._remove: Callable[[], None] | None = None
        #: Text and thinking chunks dropped because this consumer fell behind.
        self.dropped = 0

    def _push(self, event: Event) -> None:
        if self._ended:
            return
        if len(self._buffer) >= self._maxsize and isinstance(event, _DROPPABLE):
            self.dropped += 1
            return
        self._buffer.append(event)
        self._wake()

    def _end(self, terminal: HandleFinished) -> None:
        if self._ended:
            return
        self._buffer.append(terminal)
        self._detach()
        self._wake()

    def _detach(self) -> None:
        self._ended = True
        if self._remove is not None:
            self._remove()
            self._remove = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Event:
        while not self._buffer:
            if self._ended:
                raise StopAsyncIteration
            self._waiter = waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return self._buffer.popleft()

    async def aclose(self) -> None:
        """Stop listening; the events not yet read are discarded."""
        self._detach()
        self._buffer.clear()
        self._wake()


def on_sigint(handle: RunHandle[Any]) -> Callable[[], None]:
    """Wire Ctrl+C to ``handle``: the first SIGINT interrupts, the second cancels.

    Later presses go to the handler that was there before. That handler is put back as
    soon as the run ends (or when the returned function is called), so this never
    outlives the run. Call it from the main thread, which must be running the handle's
    loop (as under ``asyncio.run()``).
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("on_sigint() must be called from the main thread (signal.signal)")
    if _get_running_loop() is not handle._loop:
        raise RuntimeError(
            f"on_sigint({handle!r}) must be called on the thread running the handle's loop"
        )
    if handle.done:
        return _noop
    loop = handle._loop
    previous = signal.getsignal(signal.SIGINT)
    presses = 0

    def on_signal(signum: int, frame: types.FrameType | None) -> None:
        nonlocal presses
        presses += 1
        if presses > 2:
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.default_int_handler(signum, frame)
            return
        try:  # runs between two bytecodes of the main thread: queue the work, touch nothing
            if presses == 1:
                loop.call_soon_threadsafe(handle._interrupt)
            else:
                loop.call_soon_threadsafe(handle._cancel, "SIGINT")
        except RuntimeError:  # the loop closed meanwhile
            pass

    def restore(_: object = None) -> None:
        if signal.getsignal(signal.SIGINT) is on_signal:
            # A handler installed outside Python reads as None: the default is the best match.
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)

    signal.signal(signal.SIGINT, on_signal)
    handle.add_done_callback(restore)
    return restore
