"""Reaching a live run by its id: one request type, one protocol, one way to apply it.

A client asks a live run to ``cancel``, ``interrupt``, ``stop`` (interrupt, then cancel
after a grace) or take a ``send`` (text, and images as ``data:`` URLs) as a
:class:`Steer`. Whatever carries it (this process's :class:`LocalRuns`, Redis through
``aio.RedisControl``, Temporal through ``aimu.temporal.RunsClient``: each a
:class:`Steering`), :func:`steer` is what finally applies it to the run's handle.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

from aimu.aio.errors import UnknownRunError
from aimu.aio.images import received_images

if TYPE_CHECKING:
    from aimu.aio.run_handle import RunHandle

__all__ = ["LocalRuns", "Spawn", "Steer", "SteerKind", "Steering", "steer"]

SteerKind: TypeAlias = Literal["cancel", "interrupt", "stop", "send"]
#: Runs a coroutine in the background (a stop's wait for its grace), owned by the caller.
Spawn: TypeAlias = Callable[[Coroutine[Any, Any, Any]], object]


@dataclass(frozen=True, slots=True)
class Steer:
    """What a client asks of a live run: ``cancel`` (``reason``), ``interrupt``, ``stop``
    (``grace`` seconds, then cancel) or ``send`` (``text``, ``images`` as ``data:`` URLs)."""

    kind: SteerKind
    reason: str | None = None
    grace: float = 5.0
    text: str = ""
    images: tuple[str, ...] = ()


def steer(handle: RunHandle[Any], request: Steer, spawn: Spawn) -> bool:
    """Apply ``request`` to ``handle``; False if the run could not take it (it ended, is
    being cancelled, or no longer takes text). A stop's wait runs under ``spawn``. A
    send's images must be ``data:`` URLs (ValueError: a path would read this host's
    files); its text and images are checked as ``run()`` checks them."""
    kind = request.kind
    if kind == "cancel":
        return handle.cancel(request.reason)
    if kind == "interrupt":
        return handle.interrupt()
    if kind == "stop":
        if handle.done:
            return False
        spawn(handle.stop(request.grace))
        return True
    if kind == "send":
        return handle.send(request.text, images=received_images(request.images))
    raise ValueError(f"unknown request {kind!r}: cancel, interrupt, stop or send")


class Steering(Protocol):
    """Delivers requests to live runs by id, wherever they run."""

    async def request(self, run_id: str, request: Steer) -> bool:
        """Deliver ``request`` to run ``run_id``; False if it had ended (or refused it),
        ``UnknownRunError`` if there is no such run."""
        ...


class LocalRuns:
    """The runs of this process by id: the :class:`Steering` for them."""

    def __init__(self, spawn: Spawn) -> None:
        self._spawn = spawn
        self._handles: dict[str, RunHandle[Any]] = {}

    def add(self, handle: RunHandle[Any]) -> None:
        """Know ``handle`` by its ``run_id`` until it ends."""
        run_id = handle.run_id
        if run_id is None:
            raise ValueError(f"{handle!r} has no run_id: start it with run_id=")
        self._handles[run_id] = handle
        handle.add_done_callback(lambda done: self._handles.pop(run_id, None))

    def holds(self, run_id: str) -> bool:
        """True while run ``run_id`` is one of these (it has not ended)."""
        return run_id in self._handles

    async def request(self, run_id: str, request: Steer) -> bool:
        handle = self._handles.get(run_id)
        if handle is None:
            raise UnknownRunError(f"no run {run_id!r} in this process", url="this process")
        return steer(handle, request, self._spawn)
