"""``gemini:<model>``: Google's Gemini API (``generateContent``), over httpx.

The transcript is converted to Gemini's ``contents`` here and nowhere else: the system
prompt becomes ``systemInstruction``, the assistant is role ``model``, tool calls are
``functionCall`` parts and tool results ``functionResponse`` parts of the next user
turn, one for each call, in the calls' order (Gemini matches them by position and
name; it gives calls no ids, so ours are made from the reply's id and the call's place).
Thought summaries (parts with ``thought: true``) arrive as thinking and are not sent
back; the ``thoughtSignature`` of a reply's parts is kept as the message's
``aimu_native`` and sent back unchanged on the next turn (a function call that Gemini
did not write, from another wire or a cut turn, gets the placeholder signature Gemini's
docs name for that). A safety stop is reported as its reason (``safety``,
``recitation``, ``prompt_safety``...; see :data:`aimu.aio.events.SAFETY_STOP_REASONS`),
a malformed function call as an argument error the model can correct. Replies stream
as SSE (``streamGenerateContent?alt=sse``). The API key goes in the ``x-goog-api-key``
header, never in the URL, and appears in no repr, log or error message.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from operator import is_, itemgetter
from typing import Any, Self, Unpack, cast
from urllib.parse import quote

from aimu.aio.providers._decoder import (
    SSETurnDecoder,
    TurnDecoder,
    as_dict,
    as_list,
    call_id,
    tool_call,
    with_cached,
)
from aimu.aio.providers._errors import clip
from aimu.aio.providers._http import HTTPModelClient, TurnInput
from aimu.aio.providers._report import Reporter
from aimu.aio.providers._settings import ClientSettings, ServiceKeywords
from aimu.aio.providers._unicode import clean, clean_json
from aimu.aio.providers._wire import dumps
from aimu.aio.providers.base import Chunk, NativeData, ToolCallDelta, TurnDone
from aimu.aio.transcript import (
    AssistantMessage,
    Message,
    ToolCall,
    ToolMessage,
    ToolSpec,
    Usage,
    UserMessage,
    native_data,
)

__all__ = [
    "DEFAULT_BASE_URL",
    "SKIP_SIGNATURE",
    "WIRE",
    "GeminiClient",
    "to_request",
]

DEFAULT_BASE_URL = "https://generativelanguage.googleapis.com/v1beta"
#: The ``wire`` of this provider's ``aimu_native`` data.
WIRE = "gemini"
#: The signature Gemini's docs give for a function call it did not write itself (a
#: transcript from another model): accepted where a thought signature is required.
SKIP_SIGNATURE = "skip_thought_signature_validator"

_TOOL_MODES = {"auto": "AUTO", "required": "ANY", "none": "NONE"}
#: Gemini's finish reasons that are not a safety stop, as aimu's stop reasons.
_FINISHED = {"STOP": "stop", "MAX_TOKENS": "length"}
_MALFORMED = "MALFORMED_FUNCTION_CALL"
_CONTENT = itemgetter("content")
_VERSION = re.compile(r"v\d+(?:alpha|beta)?\d*")
_CALLED_NAME = re.compile(r"([A-Za-z_][\w.:-]*)\s*\(")


# -- the request -------------------------------------------------------------------------


def _image_part(url: str) -> dict[str, Any]:
    """A ``data:image/...;base64,...`` URL as an ``inlineData`` part."""
    head, _, data = url.partition(";base64,")
    return {"inlineData": {"mimeType": head.removeprefix("data:"), "data": data}}


def _user_parts(message: UserMessage) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    if message["content"] or not message.get("images"):
        parts.append({"text": message["content"]})
    parts += [_image_part(url) for url in message.get("images", ())]
    return parts


def _model_parts(message: AssistantMessage) -> list[dict[str, Any]]:
    """A reply as Gemini's parts: its text, then its calls, with the signatures it was
    given (a call Gemini did not sign gets :data:`SKIP_SIGNATURE` on the first call)."""
    native = native_data(cast(Message, message), WIRE) or {}
    parts: list[dict[str, Any]] = []
    text_signature = native.get("text_signature")
    if message["content"] or isinstance(text_signature, str):
        part: dict[str, Any] = {"text": message["content"]}
        if isinstance(text_signature, str):
            part["thoughtSignature"] = text_signature
        parts.append(part)
    signed: dict[str, Any] = native.get("calls") or {}
    for position, call in enumerate(message.get("tool_calls", ())):
        mine = signed.get(call["id"]) or {}
        function: dict[str, Any] = {
            "name": call["function"]["name"], "args": call["function"]["arguments"]
        }
        if isinstance(mine.get("id"), str):
            function["id"] = mine["id"]
        part = {"functionCall": function}
        signature = mine.get("thoughtSignature")
        if isinstance(signature, str):
            part["thoughtSignature"] = signature
        elif position == 0:
            part["thoughtSignature"] = SKIP_SIGNATURE
        parts.append(part)
    return parts


def _response_parts(
    results: Sequence[ToolMessage], calls: Sequence[ToolCall], native: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """Tool results as ``functionResponse`` parts in the order of the calls they answer."""
    order = {call["id"]: position for position, call in enumerate(calls)}
    signed: Mapping[str, Any] = native.get("calls") or {}
    parts: list[dict[str, Any]] = []
    for result in sorted(results, key=lambda r: order.get(r["tool_call_id"], len(order))):
        response: dict[str, Any] = {
            "name": result["name"], "response": {"output": result["content"]}
        }
        gemini_id = (signed.get(result["tool_call_id"]) or {}).get("id")
        if isinstance(gemini_id, str):
            response["id"] = gemini_id
        parts.append({"functionResponse": response})
    return parts


def to_request(messages: Sequence[Message]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The ``systemInstruction`` (or None) and ``contents`` of a transcript.

    Adjacent messages of one Gemini role go in one content (tool results with a user
    message after them; a cut reply and its continuation); partial replies with nothing
    in them are left out.
    """
    system, contents, _ = _contents(messages)
    return system, contents


def _contents(
    messages: Sequence[Message], offset: int = 0
) -> tuple[dict[str, Any] | None, list[dict[str, Any]], list[int]]:
    """:func:`to_request`, and for each content the index (plus ``offset``) of the
    message it starts with."""
    system: dict[str, Any] | None = None
    contents: list[dict[str, Any]] = []
    starts: list[int] = []
    calls: Sequence[ToolCall] = ()
    native: Mapping[str, Any] = {}
    results: list[ToolMessage] = []
    first_result = 0

    def add(role: str, parts: list[dict[str, Any]], index: int) -> None:
        if not parts:
            return
        if contents and contents[-1]["role"] == role:
            contents[-1]["parts"].extend(parts)
        else:
            contents.append({"role": role, "parts": parts})
            starts.append(index + offset)

    def flush_results() -> None:
        if results:
            add("user", _response_parts(results, calls, native), first_result)
            results.clear()

    for index, message in enumerate(messages):
        role = message["role"]
        if role == "tool":
            if not results:
                first_result = index
            results.append(cast(ToolMessage, message))
            continue
        flush_results()
        if role == "system":
            if message["content"]:
                system = {"parts": [{"text": message["content"]}]}
        elif role == "user":
            add("user", _user_parts(cast(UserMessage, message)), index)
        else:
            assistant = cast(AssistantMessage, message)
            calls = assistant.get("tool_calls", ())
            native = native_data(message, WIRE) or {}
            add("model", _model_parts(assistant), index)
    flush_results()
    return system, contents, starts


class _ContentsCache:
    """The encoded contents of the transcript sent last time, so a request re-encodes
    only from the last model content on when the transcript grew at its end (messages
    are treated as immutable once sent, as :class:`~aimu.aio.providers._wire.WireEncoder`
    does)."""

    __slots__ = ("encoded", "objects", "starts", "system", "texts")

    def __init__(self) -> None:
        self.objects: list[Message] = []
        self.texts: list[str] = []
        self.encoded: list[bytes] = []
        self.starts: list[int] = []
        self.system: dict[str, Any] | None = None

    def _restart(self, messages: Sequence[Message]) -> int:
        """The content to encode again from (0: all), for ``messages``."""
        known = len(self.objects)
        if not known or len(messages) < known:
            return 0
        sent = messages[:known]
        if not (all(map(is_, self.objects, sent)) and all(
            map(is_, self.texts, map(_CONTENT, sent))
        )):
            return 0
        for position in range(len(self.starts) - 1, 0, -1):
            if messages[self.starts[position]]["role"] == "assistant":
                return position
        return 0

    def encode(self, messages: Sequence[Message]) -> tuple[dict[str, Any] | None, bytes]:
        """The ``systemInstruction`` and the JSON array of ``contents``."""
        position = self._restart(messages)
        if position:
            first = self.starts[position]
            _, contents, starts = _contents(messages[first:], first)
            self.encoded[position:] = [dumps(content) for content in contents]
            self.starts[position:] = starts
        else:
            self.system, contents, self.starts = _contents(messages)
            self.encoded = [dumps(content) for content in contents]
        self.objects = list(messages)
        self.texts = [message["content"] for message in messages]
        return self.system, b"[" + b",".join(self.encoded) + b"]"


def _declaration(tool: ToolSpec) -> dict[str, Any]:
    function = tool["function"]
    return {
        "name": function["name"],
        "description": function.get("description", ""),
        "parametersJsonSchema": function.get("parameters") or {"type": "object"},
    }


def _tool_config(choice: str | None) -> dict[str, Any] | None:
    if choice is None:
        return None
    mode = _TOOL_MODES.get(choice)
    if mode is not None:
        return {"functionCallingConfig": {"mode": mode}}
    return {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": [choice]}}


# -- the client --------------------------------------------------------------------------


class GeminiClient(HTTPModelClient):
    """A Gemini model (``client("gemini:gemini-2.5-flash")``).

    The key is ``api_key=``, else ``GEMINI_API_KEY``, else ``GOOGLE_API_KEY``; the server
    is ``base_url=`` (up to the API version, e.g. ``.../v1beta``; a URL without one gets
    ``/v1beta``), else ``GEMINI_BASE_URL``, else Google's. ``options`` go into every
    request's ``generationConfig`` (Gemini's own names: ``temperature``,
    ``maxOutputTokens``, ``thinkingConfig``...);
    ``safety_settings`` is sent as ``safetySettings``. ``timeout``, ``connect_timeout``,
    ``retries``, ``retry_delay``, ``concurrency`` and ``context_window`` are as for
    :class:`~aimu.aio.providers.openai.OpenAIClient`.
    """

    provider = "gemini"
    service = "the Gemini API"
    hint = "is the server reachable? check base_url= / GEMINI_BASE_URL"
    url_env = "GEMINI_BASE_URL"
    default_url = DEFAULT_BASE_URL
    url_example = "http://127.0.0.1:8080/v1beta"
    key_envs = ("GEMINI_API_KEY", "GOOGLE_API_KEY")
    key_header = "x-goog-api-key"

    def __init__(
        self,
        model: str,
        *,
        safety_settings: Sequence[Mapping[str, Any]] | None = None,
        **settings: Unpack[ServiceKeywords],
    ) -> None:
        given = ClientSettings.of(type(self).__name__, ServiceKeywords, settings)
        url, sent, secrets = self.service_settings(given.base_url, given.api_key, given.headers)
        if not _VERSION.fullmatch(url.rstrip("/").rpartition("/")[2]):
            url = url.rstrip("/") + "/v1beta"  # a root URL, as Google's SDK takes it
        super().__init__(
            model.removeprefix("models/"), url, dataclasses.replace(given, merge_roles=False),
            headers=sent, secrets=secrets, to_wire=_unused,
        )
        self.safety_settings = [dict(setting) for setting in safety_settings or ()]
        self._path = f"{self.url}/models/{quote(self.model, safe='-._~')}"
        self._contents = _ContentsCache()

    def endpoint(self) -> str:
        return self._path + ":streamGenerateContent?alt=sse"

    def url_for(self, stream: bool) -> str:
        return self.endpoint() if stream else self._path + ":generateContent"

    def body(self, turn: TurnInput) -> bytes:
        system, contents = self._contents.encode(turn.messages)
        request = turn.request
        body: dict[str, Any] = {}
        if system is not None:
            body["systemInstruction"] = system
        if turn.tools:
            body["tools"] = [{"functionDeclarations": [_declaration(tool) for tool in turn.tools]}]
            config = _tool_config(request.tool_choice if request is not None else None)
            if config is not None:
                body["toolConfig"] = config
        generation = dict(self.options)
        if request is not None and request.output_schema is not None:
            generation["responseMimeType"] = "application/json"
            generation["responseJsonSchema"] = dict(request.output_schema)
        if generation:
            body["generationConfig"] = generation
        if self.safety_settings:
            body["safetySettings"] = self.safety_settings
        head = b'{"contents":' + contents
        return head + (b"," + dumps(body)[1:] if body else b"}")

    def fork(self) -> Self:
        twin = super().fork()
        twin._contents = _ContentsCache()
        return twin

    def status_hint(self, status: int) -> str:
        if status in (400, 401, 403):
            return "; check the request, and api_key= / GEMINI_API_KEY"
        if status == 404:
            return f"; check the model name and that {self.host} serves /models/{self.model}"
        return ""

    def decoder(self, reporter: Reporter) -> TurnDecoder:
        return _GeminiTurn(reporter)


def _unused(message: Message) -> dict[str, Any]:
    raise AssertionError("the Gemini client encodes whole requests (to_request)")


# -- the reply ---------------------------------------------------------------------------


class _GeminiTurn(SSETurnDecoder):
    """One reply: ``GenerateContentResponse`` objects, streamed as SSE or whole."""

    __slots__ = (
        "calls", "finish", "finish_message", "response_id", "signatures", "text_signature",
        "usage", "usage_reported",
    )
    unfinished = "ended the stream without a finishReason"

    def __init__(self, reporter: Reporter) -> None:
        super().__init__(reporter)
        self.calls = 0
        #: aimu call id -> what Gemini needs back about it (its id, its signature).
        self.signatures: dict[str, dict[str, str]] = {}
        self.text_signature: str | None = None
        self.response_id = ""
        self.finish: str | None = None
        self.finish_message = ""
        self.usage: Usage = {"input_tokens": 0, "output_tokens": 0}
        self.usage_reported = False

    # -- streamed -------------------------------------------------------------------

    def event(self, data: str) -> list[Chunk]:
        chunks, final = self.response(self.reporter.json_object(data, "an event"))
        return chunks + self._done() if final else chunks

    def end_unmarked(self) -> list[Chunk] | None:
        return None if self.finish is None else self._done()

    # -- whole ------------------------------------------------------------------------

    def whole(self, body: bytes) -> list[Chunk]:
        chunks, _ = self.response(self.reporter.json_object(body, "a reply"))
        if self.finish is None:
            raise self.reporter.protocol("sent a reply that did not finish (no finishReason)")
        return chunks + self._done()

    # -- shared -----------------------------------------------------------------------

    def response(self, reply: Mapping[str, Any]) -> tuple[list[Chunk], bool]:
        """The chunks of one ``GenerateContentResponse``, and whether it ends the turn."""
        if "error" in reply:  # its code is the HTTP status it stands for (503: retried)
            code = as_dict(reply["error"]).get("code")
            status = code if isinstance(code, int) and 400 <= code < 600 else 200
            raise self.reporter.server_error(reply["error"], status)
        if isinstance(reply.get("responseId"), str):
            self.response_id = reply["responseId"]
        usage = reply.get("usageMetadata")
        if isinstance(usage, dict):
            self.usage, self.usage_reported = _usage(usage), _reported(usage)
        blocked = as_dict(reply.get("promptFeedback")).get("blockReason")
        if isinstance(blocked, str) and blocked:
            self.finish = "prompt_" + blocked.lower()
            return [], True
        candidates = reply.get("candidates")
        if not isinstance(candidates, list) or not candidates:
            return [], False
        candidate = as_dict(candidates[0])
        chunks: list[Chunk] = []
        for part in as_list(as_dict(candidate.get("content")).get("parts")):
            chunks.extend(self._part(as_dict(part)))
        finish = candidate.get("finishReason")
        if isinstance(finish, str) and finish and self.finish is None:
            self.finish = finish
            message = candidate.get("finishMessage")
            self.finish_message = message if isinstance(message, str) else ""
            if finish == _MALFORMED:
                chunks.append(self._malformed())
            return chunks, isinstance(usage, dict)
        return chunks, False

    def _part(self, part: Mapping[str, Any]) -> list[Chunk]:
        signature = part.get("thoughtSignature")
        signature = signature if isinstance(signature, str) and signature else None
        function = part.get("functionCall")
        if isinstance(function, dict):
            return [self._call(function, signature)]
        if signature is not None:
            self.text_signature = signature
        text = part.get("text")
        if part.get("thought") is True:
            return self.text.chunks(text, None)
        return self.text.chunks(None, text)

    def _new_id(self) -> str:
        self.calls += 1
        if self.response_id:
            return clean(f"call_{self.response_id}_{self.calls}")
        return call_id()

    def _call(self, function: Mapping[str, Any], signature: str | None) -> ToolCallDelta:
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise self.reporter.protocol(f"sent a functionCall without a name: {clip(function)}")
        gemini_id = function.get("id")
        own = isinstance(gemini_id, str) and bool(gemini_id) and gemini_id not in self.signatures
        identifier = clean(cast(str, gemini_id)) if own else self._new_id()
        kept: dict[str, str] = {}
        if own:
            kept["id"] = cast(str, gemini_id)
        if signature is not None:
            kept["thoughtSignature"] = signature
        if kept:
            self.signatures[identifier] = kept
        arguments = function.get("args", {})
        error = None
        if not isinstance(arguments, dict):
            error = (
                f"the arguments for tool {clean(name)} were not a JSON object but "
                f"{clip(arguments, 200)}"
            )
            arguments = {}
        return tool_call(identifier, clean(name), clean_json(arguments), error)

    def _malformed(self) -> ToolCallDelta:
        """A call Gemini could not form, as an argument error the model can correct."""
        said = clean(self.finish_message)
        found = _CALLED_NAME.search(said.rpartition("default_api.")[2] or said)
        name = found.group(1) if found else "function_call"
        error = (
            "the function call was malformed and was not run"
            + (f" ({clip(said, 300)})" if said else "")
            + "; call the tool again with arguments that match its parameters"
        )
        return tool_call(self._new_id(), name, {}, error)

    def _done(self) -> list[Chunk]:
        chunks = self.text.flush()
        native: dict[str, Any] = {}
        if self.signatures:
            native["calls"] = self.signatures
        if self.text_signature is not None:
            native["text_signature"] = self.text_signature
        if native:
            chunks.append(NativeData({"wire": WIRE, **native}))
        chunks.append(TurnDone(self.usage, self._stop_reason(), self.usage_reported))
        self.finished = True
        return chunks

    def _stop_reason(self) -> str | None:
        finish = self.finish
        if finish is None or finish.startswith("prompt_"):
            return finish
        if finish == _MALFORMED or (finish == "STOP" and self.calls):
            return "tool_calls"
        return _FINISHED.get(finish) or finish.lower()


def _count(usage: Mapping[str, Any], key: str) -> int:
    value = usage.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _reported(usage: Mapping[str, Any]) -> bool:
    """True when ``usageMetadata`` says how many tokens the prompt took."""
    return isinstance(usage.get("promptTokenCount"), int)


def _usage(usage: Mapping[str, Any]) -> Usage:
    """Input: the prompt (cached tokens included, and counted apart too) and tool-use
    prompt; output: the reply and its thoughts (both billed as output)."""
    prompt = _count(usage, "promptTokenCount") + _count(usage, "toolUsePromptTokenCount")
    reply = _count(usage, "candidatesTokenCount") + _count(usage, "thoughtsTokenCount")
    return with_cached(
        {"input_tokens": prompt, "output_tokens": reply}, usage.get("cachedContentTokenCount")
    )
