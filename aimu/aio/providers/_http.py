"""What the HTTP providers share: turning transport failures into aimu errors.

Every message names the service and its URL (credentials removed) and says what to
check; none carries a header, so an API key can never end up in one.
"""

from __future__ import annotations

import asyncio
import copy
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any, Generic, Protocol, Self, TypeVar
from urllib.parse import urlsplit, urlunsplit

import httpx

from aimu.aio.client import ModelClient
from aimu.aio.errors import ModelConnectionError, ModelError

__all__ = ["PooledClient", "call_id", "display_url", "drain", "transport_error"]

_DRAIN_LIMIT = 1.0


class _Pool(Protocol):
    async def aclose(self) -> None: ...


PoolT = TypeVar("PoolT", bound=_Pool)


class PooledClient(ModelClient, Generic[PoolT]):
    """A model client over a connection pool that its forks share.

    A fork copies the settings (``options`` deeply enough to change on its own) and
    starts with an empty transcript; only the client first made closes the pool.
    """

    options: dict[str, Any]
    _pool: PoolT
    _owner: bool = True

    def fork(self) -> Self:
        twin = copy.copy(self)
        ModelClient.__init__(twin, self.model)  # a transcript of its own
        twin.options = dict(self.options)
        twin._owner = False
        return twin

    async def aclose(self) -> None:
        """Close the connection pool; a fork leaves it to the client it came from."""
        if self._owner:
            await self._pool.aclose()


def call_id() -> str:
    """A fresh tool-call id for a call the server sent without one."""
    return f"call_{uuid.uuid4().hex[:16]}"


def display_url(url: str) -> str:
    """``url`` without user info or query, fit to name in an error or a repr."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def _reason(error: BaseException) -> str:
    """The most telling words for ``error``: the OS's reason if one is in its chain."""
    cause: BaseException | None = error
    seen = 0
    while cause is not None and seen < 16:
        # anyio reports "All connection attempts failed"; the OS error under it says why.
        if isinstance(cause, OSError) and isinstance(cause.errno, int) and cause.errno > 0:
            return os.strerror(cause.errno)  # asyncio's own strerror hides the reason
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror  # resolver errors: "Name or service not known"
        cause = cause.__cause__ or cause.__context__
        seen += 1
    text = str(error).strip()
    return text or type(error).__name__


def transport_error(
    error: httpx.TransportError | OSError,
    *,
    service: str,
    host: str,
    hint: str,
    timeout: httpx.Timeout,
) -> ModelError:
    """The aimu error for a request to ``service`` at ``host`` that failed in transport."""
    if isinstance(error, httpx.ConnectTimeout):
        return ModelConnectionError(
            f"could not connect to {service} at {host} within {timeout.connect:g}s; {hint}",
            host=host,
        )
    if isinstance(error, httpx.ConnectError | httpx.UnsupportedProtocol | ConnectionError):
        return ModelConnectionError(
            f"cannot connect to {service} at {host} ({_reason(error)}); {hint}", host=host
        )
    if isinstance(error, httpx.ReadTimeout):
        return ModelConnectionError(
            f"{service} at {host} sent nothing for {timeout.read:g}s; the model may be "
            "stuck or overloaded (raise timeout= to wait longer)",
            host=host,
        )
    if isinstance(error, httpx.TimeoutException):
        return ModelConnectionError(
            f"the request to {service} at {host} timed out ({_reason(error)})", host=host
        )
    if isinstance(error, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        return ModelConnectionError(
            f"the connection to {service} at {host} was dropped mid-reply "
            f"({_reason(error)}); the server may have crashed or restarted",
            host=host,
        )
    return ModelConnectionError(
        f"the request to {service} at {host} failed ({_reason(error)}); {hint}", host=host
    )


async def drain(rest: AsyncIterator[object]) -> None:
    """Read what is left of a finished reply, so its connection can serve the next request.

    After the final marker only the end of the body should remain; a server that sends
    more, or fails, or dawdles beyond a second just costs us that connection.
    """
    try:
        async with asyncio.timeout(_DRAIN_LIMIT):
            async for _ in rest:
                pass
    except Exception:
        # The reply is complete: any failure now (the ollama client raises ResponseError or
        # AttributeError for a bad line) is the server's. CancelledError still propagates.
        pass
