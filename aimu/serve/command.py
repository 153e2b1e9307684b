"""The ``aimu serve`` command: options, the safety checks, and Uvicorn.

Binds 127.0.0.1 unless told otherwise, and refuses to bind any other address without a
bearer token in ``AIMU_API_TOKEN`` (a token on the command line would show in ``ps``).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

from aimu._agent_options import (
    add_agent_options,
    add_drain_options,
    agent_tools,
    import_tool,
)
from aimu._bounded_exit import owning_the_exit
from aimu._extras import MissingExtra, needs_extra
from aimu._limit_options import (
    add_session_limit_options,
    limits_from,
    session_limits_from,
)
from aimu._logs import logging_to
from aimu._mcp_options import mcp_servers, open_all
from aimu.aio.errors import AimuError
from aimu.aio.providers.test import WHAT_IT_DOES
from aimu.aio.tools import Toolset, as_tool
from aimu.assistant import default_home
from aimu.serve.fleet import MAX_WORKERS, run_fleet

if TYPE_CHECKING:
    from aimu.aio.control import RedisControl
    from aimu.serve.application import ServeApp

__all__ = [
    "ENVIRONMENT",
    "add_agent_options",
    "add_serve_options",
    "agent_tools",
    "import_tool",
    "is_loopback",
    "run_serve",
]

#: The environment variables ``aimu serve`` reads, as its ``--help`` lists them.
ENVIRONMENT: Final = """\
environment variables:
  AIMU_API_TOKEN   the bearer token every API call must carry (none: loopback only)
  AIMU_MODEL       the model when --model is not given
  AIMU_HOME        the directory of the default store (default ~/.aimu)
  OPENAI_BASE_URL  the server of openai: and openai-responses: models, and
                   OPENAI_API_KEY its key
  OLLAMA_HOST      the server of ollama: models (default http://127.0.0.1:11434)
  ANTHROPIC_BASE_URL  the server of anthropic: models, and ANTHROPIC_API_KEY its key
  GEMINI_BASE_URL  the server of gemini: models (default Google's), and GEMINI_API_KEY
                   (or GOOGLE_API_KEY) its key
  AZURE_OPENAI_BASE_URL  the resource of azure: and azure-responses: models
                   (https://RESOURCE.openai.azure.com/openai/v1), and
                   AZURE_OPENAI_API_KEY its key
  GOOGLE_CLOUD_PROJECT, GOOGLE_CLOUD_LOCATION  where vertex: models run; their token
                   from the application default credentials (GOOGLE_APPLICATION_CREDENTIALS)
  AWS_REGION       the region of bedrock: models; their credentials from AWS's chain
                   (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, a role...)
"""


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``aimu serve`` to ``parser``, and the environment it reads to
    its help."""
    parser.epilog = ENVIRONMENT
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_agent_options(parser, "the server's and aimu's log records")
    add_session_limit_options(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    parser.add_argument(
        "--temporal",
        default=None,
        metavar="HOST:PORT",
        help="hand every run to `aimu worker` processes through this Temporal server "
        "(needs the temporal extra and --task-queue)",
    )
    parser.add_argument(
        "--task-queue",
        default=None,
        metavar="QUEUE",
        help="the Temporal task queue the workers take runs from (with --temporal)",
    )
    add_drain_options(parser, "serve")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="serve from N processes sharing the port, one a core (with --redis or "
        "--temporal: any of them answers for any run; default 1)",
    )
    parser.add_argument(
        "--http", choices=("auto", "h11", "httptools"), default="auto",
        help="the HTTP/1.1 parser (default auto: httptools when installed, else h11)",
    )
    parser.add_argument(
        "--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
        help="the event loop (default auto: uvloop when installed, else asyncio's own)",
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="allow browser calls from this origin (repeatable; none by default)",
    )


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False



def run_serve(options: argparse.Namespace) -> int:
    """Run the server until SIGINT or SIGTERM; return the exit status.

    Everything that can be checked before serving is: a store, Redis or port that cannot
    be used ends the command with one line on stderr (no traceback, no password) and a
    non-zero status. Once serving, it says what it serves, and aimu's log records go to
    stderr at ``--log-level`` beside the server's own.
    """
    with logging_to(sys.stderr, options.log_level):
        try:
            return _serve(options)
        except _Refused as refused:
            print(f"aimu serve: {refused}", file=sys.stderr)
            return refused.status


class _Refused(Exception):
    """The server cannot start; the message is the one line the command prints."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def _serve(options: argparse.Namespace) -> int:
    token = os.environ.get("AIMU_API_TOKEN") or None
    _check(options, token)
    try:  # the options are checked first: a usage error is one, extra or not
        with needs_extra("aimu serve", "serve"):
            from aimu.serve._uvicorn import engine, serve_until_stopped
        # Resolved once: the processes of --workers N run on the same.
        chosen = engine(getattr(options, "http", "auto"), getattr(options, "loop", "auto"))
    except MissingExtra as missing:
        raise _Refused(str(missing).removeprefix("aimu serve "), 2) from None
    options.http, options.loop = chosen.http, chosen.loop
    try:
        tools: list[Callable[..., Any] | Toolset] = [*agent_tools(options)]
        tools += mcp_servers(options.mcp, options.mcp_url)
    except ValueError as error:
        raise _Refused(str(error), 2) from None
    store = options.store or str(default_home() / "sessions.db")
    if getattr(options, "workers", 1) > 1:
        return run_fleet(options, _listen)

    async def serve() -> int:
        application, control = await _built(options, tools, store, token)
        sock = await _reached(application, control, tools, options)
        banner = _banner(options, store, control, tools, token, sock, str(chosen))
        try:
            return await serve_until_stopped(
                application, sock, log_level=options.log_level, drain=options.drain,
                banner=banner, http=chosen.protocol,
            )
        except SystemExit as exit_:  # uvicorn's way to say the lifespan failed to start
            raise _Refused("the application failed to start; see the log above") from exit_

    try:
        with asyncio.Runner(loop_factory=chosen.new_loop) as runner:
            # A sync tool's thread still running once the server is done holds no exit.
            return runner.run(owning_the_exit(serve(), "aimu serve"))
    except KeyboardInterrupt:  # Ctrl+C before Uvicorn was listening for it
        return 130


def _check(options: argparse.Namespace, token: str | None) -> None:
    """Refuse (status 2) options that cannot go together, before anything is opened."""
    if not is_loopback(options.host) and token is None:
        raise _Refused(
            f"refusing to bind {options.host}: other machines could reach it and "
            "nothing guards it. Set AIMU_API_TOKEN to a secret (clients send "
            "'Authorization: Bearer <token>'), or bind 127.0.0.1.",
            2,
        )
    if not 0 <= options.port <= 65535:
        raise _Refused(f"--port {options.port} is not a TCP port", 2)
    if options.recover_every is not None and not options.recover:
        raise _Refused("--recover-every goes with --recover", 2)
    if options.max_crashes is not None and not (options.recover and options.max_crashes >= 1):
        raise _Refused("--max-crashes takes a count, 1 or more, with --recover", 2)
    if options.recover and options.temporal is not None:
        raise _Refused("--recover is for runs executed by aimu serve: with --temporal, "
                       "Temporal retries a dead worker's runs on another worker itself", 2)
    if options.temporal is not None and (
        limits_from(options) is not None or session_limits_from(options) is not None
    ):
        raise _Refused("--max-* and --session-max-* bound the runs aimu serve executes: with "
                       "--temporal the workers run them (aimu worker --max-requests ...)", 2)
    if (options.temporal is None) != (options.task_queue is None):
        raise _Refused("give --temporal HOST:PORT and --task-queue QUEUE together", 2)
    workers = getattr(options, "workers", 1)
    if not 1 <= workers <= MAX_WORKERS:
        raise _Refused(f"--workers takes a count from 1 to {MAX_WORKERS}; got {workers}", 2)
    if workers > 1 and options.redis is None and options.temporal is None:
        raise _Refused("--workers N needs --redis (or --temporal): each process holds its "
                       "own runs, and Redis is how any of them answers for the others'", 2)


async def _built(
    options: argparse.Namespace,
    tools: list[Callable[..., Any] | Toolset],
    store: str,
    token: str | None,
) -> tuple[ServeApp, RedisControl | None]:
    """The application of ``options`` and its Redis control; _Refused naming what is wrong."""
    from aimu.serve.application import app  # the serve extra is there
    from aimu.serve.recovery import MAX_CRASHES, RECOVER_EVERY

    control: RedisControl | None = None
    if options.redis is not None:
        try:
            from aimu.aio.control import RedisControl
        except ImportError as missing:
            raise _Refused(str(missing), 2) from None
        try:
            control = RedisControl(options.redis, options.redis_prefix)
        except ValueError as error:
            raise _Refused(f"--redis: {error}", 2) from None
    try:
        return app(
            options.model,
            store=store,
            tools=tools,
            system=options.system,
            limits=limits_from(options),
            session_limits=session_limits_from(options),
            token=token,
            cors_origins=options.cors_origin,
            allowed_hosts=options.allowed_host or None,
            redis=control,
            temporal=options.temporal,
            task_queue=options.task_queue,
            recover=(options.recover_every or RECOVER_EVERY) if options.recover else None,
            max_crashes=options.max_crashes or MAX_CRASHES,
        ), control
    except ImportError as missing:  # the store's extra (asyncpg for postgresql://)
        if control is not None:
            await control.aclose()
        raise _Refused(str(missing), 2) from None
    except (OSError, ValueError, AimuError) as error:
        if control is not None:
            await control.aclose()
        raise _Refused(_store_or_model(error, store)) from None


async def _reached(
    application: ServeApp,
    control: RedisControl | None,
    tools: list[Callable[..., Any] | Toolset],
    options: argparse.Namespace,
) -> socket.socket:
    """Reach the store, Redis, Temporal and the MCP servers now, and bind the port: a
    server that cannot would answer 500 to every request (or fail in its lifespan with
    a traceback). The listening socket; _Refused (the application closed) if not."""
    try:
        await application.runs.store.sessions()
        if control is not None:
            await control.connect()
        connect = getattr(application.runs.backend, "connect", None)  # --temporal
        if connect is not None:
            await connect()
        await open_all([t for t in tools if isinstance(t, Toolset)])  # --mcp, --mcp-url
        return _listen(options.host, options.port, reuse_port=_member(options) is not None)
    except (AimuError, OSError) as error:
        await application.aclose()
        raise _Refused(str(error)) from None


def _banner(
    options: argparse.Namespace,
    store: str,
    control: RedisControl | None,
    tools: list[Callable[..., Any] | Toolset],
    token: str | None,
    sock: socket.socket,
    engine: str,
) -> str:
    """What the server serves, printed once it listens (of ``--workers N``, by the
    first process only)."""
    url = f"http://{_url_host(options.host)}:{sock.getsockname()[1]}/"
    what = _serving(options, store, control, tools, token, url, engine)
    if _member(options) is not None:  # one of --workers N: the first says what is served
        fleet = f"  workers {options.fleet_size} processes on this port\n"
        what = fleet + what if _member(options) == 1 else ""
    return what


def _member(options: argparse.Namespace) -> int | None:
    """Which of ``--workers N`` this process is (1..N), None when it serves alone."""
    member = getattr(options, "fleet_member", None)
    return member if isinstance(member, int) else None


def _listen(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A socket bound to ``host:port`` (Uvicorn listens on it); OSError naming both.
    ``reuse_port``: shared with the other processes of ``--workers N``."""
    bare = host.strip("[]")
    try:
        family = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as error:
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((bare, port))
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def _url_host(host: str) -> str:
    bare = host.strip("[]")
    return f"[{bare}]" if ":" in bare else bare


def _shown_store(store: str) -> str:
    """The store for a person to read: a database URL without its password."""
    if not store.startswith(("postgres://", "postgresql://")):
        return str(Path(store).resolve())
    try:
        parts = urlsplit(store)
        netloc = parts.netloc.rpartition("@")[2]
        user = f"{parts.username}@" if parts.username else ""
        return f"{parts.scheme}://{user}{netloc}{parts.path}"  # no password, no query
    except ValueError:
        return "postgresql://<unparsable URL>"


def _store_or_model(error: BaseException, store: str) -> str:
    if isinstance(error, OSError):  # creating the SQLite file's directory
        why = error.strerror or str(error)
        if isinstance(error, FileExistsError | NotADirectoryError):
            why = f"{error.filename} is a file, not a directory"
        return f"cannot create the store {_shown_store(store)}: {why}"
    return str(error)


def _serving(
    options: argparse.Namespace,
    store: str,
    control: RedisControl | None,
    tools: list[Callable[..., Any] | Toolset],
    token: str | None,
    url: str,
    engine: str,
) -> str:
    """What the server serves, for the person who started it (never a secret)."""
    names = [
        f"{tool.name} (MCP server)" if isinstance(tool, Toolset) else as_tool(tool).name
        for tool in tools
    ]
    model = options.model
    if model in ("test", "test:test"):
        model = f"test (embedded and offline: {WHAT_IT_DOES})"
    rows = [
        ("model", model),
        ("store", _shown_store(store)),
        ("redis", control.url if control is not None else "none"),
        ("tools", ", ".join(names) if names else "none"),
        ("token", "required (AIMU_API_TOKEN)" if token else "none (loopback only)"),
        ("server", f"uvicorn, {engine}"),
    ]
    if options.temporal is not None:
        runs = f"aimu worker processes, Temporal at {options.temporal} ({options.task_queue})"
    else:
        runs = "in this process" + (", reachable from every server on Redis" if control else "")
    rows.insert(3, ("runs", runs))
    lines = [*(f"  {key:<6} {value}" for key, value in rows)]
    lines.append(f"aimu serve: serving {url} (the web chat; Ctrl+C stops)")
    return "\n".join(lines)
