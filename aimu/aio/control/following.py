"""Following a run's events (:meth:`RedisControl.events`): from this process's worker
when it publishes the run (each event handed on as Redis appended it, Redis read only to
catch up), else from Redis in ``XREAD BLOCK``; one cursor across both."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, Final

from aimu.aio.control.feed import Feed
from aimu.aio.control.info import RunEvent
from aimu.aio.control.worker import stream_id
from aimu.aio.errors import ControlError, RunLostError
from aimu.aio.event_json import decode_event
from aimu.aio.status import ENDED

if TYPE_CHECKING:
    from aimu.aio.control.keys import Keys
    from aimu.aio.control.worker import Worker

__all__ = ["FOLLOW_COUNT", "IDLE_BLOCK_MS", "Cursor", "Following"]

#: Events one read of a run's stream takes at most.
FOLLOW_COUNT: Final = 512
#: How long a follower waits in one XREAD BLOCK before it checks that its run is still
#: there (at most half the socket timeout, which a longer read would pass). Each read
#: and check costs the follower's process CPU: at 1 s, 1,000 quiet followers took most
#: of a loaded core, and the runs they followed stalled (issue 35: 804 of 1,000 showed
#: no text in 300 s).
IDLE_BLOCK_MS: Final = 2500
#: The largest stream id: nothing comes after it (and XRANGE refuses to start past it).
_LAST_ID: Final = (2**64 - 1, 2**64 - 1)


class Following:
    """:class:`~aimu.aio.control.RedisControl`'s reading of a run's events."""

    if TYPE_CHECKING:  # RedisControl's
        url: str
        lease: float
        timeout: float
        max_events: int
        _keys: Keys
        _worker: Worker | None

        async def status(self, run_id: str) -> Any: ...
        def _errors(
            self, what: str, run_id: str | None = None
        ) -> contextlib.AbstractContextManager[None]: ...
        async def _range(self, run_id: str, key: str, cursor: str) -> list[Any]: ...
        async def _read(
            self, run_id: str, key: str, cursor: str, block: int | None
        ) -> list[Any]: ...
        async def _standing(self, run_id: str) -> tuple[str, str | None]: ...
        def _running_here(self, run_id: str) -> bool: ...

    async def _follow(self, run_id: str, after: str | None) -> AsyncIterator[RunEvent]:
        await self.status(run_id)  # UnknownRunError before the first event
        cursor = Cursor(after)
        feed = None if self._worker is None else self._worker.subscribe(run_id)
        if feed is not None:
            try:
                async with contextlib.aclosing(self._follow_here(run_id, feed, cursor)) as here:
                    async for event in here:
                        yield event
            finally:
                feed.close()
            if cursor.finished:
                return
        async with contextlib.aclosing(self._follow_redis(run_id, cursor)) as there:
            async for event in there:
                yield event

    def _take(self, run_id: str, cursor: Cursor, entry_id: str, seq: int, kind: str,
              data: str) -> RunEvent:
        """Event ``seq`` of the stream, after ``cursor`` (moved past it); ControlError if
        the events between were trimmed away."""
        if cursor.expected is not None and seq != cursor.expected:
            raise ControlError(
                f"run {run_id!r}: events {cursor.expected} to {seq - 1} are gone (the stream "
                f"keeps about {self.max_events}); follow sooner or raise max_events",
                url=self.url,
            )
        cursor.move(entry_id, seq, kind)
        return RunEvent(entry_id, seq, decode_event(kind, data), data)

    async def _follow_here(
        self, run_id: str, feed: Feed, cursor: Cursor
    ) -> AsyncGenerator[RunEvent, None]:
        """The events of a run this control's worker publishes, as it hands them to
        ``feed``: Redis is read only to catch up (what came before the feed, or while it
        could not be trusted). Ends after the end, or (``cursor.finished`` unset) once the
        run is no longer published here or Redis says it ended or was lost without it:
        the Redis path goes on from ``cursor`` and judges that as it always does."""
        key = self._keys.events(run_id)
        quiet = self._idle_block_ms() / 1000
        while not feed.detached:
            if feed.stale:
                # Redis holds every event whose batch was answered before this point; the
                # feed is handed every one answered after it (the cursor skips repeats).
                feed.stale = False
                more = cursor.order < _LAST_ID
                while more:
                    entries = await self._range(run_id, key, cursor.id)
                    more = len(entries) == FOLLOW_COUNT
                    for entry_id, fields in entries:
                        yield self._take(run_id, cursor, entry_id, int(fields.get("seq", 0)),
                                         fields["type"], fields["data"])
                        if cursor.finished:
                            return
                continue
            if feed.items:
                item = feed.items.popleft()
                if stream_id(item.id) > cursor.order:
                    yield self._take(run_id, cursor, item.id, item.seq, item.type, item.data)
                    if cursor.finished:
                        return
                continue
            if await feed.wait(quiet):
                continue
            # Quiet a while: is the run still there to wait for (and Redis with it)?
            status, _ = await self._standing(run_id)
            if status in ENDED or (status == "lost" and not self._running_here(run_id)):
                return

    def _idle_block_ms(self) -> int:
        return max(1, min(IDLE_BLOCK_MS, int(self.timeout * 500)))

    async def _follow_redis(
        self, run_id: str, cursor: Cursor
    ) -> AsyncGenerator[RunEvent, None]:
        """The run's events after ``cursor`` read from Redis, waiting in XREAD BLOCK."""
        key = self._keys.events(run_id)
        idle_checks = 0
        block = self._idle_block_ms()
        loop = asyncio.get_running_loop()
        lost_since: float | None = None
        while True:
            entries = await self._read(run_id, key, cursor.id, block if idle_checks == 0 else None)
            for entry_id, fields in entries:
                yield self._take(run_id, cursor, entry_id, int(fields.get("seq", 0)),
                                 fields["type"], fields["data"])
                if cursor.finished:
                    return
            if entries:
                idle_checks, lost_since = 0, None
                continue
            # Nothing new for a while: is the run still there to wait for? A lease that
            # lapsed is renewed late by a worker too busy to keep it (issue 35: 1,000
            # runs on a loaded machine), so only a run lost a whole lease more is gone.
            status, worker = await self._standing(run_id)
            if status == "lost" and self._running_here(run_id):
                status = "running"  # this process runs it: its lease is only late
            if status == "lost":
                lost_since = loop.time() if lost_since is None else lost_since
                if loop.time() - lost_since < self.lease:
                    idle_checks = 0
                    continue
                raise RunLostError(
                    f"run {run_id!r} is lost: worker {worker} stopped renewing its lease; "
                    "claim() it to resume from its store",
                    url=self.url,
                )
            if status in ENDED:
                if idle_checks:  # read once more without blocking: its end was not there
                    raise ControlError(
                        f"run {run_id!r} ended {status} but its events after {cursor.id} "
                        "have expired",
                        url=self.url,
                    )
                idle_checks = 1
            else:
                idle_checks, lost_since = 0, None


class Cursor:
    """Where a follower is in a run's stream: the last event id, the seq due next (None
    until the first event after a given id), and whether the end went by."""

    __slots__ = ("expected", "finished", "id", "order")

    def __init__(self, after: str | None) -> None:
        self.id = after or "0-0"
        self.order = stream_id(self.id)
        self.expected: int | None = 1 if after is None else None
        self.finished = False

    def move(self, entry_id: str, seq: int, kind: str) -> None:
        self.id = entry_id
        self.order = stream_id(entry_id)
        self.expected = seq + 1
        self.finished = kind == "handle_finished"
