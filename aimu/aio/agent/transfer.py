"""Handoff targets and their transfer tools: what an agent's ``handoffs=`` declares.

:class:`Handoff` names a target agent, the tool that hands the conversation to it
(``transfer_to_<name>``), its description, and an ``input_filter``. A transfer tool
does nothing but answer :func:`transferred`: the transcript then says who has the
conversation, and :mod:`.handoffs` reads it before each model turn.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from aimu.aio.runnable import Runnable
from aimu.aio.tools import Tool, ToolContext
from aimu.aio.transcript import Message

__all__ = [
    "TRANSFERRED", "Handoff", "InputFilter", "check_handoffs", "handoff_tools", "slug",
    "transfer_tool",
]

_SAFE = re.compile(r"[A-Za-z0-9_-]+")
_NO_ARGUMENTS: Final[dict[str, Any]] = {"type": "object", "properties": {}}
#: How a transfer tool's result starts: the mark of a transfer taken, in the transcript.
TRANSFERRED: Final = "Transferred to "

InputFilter = Callable[[list[Message]], Sequence[Message]]


@dataclass(frozen=True, slots=True)
class Handoff:
    """A handoff target with options: ``tool_name`` (default ``transfer_to_<name>``),
    ``description``, and ``input_filter`` (what of the transcript the target is sent)."""

    agent: Runnable[Any]
    tool_name: str | None = None
    description: str | None = None
    input_filter: InputFilter | None = None

    @property
    def name(self) -> str:
        return self.tool_name or f"transfer_to_{slug(self.agent.name)}"


def slug(name: str) -> str:
    """``name`` as a part of a tool name."""
    return "_".join(_SAFE.findall(name.replace(".", "_")))[:48] or "agent"


def check_handoffs(given: object) -> tuple[Handoff, ...]:
    """``handoffs=`` as Handoffs (an agent alone is ``Handoff(agent)``); TypeError or
    ValueError saying what is wrong."""
    if given is None:
        return ()
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise TypeError(f"handoffs must be a list of agents, got {type(given).__name__}")
    made: list[Handoff] = []
    for item in given:
        handoff = item if isinstance(item, Handoff) else Handoff(item)
        if not isinstance(handoff.agent, Runnable) or handoff.agent.kind != "agent":
            raise TypeError(f"handoffs takes agents (or aio.Handoff), got {item!r:.80}")
        if handoff.input_filter is not None and not callable(handoff.input_filter):
            raise TypeError("Handoff(input_filter=...) must be a function of the messages")
        made.append(handoff)
    names = [h.name for h in made]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"handoffs: two targets give the tool name {twice[0]!r}")
    return tuple(made)


class _Transfer:
    """A transfer tool's call: its result is the transfer (taken at the next turn)."""

    __slots__ = ("answer",)

    def __init__(self, target: str) -> None:
        self.answer = f"{TRANSFERRED}{target}: it answers from now on."

    async def __call__(self, arguments: dict[str, Any], ctx: ToolContext) -> str:
        return self.answer


def transfer_tool(tool_name: str, target: str, description: str | None = None) -> Tool:
    """The tool that hands the conversation to the agent named ``target``."""
    return Tool.from_schema(
        tool_name,
        description or f"Hand the conversation over to the agent {target!r}: it answers "
        "the user from now on.",
        dict(_NO_ARGUMENTS), _Transfer(target),
    )


def handoff_tools(handoffs: Sequence[Handoff]) -> list[Tool]:
    """One transfer tool per target."""
    return [transfer_tool(h.name, h.agent.name, h.description) for h in handoffs]
