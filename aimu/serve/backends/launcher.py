"""Runs executing in this process: the :class:`Launcher` opens each run's session from
the store (its write lock taken), runs it under a handle and closes the session when the
run ends, so the next run on that session may execute in another process sharing the
store. The local and Redis backends both launch with it, and hand a run's id out only
once it is :meth:`~Launcher.accepted`: its record stored, so a process that dies after
answering "started" leaves the run for ``--recover``.

A backend calls it downward: :meth:`~Launcher.open` the run (a :class:`Launch`, which
says how many messages the session held before it), then :meth:`~Launcher.start` it
under a handle (with the backend's run control, if it has one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from aimu._hosting import AgentFactory, open_agent
from aimu.aio._tasks import Background, ended
from aimu.aio.agent import Agent
from aimu.aio.errors import SessionLockedError, StoreError
from aimu.aio.events import Event, RunStarted
from aimu.aio.run_handle import RunControl, RunHandle
from aimu.aio.status import RECOVERABLE
from aimu.aio.store import Store
from aimu.serve.errors import Conflict

__all__ = ["Launch", "Launcher"]

_log = logging.getLogger("aimu.serve")


class Launch:
    """A run of a session opened by :meth:`Launcher.open` (its agent holds the
    session's write lock), started by :meth:`Launcher.start`."""

    __slots__ = ("agent", "began", "body", "handle", "messages_from", "run", "session")

    def __init__(self, session: str, agent: Agent, run: Coroutine[Any, Any, str]) -> None:
        self.session = session
        self.agent = agent
        self.run = run
        self.messages_from = len(agent.messages)
        """How many messages the session held before the run."""
        self.body: Coroutine[Any, Any, str]
        """The run's coroutine, releasing the session when it ends."""
        self.began = False
        self.handle: RunHandle[str] | None = None


class Launcher:
    """Starts runs of sessions in this process and stops them all on :meth:`aclose`."""

    def __init__(self, agents: AgentFactory, store: Store | None = None) -> None:
        self._agents = agents
        self._store = store
        self.draining = False
        """Set by :meth:`drain`: a run that ends stopped is marked to be recovered."""
        self._handles: set[RunHandle[str]] = set()
        self._background = Background()
        self._releasing: dict[RunHandle[str], asyncio.Task[Any]] = {}
        self._recorded: dict[RunHandle[str], asyncio.Future[None]] = {}

    async def open(self, session: str, task: str | None, agent: Agent | None) -> Launch:
        """Open the run of ``task`` (None: resume) on ``session`` for :meth:`start`; its
        session is released when the run ends. ``SessionLockedError`` if a writer
        elsewhere holds it (serve answers 409), ``Conflict`` if there is nothing to
        resume. ``agent``: the session's agent, already open; None: open it."""
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
        launch = Launch(session, agent, run)
        launch.body = self._closing(launch)
        return launch

    async def start(
        self, launch: Launch, *, name: str | None = None, run_id: str | None = None,
        control: RunControl | None = None,
    ) -> RunHandle[str]:
        """Start the run :meth:`open` gave under a new handle (``RunHandle.start``'s
        ``name``, ``run_id`` and ``control``)."""
        return await self._begin(launch, lambda: RunHandle.start(
            launch.body, name=name, run_id=run_id, control=control
        ))

    async def _closing(self, launch: Launch) -> str:
        launch.began = True
        try:
            return await launch.run
        finally:
            await launch.agent.aclose()
            if self.draining and launch.handle is not None:
                await self._mark_drained(launch.session, launch.handle.run_id)

    async def _begin(
        self, launch: Launch, make: Callable[[], RunHandle[str]]
    ) -> RunHandle[str]:
        """The handle ``make`` starts ``launch``'s run under, kept until the run ends."""
        try:
            handle = make()
        except BaseException:  # never started: release the session here
            launch.body.close()
            launch.run.close()
            await launch.agent.aclose()
            raise
        launch.handle = handle
        self._handles.add(handle)
        self._recorded[handle] = _recorded(handle)
        handle.add_done_callback(lambda done: self._on_done(launch, done))
        return handle

    def _on_done(self, launch: Launch, handle: RunHandle[str]) -> None:
        self._handles.discard(handle)
        self._recorded.pop(handle, None)
        if not launch.began:  # cancelled before it began: release the session here
            launch.run.close()
            self._releasing[handle] = self.spawn(launch.agent.aclose())

    async def accepted(self, handle: RunHandle[str]) -> None:
        """Wait until the run of ``handle`` (from :meth:`launch`) stored its record
        (``running``, its task in the transcript) or ended without one. A cancel here
        stops the wait only: the run goes on."""
        recorded = self._recorded.pop(handle, None)
        if recorded is not None:
            await recorded

    async def _mark_drained(self, session: str, run_id: str | None) -> None:
        """Mark the record of run ``run_id``, stopped by the drain, to be recovered (its
        ``recover``), if it is still its session's latest: taken under the session's
        write lock, so a server recovering runs sees the mark or a newer run."""
        if run_id is None or self._store is None:
            return
        store = self._store
        try:
            writer = await store.open_session(session)
        except SessionLockedError:
            return  # the session goes on elsewhere already
        except StoreError as error:
            _log.warning("run %s: cannot mark it to be recovered: %s", run_id, error)
            return
        try:
            latest = await store.runs(session=session, limit=1)
            if latest and latest[0].id == run_id and latest[0].status in RECOVERABLE:
                await writer.record_run(dataclasses.replace(latest[0], recover=True))
        except StoreError as error:
            _log.warning("run %s: cannot mark it to be recovered: %s", run_id, error)
        finally:
            await writer.aclose()

    async def drain(self, grace: float) -> None:
        """Interrupt every run here at its next step boundary, wait up to ``grace``
        seconds for them to end, cancel those still going, and wait until each ended and
        its record was marked to be recovered (its session goes on elsewhere)."""
        self.draining = True
        handles = [h for h in self._handles if not h.done]
        for handle in handles:
            handle.interrupt()
        if handles:
            waits = [asyncio.ensure_future(ended(h)) for h in handles]
            try:
                await asyncio.wait(waits, timeout=grace)
            finally:
                for wait in waits:
                    wait.cancel()
        for handle in handles:
            if not handle.done:
                handle.cancel(f"the server shut down: still running {grace:g} s into its drain")
        await asyncio.gather(*(ended(h) for h in handles))

    async def settled(self, handle: RunHandle[str]) -> None:
        """Wait until ``handle`` ended and its session was released."""
        await ended(handle)
        release = self._releasing.pop(handle, None)
        if release is not None:
            await release

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        return self._background.spawn(work)

    async def aclose(self) -> None:
        """Cancel the runs in progress (their transcripts are kept) and wait for them."""
        handles = [h for h in self._handles if not h.done]
        for handle in handles:
            handle.cancel("the server is shutting down")
        await self._background.aclose()
        await asyncio.gather(*(ended(h) for h in handles))


def _recorded(handle: RunHandle[str]) -> asyncio.Future[None]:
    """Resolved when the run of ``handle`` says it started (an agent's run stores its
    record and its task first) or ends without saying so."""
    recorded: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def seen(event: Event | None) -> None:
        if isinstance(event, RunStarted | None) and not recorded.done():
            recorded.set_result(None)
            remove()

    remove = handle.scope.add_listener(seen)
    handle.add_done_callback(lambda _: seen(None))
    return recorded
