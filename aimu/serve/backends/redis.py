"""Runs shared by several server processes through Redis (``aimu serve --redis``).

:class:`RedisBackend` executes the runs started here with a
:class:`~aimu.serve.backends.launcher.Launcher`, each registered with a
:class:`~aimu.aio.RedisControl` before its id is handed out (Redis away: the start
fails at once and the run never starts). Everything else goes through the control, for
the runs of this process as for any other's: a run's record, a session's latest run (one
key per session, so no listing scans the runs kept), following (event ids are the Redis
stream's, the same in every process, so a follower can reconnect to any of them with
``Last-Event-ID``), cancel, interrupt, stop and send; but a request for a run this
process executes is applied here, without Redis: a Stop pressed while Redis is away
still lands (Redis learns how the run ended when it is back), while a request for
another process's run, and any start, answer 503 at once.

A follower of a run whose process died (``kill -9``, a lost host) is carried to the run
a ``--recover`` server goes on with, as with the local backend (why a chain of runs:
:mod:`.local`): every event the dead run's stream holds, a ``run_continued`` event, then
the continuing run's events, and so on. The link is the store's, as locally: a
recovering server records the dead run's end (:func:`~aimu.serve.recovery.resumed_here`)
and starts the session's next run under the session's lock, so that next record is the
continuation. No pointer is written in Redis (a server dying between it and the store's
writes would leave the two disagreeing); the store is read only for a run Redis says
died: its lease lapsed (``lost``), or Redis closed it ``cancelled`` as its session went
on in another run (Redis notes that run, but cannot tell whether it continues this one
or starts a new task: the store's record of how this one ended does). A server does
not start the next run of a session whose latest run Redis still says is live, so no
continuation exists before; and a dead run's stream grows no more (its process is gone;
recovery needs the session lock that process held), so once the follower has its last
event the bridge loses nothing.

Ids: a run's own events keep their Redis stream ids (``MS-SEQ``, every existing id
unchanged); an event of the G-th run continuing it is ``G:MS-SEQ`` (its id in that run's
stream), the ``run_continued`` that introduces it ``G:0-0`` (before any entry, so a
reconnect from it gets that run's whole stream). Ordered by (G, MS, SEQ) they increase
along the chain; a reconnect with any of them walks G links from the followed run and
reads that run's stream after MS-SEQ, in any process. Why not the continuing run's bare
ids: Redis orders ids within one stream only, and the two runs' streams are two (a
failover or a clock step could number the second run's events below the first's); and
the server could not tell which run of the chain an id names without reading them all.
A ``G:`` naming more links than the chain has, or an id past the end of a stream that
grows no more, is a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final

from aimu._hosting import AgentFactory
from aimu.aio._ids import is_event_number
from aimu.aio.agent import Agent
from aimu.aio.control.scripts import WENT_ON
from aimu.aio.errors import ControlError, UnknownRunError
from aimu.aio.run_handle import RunHandle
from aimu.aio.steering import Steer, send_kept
from aimu.serve.backends.base import (
    KEEPALIVE_SECONDS,
    Batch,
    JSONEvent,
    RunView,
    continued_event,
    next_run,
    no_cancel_error,
    resumed_here,
)
from aimu.serve.backends.hosted import HostedBackend
from aimu.serve.errors import BadRequest, Conflict, NotFound, ServiceUnavailable, unavailable
from aimu.serve.ids import chained_stream_id

if TYPE_CHECKING:
    from aimu.aio.control import RedisControl, RunEvent, RunInfo
    from aimu.aio.store import Store

__all__ = ["RedisBackend"]

#: Runs started here that this process can still report while Redis is away.
_KEEP_HERE = 1000
#: Seconds between two looks at the store for the run that goes on with a dead one.
CHAIN_POLL_SECONDS: Final = 0.5
#: Before every entry of a Redis stream: the id of a ``run_continued`` event, after
#: which a reconnect gets the continuing run's whole stream.
_BEFORE_ALL: Final = "0-0"
#: The longest chain whose ids a follower may send back (``G:MS-SEQ``, G of 9 digits).
_LAST_GENERATION: Final = 10**9 - 1


class RedisBackend(HostedBackend):
    """Runs executing here and registered with ``control``; any run on the same Redis
    (and store) is found, followed and stopped through it."""

    def __init__(self, agents: AgentFactory, store: Store, control: RedisControl) -> None:
        super().__init__(agents, store)
        self._started_here: OrderedDict[str, tuple[RunView, RunHandle[str]]] = OrderedDict()
        """The latest runs started here, reported from their handles while Redis is away."""
        self.control = control
        self._closing = asyncio.Event()

    @contextlib.contextmanager
    def _errors(self, what: str, run_id: str | None = None) -> Iterator[None]:
        try:
            yield
        except UnknownRunError:
            raise NotFound(f"no run {run_id!r} on any server sharing this Redis") from None
        except ControlError as error:
            raise unavailable(what, error) from None

    # -- starting --------------------------------------------------------------------

    async def start(self, session: str, task: str | None, agent: Agent | None) -> RunView:
        busy = await self._latest_live(session)
        if busy is not None:
            if agent is not None:
                await agent.aclose()
            raise Conflict(
                f"session {session!r} has a run in progress ({busy.run_id}); stop it or wait"
            )
        control = self.control
        launch = await self._launcher.open(session, task, agent)
        tagged = control.required(
            session=session,
            task="" if task is None else task,
            resume="1" if task is None else "",
            messages_from=str(launch.messages_from),
        )
        handle = await self._launcher.start(launch, control=tagged)
        self._runs_here.add(handle)
        self._remember(handle, session, task)
        # Every process must find the run before its id is handed out.
        try:
            with self._errors("start the run"):
                run_id = await control.registered(handle)
        except ServiceUnavailable:
            await self._launcher.settled(handle)  # it never started; its session is free
            raise
        await self._launcher.accepted(handle)
        return await self.view(run_id)

    def _remember(self, handle: RunHandle[str], session: str, task: str | None) -> None:
        run_id = handle.run_id
        assert run_id is not None
        self._started_here[run_id] = (RunView(run_id, session, task, created_at=time.time()),
                                      handle)
        while len(self._started_here) > _KEEP_HERE:
            self._started_here.popitem(last=False)

    def _view_here(self, run_id: str) -> RunView | None:
        """Run ``run_id`` as this process knows it (started here), without Redis."""
        here = self._started_here.get(run_id)
        if here is None:
            return None
        view, handle = here
        return dataclasses.replace(view, status=handle.status, reason=handle.reason)

    async def _latest_live(self, session: str) -> RunView | None:
        latest = (await self.latest([session])).get(session)
        return latest if latest is not None and latest.live else None

    # -- reading ---------------------------------------------------------------------

    async def view(self, run_id: str) -> RunView:
        try:
            with self._errors("read the run", run_id):
                return _view(await self.control.status(run_id))
        except ServiceUnavailable:
            here = self._view_here(run_id)  # Redis away: a run of this process is known
            if here is None:
                raise
            return here

    async def latest(
        self, sessions: Sequence[str], *, live: bool = False
    ) -> dict[str, RunView]:
        with self._errors("read the sessions' runs"):
            found = await self.control.latest(sessions)
        return {name: _view(info) for name, info in found.items()}

    async def check_follow(self, run_id: str, after: str | None) -> None:
        generation, start = chained_stream_id(after)
        view = await self._chain(run_id, generation, after)
        await self._within(view, start, await self._continuation(view))

    async def _chain(self, run_id: str, generation: int, after: str | None) -> RunView:
        """The run ``generation`` continuations after run ``run_id``'s (0: itself);
        ``BadRequest`` if the chain is shorter (an id this run's stream never sent)."""
        view = await self.view(run_id)
        for _ in range(generation):
            later = await self._continuation(view)
            if not isinstance(later, tuple):
                raise BadRequest(
                    f"Last-Event-ID {after!r} is not an event of run {run_id}'s stream (no "
                    "run continues it that far)"
                )
            view = later[0]
        return view

    async def _continuation(self, view: RunView) -> tuple[RunView, JSONEvent] | bool:
        """The run that continues ``view``'s and the event that says so, if its process
        died and a recovering server resumed its session; True while that run is to come
        (the dead run's end is recorded, its successor not yet); False if it did not die
        so. The store is read only for a run Redis says died (:func:`_died`)."""
        if not _died(view):
            return False
        with self._errors("read the run's continuation", view.run_id):
            stored = await self._store.run(view.run_id)
            if stored is None or not resumed_here(stored.status, stored.reason):
                return False
            later = await next_run(self._store, stored.session, stored.id)
        if later is None:
            return True
        continued = await self.view(later.id)
        return continued, continued_event(view.run_id, stored.reason, continued.run_id,
                                          continued.messages_from)

    async def _within(
        self, view: RunView, start: str | None, continued: tuple[RunView, JSONEvent] | bool
    ) -> bool:
        """True if ``start`` is the last event of ``view``'s run once its stream can grow
        no more (it ended, or it died and another run continues it): nothing of it is left
        to follow; ``BadRequest`` if ``start`` is past that event (an id it never sent)."""
        final = not (view.live or _died(view)) or isinstance(continued, tuple)
        if start is None or not final:
            return False
        with self._errors("read the run's events", view.run_id):
            last = await self.control.last_event_id(view.run_id)
        if last is not None and _stream_order(start) <= _stream_order(last):
            return start == last
        raise BadRequest(
            f"Last-Event-ID {start!r} is past the last event of run {view.run_id}"
        )

    async def follow(self, run_id: str, after: str | None) -> AsyncGenerator[Batch, None]:
        """The run's events through Redis, wherever it runs; keep-alives while idle. If
        its process died and a recovering server resumed its session, a ``run_continued``
        event, then the events of the run that continues it (and so on): the module's
        docstring says how their ids go on."""
        generation, start = chained_stream_id(after)
        view = await self._chain(run_id, generation, after)
        while True:
            later: list[tuple[RunView, JSONEvent]] = []
            async for batch in self._run_events(view, start, later):
                yield [(_chained(generation, i), event) for i, event in batch]
            if not later:
                return
            generation += 1
            if generation > _LAST_GENERATION:
                return  # ids would pass what a follower may send back
            (view, bridge), start = later[0], None
            yield [(f"{generation}:{_BEFORE_ALL}", bridge)]

    async def _run_events(
        self, view: RunView, start: str | None, later: list[tuple[RunView, JSONEvent]]
    ) -> AsyncGenerator[Batch, None]:
        """The events of ``view``'s run after ``start``; if the run died and another
        continues it, every event its stream holds, then that run and its bridge put in
        ``later``."""
        continued = await self._continuation(view)
        if await self._within(view, start, continued):
            if isinstance(continued, tuple):
                later.append(continued)
            return
        final = None  # the last event of a dead run's stream, which grows no more
        if isinstance(continued, tuple):
            with self._errors("read the run's events", view.run_id):
                final = await self.control.last_event_id(view.run_id)
            if final is None:  # none kept
                later.append(continued)
                return
        failed: ControlError | None = None
        paced = self._paced(self.control.events(view.run_id, start))
        async with contextlib.aclosing(paced):
            try:
                async for event in paced:
                    if event is None:  # a quiet while (a run that died raises, below)
                        yield []
                        continue
                    start = event.id
                    yield [(event.id, no_cancel_error(json.loads(event.data)))]
                    if isinstance(continued, tuple) and event.id == final:
                        later.append(continued)
                        return
            except ControlError as error:
                # Lost a lease long, closed (its session went on) without its end, or
                # expired: the reads of a quiet run's events find each within seconds.
                failed = error
        if failed is not None:
            async for batch in self._carried_or_failed(view.run_id, start, later, failed):
                yield batch

    async def _paced(
        self, events: AsyncIterator[RunEvent]
    ) -> AsyncGenerator[RunEvent | None, None]:
        """``events`` as they come, and None after each quiet ``KEEPALIVE_SECONDS``; they
        end with their end, or when the server shuts down (the follower reconnects
        elsewhere). A failure to read them is raised."""
        closing = asyncio.ensure_future(self._closing.wait())
        pending: asyncio.Task[Any] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(_next(events))
                done, _ = await asyncio.wait(
                    (pending, closing),
                    timeout=KEEPALIVE_SECONDS,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if closing in done:
                    return
                if pending not in done:
                    yield None
                    continue
                step, pending = pending, None
                event = step.result()
                if event is None:
                    return
                yield event
        finally:
            closing.cancel()
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, ControlError):
                    await pending
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _carried_or_failed(
        self, run_id: str, seen: str | None, later: list[tuple[RunView, JSONEvent]],
        error: ControlError,
    ) -> AsyncGenerator[Batch, None]:
        """After reading run ``run_id``'s events failed with ``error``: if its process
        died, wait (keep-alives) while a recovering server goes on with it, until the run
        that continues it is recorded (put in ``later``: the follower saw every event of
        the dead run, ``seen`` the last); else, or if none is going on with it, an
        ``error`` event (a reconnect once one has is carried on)."""
        quiet = 0.0
        while not self._closing.is_set():
            try:
                continued = await self._continuation(await self.view(run_id))
                if isinstance(continued, tuple) and await self._seen_all(run_id, seen):
                    later.append(continued)
                    return
            except (NotFound, ServiceUnavailable):
                continued = False
            if continued is not True:  # not to come: it did not die so, or events are gone
                yield [("", {"type": "error", "error": str(error)})]
                return
            if quiet >= KEEPALIVE_SECONDS:
                yield []
                quiet = 0.0
            await asyncio.sleep(CHAIN_POLL_SECONDS)
            quiet += CHAIN_POLL_SECONDS

    async def _seen_all(self, run_id: str, seen: str | None) -> bool:
        """True if ``seen`` is the last event run ``run_id``'s stream holds (or it holds
        none)."""
        with self._errors("read the run's events", run_id):
            last = await self.control.last_event_id(run_id)
        return last is None or (seen is not None and _stream_order(seen) >= _stream_order(last))

    # -- control ---------------------------------------------------------------------

    async def request(self, run_id: str, request: Steer) -> None:
        what = "send to" if request.kind == "send" else request.kind
        here = self._runs_here.holds(run_id)  # this process runs it: no Redis needed

        async def deliver(steer: Steer) -> bool:
            if here:
                return await self._runs_here.request(run_id, steer)
            # Answered once the run took it: a Redis that dies (and comes back empty)
            # right after cannot lose an accepted Stop.
            return await self.control.request(run_id, steer, taken=True)

        with self._errors(what, run_id):
            if request.kind == "send":  # kept in the shared store first: any process joins it
                session = (await self.view(run_id)).session
                accepted = await send_kept(self._store, session, request, deliver)
            else:
                accepted = await deliver(request)
        if here and not accepted:
            raise Conflict(f"run {run_id} is ending (being cancelled): nothing to {what}")
        if not accepted:
            view = await self.view(run_id)
            raise Conflict(f"run {run_id} already ended ({view.status}): nothing to {what}")

    # -- shutting down ---------------------------------------------------------------

    def begin_shutdown(self) -> None:
        self._closing.set()


async def _next(events: AsyncIterator[Any]) -> Any:
    return await anext(events, None)


def _died(view: RunView) -> bool:
    """True if Redis says ``view``'s process died: its lease lapsed (``lost``), or it
    was closed so when its session went on in another run."""
    return view.status == "lost" or (
        view.status == "cancelled" and (view.reason or "").startswith(WENT_ON)
    )


def _chained(generation: int, event_id: str) -> str:
    """The id a follower is given for event ``event_id`` of the ``generation``-th run of
    a chain (0: the followed run's own, its bare stream id)."""
    return f"{generation}:{event_id}" if generation and event_id else event_id


def _stream_order(event_id: str) -> tuple[int, int]:
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq)


def _view(info: RunInfo) -> RunView:
    """A run as the API reports it, from what Redis knows of it."""
    extra = info.info
    messages_from = extra.get("messages_from") or "0"
    return RunView(
        info.run_id,
        extra.get("session", ""),
        None if extra.get("resume") else extra.get("task"),
        status=info.status,
        created_at=info.created_at or 0.0,
        finished_at=info.ended_at,
        reason=info.reason,
        reply=info.result if isinstance(info.result, str) else None,
        error=info.error,
        usage=info.usage,  # type: ignore[arg-type]
        events=info.events,
        messages_from=int(messages_from) if is_event_number(messages_from) else 0,
    )

