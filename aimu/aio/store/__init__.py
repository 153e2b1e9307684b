"""Durable sessions: every message stored the moment it is recorded.

A :class:`Store` holds named sessions, each a transcript plus metadata; a
:class:`SessionWriter` from :meth:`Store.open_session` holds the session's write lock;
reading is always allowed. :class:`SQLiteStore` (the default: one file, stdlib
``sqlite3`` in WAL mode) and :class:`JSONLStore` (a directory of append-only
``<session>.jsonl`` files) serve one machine. A torn last record (the process died
mid-write) is ignored on load with a ``RuntimeWarning`` and repaired by the next writer;
corruption before it is a :class:`~aimu.aio.errors.StoreFormatError` naming the place.
"""

from aimu.aio.store._jsonl import JSONLStore
from aimu.aio.store._protocol import (
    SessionInfo,
    SessionStatus,
    SessionWriter,
    Store,
    validate_session_name,
)
from aimu.aio.store._sqlite import SQLiteStore

__all__ = [
    "JSONLStore",
    "SQLiteStore",
    "SessionInfo",
    "SessionStatus",
    "SessionWriter",
    "Store",
    "validate_session_name",
]
