"""The run scope: how a handle reaches every aimu loop running inside it.

A :class:`RunScope` is found through the ``current_scope`` context variable, which a
:class:`~aimu.aio.RunHandle` sets in the context of the task it starts. Agents and
workflows read it once when a run begins: they stop at their next step boundary when
``interrupt_requested`` turns true, and send every event to ``emit``. Scopes nest: an
interrupt of an outer scope reaches the inner ones, and events bubble outwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

from aimu.aio.ends import Halt
from aimu.aio.events import Event, RunResult, RunStatus
from aimu.aio.images import image_urls
from aimu.aio.transcript import UserMessage, check_text

__all__ = ["RunScope", "RunSeat", "current_scope"]

EventListener = Callable[[Event], None]

# Guards every scope's inbox: a send from another thread and the run closing it.
_inbox_lock = threading.Lock()
# Guards the interrupt waiters: an interrupt may be requested from another thread.
_waiters_lock = threading.Lock()

#: A task waiting for an interrupt: its future, and the loop it runs on.
_Waiter = tuple["asyncio.Future[bool]", asyncio.AbstractEventLoop]


def _wake(waiter: asyncio.Future[bool], interrupted: bool) -> None:
    if not waiter.done():
        waiter.set_result(interrupted)


_INTERRUPTED = Halt("interrupted")

class RunScope:
    """Interrupt request, deadline and event fan-out shared by the loops of one run."""

    __slots__ = (
        "_inbox",
        "_interrupt_requested",
        "_interrupt_waiters",
        "_listeners",
        "deadline",
        "halt",
        "last_run",
        "name",
        "options",
        "parent",
        "retries",
    )

    #: The scope of the run that called this one's agent as a tool, for a scope that ends
    #: the chain of events but not that of ownership (``aimu.aio.agent.tree.CallScope``).
    caller: RunScope | None = None
    #: For the runs opened in this scope: the id of the run record they run inside (the
    #: caller's, for an agent called as a tool: ``aimu.aio.agent.tree.CallScope``), else None.
    record: str | None = None

    def __init__(
        self, name: str, parent: RunScope | None = None, deadline: float | None = None
    ) -> None:
        self.name = name
        self.parent = parent
        if parent is not None and parent.deadline is not None:
            deadline = parent.deadline if deadline is None else min(deadline, parent.deadline)
        #: Loop time (``loop.time()``) at which the run is cancelled, inherited by nested scopes.
        self.deadline: float | None = deadline
        self._interrupt_requested = False
        #: Tasks in :meth:`interrupted_within` here or in a scope inside (None: none yet).
        self._interrupt_waiters: list[_Waiter] | None = None
        #: How a loop in this scope stopped at a step boundary, if one did: interrupted
        #: (a run that finished its answer despite an interrupt leaves it None), paused
        #: for approvals, or limited (with the limit's stop reason). Loops that halted
        #: differently: the pause, else the limit (see :class:`~aimu.aio.ends.Halt`).
        self.halt: Halt | None = None
        #: Model requests retried while this scope was current (a run's own retries: a
        #: provider counts each retry it makes, after its wait, on the scope it runs in).
        self.retries = 0
        #: The result of the last agent or workflow run that ended directly in this scope.
        self.last_run: RunResult[Any] | None = None
        self._listeners: list[EventListener] | None = None
        #: The options of the call that opened this run (a ``RunOptions``), if any.
        self.options: object = None
        #: Text sent to the run (``send()``): None before the first, () once closed.
        self._inbox: deque[UserMessage] | tuple[()] | None = None

    @property
    def expiring(self) -> bool:
        """True while this scope's run is being stopped by its own deadline (a
        :class:`~aimu.aio.RunHandle` overrides this); a plain scope has no timer."""
        return False

    @property
    def interrupt_requested(self) -> bool:
        """True once this scope, or one around it, was asked to stop gracefully."""
        return any(scope._interrupt_requested for scope in self._outward())

    def request_interrupt(self) -> None:
        """Ask every loop in this scope to stop at its next step boundary; wakes the
        tasks in :meth:`interrupted_within`. Safe from another thread or a signal handler."""
        self._interrupt_requested = True
        with _waiters_lock:
            waiters = tuple(self._interrupt_waiters or ())
        for waiter, loop in waiters:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(_wake, waiter, True)

    async def interrupted_within(self, seconds: float | None) -> bool:
        """Wait until an interrupt is requested of this scope or one around it, for at
        most ``seconds`` (None: no limit); True if one was. Awaiting, not polling: the
        request wakes the waiter at once. Cancelling the waiter only stops the waiting."""
        if self.interrupt_requested:
            return True
        if seconds is not None and seconds <= 0:
            return False
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        entry = (waiter, loop)
        chain = self._chain()
        with _waiters_lock:
            for scope in chain:
                if scope._interrupt_waiters is None:
                    scope._interrupt_waiters = []
                scope._interrupt_waiters.append(entry)
        timer = None if seconds is None else loop.call_later(seconds, _wake, waiter, False)
        try:
            if self.interrupt_requested:  # asked between the first look and registering
                return True
            return await waiter
        finally:
            if timer is not None:
                timer.cancel()
            with _waiters_lock:
                for scope in chain:
                    if scope._interrupt_waiters is not None:
                        scope._interrupt_waiters.remove(entry)

    def _outward(self) -> Iterator[RunScope]:
        """This scope and those around it, innermost first."""
        scope: RunScope | None = self
        while scope is not None:
            yield scope
            scope = scope.parent

    def _chain(self) -> list[RunScope]:
        """:meth:`_outward`, taken once (to be walked under a lock)."""
        return list(self._outward())

    def note_halt(self, halt: Halt) -> None:
        """Record that a loop in this scope stopped at a step boundary, here and in the
        scopes around (each keeps the halt that outranks the others)."""
        for scope in self._outward():
            if halt.outranks(scope.halt):
                scope.halt = halt

    def note_interrupted(self) -> None:
        """Record that a loop stopped at a step boundary because of an interrupt."""
        self.note_halt(_INTERRUPTED)

    def note_ended(self, result: RunResult[Any]) -> None:
        """Record the result of a run that ended directly in this scope."""
        self.last_run = result

    @property
    def run_id(self) -> str | None:
        """The id of the registered run this scope belongs to (a handle's), if any."""
        return None if self.parent is None else self.parent.run_id

    def send(self, text: str, *, images: Sequence[object] = ()) -> bool:
        """Give ``text`` (and ``images`` beside it) to the loops in this scope: the first
        to reach a step boundary adds it as a user message. False once the scope's run
        has ended; ValueError or TypeError, and nothing sent, for text a store could not
        hold or an image that is not one. Thread-safe."""
        return self.post(sent_message(text, images))

    def post(self, message: UserMessage) -> bool:
        """:meth:`send` for a message already checked (:func:`sent_message`)."""
        with _inbox_lock:
            inbox = self._inbox
            if isinstance(inbox, tuple):
                return False
            if inbox is None:
                inbox = self._inbox = deque()
            inbox.append(message)
        return True

    def has_sent(self) -> bool:
        """True when text sent to this scope or one around it waits to be taken.

        Read without the lock (every boundary of most runs finds nothing): a send()
        racing this read lands in an inbox and is taken at the next boundary, as it
        would be had it come just after."""
        return any(scope._inbox for scope in self._outward())

    def take_sent(self, *, close: bool = False) -> list[UserMessage]:
        """The user messages sent to this scope and those around it, oldest first, taken.

        ``close``: this scope's run is ending, so a later ``send()`` answers False.
        """
        if not close and not self.has_sent():
            return []
        chain = self._chain()
        taken: list[UserMessage] = []
        with _inbox_lock:
            for scope in reversed(chain):  # the outer scope's texts came first
                inbox = scope._inbox
                if isinstance(inbox, deque) and inbox:
                    taken.extend(inbox)
                    inbox.clear()
            if close:
                self._inbox = ()
        return taken

    def add_listener(self, listener: EventListener) -> Callable[[], None]:
        """Call ``listener`` with every event emitted in this scope; returns a remover."""
        if self._listeners is None:
            self._listeners = []
        self._listeners.append(listener)

        def remove() -> None:
            if self._listeners is not None and listener in self._listeners:
                self._listeners.remove(listener)

        return remove

    def emit(self, event: Event) -> None:
        """Deliver ``event`` to this scope's listeners and to the scopes around it."""
        scope: RunScope | None = self
        while scope is not None:
            listeners = scope._listeners
            if listeners:
                for listener in tuple(listeners):
                    listener(event)
            scope = scope.parent


class RunSeat:
    """Where one session's runs sit, one at a time: the run in progress (its scope) and
    how the last one ended. Every agent and workflow holds one; whatever drives a run
    (the agent's loop, a workflow's steps) claims the seat as the run opens and releases
    it with the run's result, calling down into this object, never back into the agent
    or workflow (whose ``running``, ``last_run`` and ``last_status`` read it)."""

    __slots__ = ("kind", "last_run", "last_status", "name", "scope", "scope_type")

    def __init__(self, kind: str, name: str, scope_type: type[RunScope] = RunScope) -> None:
        #: Who sits here, as errors name it: ``agent``, ``chain``...
        self.kind = kind
        self.name = name
        #: The class of the scope each run opens.
        self.scope_type = scope_type
        #: The scope of the run in progress, None between runs.
        self.scope: RunScope | None = None
        #: How the last run ended (None before the first).
        self.last_status: RunStatus | None = None
        #: What the last run did (None before the first).
        self.last_run: RunResult[Any] | None = None

    def busy(self) -> str:
        """What a second run on this session is told."""
        return (
            f"{self.kind} {self.name!r}: a run is already in progress on this session; "
            f"use {self.kind}.start() for another"
        )

    def claim(self, options: object = None) -> RunScope:
        """Open a run here: its scope, under the one it runs in, holding the call's
        ``options`` (a ``RunOptions``: the runs inside a workflow find them there);
        RuntimeError when a run already sits here."""
        if self.scope is not None:
            raise RuntimeError(self.busy())
        scope = self.scope = self.scope_type(self.name, parent=current_scope.get())
        scope.options = options
        return scope

    def release(self, result: RunResult[Any]) -> None:
        """End the run sitting here with ``result``, kept here and in the scope around."""
        scope, self.scope = self.scope, None
        self.last_status, self.last_run = result.status, result
        if scope is not None and scope.parent is not None:
            scope.parent.note_ended(result)


#: The scope of the run this code executes in, or None outside any handle.
current_scope: ContextVar[RunScope | None] = ContextVar("aimu_run_scope", default=None)


def sent_message(text: object, images: Sequence[object] = ()) -> UserMessage:
    """The user message ``send(text, images=...)`` adds, checked: TypeError or ValueError
    naming what is wrong (text a store could not hold, an image that is not one)."""
    if not isinstance(text, str):
        raise TypeError(f"send() takes the text as a string, got {type(text).__name__}")
    check_text(text, "the text sent")
    if isinstance(images, str | bytes) or not isinstance(images, Sequence):
        raise TypeError("images must be a list of images (bytes or paths)")
    message: UserMessage = {"role": "user", "content": text, "aimu_sent": True}
    if images:
        message["images"] = image_urls(images)
    return message
