"""A misbehaving MCP server on bare JSON-RPC lines: ``python raw_server.py MODE``.

MODE ``string-schema``: a tool whose input schema is not an object; ``list-fails``:
tools/list answers with an error. Everything else is answered as a minimal server would.
"""

from __future__ import annotations

import json
import sys

MODE = sys.argv[1]


def answer(request: dict[str, object]) -> dict[str, object] | None:
    method = request.get("method")
    if "id" not in request:
        return None  # a notification
    reply: dict[str, object] = {"jsonrpc": "2.0", "id": request["id"]}
    if method == "initialize":
        reply["result"] = {
            "protocolVersion": "2025-06-18",
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "raw", "version": "1"},
        }
    elif method == "tools/list" and MODE == "list-fails":
        reply["error"] = {"code": -32603, "message": "the tool list is broken"}
    elif method == "tools/list":
        schema = {"type": "string"}
        reply["result"] = {"tools": [{"name": "odd", "inputSchema": schema}]}
    else:
        reply["error"] = {"code": -32601, "message": "Method not found"}
    return reply


for line in sys.stdin:
    if line.strip():
        out = answer(json.loads(line))
        if out is not None:
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()
