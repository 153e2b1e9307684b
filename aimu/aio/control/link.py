"""What a control's worker needs of Redis: one small handle, not the control's insides.

:class:`Link` holds the client, the keys under the prefix, the registered scripts and
the settings (lease, retention, the events kept) of one :class:`RedisControl`; the
worker reads nothing else of the control.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as redis
from redis.commands.core import AsyncScript

from aimu.aio.control import scripts
from aimu.aio.control.keys import Keys

__all__ = ["Link", "Scripts"]


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
