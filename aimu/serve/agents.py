"""The store and the agents of a session's runs, as ``aimu serve`` and ``aimu worker`` build them.

Defined in :mod:`aimu._hosting` (shared by ``aimu serve`` and ``aimu worker`` without
either importing the other); this is the path the docs give.
"""

from __future__ import annotations

from aimu._hosting import AgentFactory, Closer, agent_factory, open_store

__all__ = ["AgentFactory", "Closer", "agent_factory", "open_store"]
