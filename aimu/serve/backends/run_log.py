"""The runs a server process follows: :class:`RunLog` keeps each run's view and its
numbered events (:class:`LoggedRun`). Every event a run emits is kept in order and
numbered from 1 (its SSE id), ending with one ``handle_finished``, so a follower that
connects late or reconnects with the last id it saw misses nothing and sees nothing
twice; a follower going away never touches the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Sequence

from aimu.aio.run_handle import RunHandle
from aimu.aio.status import LIVE
from aimu.serve.backends.base import KEEPALIVE_SECONDS, Batch, JSONEvent, RunView, no_cancel_error
from aimu.serve.errors import BadRequest, Conflict, NotFound
from aimu.serve.ids import event_number

__all__ = ["LoggedRun", "RunLog"]


@dataclasses.dataclass(eq=False)
class LoggedRun:
    """A run of this process: what the API reports, and its numbered event log."""

    view: RunView
    handle: RunHandle[str] | None = None
    """Its handle, when it executes in this process."""
    events: list[JSONEvent] = dataclasses.field(default_factory=list)
    ended: bool = False
    followers: int = 0
    """How many follow it now."""
    adopted: bool = False
    """Known from the store, not run here: a run of a process before this one (or of
    another process sharing the store), its end read from its record."""
    _waiters: list[asyncio.Future[None]] = dataclasses.field(default_factory=list)

    def add(self, event: JSONEvent) -> None:
        self.events.append(event)
        self.view.events = len(self.events)
        self.wake()

    def end(
        self, status: str, reason: str | None, error: str | None = None, *, add: bool = True
    ) -> None:
        """The run ended: note how, and add its ``handle_finished`` (unless ``add`` is
        False: the events had it)."""
        view = self.view
        view.status, view.reason, view.finished_at = status, reason, time.time()
        view.error = view.error or error
        self.ended = True
        if not add:
            self.wake()
            return
        self.add(
            no_cancel_error({
                "type": "handle_finished",
                "name": f"run {view.run_id}",
                "status": status,
                "reason": reason,
                "result": view.reply,
                "error": view.error,
            })
        )

    def watched(self) -> bool:
        """True while somebody follows this run."""
        return self.followers > 0

    def wake(self) -> None:
        """Wake every follower waiting in :meth:`changed`."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def changed(self, seconds: float) -> bool:
        """Wait until an event is added; False if ``seconds`` passed first."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            done, _ = await asyncio.wait((waiter,), timeout=seconds)
        finally:
            if not waiter.done():
                waiter.cancel()
                self._waiters.remove(waiter)
        return bool(done)


class RunLog:
    """The runs followed by this process: their views, numbered event logs and each
    session's latest run (``keep_finished`` finished runs stay readable, oldest
    forgotten first, never a session's latest)."""

    def __init__(self, *, keep_finished: int = 1000) -> None:
        self._keep_finished = keep_finished
        self._runs: OrderedDict[str, LoggedRun] = OrderedDict()
        self._latest: dict[str, LoggedRun] = {}
        """session -> its latest run here."""
        self._closing = asyncio.Event()

    def check_free(self, session: str) -> None:
        """``Conflict`` if ``session``'s latest run here is still going."""
        busy = self.here(session)
        if busy is not None and not busy.ended:
            raise Conflict(
                f"session {session!r} has a run in progress ({busy.view.run_id}); stop it or wait"
            )

    def add(self, view: RunView) -> LoggedRun:
        """Keep ``view`` as its session's latest run; its record, to add events to."""
        record = LoggedRun(view)
        self._runs[view.run_id] = self._latest[view.session] = record
        latest = {id(r) for r in self._latest.values()}
        old = [r for r in self._runs.values() if r.ended and id(r) not in latest]
        for forgotten in old[: max(0, len(old) - self._keep_finished)]:
            del self._runs[forgotten.view.run_id]
        return record

    def adopt(self, view: RunView, *, latest: bool) -> LoggedRun:
        """Keep ``view``, a run known from the store (not run here), as its session's
        latest run if ``latest``; its record, ended (with its ``handle_finished``) unless
        it still runs."""
        record = LoggedRun(view, adopted=True)
        self._runs[view.run_id] = record
        if latest:
            self._latest[view.session] = record
        if view.status not in LIVE:
            record.end(view.status, view.reason, view.error)
        return record

    def here(self, session: str) -> LoggedRun | None:
        """``session``'s latest run known here, unless it was only read from the store."""
        record = self._latest.get(session)
        return None if record is None or record.adopted else record

    def record(self, run_id: str) -> LoggedRun:
        record = self._runs.get(run_id)
        if record is None:
            raise NotFound(f"no run {run_id!r} on this server (finished long ago, or never)")
        return record

    async def view(self, run_id: str) -> RunView:
        return self.record(run_id).view

    async def latest(
        self, sessions: Sequence[str], *, live: bool = False
    ) -> dict[str, RunView]:
        return {name: self._latest[name].view for name in sessions if name in self._latest}

    async def check_follow(self, run_id: str, after: str | None) -> None:
        self._seen(run_id, after)

    def _seen(self, run_id: str, after: str | None) -> int:
        record = self.record(run_id)
        seen = event_number(after)
        if record.ended and seen > len(record.events):
            raise BadRequest(
                f"Last-Event-ID {after!r} is past the last event of run {run_id} "
                f"({len(record.events)})"
            )
        return seen

    async def follow(self, run_id: str, after: str | None) -> AsyncGenerator[Batch, None]:
        record = self.record(run_id)
        seen = self._seen(run_id, after)
        record.followers += 1
        try:
            while True:
                events = record.events
                if seen < len(events):
                    end = len(events)
                    yield [(str(i), events[i - 1]) for i in range(seen + 1, end + 1)]
                    seen = end
                    continue
                if record.ended or self._closing.is_set():
                    return
                if not await record.changed(KEEPALIVE_SECONDS):
                    yield []
        finally:
            record.followers -= 1

    def begin_shutdown(self) -> None:
        self._closing.set()
        for record in self._runs.values():
            record.wake()

