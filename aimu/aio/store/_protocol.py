"""What every store offers: the :class:`Store` and :class:`SessionWriter` protocols.

A store holds named sessions, each a transcript plus metadata. Writing goes through a
writer from :meth:`Store.open_session`, which holds the session's write lock, so two
writers never interleave; reading is always allowed. When ``append`` returns, the
message survives the process being killed. Beside the transcript a session keeps its
status, a tool journal (:class:`ToolStart`) and a JSON state object.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol, TypeAlias, cast, get_args, runtime_checkable

from aimu.aio.transcript import Message

__all__ = [
    "SessionInfo",
    "SessionStatus",
    "SessionWriter",
    "Store",
    "ToolStart",
    "check_status",
    "session_info",
    "validate_session_name",
]

SessionStatus: TypeAlias = Literal[
    "in_progress", "completed", "incomplete", "interrupted", "cancelled", "timed_out",
    "failed", "max_rounds", "paused", "limited",
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


@dataclass(frozen=True, slots=True)
class ToolStart:
    """One entry of a session's tool journal: a tool call that was about to run.

    A call with a start and no tool result message in the transcript is *in doubt*: the
    process stopped while it ran, so its side effect may or may not have happened.
    """

    call_id: str
    name: str
    arguments: Any
    """The call's arguments as the model sent them (any JSON value)."""
    started: float


def session_info(row: tuple[Any, ...]) -> SessionInfo:
    """A :class:`SessionInfo` from a database row (name, created, updated, status, the
    last message's seq and time): the count and last update come from the messages."""
    name, created, updated, status, last_seq, last_at = row
    count = 0 if last_seq is None else last_seq + 1
    if last_at is not None:
        updated = max(updated, last_at)
    return SessionInfo(name, created, updated, count, status)


@runtime_checkable
class SessionWriter(Protocol):
    """The write side of one session; holds its write lock until :meth:`aclose`.

    Every write is durable when it returns (it survives ``kill -9`` of the process), and
    a cancel that lands during a write never loses it: the write completes, then the
    ``CancelledError`` is raised. Writes of one writer are applied in call order.
    """

    session: str

    async def load(self) -> list[Message]:
        """The session's transcript as stored now."""
        ...

    async def append(self, message: Message) -> None:
        """Add one message at the end of the transcript."""
        ...

    async def replace(self, messages: Sequence[Message]) -> None:
        """Atomically rewrite the whole transcript (all or nothing); the journal stays."""
        ...

    async def set_status(self, status: SessionStatus) -> None:
        """Record the session's status (how its last run ended, or that it runs)."""
        ...

    async def record_tool_start(self, call_id: str, name: str, arguments: Any) -> None:
        """Journal that tool call ``call_id`` starts now; write it before the tool runs."""
        ...

    async def save_state(self, state: Mapping[str, Any]) -> None:
        """Replace the session's state (a JSON object: pending approvals, decisions)."""
        ...

    async def aclose(self) -> None:
        """Release the write lock; idempotent."""
        ...


@runtime_checkable
class Store(Protocol):
    """Named, durable sessions; every method is a coroutine, whatever the backend."""

    async def open_session(self, session: str) -> SessionWriter:
        """Take the session's write lock; ``SessionLockedError`` if a writer holds it."""
        ...

    async def load(self, session: str) -> list[Message]:
        """The stored transcript (``[]`` if unknown); allowed even while a writer holds it."""
        ...

    async def load_state(self, session: str) -> dict[str, Any]:
        """The state last saved by :meth:`SessionWriter.save_state` (``{}`` if none)."""
        ...

    async def tool_starts(self, session: str) -> list[ToolStart]:
        """The session's tool journal, oldest first."""
        ...

    async def sessions(self) -> list[SessionInfo]:
        """Every stored session, by name."""
        ...

    async def info(self, session: str) -> SessionInfo | None:
        """The session's metadata, or None if it was never written."""
        ...

    async def delete(self, session: str) -> bool:
        """Remove the session; False if it did not exist; ``SessionLockedError`` if open."""
        ...

    async def aclose(self) -> None:
        """Close every writer still open and release the store's resources; idempotent."""
        ...
