"""The loopback protocol server: Ollama and OpenAI-compatible chat over real HTTP/1.1.

A :class:`LoopbackServer` listens on 127.0.0.1 (a random port by default) and plays a
script (:mod:`aimu.testing.script`) through ``/api/chat`` (NDJSON) and
``/v1/chat/completions`` (SSE), with delays and injected faults. It records every
request, and for every chat reply whether the client abandoned it and when: a closed
client connection is noticed even while the server waits between chunks.

Run ``python -m aimu.testing.server [--port N] [--delay S]`` to serve the embedded
``test`` model until SIGINT or SIGTERM.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import importlib
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self, TypeAlias, TypeVar, overload

from aimu.testing.script import Script, ScriptedCall, Turn, split_text

__all__ = [
    "LoopbackServer",
    "RecordedRequest",
    "StreamRecord",
    "default_script",
    "main",
    "requested_schema",
]

WireProtocol: TypeAlias = Literal["ollama", "openai"]

_T = TypeVar("_T")
_MAX_HEAD = 64 * 1024
_MAX_BODY = 256 * 1024 * 1024
_READ_SIZE = 64 * 1024
_CLOSE_GRACE = 1.0
_OLLAMA_VERSION = "0.6.0"
_REDACTED = "***"
_SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key"})
_MID_STREAM_FAULTS = frozenset({"bad_json", "drop", "hang"})
_HTTP_FAULTS = {"http_500": 500, "http_429": 429, "http_502": 502, "http_503": 503, "http_504": 504}
_FAULT_WORDS = {
    429: "rate limited",
    500: "internal server error",
    502: "bad gateway",
    503: "service unavailable",
    504: "gateway timeout",
}
_REASONS = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
_JSON = "application/json"
_END_OF_BODY = b"0\r\n\r\n"
_OPENAI_CHAT = "/v1/chat/completions"
_ROUTES = {
    "/api/chat": "POST",
    "/api/version": "GET",
    "/api/tags": "GET",
    "/v1/chat/completions": "POST",
    "/v1/models": "GET",
}


class Headers(dict[str, str]):
    """Request headers: keys stored lower-case, looked up case-insensitively."""

    def __getitem__(self, key: str) -> str:
        return super().__getitem__(key.lower())

    def __contains__(self, key: object) -> bool:
        return super().__contains__(key.lower() if isinstance(key, str) else key)

    @overload
    def get(self, key: str, default: None = None, /) -> str | None: ...
    @overload
    def get(self, key: str, default: str, /) -> str: ...
    @overload
    def get(self, key: str, default: _T, /) -> str | _T: ...
    def get(self, key: str, default: object = None, /) -> object:
        return super().get(key.lower(), default)


@dataclass
class RecordedRequest:
    """One request as the server received it (secret header values redacted)."""

    method: str
    path: str
    protocol: WireProtocol
    body: dict[str, Any]
    headers: Headers
    time: float
    """``time.monotonic()`` when the request was fully read."""
    connection: int = 0
    """Serial number of the TCP connection it came on (equal numbers: keep-alive)."""


@dataclass
class StreamRecord:
    """One chat reply (streamed or not) and how it ended.

    ``completed``: the final marker was sent; ``abandoned``: the client closed the
    connection before that, noticed at ``abandoned_at`` (``time.monotonic()``).
    """

    path: str
    protocol: WireProtocol
    streamed: bool
    started_at: float
    fault: str | None = None
    finished_at: float | None = None
    completed: bool = False
    abandoned: bool = False
    abandoned_at: float | None = None
    chunks_sent: int = 0


class _BadRequest(Exception):
    """The bytes on the wire are not an HTTP/1.1 request we can serve."""


class _PeerGone(Exception):
    """The client closed its connection in the middle of a request."""


@dataclass
class _Request:
    method: str
    target: str
    version: str
    headers: Headers
    body: bytes

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]

    @property
    def keep_alive(self) -> bool:
        connection = self.headers.get("connection", "").lower()
        if self.version == "HTTP/1.0":
            return connection == "keep-alive"
        return connection != "close"


class _Connection:
    """One client connection: request parsing, writes, and noticing the peer close."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        number: int,
    ) -> None:
        self.number = number
        self.reader = reader
        self.writer = writer
        self.buffer = bytearray()
        self.peer_closed = asyncio.Event()
        self.peer_closed_at: float | None = None
        self._spawn = spawn
        self._watcher: asyncio.Task[None] | None = None

    def _mark_peer_closed(self) -> None:
        if not self.peer_closed.is_set():
            self.peer_closed_at = time.monotonic()
            self.peer_closed.set()

    async def _fill(self) -> bool:
        data = await self.reader.read(_READ_SIZE)
        if not data:
            return False
        self.buffer += data
        return True

    async def _need(self, size: int) -> None:
        while len(self.buffer) < size:
            if not await self._fill():
                raise _PeerGone

    async def _line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            if len(self.buffer) > _MAX_HEAD:
                raise _BadRequest("a chunk-size line is too long")
            if not await self._fill():
                raise _PeerGone
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line

    async def read_request(self) -> _Request | None:
        """The next request, or None when the client closed between requests."""
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            if len(self.buffer) > _MAX_HEAD:
                raise _BadRequest(f"the request head is over {_MAX_HEAD} bytes")
            if not await self._fill():
                if self.buffer.strip():
                    raise _PeerGone
                return None
        head = bytes(self.buffer[:end]).decode("latin-1")
        del self.buffer[: end + 4]
        request_line, *header_lines = head.lstrip("\r\n").split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _BadRequest(f"not an HTTP/1.x request line: {request_line[:80]!r}")
        headers = Headers()
        for line in header_lines:
            name, colon, value = line.partition(":")
            if not colon or not name.strip():
                raise _BadRequest(f"malformed header line: {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        if headers.get("expect", "").lower() == "100-continue":
            await self.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = await self._read_chunked()
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                raise _BadRequest("the Content-Length header is not a number") from None
            if not 0 <= length <= _MAX_BODY:
                raise _BadRequest(f"a body of {length} bytes is out of range")
            await self._need(length)
            body = bytes(self.buffer[:length])
            del self.buffer[:length]
        return _Request(parts[0].upper(), parts[1], parts[2], headers, body)

    async def _read_chunked(self) -> bytes:
        body = bytearray()
        while True:
            size_text = (await self._line()).split(b";")[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise _BadRequest(f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                while await self._line():  # trailers, up to the blank line
                    pass
                return bytes(body)
            if len(body) + size > _MAX_BODY:
                raise _BadRequest("the chunked body is too large")
            await self._need(size + 2)
            body += self.buffer[:size]
            del self.buffer[: size + 2]

    def watch(self) -> None:
        """Start noticing the peer close while a reply is produced."""
        self._watcher = self._spawn(self._watch())

    async def _watch(self) -> None:
        # Bytes that arrive here are a pipelined next request: they stay in `buffer`.
        try:
            while await self._fill():
                pass
        except (ConnectionError, OSError):
            pass
        self._mark_peer_closed()

    async def unwatch(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None and not watcher.done():
            watcher.cancel()
            # asyncio.wait never raises the watcher's CancelledError, only our own.
            await asyncio.wait([watcher])

    async def wait(self, seconds: float | None) -> bool:
        """Wait ``seconds`` (None: forever); True as soon as the peer has closed."""
        if self.peer_closed.is_set():
            return True
        if seconds is not None and seconds <= 0:
            return False
        try:
            async with asyncio.timeout(seconds):
                await self.peer_closed.wait()
        except TimeoutError:
            return False
        return True

    async def send(self, data: bytes) -> bool:
        """Write ``data``; False when the peer is gone (the write failed or it closed)."""
        if self.peer_closed.is_set() or self.writer.is_closing():
            self._mark_peer_closed()
            return False
        try:
            self.writer.write(data)
            await self.writer.drain()
        except (ConnectionError, OSError):
            self._mark_peer_closed()
            return False
        return True

    async def close(self, *, abort: bool) -> None:
        if abort:
            self.writer.transport.abort()
        else:
            self.writer.close()
        try:
            async with asyncio.timeout(_CLOSE_GRACE):
                await self.writer.wait_closed()
        except TimeoutError:
            self.writer.transport.abort()
        except (ConnectionError, OSError):
            pass


def _json_bytes(value: object) -> bytes:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:
        # A scripted lone surrogate goes out as a JSON escape, as a buggy server sends it.
        return json.dumps(value, separators=(",", ":")).encode()


def _frame(data: bytes) -> bytes:
    """One HTTP/1.1 chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def _head(status: int, headers: Sequence[tuple[str, str]], *, keep_alive: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}", "Server: aimu-loopback"]
    lines += [f"{name}: {value}" for name, value in headers]
    lines.append(f"Connection: {'keep-alive' if keep_alive else 'close'}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _plain_response(
    status: int,
    body: bytes,
    *,
    keep_alive: bool,
    content_type: str = "application/json",
    extra: Sequence[tuple[str, str]] = (),
) -> bytes:
    headers = [("Content-Type", content_type), ("Content-Length", str(len(body))), *extra]
    return _head(status, headers, keep_alive=keep_alive) + body


def _output_tokens(turn: Turn) -> int:
    if turn.output_tokens is not None:
        return turn.output_tokens
    return len(split_text(turn.text, turn.chunks))


class _Wire(abc.ABC):
    """How one protocol frames a scripted turn; subclasses per protocol."""

    protocol: WireProtocol
    stream_content_type: str

    def __init__(self, model: str, body: Mapping[str, Any], call_ids: Iterator[int]) -> None:
        self.model = model
        self.body = body
        self.call_ids = call_ids

    @abc.abstractmethod
    def error_body(self, status: int, message: str) -> bytes:
        ...

    @abc.abstractmethod
    def chunks(self, turn: Turn) -> list[bytes]:
        """The framed content lines/events of a streamed turn, without the final marker."""

    @abc.abstractmethod
    def final(self, turn: Turn) -> list[bytes]:
        ...

    @abc.abstractmethod
    def bad_line(self) -> bytes:
        ...

    @abc.abstractmethod
    def whole(self, turn: Turn, *, finished: bool = True) -> bytes:
        """The non-streamed reply; ``finished=False`` leaves out the done marker."""


class _OllamaWire(_Wire):
    protocol = "ollama"
    stream_content_type = "application/x-ndjson"

    def error_body(self, status: int, message: str) -> bytes:
        return _json_bytes({"error": message})

    def _line(self, message: Mapping[str, Any], **extra: Any) -> bytes:
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        line = {
            "model": self.model,
            "created_at": created,
            "message": {"role": "assistant", "content": "", **message},
            "done": False,
            **extra,
        }
        return _json_bytes(line) + b"\n"

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
            "eval_count": _output_tokens(turn),
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


class _OpenAIWire(_Wire):
    protocol = "openai"
    stream_content_type = "text/event-stream"

    def __init__(self, model: str, body: Mapping[str, Any], call_ids: Iterator[int]) -> None:
        super().__init__(model, body, call_ids)
        self.completion_id = f"chatcmpl-{next(call_ids)}"
        self._role_sent = False

    def error_body(self, status: int, message: str) -> bytes:
        kind = "rate_limit_error" if status == 429 else "server_error"
        if status < 500 and status != 429:
            kind = "invalid_request_error"
        return _json_bytes({"error": {"message": message, "type": kind, "code": status}})

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
        return b"data: " + _json_bytes(chunk) + b"\n\n"

    def _ids(self, calls: Sequence[ScriptedCall]) -> list[str]:
        return [call.id or f"call_{next(self.call_ids)}" for call in calls]

    @staticmethod
    def _usage(turn: Turn) -> dict[str, int]:
        output = _output_tokens(turn)
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
            events.append(b"data: " + _json_bytes(usage) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        return events

    def bad_line(self) -> bytes:
        return b'data: {"choices": this is not JSON\n\n'

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
        return _json_bytes(reply)


# -- the embedded test model as a script ------------------------------------------------


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
            "content": content if isinstance(content, str) else "",
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


def _alternation_error(messages: object) -> str | None:
    """The 400 a strict chat template gives two user, or two assistant, turns in a row."""
    if not isinstance(messages, list):
        return None
    previous = ""
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else None
        if role in ("user", "assistant") and role == previous:
            return (
                "Conversation roles must alternate user/assistant/user/assistant/...: "
                f"messages {index - 1} and {index} are both {role!r}"
            )
        previous = str(role)
    return None


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


class _ScriptError(Exception):
    """The script could not give a turn; the message goes to the client as a 500."""


# -- the server ---------------------------------------------------------------------------


class LoopbackServer:
    """An HTTP/1.1 server on asyncio streams speaking the Ollama and OpenAI chat protocols.

    ``script``: a list of :class:`Turn` served in order, one per chat request (both
    protocols share the position), or a function of the request body; None serves the
    embedded ``test`` model. Use ``async with server:`` or ``LoopbackServer.in_thread()``.
    """

    def __init__(
        self,
        script: Script | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        strict_alternation: bool = False,
    ) -> None:
        self.host = host
        self.port = port
        #: Refuse (400) a chat whose user and assistant turns do not alternate, as the
        #: chat templates of Mistral or Gemma on vLLM do.
        self.strict_alternation = strict_alternation
        self.requests: list[RecordedRequest] = []
        self.streams: list[StreamRecord] = []
        self.connections_accepted = 0
        self._script: Script = default_script()
        self._position = 0
        self.script = script
        self._state: Literal["created", "running", "stopped"] = "created"
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._models: dict[str, None] = {"test": None}
        self._serial = iter(range(1, sys.maxsize))

    # -- script ---------------------------------------------------------------------

    @property
    def script(self) -> Script:
        return self._script

    @script.setter
    def script(self, script: Script | None) -> None:
        """Replace the script; a list starts again from its first turn."""
        self._script = default_script() if script is None else script
        self._position = 0

    def _next_turn(self, body: Mapping[str, Any]) -> Turn:
        script = self._script
        if callable(script):
            try:
                return script(body)
            except Exception as error:
                raise _ScriptError(
                    f"loopback script function raised {type(error).__name__}: {error}"
                ) from error
        position = self._position
        if position >= len(script):
            raise _ScriptError(
                f"loopback script exhausted: it has {len(script)} turns and chat request "
                f"{position + 1} arrived; give the server more turns"
            )
        self._position = position + 1
        return script[position]

    # -- lifecycle ------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://HOST:PORT``, the Ollama host (the server must be started)."""
        if self._state != "running":
            raise RuntimeError(
                f"loopback server is {self._state}, not running: "
                "use `async with server:` or `await server.start()` first"
            )
        return f"http://{self.host}:{self.port}"

    @property
    def openai_base_url(self) -> str:
        return self.url + "/v1"

    async def start(self) -> None:
        """Listen on ``host:port`` (port 0: a free one, then set in ``port``)."""
        if self._state != "created":
            raise RuntimeError(f"loopback server is {self._state}; a server starts only once")
        self._server = await asyncio.start_server(self._on_connection, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._state = "running"

    async def stop(self) -> None:
        """Stop listening, close every connection and wait for every task it started."""
        if self._state != "running" or self._server is None:
            self._state = "stopped"
            return
        self._state = "stopped"
        self._server.close()
        await asyncio.sleep(0)  # connections accepted just now start, see "stopped", and close
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    @classmethod
    @contextlib.contextmanager
    def in_thread(
        cls, script: Script | None = None, *, host: str = "127.0.0.1", port: int = 0
    ) -> Iterator[LoopbackServer]:
        """The server on its own event loop in a daemon thread; stopped on exit."""
        server = cls(script, host=host, port=port)
        ready = threading.Event()
        failures: list[Exception] = []
        control: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

        async def serve() -> None:
            stop_requested = asyncio.Event()
            control.append((asyncio.get_running_loop(), stop_requested))
            try:
                await server.start()
            except Exception as error:
                failures.append(error)
                return
            finally:
                ready.set()
            try:
                await stop_requested.wait()
            finally:
                await server.stop()

        thread = threading.Thread(
            target=lambda: asyncio.run(serve()), name="aimu-loopback-server", daemon=True
        )
        thread.start()
        ready.wait()
        if failures:
            thread.join()
            raise failures[0]
        try:
            yield server
        finally:
            loop, stop_requested = control[0]
            loop.call_soon_threadsafe(stop_requested.set)
            thread.join()

    # -- abandoned streams ------------------------------------------------------------

    def _abandoned(self) -> list[StreamRecord]:
        return [record for record in self.streams if record.abandoned]

    async def wait_abandoned(
        self,
        count: int = 1,
        timeout: float = 5.0,  # noqa: ASYNC109 - the documented API takes a timeout
    ) -> list[StreamRecord]:
        """Wait until ``count`` replies were abandoned by their client; TimeoutError if not.

        Works from any event loop (also with :meth:`in_thread`).
        """
        await self.wait_until(
            lambda: len(self._abandoned()) >= count,
            timeout,
            lambda: f"{len(self._abandoned())} of {count} expected streams were abandoned",
        )
        return self._abandoned()

    async def wait_requests(
        self,
        count: int = 1,
        timeout: float = 5.0,  # noqa: ASYNC109 - the documented API takes a timeout
    ) -> list[RecordedRequest]:
        """Wait until the server has read ``count`` requests in all: a provable point."""
        await self.wait_until(
            lambda: len(self.requests) >= count,
            timeout,
            lambda: f"{len(self.requests)} of {count} expected requests arrived",
        )
        return self.requests

    async def wait_until(
        self,
        condition: Callable[[], bool],
        timeout: float = 5.0,  # noqa: ASYNC109 - the documented API takes a timeout
        what: Callable[[], str] = lambda: "the awaited state was not reached",
    ) -> None:
        """Wait until ``condition()`` holds; checked whenever a request arrives, a chunk is
        sent or a reply is abandoned. TimeoutError naming ``what()`` if it does not."""
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                while not condition():
                    await waiter[1].wait()
                    waiter[1].clear()
        except TimeoutError:
            raise TimeoutError(
                f"loopback server: {what()} within {timeout}s ({len(self.streams)} streams "
                "in all)"
            ) from None
        finally:
            self._waiters.remove(waiter)

    def _record_abandoned(self, record: StreamRecord, connection: _Connection) -> None:
        record.abandoned = True
        record.abandoned_at = connection.peer_closed_at or time.monotonic()
        self._notify()

    def _notify(self) -> None:
        """Wake every ``wait_until``, whichever loop it waits on."""
        here = asyncio.get_running_loop()
        for loop, wake in list(self._waiters):
            if loop is here:
                wake.set()
            else:
                with contextlib.suppress(RuntimeError):  # that loop has closed
                    loop.call_soon_threadsafe(wake.set)

    # -- connections -------------------------------------------------------------------

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A task of our own (not the one start_server would make) so that stop() can
        # cancel it and wait for it without asyncio logging the cancel as an error.
        self.connections_accepted += 1
        connection = _Connection(reader, writer, self._spawn, self.connections_accepted)
        self._spawn(self._serve_connection(connection))

    async def _serve_connection(self, connection: _Connection) -> None:
        abort = True
        try:
            if self._state != "running":
                return
            while True:
                try:
                    request = await connection.read_request()
                except _BadRequest as error:
                    body = _json_bytes({"error": f"bad request: {error}"})
                    await connection.send(_plain_response(400, body, keep_alive=False))
                    break
                except (_PeerGone, ConnectionError, OSError):
                    break
                if request is None:
                    break
                keep_alive = await self._dispatch(connection, request)
                if not keep_alive or connection.peer_closed.is_set():
                    break
            abort = False
        finally:
            await connection.unwatch()
            await connection.close(abort=abort)

    async def _dispatch(self, connection: _Connection, request: _Request) -> bool:
        """Answer one request; returns whether the connection may serve another."""
        path = request.path
        protocol: WireProtocol = "openai" if path == "/v1" or path.startswith("/v1/") else "ollama"
        keep_alive = request.keep_alive
        body: dict[str, Any] = {}
        error: str | None = None
        if request.method == "POST":
            try:
                parsed = json.loads(request.body)
            except (UnicodeDecodeError, json.JSONDecodeError) as problem:
                error = f"the request body is not valid JSON ({problem})"
            else:
                if isinstance(parsed, dict):
                    body = parsed
                else:
                    error = f"the request body must be a JSON object, not {type(parsed).__name__}"
        headers = Headers(
            (name, _REDACTED if name in _SECRET_HEADERS else value)
            for name, value in request.headers.items()
        )
        self.requests.append(
            RecordedRequest(
                request.method, path, protocol, body, headers, time.monotonic(), connection.number
            )
        )
        self._notify()
        model = str(body.get("model") or "test")
        wire_class = _OpenAIWire if protocol == "openai" else _OllamaWire
        wire = wire_class(model, body, self._serial)

        async def reply(status: int, payload: bytes, content_type: str = _JSON) -> bool:
            response = _plain_response(
                status, payload, keep_alive=keep_alive, content_type=content_type
            )
            return await connection.send(response) and keep_alive

        if path == "/" and request.method in ("GET", "HEAD"):
            return await reply(200, b"Ollama is running", "text/plain; charset=utf-8")
        method = _ROUTES.get(path)
        if method is None:
            return await reply(404, wire.error_body(404, f"no such endpoint: {path}"))
        if request.method != method:
            message = f"{path} takes {method}, not {request.method}"
            return await reply(405, wire.error_body(405, message))
        if path == "/api/version":
            return await reply(200, _json_bytes({"version": _OLLAMA_VERSION}))
        if path == "/api/tags":
            return await reply(200, self._tags())
        if path == "/v1/models":
            return await reply(200, self._model_list())
        if error is None and protocol == "openai" and path == "/v1/chat/completions":
            error = _unanswered_tool_calls(body.get("messages"))
        if error is None and self.strict_alternation and path in ("/api/chat", _OPENAI_CHAT):
            error = _alternation_error(body.get("messages"))
        if error is not None:
            return await reply(400, wire.error_body(400, error))
        self._models[model] = None
        return await self._chat(connection, wire, path, keep_alive)

    def _tags(self) -> bytes:
        models = [
            {
                "name": name,
                "model": name,
                "modified_at": "2024-01-01T00:00:00Z",
                "size": 0,
                "digest": "0" * 64,
                "details": {"format": "gguf", "family": "loopback", "parameter_size": "0B"},
            }
            for name in self._models
        ]
        return _json_bytes({"models": models})

    def _model_list(self) -> bytes:
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "aimu-loopback"}
            for name in self._models
        ]
        return _json_bytes({"object": "list", "data": data})

    async def _chat(
        self, connection: _Connection, wire: _Wire, path: str, keep_alive: bool
    ) -> bool:
        try:
            turn = self._next_turn(wire.body)
        except _ScriptError as error:
            body = wire.error_body(500, str(error))
            response = _plain_response(500, body, keep_alive=keep_alive)
            return await connection.send(response) and keep_alive
        if wire.protocol == "ollama":
            streamed = wire.body.get("stream", True) is not False
        else:
            streamed = wire.body.get("stream") is True
        record = StreamRecord(path, wire.protocol, streamed, time.monotonic(), turn.fault)
        self.streams.append(record)
        self._notify()
        connection.watch()
        try:
            if streamed:
                return await self._play_stream(connection, wire, turn, record, keep_alive)
            return await self._play_whole(connection, wire, turn, record, keep_alive)
        finally:
            record.finished_at = time.monotonic()
            await connection.unwatch()

    @staticmethod
    def _reset(connection: _Connection) -> bool:
        """Close the connection at once (RST) before any byte of the reply."""
        connection.writer.transport.abort()
        return False

    def _gone(self, connection: _Connection, record: StreamRecord) -> bool:
        self._record_abandoned(record, connection)
        return False

    async def _http_fault(
        self, connection: _Connection, wire: _Wire, turn: Turn, record: StreamRecord, keep: bool
    ) -> bool:
        status = _HTTP_FAULTS[str(turn.fault)]
        what = _FAULT_WORDS[status]
        body = wire.error_body(status, f"{what} (scripted {turn.fault} fault)")
        retry_after = turn.retry_after or ("1" if status == 429 else None)
        extra = [("Retry-After", retry_after)] if retry_after is not None else []
        response = _plain_response(status, body, keep_alive=keep, extra=extra)
        if not await connection.send(response):
            return self._gone(connection, record)
        record.chunks_sent = 1
        return keep

    async def _play_whole(
        self, connection: _Connection, wire: _Wire, turn: Turn, record: StreamRecord, keep: bool
    ) -> bool:
        # The reply takes as long as its stream would have: first byte, then each delay.
        text_pieces = len(split_text(turn.text, turn.chunks))
        pieces = bool(turn.thinking) + text_pieces + len(turn.tool_calls)
        pause = turn.first_byte_delay + turn.delay * max(0, pieces - 1)
        if await connection.wait(pause):
            return self._gone(connection, record)
        if turn.fault in _HTTP_FAULTS:
            return await self._http_fault(connection, wire, turn, record, keep)
        if turn.fault in ("drop", "reset"):
            return self._reset(connection) if turn.fault == "reset" else False
        if turn.fault == "hang":
            await connection.wait(None)
            return self._gone(connection, record)
        if turn.fault == "bad_json":
            body = wire.bad_line().strip()
        else:
            body = wire.whole(turn, finished=turn.fault != "no_done")
        if not await connection.send(_plain_response(200, body, keep_alive=keep)):
            return self._gone(connection, record)
        record.chunks_sent = 1
        record.completed = turn.fault is None
        return keep

    async def _play_stream(
        self, connection: _Connection, wire: _Wire, turn: Turn, record: StreamRecord, keep: bool
    ) -> bool:
        if await connection.wait(turn.first_byte_delay):
            return self._gone(connection, record)
        if turn.fault in _HTTP_FAULTS:
            return await self._http_fault(connection, wire, turn, record, keep)
        if turn.fault == "reset":
            return self._reset(connection)
        head = _head(
            200,
            [
                ("Content-Type", wire.stream_content_type),
                ("Cache-Control", "no-cache"),
                ("Transfer-Encoding", "chunked"),
            ],
            keep_alive=keep,
        )
        if not await connection.send(head):
            return self._gone(connection, record)
        pieces = wire.chunks(turn)
        fault_at = min(turn.fault_after, len(pieces)) if turn.fault in _MID_STREAM_FAULTS else -1
        for position in range(len(pieces) + 1):
            if position == len(pieces) and position != fault_at:
                break
            if position and await connection.wait(turn.delay):
                return self._gone(connection, record)
            if position == fault_at:
                return await self._mid_stream_fault(connection, wire, turn, record, keep)
            if not await connection.send(_frame(pieces[position])):
                return self._gone(connection, record)
            record.chunks_sent += 1
            self._notify()
        if turn.fault == "no_done":
            if not await connection.send(_END_OF_BODY):
                return self._gone(connection, record)
            return keep
        final = wire.final(turn)
        if not await connection.send(b"".join(map(_frame, final)) + _END_OF_BODY):
            return self._gone(connection, record)
        record.chunks_sent += len(final)
        record.completed = True
        return keep

    async def _mid_stream_fault(
        self, connection: _Connection, wire: _Wire, turn: Turn, record: StreamRecord, keep: bool
    ) -> bool:
        if turn.fault == "drop":
            return False  # the caller closes the socket with the body unfinished
        if turn.fault == "hang":
            await connection.wait(None)
            return self._gone(connection, record)
        if not await connection.send(_frame(wire.bad_line()) + _END_OF_BODY):
            return self._gone(connection, record)
        record.chunks_sent += 1
        return keep


# -- command line ---------------------------------------------------------------------------


async def _serve(host: str, port: int, delay: float) -> None:
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for number in signals:
        loop.add_signal_handler(number, stop_requested.set)
    try:
        async with LoopbackServer(default_script(delay), host=host, port=port) as server:
            print(f"listening on {server.url}", flush=True)
            await stop_requested.wait()
    finally:
        for number in signals:
            loop.remove_signal_handler(number)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aimu.testing.server``: serve the embedded test model until a signal."""
    parser = argparse.ArgumentParser(
        prog="python -m aimu.testing.server",
        description="Serve the embedded test model over the Ollama and OpenAI protocols.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (0: a free one)")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds between chunks")
    options = parser.parse_args(argv)
    asyncio.run(_serve(options.host, options.port, options.delay))
    return 0


if __name__ == "__main__":
    sys.exit(main())
