"""A transcript's wire form, encoded once per message and merged where templates need it.

:class:`WireEncoder` keeps each message's encoded JSON while the message stays in the
transcript, so a request costs one join, not a re-encoding of every message. Messages
are treated as immutable once sent: replace a message instead of editing it in place
(its content and tool calls are compared by identity to notice a replacement).

With ``merge_roles`` (the default), adjacent user messages, or adjacent assistant
messages (a stopped reply and its resumed continuation), go out as one, so servers
whose chat templates require strict user/assistant alternation accept the request.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, cast

from aimu.aio.providers._errors import clip
from aimu.aio.providers._unicode import clean, clean_json
from aimu.aio.transcript import AssistantMessage, Message, ToolCall, ToolSpec

__all__ = ["WireEncoder", "decode_arguments", "dumps", "dumps_text", "merge_messages"]

_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_MERGED = frozenset({"user", "assistant"})
_JOIN = "\n\n"
_RAW_LIMIT = 200


def dumps_text(value: object) -> str:
    """Compact JSON text, non-ASCII characters kept as they are."""
    return _ENCODER.encode(value)


def dumps(value: object) -> bytes:
    """Compact UTF-8 JSON; an unpaired surrogate (from a caller's string) becomes U+FFFD."""
    text = _ENCODER.encode(value)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return clean(text).encode()


def merge_messages(group: Sequence[Message]) -> Message:
    """One message saying what the adjacent same-role messages of ``group`` said."""
    content = _JOIN.join(m["content"] for m in group if m["content"])
    if group[0]["role"] != "assistant":
        return cast(Message, {"role": group[0]["role"], "content": content})
    merged: AssistantMessage = {"role": "assistant", "content": content}
    assistants = cast(Sequence[AssistantMessage], group)
    calls: list[ToolCall] = [c for m in assistants for c in m.get("tool_calls", ())]
    if calls:
        merged["tool_calls"] = calls
    thinking = _JOIN.join(m["thinking"] for m in assistants if m.get("thinking"))
    if thinking:
        merged["thinking"] = thinking
    return merged


_Entry = tuple[Message, str, object, bytes]


class WireEncoder:
    """Encodes transcripts for one client with ``to_wire``, caching each message's bytes."""

    __slots__ = ("_entries", "_to_wire", "_tools", "merge_roles")

    def __init__(self, to_wire: Callable[[Message], dict[str, Any]], merge_roles: bool) -> None:
        self._to_wire = to_wire
        self.merge_roles = merge_roles
        self._entries: dict[int, _Entry] = {}
        self._tools: tuple[object, bytes] = (None, b"[]")

    def messages(self, messages: Sequence[Message]) -> bytes:
        """The JSON array of ``messages`` in wire form."""
        entries = self._entries
        fresh: dict[int, _Entry] = {}
        parts: list[bytes] = []
        previous = ""
        group: list[Message] = []
        for message in messages:
            key = id(message)
            entry = entries.get(key)
            calls = message.get("tool_calls")
            if (
                entry is None
                or entry[0] is not message
                or entry[1] is not message["content"]
                or entry[2] is not calls
            ):
                entry = (message, message["content"], calls, dumps(self._to_wire(message)))
            fresh[key] = entry
            role = message["role"]
            if role == previous and self.merge_roles and role in _MERGED:
                group.append(message)
                parts[-1] = dumps(self._to_wire(merge_messages(group)))
                continue
            group = [message]
            previous = role
            parts.append(entry[3])
        self._entries = fresh  # only messages still in the transcript stay cached
        return b"[" + b",".join(parts) + b"]"

    def tools(self, tools: Sequence[ToolSpec]) -> bytes:
        """The JSON array of ``tools``, encoded again only when another list is offered."""
        cached, encoded = self._tools
        if cached is not tools:
            encoded = dumps(list(tools))
            self._tools = (tools, encoded)
        return encoded


def decode_arguments(raw: str, tool: str) -> tuple[dict[str, Any], str | None]:
    """A tool call's arguments sent as JSON text, and what was wrong with them if anything.

    Anything but a JSON object gives empty arguments and an error the agent hands the
    model as the tool's result, so it can correct itself.
    """
    try:
        parsed = json.loads(raw) if raw.strip() else {}
    except ValueError as error:
        problem = f"{error}"
    else:
        if isinstance(parsed, dict):
            return clean_json(parsed), None
        problem = f"expected a JSON object, got {type(parsed).__name__}"
    return {}, (
        f"the arguments for tool {tool} were not valid JSON: {problem}; "
        f"raw: {clip(raw, _RAW_LIMIT)}"
    )
