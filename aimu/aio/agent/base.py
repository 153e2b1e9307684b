"""The seam between an agent and the steps that hold other agents (a tree's calls,
handoffs' targets): what they use of an agent, by public names.

:class:`AgentBase` is the base of :class:`~aimu.aio.Agent`: a tree's call opens a
session of the agent called (:meth:`~AgentBase.nested`), runs a task in it from a clean
start (``finish(task, reset=True)``), reads its configuration (:attr:`~AgentBase.config`)
and whether its session is in memory (:attr:`~AgentBase.loaded`); a handoff switches a
session to a target's configuration and a fork of its model client.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

from aimu.aio.runnable import OutputT, Runnable

if TYPE_CHECKING:
    from aimu.aio.client import ModelClient
    from aimu.aio.events import RunFinished
    from aimu.aio.store import SessionWriter, Store
    from aimu.aio.transcript import Message

    from .config import Config

__all__ = ["AgentBase"]


class AgentBase(Runnable[OutputT]):
    """What a tree and handoffs use of an agent (see the module)."""

    #: The model client its sessions' turns are asked of.
    model_client: ModelClient

    @property
    @abc.abstractmethod
    def config(self) -> Config:
        """The agent's configuration: frozen, shared by every session of it."""

    @property
    @abc.abstractmethod
    def loaded(self) -> bool:
        """The session is in memory: no store, or its stored session opened (or restored)."""

    @property
    @abc.abstractmethod
    def messages(self) -> list[Message]:
        """This session's transcript."""

    @abc.abstractmethod
    async def open(self) -> None:
        """Open the store session now (without a store, nothing)."""

    @property
    @abc.abstractmethod
    def session_writer(self) -> SessionWriter | None:
        """The open writer of this agent's stored session, which holds its write lock
        (None before :meth:`open`, after :meth:`aclose`, or without a store)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release the store session (and a client the agent owns)."""

    @abc.abstractmethod
    def nested(self, store: Store | None, session: str | None) -> AgentBase[OutputT]:
        """A session of this agent for one call of it as a tool: in ``store`` under
        ``session`` (both None: in memory), sharing this agent's client's connections."""

    @abc.abstractmethod
    async def end_dead_run(self, reason: str) -> None:
        """Record this session's last run ``failed`` (with ``reason``) when its record
        still says ``running`` (its process died) and this process holds the session."""

    async def finish(self, task: str | None, *, reset: bool = False) -> RunFinished:
        """Run ``task`` (None: resume) to its end; return its RunFinished. ``reset``: the
        task starts from a clean transcript."""
        if reset:
            return await self._finish(task, True)
        return await super().finish(task)
