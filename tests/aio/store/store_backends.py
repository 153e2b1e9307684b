"""The store backends the contract suite runs against, each on a private location.

``backend(kind, tmp_path)`` gives a :class:`Backend` that builds stores on one location
(a file, a directory, or a PostgreSQL schema of its own that is dropped afterwards) and
the Python source that builds the same store in a child process.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from aimu.aio.store import Store
from aimu.aio.transcript import Message
from tests import services

KINDS = ["sqlite", "jsonl", "postgres"]

SOAK_KILLS = int(os.environ.get("AIMU_CRASH_KILLS") or 0)
"""Kills at random moments the crash loops add after their fixed landings on every
distinct point (``AIMU_CRASH_KILLS=50``: the long soak; see CONTRIBUTING.md)."""


@dataclass(frozen=True)
class Backend:
    kind: str
    spec: str
    """Python source that builds the store (``from aimu import aio`` imported)."""

    def make(self) -> Store:
        from aimu import aio

        store = eval(self.spec, {"aio": aio})
        assert isinstance(store, Store)
        return store


@contextlib.asynccontextmanager
async def backend(kind: str, tmp_path: Path) -> AsyncIterator[Backend]:
    if kind == "sqlite":
        yield Backend(kind, f"aio.SQLiteStore({str(tmp_path / 'sessions.db')!r})")
    elif kind == "jsonl":
        yield Backend(kind, f"aio.JSONLStore({str(tmp_path / 'sessions')!r})")
    else:
        dsn = services.postgres_dsn()
        schema = f"aimu_test_{uuid.uuid4().hex[:12]}"
        try:
            yield Backend(kind, f"aio.PostgresStore({dsn!r}, schema={schema!r})")
        finally:
            await drop_schema(dsn, schema)


async def drop_schema(dsn: str, schema: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


def conversation(rounds: int) -> list[Message]:
    """A valid transcript: system, task, ``rounds`` tool rounds, an answer."""
    messages: list[Message] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "add things — ünïcode ✓"},
    ]
    for i in range(rounds):
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {"name": "add", "arguments": {"a": i, "b": [1.5, None]}},
                    }
                ],
            }
        )
        messages.append(
            {"role": "tool", "content": str(i), "tool_call_id": f"call_{i}", "name": "add"}
        )
    messages.append({"role": "assistant", "content": "done", "thinking": "easy"})
    return messages
