"""Playing one scripted turn as a chat reply: its delays, its chunks and its faults.

:func:`play` sends a :class:`~aimu.testing.script.Turn` over a connection in the
framing of a :class:`~aimu.testing.server.wire.Wire`, streamed or whole, waiting
``first_byte_delay`` and ``delay`` between chunks, and injects the turn's fault
(an HTTP error status, a reset, a dropped or hanging stream, broken JSON, no done
marker). It keeps the :class:`~aimu.testing.server.records.StreamRecord` up to date,
including whether and when the client abandoned the reply.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from aimu.testing.script import Turn, split_text
from aimu.testing.server._connection import Connection
from aimu.testing.server.records import StreamRecord
from aimu.testing.server.wire import JSON, Wire

__all__ = ["HTTP_FAULTS", "play"]

_MID_STREAM_FAULTS = frozenset({"bad_json", "drop", "hang", "error_event", "overloaded_event"})
#: Faults that cut the stream inside a chunk (see _Player._cut).
_CUTS = frozenset({"cut", "stall"})
HTTP_FAULTS = {
    "http_500": 500, "http_429": 429, "http_502": 502, "http_503": 503, "http_504": 504,
    "http_503_loading": 503, "http_529": 529,
}
#: The error event faults: the status whose error each event carries, and its words.
_EVENT_FAULTS = {
    "error_event": (500, "internal error (scripted error_event fault)"),
    "overloaded_event": (529, "Overloaded (scripted overloaded_event fault)"),
}
_FAULT_WORDS = {
    429: "rate limited",
    500: "internal server error",
    502: "bad gateway",
    503: "service unavailable",
    504: "gateway timeout",
    529: "overloaded",
}


async def play(
    connection: Connection,
    wire: Wire,
    turn: Turn,
    record: StreamRecord,
    notify: Callable[[], None],
    echo: str = "",
    hurried: Callable[[], bool] = lambda: False,
) -> bool:
    """Send ``turn`` as the reply; False when the connection must close (cut or gone).

    ``notify`` is called after each chunk and when the client abandons the reply.
    ``echo`` (the prefill, from a server that echoes it) goes first: one text chunk of
    its own when streamed, the start of the content when whole. While ``hurried()`` is
    true, a streamed reply sends its next chunks without the turn's delay.
    """
    player = _Player(connection, wire, turn, record, notify, echo, hurried)
    connection.watch()
    try:
        return await (player.stream() if record.streamed else player.whole())
    finally:
        record.finished_at = time.monotonic()
        await connection.unwatch()


@dataclass
class _Player:
    connection: Connection
    wire: Wire
    turn: Turn
    record: StreamRecord
    notify: Callable[[], None]
    echo: str = ""
    hurried: Callable[[], bool] = lambda: False

    def _gone(self) -> bool:
        """The client went away: record it, and close."""
        self.record.abandoned = True
        self.record.abandoned_at = self.connection.peer_closed_at or time.monotonic()
        self.notify()
        return False

    def _reset(self) -> bool:
        """Close the connection at once (RST) before any byte of the reply."""
        self.connection.reset()
        return False

    async def _http_fault(self) -> bool:
        turn = self.turn
        status = HTTP_FAULTS[str(turn.fault)]
        words = f"{_FAULT_WORDS[status]} (scripted {turn.fault} fault)"
        if turn.fault == "http_503_loading":
            words = "Loading model"  # llama.cpp's server, while it loads the weights
        body = self.wire.error_body(status, words)
        retry_after = turn.retry_after or ("1" if status == 429 else None)
        extra = [("Retry-After", retry_after)] if retry_after is not None else []
        extra += self.wire.error_headers(status)
        if not await self.connection.send_response(status, body, JSON, extra):
            return self._gone()
        self.record.chunks_sent = 1
        return True

    async def whole(self) -> bool:
        turn, connection = self.turn, self.connection
        # The reply takes as long as its stream would have: first byte, then each delay.
        text_pieces = len(split_text(turn.text, turn.chunks))
        pieces = bool(turn.thinking) + text_pieces + len(turn.tool_calls)
        if await connection.wait(turn.first_byte_delay + turn.delay * max(0, pieces - 1)):
            return self._gone()
        if turn.fault in HTTP_FAULTS:
            return await self._http_fault()
        if turn.fault == "reset":
            return self._reset()
        if turn.fault in ("drop", "cut"):
            return False
        if turn.fault in ("hang", "stall"):
            await connection.wait(None)
            return self._gone()
        if turn.fault == "bad_json":
            body = self.wire.bad_line().strip()
        elif turn.fault in _EVENT_FAULTS:
            body = self.wire.error_body(*_EVENT_FAULTS[turn.fault])
        else:
            echoed = replace(turn, text=self.echo + turn.text) if self.echo else turn
            body = self.wire.whole(echoed, finished=turn.fault != "no_done")
        if not await connection.send_response(200, body, JSON):
            return self._gone()
        self.record.chunks_sent = 1
        self.record.completed = turn.fault is None
        return True

    async def stream(self) -> bool:
        turn, connection, record = self.turn, self.connection, self.record
        if await connection.wait(turn.first_byte_delay):
            return self._gone()
        if turn.fault in HTTP_FAULTS:
            return await self._http_fault()
        if turn.fault == "reset":
            return self._reset()
        if not await connection.start_stream(self.wire.stream_content_type):
            return self._gone()
        pieces = self.wire.chunks(turn)
        if self.echo:
            pieces = self.wire.chunks(Turn(text=self.echo, chunks=1)) + pieces
        if turn.fault in _CUTS:
            return await self._cut([*pieces, *self.wire.final(turn)])
        fault_at = min(turn.fault_after, len(pieces)) if turn.fault in _MID_STREAM_FAULTS else -1
        for position in range(len(pieces) + 1):
            if position == len(pieces) and position != fault_at:
                break
            if position and await connection.wait(0.0 if self.hurried() else turn.delay):
                return self._gone()
            if position == fault_at:
                return await self._mid_stream_fault()
            if not await connection.send_chunks([pieces[position]]):
                return self._gone()
            record.chunks_sent += 1
            self.notify()
        final = [] if turn.fault == "no_done" else self.wire.final(turn)
        if not await connection.send_chunks(final, end=True):
            return self._gone()
        record.chunks_sent += len(final)
        record.completed = turn.fault != "no_done"
        return True

    async def _cut(self, pieces: list[bytes]) -> bool:
        """The ``cut`` fault: ``fault_after`` chunks of the whole stream (its final ones
        counted), then the first half of the next one's bytes (at least one), and the
        connection closes mid-body (``stall``: never a byte more, the connection open)."""
        turn, record = self.turn, self.record
        at = max(0, min(turn.fault_after, len(pieces) - 1))
        for position in range(at + 1):
            if position and await self.connection.wait(0.0 if self.hurried() else turn.delay):
                return self._gone()
            piece = pieces[position]
            if position == at:
                piece = piece[: max(1, len(piece) // 2)]
            if not await self.connection.send_chunks([piece]):
                return self._gone()
            record.chunks_sent += 1
            self.notify()
        if turn.fault == "stall":
            await self.connection.wait(None)
            return self._gone()
        return False  # the caller closes the socket with the body unfinished

    async def _mid_stream_fault(self) -> bool:
        if self.turn.fault == "drop":
            return False  # the caller closes the socket with the body unfinished
        if self.turn.fault == "hang":
            await self.connection.wait(None)
            return self._gone()
        if self.turn.fault in _EVENT_FAULTS:
            status, words = _EVENT_FAULTS[self.turn.fault]
            event = self.wire.overloaded_event if status == 529 else self.wire.error_event
            line = event(words)
        else:
            line = self.wire.bad_line()
        if not await self.connection.send_chunks([line], end=True):
            return self._gone()
        self.record.chunks_sent += 1
        return True
