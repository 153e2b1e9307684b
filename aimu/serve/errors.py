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

:func:`answer` is the one table from any exception a route raises to the status and
message the client gets. Messages never carry a lock file's path, a pid, a host name or
a database's address: what the client cannot act on goes to the server log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Final

from aimu.aio.errors import AimuError, SessionLockedError, StoreCapacityError, StoreError

__all__ = [
    "Answer",
    "BadRequest",
    "Conflict",
    "Draining",
    "NotFound",
    "NotSupported",
    "PayloadTooLarge",
    "ServeError",
    "ServiceUnavailable",
    "Unauthorized",
    "Unprocessable",
    "answer",
    "unavailable",
]

_log = logging.getLogger("aimu.serve")


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
    """A service the server needs (Redis, Temporal, the store) did not answer, or is
    overloaded: a passing shortage (503 with ``Retry-After``)."""

    status = 503
    retry_after = 5


class Draining(ServiceUnavailable):
    """The server drains its runs before it exits: it starts none (503, ``Retry-After``;
    another server, or this one restarted, will)."""


@dataclass(frozen=True)
class Answer:
    """What a client is told about an error, and how loudly the server logs it."""

    status: int
    message: str
    log_level: int = logging.DEBUG
    """The level the error's own text is logged at (ERROR: with its traceback)."""
    retry_after: int | None = None
    """Seconds, for a ``Retry-After`` header (a passing shortage)."""


#: (exception class, how to answer it), the first match wins. ``where`` names the
#: session or run of the request ("session 'a'"), or is empty.
_TABLE: Final[tuple[tuple[type[BaseException], Callable[[BaseException, str], Answer]], ...]] = (
    (
        ServeError,
        lambda e, _: Answer(
            getattr(e, "status", 500), str(e), retry_after=getattr(e, "retry_after", None)
        ),
    ),
    (
        SessionLockedError,
        lambda _, where: Answer(
            Conflict.status,
            f"{where or 'the session'} is open for writing elsewhere (a run in progress in "
            "another process, or a writer of your own): stop it or wait, then try again",
            logging.INFO,
        ),
    ),
    (
        StoreCapacityError,
        lambda e, _: Answer(
            ServiceUnavailable.status,
            f"the session store ran out of connections: {getattr(e, 'ran_out', 'connections')} "
            "are in use; try again when runs end (the server log says which limit to raise)",
            logging.WARNING,
            retry_after=5,
        ),
    ),
    (
        StoreError,
        lambda _, where: Answer(
            ServiceUnavailable.status,
            f"the session store failed{' for ' + where if where else ''}: "
            "see the server log",
            logging.ERROR,
        ),
    ),
)


def unavailable(what: str, error: BaseException) -> ServiceUnavailable:
    """``ServiceUnavailable`` for a control (Redis, Temporal) that failed while doing
    ``what``: the client learns what failed, the log learns where (its address)."""
    _log.warning("cannot %s: %s", what, error)
    return ServiceUnavailable(
        f"cannot {what}: the service the servers share (Redis or Temporal) did not answer "
        "in time or is overloaded; try again (the server log says why)"
    )


def answer(error: BaseException, where: str = "") -> Answer:
    """The answer to ``error`` raised by a route: its status, a message safe to show."""
    for kind, make in _TABLE:
        if isinstance(error, kind):
            return make(error, where)
    return Answer(500, f"internal error: {type(error).__name__}; see the server log", logging.ERROR)
