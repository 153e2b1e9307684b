"""Pending inputs in PostgreSQL (see :class:`~aimu.aio.store.PendingInput`): the
``inputs`` table, one row per input not joined yet, kept by any process without the
session's lock and taken by its writer in the transaction that appends it."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from aimu.aio.errors import StoreError
from aimu.aio.store._codec import encode
from aimu.aio.store._protocol import PendingInput, input_message, validate_session_name
from aimu.aio.transcript import UserMessage

if TYPE_CHECKING:
    import asyncpg

__all__ = ["StoreInputs", "WriterInputs"]

_T = TypeVar("_T")


class StoreInputs:
    """The store's side: keep, list and take back pending inputs, and read a session's
    rows (the read pool)."""

    _s: str

    async def _read(
        self, what: str, query: Callable[[asyncpg.Connection], Awaitable[_T]]
    ) -> _T:
        raise NotImplementedError

    async def _session_rows(self, session: str, what: str, sql: str) -> list[asyncpg.Record]:
        """The rows ``sql`` selects for ``session`` (its ``$1``; the name checked first),
        read as ``what`` (named in an error)."""
        validate_session_name(session)
        return await self._read(what, lambda conn: conn.fetch(sql, session))

    async def add_input(self, session: str, message: UserMessage) -> None:
        validate_session_name(session)
        input_id = str(message.get("aimu_sent"))
        body = encode(input_message(input_id, message), session, 0)
        await self._read(
            f"keep an input of session {session!r}",
            lambda conn: conn.execute(
                f"INSERT INTO {self._s}.inputs (session, id, at, body) VALUES ($1, $2, $3, $4) "
                "ON CONFLICT (session, id) DO NOTHING",
                session, input_id, time.time(), body,
            ),
        )

    async def inputs(self, session: str) -> list[PendingInput]:
        rows = await self._session_rows(
            session, f"read the inputs of session {session!r}",
            f"SELECT id, at, body FROM {self._s}.inputs WHERE session = $1 ORDER BY at, id",
        )
        return [PendingInput(row[0], json.loads(row[2]), row[1]) for row in rows]

    async def drop_input(self, session: str, input_id: str) -> bool:
        validate_session_name(session)
        status = await self._read(
            f"take back an input of session {session!r}",
            lambda conn: conn.execute(
                f"DELETE FROM {self._s}.inputs WHERE session = $1 AND id = $2",
                session, input_id,
            ),
        )
        return bool(status != "DELETE 0")



class WriterInputs:
    """The writer's side: join a pending input (its own connection, in call order)."""

    session: str
    _s: str
    _next_seq: int
    _has_row: bool

    def _live(self, what: str) -> asyncpg.Connection:
        raise NotImplementedError

    async def _write(
        self, what: str, operation: Callable[[asyncpg.Connection], Awaitable[None]]
    ) -> None:
        raise NotImplementedError

    async def _upsert_session(self, conn: asyncpg.Connection, now: float) -> None:
        raise NotImplementedError

    async def join_input(self, message: UserMessage) -> bool:
        self._live("join an input")
        input_id = str(message.get("aimu_sent"))
        seq = self._next_seq
        body = encode(input_message(input_id, message), self.session, seq)
        joined = False

        async def run(conn: asyncpg.Connection) -> None:
            nonlocal joined
            async with conn.transaction():
                status = await conn.execute(
                    f"DELETE FROM {self._s}.inputs WHERE session = $1 AND id = $2",
                    self.session, input_id,
                )
                if status == "DELETE 0":
                    return
                await self._upsert_session(conn, time.time())
                await conn.execute(
                    f"INSERT INTO {self._s}.messages (session, seq, at, body) "
                    "VALUES ($1, $2, $3, $4)",
                    self.session, seq, time.time(), body,
                )
            joined = True

        self._next_seq = seq + 1  # before any await, as append
        try:
            await self._write("join an input to", run)
        except StoreError:
            if self._next_seq == seq + 1:
                self._next_seq = seq
            raise
        if joined:
            self._has_row = True
        elif self._next_seq == seq + 1:
            self._next_seq = seq  # nothing appended
        return joined

