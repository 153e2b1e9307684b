"""MCP servers' tools for agents (the extra ``aimu-agents[mcp]``, the official ``mcp`` SDK 2.x).

:class:`MCPServer` (``_server``) is a :class:`~aimu.aio.tools.Toolset`: its tools go
beside plain functions in an agent's ``tools=[...]``. ``_connection`` holds one live
SDK session in a task of its own; ``_launcher`` ties a stdio server to this process.
"""

import logging

from aimu._extras import missing_extra

try:
    import mcp  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the install
    raise missing_extra("MCP servers", "mcp", error) from error

from aimu.aio.mcp._server import MCPServer

# The SDK logs what it also reports to us (a message it cannot parse, with a traceback):
# where nobody set up logging, Python's last-resort handler would print that beside
# aimu's one-line error. A NullHandler leaves the records to whoever sets logging up.
logging.getLogger("mcp").addHandler(logging.NullHandler())

__all__ = ["MCPServer"]
