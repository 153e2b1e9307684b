"""ToolContext: what a running tool may know about its run, readable from a worker thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, Generic

from typing_extensions import TypeVar

__all__ = ["DepsT", "ToolContext"]

#: The type of the app state a run hands its tools (``Agent(deps=...)``).
DepsT = TypeVar("DepsT", default=Any)


def _never() -> bool:
    return False


#: Called with (progress, total, message) when a running tool reports its progress.
ProgressSink = Callable[[float, "float | None", "str | None"], None]


# One lock for all contexts: it guards only the lazy creation of an Event, which
# most calls never need (creating one per call would cost more than the call).
_EVENT_LOCK = threading.Lock()


class ToolContext(Generic[DepsT]):
    """What a running tool may know about its run; safe to read from a worker thread.

    ``cancelled`` turns true when the run is cancelled or this call times out; a sync
    tool should then stop (``check()`` raises ``CancelledError`` for it). ``deps`` is
    the app state the run was given (``Agent(deps=)``, ``run(deps=)``): annotate the
    parameter ``ctx: ToolContext[MyDeps]`` and ``ctx.deps`` is typed. It is never
    stored or sent to a model.
    """

    __slots__ = (
        "_cancelled", "_event", "_interrupt_probe", "_progress", "agent", "call_id", "caller",
        "deps", "shared_state", "tool_name",
    )

    def __init__(
        self,
        *,
        agent: str,
        call_id: str,
        tool_name: str,
        interrupt_probe: Callable[[], bool] = _never,
        deps: DepsT = None,  # type: ignore[assignment]  # None: the run was given none
        progress: ProgressSink | None = None,
        caller: object = None,
        shared_state: dict[str, Any] | None = None,
    ) -> None:
        self.deps: DepsT = deps
        #: The session's shared state (``agent.set_shared_state()``; AG-UI's ``state``):
        #: JSON data a tool may read and change in place; kept with the session.
        self.shared_state = shared_state
        #: The run making the call, for a tool that runs an agent (``agent.as_tool()``):
        #: what it needs of the caller's session and run (None outside an agent's run).
        self.caller = caller
        self.agent = agent
        self.call_id = call_id
        self.tool_name = tool_name
        self._interrupt_probe = interrupt_probe
        self._progress = progress
        self._cancelled = False
        self._event: threading.Event | None = None

    @property
    def cancelled(self) -> bool:
        """True once the run was cancelled, or this call timed out."""
        return self._cancelled

    @property
    def interrupt_requested(self) -> bool:
        """True once a graceful stop was asked for: finish this call, the run stops after."""
        return self._interrupt_probe()

    def report_progress(
        self, progress: float, total: float | None = None, message: str | None = None
    ) -> None:
        """Tell the run how far this call is (a :class:`~aimu.aio.ToolProgress` event).

        Call it on the event loop (from an async tool); a call after the tool returned,
        or outside a run, goes nowhere.
        """
        sink = self._progress
        if sink is not None and not self._cancelled:
            sink(progress, total, message)

    def mark_finished(self) -> None:
        """The call returned: a later progress report goes nowhere."""
        self._progress = None

    def check(self) -> None:
        """Raise ``asyncio.CancelledError`` if the call was cancelled; else do nothing."""
        if self._cancelled:
            raise asyncio.CancelledError(
                f"tool {self.tool_name!r} (call {self.call_id!r}) was cancelled"
            )

    def wait_cancelled(self, timeout: float | None = None) -> bool:
        """Block the calling thread until cancelled or ``timeout`` s passed; True if cancelled.

        For sync tools only: it blocks, so never call it on the event loop.
        """
        with _EVENT_LOCK:
            if self._cancelled:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def mark_cancelled(self) -> None:
        """Record that the call was cancelled (idempotent); wakes ``wait_cancelled``."""
        with _EVENT_LOCK:
            self._cancelled = True
            event = self._event
        if event is not None:
            event.set()

    def __repr__(self) -> str:
        return (
            f"ToolContext(agent={self.agent!r}, call_id={self.call_id!r}, "
            f"tool_name={self.tool_name!r}, cancelled={self._cancelled})"
        )

