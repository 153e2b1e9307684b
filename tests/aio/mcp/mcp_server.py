"""An MCP server for the tests, on the official Python SDK: ``python mcp_server.py stdio``
or ``python mcp_server.py http PORT``; ``--only NAME,NAME`` keeps only those tools.

Every tool call appends lines to the file named by ``AIMU_MCP_LOG`` (if set): ``started
TAG``, then ``finished TAG`` or ``cancelled TAG``, so a test can prove what the server
saw. ``pid`` gives the server's process id (for the orphan tests).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Annotated

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations
from pydantic import Field

server = MCPServer("aimu-test")


def cancel_seen(tag: str) -> None:
    """Tell ``AIMU_MCP_CANCEL_SOCKET`` (a unix datagram socket, the benchmark's) when the
    tool saw its cancel, on the monotonic clock every process here shares."""
    path = os.environ.get("AIMU_MCP_CANCEL_SOCKET")
    if path:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(f"{tag} {time.monotonic()}".encode(), path)


def note(line: str) -> None:
    path = os.environ.get("AIMU_MCP_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(line + "\n")


# Changes nothing it could not change again: no approval, not idempotent (a tool with no
# annotations would ask for approval, as the MCP specification's defaults read).
ADDITIVE = ToolAnnotations(destructiveHint=False)


@server.tool(annotations=ToolAnnotations(readOnlyHint=True, idempotentHint=True))
def add(a: int, b: Annotated[int, Field(description="the second number")]) -> str:
    """Add two numbers."""
    return str(a + b)


@server.tool(annotations=ADDITIVE)
def pid() -> str:
    """This server's process id."""
    return str(os.getpid())


@server.tool(annotations=ADDITIVE)
async def wait(tag: str, seconds: float, ctx: Context) -> str:
    """Report progress, then wait `seconds` (or until cancelled), noting what happened."""
    note(f"started {tag}")
    try:
        await ctx.report_progress(0, 1, f"waiting {tag}")
        await anyio.sleep(seconds)
    except anyio.get_cancelled_exc_class():
        cancel_seen(tag)
        note(f"cancelled {tag}")
        raise
    note(f"finished {tag}")
    await ctx.report_progress(1, 1, f"done {tag}")
    return f"waited {tag}"


@server.tool(annotations=ADDITIVE)
async def lookup(query: str, ctx: Context) -> str:
    """Look something up, reporting progress on the way."""
    await ctx.report_progress(1, 2, f"looking up {query}")
    return f"found {query}"


@server.tool(annotations=ADDITIVE)
def crash(tag: str) -> str:
    """Exit the server process mid-call."""
    note(f"crashed {tag}")
    os._exit(3)


@server.tool(annotations=ADDITIVE)
def fail(reason: str) -> str:
    """Raise an error (the model reads it)."""
    raise ValueError(reason)


@server.tool(annotations=ToolAnnotations(destructiveHint=True))
def remove(path: str) -> str:
    """Pretend to delete a file (destructive: it asks for approval)."""
    note(f"removed {path}")
    return f"removed {path}"


if __name__ == "__main__":
    if "--only" in sys.argv:  # keep only these tools: python mcp_server.py stdio --only a,b
        keep = sys.argv[sys.argv.index("--only") + 1].split(",")
        for listed in list(server._tool_manager.list_tools()):
            if listed.name not in keep:
                server.remove_tool(listed.name)
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
