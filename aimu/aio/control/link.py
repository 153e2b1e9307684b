"""What a control's worker needs of Redis: one small handle, not the control's insides,
and the connection pools a control's clients use (:func:`pooled`).

:class:`Link` holds the client, the keys under the prefix, the registered scripts and
the settings (lease, retention, the events kept) of one :class:`RedisControl`; the
worker reads nothing else of the control.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import redis.asyncio as redis
from redis.commands.core import AsyncScript

from aimu.aio.control import scripts
from aimu.aio.control.keys import Keys

__all__ = ["Link", "Scripts", "pooled"]


class Scripts:
    """The control's Lua scripts, registered with one client (sent by hash after once)."""

    __slots__ = (
        "claim", "paused", "publish", "register", "renew", "request", "reserve", "standing",
    )

    def __init__(self, client: redis.Redis) -> None:
        self.register: AsyncScript = client.register_script(scripts.REGISTER)
        self.publish: AsyncScript = client.register_script(scripts.PUBLISH)
        self.renew: AsyncScript = client.register_script(scripts.RENEW)
        self.claim: AsyncScript = client.register_script(scripts.CLAIM)
        self.request: AsyncScript = client.register_script(scripts.REQUEST)
        self.reserve: AsyncScript = client.register_script(scripts.RESERVE)
        self.paused: AsyncScript = client.register_script(scripts.PAUSED)
        self.standing: AsyncScript = client.register_script(scripts.STANDING)


@dataclass(frozen=True, slots=True)
class Link:
    """One control's connection to Redis and the settings its worker obeys."""

    client: redis.Redis
    """The worker's own connections (its pump, lease renewals, re-reads of requests)."""
    reads: redis.Redis
    """The control's connections for reads that wait (the worker's pub/sub)."""
    keys: Keys
    scripts: Scripts
    worker_id: str
    """This process's name in Redis: host, pid and a random tag."""
    url: str
    """The URL with its password hidden."""
    lease: float
    retention: float
    max_events: int
    timeout: float
    """Seconds a Redis command may take."""

    @property
    def lease_ms(self) -> int:
        return int(self.lease * 1000)

    @property
    def retention_s(self) -> int:
        """``retention`` in whole seconds, at least 1 (what EXPIRE takes)."""
        return max(1, round(self.retention))


class _Pool(redis.ConnectionPool):
    """A pool whose new connections connect a few at a time (``connecting``, shared by a
    control's pools): the others wait their turn before their connect timeout starts."""

    connecting: asyncio.Semaphore

    async def ensure_connection(self, connection: Any) -> None:
        if connection.is_connected:
            await super().ensure_connection(connection)
            return
        async with self.connecting:
            await super().ensure_connection(connection)


class _BlockingPool(_Pool, redis.BlockingConnectionPool):
    """A :class:`_Pool` where a command waits for a free connection past ``size``."""


def pooled(url: str, size: int, options: dict[str, Any], connecting: asyncio.Semaphore,
            *, blocking: bool = True) -> redis.Redis:
    """A client of ``size`` connections to ``url``; ``blocking``: a command waits for a
    free one (up to six socket timeouts: a Redis that takes no connection fails them)
    rather than opening one more."""
    pool: _Pool
    if blocking:
        pool = _BlockingPool.from_url(
            url, max_connections=size, timeout=6 * options["socket_timeout"], **options
        )
    else:
        pool = _Pool.from_url(url, max_connections=size, **options)
    pool.connecting = connecting
    return redis.Redis.from_pool(pool)
