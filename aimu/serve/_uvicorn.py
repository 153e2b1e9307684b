"""Uvicorn as ``aimu serve`` runs it: a first SIGTERM drains, a second one stops; on
httptools and uvloop when they are installed (:func:`engine`).

Imported only once the serve extra is known to be installed (:mod:`aimu.serve.command`
checks it first).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal

import uvicorn

from aimu._bounded_exit import DRAIN_MARGIN, exit_deadline
from aimu._extras import missing_extra
from aimu.aio._signals import SignalHandlers
from aimu.serve.application import ServeApp
from aimu.serve.slow_clients import DeadlineH11Protocol, DeadlineHttpToolsProtocol

__all__ = ["Engine", "engine", "serve_until_stopped"]


@dataclass(frozen=True)
class Engine:
    """The HTTP/1.1 parser and the event loop a server runs on."""

    http: Literal["h11", "httptools"]
    loop: Literal["asyncio", "uvloop"]

    def __str__(self) -> str:
        return f"{self.http} on {self.loop}"

    @property
    def protocol(self) -> type[asyncio.Protocol]:
        """Uvicorn's protocol for ``http``, with a deadline for slow clients."""
        return DeadlineHttpToolsProtocol if self.http == "httptools" else DeadlineH11Protocol

    def new_loop(self) -> asyncio.AbstractEventLoop:
        """A new event loop of ``loop``'s kind (``asyncio.Runner(loop_factory=...)``)."""
        if self.loop == "uvloop":
            import uvloop

            return uvloop.new_event_loop()
        return asyncio.new_event_loop()


def engine(http: str = "auto", loop: str = "auto") -> Engine:
    """The engine of ``--http`` and ``--loop``. ``auto``: httptools and uvloop (in C: half
    the CPU of h11 and asyncio's own loop) when they import, else those two.

    MissingExtra naming the install command: one asked for by name does not import.
    """
    return Engine(
        "httptools" if _importable(http, "httptools", "--http") else "h11",
        "uvloop" if _importable(loop, "uvloop", "--loop") else "asyncio",
    )


def _importable(choice: str, fast: str, option: str) -> bool:
    """Whether ``choice`` (auto, ``fast`` or the pure-Python one) is ``fast``."""
    if choice not in ("auto", fast):
        return False
    try:
        importlib.import_module(fast)
    except ImportError as missing:
        if choice == "auto":
            return False
        raise missing_extra(f"{option} {fast}", "serve", missing) from None
    return True

#: Uvicorn's own start-up lines, which came before the banner and say less (one names
#: an address it does not listen on: the socket is ours): the banner replaces them.
_START_LINES: Final = (
    "Started server process",
    "Waiting for application startup",
    "Application startup complete",
    "Uvicorn running on",
)


def _not_a_start_line(record: logging.LogRecord) -> bool:
    return not (isinstance(record.msg, str) and record.msg.startswith(_START_LINES))


class _Server(uvicorn.Server):
    """Says what it serves once listening; a first SIGTERM drains ``application``'s
    runs within ``drain`` seconds (0: stop at once), a second signal or Ctrl+C stops."""

    draining: asyncio.Task[None] | None = None

    def __init__(
        self, config: uvicorn.Config, application: ServeApp, drain: float, banner: str
    ) -> None:
        super().__init__(config)
        self.application = application
        self.drain = drain
        self.banner = banner
        self.loop = asyncio.get_running_loop()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit and self.banner:
            print(self.banner, file=sys.stderr, flush=True)

    def handle_exit(self, sig: int, frame: Any) -> None:
        # A first SIGTERM drains: the server answers on (503 to new runs) while its
        # runs stop at a step boundary, then shuts down. Ctrl+C, a second signal, or
        # a drain of 0: shut down now (the lifespan cancels what runs).
        first = self.draining is None and not self.should_exit
        if first and sig == signal.SIGTERM and self.drain > 0:
            self.loop.call_soon_threadsafe(self._start_draining)
            return
        self.loop.call_soon_threadsafe(self._exit_now, sig, frame)

    def _start_draining(self) -> None:
        if self.draining is None and not self.should_exit:
            self.draining = asyncio.ensure_future(self._drained())

    async def _drained(self) -> None:
        print(f"aimu serve: draining: no new runs; the runs in progress stop within "
              f"{self.drain:g} s", file=sys.stderr, flush=True)
        # Whatever holds it then (a run that does not settle), the process exits.
        exit_deadline(self.drain + DRAIN_MARGIN, "aimu serve")
        with contextlib.suppress(asyncio.CancelledError):
            await self.application.drain(self.drain)
        self._exit_now(signal.SIGTERM, None)

    def _exit_now(self, sig: int, frame: Any) -> None:
        # Event streams would hold the shutdown open until their runs end: end them
        # now (clients reconnect with Last-Event-ID); the lifespan then stops the runs.
        self.application.runs.begin_shutdown()
        if self.draining is not None and not self.draining.done():
            self.draining.cancel()  # a second signal: the runs are cancelled at once
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Uvicorn raises the signal again once it has shut down (exit -15 on SIGTERM):
        # here a stop asked for and carried out is a clean exit (serve_until_stopped).
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only: its owner handles them
            return
        with SignalHandlers(self.handle_exit, (signal.SIGINT, signal.SIGTERM)):
            yield


async def serve_until_stopped(
    application: ServeApp, sock: socket.socket, *, log_level: str, drain: float, banner: str,
    http: type[asyncio.Protocol] = DeadlineH11Protocol,
) -> int:
    """Serve ``application`` on ``sock`` with ``http`` (Uvicorn's protocol: an
    :attr:`Engine.protocol`) until a signal stops it; the exit status.

    SystemExit: the application failed to start (Uvicorn's way to say so; the
    application is closed). ``sock`` is closed in every case.
    """
    config = uvicorn.Config(
        application,
        log_level=log_level,
        timeout_graceful_shutdown=10,
        http=http,
    )
    server = _Server(config, application, drain, banner)
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(_not_a_start_line)  # after Config, which sets up its logging
    try:
        await server.serve(sockets=[sock])
    except SystemExit:
        await application.aclose()
        raise
    finally:
        uvicorn_log.removeFilter(_not_a_start_line)
        sock.close()
    # A second Ctrl+C skips the lifespan's shutdown: the runs are stopped here then.
    await application.aclose()
    # SIGTERM or Ctrl+C: the runs were stopped and their transcripts kept, so the server
    # did what it was asked: 0 (a second Ctrl+C, which cut the wait for clients short: 130).
    return 130 if server.force_exit else 0
