"""HTTP plumbing of the server: JSON bodies in and out, the bearer token, the body limit.

Every answer is JSON with ASCII escapes (a lone surrogate a client sent in a string
cannot break the encoding), and every error is ``{"error": message, "status": code}``.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aimu.serve.errors import Unauthorized

__all__ = ["JSON", "BearerAuth", "BodyLimit", "error_response", "validation_answer"]

_log = logging.getLogger("aimu.serve")

#: Paths answered without the token: the health check, and the chat page's static shell
#: (a browser cannot attach a bearer header to a page load; the page holds no data and
#: asks for the token, which it then sends on every API call), and the A2A agent card
#: (how to reach the agent and that it needs the token; no data).
PUBLIC_PATHS: Final = frozenset(
    {"/health", "/", "/docs", "/openapi.json", "/.well-known/agent-card.json"}
)
PUBLIC_PREFIX: Final = ("/static/", "/docs/")  # the pages' files: no data in them


class JSON(JSONResponse):
    """A JSON response, ASCII-escaped."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSON:
    return JSON({"error": message, "status": status}, status_code=status, headers=headers)


class BodyLimit:
    """ASGI middleware: a request's body, read whole before any route runs, up to ``limit``.

    Past ``limit`` bytes (declared or counted as they arrive) the answer is 413 and no
    more is read; a client leaving mid-body gets no answer and is logged at DEBUG only.
    The route then reads the buffered body as usual.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        refusal = None
        if declared is not None and not (declared.isascii() and declared.isdigit()):
            refusal = 400, f"Content-Length {declared[:20]!r} is not a number of bytes"
        elif declared is not None and int(declared) > self.limit:
            refusal = 413, f"the request body is {declared} bytes; the limit is {self.limit}"
        if refusal is not None:
            await error_response(*refusal)(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                _log.debug("%s %s: the client disconnected before sending its body",
                           scope["method"], scope["path"])
                return
            body += message.get("body", b"")
            if len(body) > self.limit:
                too_large = f"the request body is over the limit of {self.limit} bytes"
                await error_response(413, too_large)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # the disconnect, when the client goes
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


def validation_answer(errors: Sequence[Mapping[str, Any]]) -> tuple[int, str]:
    """The status and message for FastAPI's validation ``errors`` (the first one said):
    400 for bytes that are not JSON or a bad path, query or header value; 422 for JSON
    with missing, unknown or mistyped fields."""
    error = errors[0]
    where, *path = error.get("loc") or ("body",)
    kind = str(error.get("type", ""))
    given = error.get("input")
    # The field (a list's item: the list's name and the item's index).
    name = next((str(part) for part in reversed(path) if isinstance(part, str)), None)
    if name is not None and path and isinstance(path[-1], int):
        name = f"{name}[{path[-1]}]"
    if kind == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", "")
        return 400, f"the request body is not JSON: {detail}"
    if where != "body":
        shown = repr(given)[:60] if isinstance(given, str) else "nothing"
        return 400, f"{name or where} {_said(error)}, got {shown}"
    if name is None:
        if kind == "missing":
            return 422, "the request body is required: a JSON object"
        return 422, f"the request body must be a JSON object, not {_kind(given)}"
    if kind == "missing":
        return 422, f"the field {name!r} is required"
    if kind == "extra_forbidden":
        return 422, f"unknown field {name!r:.60}; see /docs for this route's fields"
    if kind == "string_type":
        return 422, f"the field {name!r} must be a string, not {_kind(given)}"
    if kind == "bool_type":
        return 422, f"the field {name!r} must be true or false, not {_kind(given)}"
    return 422, f"the field {name!r} {_said(error)}"


def _said(error: Mapping[str, Any]) -> str:
    message = str(error.get("msg", "is not valid")).removeprefix("Value error, ")
    return message[:1].lower() + message[1:] if not message.startswith("holds") else message


def _kind(value: object) -> str:
    return {
        dict: "an object", list: "an array", str: "a string", bool: "a boolean",
        int: "a number", float: "a number", type(None): "null",
    }.get(type(value), type(value).__name__)


class BearerAuth:
    """ASGI middleware: every HTTP request but the public paths needs ``Bearer <token>``."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._public(_route_path(scope)) or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(
            Unauthorized.status,
            "this server needs a bearer token: send 'Authorization: Bearer <AIMU_API_TOKEN>'",
            {"WWW-Authenticate": 'Bearer realm="aimu"'},
        )
        await response(scope, receive, send)

    @staticmethod
    def _public(path: str) -> bool:
        return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIX)

    def _allowed(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self._expected)
        return False


def _route_path(scope: Scope) -> str:
    """The path below the prefix this app is mounted at, if any."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path
