"""``openai:<model>``: any OpenAI-compatible ``/chat/completions`` server, over httpx.

llama.cpp server, vLLM, LM Studio, OpenAI itself. The transcript is converted to the
wire form here: tool-call arguments become JSON strings, tool results carry
``tool_call_id``, our own keys and thinking stay home. Replies stream as SSE; streamed
tool-call fragments are joined by index. The API key is sent as a Bearer header and
appears in no repr, log or error message.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from aimu.aio.client import Chunk, TextDelta, ThinkingDelta, ToolCallDelta, TurnDone
from aimu.aio.errors import ModelError, ModelHTTPError, ModelProtocolError
from aimu.aio.providers._http import PooledClient, call_id, display_url, drain, transport_error
from aimu.aio.transcript import Message, ToolCall, ToolSpec, Usage

__all__ = ["DEFAULT_BASE_URL", "OpenAIClient", "SSEParser", "to_wire"]

DEFAULT_BASE_URL = "https://api.openai.com/v1"
_SERVICE = "the OpenAI-compatible server"
_HINT = "is the server running? check base_url= / OPENAI_BASE_URL, or use --model test"
_TEXT_LIMIT = 500
_RAW_LIMIT = 200
_REDACTED = "***"


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
                        "arguments": json.dumps(
                            call["function"]["arguments"], ensure_ascii=False
                        ),
                    },
                }
                for call in calls
            ]
        return wire
    return {"role": message["role"], "content": message["content"]}


class SSEParser:
    """Server-sent events, fed line by line: returns each event's data when it completes.

    Multi-line data is joined with newlines; comments and other fields are skipped; an
    event is dispatched at its blank line (or by :meth:`flush` at the end of the stream).
    """

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        name, colon, value = line.partition(":")
        if name != "data":
            return None  # event:, id:, retry: mean nothing for chat completions
        self._data.append(value[1:] if colon and value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


class _Secret:
    """An API key that never shows itself in a repr or a str."""

    __slots__ = ("value",)

    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "<secret>"

    __str__ = __repr__


class _Pool:
    """The ``httpx.AsyncClient`` that a client and its forks share, made on first use."""

    __slots__ = ("api_key", "client", "headers", "timeout")

    def __init__(
        self, api_key: _Secret | None, headers: Mapping[str, str], timeout: httpx.Timeout
    ) -> None:
        self.api_key = api_key
        self.headers = dict(headers)
        self.timeout = timeout
        self.client: httpx.AsyncClient | None = None

    def get(self) -> httpx.AsyncClient:
        # Made lazily, so a client built outside a running loop binds to the loop using it.
        if self.client is None:
            headers = {"Accept": "application/json", **self.headers}
            if self.api_key is not None:
                headers["Authorization"] = f"Bearer {self.api_key.value}"
            self.client = httpx.AsyncClient(timeout=self.timeout, headers=headers)
        return self.client

    async def aclose(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.aclose()


@dataclass
class _PendingCall:
    """A streamed tool call being assembled from its fragments."""

    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class OpenAIClient(PooledClient[_Pool]):
    """A model on an OpenAI-compatible server (``client("openai:gpt-4o-mini")``).

    ``options`` (temperature, max_tokens...) are merged into every request body.
    ``timeout`` bounds each read, ``connect_timeout`` the connection, so an
    unreachable server fails fast instead of hanging.
    """

    provider = "openai"

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        options: Mapping[str, Any] | None = None,
        timeout: float = 300.0,
        connect_timeout: float = 5.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(model)
        url = (base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL).strip()
        if "://" not in url:
            raise ValueError(
                f"base_url {display_url(url)!r} needs a scheme, e.g. http://127.0.0.1:8080/v1"
            )
        self.base_url = url.rstrip("/")
        self.options: dict[str, Any] = dict(options or {})
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        secret = _Secret(key) if key else None
        timeouts = httpx.Timeout(timeout, connect=connect_timeout)
        self._pool = _Pool(secret, headers or {}, timeouts)

    @property
    def host(self) -> str:
        return display_url(self.base_url)

    def _body(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] | None, stream: bool
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            **self.options,
            "model": self.model,
            "messages": [to_wire(m) for m in messages],
            "stream": stream,
        }
        if tools:
            body["tools"] = list(tools)
        if stream:
            body.setdefault("stream_options", {"include_usage": True})
        return body

    async def stream_turn(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec] | None = None,
        *,
        stream: bool = True,
    ) -> AsyncGenerator[Chunk, None]:
        client = self._pool.get()
        request = client.build_request(
            "POST",
            f"{self.base_url}/chat/completions",
            json=self._body(messages, tools, stream),
            headers={"Accept": "text/event-stream"} if stream else None,
        )
        try:
            response = await client.send(request, stream=True)
        except httpx.TransportError as error:
            raise self._transport(error) from error
        lines: AsyncIterator[str] | None = None
        try:
            if response.status_code >= 400:
                raise await self._http_error(response)
            if not stream:
                try:
                    raw = await response.aread()
                except httpx.TransportError as error:
                    raise self._transport(error) from error
                for chunk in self._whole(raw):
                    yield chunk
                return
            lines = response.aiter_lines()
            turn = _StreamedTurn(self)
            parser = SSEParser()
            while True:
                # Only the read is guarded: an exception thrown in at a yield is not ours.
                try:
                    line = await anext(lines)
                except StopAsyncIteration:
                    break
                except httpx.TransportError as error:
                    raise self._transport(error) from error
                except httpx.HTTPError as error:  # a body that cannot be decoded
                    raise self._protocol(f"sent a body that could not be read ({error})") from error
                data = parser.feed(line)
                if data is None:
                    continue
                chunks = turn.event(data)
                if turn.finished:
                    await drain(lines)  # so the connection goes back to the pool
                for chunk in chunks:
                    yield chunk
                if turn.finished:
                    return
            data = parser.flush()
            if data is not None:
                for chunk in turn.event(data):
                    yield chunk
            for chunk in turn.end():
                yield chunk
        finally:
            # Closes the HTTP response now, whether we finished, failed, were closed or
            # cancelled; the server sees the connection go.
            if isinstance(lines, AsyncGenerator):
                await lines.aclose()
            await response.aclose()

    # -- replies ------------------------------------------------------------------------

    def _whole(self, raw: bytes) -> list[Chunk]:
        try:
            reply = json.loads(raw)
        except ValueError as error:
            raise self._protocol(f"sent a reply that is not JSON ({error}): {_clip(raw)}") from None
        if not isinstance(reply, dict):
            raise self._protocol(f"sent a reply that is not a JSON object: {_clip(raw)}")
        if "error" in reply:
            raise self._stream_error(reply["error"])
        choice = _first_choice(reply)
        message = choice.get("message") if choice is not None else None
        if not isinstance(message, dict):
            raise self._protocol(f"sent a reply without choices[0].message: {_clip(raw)}")
        chunks = _text_chunks(message)
        pending: list[_PendingCall] = []
        for position, call in enumerate(_list(message.get("tool_calls"))):
            function = _dict(_dict(call).get("function"))
            arguments = function.get("arguments", "")
            if not isinstance(arguments, str):  # some servers send an object already
                arguments = json.dumps(arguments)
            name = function.get("name")
            if not isinstance(name, str) or not name:
                raise self._protocol(f"sent tool call {position} without a function name")
            pending.append(_PendingCall(str(_dict(call).get("id") or ""), name, [arguments]))
        chunks.extend(self._calls(pending))
        finish = choice.get("finish_reason") if choice is not None else None
        if not isinstance(finish, str):
            raise self._protocol("sent a reply that did not finish (no finish_reason)")
        chunks.append(TurnDone(_usage(reply.get("usage")), finish))
        return chunks

    def _calls(self, pending: Iterable[_PendingCall]) -> list[ToolCallDelta]:
        """Complete tool calls; arguments that are not a JSON object become a tool error."""
        deltas: list[ToolCallDelta] = []
        seen: set[str] = set()
        for call in pending:
            identifier = call.id if call.id and call.id not in seen else call_id()
            seen.add(identifier)
            raw = "".join(call.arguments)
            arguments: dict[str, Any] = {}
            error: str | None = None
            try:
                parsed = json.loads(raw) if raw.strip() else {}
            except ValueError as problem:
                error = f"{problem}"
            else:
                if isinstance(parsed, dict):
                    arguments = parsed
                else:
                    error = f"expected a JSON object, got {type(parsed).__name__}"
            if error is not None:
                error = (
                    f"the arguments for tool {call.name} were not valid JSON: {error}; "
                    f"raw: {_clip(raw, _RAW_LIMIT)}"
                )
            tool_call: ToolCall = {
                "id": identifier,
                "type": "function",
                "function": {"name": call.name, "arguments": arguments},
            }
            deltas.append(ToolCallDelta(tool_call, error))
        return deltas

    # -- errors -------------------------------------------------------------------------

    def _redact(self, text: str) -> str:
        key = self._pool.api_key
        return text.replace(key.value, _REDACTED) if key is not None else text

    def _transport(self, error: httpx.TransportError) -> ModelError:
        return transport_error(
            error, service=_SERVICE, host=self.host, hint=_HINT, timeout=self._pool.timeout
        )

    def _protocol(self, what: str) -> ModelProtocolError:
        return ModelProtocolError(
            self._redact(f"{_SERVICE} at {self.host} {what} (model {self.model!r})"),
            host=self.host,
        )

    def _stream_error(self, detail: object) -> ModelHTTPError:
        text = self._redact(_error_message(detail))
        return ModelHTTPError(
            f"{_SERVICE} at {self.host} reported an error for model {self.model!r}: "
            f"{text[:_TEXT_LIMIT]}",
            host=self.host, status_code=200, body=text,
        )

    async def _http_error(self, response: httpx.Response) -> ModelError:
        try:
            raw = await response.aread()
        except httpx.TransportError as error:
            return self._transport(error)
        body = self._redact(raw.decode("utf-8", "replace"))
        try:
            detail: object = json.loads(body)
        except ValueError:
            detail = body
        if isinstance(detail, dict) and "error" in detail:
            detail = detail["error"]
        text = _error_message(detail)[:_TEXT_LIMIT] or response.reason_phrase
        status = response.status_code
        hint = ""
        if status in (401, 403):
            hint = "; check api_key= / OPENAI_API_KEY"
        elif status == 404:
            hint = f"; check the model name and that {self.host} serves /chat/completions"
        elif status == 429:
            retry = response.headers.get("retry-after")
            hint = f"; retry after {retry}s" if retry else "; slow down and retry"
        return ModelHTTPError(
            f"{_SERVICE} at {self.host} answered HTTP {status} for model {self.model!r}: "
            f"{text}{hint}",
            host=self.host, status_code=status, body=body,
        )


class _StreamedTurn:
    """The state of one streamed reply: tool calls by index, finish reason, usage."""

    __slots__ = ("calls", "client", "finish", "finished", "usage")

    def __init__(self, client: OpenAIClient) -> None:
        self.client = client
        self.calls: dict[int, _PendingCall] = {}
        self.finish: str | None = None
        self.usage: Usage = {"input_tokens": 0, "output_tokens": 0}
        self.finished = False

    def event(self, data: str) -> list[Chunk]:
        if data.strip() == "[DONE]":
            return self.end(done=True)
        try:
            event = json.loads(data)
        except ValueError as error:
            raise self.client._protocol(
                f"sent an event that is not JSON ({error}): {_clip(data)}"
            ) from None
        if not isinstance(event, dict):
            raise self.client._protocol(f"sent an event that is not a JSON object: {_clip(data)}")
        if "error" in event:
            raise self.client._stream_error(event["error"])
        if isinstance(event.get("usage"), dict):
            self.usage = _usage(event["usage"])
        choice = _first_choice(event)
        if choice is None:
            return []
        delta = _dict(choice.get("delta"))
        chunks = _text_chunks(delta)
        for position, fragment in enumerate(_list(delta.get("tool_calls"))):
            self._add_fragment(_dict(fragment), position)
        finish = choice.get("finish_reason")
        if isinstance(finish, str) and finish and self.finish is None:
            self.finish = finish
            chunks.extend(self._take_calls())
        return chunks

    def _add_fragment(self, fragment: Mapping[str, Any], position: int) -> None:
        index = fragment.get("index", position)
        if not isinstance(index, int):
            raise self.client._protocol(f"sent a tool-call fragment with index {index!r}")
        pending = self.calls.setdefault(index, _PendingCall())
        if isinstance(fragment.get("id"), str) and fragment["id"]:
            pending.id = fragment["id"]
        function = _dict(fragment.get("function"))
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
        ordered = [calls[index] for index in sorted(calls)]
        for index, call in zip(sorted(calls), ordered, strict=True):
            if not call.name:
                raise self.client._protocol(f"sent tool call {index} without a function name")
        return list(self.client._calls(ordered))

    def end(self, *, done: bool = False) -> list[Chunk]:
        """The turn's last chunks at ``[DONE]`` or the end of the stream."""
        if not done and self.finish is None:
            raise self.client._protocol(
                "ended the stream without a finish_reason or [DONE]; "
                "the server may have stopped mid-reply"
            )
        chunks = self._take_calls()
        chunks.append(TurnDone(self.usage, self.finish))
        self.finished = True
        return chunks


def _text_chunks(message: Mapping[str, Any]) -> list[Chunk]:
    """The thinking and text of a reply message or a stream delta (servers name thinking
    ``reasoning_content`` or ``reasoning``)."""
    chunks: list[Chunk] = []
    thinking = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(thinking, str) and thinking:
        chunks.append(ThinkingDelta(thinking))
    content = message.get("content")
    if isinstance(content, str) and content:
        chunks.append(TextDelta(content))
    return chunks


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _first_choice(reply: Mapping[str, Any]) -> dict[str, Any] | None:
    choices = reply.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None


def _usage(value: object) -> Usage:
    usage = _dict(value)
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    return {
        "input_tokens": prompt if isinstance(prompt, int) else 0,
        "output_tokens": completion if isinstance(completion, int) else 0,
    }


def _error_message(detail: object) -> str:
    """The server's own words from an error: ``{"message": ...}``, a string, or the JSON."""
    if isinstance(detail, str):
        return detail.strip()
    if isinstance(detail, dict):
        for key in ("message", "detail", "error"):
            if isinstance(detail.get(key), str):
                return str(detail[key]).strip()
    return json.dumps(detail, default=str)


def _clip(text: str | bytes, limit: int = _TEXT_LIMIT) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return text if len(text) <= limit else text[:limit] + "…"
