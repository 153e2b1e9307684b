"""Handoffs: an agent hands the conversation over to another agent.

``Agent(client, handoffs=[billing, support])`` offers the model one transfer tool per
target, named from the target's name (``transfer_to_billing``). When the model takes
one, the target answers the user from the next model turn on, in the same session
(its system prompt, tools, model, output type and guardrails), until it hands back
(it is offered ``transfer_back_to_<name>``) or hands on; a new run of the session goes
on with the agent that has the conversation. :class:`Handoff` names the tool, describes
it, or gives an ``input_filter``: a function of the transcript returning what the
target is sent of it (the transcript itself stays whole).

Each assistant message records who spoke (``aimu_agent``), so the transcript, the store
and a resume after a crash know which agent has the conversation: the last transfer
that succeeded, or the last agent that spoke, says so.

A transfer is a tool call like any other: a stop during the round settles it as any call
(a "cancelled" result, and no transfer), and an unknown name is the unknown tool's
error, which the model reads and can correct.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from aimu.aio._tool_table import ToolTable
from aimu.aio.tools import Tool, ToolContext
from aimu.aio.transcript import Message

#: The agent's session and config (aimu.aio.agent's; not imported: it imports this).
Session = Any
Config = Any

__all__ = [
    "Handoff", "Speaker", "check_handoffs", "handoff_tools", "pick_up_speaker", "speaker_of",
    "take_handoff",
]

_SAFE = re.compile(r"[A-Za-z0-9_-]+")
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
#: What a transfer tool answers when it was taken.
_TRANSFERRED = "Transferred to {name}: it answers from now on."

InputFilter = Callable[[list[Message]], Sequence[Message]]


@dataclass(frozen=True, slots=True)
class Handoff:
    """A handoff target with options: ``tool_name`` (default ``transfer_to_<name>``),
    ``description``, and ``input_filter`` (what of the transcript the target is sent)."""

    agent: Any
    tool_name: str | None = None
    description: str | None = None
    input_filter: InputFilter | None = None

    @property
    def name(self) -> str:
        return self.tool_name or f"transfer_to_{_slug(self.agent.name)}"


def _slug(name: str) -> str:
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
        if not hasattr(handoff.agent, "_config"):
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
    """The transfer tool's call: note the handoff; it takes effect at the next turn."""

    __slots__ = ("handoff",)

    def __init__(self, handoff: Handoff) -> None:
        self.handoff = handoff

    async def __call__(self, arguments: dict[str, Any], ctx: ToolContext) -> str:
        caller = ctx.caller
        if isinstance(caller, tuple):
            session = caller[0]
            speaker_of(session).pending = self.handoff
        return _TRANSFERRED.format(name=self.handoff.agent.name)


def handoff_tools(handoffs: Sequence[Handoff]) -> list[Tool]:
    """One transfer tool per target."""
    return [
        Tool.from_schema(
            h.name,
            h.description or f"Hand the conversation over to the agent {h.agent.name!r}: "
            "it answers the user from now on.",
            dict(_NO_ARGUMENTS), _Transfer(h),
        )
        for h in handoffs
    ]


class Speaker:
    """Who has a session's conversation: the home agent (the session's own) or one it
    handed over to; ``pending``: a transfer taken in this round, taken up next turn."""

    __slots__ = ("client", "config", "known", "pending")

    def __init__(self, session: Session) -> None:
        self.config = session.config
        self.client = session.client
        self.pending: Handoff | None = None
        #: Every agent reachable by handoffs, by name, and the tool that reaches it.
        self.known: dict[str, Handoff] = {}
        self._walk(self.config)

    def _walk(self, config: Config) -> None:
        for handoff in config.handoffs:
            if handoff.agent.name not in self.known and handoff.agent.name != self.config.name:
                self.known[handoff.agent.name] = handoff
                self._walk(handoff.agent._config)


def speaker_of(session: Session) -> Speaker:
    speaker = session.handoff
    if speaker is None:
        speaker = session.handoff = Speaker(session)
    assert isinstance(speaker, Speaker)
    return speaker


async def take_handoff(session: Session) -> None:
    """Before a model turn: a transfer taken in the last round (or, at a run's start, the
    agent the transcript says has the conversation) takes the session over."""
    speaker = speaker_of(session)
    handoff, speaker.pending = speaker.pending, None
    if handoff is not None:
        await _switch(session, speaker, handoff.agent.name, handoff)


async def pick_up_speaker(session: Session, reset: bool) -> None:
    """At a run's start: the agent that had the conversation (the transcript says) has
    it again (after a restart, or a new object on a stored session); a run that starts
    clean (``reset``), or a transcript that names none, starts with the home agent."""
    speaker = speaker_of(session)
    name = None if reset else _last_speaker(session.messages, speaker)
    name = speaker.config.name if name is None else name
    if name != session.config.name:
        await _switch(session, speaker, name, speaker.known.get(name))


def _last_speaker(messages: list[Message], speaker: Speaker) -> str | None:
    tools = {h.name: name for name, h in speaker.known.items()}
    back = f"transfer_back_to_{_slug(speaker.config.name)}"
    for message in reversed(messages):
        if message["role"] == "tool" and message["content"].startswith("Transferred to "):
            if message["name"] == back:
                return str(speaker.config.name)
            if message["name"] in tools:
                return str(tools[message["name"]])
        if message["role"] == "assistant" and "aimu_agent" in message:
            return str(message["aimu_agent"])
    return None


async def _switch(
    session: Session, speaker: Speaker, name: str, handoff: Handoff | None
) -> None:
    """The agent ``name`` takes the session over (its config and model; a target offered
    the way back home); the system prompt becomes its own."""
    if name == speaker.config.name or handoff is None:
        session.config, session.client = speaker.config, speaker.client
    else:
        target = handoff.agent
        config: Config = target._config
        home_name = speaker.config.name
        home = Handoff(_Home(home_name), f"transfer_back_to_{_slug(home_name)}")
        table = ToolTable([*config.table.local, *config.table.toolsets, *handoff_tools([home])])
        await table.ready()
        context = config.context
        if handoff.input_filter is not None:
            context = _Filtered(handoff.input_filter, context)
        session.config = replace(config, table=table, context=context)
        session.client = target.model_client.fork()
    system = session.config.system
    if isinstance(system, str):  # an agent without a text prompt keeps the one there
        session.system_text = system
        if session.place_system():
            await session.durable.sync(session.messages)


@dataclass(frozen=True, slots=True)
class _Home:
    """The home agent as a handoff target (only its name is read)."""

    name: str


@dataclass(frozen=True, slots=True)
class _Filtered:
    """A handoff's input filter as a context policy: the target is sent what the filter
    keeps (then what its own context policy keeps of that)."""

    keep: InputFilter
    then: Any

    def view(self, messages: Sequence[Message]) -> Sequence[Message]:
        kept = self.keep(list(messages))
        return kept if self.then is None else self.then.view(kept)
