"""Uvicorn's HTTP/1.1 connections with a deadline for each request to arrive (slowloris).

Uvicorn times out a connection idle *between* requests (``timeout_keep_alive``), but
not one that sends a request's head or body a byte at a time: a few hundred such clients
hold every connection open forever. :class:`DeadlineH11Protocol` (on h11) and
:class:`DeadlineHttpToolsProtocol` (on httptools) give each request ``request_seconds``
from its first byte (or from the connection's start) until its last; past it the
connection is closed, with a ``408`` when nothing of its answer was written yet. A run's
event stream is unaffected: its request (a GET) has arrived whole long before.

A request too malformed to reach the application (a ``content-length`` that is not a
number, a broken header line) is answered ``400`` with the JSON error body every other
error has, not Uvicorn's plain-text one: clients parse one shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, ClassVar, Protocol

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
else:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError as missing:  # httptools is optional: h11 serves without it
        _WHY = f"DeadlineHttpToolsProtocol needs httptools ({missing})"

        class HttpToolsProtocol:
            def __init__(self, *args, **kwargs):
                raise ImportError(_WHY, name="httptools")

__all__ = ["DeadlineH11Protocol", "DeadlineHttpToolsProtocol"]


def _closing_answer(status: bytes, error: str) -> bytes:
    """A whole response with the JSON error body, ``connection: close``."""
    body = json.dumps({"error": error, "status": int(status.split()[0])},
                      separators=(",", ":")).encode()
    return (b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (status, len(body), body))


_TIMED_OUT = _closing_answer(b"408 Request Timeout",
                             "the request did not arrive in time; send it whole")


class _Cycle(Protocol):
    """What the deadline touches of either protocol's ``RequestResponseCycle``."""

    response_started: bool
    response_complete: bool
    disconnected: bool
    message_event: asyncio.Event


class _RequestDeadline:
    """The deadline both protocols share; each says when a request starts and ends
    (:meth:`_arm`, :meth:`_disarm`) and whether its answer has begun."""

    request_seconds: ClassVar[float] = 30.0
    _deadline: asyncio.TimerHandle | None = None

    if TYPE_CHECKING:  # given by Uvicorn's protocol the class is mixed into
        loop: asyncio.AbstractEventLoop
        transport: asyncio.Transport
        logger: logging.Logger
        client: tuple[str, int] | None

        def _cycle_of_request(self) -> _Cycle | None: ...
        def _answer_begun(self) -> bool: ...

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_closing_answer(b"400 Bad Request", msg))
        self.transport.close()

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
        cycle = self._cycle_of_request()
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the route reading the body sees the client gone
            cycle.message_event.set()
        if not self._answer_begun():
            self.transport.write(_TIMED_OUT)
        self.transport.close()


class DeadlineH11Protocol(_RequestDeadline, H11Protocol):
    """Pass as ``uvicorn.Config(http=DeadlineH11Protocol)``; subclass to change the time."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of the next request on this connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
            self._disarm()  # the request arrived whole (or the connection is ending)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _cycle_of_request(self) -> _Cycle | None:
        return self.cycle

    def _answer_begun(self) -> bool:
        # SEND_RESPONSE: the request's head came, nothing was written; IDLE: not even
        # that (again IDLE once a kept-alive connection's previous answer is done).
        return self.conn.our_state is not h11.IDLE and self.conn.our_state is not h11.SEND_RESPONSE


class DeadlineHttpToolsProtocol(_RequestDeadline, HttpToolsProtocol):
    """Pass as ``uvicorn.Config(http=DeadlineHttpToolsProtocol)`` (needs httptools);
    subclass to change the time."""

    _cycle_now: _Cycle | None = None  # the cycle of the request arriving, once its head has

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self._between_requests():
            self._arm()  # the first bytes of the next request on this connection
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._cycle_now = None

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._cycle_now = self.cycle

    def on_message_complete(self) -> None:
        self._disarm()  # the request arrived whole
        super().on_message_complete()

    def handle_websocket_upgrade(self) -> None:
        self._disarm()  # the connection is the WebSocket protocol's from here
        super().handle_websocket_upgrade()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        # As h11's IDLE: the last request's answer is done. Bytes that come while it is
        # written are a pipelined request, which Uvicorn reads once it is.
        return self.cycle is None or self.cycle.response_complete

    def _cycle_of_request(self) -> _Cycle | None:
        return self._cycle_now

    def _answer_begun(self) -> bool:
        return self._cycle_now is not None and self._cycle_now.response_started
