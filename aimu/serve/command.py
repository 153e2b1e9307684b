"""The ``aimu serve`` command: options, the safety checks, and Uvicorn.

Binds 127.0.0.1 unless told otherwise, and refuses to bind any other address without a
bearer token in ``AIMU_API_TOKEN`` (a token on the command line would show in ``ps``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import ipaddress
import os
import sys
from collections.abc import Callable
from typing import Any, cast

__all__ = ["add_serve_options", "import_tool", "is_loopback", "run_serve"]


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``aimu serve`` to ``parser``."""
    parser.add_argument(
        "--model",
        default=os.environ.get("AIMU_MODEL") or "test",
        help="model spec, e.g. ollama:qwen3:8b (default: $AIMU_MODEL, else the test model)",
    )
    parser.add_argument(
        "--store",
        default=None,
        metavar="PATH-OR-URL",
        help="the sessions: a SQLite file, or a postgresql:// URL for a store every host "
        "reaches (default: $AIMU_HOME/sessions.db)",
    )
    parser.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="Redis URL shared by several server processes (runs stop and stream across them)",
    )
    parser.add_argument(
        "--redis-prefix",
        default="aimu",
        metavar="PREFIX",
        help="key prefix in Redis; servers that work together use the same one (default aimu)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    parser.add_argument("--system", default=None, help="system prompt for every session")
    parser.add_argument(
        "--tool",
        action="append",
        default=[],
        metavar="MODULE:NAME",
        help="a tool the agents may call: a function or aio.tool importable as MODULE:NAME "
        "(repeatable)",
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="allow browser calls from this origin (repeatable; none by default)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def import_tool(spec: str) -> Callable[..., Any]:
    """The function or tool named ``MODULE:NAME``; ValueError saying what is wrong."""
    module_name, colon, name = spec.partition(":")
    if not (colon and module_name and name):
        raise ValueError(f"--tool {spec!r}: give MODULE:NAME, like mypackage.tools:search")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--tool {spec!r}: cannot import it ({error})") from error
    if not callable(found):
        raise ValueError(f"--tool {spec!r} is a {type(found).__name__}, not a function or tool")
    return cast(Callable[..., Any], found)


def run_serve(options: argparse.Namespace) -> int:
    """Run the server until SIGINT or SIGTERM; return the exit status."""
    token = os.environ.get("AIMU_API_TOKEN") or None
    if not is_loopback(options.host) and token is None:
        print(
            f"aimu serve: refusing to bind {options.host}: other machines could reach it and "
            "nothing guards it. Set AIMU_API_TOKEN to a secret (clients send "
            "'Authorization: Bearer <token>'), or bind 127.0.0.1.",
            file=sys.stderr,
        )
        return 2
    if not 0 <= options.port <= 65535:
        print(f"aimu serve: --port {options.port} is not a TCP port", file=sys.stderr)
        return 2
    try:
        import uvicorn

        from aimu.serve import app
    except ImportError as missing:
        print(f"aimu serve: {missing}", file=sys.stderr)
        return 2
    try:
        tools = [import_tool(spec) for spec in options.tool]
    except ValueError as error:
        print(f"aimu serve: {error}", file=sys.stderr)
        return 2
    application = app(
        options.model,
        store=options.store,
        tools=tools,
        system=options.system,
        token=token,
        cors_origins=options.cors_origin,
        redis=options.redis,
        redis_prefix=options.redis_prefix,
    )
    config = uvicorn.Config(
        application,
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        timeout_graceful_shutdown=10,
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Event streams would hold the shutdown open until their runs end: end them
            # now (clients reconnect with Last-Event-ID); the lifespan then stops the runs.
            application.runs.begin_shutdown()
            super().handle_exit(sig, frame)

    try:
        asyncio.run(Server(config).serve())
    except KeyboardInterrupt:
        return 130
    return 0
