"""Uvicorn's HTTP/1.1 connection with a deadline for each request to arrive (slowloris).

Uvicorn times out a connection idle *between* requests (``timeout_keep_alive``), but
not one that sends a request's head or body a byte at a time: a few hundred such clients
hold every connection open forever. :class:`DeadlineH11Protocol` gives each request
``request_seconds`` from its first byte (or from the connection's start) until its last;
past it the connection is closed, with a ``408`` when nothing was answered yet. A run's
event stream is unaffected: its request (a GET) has arrived whole long before.

A request too malformed to reach the application (a ``content-length`` that is not a
number, a broken header line) is answered ``400`` with the JSON error body every other
error has, not Uvicorn's plain-text one: clients parse one shape.
"""

from __future__ import annotations

import asyncio
import json
from typing import ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["DeadlineH11Protocol"]

_BODY = b'{"error":"the request did not arrive in time; send it whole","status":408}'
_TIMED_OUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)


class DeadlineH11Protocol(H11Protocol):
    """Pass as ``uvicorn.Config(http=DeadlineH11Protocol)``; subclass to change the time."""

    request_seconds: ClassVar[float] = 30.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of the next request on this connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
            self._disarm()  # the request arrived whole (or the connection is ending)

    def send_400_response(self, msg: str) -> None:
        body = json.dumps({"error": msg, "status": 400}, separators=(",", ":")).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event) or b"")
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.request_seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        self.logger.info(
            "closed the connection of %s: its request took over %g s to arrive",
            client, self.request_seconds,
        )
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the route reading the body sees the client gone
            cycle.message_event.set()
        if self.conn.our_state is h11.IDLE and (cycle is None or not cycle.response_started):
            self.transport.write(_TIMED_OUT)
        self.transport.close()
