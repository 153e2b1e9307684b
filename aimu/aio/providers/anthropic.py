"""``anthropic:<model>``: Anthropic's Messages API (``POST /v1/messages``), over httpx.

The transcript is translated to Anthropic's shape here and nowhere else: the system
prompt goes as the top-level ``system``; an assistant turn is content blocks (``text``,
``tool_use``, and the signed ``thinking`` blocks it had, sent back unchanged from its
``aimu_native`` data); tool results become ``tool_result`` blocks at the head of the
next user turn, consecutive results (and a user message after them) merged into one
turn, so every ``tool_use`` is answered where the API looks for it. Thinking from
another wire, or from a turn cut short, is never sent: the API takes only signed
thinking, and a cut block has no signature.

Replies stream as SSE with every event type of the published format. An
``overloaded_error`` event before any byte of the turn is retried like a 529. The API
key goes in the ``x-api-key`` header and appears in no repr, log or error message.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, Self, Unpack

from aimu.aio.providers._decoder import (
    SSETurnDecoder,
    TurnDecoder,
    as_dict,
    decoded_call,
    with_cached,
)
from aimu.aio.providers._errors import clip
from aimu.aio.providers._http import HTTPModelClient, TurnInput
from aimu.aio.providers._report import Reporter
from aimu.aio.providers._settings import ClientSettings, ServiceTurnKeywords
from aimu.aio.providers._unicode import clean
from aimu.aio.providers._wire import dumps, request_body, unchanged
from aimu.aio.providers.base import (
    Chunk,
    NativeData,
    ToolCallDelta,
    TurnDone,
    TurnRequest,
)
from aimu.aio.transcript import Message, ToolSpec, Usage, native_data

__all__ = [
    "API_VERSION",
    "DEFAULT_BASE_URL",
    "DEFAULT_MAX_TOKENS",
    "STOP_REASONS",
    "WIRE",
    "AnthropicClient",
    "message_blocks",
]

DEFAULT_BASE_URL = "https://api.anthropic.com"
API_VERSION = "2023-06-01"
#: ``max_tokens`` when ``options`` set none (the API requires one on every request).
DEFAULT_MAX_TOKENS = 4096
#: The name of this wire in ``aimu_native`` data.
WIRE = "anthropic"
#: Anthropic's ``stop_reason`` in aimu's words (others are kept as they are).
STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "refusal": "refusal",
}
#: The HTTP status an error event's type stands for (so it is retried like that status).
_ERROR_STATUS = {
    "overloaded_error": 529,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
}
_CACHE = {"type": "ephemeral"}
_THINKING = frozenset({"thinking", "redacted_thinking"})
#: The key under which each delta type carries its piece. The piece extends the block's
#: field of the same name, but for tool input (its JSON parts are joined at the stop).
_DELTA_KEYS: dict[object, str] = {
    "text_delta": "text",
    "thinking_delta": "thinking",
    "signature_delta": "signature",
    "input_json_delta": "partial_json",
}


# -- the transcript in Anthropic's shape --------------------------------------------------


def _image(url: str) -> dict[str, Any]:
    head, _, data = url.partition(";base64,")
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": head.removeprefix("data:"), "data": data},
    }


def message_blocks(message: Message) -> list[dict[str, Any]]:
    """The content blocks of one transcript message (system messages have none here).

    An assistant reply written on this wire is sent as its ``aimu_native`` blocks
    (signed thinking included) when they still match its tool calls; any other reply
    as its text and ``tool_use`` blocks.
    """
    if message["role"] == "tool":
        result: dict[str, Any] = {"type": "tool_result", "tool_use_id": message["tool_call_id"]}
        if message["content"]:
            result["content"] = message["content"]
        return [result]
    if message["role"] == "user":
        blocks = [_image(url) for url in message.get("images", [])]
        if message["content"]:
            blocks.append({"type": "text", "text": message["content"]})
        return blocks
    if message["role"] != "assistant":
        return []
    calls = message.get("tool_calls", [])
    native = native_data(message, WIRE)
    if native is not None and isinstance(native.get("content"), list):
        sent = [block for block in native["content"] if isinstance(block, dict)]
        ids = [block.get("id") for block in sent if block.get("type") == "tool_use"]
        if ids == [call["id"] for call in calls]:
            return [b for b in sent if b.get("type") != "text" or b.get("text")]
    blocks = [{"type": "text", "text": message["content"]}] if message["content"] else []
    blocks += [
        {
            "type": "tool_use",
            "id": call["id"],
            "name": call["function"]["name"],
            "input": call["function"]["arguments"],
        }
        for call in calls
    ]
    return blocks


class _Encoder:
    """The transcript as Anthropic turns, each message's blocks encoded once.

    A transcript usually grows at its end: the messages encoded last time are checked to
    be the same objects with the same content, and only new ones are encoded. Tool
    results and user messages that follow each other form one user turn (results
    first); consecutive assistant messages one assistant turn; a message without blocks
    (an empty reply) is left out.
    """

    __slots__ = ("_contents", "_encoded", "_objects", "_tools")

    def __init__(self) -> None:
        self._objects: list[Message] = []
        self._contents: list[str] = []
        # per message: its turn's role ("" for none) and its blocks, results apart
        self._encoded: list[tuple[str, bytes, bytes]] = []
        self._tools: tuple[object, bool, bytes] = (None, False, b"[]")

    def messages(self, messages: Sequence[Message]) -> bytes:
        """The ``messages`` array (the system prompt is not in it)."""
        start = unchanged(self._objects, self._contents, messages)
        if not start:
            self._objects, self._contents, self._encoded = [], [], []
        for message in messages[start:]:
            self._objects.append(message)
            self._contents.append(message["content"])
            kind: str = message["role"]
            blocks = [dumps(block) for block in message_blocks(message)]
            if kind == "tool":
                self._encoded.append(("user", b",".join(blocks), b""))
            elif kind in ("user", "assistant") and blocks:
                self._encoded.append((kind, b"", b",".join(blocks)))
            else:
                self._encoded.append(("", b"", b""))
        turns: list[bytes] = []
        role = ""
        results: list[bytes] = []
        rest: list[bytes] = []
        for kind, result, other in self._encoded:
            if not kind:
                continue
            if kind != role:
                if role:
                    turns.append(_turn(role, results, rest))
                role, results, rest = kind, [], []
            if result:
                results.append(result)
            if other:
                rest.append(other)
        if role == "assistant" and messages[-1]["role"] == "assistant":
            # A prefill to continue: the API refuses one ending in whitespace.
            rest = [dumps(block) for block in _prefill(messages)]
        if role and rest + results:
            turns.append(_turn(role, results, rest))
        return b"[" + b",".join(turns) + b"]"

    def tools(self, tools: Sequence[ToolSpec], cache: bool) -> bytes:
        cached, cached_flag, encoded = self._tools
        if cached is not tools or cached_flag != cache:
            wire = [
                {
                    "name": tool["function"]["name"],
                    "description": tool["function"].get("description", ""),
                    "input_schema": tool["function"].get("parameters")
                    or {"type": "object", "properties": {}},
                }
                for tool in tools
            ]
            if cache and wire:
                wire[-1]["cache_control"] = _CACHE
            encoded = dumps(wire)
            self._tools = (tools, cache, encoded)
        return encoded


def _trailing(messages: Sequence[Message]) -> list[Message]:
    """The assistant messages at the end of ``messages`` (the prefill to continue)."""
    start = len(messages)
    while start and messages[start - 1]["role"] == "assistant":
        start -= 1
    return list(messages[start:])


def _prefill(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The blocks of the trailing assistant turn, its last text without trailing
    whitespace (an all-blank last text block left out)."""
    blocks = [block for message in _trailing(messages) for block in message_blocks(message)]
    if blocks and blocks[-1].get("type") == "text":
        text = str(blocks[-1]["text"]).rstrip()
        blocks[-1:] = [{"type": "text", "text": text}] if text else []
    return blocks


def prefill_space(messages: Sequence[Message]) -> str:
    """The whitespace a trailing assistant turn's text ends with (left out when sent)."""
    trailing = _trailing(messages)
    text = trailing[-1]["content"] if trailing and not trailing[-1].get("tool_calls") else ""
    return text[len(text.rstrip()):]


def _turn(role: str, results: list[bytes], rest: list[bytes]) -> bytes:
    content = b",".join(results + rest)
    return b'{"role":"' + role.encode() + b'","content":[' + content + b"]}"


# -- the client ---------------------------------------------------------------------------


class AnthropicClient(HTTPModelClient):
    """A Claude model over Anthropic's Messages API (``client("anthropic:claude-...")``).

    ``api_key`` defaults to ``ANTHROPIC_API_KEY``, ``base_url`` to ``ANTHROPIC_BASE_URL``
    or the public API. ``options`` are merged into every request body (``max_tokens``,
    default :data:`DEFAULT_MAX_TOKENS`; ``temperature``; ``thinking``, e.g.
    ``{"type": "enabled", "budget_tokens": 2048}``). ``cache=True`` marks the system
    prompt and the tools for prompt caching (``cache_control``); the cached tokens count
    in the usage's input tokens. ``timeout``, ``connect_timeout``, ``retries``,
    ``retry_delay``, ``concurrency`` and ``context_window`` are as for every HTTP client.
    ``continues_partial=True`` sends a cut answer as a prefill for the model to continue
    (the API continues a trailing assistant message, but not with thinking on).
    ``merge_roles`` is taken for uniformity with the other clients: adjacent messages of
    one side always go as one turn here, as the API wants.
    """

    provider = "anthropic"
    service = "the Anthropic API"
    hint = "check base_url= / ANTHROPIC_BASE_URL"
    url_env = "ANTHROPIC_BASE_URL"
    default_url = DEFAULT_BASE_URL
    url_example = "http://127.0.0.1:8080"
    key_envs = ("ANTHROPIC_API_KEY",)
    key_header = "x-api-key"
    chat_path = "/v1/messages"

    def __init__(
        self,
        model: str,
        *,
        cache: bool = False,
        **settings: Unpack[ServiceTurnKeywords],
    ) -> None:
        given = ClientSettings.of(type(self).__name__, ServiceTurnKeywords, settings)
        url, sent, secrets = self.service_settings(
            given.base_url, given.api_key, given.headers, {"anthropic-version": API_VERSION}
        )
        given = dataclasses.replace(given, merge_roles=False)  # always merged (see above)
        super().__init__(model, url, given, headers=sent, secrets=secrets,
                         to_wire=message_blocks)
        self.cache = bool(cache)
        self._turns = _Encoder()

    def fork(self) -> Self:
        twin = super().fork()
        twin._turns = _Encoder()
        return twin

    def body(self, turn: TurnInput) -> bytes:
        settings: dict[str, Any] = {"max_tokens": DEFAULT_MAX_TOKENS, **self.options}
        settings["model"] = self.model
        settings["stream"] = turn.stream
        messages = turn.messages
        if messages and messages[0]["role"] == "system" and messages[0]["content"]:
            system = messages[0]["content"]
            settings["system"] = (
                [{"type": "text", "text": system, "cache_control": _CACHE}] if self.cache
                else system
            )
        if turn.request is not None:
            settings.update(_request_fields(turn.request, bool(turn.tools)))
        encoded = self._turns.messages(messages)
        return request_body(
            settings, encoded, self._turns.tools(turn.tools, self.cache) if turn.tools else None
        )

    def status_hint(self, status: int) -> str:
        if status == 529:
            return "; the API is overloaded, try again later"
        return super().status_hint(status)

    def decoder(self, reporter: Reporter) -> TurnDecoder:
        return _AnthropicTurn(reporter)

    def prefill_space(self, messages: Sequence[Message]) -> str:
        return prefill_space(messages) if self.continues_partial else ""

    def counted_input(self, decoder: TurnDecoder) -> int | None:
        counted = decoder.usage["input_tokens"] if isinstance(decoder, _AnthropicTurn) else 0
        return counted or None


def _request_fields(request: TurnRequest, with_tools: bool) -> dict[str, Any]:
    """``output_config.format`` for an output schema (structured outputs); the tool
    options only with tools."""
    fields: dict[str, Any] = {}
    if request.output_schema is not None:
        schema = dict(request.output_schema)
        fields["output_config"] = {"format": {"type": "json_schema", "schema": schema}}
    if with_tools:
        choice: dict[str, Any] | None = None
        if request.tool_choice in ("auto", "none"):
            choice = {"type": request.tool_choice}
        elif request.tool_choice == "required":
            choice = {"type": "any"}
        elif request.tool_choice is not None:
            choice = {"type": "tool", "name": request.tool_choice}
        if request.parallel_tool_calls is False:
            choice = choice or {"type": "auto"}
            if choice["type"] != "none":
                choice["disable_parallel_tool_use"] = True
        if choice is not None:
            fields["tool_choice"] = choice
    return fields


# -- reading a reply ----------------------------------------------------------------------


class _Block:
    """A content block being streamed."""

    __slots__ = ("data", "json")

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.json: list[str] = []


class _AnthropicTurn(SSETurnDecoder):
    """One reply: the SSE events of a streamed message, or one message body."""

    __slots__ = ("blocks", "done_blocks", "open", "seen", "stop", "usage", "usage_reported")
    unfinished = "ended the stream before message_stop (the reply did not finish)"

    def __init__(self, reporter: Reporter) -> None:
        super().__init__(reporter)
        self.blocks: dict[int, _Block] = {}
        self.done_blocks: list[dict[str, Any]] = []
        self.open: set[int] = set()
        self.stop: str | None = None
        self.usage: Usage = {"input_tokens": 0, "output_tokens": 0}
        self.usage_reported = False
        self.seen: set[str] = set()

    # -- streamed -------------------------------------------------------------------

    def event(self, data: str) -> list[Chunk]:
        event = self.reporter.json_object(data, "an event")
        kind = event.get("type")
        if kind == "content_block_delta":
            return self._delta(event)
        if kind == "content_block_start":
            return self._start(event)
        if kind == "content_block_stop":
            return self._stop(event)
        if kind == "message_start":
            self._count(as_dict(as_dict(event.get("message")).get("usage")))
            return []
        if kind == "message_delta":
            reason = as_dict(event.get("delta")).get("stop_reason")
            if isinstance(reason, str):
                self.stop = reason
            self._count(as_dict(event.get("usage")))
            return []
        if kind == "message_stop":
            return self._done()
        if kind == "error":
            raise self._error(event.get("error"))
        return []  # ping, and event types added later, are skipped as the API asks

    def salvage(self) -> list[Chunk] | None:
        """A reply cut after its message_delta (its stop reason and usage) is whole."""
        if self.finished or self.stop is None or self.open:
            return None
        return self._done()

    def _error(self, detail: object) -> Exception:
        kind = as_dict(detail).get("type")
        return self.reporter.server_error(detail, _ERROR_STATUS.get(str(kind), 200))

    def _index(self, event: Mapping[str, Any]) -> int:
        index = event.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            raise self.reporter.protocol(f"sent a content block event with index {clip(index, 40)}")
        return index

    def _start(self, event: Mapping[str, Any]) -> list[Chunk]:
        index = self._index(event)
        block = event.get("content_block")
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise self.reporter.protocol(f"sent content block {index} without a type")
        if index in self.blocks:
            raise self.reporter.protocol(f"started content block {index} twice")
        data = dict(block)
        self.blocks[index] = _Block(data)
        self.open.add(index)
        if data["type"] == "text":
            return self.text.chunks(None, data.get("text"))
        if data["type"] == "thinking":
            return self.text.chunks(data.get("thinking"), None)
        return []

    def _block(self, event: Mapping[str, Any]) -> _Block:
        index = self._index(event)
        block = self.blocks.get(index)
        if block is None:
            raise self.reporter.protocol(f"sent a delta for content block {index} before its start")
        return block

    def _delta(self, event: Mapping[str, Any]) -> list[Chunk]:
        block = self._block(event)
        delta = as_dict(event.get("delta"))
        key = _DELTA_KEYS.get(delta.get("type"))
        piece = None if key is None else delta.get(key)
        if key is None or not isinstance(piece, str):
            return []  # citations and later delta types carry nothing the transcript keeps
        if key == "partial_json":
            block.json.append(piece)
            return []
        block.data[key] = block.data.get(key, "") + piece
        if key == "text":
            return self.text.chunks(None, piece)
        if key == "thinking":
            return self.text.chunks(piece, None)
        return []

    def _stop(self, event: Mapping[str, Any]) -> list[Chunk]:
        block = self._block(event)
        self.open.discard(self._index(event))
        data = block.data
        if data["type"] != "tool_use":
            self.done_blocks.append(data)
            return []
        raw = "".join(block.json)
        if not raw and isinstance(data.get("input"), dict) and data["input"]:
            raw = json.dumps(data["input"])
        return [self._call(data, raw)]

    def _call(self, data: dict[str, Any], raw: str) -> ToolCallDelta:
        name = data.get("name")
        if not isinstance(name, str) or not name:
            raise self.reporter.protocol("sent a tool_use block without a name")
        delta = decoded_call(data.get("id"), name, raw, self.seen)
        call = delta.call
        self.done_blocks.append({"type": "tool_use", "id": call["id"],
                                 "name": call["function"]["name"],
                                 "input": call["function"]["arguments"]})
        return delta

    def _count(self, usage: Mapping[str, Any]) -> None:
        """Usage from message_start, then message_delta's cumulative counts; the input
        tokens include those written to and read from the prompt cache, and those read
        are the cached input tokens too."""
        inputs = [usage.get(key) for key in
                  ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")]
        if any(isinstance(value, int) for value in inputs):
            self.usage["input_tokens"] = sum(v for v in inputs if isinstance(v, int))
        with_cached(self.usage, inputs[2])
        output = usage.get("output_tokens")
        if isinstance(output, int):
            self.usage["output_tokens"] = output
            self.usage_reported = isinstance(inputs[0], int) or self.usage_reported

    def _done(self) -> list[Chunk]:
        if self.open:
            raise self.reporter.protocol("ended the message with a content block still open")
        chunks = self.text.flush()
        blocks = self.done_blocks
        if any(block["type"] in _THINKING for block in blocks):
            chunks.append(NativeData({"wire": WIRE, "content": _native(blocks)}))
        reason = STOP_REASONS.get(self.stop, self.stop) if self.stop is not None else None
        usage = self.usage.copy()
        chunks.append(TurnDone(usage, reason, self.usage_reported))
        self.finished = True
        return chunks

    # -- whole ------------------------------------------------------------------------

    def whole(self, body: bytes) -> list[Chunk]:
        reply = self.reporter.json_object(body, "a reply")
        if reply.get("type") == "error":
            raise self._error(reply.get("error"))
        content = reply.get("content")
        if not isinstance(content, list):
            raise self.reporter.protocol(f"sent a reply without content: {clip(body)}")
        chunks: list[Chunk] = []
        for block in content:
            if not isinstance(block, dict):
                continue
            kind = block.get("type")
            if kind == "tool_use":
                raw = json.dumps(block.get("input") if isinstance(block.get("input"), dict) else {})
                chunks.append(self._call(block, raw))
                continue
            if kind == "text":
                chunks += self.text.chunks(None, block.get("text"))
            elif kind == "thinking":
                chunks += self.text.chunks(block.get("thinking"), None)
            self.done_blocks.append(dict(block))
        stop = reply.get("stop_reason")
        if not isinstance(stop, str):
            raise self.reporter.protocol("sent a reply that did not finish (no stop_reason)")
        self.stop = stop
        self._count(as_dict(reply.get("usage")))
        return chunks + self._done()


def _native(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reply's blocks as the API takes them back: thinking exactly as it came."""
    kept: list[dict[str, Any]] = []
    for block in blocks:
        kind = block["type"]
        if kind == "thinking":
            kept.append(
                {"type": "thinking", "thinking": block.get("thinking", ""),
                 "signature": block.get("signature", "")}
            )
        elif kind == "redacted_thinking":
            kept.append({"type": "redacted_thinking", "data": block.get("data", "")})
        elif kind == "text":
            kept.append({"type": "text", "text": clean(str(block.get("text", "")))})
        elif kind == "tool_use":
            kept.append(block)
    return kept

