"""A transcript's wire form, encoded once per message and merged where templates need it.

:class:`WireEncoder` keeps the encoded JSON of the messages sent last time, so a request
encodes only what was added since. Messages are treated as immutable once sent: replace
a message instead of editing it in place (identity and content are compared to notice
a replacement).

With ``merge_roles`` (the default), adjacent user messages, or adjacent assistant
messages (a stopped reply and its resumed continuation), go out as one, so servers
whose chat templates require strict user/assistant alternation accept the request.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from operator import is_, itemgetter
from typing import Any, cast

from aimu.aio.providers._errors import clip
from aimu.aio.providers._unicode import clean, clean_json
from aimu.aio.transcript import AssistantMessage, Message, ToolCall, ToolSpec

__all__ = ["WireEncoder", "decode_arguments", "dumps", "dumps_text", "merge_messages"]

_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_MERGED = frozenset({"user", "assistant"})
_JOIN = "\n\n"
_CONTENT = itemgetter("content")
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
        merged_user: dict[str, Any] = {"role": group[0]["role"], "content": content}
        images = [url for m in group for url in cast("list[str]", m.get("images", []))]
        if images:
            merged_user["images"] = images
        return cast(Message, merged_user)
    merged: AssistantMessage = {"role": "assistant", "content": content}
    assistants = cast(Sequence[AssistantMessage], group)
    calls: list[ToolCall] = [c for m in assistants for c in m.get("tool_calls", ())]
    if calls:
        merged["tool_calls"] = calls
    thinking = _JOIN.join(m["thinking"] for m in assistants if m.get("thinking"))
    if thinking:
        merged["thinking"] = thinking
    return merged


class WireEncoder:
    """Encodes transcripts for one client with ``to_wire``, caching the encoded messages.

    A transcript usually grows at its end: the messages sent last time are checked to be
    the same objects with the same content (two passes at C speed), and only the new
    ones are encoded. Anything else (a restore, an insertion) starts the cache afresh.
    """

    __slots__ = ("_contents", "_group", "_objects", "_parts", "_to_wire", "_tools", "merge_roles")

    def __init__(self, to_wire: Callable[[Message], dict[str, Any]], merge_roles: bool) -> None:
        self._to_wire = to_wire
        self.merge_roles = merge_roles
        self._objects: list[Message] = []
        self._contents: list[str] = []
        self._parts: list[bytes] = []
        self._group: list[Message] = []  # the last run of same-role messages (merged)
        self._tools: tuple[object, bytes] = (None, b"[]")

    def _cached(self, messages: Sequence[Message]) -> int:
        """How many leading messages are as they were last time (0: start afresh)."""
        known = len(self._objects)
        if not known or len(messages) < known:
            return 0
        sent = messages[:known]
        if all(map(is_, self._objects, sent)) and all(
            map(is_, self._contents, map(_CONTENT, sent))
        ):
            return known
        return 0

    def messages(self, messages: Sequence[Message]) -> bytes:
        """The JSON array of ``messages`` in wire form."""
        start = self._cached(messages)
        if not start:
            self._objects, self._contents, self._parts, self._group = [], [], [], []
        parts = self._parts
        group = self._group
        to_wire = self._to_wire
        merge = self.merge_roles
        for message in messages[start:] if start else messages:
            self._objects.append(message)
            self._contents.append(message["content"])
            role = message["role"]
            if merge and group and role == group[-1]["role"] and role in _MERGED:
                group.append(message)
                parts[-1] = dumps(to_wire(merge_messages(group)))
                continue
            group = [message]
            parts.append(dumps(to_wire(message)))
        self._group = group
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
