"""``--mcp "COMMAND ARGS"`` and ``--mcp-url URL``: MCP servers for ``aimu chat``, ``aimu
serve`` and ``aimu worker``, defined once here for each command to add.

:func:`mcp_servers` turns the options into :class:`~aimu.aio.MCPServer` objects (a
``ValueError`` saying what is wrong: a command that does not split, the ``aimu-agents[mcp]``
extra missing); the command opens them before serving, so a server that cannot start
is a clear error at once, and closes them when it ends.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING

from aimu.aio.tools import Toolset

if TYPE_CHECKING:
    from aimu.aio.mcp import MCPServer

__all__ = ["add_mcp_options", "loaded", "mcp_servers", "open_all"]


def add_mcp_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--mcp`` and ``--mcp-url`` (each repeatable) to ``parser``."""
    parser.add_argument(
        "--mcp",
        action="append",
        default=[],
        metavar='"COMMAND ARGS"',
        help="an MCP server to start over stdio, its tools offered to the model, e.g. "
        '--mcp "npx -y @modelcontextprotocol/server-everything" (repeatable; needs the mcp extra)',
    )
    parser.add_argument(
        "--mcp-url",
        action="append",
        default=[],
        metavar="URL",
        help="an MCP server to reach over Streamable HTTP (repeatable; needs the mcp extra)",
    )


def mcp_servers(commands: Sequence[str], urls: Sequence[str]) -> list[MCPServer]:
    """The servers the options name (not opened yet); ValueError saying what is wrong.

    Two servers with the same default name get ``_2``, ``_3``... so a clash of their
    tools' names can be told apart by prefix.
    """
    if not commands and not urls:
        return []
    try:
        from aimu.aio.mcp import MCPServer
    except ImportError as error:
        raise ValueError(f"--mcp and --mcp-url: {error}") from None
    servers: list[MCPServer] = []
    for command in commands:
        try:
            argv = shlex.split(command)
        except ValueError as error:
            raise ValueError(f"--mcp {command!r}: {error}") from None
        if not argv:
            raise ValueError('--mcp needs a command, like --mcp "npx -y some-mcp-server"')
        servers.append(MCPServer.stdio(argv[0], argv[1:]))
    for url in urls:
        try:
            servers.append(MCPServer.http(url))
        except ValueError as error:
            raise ValueError(f"--mcp-url {url!r}: {error}") from None
    seen: dict[str, int] = {}
    named: list[MCPServer] = []
    for server in servers:
        count = seen[server.name] = seen.get(server.name, 0) + 1
        named.append(server if count == 1 else server.renamed(f"{server.name}_{count}"))
    return named


async def open_all(servers: Sequence[Toolset]) -> None:
    """Open every server (an :class:`~aimu.aio.MCPServerError` naming the first that
    fails, the others closed again)."""
    opened: list[Toolset] = []
    try:
        for server in servers:
            await server.open()
            opened.append(server)
    except BaseException:
        for server in opened:
            await server.aclose()
        raise


async def loaded(servers: Sequence[MCPServer]) -> list[str]:
    """A line for each (opened) server: its name and the tools it offers, those that ask
    a person first marked, for a program to say what ``--mcp`` brought."""
    lines = []
    for server in servers:
        tools = await server.list_tools()
        names = [f"{t.name} (asks first)" if t.approval else t.name for t in tools]
        count = f"{len(tools)} tool{'' if len(tools) == 1 else 's'}"
        lines.append(f"MCP server {server.name!r}: {count}: {', '.join(names) or 'none'}")
    return lines
