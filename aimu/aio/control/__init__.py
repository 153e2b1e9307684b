"""Run control across processes and hosts, on Redis (the ``aimu-agents[redis]`` extra).

:class:`RedisControl` registers runs started with ``RunHandle.start(coro,
control=control)`` and cancels, interrupts, stops, inspects and follows them from any
process that reaches the same Redis.
"""

from __future__ import annotations

from aimu.aio.control.redis_control import ControlStatus, RedisControl, RunEvent, RunInfo

__all__ = ["ControlStatus", "RedisControl", "RunEvent", "RunInfo"]
