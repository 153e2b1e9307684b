"""The OpenAI protocol of the loopback server: ``/v1/chat/completions`` (SSE when streamed)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from aimu.aio import _sse as sse
from aimu.testing.script import ScriptedCall, Turn, split_text
from aimu.testing.server.wire import (
    Protocol,
    Reply,
    ServerView,
    Wire,
    json_bytes,
    output_tokens,
)

__all__ = ["OPENAI", "OpenAIWire"]

_DONE = sse.frame(b"[DONE]")


class OpenAIWire(Wire):
    protocol = "openai"
    stream_content_type = sse.CONTENT_TYPE

    def __init__(self, model: str, body: Mapping[str, Any], call_ids: Iterator[int]) -> None:
        super().__init__(model, body, call_ids)
        self.completion_id = f"chatcmpl-{next(call_ids)}"
        self._role_sent = False

    def refusal(self) -> str | None:
        return _unanswered_tool_calls(self.body.get("messages"))

    def error_body(self, status: int, message: str) -> bytes:
        kind = "rate_limit_error" if status == 429 else "server_error"
        if status < 500 and status != 429:
            kind = "invalid_request_error"
        return json_bytes({"error": {"message": message, "type": kind, "code": status}})

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": kind,
            "created": int(time.time()),
            "model": self.model,
        }

    def _event(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        if not self._role_sent:
            delta = {"role": "assistant", **delta}
            self._role_sent = True
        chunk = self._envelope("chat.completion.chunk")
        chunk["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
        return sse.frame(json_bytes(chunk))

    def _ids(self, calls: Sequence[ScriptedCall]) -> list[str]:
        return [call.id or f"call_{next(self.call_ids)}" for call in calls]

    @staticmethod
    def _usage(turn: Turn) -> dict[str, int]:
        output = output_tokens(turn)
        return {
            "prompt_tokens": turn.input_tokens,
            "completion_tokens": output,
            "total_tokens": turn.input_tokens + output,
        }

    def chunks(self, turn: Turn) -> list[bytes]:
        events: list[bytes] = []
        if turn.thinking:
            events.append(self._event({"reasoning_content": turn.thinking}))
        events += [self._event({"content": piece}) for piece in split_text(turn.text, turn.chunks)]
        for index, (call, call_id) in enumerate(
            zip(turn.tool_calls, self._ids(turn.tool_calls), strict=True)
        ):
            arguments = json.dumps(dict(call.arguments), ensure_ascii=False)
            # Real servers stream arguments as fragments; clients must join them by index.
            first, *rest = split_text(arguments, max(2, math.ceil(len(arguments) / 16)))
            head = {
                "index": index,
                "id": call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": first},
            }
            events.append(self._event({"tool_calls": [head]}))
            for fragment in rest:
                fragment_delta = {"index": index, "function": {"arguments": fragment}}
                events.append(self._event({"tool_calls": [fragment_delta]}))
        return events

    def final(self, turn: Turn) -> list[bytes]:
        reason = turn.stop_reason or ("tool_calls" if turn.tool_calls else "stop")
        events = [self._event({}, reason)]
        options = self.body.get("stream_options")
        if isinstance(options, Mapping) and options.get("include_usage"):
            usage = self._envelope("chat.completion.chunk")
            usage["choices"] = []
            usage["usage"] = self._usage(turn)
            events.append(sse.frame(json_bytes(usage)))
        events.append(_DONE)
        return events

    def bad_line(self) -> bytes:
        return sse.frame(b'{"choices": this is not JSON')

    def error_event(self, message: str) -> bytes:
        return sse.frame(json_bytes({"error": {"message": message, "type": "server_error"}}))

    def whole(self, turn: Turn, *, finished: bool = True) -> bytes:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": turn.text if turn.text or not turn.tool_calls else None,
        }
        if turn.thinking:
            message["reasoning_content"] = turn.thinking
        if turn.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "name": call.name,
                        "arguments": json.dumps(dict(call.arguments), ensure_ascii=False),
                    },
                }
                for call, call_id in zip(turn.tool_calls, self._ids(turn.tool_calls), strict=True)
            ]
        reason = turn.stop_reason or ("tool_calls" if turn.tool_calls else "stop")
        reply = self._envelope("chat.completion")
        reply["choices"] = [
            {"index": 0, "message": message, "finish_reason": reason if finished else None}
        ]
        reply["usage"] = self._usage(turn)
        return json_bytes(reply)


def _unanswered_tool_calls(messages: object) -> str | None:
    """The 400 an OpenAI-compatible server gives a transcript with dangling tool calls."""
    if not isinstance(messages, list):
        return None
    pending: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in pending:
                return (
                    "messages with role 'tool' must be a response to a preceding message "
                    f"with 'tool_calls' (tool_call_id {call_id!r})"
                )
            pending.remove(call_id)
            continue
        if pending:
            break
        if role == "assistant":
            pending = [
                str(call.get("id")) for call in message.get("tool_calls") or ()
                if isinstance(call, Mapping)
            ]
    if pending:
        return (
            "an assistant message with 'tool_calls' must be followed by tool messages "
            "responding to each 'tool_call_id'; these had no response: " + ", ".join(pending)
        )
    return None


def _models(server: ServerView, body: Mapping[str, Any]) -> Reply:
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "aimu-loopback"}
        for name in server.models
    ]
    return Reply(json_bytes({"object": "list", "data": data}))


OPENAI = Protocol("openai", "/v1/chat/completions", OpenAIWire, {"/v1/models": ("GET", _models)})
