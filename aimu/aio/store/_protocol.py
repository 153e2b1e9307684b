"""What every store offers: the :class:`Store` and :class:`SessionWriter` protocols.

A store holds named sessions, each a transcript plus metadata. Writing goes through a
writer from :meth:`Store.open_session`, which holds the session's write lock, so two
writers never interleave; reading is always allowed. When ``append`` returns, the
message survives the process being killed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, Protocol, TypeAlias, cast, get_args, runtime_checkable

from aimu.aio.transcript import Message

__all__ = [
    "SessionInfo",
    "SessionStatus",
    "SessionWriter",
    "Store",
    "check_status",
    "validate_session_name",
]

SessionStatus: TypeAlias = Literal[
    "in_progress", "completed", "interrupted", "cancelled", "failed", "max_rounds"
]
STATUSES: Final = frozenset(get_args(SessionStatus))

_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def validate_session_name(name: str) -> str:
    """Return ``name`` if it is a valid session name, else raise ``ValueError`` naming it.

    Valid: 1-128 characters from ``[A-Za-z0-9._-]``, and not ``.`` or ``..``; so a name
    can never reach outside a store's directory.
    """
    if not isinstance(name, str):
        raise TypeError(f"a session name is a str, got {type(name).__name__}")
    if _NAME.fullmatch(name) is None or name in (".", ".."):
        raise ValueError(
            f"invalid session name {name!r:.150}: use 1-128 characters from A-Z a-z 0-9 . _ - "
            "(not '.' or '..')"
        )
    return name


def check_status(status: str) -> SessionStatus:
    """Return ``status`` if it is a :data:`SessionStatus`, else raise ``ValueError``."""
    if status not in STATUSES:
        raise ValueError(
            f"unknown session status {status!r:.100}; expected one of "
            f"{', '.join(sorted(STATUSES))}"
        )
    return cast(SessionStatus, status)


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """What a store knows about one session; times are ``time.time()`` seconds."""

    name: str
    created: float
    updated: float
    message_count: int
    status: SessionStatus | None
    """The last status a writer set, or None if none was set."""


@runtime_checkable
class SessionWriter(Protocol):
    """The write side of one session; holds its lock until :meth:`close`."""

    session: str

    def load(self) -> list[Message]:
        """The session's transcript as stored now."""
        ...

    def append(self, message: Message) -> None:
        """Add one message; once this returns it survives the process being killed."""
        ...

    def replace(self, messages: Sequence[Message]) -> None:
        """Atomically rewrite the whole transcript (all or nothing)."""
        ...

    def set_status(self, status: SessionStatus) -> None:
        """Record the session's status, as durably as :meth:`append`."""
        ...

    def close(self) -> None:
        """Release the write lock; idempotent."""
        ...


@runtime_checkable
class Store(Protocol):
    """Named, durable sessions."""

    def open_session(self, session: str) -> SessionWriter:
        """Take the session's write lock; ``SessionLockedError`` if a writer holds it."""
        ...

    def load(self, session: str) -> list[Message]:
        """The stored transcript (``[]`` if unknown); allowed even while a writer holds it."""
        ...

    def sessions(self) -> list[SessionInfo]:
        """Every stored session, by name."""
        ...

    def info(self, session: str) -> SessionInfo | None:
        """The session's metadata, or None if it was never written."""
        ...

    def delete(self, session: str) -> bool:
        """Remove the session; False if it did not exist; ``SessionLockedError`` if open."""
        ...

    def close(self) -> None:
        """Close every writer still open and release the store's resources; idempotent."""
        ...
