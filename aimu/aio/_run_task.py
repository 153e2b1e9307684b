"""The task a :class:`~aimu.aio.RunHandle` runs: any awaitable made a coroutine and
checked before it starts, and the small steps around the task (its first suspension,
its outcome marked as seen)."""

from __future__ import annotations

import asyncio
import inspect
import types
from asyncio import Task
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any, TypeVar

from aimu.aio._echo import echo
from aimu.aio._numbers import finite

__all__ = [
    "as_coroutine", "close_unstarted", "first_step", "noop", "on_loop", "retrieve", "startable",
]

T = TypeVar("T")


def startable(
    coro: Awaitable[T], name: str | None, timeout: float | None, deadline: float | None
) -> tuple[Coroutine[Any, Any, T], str, asyncio.AbstractEventLoop]:
    """What :meth:`RunHandle.start` runs (``coro`` as a coroutine), its name and the
    running loop; ``coro`` closed, not run, when an argument is refused."""
    run: Coroutine[Any, Any, T]
    if isinstance(coro, types.CoroutineType):
        run, name = coro, name or coro.__qualname__
    else:
        run, name = as_coroutine(coro, name)
    if timeout is not None or deadline is not None:
        for what, seconds in (("timeout", timeout), ("deadline", deadline)):
            if seconds is not None and not finite(seconds):
                run.close()
                raise ValueError(
                    f"RunHandle.start({what}={echo(seconds)}): give a finite number of "
                    "seconds, or None"
                )
    try:
        return run, name, asyncio.get_running_loop()
    except RuntimeError:
        run.close()  # no "coroutine was never awaited" warning
        raise RuntimeError(
            "RunHandle.start() needs a running event loop: call it from async code "
            "(for example inside asyncio.run())"
        ) from None


@types.coroutine
def first_step() -> Generator[None, None, None]:
    """Suspend once. ``start()`` runs the driver up to here before its task exists, so
    that a cancel reaching the task before its first step still finds the driver's
    handlers (which settle the handle and close the run's coroutine)."""
    yield


def noop() -> None:
    pass


def on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """True when called on the thread running ``loop`` (where a handle acts directly)."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def close_unstarted(coro: Coroutine[Any, Any, Any]) -> None:
    """Close a run coroutine that a stop reached before it began (no "never awaited")."""
    if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
        coro.close()


def retrieve(task: Task[Any]) -> None:
    """Mark a finished task's exception as seen: its handle reports it to its awaiters,
    so a handle nobody awaits never logs "Task exception was never retrieved"."""
    if not task.cancelled():
        task.exception()


async def _await(awaitable: Awaitable[T]) -> T:
    return await awaitable


def as_coroutine(run: Awaitable[T], name: str | None) -> tuple[Coroutine[Any, Any, T], str]:
    """``run`` (an awaitable, not a coroutine) as a coroutine, and the handle's name."""
    if inspect.isawaitable(run):
        default = getattr(run, "__qualname__", None) or type(run).__qualname__
        return _await(run), name or default
    raise TypeError(
        f"RunHandle.start() needs a coroutine or another awaitable, not {type(run).__name__}"
    )
