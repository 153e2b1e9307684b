"""``ollama:<model>``: a model served by Ollama, over the official ``ollama.AsyncClient``.

The transcript is converted to Ollama's wire form here and nowhere else: tool results
become role ``tool`` with ``tool_name``, tool-call arguments stay objects, thinking goes
in its own field. Replies stream as NDJSON; closing the turn's generator (or
cancelling its task) closes the HTTP response at once.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
import ollama
import pydantic

from aimu.aio.client import Chunk, TextDelta, ThinkingDelta, ToolCallDelta, TurnDone
from aimu.aio.errors import ModelError, ModelHTTPError, ModelProtocolError
from aimu.aio.providers._http import PooledClient, call_id, display_url, drain, transport_error
from aimu.aio.transcript import Message, ToolCall, ToolSpec, Usage

__all__ = ["DEFAULT_HOST", "OllamaClient", "resolve_host", "to_wire"]

DEFAULT_HOST = "http://127.0.0.1:11434"
_SERVICE = "Ollama"
_HINT = "is Ollama running? set OLLAMA_HOST or use --model test"
_BODY_LIMIT = 500

Think = bool | Literal["low", "medium", "high"]

# What the ollama client raises for a failed request or an unreadable reply.
_FAILURES = (
    ollama.ResponseError,
    httpx.HTTPError,
    ConnectionError,
    json.JSONDecodeError,
    pydantic.ValidationError,
)
# Inside a stream, a JSON line that is not an object surfaces as one of these too.
_STREAM_FAILURES = (*_FAILURES, AttributeError, TypeError)


def resolve_host(host: str | None = None) -> str:
    """The Ollama base URL: ``host``, else ``OLLAMA_HOST``, else :data:`DEFAULT_HOST`.

    Normalised like the ollama package does: a bare ``host[:port]`` gets ``http://``
    and port 11434; ``:port`` alone means 127.0.0.1; a trailing slash is dropped.
    """
    value = (host if host is not None else os.environ.get("OLLAMA_HOST", "")).strip()
    if not value:
        return DEFAULT_HOST
    explicit = "://" in value
    scheme, _, rest = value.partition("://") if explicit else ("http", "", value)
    netloc, _, path = rest.partition("/")
    try:
        parts = urlsplit(f"{scheme}://{netloc}")
        port = parts.port
    except ValueError as error:
        raise ValueError(f"Ollama host {value!r} is not a valid host[:port] or URL") from error
    hostname = parts.hostname or "127.0.0.1"
    if ":" in hostname:  # IPv6 literal
        hostname = f"[{hostname}]"
    if port is None:
        port = (443 if scheme == "https" else 80) if explicit else 11434
    path = path.strip("/")
    return f"{scheme}://{hostname}:{port}" + (f"/{path}" if path else "")


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
    return {"role": message["role"], "content": message["content"]}


class _Pool:
    """The ``ollama.AsyncClient`` that a client and its forks share, made on first use."""

    __slots__ = ("client", "host", "timeout")

    def __init__(self, host: str, timeout: httpx.Timeout) -> None:
        self.host = host
        self.timeout = timeout
        self.client: ollama.AsyncClient | None = None

    def get(self) -> ollama.AsyncClient:
        # Made lazily, so a client built outside a running loop binds to the loop using it.
        if self.client is None:
            self.client = ollama.AsyncClient(host=self.host, timeout=self.timeout)
        return self.client

    async def aclose(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.close()  # type: ignore[no-untyped-call]


class OllamaClient(PooledClient[_Pool]):
    """A model on an Ollama server (``client("ollama:qwen3:8b")``).

    ``options`` (temperature, num_ctx...), ``think`` and ``keep_alive`` are sent with
    every request. ``timeout`` bounds the wait for each read, ``connect_timeout`` the
    connection, so an unreachable server fails fast instead of hanging.
    """

    provider = "ollama"

    def __init__(
        self,
        model: str,
        *,
        host: str | None = None,
        options: Mapping[str, Any] | None = None,
        think: Think | None = None,
        keep_alive: float | str | None = None,
        timeout: float = 300.0,
        connect_timeout: float = 5.0,
    ) -> None:
        super().__init__(model)
        self.options: dict[str, Any] = dict(options or {})
        self.think = think
        self.keep_alive = keep_alive
        self._pool = _Pool(resolve_host(host), httpx.Timeout(timeout, connect=connect_timeout))

    @property
    def host(self) -> str:
        return display_url(self._pool.host)

    def _request(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] | None
    ) -> dict[str, Any]:
        request: dict[str, Any] = {
            "model": self.model,
            "messages": [to_wire(m) for m in messages],
        }
        if tools:
            request["tools"] = list(tools)
        if self.options:
            request["options"] = self.options
        if self.think is not None:
            request["think"] = self.think
        if self.keep_alive is not None:
            request["keep_alive"] = self.keep_alive
        return request

    async def stream_turn(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec] | None = None,
        *,
        stream: bool = True,
    ) -> AsyncGenerator[Chunk, None]:
        client = self._pool.get()
        request = self._request(messages, tools)
        if not stream:
            try:
                whole = await client.chat(**request, stream=False)
            except _FAILURES as error:
                raise self._error(error) from error
            for chunk in self._chunks(whole):
                yield chunk
            if not whole.done:
                raise self._cut_short()
            return
        parts: AsyncIterator[ollama.ChatResponse] | None = None
        try:
            try:
                parts = await client.chat(**request, stream=True)
            except _FAILURES as error:
                raise self._error(error) from error
            while True:
                # Only the read is guarded: an exception thrown in at a yield is not ours.
                try:
                    part = await anext(parts)
                except StopAsyncIteration:
                    break
                except _STREAM_FAILURES as error:
                    raise self._error(error) from error
                chunks = self._chunks(part)
                if part.done:
                    await drain(parts)  # so the connection goes back to the pool
                for chunk in chunks:
                    yield chunk
                if part.done:
                    return
            raise self._cut_short()
        finally:
            # Closes the HTTP response now, whether we finished, failed, were closed or
            # cancelled; the server sees the connection go.
            if isinstance(parts, AsyncGenerator):
                await parts.aclose()

    def _chunks(self, part: ollama.ChatResponse) -> list[Chunk]:
        chunks: list[Chunk] = []
        message = part.message
        if message.thinking:
            chunks.append(ThinkingDelta(message.thinking))
        if message.content:
            chunks.append(TextDelta(message.content))
        for call in message.tool_calls or ():
            server_id = getattr(call, "id", None)  # newer servers may send one
            function = call.function
            tool_call: ToolCall = {
                "id": server_id if isinstance(server_id, str) and server_id else call_id(),
                "type": "function",
                "function": {"name": function.name, "arguments": dict(function.arguments)},
            }
            chunks.append(ToolCallDelta(tool_call))
        if part.done:
            usage: Usage = {
                "input_tokens": part.prompt_eval_count or 0,
                "output_tokens": part.eval_count or 0,
            }
            chunks.append(TurnDone(usage, part.done_reason))
        return chunks

    def _cut_short(self) -> ModelProtocolError:
        return ModelProtocolError(
            f"the reply from {_SERVICE} at {self.host} for model {self.model!r} ended "
            "without its final 'done' message; the server may have stopped mid-reply",
            host=self.host,
        )

    def _error(self, error: Exception) -> ModelError:
        """The aimu error for ``error``, raised by the ollama client or httpx."""
        host = self.host
        if isinstance(error, ollama.ResponseError):
            text = _error_text(error.error)
            if error.status_code < 0:  # an {"error": ...} line inside a 200 stream
                return ModelHTTPError(
                    f"{_SERVICE} at {host} reported an error mid-reply for model "
                    f"{self.model!r}: {text[:_BODY_LIMIT]}",
                    host=host, status_code=200, body=text,
                )
            return ModelHTTPError(
                f"{_SERVICE} at {host} answered HTTP {error.status_code} for model "
                f"{self.model!r}: {text[:_BODY_LIMIT]}",
                host=host, status_code=error.status_code, body=text,
            )
        if isinstance(error, ConnectionError) and isinstance(
            error.__context__, httpx.TransportError
        ):
            # ollama swaps httpx's ConnectError for a generic message: use the original.
            error = error.__context__
        if isinstance(error, httpx.TransportError | ConnectionError):
            return transport_error(
                error, service=_SERVICE, host=host, hint=_HINT, timeout=self._pool.timeout
            )
        return ModelProtocolError(
            f"{_SERVICE} at {host} sent a reply that could not be understood "
            f"({type(error).__name__}: {str(error)[:_BODY_LIMIT]})",
            host=host,
        )


def _error_text(detail: object) -> str:
    """The server's own words from an error detail: a string, or ``{"message": ...}``."""
    if isinstance(detail, str):
        return detail.strip() or "(no error text)"
    if isinstance(detail, Mapping) and isinstance(detail.get("message"), str):
        return str(detail["message"])
    return json.dumps(detail, default=str)
