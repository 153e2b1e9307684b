"""Context policies: what of a long transcript is sent to the model.

A policy sees the whole transcript before each model request and returns the messages
to send; the transcript itself (in memory and in the store) stays whole. Cuts fall only
at a user message, so a tool call is never separated from its result, and the system
prompt is always kept. :class:`SummarizeOlderTurns` has the model write a summary of
the turns it leaves out (the agent asks for it, and keeps it in the session's state).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from aimu.aio.transcript import Message, SystemMessage

__all__ = ["ContextPolicy", "KeepLastTurns", "SummarizeOlderTurns", "Summary", "turn_starts"]


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


SUMMARY_INSTRUCTIONS = (
    "Summarise the conversation below for the assistant who will continue it: the "
    "user's goals and preferences, facts learned, tool results that still matter, "
    "decisions made and open questions. Be brief and concrete; write only the summary."
)


@dataclass(frozen=True, slots=True)
class Summary:
    """A summary of the transcript's first ``upto`` messages (the system prompt aside)."""

    upto: int
    text: str

    def dump(self) -> dict[str, Any]:
        return {"upto": self.upto, "text": self.text}

    @classmethod
    def load(cls, data: object, length: int, where: str) -> Summary | None:
        """The summary in :meth:`dump` data (None: none); ValueError naming ``where``
        when it is not that shape or covers more than the ``length`` messages there are."""
        if data is None:
            return None
        upto = data.get("upto") if isinstance(data, Mapping) else None
        text = data.get("text") if isinstance(data, Mapping) else None
        if (isinstance(upto, bool) or not isinstance(upto, int) or not 0 < upto <= length
                or not isinstance(text, str)):
            raise ValueError(f"{where}: unreadable summary (expected {{'upto': 1..{length}, "
                             f"'text': str}}, got {data!r:.100})")
        return cls(upto, text)


@dataclass(frozen=True, slots=True)
class SummarizeOlderTurns:
    """Send the system prompt with a summary of the older turns, and the last ``keep``
    turns whole (the turn in progress always whole, however many tool rounds it has).

    When turns older than the last ``keep`` exist that the summary does not cover, the
    agent asks the model for a new summary before the request: the previous summary and
    the turns that became old, with ``instructions`` as the system prompt. That request
    counts in the run's usage, requests and limits, a stop cuts it like any model turn,
    and the summary is kept in the session's state, so a resumed run or another process
    does not ask again. The stored transcript stays whole.
    """

    keep: int = 4
    instructions: str = SUMMARY_INSTRUCTIONS

    def __post_init__(self) -> None:
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(
                f"SummarizeOlderTurns(keep=...) must be a positive int, got {self.keep!r}"
            )
        if not isinstance(self.instructions, str) or not self.instructions.strip():
            raise ValueError("SummarizeOlderTurns(instructions=...) must be a non-empty string")

    def view(self, messages: Sequence[Message]) -> Sequence[Message]:
        """Without a summary yet: every message (see :meth:`view_with`)."""
        return messages

    def due(
        self, messages: Sequence[Message], summary: Summary | None
    ) -> tuple[int, list[Message]] | None:
        """(where the kept turns start, the messages to summarise) when turns older than
        the last ``keep`` are not covered by ``summary``; else None."""
        starts = turn_starts(messages)
        if len(starts) <= self.keep:
            return None
        cut = starts[-self.keep]
        if summary is not None and summary.upto >= cut:
            return None
        first = summary.upto if summary is not None else _after_system(messages)
        return cut, list(messages[first:cut])

    def request(self, summary: Summary | None, older: Sequence[Message]) -> list[Message]:
        """The summarising request: the instructions, then the previous summary and the
        messages that became old, as plain text."""
        text = render(older)
        if summary is not None:
            text = f"The summary so far:\n{summary.text}\n\nWhat came after it:\n{text}"
        return [{"role": "system", "content": self.instructions},
                {"role": "user", "content": text}]

    def view_with(self, messages: Sequence[Message], summary: Summary | None) -> list[Message]:
        """The messages to send: the system prompt with ``summary`` added, then every
        message after what the summary covers."""
        if summary is None:
            return list(messages)
        system = messages[0]["content"] if _after_system(messages) else ""
        note = f"Summary of the earlier conversation:\n{summary.text}"
        head: SystemMessage = {"role": "system",
                               "content": f"{system}\n\n{note}" if system else note}
        return [head, *messages[summary.upto:]]


def _after_system(messages: Sequence[Message]) -> int:
    return 1 if messages and messages[0]["role"] == "system" else 0


def render(messages: Sequence[Message]) -> str:
    """Messages as plain lines (``role: text``; calls with their arguments) to summarise."""
    lines: list[str] = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "tool":
            lines.append(f"tool {message.get('name', '')}: {content}")
            continue
        calls = message.get("tool_calls") if message["role"] == "assistant" else None
        if isinstance(calls, list) and calls:
            called = ", ".join(
                f"{c['function']['name']}({_arguments(c['function']['arguments'])})"
                for c in calls
            )
            content = f"{content} [called {called}]".strip()
        lines.append(f"{role}: {content}")
    return "\n".join(lines)


def _arguments(arguments: object) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)
