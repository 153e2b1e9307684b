"""A Gemini request in the chat shape: what the loopback server hands scripts and what
:attr:`~aimu.testing.server.records.RecordedRequest.messages` shows, so one script and
one assertion serve every wire. Imports nothing of the server (records use it)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["chat_view"]

_TOOL_MODES = {"AUTO": "auto", "ANY": "required", "NONE": "none", "VALIDATED": "auto"}


def _text(parts: Sequence[Mapping[str, Any]]) -> str:
    return "".join(
        str(p["text"]) for p in parts if isinstance(p.get("text"), str) and not p.get("thought")
    )


def _model_message(parts: Sequence[Mapping[str, Any]], index: int) -> dict[str, Any]:
    """A model content as an assistant message; its calls' ids by content and place
    (Gemini's own id where it gave one)."""
    calls: list[dict[str, Any]] = []
    for position, function in enumerate(_kind(parts, "functionCall")):
        calls.append({
            "id": str(function.get("id") or f"gemini_{index}_{position}"),
            "type": "function",
            "function": {
                "name": str(function.get("name", "")),
                "arguments": dict(function.get("args") or {}),
            },
        })
    message: dict[str, Any] = {"role": "assistant", "content": _text(parts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _kind(parts: Sequence[Mapping[str, Any]], kind: str) -> list[Mapping[str, Any]]:
    return [p[kind] for p in parts if isinstance(p.get(kind), Mapping)]


def _results(parts: Sequence[Mapping[str, Any]], asked: Sequence[str]) -> list[dict[str, Any]]:
    """``functionResponse`` parts as tool messages answering ``asked`` (ids) in order."""
    results: list[dict[str, Any]] = []
    for position, response in enumerate(_kind(parts, "functionResponse")):
        answer = response.get("response")
        output = answer.get("output") if isinstance(answer, Mapping) else None
        fallback = asked[position] if position < len(asked) else ""
        results.append({
            "role": "tool",
            "tool_call_id": str(response.get("id") or fallback),
            "name": str(response.get("name", "")),
            "content": output if isinstance(output, str) else json.dumps(answer),
        })
    return results


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    system = body.get("systemInstruction")
    if isinstance(system, Mapping):
        parts = [p for p in system.get("parts") or () if isinstance(p, Mapping)]
        messages.append({"role": "system", "content": _text(parts)})
    asked: list[str] = []
    for index, content in enumerate(body.get("contents") or ()):
        if not isinstance(content, Mapping):
            continue
        parts = [p for p in content.get("parts") or () if isinstance(p, Mapping)]
        if content.get("role") == "model":
            message = _model_message(parts, index)
            asked = [call["id"] for call in message.get("tool_calls", ())]
            messages.append(message)
            continue
        messages += _results(parts, asked)
        text = _text(parts)
        if text or any("inlineData" in p for p in parts):
            messages.append({"role": "user", "content": text})
    return messages


def chat_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """``messages``, ``tools``, ``tool_choice`` and ``response_format`` in the chat shape."""
    view: dict[str, Any] = {"messages": _messages(body), "tools": _tools(body)}
    tool_config = body.get("toolConfig")
    calling = tool_config.get("functionCallingConfig") if isinstance(tool_config, Mapping) else None
    if isinstance(calling, Mapping):
        allowed = calling.get("allowedFunctionNames")
        if isinstance(allowed, list) and len(allowed) == 1:
            view["tool_choice"] = allowed[0]
        elif calling.get("mode") in _TOOL_MODES:
            view["tool_choice"] = _TOOL_MODES[calling["mode"]]
    config = body.get("generationConfig")
    if isinstance(config, Mapping):
        schema = (
            config.get("responseJsonSchema") or config.get("response_json_schema")
            or config.get("responseSchema")
        )
        if isinstance(schema, Mapping):
            view["response_format"] = {
                "type": "json_schema", "json_schema": {"schema": dict(schema)}
            }
        elif config.get("responseMimeType") == "application/json":
            view["response_format"] = {"type": "json_object"}
    return view


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    specs: list[dict[str, Any]] = []
    for tool in body.get("tools") or ():
        declarations = tool.get("functionDeclarations") if isinstance(tool, Mapping) else None
        for declaration in declarations or ():
            if not isinstance(declaration, Mapping):
                continue
            # Google's JSON takes a field's proto name too (the SDK sends this one so).
            schema = (
                declaration.get("parametersJsonSchema")
                or declaration.get("parameters_json_schema")
                or declaration.get("parameters")
            )
            specs.append({
                "type": "function",
                "function": {
                    "name": str(declaration.get("name", "")),
                    "description": str(declaration.get("description", "")),
                    "parameters": dict(schema) if isinstance(schema, Mapping) else {},
                },
            })
    return specs
