"""Handoffs: an agent hands the conversation over to another agent.

``Agent(client, handoffs=[billing, support])`` offers the model one transfer tool per
target, named from the target's name (``transfer_to_billing``; see :mod:`.transfer`).
When the model takes one, the target answers the user from the next model turn on, in
the same session (its system prompt, tools, model, output type and guardrails), until it
hands back (it is offered ``transfer_back_to_<name>``) or hands on; a new run of the
session goes on with the agent that has the conversation. :class:`~.transfer.Handoff` names the
tool, describes it, or gives an ``input_filter``: a function of the transcript returning
what the target is sent of it (the transcript itself stays whole).

The transcript says who has the conversation, and it is read the same way at a run's
start and before each model turn: the last transfer that succeeded, or the last agent
that spoke (each assistant message records it: ``aimu_agent``). So the store and a
resume after a crash know it too.

A transfer is a tool call like any other: a stop during the round settles it as any call
(a "cancelled" result, and no transfer), and an unknown name is the unknown tool's
error, which the model reads and can correct.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from aimu.aio._tool_table import ToolTable
from aimu.aio.context import ContextPolicy
from aimu.aio.transcript import Message

from .base import AgentBase
from .config import Config
from .session import Session, Speaker
from .transfer import TRANSFERRED, Handoff, InputFilter, slug, transfer_tool

__all__ = ["follow_speaker", "target_of"]


def target_of(handoff: Handoff) -> AgentBase[Any]:
    """The agent ``handoff`` hands to (check_handoffs let only agents in)."""
    agent = handoff.agent
    assert isinstance(agent, AgentBase)
    return agent


def _speaker(session: Session) -> Speaker:
    speaker = session.handoff
    if speaker is None:
        config = session.config
        known: dict[str, Handoff] = {}
        _walk(config, config.name, known)
        speaker = session.handoff = Speaker(config, session.client, known)
    return speaker


def _walk(config: Config, home: str, known: dict[str, Handoff]) -> None:
    for handoff in config.handoffs:
        name = handoff.agent.name
        if name not in known and name != home:
            known[name] = handoff
            _walk(target_of(handoff).config, home, known)


async def follow_speaker(session: Session, reset: bool = False) -> None:
    """At a run's start and before each model turn: the agent the transcript says has the
    conversation takes the session (a transfer taken in the last round; after a restart,
    or on a new object on a stored session, the agent that had it). A run that starts
    clean (``reset``), or a transcript that names none, starts with the home agent."""
    speaker = _speaker(session)
    name = None if reset else _last_speaker(session.messages, speaker)
    name = speaker.config.name if name is None else name
    if name != session.config.name:
        await _switch(session, speaker, name, speaker.known.get(name))


def _last_speaker(messages: list[Message], speaker: Speaker) -> str | None:
    tools = {h.name: name for name, h in speaker.known.items()}
    back = f"transfer_back_to_{slug(speaker.config.name)}"
    for message in reversed(messages):
        if message["role"] == "tool" and message["content"].startswith(TRANSFERRED):
            if message["name"] == back:
                return speaker.config.name
            if message["name"] in tools:
                return tools[message["name"]]
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
        target = target_of(handoff)
        config = target.config
        home = speaker.config.name
        back = transfer_tool(f"transfer_back_to_{slug(home)}", home)
        table = ToolTable([*config.table.local, *config.table.toolsets, back])
        await table.ready()
        context: ContextPolicy | None = config.context
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
class _Filtered:
    """A handoff's input filter as a context policy: the target is sent what the filter
    keeps (then what its own context policy keeps of that)."""

    keep: InputFilter
    then: ContextPolicy | None

    def view(self, messages: Sequence[Message]) -> Sequence[Message]:
        kept = self.keep(list(messages))
        return kept if self.then is None else self.then.view(kept)
