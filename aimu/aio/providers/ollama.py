"""``ollama:<model>``: a model served by Ollama, over ``/api/chat`` with our own JSON.

The transcript is converted to Ollama's wire form here and nowhere else: tool results
become role ``tool`` with ``tool_name``, tool-call arguments stay objects, thinking goes
in its own field, tool schemas go as given (nested schemas intact). Replies stream as
NDJSON. The official ``ollama`` package is not on this path; it stays the tool for
listing and pulling models.
"""

from __future__ import annotations

import os
from typing import Any, Literal, Unpack
from urllib.parse import urlsplit

import httpx

from aimu.aio._numbers import is_count
from aimu.aio.providers._decoder import TurnDecoder, call_id
from aimu.aio.providers._errors import clip
from aimu.aio.providers._http import HTTPModelClient, TurnInput
from aimu.aio.providers._report import Reporter
from aimu.aio.providers._settings import ClientSettings, TurnKeywords
from aimu.aio.providers._unicode import TurnText, clean, clean_json
from aimu.aio.providers._wire import decode_arguments
from aimu.aio.providers.base import (
    Chunk,
    ToolCallDelta,
    TurnDone,
)
from aimu.aio.transcript import Message, ToolCall, Usage

__all__ = ["DEFAULT_HOST", "OllamaClient", "resolve_host", "to_wire"]

DEFAULT_HOST = "http://127.0.0.1:11434"

Think = bool | Literal["low", "medium", "high"]


def resolve_host(host: str | None = None) -> str:
    """The Ollama base URL: ``host``, else ``OLLAMA_HOST``, else :data:`DEFAULT_HOST`.

    Normalised like the ollama package does: a bare ``host[:port]`` gets ``http://``
    and port 11434; ``:port`` alone means 127.0.0.1; a trailing slash is dropped.
    ``user:password@`` is kept (it becomes a Basic auth header, never part of a log).
    """
    value = (host if host is not None else os.environ.get("OLLAMA_HOST", "")).strip()
    if not value:
        return DEFAULT_HOST
    explicit = "://" in value
    scheme, _, rest = value.partition("://") if explicit else ("http", "", value)
    netloc, _, path = rest.partition("/")
    userinfo, at, netloc = netloc.rpartition("@")
    try:
        parts = urlsplit(f"{scheme}://{netloc}")
        port = parts.port
    except ValueError:
        raise ValueError(
            f"Ollama host {f'{scheme}://{netloc}'!r} is not a valid host[:port] or URL"
        ) from None
    hostname = parts.hostname or "127.0.0.1"
    if ":" in hostname:  # IPv6 literal
        hostname = f"[{hostname}]"
    if port is None:
        port = (443 if scheme == "https" else 80) if explicit else 11434
    path = path.strip("/")
    return f"{scheme}://{userinfo}{at}{hostname}:{port}" + (f"/{path}" if path else "")


def to_wire(message: Message) -> dict[str, Any]:
    """One transcript message as Ollama's ``/api/chat`` expects it."""
    if message["role"] == "tool":
        return {"role": "tool", "content": message["content"], "tool_name": message["name"]}
    if message["role"] == "assistant":
        wire: dict[str, Any] = {"role": "assistant", "content": message["content"]}
        thinking = message.get("thinking")
        if thinking:
            wire["thinking"] = thinking
        calls = message.get("tool_calls")
        if calls:
            # Ollama has no call ids on the wire: results are matched by order and name.
            wire["tool_calls"] = [
                {"function": {"name": f["name"], "arguments": f["arguments"]}}
                for f in (c["function"] for c in calls)
            ]
        return wire
    if message["role"] == "user" and message.get("images"):
        images = [url.partition(",")[2] for url in message["images"]]  # bare base64
        return {"role": "user", "content": message["content"], "images": images}
    return {"role": message["role"], "content": message["content"]}


class OllamaClient(HTTPModelClient):
    """A model on an Ollama server (``client("ollama:qwen3:8b")``).

    ``options`` (temperature, num_ctx...), ``think`` and ``keep_alive`` are sent with
    every request. ``timeout`` bounds the wait for each read, ``connect_timeout`` the
    connection, so an unreachable server fails fast instead of hanging. ``retries``
    (0 disables) and ``retry_delay`` govern retrying a request that failed before its
    reply began; ``merge_roles`` sends adjacent same-role messages as one;
    ``concurrency`` bounds the requests in flight (None: no bound; past it a request
    waits for a slot, at most ``timeout``). ``context_window`` (tokens) is the
    model's context size: an agent stops ``limited`` before a request that would not fit.
    Ollama continues a trailing assistant message, so ``resume(continue_partial=True)``
    continues a cut answer (``continues_partial=False`` for a server that cannot).
    """

    provider = "ollama"
    service = "Ollama"
    discovers_context_window = True
    _context_asked = False
    hint = "is Ollama running there? host= or OLLAMA_HOST sets the address"
    chat_path = "/api/chat"

    def __init__(
        self,
        model: str,
        *,
        host: str | None = None,
        think: Think | None = None,
        keep_alive: float | str | None = None,
        **settings: Unpack[TurnKeywords],
    ) -> None:
        settings.setdefault("continues_partial", True)  # Ollama continues a cut answer
        given = ClientSettings.of(type(self).__name__, TurnKeywords, settings)
        super().__init__(model, resolve_host(host), given,
                         headers={"Accept": "application/json"}, secrets=(), to_wire=to_wire)
        self.think = think
        self.keep_alive = keep_alive

    async def discover_context_window(self) -> int | None:
        """``options["num_ctx"]`` if set (what Ollama then uses), else the model's context
        length from ``/api/show``, asked once; None when the server cannot say."""
        if self.context_window is not None or self._context_asked:
            return self.context_window
        self._context_asked = True
        num_ctx = self.options.get("num_ctx")
        if isinstance(num_ctx, int) and not isinstance(num_ctx, bool) and num_ctx > 0:
            self.context_window = num_ctx
            return num_ctx
        http = await self._pool.bind()
        try:
            response = await http.post(self.url + "/api/show", json={"model": self.model})
            shown = response.json() if response.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return None  # unknown: the chat request itself will say what is wrong
        info = shown.get("model_info") if isinstance(shown, dict) else None
        for key, value in (info.items() if isinstance(info, dict) else ()):
            if key.endswith(".context_length") and isinstance(value, int) and value > 0:
                self.context_window = value
        return self.context_window

    def body(self, turn: TurnInput) -> bytes:
        """The request; an output schema goes as ``format``. Ollama has no
        ``tool_choice`` or ``parallel_tool_calls``: they are not sent."""
        settings: dict[str, Any] = {"model": self.model, "stream": turn.stream}
        if self.options:
            settings["options"] = self.options
        if self.think is not None:
            settings["think"] = self.think
        if self.keep_alive is not None:
            settings["keep_alive"] = self.keep_alive
        if turn.request is not None and turn.request.output_schema is not None:
            settings["format"] = turn.request.output_schema
        return self.compose(settings, turn.messages, turn.tools)

    def status_hint(self, status: int) -> str:
        if status == 404:
            return f"; pull the model first (ollama pull {self.model})"
        return ""

    def decoder(self, reporter: Reporter) -> TurnDecoder:
        return _OllamaTurn(reporter)


class _OllamaTurn(TurnDecoder):
    """One reply of ``/api/chat``: NDJSON lines, the last with ``done: true``."""

    __slots__ = ("reporter", "text")

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.text = TurnText()

    def line(self, line: bytes) -> list[Chunk]:
        if not line.strip():
            return []
        return self._part(self._parse(line, "a line"))

    def end(self) -> list[Chunk]:
        raise self.reporter.unfinished("ended its reply without the final 'done' message")

    def whole(self, body: bytes) -> list[Chunk]:
        chunks = self._part(self._parse(body, "a reply"))
        if not self.finished:
            self.end()
        return chunks

    def _parse(self, raw: bytes, what: str) -> dict[str, Any]:
        part = self.reporter.json_object(raw, what)
        if "error" in part:
            raise self.reporter.server_error(part["error"])
        return part

    def _part(self, part: dict[str, Any]) -> list[Chunk]:
        chunks: list[Chunk] = []
        message = part.get("message")
        if isinstance(message, dict):
            chunks = self.text.chunks(message.get("thinking"), message.get("content"))
            calls = message.get("tool_calls")
            if isinstance(calls, list):
                chunks.extend(self._call(call, position) for position, call in enumerate(calls))
        elif message is not None:
            raise self.reporter.protocol(
                f"sent a line that could not be understood ('message' is not an object): "
                f"{clip(message)}"
            )
        if part.get("done") is True:
            self.finished = True
            chunks.extend(self.text.flush())
            usage: Usage = {
                "input_tokens": _count(part.get("prompt_eval_count")),
                "output_tokens": _count(part.get("eval_count")),
            }
            reason = part.get("done_reason")
            reported = is_count(part.get("prompt_eval_count")) and is_count(part.get("eval_count"))
            chunks.append(
                TurnDone(usage, reason if isinstance(reason, str) and reason else None, reported)
            )
        return chunks

    def _call(self, call: object, position: int) -> ToolCallDelta:
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise self.reporter.protocol(f"sent tool call {position} without a function name")
        assert isinstance(call, dict) and isinstance(function, dict)
        server_id = call.get("id")  # newer servers send one
        arguments, error = _arguments(function.get("arguments"), clean(name))
        tool_call: ToolCall = {
            "id": clean(server_id) if isinstance(server_id, str) and server_id else call_id(),
            "type": "function",
            "function": {"name": clean(name), "arguments": arguments},
        }
        return ToolCallDelta(tool_call, error)


def _arguments(raw: object, name: str) -> tuple[dict[str, Any], str | None]:
    """The call's arguments, and what was wrong with them (a tool error the model sees)."""
    if raw is None:
        return {}, None
    if isinstance(raw, dict):
        return clean_json(raw), None
    if isinstance(raw, str):  # some servers and models send the object as a JSON string
        return decode_arguments(raw, name)
    return {}, (
        f"the arguments for tool {name} must be a JSON object, got {type(raw).__name__}: "
        f"{clip(raw, 200)}"
    )


def _count(value: object) -> int:
    """A token count the server sent; 0 for anything but an int from 0 to 2**63-1."""
    return value if is_count(value) else 0
