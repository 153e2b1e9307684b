"""``openai-responses:<model>``: OpenAI's Responses API (``POST /v1/responses``), over httpx.

The transcript becomes ``input`` items: messages, ``function_call`` and
``function_call_output`` items, and the reasoning items a reply of this wire carried
(kept in its ``aimu_native``, sent back unchanged, encrypted content included); the
system prompt goes as ``instructions``, an output schema as ``text.format``. Replies
stream as SSE events, each with its ``sequence_number``.

With ``background=True`` a turn is a background response (``background``, ``store``):
a stop closes the stream and sends ``POST /v1/responses/{id}/cancel``, so the server's
work stops too; a stream dropped mid-reply is re-attached
(``GET /v1/responses/{id}?stream=true&starting_after=N``) instead of asked again, and
:meth:`OpenAIResponsesClient.reattach` does the same for a response a crashed process
left. The API key is sent as a Bearer header and appears in no repr, log or error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Self, Unpack, cast

import httpx

from aimu.aio.errors import ModelConnectionError, ModelError, ModelHTTPError
from aimu.aio.providers._decoder import SSETurnDecoder, as_dict, decoded_call, with_cached
from aimu.aio.providers._errors import clip
from aimu.aio.providers._http import TurnInput, in_scope
from aimu.aio.providers._report import Reporter
from aimu.aio.providers._resume import tail
from aimu.aio.providers._retry import log
from aimu.aio.providers._settings import ClientSettings, ServiceKeywords
from aimu.aio.providers._wire import dumps, dumps_text, unchanged
from aimu.aio.providers.base import (
    Chunk,
    NativeData,
    TextDelta,
    ToolCallDelta,
    TurnDone,
    TurnRequest,
    TurnRetry,
)
from aimu.aio.providers.openai import OpenAIService
from aimu.aio.scope import RunScope, current_scope
from aimu.aio.transcript import Message, ToolSpec, Usage, native_data, zero_usage

__all__ = ["WIRE", "BackgroundResponse", "OpenAIResponsesClient", "input_items"]

WIRE = "openai-responses"
#: Models that reason (their reasoning items come back): OpenAI's o-series and gpt-5.
_REASONING = re.compile(r"(o\d|gpt-5|codex)", re.IGNORECASE)
#: Seconds a stop waits for the server to take a background response's cancel.
_CANCEL_WAIT = 2.0


def input_items(
    messages: Sequence[Message], *, stored: bool = False
) -> tuple[str | None, list[dict[str, Any]]]:
    """The transcript as the Responses API takes it: ``instructions`` and ``input``.

    A reply written on this wire gives back its reasoning items unchanged (from
    ``aimu_native``): with their encrypted content, or by id when the server ``stored``
    them (an unstored item without it cannot be found, so it stays home). Thinking from
    another wire cannot cross and is left out.
    """
    instructions: str | None = None
    items: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "system":
            instructions = message["content"]
        elif message["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": message["tool_call_id"],
                          "output": message["content"]})
        elif message["role"] == "assistant":
            native = native_data(message, WIRE)
            reasoning = native.get("reasoning") if native is not None else None
            if isinstance(reasoning, list):
                items.extend(
                    item for item in reasoning
                    if isinstance(item, dict) and (stored or item.get("encrypted_content"))
                )
            if message["content"]:
                items.append({"role": "assistant", "content": message["content"]})
            for call in message.get("tool_calls", ()):
                items.append({
                    "type": "function_call", "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": dumps_text(call["function"]["arguments"]),
                })
        elif message["role"] == "user" and message.get("images"):
            parts: list[dict[str, Any]] = [{"type": "input_text", "text": message["content"]}]
            parts += [{"type": "input_image", "image_url": url} for url in message["images"]]
            items.append({"role": "user", "content": parts})
        else:
            items.append({"role": message["role"], "content": message["content"]})
    return instructions, items


@dataclass(frozen=True)
class BackgroundResponse:
    """A background response in flight: its id and the last event number read. What a
    run keeps durable to re-attach after a crash (:meth:`OpenAIResponsesClient.reattach`)."""

    response_id: str
    sequence_number: int


class OpenAIResponsesClient(OpenAIService):
    """A model behind OpenAI's Responses API (``client("openai-responses:gpt-5-mini")``).

    ``options`` (``temperature``, ``max_output_tokens``, ``reasoning``...) are merged into
    every request body. ``store`` (default False: the whole transcript goes each turn)
    says whether the server keeps responses. Unstored, a reasoning model's items are
    asked with their ``encrypted_content`` (``encrypted_reasoning``; default: for o-series
    and gpt-5 models, or when ``options`` has ``reasoning``) so they can be sent again.
    ``background=True`` makes each streamed turn a background response (stored),
    cancelled on the server when the run stops. The other settings are the ``openai:``
    provider's.
    """

    provider = "openai-responses"
    service = "the OpenAI Responses API"
    chat_path = "/responses"

    def __init__(
        self,
        model: str,
        *,
        background: bool = False,
        store: bool | None = None,
        encrypted_reasoning: bool | None = None,
        **settings: Unpack[ServiceKeywords],
    ) -> None:
        given = ClientSettings.of(type(self).__name__, ServiceKeywords, settings)
        url, sent, secrets = self.service_settings(given.base_url, given.api_key, given.headers)
        super().__init__(model, url, dataclasses.replace(given, merge_roles=False),
                         headers=sent, secrets=secrets, to_wire=dict)
        self.background = bool(background)
        if background and store is False:
            raise ValueError("background=True needs store=True: the server keeps the response")
        self.store = bool(background) if store is None else bool(store)
        if encrypted_reasoning is None:  # a reasoning model, or reasoning asked for
            encrypted_reasoning = "reasoning" in self.options or bool(_REASONING.match(model))
        #: Ask for reasoning items' encrypted content (``include``): what an unstored
        #: reasoning item needs to be sent back. Models without reasoning refuse it.
        self.encrypted_reasoning = bool(encrypted_reasoning) and not self.store
        #: The background response of the turn in flight (None between turns).
        self.in_flight: BackgroundResponse | None = None
        self._attach: BackgroundResponse | None = None
        self._inputs = _InputEncoder(self.store)

    def decoder(self, reporter: Reporter) -> _ResponsesTurn:
        return _ResponsesTurn(reporter)

    def body(self, turn: TurnInput) -> bytes:
        body: dict[str, Any] = {"model": self.model, "stream": turn.stream, "store": self.store}
        if self.background and turn.stream:
            body["background"] = True
        if self.encrypted_reasoning:
            body["include"] = ["reasoning.encrypted_content"]
        if turn.messages and turn.messages[0]["role"] == "system":
            body["instructions"] = turn.messages[0]["content"]
        if turn.request is not None:
            body.update(_request_fields(turn.request, bool(turn.tools)))
        body.update(self.options)
        head = dumps(body)[:-1]  # the object left open for the tools and the input
        if turn.tools:
            head += b',"tools":' + self._inputs.tools(turn.tools)
        return head + b',"input":' + self._inputs.items(turn.messages) + b"}"

    def fork(self) -> Self:
        twin = super().fork()
        twin._inputs = _InputEncoder(self.store)
        twin.in_flight = twin._attach = None
        return twin

    # -- background mode --------------------------------------------------------------

    def reattach(self, response: BackgroundResponse) -> None:
        """Make the next streamed turn re-attach to ``response`` (left by a run that
        crashed) from its next event, instead of asking the model again."""
        if not self.background:
            raise ValueError("reattach() needs a client made with background=True")
        self._attach = response

    def reattach_turn(self, handle: Mapping[str, Any]) -> bool:
        response_id, after = handle.get("response_id"), handle.get("after")
        if handle.get("wire") != WIRE or not self.background:
            return False
        if not isinstance(response_id, str) or not isinstance(after, int):
            return False
        self._attach = BackgroundResponse(response_id, after)
        return True

    def _run_turn(self, asked: TurnInput) -> AsyncGenerator[Chunk, None]:
        if self.background and asked.stream:
            return self._background_turn(asked)
        return super()._run_turn(asked)

    async def _background_turn(self, asked: TurnInput) -> AsyncGenerator[Chunk, None]:
        """A streamed background response: re-attached after a drop, cancelled on the
        server when the turn is stopped (closed, cancelled or failed) before its end."""
        reporter = self.reporter()
        decoder = self.decoder(reporter)
        attach, self._attach = self._attach, None
        drops, text = 0, list[str]()  # text: the reply's so far (what a re-attach keeps)
        scope = current_scope.get()  # the run's: current for a re-attach's wait
        http = await self._pool.bind()
        try:
            while True:
                try:
                    shard = await self._pool.acquire(reporter)
                    try:
                        if attach is not None:
                            decoder.response_id = attach.response_id
                            decoder.sequence = attach.sequence_number
                            response = await self._open_get(shard.http, attach, reporter)
                        else:
                            body = self.body(asked)
                            response = await self._open(shard.http, body, True, reporter)
                        # Closed before the cancel below is sent: the stream goes first.
                        async with aclosing(self._read(response, decoder, reporter)) as chunks:
                            async for chunk in chunks:
                                if self.in_flight is None and decoder.response_id is not None:
                                    await self._started(decoder)
                                self.in_flight = BackgroundResponse(
                                    decoder.response_id or "", decoder.sequence
                                )
                                if type(chunk) is TextDelta:
                                    text.append(chunk.text)
                                yield chunk
                    finally:
                        self._pool.release(shard)
                    return
                except ModelHTTPError as error:
                    if attach is None or error.status_code != 404:
                        raise
                    # The response is gone (expired, deleted): ask the model again.
                    log.info("model %r at %s: background response %s is gone; asking again",
                             self.model, self.host, attach.response_id)
                    attach = None
                    decoder = self.decoder(reporter)
                except ModelConnectionError as error:
                    drops += 1
                    attach = await self._reattach_after(error, decoder, drops, reporter, scope)
                    # Read on from the next event: nothing is generated or paid twice.
                    yield TurnRetry(True, "".join(text), zero_usage(), str(error), drops)
        finally:
            if not decoder.finished and decoder.response_id is not None:
                await self._cancel_remote(http, decoder.response_id, reporter)
            self.in_flight = None

    async def _reattach_after(
        self,
        error: ModelConnectionError,
        decoder: _ResponsesTurn,
        drops: int,
        reporter: Reporter,
        scope: RunScope | None,
    ) -> BackgroundResponse:
        """Where to read the response on from after its stream broke (``drops`` times),
        once the retry's wait is over; ``error`` raised when no retry is left, a stop cut
        the wait, or the response was never created (nothing to re-attach to)."""
        if decoder.response_id is None:
            raise error
        with in_scope(scope):  # the stream broke, not the response: the server goes on
            if not await self.retry.wait(drops, None, error, reporter):
                raise error
        self._retried += 1
        log.info("model %r at %s: background response stream dropped (%s); re-attaching",
                 self.model, self.host, type(error).__name__)
        return BackgroundResponse(decoder.response_id, decoder.sequence)

    async def _started(self, decoder: _ResponsesTurn) -> None:
        """The response exists on the server: hand its handle to whoever keeps it."""
        self.in_flight = BackgroundResponse(decoder.response_id or "", decoder.sequence)
        if self.on_remote_turn is not None:  # from before any content: none is durable yet
            await self.on_remote_turn({"wire": WIRE, "response_id": self.in_flight.response_id,
                                       "after": decoder.started_at})

    async def _open_get(
        self, http: httpx.AsyncClient, attach: BackgroundResponse, reporter: Reporter
    ) -> httpx.Response:
        """The stream of a background response from its event after ``attach``'s."""
        url = f"{self.endpoint()}/{attach.response_id}"
        params = {"stream": "true", "starting_after": str(attach.sequence_number)}
        headers = await self.auth_headers({"Accept": "text/event-stream"}, reporter)
        request = http.build_request("GET", url, params=params, headers=headers)
        with reporter:
            response = await http.send(request, stream=True)
        if response.status_code >= 400:
            raise await self._http_error(response, reporter)
        return response

    async def _read(
        self, response: httpx.Response, decoder: _ResponsesTurn, reporter: Reporter
    ) -> AsyncGenerator[Chunk, None]:
        pieces = cast(AsyncGenerator[bytes, None], response.aiter_bytes())
        try:
            with reporter:
                rest = b""
                async for piece in pieces:
                    lines = (rest + piece).split(b"\n")
                    rest = lines.pop()
                    for line in lines:
                        for chunk in decoder.line(line):
                            yield chunk
                        if decoder.finished:
                            return
                for chunk in tail(decoder, rest):
                    yield chunk
        finally:
            await pieces.aclose()
            await response.aclose()

    async def _cancel_remote(
        self, http: httpx.AsyncClient, response_id: str, reporter: Reporter
    ) -> None:
        """``POST /responses/{id}/cancel``: the server stops making the response. Bounded;
        a failure is logged, never raised over the stop that caused it."""
        url = f"{self.endpoint()}/{response_id}/cancel"
        try:
            async with asyncio.timeout(_CANCEL_WAIT):
                headers = await self.auth_headers({"Content-Type": "application/json"}, reporter)
                with reporter:
                    answer = await http.post(url, headers=headers)
            if answer.status_code >= 400:
                log.warning("model %r at %s: cancelling background response %s answered "
                            "HTTP %d", self.model, self.host, response_id, answer.status_code)
        except (ModelError, TimeoutError) as error:
            log.warning("model %r at %s: could not cancel background response %s (%s)",
                        self.model, self.host, response_id, type(error).__name__)


class _InputEncoder:
    """The ``input`` items of a transcript, each message's encoded once: a transcript
    usually grows at its end, so a request encodes only the messages added since the
    last one (as :class:`~aimu.aio.providers._wire.WireEncoder` does for chat wires)."""

    __slots__ = ("_contents", "_objects", "_parts", "_tools", "stored")

    def __init__(self, stored: bool) -> None:
        self.stored = stored
        self._objects: list[Message] = []
        self._contents: list[str] = []
        self._parts: list[bytes] = []
        self._tools: tuple[object, bytes] = (None, b"[]")

    def items(self, messages: Sequence[Message]) -> bytes:
        """The JSON array of ``messages``' input items."""
        start = unchanged(self._objects, self._contents, messages)
        if not start:
            self._objects, self._contents, self._parts = [], [], []
        for message in messages[start:] if start else messages:
            self._objects.append(message)
            self._contents.append(message["content"])
            _, items = input_items((message,), stored=self.stored)
            self._parts.append(b",".join(map(dumps, items)))
        return b"[" + b",".join(filter(None, self._parts)) + b"]"

    def tools(self, tools: Sequence[ToolSpec]) -> bytes:
        """The function tools, encoded again only when another list is offered."""
        cached, encoded = self._tools
        if cached is not tools:
            encoded = dumps([
                {"type": "function", "name": spec["function"]["name"],
                 "description": spec["function"].get("description", ""),
                 "parameters": spec["function"]["parameters"], "strict": False}
                for spec in tools
            ])
            self._tools = (tools, encoded)
        return encoded


def _request_fields(request: TurnRequest, with_tools: bool) -> dict[str, Any]:
    """``text.format`` for an output schema; the tool options only with tools."""
    fields: dict[str, Any] = {}
    if request.output_schema is not None:
        fields["text"] = {"format": {
            "type": "json_schema", "name": request.output_name,
            "schema": request.output_schema, "strict": False,
        }}
    if with_tools:
        choice = request.tool_choice
        if choice in ("auto", "required", "none"):
            fields["tool_choice"] = choice
        elif choice is not None:
            fields["tool_choice"] = {"type": "function", "name": choice}
        if request.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = request.parallel_tool_calls
    return fields


class _ResponsesTurn(SSETurnDecoder):
    """One response: its SSE events (or one response object) into chunks.

    Text and reasoning summaries stream as they come; a function call is complete at its
    ``response.output_item.done``; reasoning items are kept for :class:`NativeData`.
    """

    __slots__ = ("calls", "reasoning", "response_id", "seen", "sequence", "started_at")
    unfinished = "ended the stream without finishing the response (no response.completed)"

    def __init__(self, reporter: Reporter) -> None:
        super().__init__(reporter)
        self.response_id: str | None = None
        #: The ``sequence_number`` of the last event read (-1: none yet).
        self.sequence = -1
        #: The number of the last event before any content (the response's creation).
        self.started_at = -1
        self.calls = 0
        self.seen: set[str] = set()
        self.reasoning: list[dict[str, Any]] = []

    def event(self, data: str) -> list[Chunk]:
        event = self.reporter.json_object(data, "an event")
        number = event.get("sequence_number")
        if isinstance(number, int):
            if number <= self.sequence:
                return []  # already read (a re-attached stream repeats nothing new)
            self.sequence = number
        kind = event.get("type")
        if kind in ("response.output_text.delta", "response.refusal.delta"):
            return self.text.chunks(None, event.get("delta"))  # a refusal is the answer
        if kind in ("response.reasoning_summary_text.delta", "response.reasoning_text.delta"):
            return self.text.chunks(event.get("delta"), None)
        if kind == "response.output_item.done":
            return self._item(as_dict(event.get("item")))
        if kind in ("response.created", "response.queued", "response.in_progress"):
            identifier = as_dict(event.get("response")).get("id")
            if isinstance(identifier, str) and identifier:
                self.response_id = identifier
            self.started_at = self.sequence
            return []
        if kind in ("response.completed", "response.incomplete"):
            return self._finish(as_dict(event.get("response")))
        if kind == "response.failed":
            failed = as_dict(event.get("response"))
            error = failed.get("error") or "the response failed"
            raise self.reporter.server_error(error, _status(as_dict(error).get("code")))
        if kind == "error":
            raise self.reporter.server_error(event, _status(event.get("code")))
        if kind is None and "error" in event:
            raise self.reporter.server_error(event["error"])
        return []

    def _item(self, item: dict[str, Any]) -> list[Chunk]:
        kind = item.get("type")
        if kind == "function_call":
            return [self._call(item)]
        if kind == "reasoning":
            self.reasoning.append(item)
        return []

    def _call(self, item: Mapping[str, Any]) -> ToolCallDelta:
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise self.reporter.protocol(f"sent function call {self.calls} without a name")
        self.calls += 1
        arguments = item.get("arguments")
        raw = arguments if isinstance(arguments, str) else ""
        return decoded_call(item.get("call_id"), name, raw, self.seen)

    def _finish(self, response: dict[str, Any]) -> list[Chunk]:
        chunks = self.text.flush()
        if self.reasoning:
            chunks.append(NativeData({"wire": WIRE, "reasoning": self.reasoning}))
        status = response.get("status")
        reason = "tool_calls" if self.calls else "stop"
        if status == "incomplete":
            detail = as_dict(response.get("incomplete_details")).get("reason")
            reason = "length" if detail == "max_output_tokens" else str(detail or "incomplete")
        usage = response.get("usage")
        chunks.append(TurnDone(_usage(usage), reason, _reported(usage)))
        self.finished = True
        return chunks

    def whole(self, body: bytes) -> list[Chunk]:
        response = self.reporter.json_object(body, "a reply")
        if response.get("error"):
            raise self.reporter.server_error(response["error"])
        status = response.get("status")
        if status not in ("completed", "incomplete"):
            raise self.reporter.protocol(
                f"sent a response that did not finish (status {clip(status, 40)})"
            )
        chunks: list[Chunk] = []
        for item in response.get("output") or ():
            item = as_dict(item)
            kind = item.get("type")
            if kind == "message":
                for part in item.get("content") or ():
                    part = as_dict(part)
                    kind = part.get("type")
                    text = part.get("text" if kind == "output_text" else "refusal")
                    chunks += self.text.chunks(None, text)
            elif kind == "reasoning":
                for part in item.get("summary") or ():
                    chunks += self.text.chunks(as_dict(part).get("text"), None)
                self.reasoning.append(item)
            elif kind == "function_call":
                chunks.append(self._call(item))
        return chunks + self._finish(response)


#: The HTTP status a failed response's error code stands for (so it is retried like it).
_ERROR_STATUS = {"server_error": 500, "rate_limit_exceeded": 429}


def _status(code: object) -> int:
    return _ERROR_STATUS.get(code, 200) if isinstance(code, str) else 200


def _reported(value: object) -> bool:
    usage = as_dict(value)
    return isinstance(usage.get("input_tokens"), int) and isinstance(
        usage.get("output_tokens"), int
    )


def _usage(value: object) -> Usage:
    usage = as_dict(value)
    given, made = usage.get("input_tokens"), usage.get("output_tokens")
    counts: Usage = {
        "input_tokens": given if isinstance(given, int) else 0,
        "output_tokens": made if isinstance(made, int) else 0,
    }
    return with_cached(counts, as_dict(usage.get("input_tokens_details")).get("cached_tokens"))
