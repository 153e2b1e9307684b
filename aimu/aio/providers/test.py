"""The embedded ``test`` model: deterministic, offline, no dependencies.

:func:`respond` is a pure function of the transcript and the offered tools. On a user
turn with tools it calls each tool once, with arguments built from the tool's JSON
schema; after tool results it answers with a summary that quotes them; otherwise it
answers with a short reply derived from the user text; asked for an output schema, it
answers with a JSON value built from it. :class:`TestModelClient`
streams that reply in chunks, yielding to the event loop between them.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any, Self, TypeGuard

from aimu.aio.providers.base import (
    Chunk,
    ModelClient,
    TextDelta,
    ToolCallDelta,
    TurnDone,
    TurnRequest,
)
from aimu.aio.transcript import Message, ToolCall, ToolSpec, Usage, is_correction

__all__ = [
    "EMBEDDED",
    "WHAT_IT_DOES",
    "TestModelClient",
    "arguments_for",
    "offered",
    "respond",
    "split_text",
    "value_for",
]

#: The test model's ``host``: it runs in this process.
EMBEDDED = "embedded"
#: The test model in one sentence, for the programs' banners: its first answer (a call
#: to every tool, then their results quoted) puzzles whoever expects a language model.
WHAT_IT_DOES = (
    "a stand-in for a real model, it calls each tool it is offered once, then quotes "
    "what they returned"
)

_RESULT_LIMIT = 200
_ECHO_WORDS = 24
_STOP_WORDS = frozenset(
    (
        "the", "and", "for", "with", "that", "this", "what", "which", "from", "into",
        "about", "please", "could", "would", "should", "you", "your", "are", "was",
        "were", "can", "will", "have", "has", "had", "its", "it's", "how", "why",
        "when", "where", "who",
    )
)
_WORD = re.compile(r"[^\W_][\w'-]*")
_FORMATS = {
    "date": "2024-01-01",
    "date-time": "2024-01-01T00:00:00Z",
    "time": "00:00:00",
    "email": "user@example.com",
    "uri": "https://example.com",
    "url": "https://example.com",
    "uuid": "00000000-0000-4000-8000-000000000000",
}


def _last_user_index(messages: Sequence[Message]) -> int:
    """The last task's index: a correction of an invalid typed answer is not a task."""
    for index in range(len(messages) - 1, -1, -1):
        if messages[index]["role"] == "user" and not is_correction(messages[index]):
            return index
    return -1


def _pick_word(text: str) -> str:
    """A word of ``text`` to fill string arguments: a name if there is one, else the longest."""
    words: list[str] = _WORD.findall(text)
    # A capitalised word that does not start the text is most likely a name ("Paris").
    names = [w for w in words[1:] if w[0].isupper() and w.lower() not in _STOP_WORDS]
    if names:
        return names[-1]
    content = [w for w in words if len(w) >= 3 and w.lower() not in _STOP_WORDS]
    if content:
        return max(content, key=len)
    return "example"


def _resolve(schema: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    """Follow local ``$ref`` pointers (``#/$defs/Name``) within the tool's schema."""
    seen = 0
    while isinstance(schema.get("$ref"), str) and seen < 32:
        node: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node.get(part) if isinstance(node, Mapping) and part else None
        if not isinstance(node, Mapping):
            return {}
        schema = node
        seen += 1
    return schema


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(schema: Mapping[str, Any], preferred: float) -> float:
    value = preferred
    low = schema.get("minimum")
    high = schema.get("maximum")
    if isinstance(low, int | float) and value < low:
        value = low
    if isinstance(high, int | float) and value > high:
        value = high
    exclusive_low = schema.get("exclusiveMinimum")
    exclusive_high = schema.get("exclusiveMaximum")
    # Draft 6+ form (a number); the draft 4 boolean form is left to minimum/maximum.
    if _is_number(exclusive_low) and value <= exclusive_low:
        value = exclusive_low + 1
    if _is_number(exclusive_high) and value >= exclusive_high:
        value = exclusive_high - 1
    return value


def _string(schema: Mapping[str, Any], word: str) -> str:
    value = _FORMATS.get(str(schema.get("format", "")), word)
    min_length = schema.get("minLength")
    max_length = schema.get("maxLength")
    if isinstance(min_length, int) and len(value) < min_length:
        value = (value * (min_length // max(len(value), 1) + 1))[:min_length]
    if isinstance(max_length, int) and len(value) > max_length:
        value = value[:max_length]
    return value


def _value(schema: Mapping[str, Any], root: Mapping[str, Any], word: str, depth: int) -> Any:
    schema = _resolve(schema, root)
    if depth > 16:
        return None
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            for branch in branches:
                if isinstance(branch, Mapping) and _resolve(branch, root).get("type") != "null":
                    return _value(branch, root, word, depth + 1)
            return None
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and all_of:
        merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
        for branch in all_of:
            if isinstance(branch, Mapping):
                merged.update(_resolve(branch, root))
        return _value(merged, root, word, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "string"
    if kind == "string":
        return _string(schema, word)
    if kind == "integer":
        return int(_number(schema, 1))
    if kind == "number":
        return float(_number(schema, 1.5))
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    if kind == "array":
        return _array(schema, root, word, depth + 1)
    if kind == "object":
        return _object(schema, root, word, depth + 1)
    return word


def _array(schema: Mapping[str, Any], root: Mapping[str, Any], word: str, depth: int) -> list[Any]:
    """A value for each fixed position (``prefixItems``; ``items`` as a list in older
    drafts), then ``items`` values up to ``minItems``; one item at least, where allowed."""
    items = schema.get("items")
    positions: object
    if isinstance(items, list):
        positions, rest = items, schema.get("additionalItems")
    else:
        positions, rest = schema.get("prefixItems"), items
    if not isinstance(positions, list):
        positions = []
    fixed = [p if isinstance(p, Mapping) else {} for p in positions]
    min_items = schema.get("minItems")
    count = max(len(fixed) or 1, min_items if isinstance(min_items, int) else 0)
    max_items = schema.get("maxItems")
    if rest is False:  # nothing beyond the fixed positions
        count = len(fixed)
    if isinstance(max_items, int):
        count = min(count, max_items)
    rest_schema = rest if isinstance(rest, Mapping) else {}
    return [
        _value(fixed[i] if i < len(fixed) else rest_schema, root, word, depth)
        for i in range(count)
    ]


def _object(
    schema: Mapping[str, Any], root: Mapping[str, Any], word: str, depth: int
) -> dict[str, Any]:
    properties = schema.get("properties")
    required = schema.get("required")
    if not isinstance(properties, Mapping) or not isinstance(required, list):
        return {}
    arguments: dict[str, Any] = {}
    for name in required:
        prop = properties.get(name)
        if isinstance(name, str):
            arguments[name] = _value(prop if isinstance(prop, Mapping) else {}, root, word, depth)
    return arguments


def arguments_for(parameters: Mapping[str, Any], text: str = "") -> dict[str, Any]:
    """Arguments for a tool whose parameters are ``parameters`` (a JSON object schema).

    Only required properties are filled; strings take a word of ``text`` (or
    ``"example"``), numbers respect their bounds, enums take their first value.
    """
    return _object(_resolve(parameters, parameters), parameters, _pick_word(text), 0)


def value_for(schema: Mapping[str, Any], text: str = "") -> Any:
    """A JSON value matching ``schema`` (an output type's schema), built as
    :func:`arguments_for` builds arguments: the same input gives the same value."""
    return _value(_resolve(schema, schema), schema, _pick_word(text), 0)


def offered(tools: Sequence[ToolSpec] | None, tool_choice: object) -> Sequence[ToolSpec] | None:
    """The tools a request lets the model call: none for ``"none"``, only the named one
    for a tool's name, else all of them."""
    if not tools or tool_choice in (None, "auto", "required"):
        return tools
    if isinstance(tool_choice, Mapping):  # OpenAI's {"type": "function", "function": {...}}
        function = tool_choice.get("function")
        tool_choice = function.get("name") if isinstance(function, Mapping) else None
    return [spec for spec in tools if spec["function"]["name"] == tool_choice]


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def respond(
    messages: Sequence[Message],
    tools: Sequence[ToolSpec] | None,
    output_schema: Mapping[str, Any] | None = None,
) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """The test model's reply to ``messages``: its text and its tool calls as (name, arguments).

    Pure and deterministic. Tool results after the last user message get a summary
    that quotes each; otherwise offered tools are each called once; otherwise a
    short reply echoes the user text. With ``output_schema`` an answer is instead a
    JSON value matching it (:func:`value_for`).
    """
    last_user = _last_user_index(messages)
    user_text = messages[last_user]["content"] if last_user >= 0 else ""
    results = [m for m in messages[last_user + 1 :] if m["role"] == "tool"]
    if output_schema is not None and (results or not tools):
        return json.dumps(value_for(output_schema, user_text)), []
    if results:
        parts = [
            f"I called {r['name']}: {_clip(r['content'], _RESULT_LIMIT) or '(no output)'}."
            for r in results
        ]
        return " ".join(parts), []
    if tools:
        # .get: the loopback server hands us raw request tools, which may lack parameters.
        functions = [spec["function"] for spec in tools]
        calls = [
            (function["name"], arguments_for(function.get("parameters", {}), user_text))
            for function in functions
        ]
        return "", calls
    words = user_text.split()
    if not words:
        return "Hello! I am the test model. Ask me anything.", []
    echo = " ".join(words[:_ECHO_WORDS]) + (" …" if len(words) > _ECHO_WORDS else "")
    return f"You said: {echo}", []


def split_text(text: str, chunks: int | None = None) -> list[str]:
    """Split ``text`` into pieces that join back to it exactly.

    ``chunks=None`` gives one piece per word (each keeping its trailing space);
    otherwise ``chunks`` pieces of near-equal length (fewer if the text is shorter).
    """
    if not text:
        return []
    if chunks is None:
        pieces: list[str] = []
        start = 0
        length = len(text)
        while start < length:
            end = start
            while end < length and text[end] == " ":
                end += 1
            while end < length and text[end] != " ":
                end += 1
            while end < length and text[end] == " ":
                end += 1
            pieces.append(text[start:end])
            start = end
        return pieces
    count = max(1, min(chunks, len(text)))
    size, extra = divmod(len(text), count)
    pieces = []
    start = 0
    for index in range(count):
        end = start + size + (1 if index < extra else 0)
        pieces.append(text[start:end])
        start = end
    return pieces


class TestModelClient(ModelClient):
    """The embedded offline model (``client("test")``): replies come from :func:`respond`.

    Text streams one word per chunk (or ``chunks`` pieces), with ``delay`` seconds
    between chunks; every chunk is preceded by an event-loop yield so a cancel can land
    between any two.
    """

    __test__ = False  # not a pytest test class, despite the name
    provider = "test"

    def __init__(self, model: str = "test", *, delay: float = 0.0, chunks: int | None = None):
        super().__init__(model)
        if delay < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {delay}")
        if chunks is not None and chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        self.delay = delay
        self.chunks = chunks

    @property
    def host(self) -> str:
        return EMBEDDED

    def fork(self) -> Self:
        return type(self)(self.model, delay=self.delay, chunks=self.chunks)

    async def stream_turn(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec] | None = None,
        *,
        stream: bool = True,
        request: TurnRequest | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        if request is None:
            text, calls = respond(messages, tools)
        else:
            text, calls = respond(
                messages, offered(tools, request.tool_choice), request.output_schema
            )
        # Ids are deterministic and unique across the conversation: turn number + position.
        turn = sum(1 for m in messages if m["role"] == "assistant")
        pieces: list[Chunk] = [TextDelta(piece) for piece in split_text(text, self.chunks)]
        for position, (name, arguments) in enumerate(calls):
            call: ToolCall = {
                "id": f"call_{turn}_{position}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            pieces.append(ToolCallDelta(call))
        for position, piece in enumerate(pieces):
            await asyncio.sleep(self.delay if position else 0)
            yield piece
        await asyncio.sleep(0)
        usage: Usage = {
            "input_tokens": sum(len(m["content"].split()) for m in messages),
            "output_tokens": len(pieces),
        }
        yield TurnDone(usage, "tool_calls" if calls else "stop")
