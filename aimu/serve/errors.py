"""Errors of the HTTP layer: each carries the HTTP status it is answered with.

    ServeError (an AimuError)       answered as ``{"error": message, "status": code}``
     ├── BadRequest          400    malformed JSON, a bad session name or event id
     ├── Unauthorized        401    a missing or wrong bearer token
     ├── NotFound            404    no such run, session or route
     ├── Conflict            409    the session is busy, the run already ended
     ├── PayloadTooLarge     413    a request body over the server's limit
     ├── Unprocessable       422    well-formed JSON with the wrong fields or types
     ├── NotSupported        501    a feature this aimu or this control cannot do
     └── ServiceUnavailable  503    Redis, shared by the servers, cannot be reached
"""

from __future__ import annotations

from typing import ClassVar

from aimu.aio.errors import AimuError

__all__ = [
    "BadRequest",
    "Conflict",
    "NotFound",
    "NotSupported",
    "PayloadTooLarge",
    "ServeError",
    "ServiceUnavailable",
    "Unauthorized",
    "Unprocessable",
]


class ServeError(AimuError):
    """An error answered to an HTTP client with :attr:`status` and the message."""

    status: ClassVar[int] = 500


class BadRequest(ServeError):
    status = 400


class Unauthorized(ServeError):
    status = 401


class NotFound(ServeError):
    status = 404


class Conflict(ServeError):
    status = 409


class PayloadTooLarge(ServeError):
    status = 413


class Unprocessable(ServeError):
    status = 422


class NotSupported(ServeError):
    status = 501


class ServiceUnavailable(ServeError):
    status = 503
