"""Names under the control's prefix: run ids, Redis keys, channels, and the URL to show.

Every key a :class:`~aimu.aio.control.RedisControl` touches starts with ``PREFIX:``;
run ids are checked before any key is built from them, so no id reaches another
prefix's keys. :func:`redact` is the only form of the URL that may be logged or raised.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from aimu.aio._ids import is_run_id, is_stream_id, new_run_id

__all__ = [
    "Keys", "check_after", "check_prefix", "check_run_id", "new_run_id", "redact",
]

_PREFIX = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SECRET_QUERY = frozenset({"password", "username"})


def check_run_id(run_id: object, prefix: str) -> str:
    """Return ``run_id`` if it is a well-formed id, else raise naming what is wrong."""
    if not isinstance(run_id, str):
        raise TypeError(f"a run id is a string, got {type(run_id).__name__}")
    if ":" in run_id:
        raise ValueError(
            f"run id {run_id!r} contains ':': ids are bare names, not Redis keys; this "
            f"control's keys live under {prefix!r}, and a key of another prefix is no run id"
        )
    if not is_run_id(run_id):
        raise ValueError(f"malformed run id {run_id!r}: use 1 to 128 letters, digits, '_' or '-'")
    return run_id


def check_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or _PREFIX.fullmatch(prefix) is None:
        raise ValueError(f"bad key prefix {prefix!r}: use 1 to 64 letters, digits, '_', '-' or '.'")
    return prefix


def check_after(after: object) -> str:
    """An event id to follow from (``"1712345678901-0"``), else raise."""
    if not is_stream_id(after):
        raise ValueError(
            f"bad event id {after!r}: pass the id of an event this run published "
            "(like '1712345678901-0'), or None to follow from the start"
        )
    return after


def redact(url: str) -> str:
    """``url`` with any password (and the user name) replaced by ``***``."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            _, _, host = netloc.rpartition("@")
            netloc = f"***@{host}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode([(k, "***" if k in _SECRET_QUERY else v) for k, v in pairs])
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return "<unparsable URL>"


class Keys:
    """The Redis key of each thing, for one prefix."""

    __slots__ = ("base", "channel_base", "prefix", "prune", "runs")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        #: What every key starts with (the scripts build a run's keys from it).
        self.base = f"{prefix}:"
        #: Where the pruning of the runs list goes on from (a score bound).
        self.prune = f"{prefix}:prune"
        #: Sorted set of run ids by creation time: what ``runs()`` lists.
        self.runs = f"{prefix}:runs"
        #: ``channel_base + worker``: where requests for a worker's runs are published.
        self.channel_base = f"{prefix}:worker:"

    def run(self, run_id: str) -> str:
        """Hash: status, worker, name, attempt, times, reason, error, info."""
        return f"{self.prefix}:run:{run_id}"

    def session(self, name: str) -> str:
        """String: the id of the latest run of session ``name`` (``""``: the key of none)."""
        return f"{self.prefix}:session:{name}"

    def lease(self, run_id: str) -> str:
        """String: the worker holding the run, expiring unless its heartbeat renews it."""
        return f"{self.prefix}:run:{run_id}:lease"

    def events(self, run_id: str) -> str:
        """Stream: the run's events, each with its ``seq``, ``type`` and JSON ``data``."""
        return f"{self.prefix}:run:{run_id}:events"

    def requests(self, run_id: str) -> str:
        """Stream: cancel, interrupt and stop requests, durable before they are published."""
        return f"{self.prefix}:run:{run_id}:requests"

    def all(self, run_id: str) -> tuple[str, str, str, str]:
        return self.run(run_id), self.lease(run_id), self.events(run_id), self.requests(run_id)
