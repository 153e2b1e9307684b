"""The Ollama protocol of the loopback server: ``/api/chat`` as NDJSON, and its info endpoints."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from aimu.testing.script import ScriptedCall, Turn, split_text
from aimu.testing.server.wire import (
    Protocol,
    Reply,
    ServerView,
    Wire,
    json_bytes,
    output_tokens,
)

__all__ = ["CONTEXT_LENGTH", "OLLAMA", "OLLAMA_VERSION", "OllamaWire"]

OLLAMA_VERSION = "0.6.0"


class OllamaWire(Wire):
    protocol = "ollama"
    stream_content_type = "application/x-ndjson"

    def streamed(self) -> bool:
        return self.body.get("stream", True) is not False

    def error_body(self, status: int, message: str) -> bytes:
        return json_bytes({"error": message})

    def _line(self, message: Mapping[str, Any], **extra: Any) -> bytes:
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        line = {
            "model": self.model,
            "created_at": created,
            "message": {"role": "assistant", "content": "", **message},
            "done": False,
            **extra,
        }
        return json_bytes(line) + b"\n"

    @staticmethod
    def _calls(calls: Sequence[ScriptedCall]) -> list[dict[str, Any]]:
        wire: list[dict[str, Any]] = []
        for call in calls:
            item: dict[str, Any] = {
                "function": {"name": call.name, "arguments": dict(call.arguments)}
            }
            if call.id is not None:
                item["id"] = call.id
            wire.append(item)
        return wire

    def _done_fields(self, turn: Turn) -> dict[str, Any]:
        return {
            "done": True,
            "done_reason": turn.stop_reason or "stop",  # Ollama says "stop" after tool calls too
            "total_duration": 0,
            "load_duration": 0,
            "prompt_eval_count": turn.input_tokens,
            "prompt_eval_duration": 0,
            "eval_count": output_tokens(turn),
            "eval_duration": 0,
        }

    def chunks(self, turn: Turn) -> list[bytes]:
        lines: list[bytes] = []
        if turn.thinking:
            lines.append(self._line({"thinking": turn.thinking}))
        lines += [self._line({"content": piece}) for piece in split_text(turn.text, turn.chunks)]
        if turn.tool_calls:
            lines.append(self._line({"tool_calls": self._calls(turn.tool_calls)}))
        return lines

    def final(self, turn: Turn) -> list[bytes]:
        return [self._line({}, **self._done_fields(turn))]

    def bad_line(self) -> bytes:
        return b'{"model": this is not JSON\n'

    def whole(self, turn: Turn, *, finished: bool = True) -> bytes:
        message: dict[str, Any] = {"content": turn.text}
        if turn.thinking:
            message["thinking"] = turn.thinking
        if turn.tool_calls:
            message["tool_calls"] = self._calls(turn.tool_calls)
        extra = self._done_fields(turn) if finished else {}
        return self._line(message, **extra).rstrip(b"\n")


def _tags(server: ServerView, body: Mapping[str, Any]) -> Reply:
    models = [
        {
            "name": name,
            "model": name,
            "modified_at": "2024-01-01T00:00:00Z",
            "size": 4_000_000,
            "digest": "0" * 64,
            "details": {"format": "gguf", "family": "loopback", "parameter_size": "0B"},
        }
        for name in server.models
    ]
    return Reply(json_bytes({"models": models}))


#: The context length ``/api/show`` reports for every model.
CONTEXT_LENGTH = 4096


def _show(server: ServerView, body: Mapping[str, Any]) -> Reply:
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        return Reply(json_bytes({"error": "model is required"}), status=400)
    if name in server.missing_models or name in server.not_pulled:
        return Reply(json_bytes({"error": f"model '{name}' not found"}), status=404)
    return Reply(json_bytes({
        "modelfile": f"FROM {name}",
        "parameters": "",
        "template": "{{ .Prompt }}",
        "details": {"format": "gguf", "family": "loopback", "parameter_size": "0B",
                    "quantization_level": "Q4_0"},
        "model_info": {"general.architecture": "loopback",
                       "loopback.context_length": CONTEXT_LENGTH},
        "capabilities": ["completion", "tools", "vision"],
    }))


def _pull(server: ServerView, body: Mapping[str, Any]) -> Reply:
    """A pull's progress as NDJSON lines (manifest, one layer in four steps, success),
    after which the model is on the server; a model in ``missing_models`` gets Ollama's
    error line."""
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        return Reply(json_bytes({"error": "model is required"}), status=400)
    if name in server.missing_models:
        return Reply(json_bytes({"error": "pull model manifest: file does not exist"}),
                     status=500)
    total = 4_000_000
    lines: list[dict[str, Any]] = [{"status": "pulling manifest"}]
    lines += [
        {"status": f"pulling {'0' * 12}", "digest": "sha256:" + "0" * 64, "total": total,
         "completed": total * step // 4}
        for step in range(5)
    ]
    lines += [{"status": "verifying sha256 digest"}, {"status": "writing manifest"},
              {"status": "success"}]
    server.models[name] = None  # type: ignore[index]  # pulled: listed from now on
    server.not_pulled.discard(name)
    return Reply(b"".join(json_bytes(line) + b"\n" for line in lines),
                 content_type="application/x-ndjson")


def _version(server: ServerView, body: Mapping[str, Any]) -> Reply:
    return Reply(json_bytes({"version": OLLAMA_VERSION}))


def _running(server: ServerView, body: Mapping[str, Any]) -> Reply:
    return Reply(b"Ollama is running", content_type="text/plain; charset=utf-8")


OLLAMA = Protocol(
    "ollama",
    "/api/chat",
    OllamaWire,
    {
        "/": ("GET", _running),
        "/api/version": ("GET", _version),
        "/api/tags": ("GET", _tags),
        "/api/show": ("POST", _show),
        "/api/pull": ("POST", _pull),
    },
)
