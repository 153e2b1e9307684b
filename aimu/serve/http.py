"""HTTP plumbing of the server: JSON bodies in and out, the bearer token, the body limit.

Every answer is JSON with ASCII escapes (a lone surrogate a client sent in a string
cannot break the encoding), and every error is ``{"error": message, "status": code}``.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Mapping
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from aimu.serve.errors import BadRequest, PayloadTooLarge, Unauthorized, Unprocessable

__all__ = ["JSON", "BearerAuth", "error_response", "fields", "read_json"]

#: Paths answered without the token: the health check, and the chat page's static shell
#: (a browser cannot attach a bearer header to a page load; the page holds no data and
#: asks for the token, which it then sends on every API call).
PUBLIC_PATHS: Final = frozenset({"/health", "/"})
PUBLIC_PREFIX: Final = "/static/"


class JSON(Response):
    """A JSON response, ASCII-escaped."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSON:
    return JSON({"error": message, "status": status}, status_code=status, headers=headers)


async def read_json(request: Request, limit: int) -> dict[str, Any] | None:
    """The request's JSON object, or None for an empty body.

    ``PayloadTooLarge`` past ``limit`` bytes (read no further), ``BadRequest`` for bytes
    that are not JSON, ``Unprocessable`` for JSON that is not an object.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise BadRequest(f"Content-Length {declared[:20]!r} is not a number of bytes")
        if int(declared) > limit:
            raise PayloadTooLarge(f"the request body is {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"the request body is over the limit of {limit} bytes")
    if not body.strip():
        return None
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRequest(f"the request body is not JSON: {error}") from None
    except RecursionError:
        raise BadRequest("the request body is JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise Unprocessable(f"the request body must be a JSON object, not {_kind(value)}")
    return value


def fields(
    body: Mapping[str, Any] | None,
    required: Mapping[str, type],
    optional: Mapping[str, type] = {},
) -> dict[str, Any]:
    """Check ``body`` against field names and types; ``Unprocessable`` names what is wrong."""
    given = dict(body or {})
    unknown = sorted(set(given) - set(required) - set(optional))
    if unknown:
        raise Unprocessable(
            f"unknown field {unknown[0]!r:.60}; expected {', '.join([*required, *optional])}"
        )
    for name in required:
        if name not in given:
            raise Unprocessable(f"the field {name!r} is required")
    for name, value in given.items():
        kind = required.get(name) or optional[name]
        if value is None and name in optional:
            continue
        if kind is str and not isinstance(value, str):
            raise Unprocessable(f"the field {name!r} must be a string, not {_kind(value)}")
        if kind is str:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as error:
                raise Unprocessable(
                    f"the field {name!r} holds a lone surrogate at character {error.start}: "
                    "send valid Unicode"
                ) from None
        if kind is bool and not isinstance(value, bool):
            raise Unprocessable(f"the field {name!r} must be true or false, not {_kind(value)}")
    return given


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
