"""Run ids and event ids as they arrive over HTTP: checked once, here, by the one rule.

A malformed run id names no run (``NotFound``, like an unknown one); a malformed
``Last-Event-ID`` / ``?after=`` is the client's mistake (``BadRequest``, a short message).
The rule itself is :mod:`aimu.aio._ids`, shared with the Redis control and the OpenAPI
document.
"""

from __future__ import annotations

from aimu.aio._ids import is_event_number, is_run_id, is_stream_id
from aimu.serve.errors import BadRequest, NotFound

__all__ = ["chained_stream_id", "check_run_id", "event_number", "stream_id"]


def check_run_id(run_id: str) -> str:
    """``run_id`` if it could be one of ours, else ``NotFound``."""
    if not is_run_id(run_id):
        raise NotFound(
            f"no run {run_id[:64]!r}: run ids are 1-128 characters from A-Z a-z 0-9 - _"
        )
    return run_id


def event_number(after: str | None) -> int:
    """How many events a follower of a local run has seen (0: none), from its event id."""
    if after is None or after == "":
        return 0
    if not is_event_number(after):
        raise _bad_event_id(after, "a number like '12'")
    return int(after)


def stream_id(after: str | None) -> str | None:
    """A follower's event id on a run shared through Redis (None: from the start)."""
    if after is None or after == "":
        return None
    if not is_stream_id(after):
        raise _bad_event_id(after, "like '1712345678901-0'")
    return after


def chained_stream_id(after: str | None) -> tuple[int, str | None]:
    """A follower's event id on a chain of runs shared through Redis: how many runs
    continue the followed one up to the event's (0: the followed run's own event, a bare
    ``MS-SEQ``; G: ``G:MS-SEQ``) and the event's id in that run's stream (None: from the
    start)."""
    if after is None or after == "":
        return 0, None
    generation, colon, rest = after.partition(":")
    if not colon:
        return 0, stream_id(after)
    if not (generation.isascii() and generation.isdigit() and len(generation) <= 9
            and generation[0] != "0" and is_stream_id(rest)):
        raise _bad_event_id(after, "like '1712345678901-0', or '2:1712345678901-0' after "
                            "a run_continued event")
    return int(generation), rest


def _bad_event_id(after: str, like: str) -> BadRequest:
    return BadRequest(
        f"Last-Event-ID {after[:48]!r} is not an event id of this run: send the id: field "
        f"of the last event you received ({like})"
    )
