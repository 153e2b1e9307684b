"""The transcript: chat messages as plain JSON-serialisable dicts, defined once.

The shape is the Ollama/OpenAI chat shape. Assistant tool calls carry a stable ``id``
and their arguments as a dict; tool results carry the call's id and the tool name.
Keys starting with ``aimu_`` are ours (``aimu_partial`` marks a turn cut short by a
stop, ``aimu_sent`` a user message sent into a running run (``send()``: it joins the
task, it does not start one), ``aimu_stop_reason`` an answer the model's server cut
off, e.g. ``"length"``, ``aimu_model`` the model that wrote a reply, ``aimu_native``
what one wire needs back unchanged) and are never sent to a provider as they are: see
:func:`wire_view` and :func:`native_data`.

``validate`` checks a whole transcript, ``answer_open_calls`` answers every dangling tool call
with a deterministic "cancelled" result (idempotently), ``copy_messages`` copies so
that no dict is ever shared with a caller.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NotRequired, TypeAlias, TypedDict, cast

from aimu.aio._echo import echo
from aimu.aio.errors import TranscriptError

__all__ = [
    "CANCELLED_RESULT",
    "CORRECTION_PREFIX",
    "MAX_DEPTH",
    "AssistantMessage",
    "FunctionSpec",
    "JSONValue",
    "Message",
    "SystemMessage",
    "ToolCall",
    "ToolCallFunction",
    "ToolMessage",
    "ToolSpec",
    "Usage",
    "UserMessage",
    "add_usage",
    "answer_open_calls",
    "check_text",
    "copy_messages",
    "dangling_calls",
    "is_correction",
    "native_data",
    "validate",
    "wire_view",
    "zero_usage",
]

JSONValue: TypeAlias = (
    "str | int | float | bool | list[JSONValue] | dict[str, JSONValue] | None"
)

#: Content of the result given to a tool call that never finished.
CANCELLED_RESULT = "[cancelled before it finished]"

#: How the user message correcting an invalid typed answer (``output_type=``) begins.
CORRECTION_PREFIX = "Your answer is not valid output."


class ToolCallFunction(TypedDict):
    name: str
    arguments: dict[str, Any]


class ToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class SystemMessage(TypedDict):
    role: Literal["system"]
    content: str


class UserMessage(TypedDict):
    role: Literal["user"]
    content: str
    images: NotRequired[list[str]]
    """Images beside the text, as ``data:image/...;base64,...`` URLs."""
    aimu_sent: NotRequired[bool | str]
    """Sent into a running run (``send()``): it joins that task; kept, never sent. A
    string: the id of the stored input it was (see ``aimu.aio.store.PendingInput``)."""


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: str
    tool_calls: NotRequired[list[ToolCall]]
    thinking: NotRequired[str]
    aimu_partial: NotRequired[bool]
    aimu_stop_reason: NotRequired[str]
    aimu_model: NotRequired[str]
    """The model that wrote this reply, as ``"provider:model"``; kept, never sent."""
    aimu_agent: NotRequired[str]
    """The agent that spoke, in a session whose agents hand the conversation over
    (``handoffs=``); kept, never sent."""
    aimu_native: NotRequired[dict[str, Any]]
    """Provider-native data of a finished reply that its wire needs back unchanged
    (signed thinking blocks, thought signatures, reasoning items): ``{"wire": NAME, ...}``.
    Only a provider of that wire sends it (:func:`native_data`); others drop it."""


class ToolMessage(TypedDict):
    role: Literal["tool"]
    content: str
    tool_call_id: str
    name: str


Message: TypeAlias = SystemMessage | UserMessage | AssistantMessage | ToolMessage


class FunctionSpec(TypedDict):
    name: str
    description: str
    parameters: dict[str, Any]


class ToolSpec(TypedDict):
    """A tool as offered to a model: the JSON-schema shape both protocols accept."""

    type: Literal["function"]
    function: FunctionSpec


class Usage(TypedDict):
    """Tokens a request (or a run) took. ``cached_input_tokens``, there only when the
    server said some were: how many of ``input_tokens`` it read from its prompt cache."""

    input_tokens: int
    output_tokens: int
    cached_input_tokens: NotRequired[int]


def zero_usage() -> Usage:
    return {"input_tokens": 0, "output_tokens": 0}


def add_usage(total: Usage, more: Usage) -> None:
    """Add ``more`` into ``total`` in place."""
    total["input_tokens"] += more["input_tokens"]
    total["output_tokens"] += more["output_tokens"]
    cached = more.get("cached_input_tokens")
    if cached:
        total["cached_input_tokens"] = total.get("cached_input_tokens", 0) + cached


_ROLES = ("system", "user", "assistant", "tool")
_KEYS: dict[str, frozenset[str]] = {
    "system": frozenset({"role", "content"}),
    "user": frozenset({"role", "content", "images", "aimu_sent"}),
    "assistant": frozenset(
        {
            "role", "content", "tool_calls", "thinking",
            "aimu_partial", "aimu_stop_reason", "aimu_model", "aimu_native", "aimu_agent",
        }
    ),
    "tool": frozenset({"role", "content", "tool_call_id", "name"}),
}


#: How deep tool-call arguments may nest (JSON encoders recurse; stores must write them).
MAX_DEPTH = 200
_SURROGATE = re.compile("[\ud800-\udfff]")


def _fail(index: int, message: str) -> TranscriptError:
    return TranscriptError(f"message {index}: {message}", index=index)


def _encodable(text: str) -> bool:
    """True if ``text`` is valid Unicode text (no unpaired surrogate), so UTF-8 can hold it."""
    return text.isascii() or _SURROGATE.search(text) is None


def _surrogate_problem(value: str, where: str) -> str | None:
    """What is wrong with ``value`` if it holds a lone surrogate, else None."""
    if _encodable(value):
        return None
    found = _SURROGATE.search(value)
    at = found.start() if found is not None else 0
    near = echo(value[max(0, at - 20) : at + 1])
    return (
        f"{where} holds a lone surrogate code point at character {at} (after {near}), which "
        "no UTF-8 store can hold; replace it (e.g. with U+FFFD)"
    )


def _check_text(value: str, index: int, where: str) -> None:
    problem = _surrogate_problem(value, where)
    if problem is not None:
        raise _fail(index, problem)


def check_text(value: str, where: str) -> None:
    """Raise :class:`TranscriptError` (a ``ValueError``) naming ``where`` if ``value``
    is not valid Unicode text: the rule of :func:`validate`, for text that enters a run
    (a task, a sent text) before it becomes a message."""
    problem = _surrogate_problem(value, where)
    if problem is not None:
        raise TranscriptError(problem)


def _check_json(value: object, index: int, where: str) -> None:
    """Raise unless ``value`` is plain, encodable, acyclic JSON data at most MAX_DEPTH deep.

    Iterative, so a 50,000-deep value is refused, not a RecursionError.
    """
    stack: list[tuple[object, int]] = [(value, 0)]
    open_containers: set[int] = set()
    exits: list[tuple[int, int]] = []  # (stack height to close at, container id)
    while stack:
        while exits and len(stack) <= exits[-1][0]:
            open_containers.discard(exits.pop()[1])
        item, depth = stack.pop()
        if item is None or isinstance(item, bool | int):
            continue
        if isinstance(item, str):
            _check_text(item, index, where)
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                raise _fail(index, f"{where} holds a non-finite number")
            continue
        if not isinstance(item, list | dict):
            raise _fail(index, f"{where} holds {type(item).__name__}, which is not JSON data")
        if depth >= MAX_DEPTH:
            raise _fail(index, f"{where} nests deeper than {MAX_DEPTH} levels")
        if id(item) in open_containers:
            raise _fail(index, f"{where} contains itself (a cycle), which JSON cannot hold")
        open_containers.add(id(item))
        exits.append((len(stack), id(item)))
        if isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    raise _fail(index, f"{where} has a non-string key {echo(key)}")
                _check_text(key, index, where)
                stack.append((child, depth + 1))
        else:
            stack.extend((child, depth + 1) for child in item)


def _check_string(message: Mapping[str, Any], key: str, index: int, role: str) -> str:
    value = message.get(key)
    if not isinstance(value, str):
        raise _fail(index, f"{role} message needs string {key!r}, got {echo(value)}")
    _check_text(value, index, f"{key!r}")
    return value


def _check_non_empty(mapping: Mapping[str, Any], key: str, index: int, where: str) -> str:
    """``mapping[key]``, checked to be a non-empty string of valid text."""
    value = mapping.get(key)
    if not isinstance(value, str) or not value:
        raise _fail(index, f"{where} needs a non-empty string {key!r}, got {echo(value)}")
    _check_text(value, index, f"{where}.{key}")
    return value


def _check_tool_call(call: object, index: int, position: int) -> str:
    where = f"tool_calls[{position}]"
    if not isinstance(call, Mapping):
        raise _fail(index, f"{where} must be a dict, got {type(call).__name__}")
    call_id = _check_non_empty(call, "id", index, where)
    if call.get("type", "function") != "function":
        raise _fail(index, f"{where} has type {echo(call.get('type'))}; only 'function' exists")
    function = call.get("function")
    if not isinstance(function, Mapping):
        raise _fail(index, f"{where} needs a 'function' dict with 'name' and 'arguments'")
    _check_non_empty(function, "name", index, f"{where}.function")
    arguments = function.get("arguments")
    if not isinstance(arguments, dict):
        raise _fail(
            index, f"{where}.function.arguments must be a dict, got {type(arguments).__name__}"
        )
    _check_json(arguments, index, f"{where}.function.arguments")
    return call_id


def validate(messages: object) -> None:
    """Raise :class:`TranscriptError` (a ``ValueError``) naming the first bad message.

    Checked: every message is a dict with a known role, the keys that role allows and
    string content; every string valid Unicode (storable as UTF-8); a system message
    only first; tool calls well formed, their arguments JSON data without cycles and at
    most :data:`MAX_DEPTH` deep, with unique ids within their turn; every tool result
    answers a call of the assistant turn before it, once. Bad values are echoed
    bounded. Tool calls still unanswered are allowed: :func:`answer_open_calls` answers them.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise TranscriptError(f"a transcript is a list of messages, got {type(messages).__name__}")
    open_calls: dict[str, str] = {}  # id -> tool name, for the latest assistant turn
    answered: set[str] = set()
    for index, message in enumerate(messages):
        role = _check_shape(message, index)
        if role == "assistant":
            open_calls, answered = _check_assistant(message, index), set()
        elif role == "tool":
            answered.add(_check_tool_result(message, index, open_calls, answered))
        else:
            open_calls, answered = {}, set()


def _check_shape(message: object, index: int) -> str:
    """A dict with a known role, only the keys that role allows, string content; its role."""
    if not isinstance(message, Mapping):
        raise _fail(index, f"must be a dict, got {type(message).__name__}")
    role = message.get("role")
    if role not in _ROLES:
        raise _fail(index, f"unknown role {echo(role)}; expected one of {', '.join(_ROLES)}")
    extra = set(message) - _KEYS[role]
    if extra:
        shown = ", ".join(echo(key) for key in sorted(map(str, extra))[:5])
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise _fail(index, f"{role} message has unexpected keys {shown}{more}")
    _check_string(message, "content", index, role)
    if role == "user" and "images" in message:
        _check_images(message["images"], index)
    if role == "user" and not isinstance(message.get("aimu_sent", False), bool | str):
        raise _fail(index, "'aimu_sent' must be a bool or an input id")
    if role == "system" and index != 0:
        raise _fail(index, "a system message may only be the first message")
    return str(role)


def _check_images(images: object, index: int) -> None:
    if not isinstance(images, list) or not all(
        isinstance(url, str) and url.startswith("data:image/") and ";base64," in url
        for url in images
    ):
        raise _fail(index, "'images' must be a list of data:image/...;base64,... URLs")


def _check_assistant(message: Mapping[str, Any], index: int) -> dict[str, str]:
    """Well-formed tool calls with ids unique in the turn; returns id -> tool name."""
    calls = message.get("tool_calls", [])
    if not isinstance(calls, list):
        raise _fail(index, "'tool_calls' must be a list")
    open_calls: dict[str, str] = {}
    for position, call in enumerate(calls):
        call_id = _check_tool_call(call, index, position)
        if call_id in open_calls:
            raise _fail(index, f"tool call id {echo(call_id)} is used twice in one turn")
        open_calls[call_id] = call["function"]["name"]
    if "thinking" in message:
        _check_string(message, "thinking", index, "assistant")
    if not isinstance(message.get("aimu_partial", False), bool):
        raise _fail(index, "'aimu_partial' must be a bool")
    if "aimu_stop_reason" in message:
        _check_string(message, "aimu_stop_reason", index, "assistant")
    if "aimu_model" in message:
        _check_string(message, "aimu_model", index, "assistant")
    if "aimu_agent" in message:
        _check_string(message, "aimu_agent", index, "assistant")
    if "aimu_native" in message:
        native = message["aimu_native"]
        if not isinstance(native, dict) or not isinstance(native.get("wire"), str):
            raise _fail(index, "'aimu_native' must be an object with a string 'wire'")
    return open_calls


def _check_tool_result(
    message: Mapping[str, Any], index: int, open_calls: dict[str, str], answered: set[str]
) -> str:
    """A result answering, once and by the right name, a call of the turn before it."""
    call_id = _check_string(message, "tool_call_id", index, "tool")
    name = _check_string(message, "name", index, "tool")
    if call_id not in open_calls:
        raise _fail(
            index,
            f"tool result for {echo(call_id)} answers no tool call of the assistant "
            "turn before it",
        )
    if call_id in answered:
        raise _fail(index, f"tool call {echo(call_id)} already has a result")
    if open_calls[call_id] != name:
        raise _fail(
            index,
            f"tool result names {echo(name)} but call {echo(call_id)} was to "
            f"{echo(open_calls[call_id])}",
        )
    return call_id


def dangling_calls(messages: Sequence[Message], start: int = 0) -> list[tuple[int, ToolCall]]:
    """Tool calls without a result, as (index of the assistant message, call)."""
    found: list[tuple[int, ToolCall]] = []
    pending: dict[str, tuple[int, ToolCall]] = {}
    for index in range(start, len(messages)):
        message = messages[index]
        role = message["role"]
        if role == "assistant":
            found.extend(pending.values())
            pending = {
                call["id"]: (index, call)
                for call in cast(AssistantMessage, message).get("tool_calls", ())
            }
        elif role == "tool":
            pending.pop(cast(ToolMessage, message)["tool_call_id"], None)
        elif pending:
            found.extend(pending.values())
            pending = {}
    found.extend(pending.values())
    return found


def cancelled_result(call: ToolCall, content: str = CANCELLED_RESULT) -> ToolMessage:
    """The deterministic result recorded for a call that never finished."""
    return {
        "role": "tool",
        "content": content,
        "tool_call_id": call["id"],
        "name": call["function"]["name"],
    }


def answer_open_calls(
    messages: list[Message],
    content: str | Callable[[int, ToolCall], str | None] = CANCELLED_RESULT,
    *,
    start: int = 0,
) -> list[ToolMessage]:
    """Answer every dangling tool call in place; return the results it added.

    Each result goes right after the results its assistant turn already has, so the
    transcript stays valid. Idempotent: a settled transcript is left unchanged.
    ``start`` skips messages known to be settled already. ``content`` may be a function
    of (index of the assistant message, call) giving each result's text, or None to
    leave that call dangling.
    """
    dangling = dangling_calls(messages, start)
    if not dangling:
        return []
    text_of = content if callable(content) else (lambda _index, _call: content)
    added: list[ToolMessage] = []
    # Insert from the back so earlier indices stay true.
    by_turn: dict[int, list[ToolMessage]] = {}
    for index, call in dangling:
        text = text_of(index, call)
        if text is not None:
            by_turn.setdefault(index, []).append(cancelled_result(call, text))
    for index in sorted(by_turn, reverse=True):
        end = index + 1
        while end < len(messages) and messages[end]["role"] == "tool":
            end += 1
        results = by_turn[index]
        messages[end:end] = results
        added[:0] = results
    return added


def _copy_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _copy_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy_json(item) for item in value]
    return value


def copy_messages(messages: Iterable[Mapping[str, Any]]) -> list[Message]:
    """A deep copy: the result shares no dict or list with ``messages``."""
    return [cast(Message, _copy_json(dict(message))) for message in messages]


def wire_view(message: Message) -> dict[str, Any]:
    """The message as a provider should see it: our ``aimu_`` keys left out."""
    if not any(key.startswith("aimu_") for key in message):
        return cast(dict[str, Any], message)
    return {key: value for key, value in message.items() if not key.startswith("aimu_")}


def native_data(message: Message, wire: str) -> dict[str, Any] | None:
    """The reply's ``aimu_native`` data if it was written on ``wire``, else None: what a
    provider of that wire sends back unchanged (another wire drops it)."""
    native = message.get("aimu_native")
    if isinstance(native, dict) and native.get("wire") == wire:
        return native
    return None


def dumps(message: Message) -> str:
    """One message as compact JSON (the form stores write)."""
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"))


def is_correction(message: Message) -> bool:
    """True for the user message that corrects an invalid typed answer (not a task)."""
    return message["role"] == "user" and message["content"].startswith(CORRECTION_PREFIX)
