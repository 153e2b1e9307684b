"""A run's events handed, as Redis appended them, to its followers in the same process.

The worker that publishes a run knows each event's stream id and seq once its batch is
appended; a follower in that process subscribes a :class:`Feed` and takes them from
there, reading Redis only to catch up (what was published before it subscribed, or while
its feed could not keep up), never once per event. A feed is ``stale`` until its
follower caught up, and ``detached`` once the run is no longer published here (its
follower goes on through Redis from where it is).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Final, NamedTuple

__all__ = ["LIMIT", "Feed", "Published"]

#: Events a feed holds for a follower that does not keep up; past that it drops them and
#: the follower catches up from Redis (so a stalled consumer costs no memory here).
LIMIT: Final = 2048


class Published(NamedTuple):
    """One event as Redis appended it to the run's stream."""

    id: str
    seq: int
    type: str
    data: str


class Feed:
    """One follower's share of a run's published events, in stream order."""

    __slots__ = ("_feeds", "_news", "detached", "items", "stale")

    def __init__(self, feeds: set[Feed]) -> None:
        self.items: deque[Published] = deque()
        self.stale = True
        """Read Redis from the follower's cursor before trusting ``items`` (at first:
        what was published before it subscribed)."""
        self.detached = False
        self._news = asyncio.Event()
        self._feeds = feeds
        feeds.add(self)

    def put(self, published: list[Published]) -> None:
        if len(self.items) + len(published) > LIMIT:
            self.items.clear()
            self.stale = True
        else:
            self.items.extend(published)
        self._news.set()

    def catch_up(self) -> None:
        """Some events may never come here (a batch whose answer was lost): re-read Redis."""
        self.stale = True
        self._news.set()

    def detach(self) -> None:
        """The run is no longer published here: its follower goes on through Redis."""
        self.detached = True
        self.items.clear()
        self._feeds.discard(self)
        self._news.set()

    def close(self) -> None:
        """The follower is done: nothing more is handed to it."""
        self._feeds.discard(self)

    async def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for news; False if none came."""
        if self.items or self.stale or self.detached:
            return True
        self._news.clear()
        try:
            async with asyncio.timeout(seconds):
                await self._news.wait()
        except TimeoutError:
            return False
        return True
