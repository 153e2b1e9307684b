"""What the local stores (SQLite, JSONL) share: writers under a lock, the open-writer set."""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from typing import Generic, Self, TypeVar

from aimu.aio.errors import StoreError
from aimu.aio.store._lock import SessionLock

__all__ = ["StoreBase", "WriterBase"]


class WriterBase(abc.ABC):
    """A session writer: the session, its lock, and the closed check."""

    def __init__(self, session: str, lock: SessionLock, where: str) -> None:
        self.session = session
        self._lock = lock
        self._label = f"{where} writer of {session!r}"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<{self._label}, {'open' if self._lock.held else 'closed'}>"

    async def aclose(self) -> None:
        """Release the write lock; idempotent."""
        self.release()

    @abc.abstractmethod
    def release(self) -> None:
        """Release the write lock now (the synchronous form of :meth:`aclose`)."""

    def _check_open(self, what: str) -> None:
        if not self._lock.held:
            raise StoreError(f"the writer of session {self.session!r} is closed; cannot {what}")


W = TypeVar("W", bound=WriterBase)


class StoreBase(abc.ABC, Generic[W]):
    """A store: ``async with`` it; writers open under a session lock."""

    _mutex: threading.RLock
    _writers: set[W]

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    async def aclose(self) -> None:
        """Close every writer still open and release the store's resources; idempotent."""
        self.close()

    @abc.abstractmethod
    def close(self) -> None:
        """The synchronous form of :meth:`aclose`, for code that has no event loop."""

    def _add_writer(self, lock: SessionLock, make: Callable[[SessionLock], W]) -> W:
        """Build a writer holding ``lock`` (released if building fails); call under the mutex."""
        try:
            writer = make(lock)
        except BaseException:
            lock.release()
            raise
        self._writers.add(writer)
        return writer
