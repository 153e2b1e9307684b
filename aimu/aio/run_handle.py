"""RunHandle: a run scheduled as a task that can be cancelled, interrupted or stopped.

:meth:`RunHandle.start` runs any awaitable in a task of its own. A handle is the
:class:`~aimu.aio.scope.RunScope` of that run: the task's context holds it as
``current_scope``, so every aimu loop inside finds it, stops at its next step boundary
when asked to (``interrupt()``) and emits its events there (``events()``). ``cancel()``
is the hard stop; a deadline cancels on its own.

The state machine is :mod:`aimu.aio._handle_states`'s (``HandleState``).

Handles nest, as tasks do in a ``TaskGroup``: a handle started inside another handle's
run belongs to that run. Its scope is inside the outer one (the outer deadline bounds
it, an outer interrupt reaches it), ``cancel()`` of the outer handle cancels it too,
and the outer run ends only once it has ended: when the outer run returns, it waits
for it; when the outer run fails or is cancelled, it cancels it and waits.
``RunHandle.start(coro, detached=True)`` starts a run that belongs to no other.

Awaiting a handle never cancels the run. Unlike awaiting a task, a waiter that is itself
cancelled only stops waiting::

    handle = RunHandle.start(agent.run(task))
    try:
        async with asyncio.timeout(2):
            reply = await handle          # gives up after 2 s ...
    except TimeoutError:
        print(handle.status)              # ... and the run is still "running"

That is also why a handle is not an ``asyncio.Future``: ``asyncio.wait`` calls
``done()`` (here ``done`` is a property, as the seed API has it), and ``asyncio.gather``
cancels its futures when it is cancelled. ``handle.task`` is the task that runs the run,
for those: its outcome is the run's (its result, its exception, ``TimeoutError`` for a
deadline, cancelled for a cancel), and cancelling it cancels the run.
``asyncio.gather(handle)`` works as for any awaitable: it waits, and never cancels.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
import types
from asyncio import CancelledError, Future, Task
from collections.abc import (
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Sequence,
)
from typing import Any, Generic, Protocol, TypeVar, cast, final

from aimu.aio._event_tap import EventTap
from aimu.aio._handle_states import LIVE_STATES, RETURNED_STATES, HandleState
from aimu.aio._numbers import grace_seconds
from aimu.aio._run_task import (
    close_unstarted,
    first_step,
    noop,
    on_loop,
    retrieve,
    startable,
)
from aimu.aio._signals import SignalHandlers
from aimu.aio.ends import error_text
from aimu.aio.errors import NoOutputError
from aimu.aio.events import HandleFinished, HandleStatus
from aimu.aio.scope import RunScope, current_scope, sent_message
from aimu.aio.transcript import UserMessage

__all__ = ["EventStream", "EventTap", "RunControl", "RunHandle", "on_sigint"]

T = TypeVar("T")
#: What ``events()`` returns: an :class:`EventTap` (its name before the tap had one).
EventStream = EventTap
DoneCallback = Callable[["RunHandle[Any]"], object]


def _owner_of(scope: RunScope | None) -> RunHandle[Any] | None:
    """The live handle nearest around ``scope`` (itself included): the run it belongs to.
    From inside an agent called as a tool, the caller's run's (its call scope's
    ``caller``: the chain of events stops there, the run's ownership does not)."""
    while scope is not None:
        if isinstance(scope, RunHandle):
            return scope if scope._state in LIVE_STATES else None
        scope = scope.parent or scope.caller
    return None


class _Observers:
    """Who hears of a run's end besides its first awaiter; made on first use."""

    __slots__ = ("callbacks", "taps", "terminal", "waiters", "watchers")

    def __init__(self) -> None:
        self.waiters: list[Future[Any]] = []
        self.watchers: list[Future[None]] = []
        """Futures set to None when the run ends (stop() and nesting wait on these)."""
        self.callbacks: list[tuple[DoneCallback, contextvars.Context]] = []
        self.taps: list[EventTap] = []
        self.terminal: HandleFinished | None = None


class RunControl(Protocol):
    """What ``RunHandle.start(control=...)`` needs: a run id, then the handle to watch.

    ``run_id(wanted)`` checks (or, for None, makes) the id before anything is scheduled,
    raising on a bad one; ``attach(handle)`` must not raise. It may return a future the
    run waits for before its coroutine starts (a cancel meanwhile means it never
    starts): ``aio.RedisControl`` holds a run until Redis said what was asked of it.
    """

    def run_id(self, wanted: str | None) -> str: ...

    def attach(self, handle: RunHandle[Any]) -> asyncio.Future[None] | None: ...


@final
class RunHandle(RunScope, Generic[T]):
    """A run scheduled as a task: cancel, interrupt, stop, await, observe.

    Make one with :meth:`start`. ``await handle`` (or ``await handle.result()``) returns
    the run's result or raises ``CancelledError``, ``TimeoutError`` or the run's error.
    ``name`` is the ``name=`` given to start(), else the coroutine's qualified name.
    """

    __slots__ = (
        "__weakref__",
        "_admission",
        "_children",
        "_deadline_cancels",
        "_error",
        "_loop",
        "_observers",
        "_owner",
        "_reason",
        "_result",
        "_run_id",
        "_started",
        "_started_at",
        "_state",
        "_task",
        "_timer",
        "_waiter",
    )
    _loop: asyncio.AbstractEventLoop
    _task: Task[T]
    _run_id: str | None
    _state: str  # one of HandleState
    _started_at: float  # time.monotonic(), for the age in repr()
    _reason: str | None  # why it was cancelled ("deadline passed" for a timeout)
    _timer: asyncio.TimerHandle | None  # the deadline's
    _waiter: Future[T] | None  # the first awaiter's future (the rest are in _observers)
    _observers: _Observers | None
    _owner: RunHandle[Any] | None  # the handle this run belongs to
    _admission: asyncio.Future[None] | None
    _children: set[RunHandle[Any]] | None  # the live handles that belong to this run
    # Assigned before they are read, so not at start (each store costs every run):
    _result: T  # once the run returned
    _error: BaseException | None  # once it ended otherwise
    _started: bool  # set by the first stop: whether the task had stepped by then
    _deadline_cancels: int  # ``task.cancelling()`` just before the deadline's own cancel

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("use RunHandle.start(coro) to make a RunHandle")

    @classmethod
    def start(
        cls,
        coro: Awaitable[T],
        *,
        name: str | None = None,
        timeout: float | None = None,
        deadline: float | None = None,
        detached: bool = False,
        run_id: str | None = None,
        control: RunControl | None = None,
    ) -> RunHandle[T]:
        """Schedule ``coro`` (any awaitable) as a task in a fresh run scope; return its handle.

        ``timeout`` (seconds) or ``deadline`` (``loop.time()``) cancel the run when they
        pass (the earlier wins, and so does a deadline of the scope around). Inside
        another handle's run the new one belongs to it (see the module docstring) unless
        ``detached=True``. Needs a running event loop; a non-awaitable raises ``TypeError``.
        ``control`` (such as ``aio.RedisControl``) registers the run under ``run_id``
        (made when None). A ``timeout`` or ``deadline`` that is not a finite number raises
        ``ValueError`` (and ``coro`` is closed, not run).
        """
        run, name, loop = startable(coro, name, timeout, deadline)
        if control is not None:
            try:
                run_id = control.run_id(run_id)
            except BaseException:
                run.close()
                raise
        if timeout is not None:
            at = loop.time() + timeout
            deadline = at if deadline is None else min(at, deadline)
        self = cls.__new__(cls)
        RunScope.__init__(self, name, None if detached else current_scope.get(), deadline)
        self._run_id = run_id
        self._loop = loop
        self._state = HandleState.PENDING
        self._started_at = time.monotonic()
        self._reason = None
        self._timer = None
        self._waiter = None
        self._observers = None
        self._owner = None if self.parent is None else _owner_of(self.parent)
        self._children = None
        driver = self._drive(run)
        driver.send(None)  # up to first_step
        # What loop.create_task() does when no task factory is set, one call shorter.
        if loop.get_task_factory() is None:
            self._task = Task(driver, loop=loop)
        else:
            self._task = loop.create_task(driver)
        if self._owner is not None:
            self._owner._adopt(self)
        if self.deadline is not None:
            self._timer = loop.call_at(self.deadline, self._expire)
        self._admission = None if control is None else control.attach(self)
        return self

    # -- the run -------------------------------------------------------------------

    async def _drive(self, run: Coroutine[Any, Any, T]) -> T:
        try:
            await first_step()
            current_scope.set(self)
            if self._state is HandleState.PENDING:
                self._state = HandleState.RUNNING
            else:
                self._deliver_early_stop()
            if self._admission is not None:
                await self._admission  # the control's go-ahead; a cancel here: never started
            result = await run
        except CancelledError as stop:
            close_unstarted(run)
            # Past our deadline, the inner runs are past theirs (see _expire): they time out.
            await self._join_children(cancel=self._state is not HandleState.EXPIRING)
            error = self._cancelled(stop)
            if error is stop:
                raise
            raise error from stop
        except GeneratorExit:
            # The task was destroyed unfinished (its loop closed): nothing to report to.
            close_unstarted(run)
            raise
        except (KeyboardInterrupt, SystemExit) as error:
            self._failed(error)
            raise  # asyncio stops the loop with these; they are not the run's to keep
        except BaseException as error:
            await self._join_children(cancel=True)
            self._failed(error)
            raise
        if self._children:
            late_cancel = await self._join_children(cancel=False)
            if late_cancel is not None:
                raise self._cancelled(late_cancel)
        self._result = result
        halt = None if self.halt is None else self.halt.status
        if halt == "paused":
            self._state, self._error = HandleState.PAUSED, None
        elif halt == "interrupted":
            self._state, self._error = HandleState.INTERRUPTED, None
        else:
            last = self.last_run
            if last is not None and last.status == "incomplete":
                self._state, self._error = HandleState.INCOMPLETE, None
            elif last is not None and last.status == "limited":
                self._state, self._error = HandleState.LIMITED, None
            elif last is not None and last.status == "blocked":
                self._state, self._error = HandleState.BLOCKED, None
            else:
                self._state = HandleState.COMPLETED
        self._finish()
        return result

    def _deliver_early_stop(self) -> None:
        """cancel() or the deadline came before the first step: deliver it now, so that it
        lands at the run's first await (its opening lines still run)."""
        self._started = True
        self._deadline_cancels = self._task.cancelling()
        self._task.cancel(self._reason if self._state is HandleState.CANCELLING else None)

    def _failed(self, error: BaseException) -> None:
        self._check_live()
        self._error = error
        self._state = HandleState.FAILED
        if isinstance(error, NoOutputError):  # a typed run that stopped before its answer
            halt = None if self.halt is None else self.halt.status
            if halt == "paused":
                self._state = HandleState.PAUSED
            elif halt == "interrupted":
                self._state = HandleState.INTERRUPTED
            elif error.status == "limited":
                self._state = HandleState.LIMITED
            elif error.status == "blocked":
                self._state = HandleState.BLOCKED
        self._task.add_done_callback(retrieve)
        self._finish()

    def _cancelled(self, stop: CancelledError) -> BaseException:
        """End as cancelled, or timed out; return what the task raises (``stop``, or a
        TimeoutError when the deadline's cancel was the only one)."""
        state = self._check_live()
        if state is HandleState.EXPIRING and self._task.uncancel() <= self._deadline_cancels:
            self._state = HandleState.TIMED_OUT
            self._reason = self._reason or "deadline passed"
            self._error = TimeoutError(f"run {self.name!r} passed its deadline")
            self._task.add_done_callback(retrieve)
        else:
            self._state = HandleState.CANCELLED
            self._error = None
            if state is not HandleState.CANCELLING and stop.args and isinstance(stop.args[0], str):
                self._reason = stop.args[0]  # a cancel from outside, with a message
        self._finish()
        return stop if self._error is None else self._error

    def _returned(self) -> bool:
        """The run returned a value (a typed run stopped without one has ``_error``)."""
        state = self._state
        return state is HandleState.COMPLETED or (state in RETURNED_STATES and self._error is None)

    def _check_live(self) -> str:
        state = self._state
        if state not in LIVE_STATES:
            raise RuntimeError(f"RunHandle {self.name!r} is already {state}")
        return state

    def _finish(self) -> None:
        """Tell everyone the run has ended, in the order they hear of it: done callbacks
        (on_sigint's restore among them), event streams, stop(), then the awaiters."""
        # Called in the run's task, whose context holds this handle: drop it, so that the
        # handle and the task (which holds the context) go by refcount, not by the GC.
        current_scope.set(None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._owner is not None and self._owner._children is not None:
            self._owner._children.discard(self)
        observers = self._observers
        if observers is not None:
            for callback, context in observers.callbacks:
                self._loop.call_soon(callback, self, context=context)
            observers.callbacks.clear()
            if observers.taps:
                terminal = self._terminal_event()
                taps, observers.taps = observers.taps, []
                for tap in taps:
                    tap._end(terminal)
            for watcher in observers.watchers:
                if not watcher.done():
                    watcher.set_result(None)
            observers.watchers.clear()
            for waiter in observers.waiters:
                self._resolve(waiter)
            observers.waiters.clear()
        if self._waiter is not None:
            self._resolve(self._waiter)

    def _resolve(self, waiter: Future[T]) -> None:
        """Give ``waiter`` the outcome of the finished run (unless its awaiter gave up)."""
        if waiter.done():
            return
        if self._returned():
            waiter.set_result(self._result)
        elif self._state is HandleState.CANCELLED:
            waiter.cancel(self._reason)
        else:
            assert self._error is not None
            waiter.set_exception(self._error)

    def _observing(self) -> _Observers:
        if self._observers is None:
            self._observers = _Observers()
        return self._observers

    def _terminal_event(self) -> HandleFinished:
        observers = self._observing()
        if observers.terminal is None:
            returned = self._returned()
            error = None if returned else self._error
            observers.terminal = HandleFinished(
                self.name,
                self.status,
                self._reason,
                self._result if returned else None,
                None if error is None else error_text(error),
            )
        return observers.terminal

    def _expire(self) -> None:
        state = self._state
        if state is HandleState.PENDING or state is HandleState.RUNNING:
            self._timer = None
            self._state = HandleState.EXPIRING
            if state is HandleState.RUNNING:
                self._started = True
                self._deadline_cancels = self._task.cancelling()
                self._task.cancel()
            else:
                self._started = False  # delivered at the task's first step
            for child in tuple(self._children or ()):
                child._expire()  # our deadline bounds theirs

    # -- nesting -------------------------------------------------------------------

    def _adopt(self, child: RunHandle[Any]) -> None:
        if self._children is None:
            self._children = set()
        self._children.add(child)
        if self._state is HandleState.CANCELLING:
            child._cancel(self._reason)

    async def _join_children(self, *, cancel: bool) -> CancelledError | None:
        """Wait until every handle started in this run has ended; cancel them first when
        ``cancel``. A cancel of ours meanwhile cancels them and is returned, not raised."""
        late_cancel: CancelledError | None = None
        while self._children:
            child = next(iter(self._children))
            if cancel:
                child._cancel(self._reason)
            try:
                await child._wait_done(None)
            except CancelledError as error:
                late_cancel, cancel = error, True
            self._children.discard(child)
        return late_cancel

    # -- requests ------------------------------------------------------------------

    def cancel(self, reason: str | None = None) -> bool:
        """Stop the run at its next ``await``; False if it had already finished.

        ``reason`` is kept in ``reason`` and the terminal event. A second cancel changes
        nothing and returns True while the run is still stopping. Off the loop's thread
        the cancel is queued (``call_soon_threadsafe``): True means the run had not
        finished when asked, False that it had (or that its loop is closed).
        """
        loop = self._loop
        if not on_loop(loop):
            return self._queue(self._cancel, reason)
        accepted = self._cancel(reason)
        if accepted and asyncio.current_task(loop) is None:
            # Called from a plain callback, or from a signal handler while the loop
            # sleeps in select(): wake it so the cancel is seen now.
            loop.call_soon_threadsafe(noop)
        return accepted

    def _cancel(self, reason: str | None) -> bool:
        state = self._state
        if state is HandleState.CANCELLING:
            return True
        if state not in LIVE_STATES:
            return False
        self._reason = reason
        self._state = HandleState.CANCELLING
        if state is HandleState.PENDING:
            self._started = False  # delivered at the task's first step
        elif state is HandleState.RUNNING:
            self._started = True
            self._task.cancel(reason)
        # EXPIRING: the deadline's cancel is on its way; this one only changes the verdict.
        for child in tuple(self._children or ()):
            child._cancel(reason)
        return True

    def when(self) -> float | None:
        """The deadline as ``loop.time()``, or None; as ``asyncio.Timeout.when()``."""
        return self.deadline

    def reschedule(self, when: float | None) -> None:
        """Move the deadline to ``when`` (``loop.time()``; None removes it).

        As ``asyncio.Timeout.reschedule()``; a deadline of the scope around still bounds
        it, and handles started inside before the call keep theirs. Call it on the
        loop's thread while the run is pending or running, else ``RuntimeError``.
        """
        if self._state is not HandleState.PENDING and self._state is not HandleState.RUNNING:
            raise RuntimeError(f"cannot reschedule run {self.name!r}: it is {self.status}")
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        outer = None if self.parent is None else self.parent.deadline
        if outer is not None:
            when = outer if when is None else min(when, outer)
        self.deadline = when
        if when is not None:
            self._timer = self._loop.call_at(when, self._expire)

    def interrupt(self) -> bool:
        """Ask every aimu loop in the run to stop at its next step boundary.

        True if asked; False if the run had finished or is being cancelled. Off the
        loop's thread it is queued as for :meth:`cancel`, with the same return values.
        """
        if not on_loop(self._loop):
            return self._queue(self._interrupt)
        return self._interrupt()

    def send(self, text: str, *, images: Sequence[object] = ()) -> bool:
        """Give ``text`` (and ``images``: bytes or paths, as ``run(images=)`` takes them)
        to the aimu loop running inside: it joins the run as a user message at the next
        step boundary. False if the run has ended or is being cancelled. Thread-safe;
        several sends keep their order."""
        return self.post(sent_message(text, images))  # bad input refused whatever the state

    def post(self, message: UserMessage) -> bool:
        """:meth:`send` for a message already checked (``sent_message``); False if the
        run has ended or is being cancelled."""
        state = self._state
        if state is not HandleState.PENDING and state is not HandleState.RUNNING:
            return False
        return super().post(message)

    def _interrupt(self) -> bool:
        state = self._state
        if state is HandleState.PENDING or state is HandleState.RUNNING:
            self.request_interrupt()
            return True
        return False

    def _queue(self, request: Callable[..., bool], *args: object) -> bool:
        if self._state not in LIVE_STATES:
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
        stops the waiting. A ``grace`` that is not a finite number, 0 or more, raises
        ``ValueError`` and stops nothing.
        """
        grace = grace_seconds(grace)
        loop = self._loop
        if not on_loop(loop):
            future = asyncio.run_coroutine_threadsafe(self._stop(grace), loop)
            return await asyncio.wrap_future(future)
        return await self._stop(grace)

    async def _stop(self, grace: float) -> HandleStatus:
        if self._state in LIVE_STATES:
            self._interrupt()
            if not await self._wait_done(grace):
                self._cancel(f"stop(): still running {grace:g} s after the interrupt")
                await self._wait_done(None)
        return self.status

    async def wait(self) -> HandleFinished:
        """Wait until the run has ended and return its terminal event (:attr:`final`).

        Never raises the run's outcome: a cancelled, timed-out or failed run is told by
        the event's ``status``, ``reason`` and ``error``. Cancelling the waiter only stops
        the waiting. Safe from another thread's event loop, as :meth:`stop`.
        """
        loop = self._loop
        if not on_loop(loop):
            future = asyncio.run_coroutine_threadsafe(self._wait_final(), loop)
            return await asyncio.wrap_future(future)
        return await self._wait_final()

    async def _wait_final(self) -> HandleFinished:
        await self._wait_done(None)
        return self._terminal_event()

    @property
    def final(self) -> HandleFinished | None:
        """The run's terminal event once it has ended (the one :meth:`events` ends with:
        status, reason, result, error), else None."""
        return None if self._state in LIVE_STATES else self._terminal_event()

    async def _wait_done(self, seconds: float | None) -> bool:
        """Wait until the run ends or ``seconds`` pass; True if it ended."""
        if self._state not in LIVE_STATES:
            return True
        if seconds is not None and seconds <= 0:
            return False
        watcher: Future[None] = self._loop.create_future()
        watchers = self._observing().watchers
        watchers.append(watcher)
        try:
            done, _ = await asyncio.wait((watcher,), timeout=seconds)
        finally:
            if not watcher.done():
                watcher.cancel()
                watchers.remove(watcher)
        return bool(done)

    # -- results -------------------------------------------------------------------

    def __await__(self) -> Generator[Any, None, T]:
        # Our own future, settled when the run ends: cancelling the awaiter cancels only it.
        waiter: Future[T] = Future(loop=self._loop)
        if self._state not in LIVE_STATES:
            self._resolve(waiter)
        elif self._waiter is None:
            self._waiter = waiter
        else:
            self._observing().waiters.append(waiter)
        return waiter.__await__()

    async def result(self) -> T:
        """The run's result; raises ``CancelledError``, ``TimeoutError`` or its error."""
        return await self

    def exception(self) -> BaseException | None:
        """The run's exception (``TimeoutError`` for its deadline), None if it returned.

        As ``Future.exception()``: ``CancelledError`` if it was cancelled, and
        ``asyncio.InvalidStateError`` while it runs.
        """
        state = self._state
        if state in LIVE_STATES:
            raise asyncio.InvalidStateError(f"run {self.name!r} is still {self.status}")
        if state is HandleState.CANCELLED:
            raise CancelledError(self._reason)
        return None if self._returned() else self._error

    # -- observing -------------------------------------------------------------------

    @property
    def run_id(self) -> str | None:
        """The ``run_id`` given to start() (made by its ``control`` when not given)."""
        return self._run_id

    def get_name(self) -> str:
        """The handle's name, as ``Task.get_name()`` gives a task's."""
        return self.name

    @property
    def task(self) -> Task[T]:
        """The task running the run, for ``asyncio.wait`` and friends (see the module
        docstring). Its outcome is the run's; cancelling it cancels the run."""
        return self._task

    @property
    def scope(self) -> RunScope:
        """The run scope the loops inside this run find in ``current_scope``: the handle."""
        return self

    @property
    def expiring(self) -> bool:
        """True from the deadline's cancel until the run has settled, unless a cancel()
        came first or meanwhile: the run is ending ``timed_out``."""
        return self._state is HandleState.EXPIRING

    @property
    def done(self) -> bool:
        """True once the run has ended, whatever ended it."""
        return self._state not in LIVE_STATES

    @property
    def cancelled(self) -> bool:
        """True when the run ended by a cancel (awaiting raises ``CancelledError``).

        A run stopped by its deadline is ``timed_out``, not cancelled.
        """
        return self._state is HandleState.CANCELLED

    @property
    def status(self) -> HandleStatus:
        """pending, running, completed, incomplete, interrupted, paused, cancelled,
        timed_out or failed."""
        state = self._state
        if state is HandleState.CANCELLING or state is HandleState.EXPIRING:
            return "running" if self._started else "pending"
        return cast(HandleStatus, state)  # the other states are named as the statuses

    @property
    def reason(self) -> str | None:
        """Why the run was cancelled (the reason given, "SIGINT", "deadline passed")."""
        return self._reason

    def add_done_callback(self, fn: DoneCallback) -> None:
        """Call ``fn(handle)`` on the loop soon after the run ends (soon, if it has ended).

        Callbacks run before the handle's waiters resume; call it on the loop's thread.
        """
        context = contextvars.copy_context()
        if self._state not in LIVE_STATES:
            self._loop.call_soon(fn, self, context=context)
            return
        self._observing().callbacks.append((fn, context))

    def remove_done_callback(self, fn: DoneCallback) -> int:
        """Remove every registration of ``fn``; return how many were removed."""
        if self._observers is None:
            return 0
        callbacks = self._observers.callbacks
        kept = [(f, c) for f, c in callbacks if f != fn]
        removed = len(callbacks) - len(kept)
        callbacks[:] = kept
        return removed

    def events(self, *, maxsize: int = 1024) -> EventTap:
        """Iterate the events emitted in this run from now on, then one HandleFinished.

        Nothing emitted before the call is replayed; called after the run ended it
        yields only the terminal event. A reader more than ``maxsize`` events behind
        loses text and thinking chunks (counted in ``dropped``), never another event.
        """
        return self.tap(maxsize=maxsize)

    def tap(
        self, *, maxsize: int | None = None, notify: Callable[[], object] | None = None
    ) -> EventTap:
        """Hold this run's events from now on for one reader, then one HandleFinished
        (see :class:`~aimu.aio._event_tap.EventTap`: unbounded unless ``maxsize``).
        ``notify()`` (which must not raise) is called on the loop after each event held
        and at the end; the tap of a run that has ended holds its terminal at once."""
        tap = EventTap(self._loop, maxsize)
        if self._state not in LIVE_STATES:
            tap._end(self._terminal_event())
            return tap
        tap._notify = notify
        observers = self._observing()
        observers.taps.append(tap)
        remove = self.add_listener(tap._push)

        def detach() -> None:
            remove()
            if tap in observers.taps:
                observers.taps.remove(tap)

        tap._detach = detach
        return tap

    def __repr__(self) -> str:
        age = time.monotonic() - self._started_at
        reason = self.reason
        extra = f" reason={reason!r}" if reason else ""
        return f"<RunHandle {self.name!r} {self.status} age={age:.3f}s{extra}>"


def on_sigint(handle: RunHandle[Any]) -> Callable[[], None]:
    """Wire Ctrl+C to ``handle``: the first SIGINT interrupts, the second cancels.

    Later presses go to the handler that was there before. That handler is put back as
    soon as the run ends (or when the returned function is called), so this never
    outlives the run. Call it from the main thread, which must be running the handle's
    loop (as under ``asyncio.run()``).
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("on_sigint() must be called from the main thread (signal.signal)")
    if not on_loop(handle._loop):
        raise RuntimeError(
            f"on_sigint({handle!r}) must be called on the thread running the handle's loop"
        )
    if handle.done:
        return noop
    loop = handle._loop
    presses = 0

    def on_signal(signum: int, frame: types.FrameType | None) -> None:
        nonlocal presses
        presses += 1
        if presses > 2:
            installed.pass_on(signum, frame)
            return
        try:  # runs between two bytecodes of the main thread: queue the work, touch nothing
            if presses == 1:
                loop.call_soon_threadsafe(handle._interrupt)
            else:
                loop.call_soon_threadsafe(handle._cancel, "SIGINT")
        except RuntimeError:  # the loop closed meanwhile
            pass

    def restore(_: object = None) -> None:
        installed.restore()

    installed = SignalHandlers(on_signal)
    handle.add_done_callback(restore)
    return restore
