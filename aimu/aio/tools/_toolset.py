"""Toolset: a source of tools that must be opened first (an MCP server), given in ``tools=``.

The agent opens each toolset before a run's first model turn and asks it for its tools
(names filtered and made unique by the toolset); a toolset reconnects there if its
connection was lost. Whoever opened a toolset closes it: a toolset the agent opened is
closed by ``agent.aclose()``, one opened by ``async with`` stays open until that block ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from aimu.aio.tools._definition import Tool

__all__ = ["Toolset"]


@runtime_checkable
class Toolset(Protocol):
    """Tools that come from somewhere that must be opened first."""

    @property
    def name(self) -> str:
        """What the toolset is called: errors name it, clashing tool names get it as prefix."""
        ...

    @property
    def is_open(self) -> bool:
        """True while it is open (its tools can be called)."""
        ...

    async def open(self) -> None:
        """Connect (or reconnect); an error naming the toolset, within its own timeout."""
        ...

    async def list_tools(self) -> Sequence[Tool]:
        """Its tools, opened first if need be; the same list while the connection lasts."""
        ...

    async def aclose(self) -> None:
        """Close it (idempotent); it may be opened again."""
        ...
