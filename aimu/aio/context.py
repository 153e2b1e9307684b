"""Context policies: what of a long transcript is sent to the model.

A policy sees the whole transcript before each model request and returns the messages
to send; the transcript itself (in memory and in the store) stays whole. Cuts fall only
at a user message, so a tool call is never separated from its result, and the system
prompt is always kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from aimu.aio.transcript import Message

__all__ = ["ContextPolicy", "KeepLastTurns", "turn_starts"]


@runtime_checkable
class ContextPolicy(Protocol):
    """Chooses the messages a model request sends from the whole transcript."""

    def view(self, messages: Sequence[Message]) -> Sequence[Message]:
        """The messages to send; the system prompt first if there is one, and never a
        tool result without the call before it."""
        ...


def turn_starts(messages: Sequence[Message]) -> list[int]:
    """The index of each turn's opening user message (a turn runs to the next one)."""
    return [index for index, message in enumerate(messages) if message["role"] == "user"]


@dataclass(frozen=True, slots=True)
class KeepLastTurns:
    """Send the system prompt and the last ``turns`` turns (a turn: a user message and
    every model turn and tool result after it). The turn in progress is always sent
    whole, however many tool rounds it has."""

    turns: int

    def __post_init__(self) -> None:
        if isinstance(self.turns, bool) or not isinstance(self.turns, int) or self.turns < 1:
            raise ValueError(f"KeepLastTurns(turns=...) must be a positive int, got {self.turns!r}")

    def view(self, messages: Sequence[Message]) -> Sequence[Message]:
        starts = turn_starts(messages)
        if len(starts) <= self.turns:
            return messages
        cut = starts[-self.turns]
        head = [messages[0]] if messages and messages[0]["role"] == "system" else []
        return [*head, *messages[cut:]]
