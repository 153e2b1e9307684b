"""The bound a drain puts on a process's exit (``aimu serve`` and ``aimu worker``).

``--drain S`` stops the runs within S seconds: interrupted at a step boundary, cancelled
at S, each recorded and marked to be recovered. A sync tool's worker thread cannot be
stopped (Python kills no thread), and the interpreter's exit waits for every such
thread: a tool blocking 60 s held the exit 60 s. So the process does not wait for them:

- once the command is done (the server shut down, its runs recorded), a worker thread
  still running (its run was cancelled and recorded already; its result would go
  nowhere) is left behind: the process exits at once (:func:`owning_the_exit`);
- and whatever else holds it, the process exits :data:`DRAIN_MARGIN` seconds after its
  drain's S (:func:`exit_deadline`): a run not yet recorded as stopped by then keeps its
  ``running`` record, which ``--recover`` goes on with as a run whose process died.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Final

__all__ = ["DRAIN_MARGIN", "exit_deadline", "leave_threads_behind", "owning_the_exit"]

#: Seconds past ``--drain S`` the process has to record its stopped runs and shut down
#: before it exits whatever still runs.
DRAIN_MARGIN: Final = 5.0

#: Seconds the worker threads get to finish once the server has shut down (idle ones
#: end at once; one still in a tool is left behind).
_THREADS_WAIT: Final = 1.0


def exit_deadline(seconds: float, label: str) -> Callable[[], None]:
    """End the process (exit 0) ``seconds`` from now, unless the returned function is
    called first; ``label`` names the command in the line it prints."""

    def out_of_time() -> None:
        print(f"{label}: still shutting down {seconds:g} s after the drain began: exiting "
              "now (a run not yet recorded as stopped stays 'running', for --recover)",
              file=sys.stderr, flush=True)
        _exit_now(0)

    timer = threading.Timer(seconds, out_of_time)
    timer.daemon = True
    timer.start()
    return timer.cancel


async def owning_the_exit(command: Awaitable[int], label: str) -> int:
    """``command``'s exit status, once no thread would hold the process's exit (else the
    process exits now with it): for the command that owns the process (``asyncio.run``
    in its entry point), never for one run inside a test's loop."""
    code = await command
    await leave_threads_behind(code, label)
    return code


async def leave_threads_behind(code: int, label: str) -> None:
    """Return when no thread would hold the process's exit; else exit now with ``code``.

    Called once everything is closed and recorded: the default executor is shut down
    (its idle threads end); a thread still running after :data:`_THREADS_WAIT` (a sync
    tool that has not returned) is left behind, the process exits without it."""
    shutdown = asyncio.ensure_future(asyncio.get_running_loop().shutdown_default_executor())
    done, _ = await asyncio.wait([shutdown], timeout=_THREADS_WAIT)
    if shutdown in done and not _holding_the_exit():
        return
    print(f"{label}: exiting with a tool's thread still running (its run was stopped and "
          "recorded; the thread's result would go nowhere)", file=sys.stderr, flush=True)
    _exit_now(code)


def _holding_the_exit() -> list[threading.Thread]:
    """The threads the interpreter's exit would wait for."""
    main = threading.main_thread()
    return [t for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]


def _exit_now(code: int) -> None:
    """Exit the process with ``code`` without waiting for any thread (what is printed is
    flushed first; nothing else is left to close)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a pipe nobody reads
            stream.flush()
    os._exit(code)
