"""The Anthropic protocol of the loopback server: ``POST /v1/messages`` (SSE when streamed).

A streamed turn goes out as the published event types: ``message_start``, ``ping``,
``content_block_start`` / ``content_block_delta`` (``thinking_delta`` and
``signature_delta``, ``text_delta``, ``input_json_delta``) / ``content_block_stop``,
``message_delta`` (stop reason and usage) and ``message_stop``; the ``error_event`` and
``overloaded_event`` faults send an ``error`` event mid-stream. Thinking blocks are
signed, and a thinking block sent back with a signature that does not match its text is
refused, as are the requests the API refuses: a ``tool_use`` without its
``tool_result`` in the next user turn, a ``tool_result`` answering nothing, a
``system`` role in ``messages``, empty content, no ``max_tokens``, a final assistant
message (a prefill) ending in whitespace.

Scripts see the request in the chat shape (system prompt first, tool results as
``tool`` messages, tools as function specs), so the same script or test model answers
every protocol alike; the server's records keep the body as it came.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from aimu.aio import _sse as sse
from aimu.testing.script import ScriptedCall, Turn, split_text
from aimu.testing.server.wire import Protocol, Wire, json_bytes, output_tokens

__all__ = ["ANTHROPIC", "AnthropicWire", "sign"]

_KEY = b"aimu-loopback-thinking"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
_STOP_REASONS = {
    "stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens",
    "content_filter": "refusal",
}


def sign(thinking: str) -> str:
    """The signature the loopback server gives (and checks on) a thinking block."""
    digest = hmac.new(_KEY, thinking.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def _event(kind: str, data: Mapping[str, Any]) -> bytes:
    return sse.frame(json_bytes({"type": kind, **data}), event=kind)


def _block(
    index: int, start: Mapping[str, Any], delta: str, key: str, parts: Sequence[str]
) -> list[list[bytes]]:
    """A content block streamed as one piece per delta: its start goes with the first,
    its stop with the last."""
    pieces = [[_event("content_block_delta", {"index": index, "delta": {"type": delta, key: part}})]
              for part in parts]
    pieces[0].insert(0, _event("content_block_start", {"index": index, "content_block": start}))
    pieces[-1].append(_event("content_block_stop", {"index": index}))
    return pieces


class AnthropicWire(Wire):
    protocol = "anthropic"
    stream_content_type = sse.CONTENT_TYPE

    def __init__(self, model: str, body: Mapping[str, Any], call_ids: Iterator[int]) -> None:
        super().__init__(model, body, call_ids)
        self.message_id = f"msg_loopback_{next(call_ids)}"
        self._ids: list[str] | None = None
        self._caches: bool | None = None  # the request asks for prompt caching

    def refusal(self) -> str | None:
        return request_error(self.body)

    def script_view(self) -> dict[str, Any]:
        return chat_shape(self.body)

    def error_body(self, status: int, message: str) -> bytes:
        kind = _ERROR_TYPES.get(status, "api_error")
        return json_bytes({"type": "error", "error": {"type": kind, "message": message}})

    def error_event(self, message: str) -> bytes:
        return _event("error", {"error": {"type": "api_error", "message": message}})

    def overloaded_event(self, message: str) -> bytes:
        return _event("error", {"error": {"type": "overloaded_error", "message": message}})

    def _call_ids(self, calls: Sequence[ScriptedCall]) -> list[str]:
        if self._ids is None:
            self._ids = [call.id or f"toolu_{next(self.call_ids):08d}" for call in calls]
        return self._ids

    def _usage(self, turn: Turn, output: int) -> dict[str, int]:
        """The usage the server reports; with ``cache_control`` in the request, half of
        the input counts as read from the cache (the client adds them up again)."""
        if self._caches is None:
            self._caches = b"cache_control" in json_bytes(self.body)
        cached = turn.input_tokens // 2 if self._caches else 0
        return {
            "input_tokens": turn.input_tokens - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": output,
        }

    def _message(self, turn: Turn) -> dict[str, Any]:
        return {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": self._usage(turn, 1),
        }

    def chunks(self, turn: Turn) -> list[bytes]:
        """One piece per delta: a block's start goes with its first delta, its stop with
        its last; the message's start and a ping go with the first piece."""
        pieces: list[list[bytes]] = []
        index = 0
        if turn.thinking:
            pieces.append([
                _event("content_block_start", {
                    "index": index,
                    "content_block": {"type": "thinking", "thinking": "", "signature": ""},
                }),
                _event("content_block_delta", {
                    "index": index, "delta": {"type": "thinking_delta", "thinking": turn.thinking},
                }),
                _event("content_block_delta", {
                    "index": index,
                    "delta": {"type": "signature_delta", "signature": sign(turn.thinking)},
                }),
                _event("content_block_stop", {"index": index}),
            ])
            index += 1
        texts = split_text(turn.text, turn.chunks) if turn.text else []
        if texts:
            pieces += _block(index, {"type": "text", "text": ""}, "text_delta", "text", texts)
            index += 1
        for call, call_id in zip(turn.tool_calls, self._call_ids(turn.tool_calls), strict=True):
            arguments = json.dumps(dict(call.arguments), ensure_ascii=False)
            fragments = split_text(arguments, max(2, math.ceil(len(arguments) / 16)))
            start = {"type": "tool_use", "id": call_id, "name": call.name, "input": {}}
            pieces += _block(index, start, "input_json_delta", "partial_json", fragments)
            index += 1
        prelude = [
            _event("message_start", {"message": self._message(turn)}),
            _event("ping", {}),
        ]
        if not pieces:
            return [b"".join(prelude)]
        pieces[0] = prelude + pieces[0]
        return [b"".join(piece) for piece in pieces]

    def _stop_reason(self, turn: Turn) -> str:
        if turn.stop_reason is not None:
            return _STOP_REASONS.get(turn.stop_reason, turn.stop_reason)
        return "tool_use" if turn.tool_calls else "end_turn"

    def final(self, turn: Turn) -> list[bytes]:
        usage = self._usage(turn, output_tokens(turn))
        return [
            _event("message_delta", {
                "delta": {"stop_reason": self._stop_reason(turn), "stop_sequence": None},
                "usage": usage,
            }),
            _event("message_stop", {}),
        ]

    def bad_line(self) -> bytes:
        return b'event: content_block_delta\ndata: {"type": this is not JSON\n\n'

    def whole(self, turn: Turn, *, finished: bool = True) -> bytes:
        content: list[dict[str, Any]] = []
        if turn.thinking:
            content.append(
                {"type": "thinking", "thinking": turn.thinking, "signature": sign(turn.thinking)}
            )
        if turn.text:
            content.append({"type": "text", "text": turn.text})
        for call, call_id in zip(turn.tool_calls, self._call_ids(turn.tool_calls), strict=True):
            content.append({
                "type": "tool_use", "id": call_id, "name": call.name,
                "input": dict(call.arguments),
            })
        message = self._message(turn)
        message["content"] = content
        message["stop_reason"] = self._stop_reason(turn) if finished else None
        message["usage"] = self._usage(turn, output_tokens(turn))
        return json_bytes(message)


# -- what the API refuses -----------------------------------------------------------------


def _blocks(message: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return [block for block in content if isinstance(block, Mapping)]
    return []


def request_error(body: Mapping[str, Any]) -> str | None:
    """The 400 Anthropic's Messages API gives this request body, or None if it takes it."""
    if not isinstance(body.get("max_tokens"), int):
        return "max_tokens: Field required"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages: at least one message is required"
    pending: list[str] = []  # tool_use ids of the assistant turn before
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            return f"messages.{index}: Input should be an object"
        role = message.get("role")
        if role not in ("user", "assistant"):
            return (
                f"messages.{index}: Unexpected role {role!r}. The Messages API accepts a "
                "top-level `system` parameter, not \"system\" as an input message role."
            )
        blocks = _blocks(message)
        last = index == len(messages) - 1
        if not blocks and not (last and role == "assistant"):
            return f"messages.{index}: all messages must have non-empty content except for " \
                "the optional final assistant message"
        answered = [b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"]
        if pending and (role != "user" or set(pending) - set(answered)):
            missing = ", ".join(sorted(set(pending) - set(answered)))
            return (
                f"messages.{index}: `tool_use` ids were found without `tool_result` blocks "
                f"immediately after: {missing}. Each `tool_use` block must have a "
                "corresponding `tool_result` block in the next message."
            )
        if set(answered) - set(pending):
            stray = ", ".join(sorted(map(str, set(answered) - set(pending))))
            return (
                f"messages.{index}.content: unexpected `tool_use_id` found in `tool_result` "
                f"blocks: {stray}. Each `tool_result` block must have a corresponding "
                "`tool_use` block in the previous message."
            )
        problem = _block_error(index, role, blocks)
        if problem is not None:
            return problem
        pending = [str(b.get("id")) for b in blocks if b.get("type") == "tool_use"]
        if last and role == "assistant" and blocks and blocks[-1].get("type") == "text":
            text = str(blocks[-1].get("text"))
            if text != text.rstrip():
                return "final assistant content cannot end with trailing whitespace"
    return None


def _block_error(index: int, role: object, blocks: Sequence[Mapping[str, Any]]) -> str | None:
    where = f"messages.{index}.content"
    for position, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text" and not block.get("text"):
            return f"{where}.{position}.text: text content blocks must be non-empty"
        if kind in ("thinking", "redacted_thinking", "tool_use") and role != "assistant":
            return f"{where}.{position}: {kind} blocks are only allowed in assistant messages"
        if kind in ("tool_result", "image") and role != "user":
            return f"{where}.{position}: {kind} blocks are only allowed in user messages"
        if kind == "thinking":
            text, signature = block.get("thinking"), block.get("signature")
            if not isinstance(text, str) or not isinstance(signature, str) or not signature:
                return f"{where}.{position}.signature: Field required"
            if not hmac.compare_digest(signature, sign(text)):
                return f"{where}.{position}: Invalid `signature` in `thinking` block"
        if kind == "tool_use" and not isinstance(block.get("input"), Mapping):
            return f"{where}.{position}.input: Input should be a valid dictionary"
        if kind == "image" and _bad_image(block.get("source")):
            return f"{where}.{position}.source: Could not process image"
    return None


_IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")


def _bad_image(source: object) -> bool:
    if not isinstance(source, Mapping) or source.get("type") != "base64":
        return True
    if source.get("media_type") not in _IMAGE_TYPES:
        return True
    try:
        base64.b64decode(str(source.get("data")), validate=True)
    except ValueError:
        return True
    return False


# -- the request in the chat shape, for scripts -------------------------------------------


def chat_shape(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request as an OpenAI-style chat body: what scripts and the test model read."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, list):
        system = "".join(str(b.get("text", "")) for b in system if isinstance(b, Mapping))
    if isinstance(system, str) and system:
        messages.append({"role": "system", "content": system})
    names: dict[str, str] = {}
    for message in body.get("messages") or ():
        if not isinstance(message, Mapping):
            continue
        blocks = _blocks(message)
        text = "".join(str(b.get("text", "")) for b in blocks if b.get("type") == "text")
        if message.get("role") == "assistant":
            assistant: dict[str, Any] = {"role": "assistant", "content": text}
            uses = [b for b in blocks if b.get("type") == "tool_use"]
            names.update((str(b.get("id")), str(b.get("name"))) for b in uses)
            calls = [
                {"id": str(b.get("id")), "type": "function",
                 "function": {"name": str(b.get("name")), "arguments": b.get("input") or {}}}
                for b in uses
            ]
            if calls:
                assistant["tool_calls"] = calls
            messages.append(assistant)
            continue
        for block in blocks:
            if block.get("type") == "tool_result":
                call_id = str(block.get("tool_use_id"))
                content = block.get("content", "")
                if isinstance(content, list):
                    content = "".join(str(b.get("text", "")) for b in content
                                      if isinstance(b, Mapping))
                messages.append({"role": "tool", "tool_call_id": call_id,
                                 "name": names.get(call_id, ""), "content": str(content)})
        if text or not any(b.get("type") == "tool_result" for b in blocks):
            messages.append({"role": "user", "content": text})
    shaped: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    tools = [
        {"type": "function", "function": {"name": t.get("name"),
                                          "description": t.get("description", ""),
                                          "parameters": t.get("input_schema")}}
        for t in body.get("tools") or () if isinstance(t, Mapping)
    ]
    if tools:
        shaped["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping):
        kind = choice.get("type")
        shaped["tool_choice"] = {"any": "required", "tool": choice.get("name")}.get(
            str(kind), kind
        )
    output = body.get("output_config")
    form = output.get("format") if isinstance(output, Mapping) else None
    if isinstance(form, Mapping) and form.get("type") == "json_schema":
        shaped["response_format"] = {
            "type": "json_schema", "json_schema": {"name": "output", "schema": form.get("schema")}
        }
    return shaped


ANTHROPIC = Protocol("anthropic", "/v1/messages", AnthropicWire)
