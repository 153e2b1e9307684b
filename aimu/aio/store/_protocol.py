"""What every store offers: the :class:`Store` and :class:`SessionWriter` protocols.

A store holds named sessions, each a transcript plus metadata. Writing goes through a
writer from :meth:`Store.open_session`, which holds the session's write lock, so two
writers never interleave; reading is always allowed. When ``append`` returns, the
message survives the process being killed. Beside the transcript a session keeps its
status, a tool journal (:class:`ToolStart`) and a JSON state object.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, cast, runtime_checkable

from aimu.aio.status import (
    RUN_RECORD_STATUSES,
    SESSION_STATUSES,
    RunRecordStatus,
    SessionStatus,
)
from aimu.aio.transcript import Message, UserMessage

__all__ = [
    "RUN_STATUSES",
    "PendingInput",
    "RunRecord",
    "RunRecordStatus",
    "SessionInfo",
    "SessionStatus",
    "SessionWriter",
    "Store",
    "ToolStart",
    "check_run_id",
    "check_run_of",
    "check_run_status",
    "check_status",
    "input_message",
    "run_record",
    "run_row",
    "session_info",
    "validate_session_name",
]

#: Every :data:`SessionStatus`.
STATUSES: Final = SESSION_STATUSES

_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")

#: Every :data:`RunRecordStatus`.
RUN_STATUSES: Final = RUN_RECORD_STATUSES
#: The most runs one call of :meth:`Store.runs` returns.
MAX_RUNS_PAGE: Final = 1000


def validate_session_name(name: str) -> str:
    """Return ``name`` if it is a valid session name, else raise ``ValueError`` naming it.

    Valid: 1-128 characters from ``[A-Za-z0-9._-]``, and not ``.`` or ``..``; so a name
    can never reach outside a store's directory.
    """
    return _checked_name(name, "session name")


def _checked_name(name: str, what: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"a {what} is a str, got {type(name).__name__}")
    if _NAME.fullmatch(name) is None or name in (".", ".."):
        raise ValueError(
            f"invalid {what} {name!r:.150}: use 1-128 characters from A-Z a-z 0-9 . _ - "
            "(not '.' or '..')"
        )
    return name


def _checked_status(status: str, known: frozenset[str], what: str) -> str:
    if status not in known:
        raise ValueError(
            f"unknown {what} status {status!r:.100}; expected one of {', '.join(sorted(known))}"
        )
    return status


def check_status(status: str) -> SessionStatus:
    """Return ``status`` if it is a :data:`SessionStatus`, else raise ``ValueError``."""
    return cast(SessionStatus, _checked_status(status, STATUSES, "session"))


def check_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is a valid run id (the session name rules), else raise
    ``ValueError`` naming it."""
    return _checked_name(run_id, "run id")


def check_run_status(status: str) -> RunRecordStatus:
    """Return ``status`` if it is a :data:`RunRecordStatus`, else raise ``ValueError``."""
    return cast(RunRecordStatus, _checked_status(status, RUN_STATUSES, "run"))


@dataclass(frozen=True, slots=True)
class RunRecord:
    """One run of an agent on a session, as its store keeps it: written with status
    ``running`` as the run starts and again as it ends, so a run whose record still says
    ``running`` while no process runs it died with its process. Times are
    ``time.time()`` seconds."""

    id: str
    session: str
    agent: str
    started: float
    status: RunRecordStatus
    parent: str | None = None
    """The run this one runs inside (agent trees); None for a top-level run."""
    ended: float | None = None
    reason: str | None = None
    """Why the run ended so (a cancel's reason, the error's type, the tools waiting)."""
    stop_reason: str | None = None
    """Why the model stopped its last turn, as its server said ("stop", "length"...)."""
    usage: Mapping[str, int] | None = None
    """Tokens the run used: ``input_tokens``, ``output_tokens``."""
    spend: Mapping[str, Any] | None = None
    """What the run spent (:meth:`aimu.aio.Spend.dump`)."""
    limit: str | None = None
    """The usage limit that ended a ``limited`` run, in words."""
    models: tuple[str, ...] = ()
    """The models that wrote the run's replies (``"provider:model"``), in order."""
    recover: bool = False
    """The run is to be resumed by a process that recovers runs (drain, crash)."""
    messages_from: int | None = None
    """Where the run's messages begin in its session's transcript (the transcript's
    length as it started); None in records of an aimu that did not keep it."""

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object (the HTTP API's and the JSONL runs file's shape)."""
        return {
            "id": self.id, "session": self.session, "agent": self.agent,
            "parent": self.parent, "started": self.started, "ended": self.ended,
            "status": self.status, "reason": self.reason, "stop_reason": self.stop_reason,
            "usage": None if self.usage is None else dict(self.usage),
            "spend": None if self.spend is None else dict(self.spend),
            "limit": self.limit, "models": list(self.models), "recover": self.recover,
            "messages_from": self.messages_from,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunRecord:
        """The record of :meth:`to_json`; ``ValueError`` if it is not one."""
        try:
            record = cls(
                id=check_run_id(data["id"]),
                session=validate_session_name(data["session"]),
                agent=str(data["agent"]),
                started=float(data["started"]),
                status=check_run_status(data["status"]),
                parent=data.get("parent"),
                ended=None if data.get("ended") is None else float(data["ended"]),
                reason=data.get("reason"),
                stop_reason=data.get("stop_reason"),
                usage=data.get("usage"),
                spend=data.get("spend"),
                limit=data.get("limit"),
                models=tuple(data.get("models") or ()),
                recover=bool(data.get("recover", False)),
                messages_from=_count_or_none(data.get("messages_from")),
            )
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a run record: {error!r}") from None
        return record


def _count_or_none(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"messages_from is not a count: {value!r:.50}")
    return value


#: The columns of a run row in the SQL stores, in order (usage, spend and models as JSON).
RUN_COLUMNS: Final = (
    "id", "session", "agent", "parent", "started", "ended", "status", "reason",
    "stop_reason", "usage", "spend", "run_limit", "models", "recover", "messages_from",
)


def check_run_of(record: RunRecord, session: str) -> RunRecord:
    """``record`` if it is a valid run of ``session``, else ``ValueError`` (a writer
    writes the runs of its own session only)."""
    if not isinstance(record, RunRecord):
        raise TypeError(f"a run record is a RunRecord, got {type(record).__name__}")
    if record.session != session:
        raise ValueError(
            f"run {record.id!r} is of session {record.session!r}, not of {session!r}: "
            "record it with that session's writer"
        )
    check_run_id(record.id)
    check_run_status(record.status)
    return record


def _json_text(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


def run_row(record: RunRecord) -> tuple[Any, ...]:
    """``record`` as a row of :data:`RUN_COLUMNS`."""
    return (
        check_run_id(record.id), validate_session_name(record.session), record.agent,
        record.parent, record.started, record.ended, check_run_status(record.status),
        record.reason, record.stop_reason,
        _json_text(None if record.usage is None else dict(record.usage)),
        _json_text(None if record.spend is None else dict(record.spend)),
        record.limit, json.dumps(list(record.models)), bool(record.recover),
        record.messages_from,
    )


def run_record(row: Sequence[Any]) -> RunRecord:
    """The :class:`RunRecord` of a row of :data:`RUN_COLUMNS`."""
    (run_id, session, agent, parent, started, ended, status, reason, stop_reason, usage,
     spend, limit, models, recover, messages_from) = row
    return RunRecord(
        id=run_id, session=session, agent=agent, started=started, status=status,
        parent=parent, ended=ended, reason=reason, stop_reason=stop_reason,
        usage=None if usage is None else json.loads(usage),
        spend=None if spend is None else json.loads(spend),
        limit=limit, models=tuple(json.loads(models or "[]")), recover=bool(recover),
        messages_from=messages_from,
    )


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


@dataclass(frozen=True, slots=True)
class PendingInput:
    """A message sent to a session's run (``send()``), stored the moment it was accepted
    and not yet joined to the transcript: the run joins it at its next step boundary
    (:meth:`SessionWriter.join_input`), or the session's next run does, exactly once.
    ``message["aimu_sent"]`` is ``id``."""

    id: str
    message: UserMessage
    at: float


def input_message(input_id: str, message: UserMessage) -> UserMessage:
    """``message`` checked as a pending input's: a user message whose ``aimu_sent`` is
    ``input_id`` (ValueError if not)."""
    _checked_name(input_id, "input id")
    if message.get("role") != "user" or message.get("aimu_sent") != input_id:
        raise ValueError(
            f"input {input_id!r}: a pending input is a user message whose aimu_sent is its id"
        )
    return message


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

    async def record_run(self, record: RunRecord) -> None:
        """Write the record of a run of this session (a new one, or the same id again:
        it replaces the earlier record, as the run ends)."""
        ...

    async def join_input(self, message: UserMessage) -> bool:
        """Append the pending input ``message`` (its id in ``aimu_sent``) to the
        transcript and take it off the pending inputs, atomically; False, and nothing
        appended, if it is no longer pending (its sender took it back)."""
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

    async def add_input(self, session: str, message: UserMessage) -> None:
        """Keep ``message``, sent to the session's run, as a pending input (its id in
        ``aimu_sent``), durably when this returns; no write lock needed (any process may
        send). Adding the same id again changes nothing."""
        ...

    async def inputs(self, session: str) -> list[PendingInput]:
        """The session's pending inputs, oldest first."""
        ...

    async def drop_input(self, session: str, input_id: str) -> bool:
        """Take back a pending input its run did not take (a send refused); False if it
        is not pending (joined already, or never stored)."""
        ...

    async def info(self, session: str) -> SessionInfo | None:
        """The session's metadata, or None if it was never written."""
        ...

    async def runs(
        self,
        session: str | None = None,
        status: str | None = None,
        limit: int = 100,
        before: str | None = None,
        *,
        recover: bool | None = None,
    ) -> list[RunRecord]:
        """Run records, the latest started first, at most ``limit``: of one ``session``,
        with one ``status``, with ``recover`` set so (None: either), started before the
        run ``before`` (the last id of the page before). ``ValueError`` for a bad argument
        or an unknown ``before``."""
        ...

    async def run(self, run_id: str) -> RunRecord | None:
        """The record of run ``run_id``, or None; ``ValueError`` for an invalid id."""
        ...

    async def delete(self, session: str) -> bool:
        """Remove the session, its run records and pending inputs; False if it did not exist;
        ``SessionLockedError`` if open."""
        ...

    async def aclose(self) -> None:
        """Close every writer still open and release the store's resources; idempotent."""
        ...
