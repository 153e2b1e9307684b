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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from aimu._hosting import AgentFactory
from aimu.aio._ids import is_event_number
from aimu.aio.agent import Agent
from aimu.aio.errors import ControlError, UnknownRunError
from aimu.aio.run_handle import RunHandle
from aimu.aio.steering import LocalRuns, Steer, send_kept
from aimu.serve.backends.base import (
    KEEPALIVE_SECONDS,
    Batch,
    Decided,
    JSONEvent,
    RunView,
    Verdict,
    no_cancel_error,
)
from aimu.serve.backends.decisions import StoreDecisions
from aimu.serve.backends.launcher import Launcher
from aimu.serve.errors import BadRequest, Conflict, NotFound, ServiceUnavailable, unavailable
from aimu.serve.ids import stream_id

if TYPE_CHECKING:
    from aimu.aio.control import RedisControl, RunInfo
    from aimu.aio.store import Store

__all__ = ["RedisBackend"]

#: Runs started here that this process can still report while Redis is away.
_KEEP_HERE = 1000


class RedisBackend:
    """Runs executing here and registered with ``control``; any run on the same Redis
    (and store) is found, followed and stopped through it."""

    def __init__(self, agents: AgentFactory, store: Store, control: RedisControl) -> None:
        self._store = store
        self._launcher = Launcher(agents, store)
        self._runs_here = LocalRuns(self._launcher.spawn)
        """The runs this process executes, steered here (Redis or not)."""
        self._started_here: OrderedDict[str, tuple[RunView, RunHandle[str]]] = OrderedDict()
        """The latest runs started here, reported from their handles while Redis is away."""
        self._decisions = StoreDecisions(store, agents, self)
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

        def start(run: Any, messages_from: int) -> RunHandle[str]:
            tagged = control.required(
                session=session,
                task="" if task is None else task,
                resume="1" if task is None else "",
                messages_from=str(messages_from),
            )
            return RunHandle.start(run, control=tagged)

        handle = await self._launcher.launch(session, task, agent, start)
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
        await self._at_end(run_id, after)

    async def _at_end(self, run_id: str, after: str | None) -> bool:
        """True if ``after`` is the last event of a finished run (nothing to follow);
        ``BadRequest`` if it is past that event (an id this run never sent)."""
        view = await self.view(run_id)
        start = stream_id(after)
        if start is None or view.live or view.status == "lost":
            return False
        with self._errors("read the run's events", run_id):
            last = await self.control.last_event_id(run_id)
        if last is not None and _stream_order(start) <= _stream_order(last):
            return start == last
        raise BadRequest(f"Last-Event-ID {start!r} is past the last event of run {run_id}")

    async def follow(self, run_id: str, after: str | None) -> AsyncGenerator[Batch, None]:
        """The run's events through Redis, wherever it runs; keep-alives while idle."""
        if after and await self._at_end(run_id, after):
            return
        events = self.control.events(run_id, stream_id(after))
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
                    return  # the server shuts down: the follower reconnects elsewhere
                if pending not in done:
                    yield []
                    continue
                step, pending = pending, None
                try:
                    event = step.result()
                except ControlError as error:  # lost, expired: say so, then end
                    yield [("", {"type": "error", "error": str(error)})]
                    return
                if event is None:
                    return
                data: JSONEvent = json.loads(event.data)
                yield [(event.id, no_cancel_error(data))]
        finally:
            closing.cancel()
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, ControlError):
                    await pending
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

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

    async def decide(self, view: RunView, verdict: Verdict) -> Decided:
        return await self._decisions.decide(view, verdict)

    # -- shutting down ---------------------------------------------------------------

    def begin_shutdown(self) -> None:
        self._closing.set()

    async def drain(self, grace: float) -> None:
        await self._launcher.drain(grace)

    async def aclose(self) -> None:
        self.begin_shutdown()
        await self._launcher.aclose()


async def _next(events: AsyncIterator[Any]) -> Any:
    return await anext(events, None)


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

