"""The network backend of a pool: httpcore's connections on asyncio's own transports.

httpcore's default backend reads through anyio: every read of a streamed reply opens a
cancel scope for its timeout, re-registers the socket with the selector (reading is
resumed for the read and paused after it) and, when data is already buffered, takes an
extra pass of the loop. A reply streamed token by token makes a read per chunk, so that
was a third of a run's cost per chunk (a profile of 100 runs streaming). Here a
connection is an :class:`asyncio.Protocol` that keeps reading into a buffer (paused only
past :data:`HIGH_WATER`): a read takes what is buffered, or waits on one future with a
timer for its timeout.

Connections are opened with a slot of the pool's
:data:`~aimu.aio.providers._pool.MAX_CONNECTING`, and a stream's socket is shut the
moment a read or write of it is cancelled (a Stop, a cancelled run), or when
:meth:`_Stream.shut` is called (a reply abandoned between two reads): the server sees
the FIN at once. httpcore closes such a connection too (one whose reply was not read to
its end is never reused), but only after its lock, a checkpoint and the transport's
deferred close: two or three passes of the loop later.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final, Protocol, cast

import httpcore

__all__: list[str] = []

#: Bytes buffered unread past which a connection stops reading (resumed below LOW_WATER).
HIGH_WATER: Final = 256 * 1024
LOW_WATER: Final = 64 * 1024

_SocketOption = (
    tuple[int, int, int] | tuple[int, int, bytes | bytearray] | tuple[int, int, None, int]
)


class _Connecting(Protocol):
    """What the backend needs of its pool: the slots to open a connection (its loop's)."""

    connecting: asyncio.Semaphore


class _Native(httpcore.AsyncNetworkBackend):
    """httpcore's network backend on asyncio transports (see the module)."""

    def __init__(self, pool: _Connecting) -> None:
        self.pool = pool

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Iterable[_SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        local = None if local_address is None else (local_address, 0)
        loop = asyncio.get_running_loop()
        async with self.pool.connecting:
            return await _connected(
                lambda: loop.create_connection(_Reader, host, port, local_addr=local),
                timeout, socket_options,
            )

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        socket_options: Iterable[_SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        return await _connected(
            lambda: loop.create_unix_connection(_Reader, path), timeout, socket_options
        )

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


async def _connected(
    connect: Callable[[], Awaitable[tuple[asyncio.BaseTransport, _Reader]]],
    timeout: float | None,  # noqa: ASYNC109 - httpcore's
    socket_options: Iterable[_SocketOption] | None,
) -> _Stream:
    """The stream ``connect`` opens, within ``timeout``: httpcore's errors if it cannot."""
    try:
        async with asyncio.timeout(timeout):
            transport, reader = await connect()
    except TimeoutError as error:
        raise httpcore.ConnectTimeout(str(error) or "timed out connecting") from error
    except OSError as error:
        raise httpcore.ConnectError(str(error)) from error
    stream = _Stream(transport, reader)
    if socket_options and stream.sock is not None:
        for option in socket_options:
            stream.sock.setsockopt(*option)
    return stream


def _expire(waiter: asyncio.Future[None], error: type[Exception]) -> None:
    if not waiter.done():
        waiter.set_exception(error("timed out"))


class _Reader(asyncio.Protocol):
    """A connection's receiving side: what arrived and not yet read, its end, and the
    one task waiting to read (httpcore reads a connection from one task at a time)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.size = 0
        self.ended = False  # the peer sent its FIN, or the connection is lost
        self.error: Exception | None = None
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.blocked: asyncio.Future[None] | None = None  # writing waits for the buffer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not isinstance-checked: uvloop's transports are not asyncio.Transport's kind.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)
        if self.size > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> None:
        self.ended = True
        self._wake()  # None: the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.error = exc
        self._wake()
        blocked, self.blocked = self.blocked, None
        if blocked is not None and not blocked.done():
            blocked.set_result(None)

    def pause_writing(self) -> None:
        if self.blocked is None:
            self.blocked = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        blocked, self.blocked = self.blocked, None
        if blocked is not None and not blocked.done():
            blocked.set_result(None)

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` of what arrived (b"" once the peer has ended)."""
        chunks = self.chunks
        if not chunks:
            if self.error is not None:
                raise httpcore.ReadError(str(self.error) or type(self.error).__name__)
            return b""
        data = chunks.popleft()
        if len(data) > max_bytes:
            data, rest = data[:max_bytes], data[max_bytes:]
            chunks.appendleft(rest)
        self.size -= len(data)
        if self.paused and self.size < LOW_WATER and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    async def arrival(self, timeout: float | None) -> None:  # noqa: ASYNC109 - httpcore's
        """Wait until something arrives or the connection ends: ReadTimeout past
        ``timeout``."""
        waiter = self.waiter = asyncio.get_running_loop().create_future()
        timer = (None if timeout is None else
                 asyncio.get_running_loop().call_later(
                     timeout, _expire, waiter, httpcore.ReadTimeout))
        try:
            await waiter
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    async def drained(self, timeout: float | None) -> None:  # noqa: ASYNC109 - httpcore's
        """Wait while the transport's write buffer is full: WriteTimeout past ``timeout``."""
        blocked = self.blocked
        if blocked is None:
            return
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(blocked)
        except TimeoutError as error:
            raise httpcore.WriteTimeout("timed out") from error


class _Stream(httpcore.AsyncNetworkStream):
    """One connection, as httpcore reads and writes it (see the module)."""

    __slots__ = ("reader", "sock", "transport")

    def __init__(self, transport: asyncio.BaseTransport, reader: _Reader) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's too (see _Reader)
        self.transport = transport
        self.reader = reader
        reader.transport = transport
        self.sock: Any = transport.get_extra_info("socket")

    async def read(
        self, max_bytes: int, timeout: float | None = None  # noqa: ASYNC109 - httpcore's
    ) -> bytes:
        reader = self.reader
        if not reader.chunks and not reader.ended:
            try:
                await reader.arrival(timeout)
            except asyncio.CancelledError:
                self.shut()
                raise
        return reader.take(max_bytes)

    async def write(
        self, buffer: bytes, timeout: float | None = None  # noqa: ASYNC109 - httpcore's
    ) -> None:
        if not buffer:
            return
        reader = self.reader
        if (reader.ended and reader.error is not None) or self.transport.is_closing():
            raise httpcore.WriteError("the connection is closed")
        self.transport.write(buffer)
        if reader.blocked is not None:
            try:
                await reader.drained(timeout)
            except asyncio.CancelledError:
                self.shut()
                raise

    async def aclose(self) -> None:
        transport = self.transport
        if not transport.is_closing() and transport.can_write_eof():
            # The FIN now: the transport's own close comes a pass of the loop later.
            with contextlib.suppress(OSError):  # the peer has gone already
                transport.write_eof()
        transport.close()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                transport = await loop.start_tls(
                    self.transport, self.reader, ssl_context, server_hostname=server_hostname
                )
        except TimeoutError as error:
            self.transport.close()
            raise httpcore.ConnectTimeout(str(error) or "timed out in the TLS handshake") \
                from error
        except (OSError, ssl.SSLError) as error:
            self.transport.close()
            raise httpcore.ConnectError(str(error)) from error
        except BaseException:
            self.transport.close()
            raise
        assert transport is not None
        return _Stream(transport, self.reader)

    def get_extra_info(self, info: str) -> Any:
        if info == "socket":
            return self.sock
        if info == "ssl_object":
            return self.transport.get_extra_info("ssl_object")
        if info == "client_addr":
            return self.transport.get_extra_info("sockname")
        if info == "server_addr":
            return self.transport.get_extra_info("peername")
        if info == "is_readable":  # an idle connection the server closed, or wrote to
            return bool(self.reader.chunks) or self.reader.ended
        return None

    def shut(self) -> None:
        """Shut the socket both ways (the close that follows is httpcore's)."""
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
                return
            except OSError:  # closed already, or the peer's reset came first
                return
            except TypeError:  # uvloop's transport sockets have no shutdown()
                pass
        self.transport.abort()  # closed at once instead (httpcore's close then does nothing)
