"""Runs executing in this process: the :class:`Launcher` that starts them, the
:class:`RunLog` that keeps and numbers the events of runs followed here, and
:class:`LocalBackend`, both together (``aimu serve``).

Each run opens its session from the store (its write lock taken), writes every message
durably as the agent records it, and closes the session when it ends, so the next run on
that session may execute in another process sharing the store. Every event a local run
emits is kept in order and numbered from 1 (its SSE id), ending with one
``handle_finished``, so a follower that connects late or reconnects with the last id it
saw misses nothing and sees nothing twice; a follower going away never touches the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from typing import Any, Final

from aimu.aio.agent import Agent
from aimu.aio.event_json import event_data
from aimu.aio.events import Event, RunFinished
from aimu.aio.run_handle import RunHandle
from aimu.aio.store import Store
from aimu.serve.decisions import StoreDecisions
from aimu.serve.errors import BadRequest, Conflict, NotFound
from aimu.serve.ids import event_number
from aimu.serve.runs import (
    KEEPALIVE_SECONDS,
    AgentFactory,
    Batch,
    Decided,
    JSONEvent,
    Request,
    RunView,
    no_cancel_error,
    open_agent,
)

__all__ = ["Launcher", "LocalBackend", "RunLog", "RunRecord", "ended"]

_RUN_ID_BYTES: Final = 18  # 144 bits: unguessable, so a run id is a capability

#: Starts the run's coroutine under a handle, given how many messages the session held.
StartHandle = Callable[[Coroutine[Any, Any, str], int], RunHandle[str]]


class Launcher:
    """Starts runs of sessions in this process and stops them all on :meth:`aclose`."""

    def __init__(self, agents: AgentFactory) -> None:
        self._agents = agents
        self._handles: set[RunHandle[str]] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self._releasing: dict[RunHandle[str], asyncio.Task[Any]] = {}

    async def launch(
        self, session: str, task: str | None, agent: Agent | None, start: StartHandle
    ) -> RunHandle[str]:
        """Run ``task`` (None: resume) of ``session`` under ``start``'s handle; the session
        is released when the run ends. ``SessionLockedError`` if a writer elsewhere holds
        it (serve answers 409), ``Conflict`` if there is nothing to resume."""
        if agent is None:
            agent = await open_agent(self._agents, session)
        try:
            run = agent.resume() if task is None else agent.run(task)
        except ValueError as error:  # nothing to resume; calls still wait for a decision
            await agent.aclose()
            raise Conflict(f"session {session!r}: {error}") from error
        except BaseException:
            await agent.aclose()
            raise
        started = False

        async def closing() -> str:
            nonlocal started
            started = True
            try:
                return await run
            finally:
                await agent.aclose()

        def on_done(handle: RunHandle[str]) -> None:
            self._handles.discard(handle)
            if not started:  # cancelled before it began: release the session here
                run.close()
                self._releasing[handle] = self.spawn(agent.aclose())

        body = closing()
        try:
            handle = start(body, len(agent.model_client.messages))
        except BaseException:  # never started: release the session here
            body.close()
            run.close()
            await agent.aclose()
            raise
        self._handles.add(handle)
        handle.add_done_callback(on_done)
        return handle

    async def settled(self, handle: RunHandle[str]) -> None:
        """Wait until ``handle`` ended and its session was released."""
        await ended(handle)
        release = self._releasing.pop(handle, None)
        if release is not None:
            await release

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def aclose(self) -> None:
        """Cancel the runs in progress (their transcripts are kept) and wait for them."""
        handles = [h for h in self._handles if not h.done]
        for handle in handles:
            handle.cancel("the server is shutting down")
        for task in list(self._background):
            task.cancel()
        pending: list[Any] = [*self._background, *(ended(h) for h in handles)]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


@dataclasses.dataclass(eq=False)
class RunRecord:
    """A run of this process: what the API reports, and its numbered event log."""

    view: RunView
    handle: RunHandle[str] | None = None
    """Its handle, when it executes in this process."""
    events: list[JSONEvent] = dataclasses.field(default_factory=list)
    ended: bool = False
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
        self._runs: OrderedDict[str, RunRecord] = OrderedDict()
        self._latest: dict[str, RunRecord] = {}
        """session -> its latest run here."""
        self._closing = asyncio.Event()

    def check_free(self, session: str) -> None:
        """``Conflict`` if ``session``'s latest run here is still going."""
        busy = self._latest.get(session)
        if busy is not None and not busy.ended:
            raise Conflict(
                f"session {session!r} has a run in progress ({busy.view.run_id}); stop it or wait"
            )

    def add(self, view: RunView) -> RunRecord:
        """Keep ``view`` as its session's latest run; its record, to add events to."""
        record = RunRecord(view)
        self._runs[view.run_id] = self._latest[view.session] = record
        latest = {id(r) for r in self._latest.values()}
        old = [r for r in self._runs.values() if r.ended and id(r) not in latest]
        for forgotten in old[: max(0, len(old) - self._keep_finished)]:
            del self._runs[forgotten.view.run_id]
        return record

    def record(self, run_id: str) -> RunRecord:
        record = self._runs.get(run_id)
        if record is None:
            raise NotFound(f"no run {run_id!r} on this server (finished long ago, or never)")
        return record

    async def view(self, run_id: str) -> RunView:
        return self.record(run_id).view

    async def latest(self, sessions: Sequence[str]) -> dict[str, RunView]:
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

    def begin_shutdown(self) -> None:
        self._closing.set()
        for record in self._runs.values():
            record.wake()


class LocalBackend(RunLog):
    """Runs executing in this process, found and controlled from this process only."""

    def __init__(self, agents: AgentFactory, store: Store, *, keep_finished: int = 1000) -> None:
        super().__init__(keep_finished=keep_finished)
        self._launcher = Launcher(agents)
        self._decisions = StoreDecisions(store, agents, self)

    async def start(self, session: str, task: str | None, agent: Agent | None) -> RunView:
        try:
            self.check_free(session)
        except Conflict:
            if agent is not None:
                await agent.aclose()
            raise
        view = RunView(secrets.token_urlsafe(_RUN_ID_BYTES), session, task, created_at=time.time())

        def start(run: Coroutine[Any, Any, str], messages_from: int) -> RunHandle[str]:
            view.messages_from = messages_from
            return RunHandle.start(run, name=f"run {view.run_id}", run_id=view.run_id)

        handle = await self._launcher.launch(session, task, agent, start)
        record = self.add(view)
        record.handle = handle
        view.status = handle.status
        handle.scope.add_listener(lambda event: self._on_event(record, event))
        handle.add_done_callback(lambda done: self._finished(record, done))
        return view

    def _on_event(self, record: RunRecord, event: Event) -> None:
        view = record.view
        if view.status == "pending":
            view.status = "running"
        if isinstance(event, RunFinished):
            view.reply, view.error = event.reply, event.error
            view.usage = dict(event.usage)  # type: ignore[assignment]
        record.add(no_cancel_error(event_data(event)))

    def _finished(self, record: RunRecord, handle: RunHandle[str]) -> None:
        error = None
        if record.view.error is None and handle.status == "failed":
            failure = handle.exception()
            error = None if failure is None else f"{type(failure).__name__}: {failure}"
        record.end(handle.status, handle.reason, error)

    async def request(self, run_id: str, request: Request) -> None:
        record = self.record(run_id)
        kind, handle = request.kind, record.handle
        what = "send to" if kind == "send" else kind
        if record.ended or handle is None:
            raise Conflict(
                f"run {run_id} already ended ({record.view.status}): nothing to {what}"
            )
        if kind == "cancel":
            handle.cancel(request.value if isinstance(request.value, str) else None)
        elif kind == "interrupt":
            if not handle.interrupt():
                raise Conflict(f"run {run_id} is being cancelled already: nothing to interrupt")
        elif kind == "stop":
            grace = request.value if isinstance(request.value, float | int) else 5.0
            self._launcher.spawn(handle.stop(float(grace)))
        elif not handle.send(str(request.value), images=request.images):
            raise Conflict(
                f"run {run_id} is ending (being cancelled): the text was not sent; "
                "start a new run with it"
            )

    async def decide(
        self, view: RunView, call_id: str, approve: bool, reason: str | None
    ) -> Decided:
        return await self._decisions.decide(view, call_id, approve, reason)

    async def aclose(self) -> None:
        self.begin_shutdown()
        await self._launcher.aclose()


async def ended(handle: RunHandle[Any]) -> None:
    """Wait until ``handle`` ends, whatever ended it (its outcome is not ours to raise)."""
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def settle(_: object) -> None:
        if not ended.done():
            ended.set_result(None)

    handle.add_done_callback(settle)
    await ended
