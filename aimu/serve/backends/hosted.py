"""What the backends whose runs execute in this process share (:mod:`.local`,
:mod:`.redis`): the launcher that opens and starts their runs, the runs steered here, and
the decisions on paused runs recorded in the store; draining and closing go through the
launcher."""

from __future__ import annotations

import abc
from collections.abc import Sequence

from aimu._hosting import AgentFactory
from aimu.aio.agent import Agent
from aimu.aio.steering import LocalRuns
from aimu.aio.store import Store
from aimu.serve.backends.base import Decided, RunView, Verdict
from aimu.serve.backends.decisions import StoreDecisions
from aimu.serve.backends.launcher import Launcher

__all__ = ["HostedBackend"]


class HostedBackend(abc.ABC):
    """A backend executing runs here: a subclass starts them, finds them and says how a
    shutdown begins."""

    def __init__(self, agents: AgentFactory, store: Store) -> None:
        self._store = store
        self._launcher = Launcher(agents, store)
        #: The runs this process executes, steered here (whatever else the backend uses).
        self._runs_here = LocalRuns(self._launcher.spawn)
        self._decisions = StoreDecisions(store, agents, self)

    @abc.abstractmethod
    async def start(self, session: str, task: str | None, agent: Agent | None) -> RunView: ...

    @abc.abstractmethod
    async def latest(
        self, sessions: Sequence[str], *, live: bool = False
    ) -> dict[str, RunView]: ...

    @abc.abstractmethod
    def begin_shutdown(self) -> None: ...

    async def decide(self, view: RunView, verdict: Verdict) -> Decided:
        return await self._decisions.decide(view, verdict)

    async def drain(self, grace: float) -> None:
        await self._launcher.drain(grace)

    async def aclose(self) -> None:
        self.begin_shutdown()
        await self._launcher.aclose()
