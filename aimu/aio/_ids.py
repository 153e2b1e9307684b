"""The one rule for run ids and event ids, wherever they arrive (Python, Redis, HTTP).

A run id is 1-128 ASCII letters, digits, ``_`` or ``-`` (safe in a URL path and a Redis
key). An event id is ``N`` (a run's own numbering, from 1), ``MS-SEQ`` (a Redis
stream's, each part a 64-bit unsigned number) or ``G:MS-SEQ`` (the Redis stream's id
of an event of the G-th run continuing a run whose server died, G from 1). The patterns
are ASCII-only on purpose: ``str.isdigit()`` accepts ``'²'``, which ``int()`` then
refuses.
"""

from __future__ import annotations

import re
import secrets
from typing import Final, TypeGuard

__all__ = [
    "CHAINED_STREAM_ID_PATTERN",
    "EVENT_NUMBER_PATTERN",
    "RUN_ID_PATTERN",
    "STREAM_ID_PATTERN",
    "is_event_number",
    "is_run_id",
    "is_stream_id",
    "new_run_id",
    "new_token",
]

RUN_ID_PATTERN: Final = "^[A-Za-z0-9_-]{1,128}$"
#: A run's own event number (1, 2, ...), as a local server numbers events.
EVENT_NUMBER_PATTERN: Final = "^[0-9]{1,12}$"
#: A Redis stream entry id, as servers sharing Redis number events.
STREAM_ID_PATTERN: Final = "^[0-9]{1,20}-[0-9]{1,20}$"
#: An event of the G-th run continuing a run (serve's Redis backend): ``G:MS-SEQ``.
CHAINED_STREAM_ID_PATTERN: Final = "^[1-9][0-9]{0,8}:[0-9]{1,20}-[0-9]{1,20}$"
_U64: Final = (1 << 64) - 1
_RUN_ID = re.compile(RUN_ID_PATTERN, re.ASCII)
_EVENT_NUMBER = re.compile(EVENT_NUMBER_PATTERN, re.ASCII)
_STREAM_ID = re.compile(STREAM_ID_PATTERN, re.ASCII)


def is_run_id(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and _RUN_ID.fullmatch(value) is not None


def is_event_number(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and _EVENT_NUMBER.fullmatch(value) is not None


def is_stream_id(value: object) -> TypeGuard[str]:
    """True for an id Redis accepts: two ASCII numbers, each below 2**64."""
    if not isinstance(value, str) or _STREAM_ID.fullmatch(value) is None:
        return False
    ms, _, seq = value.partition("-")
    return int(ms) <= _U64 and int(seq) <= _U64


def new_token(nbytes: int) -> str:
    """``nbytes`` random bytes, URL-safe, never starting with ``-``: an id a person pastes
    after a command (``aimu runs cancel ID``) must not be taken for an option."""
    while (token := secrets.token_urlsafe(nbytes)).startswith("-"):
        pass  # one draw in 64; drawing again keeps the rest uniform
    return token


def new_run_id() -> str:
    """An unguessable run id: 144 random bits, URL-safe (24 characters)."""
    return new_token(18)
