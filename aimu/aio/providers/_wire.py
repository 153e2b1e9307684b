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
from aimu.aio.providers.base import Chunk, TextDelta, ThinkingDelta
from aimu.aio.transcript import AssistantMessage, Message, ToolCall, ToolSpec

__all__ = [
    "PrefillEcho", "WireEncoder", "decode_arguments", "dumps", "dumps_text", "merge_messages",
    "prefill", "request_body", "unchanged",
]

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


def request_body(settings: dict[str, Any], messages: bytes, tools: bytes | None) -> bytes:
    """A request body: ``settings`` with the encoded ``messages`` array and ``tools``."""
    head = dumps(settings)[:-1]  # the object left open for the transcript
    tail = b',"tools":' + tools + b"}" if tools is not None else b"}"
    return head + b',"messages":' + messages + tail


def unchanged(objects: list[Message], contents: list[str], messages: Sequence[Message]) -> int:
    """How many leading ``messages`` are the ``objects`` encoded last time, with the same
    ``contents`` (0: start afresh). Two passes at C speed."""
    known = len(objects)
    if not known or len(messages) < known:
        return 0
    sent = messages[:known]
    if all(map(is_, objects, sent)) and all(map(is_, contents, map(_CONTENT, sent))):
        return known
    return 0


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


def prefill(messages: Sequence[Message], merge_roles: bool) -> str:
    """The text of the trailing assistant message as sent (merged with the assistant
    messages before it when ``merge_roles``): the prefix a server continues, else ``""``."""
    if not messages or messages[-1]["role"] != "assistant":
        return ""
    if not merge_roles:
        return messages[-1]["content"]
    start = len(messages) - 1
    while start and messages[start - 1]["role"] == "assistant":
        start -= 1
    return merge_messages(messages[start:])["content"]


class PrefillEcho:
    """Takes a server's echo of the prefill out of its reply, once.

    llama.cpp's server continues a trailing assistant message but sends that message's
    text back first (as the first streamed delta; at the start of a whole reply). The
    reply's text is held while it could still be that echo; it is stripped only when the
    text starts with the whole prefill, and released unchanged otherwise (or when the
    reply goes on to a tool call or ends first). Thinking passes through.
    """

    __slots__ = ("held", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.held = ""

    @property
    def settled(self) -> bool:
        """True once the echo was stripped or ruled out: the rest passes as it comes."""
        return not self.text

    def chunks(self, chunks: list[Chunk]) -> list[Chunk]:
        """``chunks`` with the echo taken out (text held back while undecided)."""
        passed: list[Chunk] = []
        for chunk in chunks:
            if not self.text or isinstance(chunk, ThinkingDelta):
                passed.append(chunk)
                continue
            if isinstance(chunk, TextDelta):
                held = self.held + chunk.text
                if len(held) < len(self.text) and self.text.startswith(held):
                    self.held = held  # still possibly the echo: wait for more
                    continue
                if held.startswith(self.text):
                    held = held[len(self.text):]
                self._decided(passed, held)
            else:  # a call, native data or the end came first: no echo
                self._decided(passed, self.held)
                passed.append(chunk)
        return passed

    def _decided(self, passed: list[Chunk], text: str) -> None:
        self.text = self.held = ""
        if text:
            passed.append(TextDelta(text))


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

    def messages(self, messages: Sequence[Message]) -> bytes:
        """The JSON array of ``messages`` in wire form."""
        start = unchanged(self._objects, self._contents, messages)
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
