"""The Gemini protocol of the loopback server: ``/v1beta/models/{model}:generateContent``
and ``:streamGenerateContent?alt=sse`` (under ``/v1/models/`` too).

A scripted turn goes out as ``GenerateContentResponse`` objects: thought parts
(``thought: true``), text parts, one ``functionCall`` part per call, then a last one with
the ``finishReason`` and ``usageMetadata``. Like Gemini 3, replies are signed: the first
function call, or else (for a turn with thinking) a last empty text part, carries a
``thoughtSignature``, and a
request is refused (400) whose current turn has a function call without one, or that
sends back a signature this server did not give (or one of the placeholders Gemini's
docs allow). It refuses what Gemini refuses: a ``functionCall`` turn not followed by a
``functionResponse`` turn answering each call by name and in order, a response without
a call, a part that is not one kind of data, an image that is not one.

A turn's ``stop_reason`` may be aimu's word (``"length"``) or Gemini's own finish
reason (``"SAFETY"``, ``"RECITATION"``, ``"MALFORMED_FUNCTION_CALL"``: the turn's text is
then the call Gemini could not form); ``"blocked:SAFETY"`` blocks the prompt
(``promptFeedback.blockReason``). Scripts get the request body with, beside Gemini's
own keys, its transcript in the chat shape as ``messages``, its tools as ``tools``
(OpenAI's shape), ``tool_choice`` and ``response_format``, so one script serves every
wire.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import unquote

from aimu.aio import _sse as sse
from aimu.testing.script import ScriptedCall, Turn, split_text
from aimu.testing.server.gemini_chat import chat_view
from aimu.testing.server.wire import Protocol, Wire, json_bytes, output_tokens

__all__ = ["GEMINI", "PLACEHOLDER_SIGNATURES", "GeminiWire", "is_gemini_path"]

PREFIX = "/v1beta/models/"
_V1 = "/v1/models/"
_STREAM = ":streamGenerateContent"
_WHOLE = ":generateContent"
#: Signatures Gemini accepts for function calls it did not write (its docs name them).
PLACEHOLDER_SIGNATURES = frozenset(
    {"skip_thought_signature_validator", "context_engineering_is_the_way_to_go"}
)
_SIGNED = b"aimu-loopback-thought:"
_STATUS = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
    404: "NOT_FOUND", 405: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL",
    502: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}
_REASONS = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS",
            "content_filter": "SAFETY"}
_MALFORMED = "MALFORMED_FUNCTION_CALL"
_DATA_FIELDS = frozenset({
    "text", "inlineData", "functionCall", "functionResponse", "fileData", "executableCode",
    "codeExecutionResult",
})


def is_gemini_path(path: str) -> bool:
    """``/v1beta/...``, or a model's method under ``/v1/models/`` (OpenAI's paths there
    have no colon)."""
    return path.startswith(PREFIX) or (path.startswith(_V1) and ":" in path)


def _signature(response_id: str) -> str:
    return base64.b64encode(_SIGNED + response_id.encode()).decode()


def genuine(signature: object) -> bool:
    """A signature this server gave, or a placeholder Gemini accepts."""
    if signature in PLACEHOLDER_SIGNATURES:
        return True
    try:
        return base64.b64decode(str(signature), validate=True).startswith(_SIGNED)
    except (binascii.Error, ValueError):
        return False


class GeminiWire(Wire):
    protocol = "gemini"
    stream_content_type = sse.CONTENT_TYPE

    def __init__(
        self,
        model: str,
        body: Mapping[str, Any],
        call_ids: Iterator[int],
        *,
        stream: bool = True,
        sse_asked: bool = True,
    ) -> None:
        super().__init__(model, body, call_ids)
        self.stream = stream
        self.sse_asked = sse_asked
        self.response_id = f"loopback-{next(call_ids)}"

    def streamed(self) -> bool:
        return self.stream

    def error_body(self, status: int, message: str) -> bytes:
        error = {"code": status, "message": message, "status": _STATUS.get(status, "UNKNOWN")}
        return json_bytes({"error": error})

    def refusal(self) -> str | None:
        if self.stream and not self.sse_asked:
            return "this loopback server streams only as SSE: add ?alt=sse"
        return refusal(self.body)

    def script_view(self) -> Mapping[str, Any]:
        return {**self.body, **chat_view(self.body)}

    # -- framing ------------------------------------------------------------------------

    def _response(self, candidate: dict[str, Any] | None, **extra: Any) -> bytes:
        reply: dict[str, Any] = {}
        if candidate is not None:
            reply["candidates"] = [{**candidate, "index": 0}]
        reply.update(extra)
        reply["modelVersion"] = self.model
        reply["responseId"] = self.response_id
        return json_bytes(reply)

    def _event(self, parts: list[dict[str, Any]]) -> bytes:
        return sse.frame(self._response({"content": {"role": "model", "parts": parts}}))

    def _call_parts(self, calls: Sequence[ScriptedCall]) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = []
        for position, call in enumerate(calls):
            function: dict[str, Any] = {"name": call.name, "args": dict(call.arguments)}
            if call.id is not None:
                function["id"] = call.id
            part: dict[str, Any] = {"functionCall": function}
            if position == 0:
                part["thoughtSignature"] = _signature(self.response_id)
            parts.append(part)
        return parts

    def _usage(self, turn: Turn) -> dict[str, int]:
        output = output_tokens(turn)
        usage = {"promptTokenCount": turn.input_tokens, "candidatesTokenCount": output}
        thoughts = len(turn.thinking.split())
        if thoughts:
            usage["thoughtsTokenCount"] = thoughts
        usage["totalTokenCount"] = turn.input_tokens + output + thoughts
        return usage

    def _finish(self, turn: Turn, parts: list[dict[str, Any]]) -> bytes:
        """The last response: the finish reason, the usage, any parts still to send."""
        reason = turn.stop_reason or "stop"
        usage = self._usage(turn)
        if reason.startswith("blocked:"):
            feedback = {"blockReason": reason.partition(":")[2], "safetyRatings": _ratings()}
            return self._response(None, promptFeedback=feedback, usageMetadata=usage)
        finish = _REASONS.get(reason, reason)
        candidate: dict[str, Any] = {"finishReason": finish}
        if finish == _MALFORMED:
            candidate["finishMessage"] = f"Malformed function call: {turn.text}"
        elif finish not in ("STOP", "MAX_TOKENS"):
            candidate["safetyRatings"] = _ratings()
        elif turn.thinking and not turn.tool_calls:
            parts = [*parts, {"text": "", "thoughtSignature": _signature(self.response_id)}]
        if parts:
            candidate["content"] = {"role": "model", "parts": parts}
        return self._response(candidate, usageMetadata=usage)

    def chunks(self, turn: Turn) -> list[bytes]:
        if (turn.stop_reason or "").startswith("blocked:"):
            return []
        events: list[bytes] = []
        if turn.thinking:
            events.append(self._event([{"text": turn.thinking, "thought": True}]))
        if turn.stop_reason != _MALFORMED:
            pieces = split_text(turn.text, turn.chunks)
            events += [self._event([{"text": piece}]) for piece in pieces]
        events += [self._event([part]) for part in self._call_parts(turn.tool_calls)]
        return events

    def final(self, turn: Turn) -> list[bytes]:
        return [sse.frame(self._finish(turn, []))]

    def bad_line(self) -> bytes:
        return sse.frame(b'{"candidates": this is not JSON')

    def error_event(self, message: str) -> bytes:
        return sse.frame(self.error_body(500, message))

    def whole(self, turn: Turn, *, finished: bool = True) -> bytes:
        parts: list[dict[str, Any]] = []
        blocked = (turn.stop_reason or "").startswith("blocked:")
        if turn.thinking and not blocked:
            parts.append({"text": turn.thinking, "thought": True})
        if turn.text and turn.stop_reason != _MALFORMED and not blocked:
            parts.append({"text": turn.text})
        if not blocked:
            parts += self._call_parts(turn.tool_calls)
        if finished:
            return self._finish(turn, parts)
        return self._response({"content": {"role": "model", "parts": parts}})


def _ratings() -> list[dict[str, Any]]:
    return [{"category": "HARM_CATEGORY_DANGEROUS_CONTENT", "probability": "HIGH",
             "blocked": True}]


# -- what Gemini refuses --------------------------------------------------------------------


def _parts(content: Mapping[str, Any], kind: str) -> list[dict[str, Any]]:
    return [part[kind] for part in content.get("parts", ()) if isinstance(part.get(kind), dict)]


def _part_error(part: object, where: str) -> str | None:
    if not isinstance(part, Mapping):
        return f"{where} must be an object"
    data = [key for key in part if key in _DATA_FIELDS]
    if len(data) != 1:
        return f"{where} must hold exactly one of {', '.join(sorted(_DATA_FIELDS))}"
    if "thoughtSignature" in part and not genuine(part["thoughtSignature"]):
        return f"{where}: corrupted thought signature"
    inline = part.get("inlineData")
    if isinstance(inline, Mapping):
        mime = str(inline.get("mimeType", ""))
        try:
            data_bytes = base64.b64decode(str(inline.get("data", "")), validate=True)
        except (binascii.Error, ValueError):
            data_bytes = b""
        if not mime.startswith("image/") or not _is_image(data_bytes):
            return f"{where}: unable to process input image"
    return None


def _is_image(data: bytes) -> bool:
    magic = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a")
    return data.startswith(magic) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")


def _shape_error(body: Mapping[str, Any]) -> str | None:
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        return "* GenerateContentRequest.contents: contents is not specified"
    for index, content in enumerate(contents):
        where = f"* GenerateContentRequest.contents[{index}]"
        if not isinstance(content, Mapping):
            return f"{where}: must be an object"
        if content.get("role", "user") not in ("user", "model"):
            return f"{where}.role: Please use a valid role: user, model."
        parts = content.get("parts")
        if not isinstance(parts, list) or not parts:
            return f"{where}.parts: contents.parts must not be empty."
        for position, part in enumerate(parts):
            problem = _part_error(part, f"{where}.parts[{position}]")
            if problem is not None:
                return problem
    system = body.get("systemInstruction")
    if system is not None and (not isinstance(system, Mapping) or not system.get("parts")):
        return "* GenerateContentRequest.system_instruction: parts must not be empty."
    return None


def _pairing_error(contents: Sequence[Mapping[str, Any]]) -> str | None:
    """A function call turn must be answered by the next turn, each call by name in order."""
    for index, content in enumerate(contents):
        responses = _parts(content, "functionResponse")
        if responses and content.get("role", "user") == "model":
            return f"contents[{index}]: a functionResponse must be in a user turn"
        calls = _parts(content, "functionCall") if content.get("role") == "model" else []
        previous = contents[index - 1] if index else {}
        asked = _parts(previous, "functionCall") if previous.get("role") == "model" else []
        if responses and not asked:
            return (
                "Please ensure that function response turn comes immediately after a "
                "function call turn."
            )
        if asked:
            if len(responses) != len(asked):
                return (
                    "Please ensure that the number of function response parts is equal to "
                    "the number of function call parts of the function call turn."
                )
            names = [r.get("name") for r in responses]
            if names != [c.get("name") for c in asked]:
                return (
                    f"contents[{index}]: the function responses {names} do not answer the "
                    "function calls of the turn before, by name and in order"
                )
        if calls and index == len(contents) - 1:
            return (
                "Please ensure that function response turn comes immediately after a "
                "function call turn."
            )
    return None


def _signature_error(contents: Sequence[Mapping[str, Any]]) -> str | None:
    """Gemini 3: in the current turn (since the last user text), every step's first
    function call carries a thought signature."""
    start = 0
    for index, content in enumerate(contents):
        if content.get("role", "user") == "user" and any(
            "text" in part or "inlineData" in part for part in content.get("parts", ())
        ):
            start = index
    for index in range(start, len(contents)):
        content = contents[index]
        if content.get("role") != "model":
            continue
        first = next((p for p in content["parts"] if "functionCall" in p), None)
        if first is not None and "thoughtSignature" not in first:
            name = first["functionCall"].get("name")
            return (
                f"Function call `{name}` in the {index + 1}. content block is missing a "
                "`thought_signature`."
            )
    return None


def refusal(body: Mapping[str, Any]) -> str | None:
    """The 400 Gemini gives this request body, if it would give one."""
    problem = _shape_error(body)
    if problem is not None:
        return problem
    contents = body["contents"]
    return _pairing_error(contents) or _signature_error(contents)


class GeminiProtocol(Protocol):
    """Gemini's chat paths name the model and the method: ``/v1beta/models/M:method``."""

    def is_chat(self, path: str) -> bool:
        return is_gemini_path(path) and path.endswith((_STREAM, _WHOLE))

    def make_wire(self, target: str, body: Mapping[str, Any], call_ids: Iterator[int]) -> Wire:
        path, _, query = target.partition("?")
        name = unquote(path.removeprefix(PREFIX).removeprefix(_V1).rpartition(":")[0])
        return GeminiWire(
            name or "test", body, call_ids, stream=path.endswith(_STREAM),
            sse_asked="alt=sse" in query,
        )


GEMINI = GeminiProtocol("gemini", PREFIX + "{model}" + _STREAM, GeminiWire)
