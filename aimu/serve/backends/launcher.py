"""Runs executing in this process: the :class:`Launcher` opens each run's session from
the store (its write lock taken), runs it under a handle and closes the session when the
run ends, so the next run on that session may execute in another process sharing the
store. The local and Redis backends both launch with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from aimu.aio._tasks import Background, ended
from aimu.aio.agent import Agent
from aimu.aio.run_handle import RunHandle
from aimu.serve.errors import Conflict
from aimu.serve.runs import AgentFactory, open_agent

__all__ = ["Launcher", "StartHandle"]

#: Starts the run's coroutine under a handle, given how many messages the session held.
StartHandle = Callable[[Coroutine[Any, Any, str], int], RunHandle[str]]


class Launcher:
    """Starts runs of sessions in this process and stops them all on :meth:`aclose`."""

    def __init__(self, agents: AgentFactory) -> None:
        self._agents = agents
        self._handles: set[RunHandle[str]] = set()
        self._background = Background()
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
        return self._background.spawn(work)

    async def aclose(self) -> None:
        """Cancel the runs in progress (their transcripts are kept) and wait for them."""
        handles = [h for h in self._handles if not h.done]
        for handle in handles:
            handle.cancel("the server is shutting down")
        await self._background.aclose()
        await asyncio.gather(*(ended(h) for h in handles))
