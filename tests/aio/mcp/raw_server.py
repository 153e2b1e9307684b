"""A misbehaving MCP server on bare JSON-RPC lines: ``python raw_server.py MODE``.

MODE ``string-schema``: a tool whose input schema is not an object; ``list-fails``:
tools/list answers with an error; ``deep-schema``: a schema nested deeper than a JSON
parser's recursion allows; ``annotations``: tools annotated every way the MCP
specification allows (their names say how), and ``big``, whose result is 1.5 MB of text.
Everything else is answered as a minimal server would.
"""

from __future__ import annotations

import json
import sys

MODE = sys.argv[1]


def answer(request: dict[str, object]) -> dict[str, object] | str | None:
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
    elif method == "tools/list" and MODE == "deep-schema":
        deep = '{"type": "object", "properties": {"a": ' * 5000 + "{}" + "}}" * 5000
        listed = '{"tools": [{"name": "deep", "inputSchema": ' + deep + "}]}"
        return f'{{"jsonrpc": "2.0", "id": {json.dumps(request["id"])}, "result": {listed}}}'

    elif method == "tools/list" and MODE == "annotations":
        hints: dict[str, dict[str, bool] | None] = {
            "none": None,
            "empty": {},
            "read_only": {"readOnlyHint": True},
            "read_only_destructive": {"readOnlyHint": True, "destructiveHint": True},
            "additive": {"destructiveHint": False},
            "additive_idempotent": {"destructiveHint": False, "idempotentHint": True},
            "destructive_idempotent": {"destructiveHint": True, "idempotentHint": True},
            "idempotent": {"idempotentHint": True},
            "big": {"readOnlyHint": True},
            "picture": {"readOnlyHint": True},
        }
        tools = []
        for name, annotations in hints.items():
            listed: dict[str, object] = {"name": name, "inputSchema": {"type": "object"}}
            if annotations is not None:
                listed["annotations"] = annotations
            tools.append(listed)
        reply["result"] = {"tools": tools}
    elif method == "tools/call" and MODE == "annotations" and (
        request["params"]["name"] == "picture"  # type: ignore[index]
    ):
        png = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmM"
               "IQAAAABJRU5ErkJggg==")  # a 1x1 PNG, 70 bytes
        blob = {"uri": "file:///tmp/a.bin", "mimeType": "application/zip", "blob": "AAEC"}
        reply["result"] = {"content": [
            {"type": "text", "text": "a red dot:"},
            {"type": "image", "data": png, "mimeType": "image/png"},
            {"type": "audio", "data": "UklGRg==", "mimeType": "audio/wav"},
            {"type": "resource", "resource": blob},
        ]}
    elif method == "tools/call" and MODE == "annotations":
        text = "é" + "x" * 1_499_998  # 1.5 MB of UTF-8, starting with a 2-byte character
        reply["result"] = {"content": [{"type": "text", "text": text}]}
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
            sys.stdout.write((out if isinstance(out, str) else json.dumps(out)) + "\n")
            sys.stdout.flush()
