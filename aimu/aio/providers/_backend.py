"""The network backend of a pool: connections opened with a slot of the pool's
:data:`~aimu.aio.providers._pool.MAX_CONNECTING`, and streams whose socket is shut the
moment a reply is abandoned."""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any, Protocol

import httpcore

__all__: list[str] = []


class _Connecting(Protocol):
    """What the backend needs of its pool: the slots to open a connection (its loop's)."""

    connecting: asyncio.Semaphore


class _Paced(httpcore.AsyncNetworkBackend):
    """A network backend that opens a TCP connection only with a slot of its pool's
    :data:`MAX_CONNECTING` (the pool's semaphore for its running loop)."""

    def __init__(self, inner: httpcore.AsyncNetworkBackend, pool: _Connecting) -> None:
        self.inner = inner
        self.pool = pool

    async def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        async with self.pool.connecting:
            return _Stream(await self.inner.connect_tcp(*args, **kwargs))

    async def connect_unix_socket(self, *args: Any, **kwargs: Any
                                  ) -> httpcore.AsyncNetworkStream:
        return _Stream(await self.inner.connect_unix_socket(*args, **kwargs))

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class _Stream(httpcore.AsyncNetworkStream):
    """A connection's stream whose socket is shut the moment a read or write of it is
    cancelled (a Stop, a cancelled run), or when :meth:`shut` is called (a reply
    abandoned between two reads): the server sees the FIN at once.

    httpcore closes such a connection too (one whose reply was not read to its end is
    never reused), but only after its lock, a checkpoint and the transport's deferred
    close: two or three passes of the loop, 160-190 Python calls, later (a profile of
    the cancel). What a stop keeps is the reader's business and does not change."""

    __slots__ = ("inner", "sock")

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self.inner = inner
        self.sock = inner.get_extra_info("socket")  # looked up now: it costs 30 calls

    async def read(
        self, max_bytes: int, timeout: float | None = None  # noqa: ASYNC109 - httpcore's
    ) -> bytes:
        try:
            return await self.inner.read(max_bytes, timeout)
        except asyncio.CancelledError:
            self.shut()
            raise

    async def write(
        self, buffer: bytes, timeout: float | None = None  # noqa: ASYNC109 - httpcore's
    ) -> None:
        try:
            await self.inner.write(buffer, timeout)
        except asyncio.CancelledError:
            self.shut()
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
    ) -> httpcore.AsyncNetworkStream:
        return _Stream(await self.inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)

    def shut(self) -> None:
        """Shut the socket both ways (the close that follows is httpcore's)."""
        if self.sock is not None:
            try:  # noqa: SIM105 - not contextlib.suppress: 3 calls fewer before the FIN
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed already, or the peer's reset came first
                pass
