"""The store and the agents of a session's runs, as ``aimu serve`` and ``aimu worker`` build them.

One place decides what ``--model``, ``--store``, ``--tool`` and ``--system`` mean, so a
server and the Temporal workers behind it run the same agent on the same sessions.
Neither command imports the other: both import this (``aimu.serve.agents`` re-exports
it under the name the docs give).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeAlias

from aimu.aio.agent import Agent
from aimu.aio.client import ModelClient
from aimu.aio.limits import UsageLimits
from aimu.aio.store import SQLiteStore, Store
from aimu.aio.tools import Tool, Toolset, as_tool

__all__ = ["AgentFactory", "Closer", "agent_factory", "open_agent", "open_store"]

#: Builds the agent of a session's run from its session id.
AgentFactory: TypeAlias = Callable[[str], Agent]
Closer: TypeAlias = Callable[[], Awaitable[None]]


def open_store(store: str | os.PathLike[str] | Store | None) -> tuple[Store, Closer | None]:
    """The store for ``store`` and how to close it (None: the caller owns it).

    A SQLite path, a ``postgresql://`` URL (the ``aimu-agents[postgres]`` extra), a store, or
    None for ``$AIMU_HOME/sessions.db`` (the home of ``aimu chat``).
    """
    if isinstance(store, Store):
        return store, None
    opened: Store
    if isinstance(store, str) and store.startswith(("postgres://", "postgresql://")):
        from aimu.aio.store import PostgresStore

        opened = PostgresStore(store)
    else:
        from aimu.assistant import default_home

        path = Path(store) if store is not None else default_home() / "sessions.db"
        path.parent.mkdir(parents=True, exist_ok=True)
        opened = SQLiteStore(path)
    return opened, opened.aclose


def agent_factory(
    model: str | ModelClient,
    store: Store,
    *,
    tools: Sequence[Callable[..., Any] | Tool | Toolset] = (),
    system: str | None = None,
    max_rounds: int = 10,
    limits: UsageLimits | None = None,
    session_limits: UsageLimits | None = None,
) -> tuple[AgentFactory, Closer]:
    """A factory of one agent per session on ``store``, and how to close its model client.

    ``model`` is a spec for :func:`aimu.aio.client` (the test model streams visibly
    slowly, as in ``aimu chat``) or a client; every agent gets a fork of it.
    ``limits`` bound each run, ``session_limits`` each session's runs together.
    """
    if isinstance(model, ModelClient):
        root = model
    else:
        from aimu.assistant import make_client

        root = make_client(model)
    # A toolset (an MCP server) is opened by the app, so a run's agent never closes it.
    built = [t if isinstance(t, Toolset) else as_tool(t) for t in tools]

    def agents(session: str) -> Agent:
        return Agent(
            root.fork(),
            built,
            system=system,
            max_rounds=max_rounds,
            limits=limits,
            session_limits=session_limits,
            store=store,
            session=session,
        )

    return agents, root.aclose


async def open_agent(agents: AgentFactory, session: str) -> Agent:
    """The agent of ``session``, its store session open (its write lock taken);
    ``SessionLockedError`` if a writer holds it."""
    agent = agents(session)
    try:
        await agent.open()
    except BaseException:
        await agent.aclose()
        raise
    return agent
