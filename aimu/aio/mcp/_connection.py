"""One live connection to an MCP server, held by a task of its own.

The SDK's transports and session are async context managers that must be entered and
left in one task, while calls come from many (every run, every session of an agent).
So a :class:`Connection` enters them in a background task that holds them until
:meth:`Connection.aclose`; calls use the session from any task. Closing is shielded
from the closer's cancel: a stdio server is always stopped and reaped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import anyio
from mcp import Client, types
from mcp.client._transport import Transport
from mcp.client.session import ClientSession

__all__ = ["Connection"]


class Connection:
    """An MCP client session opened in its own task; :meth:`aclose` ends it."""

    __slots__ = ("_closing", "_holder", "_ready", "_scope", "client", "lost", "tools")

    def __init__(self) -> None:
        self.client: Client | None = None
        #: The server's tools, listed once at connect (every page).
        self.tools: list[types.Tool] = []
        #: True once the connection failed (a crash, a closed stream): reconnect.
        self.lost = False
        self._closing = asyncio.Event()
        self._ready: asyncio.Future[None] | None = None
        self._holder: asyncio.Task[None] | None = None
        #: Cancels the holder the anyio way, which the SDK's shielded shutdown respects
        #: (a native task.cancel() may cut it short and leave the server running).
        self._scope: anyio.CancelScope | None = None

    @property
    def session(self) -> ClientSession:
        assert self.client is not None
        return self.client.session

    async def open(self, transport: Callable[[], Transport], name: str) -> None:
        """Connect and list the tools; raises what failed (the caller names the server).

        Cancelled (or timed out), it stops what it started before the cancel goes on.
        """
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._holder = loop.create_task(self._hold(transport), name=f"MCP server {name!r}")
        try:
            await asyncio.shield(self._ready)
        except BaseException:
            await self.aclose(abort=True)
            raise

    async def _hold(self, transport: Callable[[], Transport]) -> None:
        ready = self._ready
        assert ready is not None
        try:
            with anyio.CancelScope() as self._scope:
                await self._session(transport, ready)
            if not ready.done():
                ready.cancel()  # aborted mid-handshake: open() is being cancelled
        except BaseException as error:
            self.lost = True
            if not ready.done():
                if isinstance(error, asyncio.CancelledError):
                    ready.cancel()
                else:
                    ready.set_exception(error)
            if not isinstance(error, Exception):
                raise
        finally:
            self.lost = True

    async def _session(
        self, transport: Callable[[], Transport], ready: asyncio.Future[None]
    ) -> None:
        async with Client(transport(), cache=None, message_handler=self._on_message) as client:
            tools: list[types.Tool] = []
            cursor: str | None = None
            while True:
                page = await client.session.list_tools(
                    params=types.PaginatedRequestParams(cursor=cursor)
                )
                tools.extend(page.tools)
                cursor = page.next_cursor
                if cursor is None:
                    break
            self.client, self.tools = client, tools
            ready.set_result(None)
            await self._closing.wait()

    async def _on_message(self, message: types.ServerNotification | Exception) -> None:
        """A message the transport could not read (not JSON, or nested deeper than the
        parser allows) while connecting: its answer will never come, so start-up fails
        with what went wrong now, instead of waiting out the timeout."""
        ready = self._ready
        if isinstance(message, Exception) and ready is not None and not ready.done():
            ready.set_exception(message)

    async def aclose(self, *, abort: bool = False) -> None:
        """End the connection and wait until it has (a stdio server stopped and reaped),
        even if this caller is cancelled meanwhile. ``abort``: it may be mid-handshake."""
        holder = self._holder
        if holder is None:
            return
        self._closing.set()
        if abort and not holder.done():
            # A handshake does not wait for _closing.
            if self._scope is not None:
                self._scope.cancel()
            else:
                holder.cancel()
        try:
            await asyncio.shield(holder)
        except asyncio.CancelledError:
            # This caller was cancelled: let the close finish, then go on cancelling.
            with contextlib.suppress(BaseException):
                await holder
            raise
        except Exception:
            pass  # a failure of the connection was reported where it happened

    def done(self) -> bool:
        return self._holder is not None and self._holder.done()


def first_error(error: BaseException) -> BaseException:
    """The innermost first error of an exception group (anyio task groups wrap them)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def describe(error: BaseException) -> str:
    error = first_error(error)
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__

