"""One client connection of the loopback server: HTTP/1.1 parsed by h11, bytes written by us.

h11 (the sans-IO parser httpx's own stack uses) reads requests: request line, headers,
``Content-Length`` and chunked bodies, ``Expect: 100-continue``, pipelining, keep-alive.
It also frames what we send, one ``send_*`` call per write, so the fault injection keeps
its byte-level control: a delay before any chunk, a body cut short (:meth:`close`
without the end), a reset before the first byte (:meth:`reset`). While a reply is
produced, :meth:`watch` reads on, so a client that closes is noticed at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import h11

from aimu.testing.server.records import Headers

__all__ = ["BadRequest", "Connection", "Request"]

_MAX_HEAD = 64 * 1024
_MAX_BODY = 256 * 1024 * 1024
_READ_SIZE = 64 * 1024
_CLOSE_GRACE = 1.0
_SERVER = ("Server", "aimu-loopback")
_CONTINUE = h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")


class BadRequest(Exception):
    """The bytes on the wire are not an HTTP/1.1 request we can serve."""


@dataclass
class Request:
    """A request read whole: its head and its body."""

    method: str
    target: str
    headers: Headers
    body: bytes

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


class Connection:
    """One client connection: reading requests, writing replies, noticing the peer close."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        number: int,
    ) -> None:
        self.number = number
        self.reader = reader
        self.writer = writer
        self.peer_closed = asyncio.Event()
        self.peer_closed_at: float | None = None
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        self._unread = bytearray()  # read while watching: a pipelined next request
        self._eof = False
        self._chunked = False  # the streamed reply's body is sent in chunks
        self._head_only = False  # answering HEAD: the head goes out, the body does not
        self._spawn = spawn
        self._watcher: asyncio.Task[None] | None = None

    def _mark_peer_closed(self) -> None:
        if not self.peer_closed.is_set():
            self.peer_closed_at = time.monotonic()
            self.peer_closed.set()

    # -- reading ---------------------------------------------------------------------

    async def _feed(self) -> None:
        """Hand h11 more bytes: those read while watching, else the socket's next."""
        if self._unread:
            data, self._unread = bytes(self._unread), bytearray()
        elif self._eof:
            data = b""
        else:
            data = await self.reader.read(_READ_SIZE)
            self._eof = not data
        self._h11.receive_data(data)

    def _event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        try:
            return self._h11.next_event()
        except h11.RemoteProtocolError as error:
            if self._eof:
                raise ConnectionResetError("the client closed in the middle of a request") from None
            raise BadRequest(str(error)) from None

    async def read_request(self) -> Request | None:
        """The next request, or None when the client closed between requests."""
        head: h11.Request | None = None
        body = bytearray()
        while True:
            event = self._event()
            if event is h11.NEED_DATA:
                await self._feed()
            elif isinstance(event, h11.Request):
                head = event
                self._head_only = event.method == b"HEAD"
                if self._h11.they_are_waiting_for_100_continue:
                    await self._write(self._h11.send(_CONTINUE) or b"")
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > _MAX_BODY:
                    raise BadRequest(f"the body is over {_MAX_BODY} bytes")
            elif isinstance(event, h11.EndOfMessage) and head is not None:
                headers = Headers(
                    (name.decode("latin-1"), value.decode("latin-1"))
                    for name, value in head.headers
                )
                method, target = head.method.decode("ascii"), head.target.decode("latin-1")
                return Request(method, target, headers, bytes(body))
            elif isinstance(event, h11.ConnectionClosed):
                return None
            else:  # PAUSED never comes: a request is read only once the last reply ended
                raise BadRequest(f"unexpected {type(event).__name__} from the parser")

    def next_request_allowed(self) -> bool:
        """Whether the reply just sent leaves the connection open for another request."""
        if self.peer_closed.is_set():
            return False
        if self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
            self._h11.start_next_cycle()
            return True
        return False

    # -- watching for the peer to close --------------------------------------------------

    def watch(self) -> None:
        """Start noticing the peer close while a reply is produced."""
        self._watcher = self._spawn(self._watch())

    async def _watch(self) -> None:
        # Bytes that arrive here are a pipelined next request: keep them for h11.
        try:
            while data := await self.reader.read(_READ_SIZE):
                self._unread += data
        except (ConnectionError, OSError):
            pass
        self._eof = True
        self._mark_peer_closed()

    async def unwatch(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None and not watcher.done():
            watcher.cancel()
            # asyncio.wait never raises the watcher's CancelledError, only our own.
            await asyncio.wait([watcher])

    async def wait(self, seconds: float | None) -> bool:
        """Wait ``seconds`` (None: forever); True as soon as the peer has closed."""
        if self.peer_closed.is_set():
            return True
        if seconds is not None and seconds <= 0:
            return False
        try:
            async with asyncio.timeout(seconds):
                await self.peer_closed.wait()
        except TimeoutError:
            return False
        return True

    # -- writing ----------------------------------------------------------------------

    async def _write(self, data: bytes) -> bool:
        """Write ``data``; False when the peer is gone (the write failed or it closed)."""
        if self.peer_closed.is_set() or self.writer.is_closing():
            self._mark_peer_closed()
            return False
        try:
            self.writer.write(data)
            await self.writer.drain()
        except (ConnectionError, OSError):
            self._mark_peer_closed()
            return False
        return True

    def _head(self, status: int, headers: Sequence[tuple[str, str]], close: bool) -> bytes:
        fields = [_SERVER, *headers]
        if close:
            fields.append(("Connection", "close"))
        response = h11.Response(status_code=status, headers=fields, reason=_reason(status))
        return self._h11.send(response) or b""

    async def send_response(
        self,
        status: int,
        body: bytes,
        content_type: str,
        extra: Sequence[tuple[str, str]] = (),
        *,
        close: bool = False,
    ) -> bool:
        """A whole reply in one write; False when the peer is gone."""
        headers = [("Content-Type", content_type), ("Content-Length", str(len(body))), *extra]
        data = self._head(status, headers, close)
        if not self._head_only:
            data += self._h11.send(h11.Data(data=body)) or b""
        data += self._h11.send(h11.EndOfMessage()) or b""
        return await self._write(data)

    async def start_stream(self, content_type: str) -> bool:
        """The head of a streamed 200 reply (chunked); False when the peer is gone."""
        headers = [("Content-Type", content_type), ("Cache-Control", "no-cache")]
        head = self._head(200, headers, close=False)
        # h11 chose the framing (chunked, or to the close for an HTTP/1.0 client).
        self._chunked = b"\r\ntransfer-encoding: chunked\r\n" in head.lower()
        return await self._write(head)

    def _body(self, piece: bytes) -> bytes:
        if self._chunked:
            # Framed here exactly as h11 frames it: a Data event through h11's state
            # machine costs ~8 µs, ~30 times this, on every chunk of every streamed
            # reply. h11 keeps no count for a chunked body; it still sends the end.
            return b"%x\r\n%s\r\n" % (len(piece), piece) if piece else b""
        return self._h11.send(h11.Data(data=piece)) or b""

    async def send_chunks(self, pieces: Sequence[bytes], *, end: bool = False) -> bool:
        """``pieces`` as body chunks in one write, then the end of the body if ``end``."""
        data = b"".join(map(self._body, pieces))
        if end:
            data += self._h11.send(h11.EndOfMessage()) or b""
        return await self._write(data)

    def reset(self) -> None:
        """Close at once (RST), whatever was sent."""
        self.writer.transport.abort()

    async def close(self, *, abort: bool) -> None:
        if abort:
            self.writer.transport.abort()
        else:
            self.writer.close()
        try:
            async with asyncio.timeout(_CLOSE_GRACE):
                await self.writer.wait_closed()
        except TimeoutError:
            self.writer.transport.abort()
        except (ConnectionError, OSError):
            pass
