"""The embedded ``test`` model as a loopback script: what the server answers by default.

:func:`default_script` hands each chat request, in the transcript's shape whichever
protocol it came in, to :mod:`aimu.aio.providers.test` (the offline demo model) and
turns its answer into a :class:`~aimu.testing.script.Turn`.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from aimu.testing.script import ScriptedCall, Turn

__all__ = ["default_script", "requested_schema"]


def _text_parts(content: object) -> str:
    """The text of OpenAI content parts (images left out)."""
    parts = content if isinstance(content, list) else []
    return "".join(
        str(part.get("text", "")) for part in parts
        if isinstance(part, Mapping) and part.get("type") == "text"
    )


def _canonical_messages(wire_messages: object) -> list[dict[str, Any]]:
    """Wire messages of either protocol in the transcript shape (arguments as dicts)."""
    messages: list[dict[str, Any]] = []
    #: OpenAI's tool results carry only the call's id: its name comes from the call.
    names: dict[str, str] = {}
    if not isinstance(wire_messages, list):
        return messages
    for raw in wire_messages:
        if not isinstance(raw, Mapping):
            continue
        content = raw.get("content")
        message: dict[str, Any] = {
            "role": raw.get("role", "user"),
            "content": content if isinstance(content, str) else _text_parts(content),
        }
        if message["role"] == "assistant" and raw.get("tool_calls"):
            calls = []
            for position, call in enumerate(raw["tool_calls"]):
                function = call.get("function", {}) if isinstance(call, Mapping) else {}
                arguments = function.get("arguments", {})
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments or "{}")
                    except json.JSONDecodeError:
                        arguments = {}
                identifier = str(call.get("id") or f"call_{len(messages)}_{position}")
                name = function.get("name", "")
                names[identifier] = str(name)
                calls.append(
                    {
                        "id": identifier,
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }
                )
            message["tool_calls"] = calls
        if message["role"] == "tool":
            call_id = message["tool_call_id"] = str(raw.get("tool_call_id", ""))
            message["name"] = str(raw.get("name") or raw.get("tool_name") or names.get(call_id, ""))
        messages.append(message)
    return messages


def _tool_specs(request: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Offered tools in the full ToolSpec shape, whatever keys the client left out."""
    specs: list[dict[str, Any]] = []
    for tool in request.get("tools") or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not function.get("name"):
            continue
        parameters = function.get("parameters")
        if not isinstance(parameters, Mapping):
            parameters = {"type": "object", "properties": {}}
        specs.append(
            {
                "type": "function",
                "function": {
                    "name": str(function["name"]),
                    "description": str(function.get("description") or ""),
                    "parameters": dict(parameters),
                },
            }
        )
    return specs


def _echo(messages: list[dict[str, Any]], tools: list[Any], *_: object) -> tuple[str, list[Any]]:
    said = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    return f"You said: {said}", []


def _all_tools(tools: list[dict[str, Any]], tool_choice: object) -> list[dict[str, Any]]:
    return tools


def requested_schema(request: Mapping[str, Any]) -> dict[str, Any] | None:
    """The JSON schema a chat request asks the reply to match: Ollama's ``format`` (a
    schema, or ``"json"``: any JSON), OpenAI's ``response_format``; None if it asks none."""
    wanted = request.get("format")
    if wanted is None:
        response_format = request.get("response_format")
        if not isinstance(response_format, Mapping) or response_format.get("type") == "text":
            return None
        wanted = response_format.get("json_schema")
        wanted = wanted.get("schema") if isinstance(wanted, Mapping) else "json"
    return dict(wanted) if isinstance(wanted, Mapping) else {}


def default_script(delay: float = 0.0) -> Callable[[Mapping[str, Any]], Turn]:
    """A script that answers like the embedded ``test`` model, ``delay`` s between chunks."""

    def answer(request: Mapping[str, Any]) -> Turn:
        try:
            # Imported lazily: the provider module is optional for this server.
            module = importlib.import_module("aimu.aio.providers.test")
            respond = getattr(module, "respond", _echo)
            offered = getattr(module, "offered", _all_tools)
        except ModuleNotFoundError as error:
            if error.name != "aimu.aio.providers.test":
                raise
            respond, offered = _echo, _all_tools
        text, calls = respond(
            _canonical_messages(request.get("messages")),
            offered(_tool_specs(request), request.get("tool_choice")),
            requested_schema(request),
        )
        scripted = tuple(ScriptedCall(name, dict(arguments)) for name, arguments in calls)
        return Turn(text=text, tool_calls=scripted, delay=delay)

    return answer
