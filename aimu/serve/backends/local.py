"""Runs executing in this process, found and controlled from it (``aimu serve``):
:class:`LocalBackend` launches runs (:mod:`.launcher`), keeps their numbered events
(:mod:`.run_log`) and records decisions in the store (:mod:`.decisions`).

A run this process did not start (its server drained or died, and this one serves the
same store) is *adopted* from its record in the store the first time it is asked about:
``GET /runs/{id}``, its session's latest run, a follow, a decision, a send or a stop find
it as the server that ran it would have, ended as its record says (one
``handle_finished`` event: the events before it lived in that process's memory). A
paused run so adopted is decided and resumed here exactly once, whichever servers sharing
the store are asked: a decision takes the session's write lock and checks, under it, that
the call still waits (:mod:`.decisions`), so of two servers racing, one resumes the run and
the other answers 409 "decided already". A record still ``running`` that no process here
runs is followed from the store until it ends while a process holds its session (it runs
elsewhere, or recovery goes on with it); while none does, it died with its server and no
server went on with it yet: following it answers 404 (the web chat's cue to resume it by a
POST; a GET never revives a run).

A follower of a run whose process died is carried to the run that goes on with it
(:meth:`LocalBackend.follow`): a ``run_continued`` event, then that run's events, their
ids going on increasing. Why a chain of runs and not one run id kept across the death:
the dead run and the one going on are two executions, each with its record (started,
``messages_from``, models, usage, how it ended), and recovery counts deaths in a row by
those records; one id would rewrite the dead run's record and lose them. The link needs
no new field: a recovering server records the dead run's end (:func:`resumed_here`) and
starts the next run of its session under the same lock, so the session's next record is
the run that continues it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Final

from aimu._hosting import AgentFactory
from aimu.aio._event_tap import EventTap
from aimu.aio._ids import new_run_id
from aimu.aio.agent import Agent
from aimu.aio.ends import error_text
from aimu.aio.errors import SessionLockedError
from aimu.aio.event_json import event_data
from aimu.aio.events import Event, HandleFinished, RunFinished
from aimu.aio.run_handle import RunHandle
from aimu.aio.status import LIVE
from aimu.aio.steering import Steer, Steering, send_kept
from aimu.aio.store import RunRecord as StoredRun
from aimu.aio.store import Store
from aimu.serve.backends.base import (
    KEEPALIVE_SECONDS,
    Batch,
    RunView,
    continued_event,
    next_run,
    no_cancel_error,
    resumed_here,
)
from aimu.serve.backends.hosted import HostedBackend
from aimu.serve.backends.run_log import LoggedRun, RunLog
from aimu.serve.errors import BadRequest, Conflict, NotFound
from aimu.serve.ids import event_number

__all__ = ["LocalBackend"]

#: The ids of the events of the n-th run continuing a run begin at n * GENERATION.
GENERATION: Final = 10**9
_LAST_ID: Final = 10**12 - 1
#: Seconds between two reads of the record of a run followed here that no process here
#: runs, until it ends.
STORE_POLL_SECONDS: Final = 0.25


class LocalBackend(RunLog, HostedBackend):
    """Runs executing in this process, found and controlled from this process only."""

    def __init__(self, agents: AgentFactory, store: Store, *, keep_finished: int = 1000) -> None:
        RunLog.__init__(self, keep_finished=keep_finished)
        HostedBackend.__init__(self, agents, store)
        self._steering: Steering = self._runs_here

    async def start(self, session: str, task: str | None, agent: Agent | None) -> RunView:
        try:
            self.check_free(session)
        except Conflict:
            if agent is not None:
                await agent.aclose()
            raise
        view = RunView(new_run_id(), session, task, created_at=time.time())
        launch = await self._launcher.open(session, task, agent)
        view.messages_from = launch.messages_from
        handle = await self._launcher.start(launch, name=f"run {view.run_id}",
                                            run_id=view.run_id)
        record = self.add(view)
        record.handle = handle
        self._runs_here.add(handle)
        view.status = handle.status
        tap = handle.tap(notify=lambda: self._log(record, handle, tap))
        await self._launcher.accepted(handle)
        return view

    # -- runs known from the store -------------------------------------------------------

    async def view(self, run_id: str) -> RunView:
        return (await self._known(run_id)).view

    async def latest(
        self, sessions: Sequence[str], *, live: bool = False
    ) -> dict[str, RunView]:
        """Each session's latest run here, else as the store records it (a run still
        ``running`` there and not here is left out: its process died, or runs it; so
        with ``live`` the store is not read: a run in progress is one of this process)."""
        found: dict[str, RunView] = {}
        for name in sessions:
            here = self.here(name)
            if here is not None:
                found[name] = here.view
                continue
            if live:
                continue
            stored = await self._store.runs(session=name, limit=1)
            if stored and stored[0].status != "running":
                found[name] = (await self._adopted(stored[0])).view
        return found

    async def _known(self, run_id: str) -> LoggedRun:
        """The run here, or adopted from (and brought up to date with) its record."""
        known = self._runs.get(run_id)
        if known is not None and not known.adopted:
            return known
        try:
            stored = await self._store.run(run_id)
        except ValueError:
            stored = None
        if stored is None:
            if known is not None:
                return known
            raise NotFound(f"no run {run_id!r} on this server nor in its store")
        return await self._adopted(stored)

    async def _adopted(self, stored: StoredRun) -> LoggedRun:
        """The record of run ``stored`` here, adopted now if it was not, ended if its
        record says it ended since."""
        known = self._runs.get(stored.id)
        if known is None:
            latest = await self._store.runs(session=stored.session, limit=1)
            known = self._runs.get(stored.id)  # adopted meanwhile
            if known is None:
                is_latest = (self.here(stored.session) is None and bool(latest)
                             and latest[0].id == stored.id)
                return self.adopt(_stored_view(stored), latest=is_latest)
        if known.adopted and not known.ended and stored.status not in LIVE:
            view = known.view
            view.usage = stored.usage  # type: ignore[assignment]
            known.end(stored.status, stored.reason)
        return known

    # -- following, across a death of the process that ran the run -----------------------

    async def _followable(self, run_id: str) -> LoggedRun:
        """The run ``run_id`` to follow; ``NotFound`` for one whose record says running
        while no process holds its session: it died with its server and none went on with
        it yet (a page then resumes it by a POST; a follower reconnects once a
        ``--recover`` server went on with it). Its session is opened and released at once
        to tell: the lock is let go by a process that dies, held by one that runs it."""
        record = await self._known(run_id)
        if not record.adopted or record.ended:
            return record
        try:
            writer = await self._store.open_session(record.view.session)
        except SessionLockedError:
            return record  # a process runs it (or recovery goes on with it now)
        await writer.aclose()
        record = await self._known(run_id)
        if record.ended:
            return record
        raise NotFound(
            f"run {run_id} died with its server and no server has gone on with it yet: "
            "reconnect once one has (aimu serve --recover), or resume its session (POST "
            f"/sessions/{record.view.session}/resume)"
        )

    async def check_follow(self, run_id: str, after: str | None) -> None:
        generation, seen = divmod(event_number(after), GENERATION)
        record = await self._generation(await self._followable(run_id), generation, after)
        if not record.adopted and generation == 0:
            await super().check_follow(run_id, after)
        elif not record.adopted and record.ended and seen > len(record.events):
            raise BadRequest(f"Last-Event-ID {after!r} is past the last event of run {run_id}")

    async def _generation(
        self, record: LoggedRun, generation: int, after: str | None
    ) -> LoggedRun:
        """The run ``generation`` continuations after ``record``'s (0: itself);
        ``BadRequest`` if the chain is shorter (an id this run's stream never sent)."""
        for _ in range(generation):
            later = await self._continuation(record)
            if later is None:
                raise BadRequest(
                    f"Last-Event-ID {after!r} is not an event of run {record.view.run_id}'s "
                    "stream (no run continues it that far)"
                )
            record = later
        return record

    async def _continuation(self, record: LoggedRun) -> LoggedRun | None:
        """The run that continues ``record``'s after its process died (a recovering
        server resumed its session: the session's next run), or None: it did not die so,
        or that run is not recorded yet."""
        view = record.view
        if not record.ended or not resumed_here(view.status, view.reason):
            return None
        newer = await next_run(self._store, view.session, view.run_id)
        return None if newer is None else await self._followable(newer.id)

    async def follow(self, run_id: str, after: str | None) -> AsyncGenerator[Batch, None]:
        """The run's events after ``after``, as :meth:`RunLog.follow`; then, if its
        process died and a recovering server resumed its session, a ``run_continued``
        event and the events of the run that continues it (and so on).

        The ids of a chain stay increasing, so a follower reconnects from its last one
        to any event of the chain: the run's own events are numbered 1, 2, ... as always;
        the n-th run continuing it has ids ``n * GENERATION + i`` (``i``: its own event
        number; 0, the ``run_continued`` that introduces it). A run adopted from the store
        (its process is gone) has no events here but its end, given the id
        ``(n + 1) * GENERATION - 1``: after any id its process sent."""
        generation, seen = divmod(event_number(after), GENERATION)
        record = await self._generation(await self._followable(run_id), generation, after)
        while True:
            base = generation * GENERATION
            if record.adopted:
                ended = await self._adopted_end(record)
                if ended is None:
                    return  # the server shuts down
                if ended:
                    yield ended
                    seen = GENERATION - 1
            else:
                async for batch in self._own(record, seen):
                    if not batch:
                        yield []
                        continue
                    last = int(batch[-1][0])
                    finished = batch[-1][1].get("type") == "handle_finished"
                    if finished and resumed_here(str(batch[-1][1].get("status")),
                                                 batch[-1][1].get("reason")):
                        batch = batch[:-1]  # its end is told by run_continued below
                    if batch:
                        yield [(str(base + int(i)), event) for i, event in batch]
                    seen = last
            if seen < GENERATION - 1 and not record.ended:
                return  # the server shuts down
            later = await self._await_continuation(record)
            if later is None:
                return  # it ended without one (or the server shuts down)
            if isinstance(later, list):
                yield later
                continue
            generation += 1
            if generation * GENERATION > _LAST_ID:
                return  # ids would pass what a follower may send back
            bridge = continued_event(record.view.run_id, record.view.reason,
                                     later.view.run_id, later.view.messages_from)
            yield [(str(generation * GENERATION), bridge)]
            record, seen = later, 0

    async def _own(self, record: LoggedRun, seen: int) -> AsyncGenerator[Batch, None]:
        """The events of a run of this process after ``seen``, each with its number."""
        async for batch in super().follow(record.view.run_id, str(seen) if seen else None):
            yield batch

    async def _adopted_end(self, record: LoggedRun) -> Batch | None:
        """The end of an adopted run, once its record says it ended (polled), unless it
        continues (then ``[]``); None if the server shuts down first."""
        record.followers += 1
        watch = None if record.ended else self._launcher.spawn(self._watch(record))
        try:
            while not record.ended:
                if self._closing.is_set():
                    return None
                await record.changed(STORE_POLL_SECONDS)
        finally:
            record.followers -= 1
            if watch is not None:
                watch.cancel()
        view = record.view
        if resumed_here(view.status, view.reason):
            return []
        return [(str(GENERATION - 1), record.events[-1])]

    async def _await_continuation(self, record: LoggedRun) -> LoggedRun | Batch | None:
        """The run continuing ``record``'s; a keep-alive (``[]``) after a quiet while;
        None if there is none to wait for (or the server shuts down)."""
        if not resumed_here(record.view.status, record.view.reason):
            return None
        waited = 0.0
        while not self._closing.is_set():
            try:
                later = await self._continuation(record)
            except NotFound:  # that run died too, not gone on with yet: wait for it
                later = None
            if later is not None:
                return later
            if waited >= KEEPALIVE_SECONDS:
                return []
            await asyncio.sleep(STORE_POLL_SECONDS)
            waited += STORE_POLL_SECONDS
        return None

    async def _watch(self, record: LoggedRun) -> None:
        while not record.ended:
            await asyncio.sleep(STORE_POLL_SECONDS)
            await self._known(record.view.run_id)

    # -- the runs executing here -------------------------------------------------------

    def _log(self, record: LoggedRun, handle: RunHandle[str], tap: EventTap) -> None:
        """Add what the run's tap holds to its log; its end after the handle's done
        callbacks (the launcher's release of the session among them)."""
        for event in tap.take():
            if isinstance(event, HandleFinished):
                asyncio.get_running_loop().call_soon(self._finished, record, handle)
            else:
                self._on_event(record, event)

    def _on_event(self, record: LoggedRun, event: Event) -> None:
        view = record.view
        if view.status == "pending":
            view.status = "running"
        if isinstance(event, RunFinished):
            view.reply, view.error = event.reply, event.error
            view.usage = dict(event.usage)  # type: ignore[assignment]
        record.add(no_cancel_error(event_data(event)))

    def _finished(self, record: LoggedRun, handle: RunHandle[str]) -> None:
        error = None
        if record.view.error is None and handle.status == "failed":
            failure = handle.exception()
            error = None if failure is None else error_text(failure)
        record.end(handle.status, handle.reason, error)

    async def request(self, run_id: str, request: Steer) -> None:
        record = await self._known(run_id)
        kind = request.kind
        what = "send to" if kind == "send" else kind
        if record.adopted and not record.ended:
            raise Conflict(
                f"run {run_id} is not run by this server: its record says running (its "
                "server died, and --recover goes on with it; or a server sharing the store "
                f"without Redis runs it): nothing to {what} here"
            )
        if record.ended or record.handle is None:
            raise Conflict(
                f"run {run_id} already ended ({record.view.status}): nothing to {what}"
            )
        if kind == "send":  # in the store before it is answered (DESIGN invariant 6)
            taken = await send_kept(self._store, record.view.session, request,
                                    lambda kept: self._steering.request(run_id, kept))
        else:
            taken = await self._steering.request(run_id, request)
        if not taken and kind == "interrupt":
            raise Conflict(f"run {run_id} is being cancelled already: nothing to interrupt")
        if not taken and kind == "send":
            raise Conflict(
                f"run {run_id} is ending (being cancelled): the text was not sent; "
                "start a new run with it"
            )


def _stored_view(stored: StoredRun) -> RunView:
    """A run as its record in the store tells it (its task and reply are in its
    session's transcript, not in the record)."""
    return RunView(
        stored.id, stored.session, None, status=stored.status, created_at=stored.started,
        finished_at=stored.ended, reason=stored.reason,
        usage=None if stored.usage is None else dict(stored.usage),  # type: ignore[arg-type]
        messages_from=stored.messages_from or 0,
    )
