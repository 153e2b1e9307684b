"""``aimu mcp``: the agent as an MCP server over stdio (one tool, ``run_agent``).

It runs the same agent as ``aimu serve`` (the same ``--model``, ``--store``, ``--tool``
and limits) in this process; stdout carries MCP's messages, so everything else (log
records, errors) goes to stderr. ``aimu serve`` offers the same server at ``/mcp``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from aimu._extras import MissingExtra, needs_extra
from aimu._limit_options import limits_from
from aimu._logs import logging_to
from aimu.assistant import default_home
from aimu.serve.command import ENVIRONMENT, add_agent_options, agent_tools

__all__ = ["add_mcp_command_options", "run_mcp"]


def add_mcp_command_options(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ENVIRONMENT
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--name", default="aimu", help="the server's name for clients")
    # stderr of a stdio server lands in the client's own output (its log, its terminal):
    # warnings and errors only, unless asked.
    add_agent_options(parser, "aimu's log records", log_level="warning")


def run_mcp(options: argparse.Namespace) -> int:
    """Serve MCP on stdin/stdout until the client goes; return the exit status."""
    with logging_to(sys.stderr, options.log_level):
        try:
            with needs_extra("aimu mcp", "mcp"):
                import mcp  # noqa: F401
        except MissingExtra as missing:
            print(f"aimu mcp: {str(missing).removeprefix('aimu mcp ')}", file=sys.stderr)
            return 2
        if options.redis or getattr(options, "mcp", None) or getattr(options, "mcp_url", None):
            print("aimu mcp: --redis and --mcp are for aimu serve; this runs the agent here",
                  file=sys.stderr)
            return 2
        try:
            tools = agent_tools(options)
        except ValueError as error:
            print(f"aimu mcp: {error}", file=sys.stderr)
            return 2
        try:
            return asyncio.run(_serve(options, tools))
        except KeyboardInterrupt:
            return 130


async def _serve(options: argparse.Namespace, tools: list[Any]) -> int:
    from aimu.serve.agents import agent_factory, open_store
    from aimu.serve.backends.local import LocalBackend
    from aimu.serve.mcp_agent import agent_server
    from aimu.serve.runs import Runs

    store, close_store = open_store(options.store or str(default_home() / "sessions.db"))
    agents, close_model = agent_factory(options.model, store, tools=tools,
                                        system=options.system, limits=limits_from(options))
    runs = Runs(LocalBackend(agents, store), store, agents)
    try:
        await agent_server(runs, name=options.name).run_stdio_async()
    finally:
        await runs.aclose()  # a run still going when the client left is cancelled, kept
        await close_model()
        if close_store is not None:
            await close_store()
    return 0
