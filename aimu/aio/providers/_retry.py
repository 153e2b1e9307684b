"""Retrying a model request that failed before any byte of its reply arrived (and, with
the same policy and budget, one whose stream broke mid-reply: see :mod:`._resume`).

A 429 (its ``Retry-After`` honoured), a 502/503/504/529 (Anthropic's overloaded), or a
connection refused or reset before the response head (or an error event standing for one
of those statuses before any byte of the turn) is retried with exponential backoff and
jitter, at most ``retries`` times, never past the run's deadline. A ``503 Loading
model`` (a server still loading the model's weights, as llama.cpp's says) is retried
beyond that, every second or so, for up to :data:`LOADING_WAIT` seconds from the first,
still never past the deadline. A cancel ends the wait at once; an interrupt of the run
ends it too, and the last failure is raised (an agent then ends the run interrupted: no
byte of the turn exists). Each retry is a :class:`~aimu.aio.events.ModelRetry` event in
the current run scope and a log record on ``aimu.aio.providers`` (host without
credentials, redacted error, no header).
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import time
from typing import Protocol

import httpx

from aimu.aio.errors import ModelError, ModelHTTPError
from aimu.aio.events import ModelRetry
from aimu.aio.scope import current_scope

__all__ = ["DEFAULT_RETRIES", "LOADING_WAIT", "Retry", "loading_model", "retry_after"]

log = logging.getLogger("aimu.aio.providers")

DEFAULT_RETRIES = 3
DEFAULT_DELAY = 0.5
_MAX_DELAY = 30.0
_MAX_RETRY_AFTER = 60.0
#: Seconds a server that answers ``503 Loading model`` is waited for (from its first).
LOADING_WAIT = 120.0
_LOADING_POLL = 1.0  # the longest wait between two tries of a loading server
_STATUSES = frozenset({429, 502, 503, 504, 529})  # 529: Anthropic overloaded
# Raised by send() before the response head: nothing of a reply has arrived.
_BEFORE_REPLY = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)


def loading_model(failure: ModelError) -> bool:
    """True for a ``503`` whose body says the server is loading the model."""
    return (
        isinstance(failure, ModelHTTPError)
        and failure.status_code == 503
        and "loading model" in failure.body.lower()
    )


def retry_after(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (a number or an HTTP date), or None."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if seconds == seconds else None  # NaN: ignored


class Named(Protocol):
    """What a retry names in its log lines and events: the server and the model (the
    request's error reporter has them)."""

    @property
    def host(self) -> str: ...

    @property
    def model(self) -> str: ...


class Retry:
    """The retry policy of one client: how many attempts, and the first backoff delay."""

    __slots__ = ("delay", "retries")

    def __init__(self, retries: int, delay: float) -> None:
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        if not delay >= 0:
            raise ValueError(f"retry_delay must be >= 0 seconds, got {delay!r}")
        self.retries = retries
        self.delay = delay

    @staticmethod
    def before_reply(cause: BaseException | None) -> bool:
        return isinstance(cause, _BEFORE_REPLY)

    @staticmethod
    def retry_status(status: int) -> bool:
        return status in _STATUSES

    def backoff(self, attempt: int) -> float:
        """Exponential in ``attempt`` (1-based), with jitter: between half and all of it."""
        ceiling = min(_MAX_DELAY, self.delay * 2 ** (attempt - 1))
        return float(ceiling * random.uniform(0.5, 1.0))

    async def wait(
        self,
        attempt: int,
        requested: float | None,
        failure: ModelError,
        reporter: Named,
        loading_for: float | None = None,
    ) -> bool:
        """Wait before retry ``attempt``; False when no retry may be made.

        ``loading_for``: seconds the server has answered ``503 Loading model`` (None:
        it has not); such a server is tried beyond ``retries`` (unless 0), up to
        LOADING_WAIT."""
        # retries=0 turns retrying off, the wait for a loading server included.
        loading = loading_for is not None and loading_for < LOADING_WAIT and self.retries > 0
        if attempt > self.retries and not loading:
            return False
        if requested is not None and requested > _MAX_RETRY_AFTER:
            return False
        delay = self.backoff(attempt) if requested is None else requested
        if loading and requested is None:
            delay = min(delay, _LOADING_POLL)
        loop = asyncio.get_running_loop()
        scope = current_scope.get()
        end = loop.time() + delay
        if scope is not None:
            if scope.interrupt_requested:
                return False
            if scope.deadline is not None and end >= scope.deadline:
                return False
        error = str(failure)
        if attempt > self.retries:
            log.info(
                "model at %s is loading its model (%s); retry %d in %.2fs, waiting up to %gs",
                reporter.host, error, attempt, delay, LOADING_WAIT,
            )
        else:
            log.info(
                "model request to %s failed (%s); retry %d of %d in %.2fs",
                reporter.host, error, attempt, self.retries, delay,
            )
        if scope is not None:
            scope.emit(ModelRetry(reporter.host, reporter.model, attempt, delay, error))
        if scope is None:
            await asyncio.sleep(delay)
            return True
        if await scope.interrupted_within(delay):  # an interrupt ends it at once
            return False
        scope.retries += 1  # counted where the request is made, for the run making it
        return True
