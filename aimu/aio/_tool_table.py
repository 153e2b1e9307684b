"""An agent's tools: its plain functions and the tools of its toolsets (MCP servers).

A :class:`ToolTable` is shared by every session of one agent. Plain tools are known at
construction; a toolset's tools only once it is open, so :meth:`ToolTable.ready` opens
the toolsets (reconnecting a lost one) before each run and rebuilds the names and specs
when a toolset's list changed. A toolset's tool whose name clashes with another tool's
gets its toolset's name as a prefix (``files_read``); its schema is sent unchanged.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Callable, Sequence
from types import EllipsisType
from typing import Any

from aimu.aio.tools import Tool, Toolset, as_tool, tool
from aimu.aio.transcript import ToolSpec

__all__ = ["ToolTable"]

_NOT_A_NAME = re.compile(r"[^A-Za-z0-9_-]+")


class ToolTable:
    """The tools an agent offers, by name, and their specs; toolsets opened on demand."""

    __slots__ = ("_listed", "_lock", "by_name", "local", "opened", "specs", "tools", "toolsets")

    def __init__(self, tools: Sequence[Callable[..., Any] | Tool | Toolset | EllipsisType]) -> None:
        toolsets: list[Toolset] = []
        local: list[Tool] = []
        for item in tools:
            if item is Ellipsis:
                continue  # ``tools=[...]``, the docs' placeholder, means none
            if isinstance(item, Toolset):
                if any(item is seen for seen in toolsets):
                    raise ValueError(f"toolset {item.name!r} is given twice in tools=")
                toolsets.append(item)
            else:
                local.append(as_tool(item))
        self.local = tuple(local)
        self.toolsets = tuple(toolsets)
        #: Toolsets this table opened: the agent that owns it closes them.
        self.opened: list[Toolset] = []
        self._listed: tuple[Sequence[Tool], ...] = ()
        self._lock: asyncio.Lock | None = None
        self.tools: tuple[Tool, ...] = ()
        self.by_name: dict[str, Tool] = {}
        self.specs: tuple[ToolSpec, ...] = ()
        self._build(())

    async def ready(self) -> None:
        """Open every toolset not open (an error naming it if one cannot be), and take
        their tools; cheap when nothing changed."""
        if not self.toolsets:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            listed: list[Sequence[Tool]] = []
            for toolset in self.toolsets:
                if not toolset.is_open:
                    await toolset.open()
                    if not any(toolset is t for t in self.opened):
                        self.opened.append(toolset)
                listed.append(await toolset.list_tools())
            if len(listed) != len(self._listed) or any(
                a is not b for a, b in zip(listed, self._listed, strict=True)
            ):
                self._build(tuple(listed))

    async def aclose(self) -> None:
        """Close the toolsets this table opened (those opened by their owner stay open)."""
        opened, self.opened = self.opened, []
        errors: list[BaseException] = []
        for toolset in reversed(opened):
            try:
                await toolset.aclose()
            except Exception as error:  # close the others first, then report
                errors.append(error)
        if errors:
            raise errors[0]

    def _build(self, listed: tuple[Sequence[Tool], ...]) -> None:
        counts = Counter(t.name for t in self.local)
        for tools in listed:
            counts.update(t.name for t in tools)
        built = list(self.local)
        for toolset, tools in zip(self.toolsets, listed, strict=False):
            for item in tools:
                if counts[item.name] > 1:
                    item = tool(item, name=_prefixed(toolset.name, item.name))
                built.append(item)
        by_name: dict[str, Tool] = {}
        for item in built:
            if item.name in by_name:
                raise ValueError(f"two tools are named {item.name!r}; tool names must be unique")
            by_name[item.name] = item
        self.tools, self.by_name = tuple(built), by_name
        self.specs = tuple(t.spec for t in built)
        self._listed = listed


def _prefixed(prefix: str, name: str) -> str:
    """``prefix_name`` in the characters model servers accept, at most 64 of them."""
    return _NOT_A_NAME.sub("_", f"{prefix}_{name}")[:64]
