"""Durable sessions: every message stored the moment it is recorded.

A :class:`Store` holds named sessions, each a transcript plus metadata, a tool journal
and a JSON state; a :class:`SessionWriter` from :meth:`Store.open_session` holds the
session's write lock; reading is always allowed. Every method is a coroutine.
:class:`SQLiteStore` (the default: one file, stdlib ``sqlite3`` in WAL mode) and
:class:`JSONLStore` (a directory of append-only ``<session>.jsonl`` files) serve one
machine; :class:`PostgresStore` (extra ``aimu-agents[postgres]``) serves many hosts. A torn
last record (the process died mid-write) is ignored on load with a ``RuntimeWarning``
and repaired by the next writer; corruption before it is a
:class:`~aimu.aio.errors.StoreFormatError` naming the place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aimu.aio._lazy import lazy_names
from aimu.aio.store._protocol import (
    PendingInput,
    RunRecord,
    SessionInfo,
    SessionStatus,
    SessionWriter,
    Store,
    ToolStart,
    validate_session_name,
)

if TYPE_CHECKING:
    from aimu.aio.store._jsonl import JSONLStore
    from aimu.aio.store._postgres import PostgresStore
    from aimu.aio.store._sqlite import SQLiteStore

__all__ = [
    "JSONLStore",
    "PendingInput",
    "PostgresStore",
    "RunRecord",
    "SQLiteStore",
    "SessionInfo",
    "SessionStatus",
    "SessionWriter",
    "Store",
    "ToolStart",
    "validate_session_name",
]

# Backends import on first use, so the agent's import of the protocol stays light.
_BACKENDS = {"JSONLStore": "_jsonl", "PostgresStore": "_postgres", "SQLiteStore": "_sqlite"}


__getattr__ = lazy_names(__name__, _BACKENDS)
