"""``openai:<model>``: any OpenAI-compatible ``/chat/completions`` server, over httpx.

llama.cpp server, vLLM, LM Studio, OpenAI itself. The transcript is converted to the
wire form here: tool-call arguments become JSON strings, tool results carry
``tool_call_id``, our own keys and thinking stay home. Replies stream as SSE; streamed
tool-call fragments are joined by index. The API key is sent as a Bearer header and
appears in no repr, log or error message.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Unpack
from urllib.parse import urlsplit

from aimu.aio._numbers import is_count
from aimu.aio.providers._decoder import (
    SSETurnDecoder,
    TurnDecoder,
    as_dict,
    as_list,
    decoded_call,
    with_cached,
)
from aimu.aio.providers._errors import clip
from aimu.aio.providers._http import HTTPModelClient, TurnInput
from aimu.aio.providers._report import Reporter, display_url
from aimu.aio.providers._retry import log
from aimu.aio.providers._settings import ClientSettings, ServiceTurnKeywords
from aimu.aio.providers._wire import dumps_text
from aimu.aio.providers.base import Chunk, ToolCallDelta, TurnDone, TurnRequest
from aimu.aio.transcript import Message, Usage

__all__ = ["DEFAULT_BASE_URL", "OpenAIClient", "OpenAIService", "to_wire"]

DEFAULT_BASE_URL = "https://api.openai.com/v1"


def to_wire(message: Message) -> dict[str, Any]:
    """One transcript message as ``/chat/completions`` expects it."""
    if message["role"] == "tool":
        return {
            "role": "tool",
            "tool_call_id": message["tool_call_id"],
            "content": message["content"],
        }
    if message["role"] == "assistant":
        wire: dict[str, Any] = {"role": "assistant", "content": message["content"]}
        calls = message.get("tool_calls")
        if calls:
            wire["tool_calls"] = [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {
                        "name": call["function"]["name"],
                        "arguments": dumps_text(call["function"]["arguments"]),
                    },
                }
                for call in calls
            ]
        return wire
    if message["role"] == "user" and message.get("images"):
        parts: list[dict[str, Any]] = [{"type": "text", "text": message["content"]}]
        parts += [{"type": "image_url", "image_url": {"url": url}} for url in message["images"]]
        return {"role": "user", "content": parts}
    return {"role": message["role"], "content": message["content"]}


class OpenAIService(HTTPModelClient):
    """What the OpenAI wires share: the base URL (``base_url`` or ``OPENAI_BASE_URL``) and
    the API key (``api_key`` or ``OPENAI_API_KEY``) as a Bearer header."""

    hint = "is the server running? check base_url= / OPENAI_BASE_URL"
    url_env = "OPENAI_BASE_URL"
    default_url = DEFAULT_BASE_URL
    url_example = "http://127.0.0.1:8080/v1"
    key_envs = ("OPENAI_API_KEY",)
    key_header = "Authorization"
    key_prefix = "Bearer "

    def not_found_elsewhere(self) -> bool:
        """A server's root URL given (``http://HOST:PORT``, as the other wires take it)
        that answers 404: the OpenAI API is under ``/v1`` there (as the OpenAI SDK's base
        URL has it), so requests go to ``ROOT/v1`` from now on. A server that serves at
        its root is reached at the first try."""
        if urlsplit(self.url).path not in ("", "/"):
            return False
        self.url = self.url.rstrip("/") + "/v1"
        log.debug("%s answers 404 at its root: using %s", self.host, display_url(self.url))
        return True


class OpenAIClient(OpenAIService):
    """A model on an OpenAI-compatible server (``client("openai:gpt-4o-mini")``).

    ``options`` (temperature, max_tokens...) are merged into every request body.
    ``timeout`` bounds each read, ``connect_timeout`` the connection, so an
    unreachable server fails fast instead of hanging. ``retries`` (0 disables) and
    ``retry_delay`` govern retrying a request that failed before its reply began;
    ``merge_roles`` sends adjacent same-role messages as one; ``concurrency`` bounds
    the requests in flight (None: no bound; past it a request waits for a slot, at most
    ``timeout``). ``context_window`` (tokens) is the
    model's context size: an agent stops ``limited`` before a request that would not fit.
    ``continues_partial=True`` says the server continues a trailing assistant message
    (llama.cpp's server does; OpenAI's answers anew), so ``resume(continue_partial=True)``
    sends a cut answer as the prefix to continue.
    """

    provider = "openai"
    service = "the OpenAI-compatible server"
    chat_path = "/chat/completions"

    def __init__(self, model: str, **settings: Unpack[ServiceTurnKeywords]) -> None:
        given = ClientSettings.of(type(self).__name__, ServiceTurnKeywords, settings)
        url, sent, secrets = self.service_settings(given.base_url, given.api_key, given.headers)
        super().__init__(model, url, given, headers=sent, secrets=secrets, to_wire=to_wire)

    def body(self, turn: TurnInput) -> bytes:
        settings: dict[str, Any] = {**self.options, "model": self.model, "stream": turn.stream}
        if turn.stream:
            settings.setdefault("stream_options", {"include_usage": True})
        if turn.request is not None:
            settings.update(_request_fields(turn.request, bool(turn.tools)))
        return self.compose(settings, turn.messages, turn.tools)

    def decoder(self, reporter: Reporter) -> TurnDecoder:
        return _OpenAITurn(reporter)


@dataclass
class _PendingCall:
    """A streamed tool call being assembled from its fragments."""

    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class _OpenAITurn(SSETurnDecoder):
    """One reply: SSE events (tool calls by index, finish reason, usage) or one body."""

    __slots__ = ("calls", "finish", "usage", "usage_reported")
    unfinished = "ended the stream without a finish_reason or [DONE]"

    def __init__(self, reporter: Reporter) -> None:
        super().__init__(reporter)
        self.calls: dict[int, _PendingCall] = {}
        self.finish: str | None = None
        self.usage: Usage = {"input_tokens": 0, "output_tokens": 0}
        self.usage_reported = False

    # -- streamed -------------------------------------------------------------------

    def end_unmarked(self) -> list[Chunk] | None:
        return None if self.finish is None else self._done()

    def event(self, data: str) -> list[Chunk]:
        if data.strip() == "[DONE]":
            return self._done()
        event = self.reporter.json_object(data, "an event")
        if "error" in event:
            raise self.reporter.server_error(event["error"], _status(event["error"]))
        if isinstance(event.get("usage"), dict):
            self.usage = _usage(event["usage"])
            self.usage_reported = _reported(event["usage"])
        choice = _first_choice(event)
        if choice is None:
            return []
        delta = as_dict(choice.get("delta"))
        chunks = self._text(delta)
        if "tool_calls" in delta:  # most events carry text only
            for position, fragment in enumerate(as_list(delta["tool_calls"])):
                self._add_fragment(as_dict(fragment), position)
        finish = choice.get("finish_reason")
        if isinstance(finish, str) and finish and self.finish is None:
            self.finish = finish
            chunks.extend(self._take_calls())
        return chunks

    def _done(self) -> list[Chunk]:
        chunks = self._take_calls()
        chunks.extend(self.text.flush())
        chunks.append(TurnDone(self.usage, self.finish, self.usage_reported))
        self.finished = True
        return chunks

    def _add_fragment(self, fragment: Mapping[str, Any], position: int) -> None:
        index = fragment.get("index", position)
        if not isinstance(index, int):
            raise self.reporter.protocol(f"sent a tool-call fragment with index {clip(index, 40)}")
        pending = self.calls.setdefault(index, _PendingCall())
        if isinstance(fragment.get("id"), str) and fragment["id"]:
            pending.id = fragment["id"]
        function = as_dict(fragment.get("function"))
        name = function.get("name")
        if isinstance(name, str) and name:
            # Most servers send the name once; a few repeat it whole in every fragment.
            pending.name = name if not pending.name or pending.name == name else pending.name
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            pending.arguments.append(arguments)
        elif isinstance(arguments, dict):
            pending.arguments.append(json.dumps(arguments))

    def _take_calls(self) -> list[Chunk]:
        calls, self.calls = self.calls, {}
        for index in sorted(calls):
            if not calls[index].name:
                raise self.reporter.protocol(f"sent tool call {index} without a function name")
        return list(_complete(calls[index] for index in sorted(calls)))

    # -- whole ------------------------------------------------------------------------

    def whole(self, body: bytes) -> list[Chunk]:
        reply = self.reporter.json_object(body, "a reply")
        if "error" in reply:
            raise self.reporter.server_error(reply["error"])
        choice = _first_choice(reply)
        message = choice.get("message") if choice is not None else None
        if choice is None or not isinstance(message, dict):
            raise self.reporter.protocol(f"sent a reply without choices[0].message: {clip(body)}")
        chunks = self._text(message)
        pending: list[_PendingCall] = []
        for position, call in enumerate(as_list(message.get("tool_calls"))):
            function = as_dict(as_dict(call).get("function"))
            arguments = function.get("arguments", "")
            if not isinstance(arguments, str):  # some servers send an object already
                arguments = json.dumps(arguments)
            name = function.get("name")
            if not isinstance(name, str) or not name:
                raise self.reporter.protocol(f"sent tool call {position} without a function name")
            pending.append(_PendingCall(str(as_dict(call).get("id") or ""), name, [arguments]))
        chunks.extend(_complete(pending))
        finish = choice.get("finish_reason")
        if not isinstance(finish, str):
            raise self.reporter.protocol("sent a reply that did not finish (no finish_reason)")
        chunks.extend(self.text.flush())
        usage = reply.get("usage")
        chunks.append(TurnDone(_usage(usage), finish, _reported(usage)))
        self.finished = True
        return chunks

    # -- shared -----------------------------------------------------------------------

    def _text(self, message: Mapping[str, Any]) -> list[Chunk]:
        # Servers name thinking ``reasoning_content`` or ``reasoning``.
        thinking = message.get("reasoning_content") or message.get("reasoning")
        return self.text.chunks(thinking, message.get("content"))


def _request_fields(request: TurnRequest, with_tools: bool) -> dict[str, Any]:
    """``response_format`` for an output schema; the tool options only with tools (a
    server refuses ``tool_choice`` without them)."""
    fields: dict[str, Any] = {}
    if request.output_schema is not None:
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {
                "name": request.output_name,
                "schema": request.output_schema,
                "strict": False,
            },
        }
    if with_tools:
        choice = request.tool_choice
        if choice in ("auto", "required", "none"):
            fields["tool_choice"] = choice
        elif choice is not None:
            fields["tool_choice"] = {"type": "function", "function": {"name": choice}}
        if request.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = request.parallel_tool_calls
    return fields


def _complete(pending: Iterable[_PendingCall]) -> list[ToolCallDelta]:
    """Complete tool calls; arguments that are not a JSON object become a tool error."""
    deltas: list[ToolCallDelta] = []
    seen: set[str] = set()
    for call in pending:
        deltas.append(decoded_call(call.id, call.name, "".join(call.arguments), seen))
    return deltas


#: The HTTP status an error's type stands for (so it is retried like it): OpenAI's words.
_ERROR_STATUS = {"server_error": 500, "rate_limit_exceeded": 429, "rate_limit_error": 429}


def _status(error: object) -> int:
    """The HTTP status a mid-stream error object stands for: its numeric ``code`` (as
    vLLM sends), else its ``type``'s (OpenAI's), else 200 (nothing says)."""
    detail = as_dict(error)
    code = detail.get("code")
    if isinstance(code, int) and 400 <= code < 600:
        return code
    kind = detail.get("type")
    return _ERROR_STATUS.get(kind, 200) if isinstance(kind, str) else 200


def _first_choice(reply: Mapping[str, Any]) -> dict[str, Any] | None:
    choices = reply.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None


def _reported(value: object) -> bool:
    """True when ``value`` is a usage object with both token counts."""
    usage = as_dict(value)
    return is_count(usage.get("prompt_tokens")) and is_count(usage.get("completion_tokens"))


def _usage(value: object) -> Usage:
    usage = as_dict(value)
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    counts: Usage = {
        "input_tokens": prompt if is_count(prompt) else 0,  # a huge or negative one: none
        "output_tokens": completion if is_count(completion) else 0,
    }
    return with_cached(counts, as_dict(usage.get("prompt_tokens_details")).get("cached_tokens"))
