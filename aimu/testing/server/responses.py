"""The OpenAI Responses protocol of the loopback server: ``/v1/responses`` and background mode.

``POST /v1/responses`` answers one scripted turn as a response object, or as SSE events
(``response.created`` ... ``response.completed``, each with its ``sequence_number``) when
streamed. With ``background: true`` (which needs ``store: true``) the response is made by
a task of the server's own that outlives the request's connection: a client that goes
away does not stop it; ``POST /v1/responses/{id}/cancel`` does, and
``GET /v1/responses/{id}?stream=true&starting_after=N`` streams it again from event N+1.
Requests are checked as the real API checks them (a ``function_call`` item without its
``function_call_output`` is refused), and scripts see the request in the chat shape
(:meth:`ResponsesWire.script_body`), so one script serves every wire.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from aimu.aio import _sse as sse
from aimu.testing.script import Turn, split_text
from aimu.testing.server._connection import Connection, Request
from aimu.testing.server.playback import HTTP_FAULTS, play
from aimu.testing.server.records import StreamRecord
from aimu.testing.server.wire import JSON, Protocol, Wire, json_bytes, output_tokens

__all__ = ["PREFIX", "RESPONSES", "BackgroundResponses", "ResponsesWire", "chat_view"]

PREFIX = "/v1/responses"
_OBJECT = "response"
_INCOMPLETE = {"length": "max_output_tokens", "max_output_tokens": "max_output_tokens",
               "content_filter": "content_filter"}


def _seal(item_id: str, text: str) -> str:
    """The ``encrypted_content`` of a reasoning item: opaque to a client, checkable here."""
    digest = hashlib.sha256(f"{item_id}\0{text}".encode()).hexdigest()[:16]
    return base64.b64encode(json.dumps([item_id, text, digest]).encode()).decode()


def _unseal(token: object) -> bool:
    """True when ``token`` is an ``encrypted_content`` this server made, unchanged."""
    try:
        item_id, text, digest = json.loads(base64.b64decode(str(token), validate=True))
    except (ValueError, TypeError):
        return False
    return bool(_seal(str(item_id), str(text)) == str(token)) and isinstance(digest, str)


# -- the request as a chat (for scripts and the shared checks) -----------------------------


def _part_text(content: object) -> tuple[str, list[dict[str, Any]]]:
    """The text of a message's content (a string or parts) and its parts in chat form."""
    if isinstance(content, str):
        return content, [{"type": "text", "text": content}]
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    for part in content if isinstance(content, list) else []:
        if not isinstance(part, Mapping):
            continue
        if part.get("type") in ("input_text", "output_text", "text"):
            texts.append(str(part.get("text", "")))
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif part.get("type") == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url", "")}})
    return "".join(texts), parts


def chat_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses request in the chat-completions shape: ``messages`` (instructions as
    the system message, function calls joined to their assistant turn), nested ``tools``,
    ``response_format`` for ``text.format``, and ``tool_choice``."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    names: dict[str, str] = {}
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, Mapping):
            continue
        kind = item.get("type", "message")
        if kind == "message":
            text, parts = _part_text(item.get("content"))
            has_image = any(part["type"] == "image_url" for part in parts)
            messages.append({"role": str(item.get("role", "user")),
                             "content": parts if has_image else text})
        elif kind == "function_call":
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            call_id = str(item.get("call_id", ""))
            names[call_id] = str(item.get("name", ""))
            last.setdefault("tool_calls", []).append({
                "id": call_id, "type": "function",
                "function": {"name": names[call_id], "arguments": item.get("arguments", "")},
            })
        elif kind == "function_call_output":
            call_id = str(item.get("call_id", ""))
            output = item.get("output")
            text = output if isinstance(output, str) else _part_text(output)[0]
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "name": names.get(call_id, ""), "content": text})
    view: dict[str, Any] = {"model": body.get("model"), "messages": messages,
                            "stream": body.get("stream") is True}
    tools = [
        {"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description") or "",
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}}
        for tool in body.get("tools") or () if isinstance(tool, Mapping)
    ]
    if tools:
        view["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        view["tool_choice"] = choice
    wanted = body.get("text", {}).get("format") if isinstance(body.get("text"), Mapping) else None
    if isinstance(wanted, Mapping) and wanted.get("type") == "json_schema":
        view["response_format"] = {"type": "json_schema", "json_schema": {
            "name": wanted.get("name"), "schema": wanted.get("schema")}}
    elif isinstance(wanted, Mapping) and wanted.get("type") == "json_object":
        view["response_format"] = {"type": "json_object"}
    return view


def _refusal(body: Mapping[str, Any]) -> str | None:
    """The 400 the Responses API gives this request, if it would."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "Missing required parameter: 'model'."
    items = body.get("input")
    if not isinstance(items, str | list):
        return "Missing required parameter: 'input'."
    if "instructions" in body and not isinstance(body["instructions"], str | None):
        return "Invalid type for 'instructions': expected a string."
    if body.get("background") is True and body.get("store") is False:
        return "Background mode requires 'store' to be true."
    for index, tool in enumerate(body.get("tools") or ()):
        if not isinstance(tool, Mapping) or not tool.get("type"):
            return f"Missing required parameter: 'tools[{index}].type'."
        if tool["type"] == "function" and not isinstance(tool.get("name"), str):
            return f"Missing required parameter: 'tools[{index}].name'."
    wanted = body.get("text", {}).get("format") if isinstance(body.get("text"), Mapping) else None
    if isinstance(wanted, Mapping) and wanted.get("type") == "json_schema":
        for key in ("name", "schema"):
            if key not in wanted:
                return f"Missing required parameter: 'text.format.{key}'."
    stored = body.get("store", True) is not False
    return _item_refusal(items, stored) if isinstance(items, list) else None


def _item_refusal(items: list[Any], stored: bool) -> str | None:
    calls: list[str] = []
    answered: set[str] = set()
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            return f"Invalid type for 'input[{index}]': expected an object."
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ("user", "assistant", "system", "developer"):
                return f"Invalid value for 'input[{index}].role': {item.get('role')!r}."
            if not isinstance(item.get("content"), str | list):
                return f"Missing required parameter: 'input[{index}].content'."
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    return f"Missing required parameter: 'input[{index}].{key}'."
            calls.append(item["call_id"])
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in calls:
                return f"No tool call found for function call output with call_id {call_id}."
            answered.add(str(call_id))
        elif kind == "reasoning":
            # An unstored item is known only by its encrypted content, unchanged.
            if not stored and not _unseal(item.get("encrypted_content")):
                return (
                    f"Item with id '{item.get('id')}' not found. Items are not persisted when "
                    "`store` is set to false; send reasoning items with their "
                    "encrypted_content unchanged."
                )
        else:
            return f"Invalid value for 'input[{index}].type': {kind!r}."
    for call_id in calls:
        if call_id not in answered:
            return f"No tool output found for function call {call_id}."
    return None


# -- the wire -------------------------------------------------------------------------------


class ResponsesWire(Wire):
    """One ``POST /v1/responses``: a turn as one response object, or its SSE events.

    Each streamed chunk is the events up to and including one content delta (so faults
    that count chunks cut at the same content as on the other wires); the events that
    close the items and ``response.completed`` (or ``response.incomplete``) are the final.
    """

    protocol = "openai-responses"
    stream_content_type = sse.CONTENT_TYPE

    def __init__(self, model: str, body: Mapping[str, Any], call_ids: Iterator[int]) -> None:
        super().__init__(model, body, call_ids)
        self.response_id = f"resp_{next(call_ids):06d}{time.time_ns() % 10**9:09d}"
        self.created_at = int(time.time())
        self._plan: tuple[Turn, list[list[bytes]], list[bytes]] | None = None

    def background(self) -> bool:
        return self.body.get("background") is True

    def refusal(self) -> str | None:
        return _refusal(self.body)

    def script_view(self) -> Mapping[str, Any]:
        return chat_view(self.body)

    def error_body(self, status: int, message: str) -> bytes:
        kind = "invalid_request_error" if status < 500 and status != 429 else "server_error"
        code = "rate_limit_exceeded" if status == 429 else None
        return json_bytes(
            {"error": {"message": message, "type": kind, "param": None, "code": code}}
        )

    # -- the response object ------------------------------------------------------------

    def response(
        self,
        status: str,
        output: Sequence[Mapping[str, Any]] = (),
        turn: Turn | None = None,
    ) -> dict[str, Any]:
        """The response object in ``status``, with ``output`` and (finished) usage."""
        body = self.body
        choice = body.get("tool_choice", "auto")
        reply: dict[str, Any] = {
            "id": self.response_id, "object": _OBJECT, "created_at": self.created_at,
            "status": status, "background": body.get("background") is True,
            "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "max_output_tokens": None,
            "model": self.model, "output": list(output),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None, "store": body.get("store", True),
            "temperature": body.get("temperature", 1.0),
            "text": body.get("text", {"format": {"type": "text"}}),
            "tool_choice": choice, "tools": list(body.get("tools") or ()),
            "top_p": 1.0, "truncation": "disabled", "usage": None, "metadata": {},
        }
        if turn is not None and status in ("completed", "incomplete"):
            reason = _INCOMPLETE.get(turn.stop_reason or "")
            if status == "incomplete":
                reply["incomplete_details"] = {"reason": reason}
            made = output_tokens(turn)
            reply["usage"] = {
                "input_tokens": turn.input_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": made,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": turn.input_tokens + made,
            }
        return reply

    @staticmethod
    def final_status(turn: Turn) -> str:
        return "incomplete" if turn.stop_reason in _INCOMPLETE else "completed"

    def output_items(self, turn: Turn) -> list[dict[str, Any]]:
        """The finished output items of ``turn``: reasoning, message, function calls."""
        return self.plan_items(turn)[0]

    def plan_items(
        self, turn: Turn
    ) -> tuple[list[dict[str, Any]], list[tuple[str, dict[str, Any], list[str]]]]:
        """The output items, and per item (kind, its in-progress form, its deltas)."""
        serial = self.response_id.removeprefix("resp_")
        items: list[dict[str, Any]] = []
        steps: list[tuple[str, dict[str, Any], list[str]]] = []
        if turn.thinking:
            item_id = f"rs_{serial}"
            item: dict[str, Any] = {
                "id": item_id, "type": "reasoning",
                "summary": [{"type": "summary_text", "text": turn.thinking}],
            }
            include = self.body.get("include") or ()
            if "reasoning.encrypted_content" in include:
                item["encrypted_content"] = _seal(item_id, turn.thinking)
            items.append(item)
            steps.append(("reasoning", {"id": item_id, "type": "reasoning", "summary": []},
                          [turn.thinking]))
        if turn.text or not turn.tool_calls:
            item_id = f"msg_{serial}"
            items.append({
                "id": item_id, "type": "message", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": turn.text, "annotations": []}],
            })
            steps.append(("message", {"id": item_id, "type": "message", "status": "in_progress",
                                      "role": "assistant", "content": []},
                          split_text(turn.text, turn.chunks) if turn.text else []))
        for position, call in enumerate(turn.tool_calls):
            call_id = call.id or f"call_{next(self.call_ids)}"
            arguments = json.dumps(dict(call.arguments), ensure_ascii=False)
            item_id = f"fc_{serial}_{position}"
            items.append({"id": item_id, "type": "function_call", "status": "completed",
                          "call_id": call_id, "name": call.name, "arguments": arguments})
            pieces = split_text(arguments, max(2, math.ceil(len(arguments) / 16)))
            steps.append(("function_call", {"id": item_id, "type": "function_call",
                                            "status": "in_progress", "call_id": call_id,
                                            "name": call.name, "arguments": ""}, pieces))
        return items, steps

    # -- streamed ----------------------------------------------------------------------

    def plan(self, turn: Turn) -> tuple[list[list[bytes]], list[bytes]]:
        """The streamed events of ``turn``, numbered from 0: the chunks (each ending with one
        content delta) and the final events."""
        if self._plan is not None and self._plan[0] is turn:
            return self._plan[1], self._plan[2]
        events = _Events(self.body.get("background") is True)
        events.add("response.created", response=self.response("in_progress"))
        if self.body.get("background") is True:
            events.add("response.queued", response=self.response("queued"))
        events.add("response.in_progress", response=self.response("in_progress"))
        items, steps = self.plan_items(turn)
        for index, ((kind, started, deltas), done) in enumerate(zip(steps, items, strict=True)):
            events.add("response.output_item.added", output_index=index, item=started)
            item_id = started["id"]
            at = {"item_id": item_id, "output_index": index}
            if kind == "reasoning":
                events.add("response.reasoning_summary_part.added", **at, summary_index=0,
                           part={"type": "summary_text", "text": ""})
                for delta in deltas:
                    events.content("response.reasoning_summary_text.delta", **at,
                                   summary_index=0, delta=delta)
                text = "".join(deltas)
                events.add("response.reasoning_summary_text.done", **at, summary_index=0,
                           text=text)
                events.add("response.reasoning_summary_part.done", **at, summary_index=0,
                           part={"type": "summary_text", "text": text})
            elif kind == "message":
                part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
                events.add("response.content_part.added", **at, content_index=0, part=part)
                for delta in deltas:
                    events.content("response.output_text.delta", **at, content_index=0,
                                   delta=delta, logprobs=[])
                text = "".join(deltas)
                events.add("response.output_text.done", **at, content_index=0, text=text,
                           logprobs=[])
                events.add("response.content_part.done", **at, content_index=0,
                           part={**part, "text": text})
            else:
                for delta in deltas:
                    events.content("response.function_call_arguments.delta", **at, delta=delta)
                events.add("response.function_call_arguments.done", **at,
                           arguments="".join(deltas))
            events.add("response.output_item.done", output_index=index, item=done)
        status = self.final_status(turn)
        events.add(f"response.{status}", response=self.response(status, items, turn))
        self._plan = turn, events.chunks, events.pending
        return events.chunks, events.pending

    def chunks(self, turn: Turn) -> list[bytes]:
        return [b"".join(chunk) for chunk in self.plan(turn)[0]]

    def final(self, turn: Turn) -> list[bytes]:
        return [b"".join(self.plan(turn)[1])]

    def bad_line(self) -> bytes:
        return sse.frame(b'{"type": "response.output_text.delta", this is not JSON',
                         event="response.output_text.delta")

    def error_event(self, message: str) -> bytes:
        """The ``error`` event a server sends when the response fails mid-stream."""
        data = {"type": "error", "code": "server_error", "message": message, "param": None,
                "sequence_number": 10_000}
        return sse.frame(json_bytes(data), event="error")

    def whole(self, turn: Turn, *, finished: bool = True) -> bytes:
        if not finished:
            return json_bytes(self.response("in_progress"))
        status = self.final_status(turn)
        return json_bytes(self.response(status, self.output_items(turn), turn))


class _Events:
    """SSE events numbered in order, grouped into chunks that each end with a content delta."""

    def __init__(self, background: bool) -> None:
        self.background = background
        self.sequence = 0
        self.chunks: list[list[bytes]] = []
        self.pending: list[bytes] = []

    def add(self, kind: str, **fields: Any) -> None:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        # A background stream names each event's number in its SSE id too.
        self.pending.append(sse.frame(json_bytes(data), event=kind,
                                      id=str(self.sequence) if self.background else None))
        self.sequence += 1

    def content(self, kind: str, **fields: Any) -> None:
        self.add(kind, **fields)
        self.chunks.append(self.pending)
        self.pending = []


# -- background responses ---------------------------------------------------------------------


@dataclass
class _Stored:
    """One background response: its events so far, its status and the task making it."""

    wire: ResponsesWire
    turn: Turn
    events: list[bytes] = field(default_factory=list)
    chunk_ends: list[int] = field(default_factory=list)
    status: str = "queued"
    task: asyncio.Task[None] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "incomplete", "failed", "cancelled")

    def touch(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class BackgroundResponses:
    """The background responses of one server, by id, and the requests that act on them.

    ``cancelled`` lists the ids a ``POST /v1/responses/{id}/cancel`` stopped, in order.
    """

    def __init__(
        self,
        spawn: Callable[[Any], asyncio.Task[None]],
        notify: Callable[[], None],
    ) -> None:
        self._spawn = spawn
        self._notify = notify
        self.stored: dict[str, _Stored] = {}
        self.cancelled: list[str] = []

    async def create(
        self, connection: Connection, wire: ResponsesWire, turn: Turn, record: StreamRecord
    ) -> bool:
        """Start making ``turn`` in the background; stream it (or answer it queued)."""
        if turn.fault in HTTP_FAULTS or turn.fault == "reset":
            return await play(connection, wire, turn, record, self._notify)
        stored = _Stored(wire, turn)
        self.stored[wire.response_id] = stored
        stored.task = self._spawn(self._produce(stored))
        if not record.streamed:
            ok = await connection.send_response(200, json_bytes(wire.response("queued")), JSON)
            record.completed = ok
            return ok
        return await self._follow(connection, stored, -1, record, fault=turn.fault)

    async def _produce(self, stored: _Stored) -> None:
        chunks, final = stored.wire.plan(stored.turn)
        turn = stored.turn
        stored.status = "in_progress"
        try:
            if turn.first_byte_delay:
                await asyncio.sleep(turn.first_byte_delay)
            for position, chunk in enumerate([*chunks, final]):
                if 0 < position < len(chunks) and turn.delay:
                    await asyncio.sleep(turn.delay)
                stored.events.extend(chunk)
                stored.chunk_ends.append(len(stored.events))
                stored.touch()
                self._notify()
            stored.status = stored.wire.final_status(turn)
        finally:
            if not stored.finished:
                stored.status = "cancelled"
            stored.touch()
            self._notify()

    async def _follow(
        self,
        connection: Connection,
        stored: _Stored,
        after: int,
        record: StreamRecord,
        fault: str | None = None,
    ) -> bool:
        """Stream ``stored``'s events after number ``after`` as they are made; the faults
        ``drop`` and ``hang`` (after ``fault_after`` chunks) cut this stream only."""
        connection.watch()
        try:
            if not await connection.start_stream(sse.CONTENT_TYPE):
                return self._gone(connection, record)
            sent = after + 1
            while True:
                limit = len(stored.events)
                if fault in ("drop", "hang"):
                    cut = stored.turn.fault_after
                    if len(stored.chunk_ends) > cut:
                        limit = min(limit, stored.chunk_ends[cut - 1] if cut else 0)
                if sent < limit:
                    if not await connection.send_chunks(stored.events[sent:limit]):
                        return self._gone(connection, record)
                    record.chunks_sent += limit - sent
                    sent = limit
                    self._notify()
                if fault in ("drop", "hang") and limit < len(stored.events):
                    if fault == "drop":
                        return False  # the socket closes, the body unfinished
                    await connection.wait(None)
                    return self._gone(connection, record)
                if stored.finished and sent >= len(stored.events):
                    ok = await connection.send_chunks([], end=True)
                    record.completed = ok and stored.status != "cancelled"
                    return ok or self._gone(connection, record)
                if await _changed_or_gone(stored.changed, connection):
                    return self._gone(connection, record)
        finally:
            record.finished_at = time.monotonic()
            await connection.unwatch()

    def _gone(self, connection: Connection, record: StreamRecord) -> bool:
        record.abandoned = True
        record.abandoned_at = connection.peer_closed_at or time.monotonic()
        self._notify()
        return False

    async def serve(
        self,
        connection: Connection,
        request: Request,
        wire: ResponsesWire,
        records: list[StreamRecord],
    ) -> bool:
        """``GET /v1/responses/{id}`` (streamed with ``stream=true``) and ``POST .../cancel``."""
        rest = request.path.removeprefix(PREFIX + "/")
        response_id, _, action = rest.partition("/")
        stored = self.stored.get(response_id)

        async def answer(status: int, body: bytes) -> bool:
            return await connection.send_response(status, body, JSON)

        if action not in ("", "cancel"):
            return await answer(404, wire.error_body(404, f"no such endpoint: {request.path}"))
        method = "POST" if action else "GET"
        if request.method != method and not (method == "GET" and request.method == "HEAD"):
            message = f"{request.path} takes {method}, not {request.method}"
            return await answer(405, wire.error_body(405, message))
        if stored is None:
            return await answer(
                404, wire.error_body(404, f"No response found with id '{response_id}'.")
            )
        if action == "cancel":
            if stored.status in ("completed", "incomplete", "failed"):
                return await answer(400, wire.error_body(
                    400, f"Cannot cancel a response with status '{stored.status}'."))
            if not stored.finished:
                self.cancelled.append(response_id)
                assert stored.task is not None
                stored.task.cancel()
                await asyncio.wait([stored.task])
            return await answer(200, json_bytes(self._snapshot(stored)))
        query = parse_qs(request.target.partition("?")[2])
        if query.get("stream", ["false"])[0] != "true":
            return await answer(200, json_bytes(self._snapshot(stored)))
        try:
            after = int(query.get("starting_after", ["-1"])[0])
        except ValueError:
            return await answer(400, wire.error_body(400, "Invalid 'starting_after'."))
        record = StreamRecord(request.path, "openai-responses", True, time.monotonic())
        records.append(record)
        self._notify()
        return await self._follow(connection, stored, after, record)

    @staticmethod
    def _snapshot(stored: _Stored) -> dict[str, Any]:
        wire, turn = stored.wire, stored.turn
        if stored.status in ("completed", "incomplete"):
            return wire.response(stored.status, wire.output_items(turn), turn)
        return wire.response(stored.status)


async def _changed_or_gone(changed: asyncio.Event, connection: Connection) -> bool:
    """Wait for the response to change or the client to go; True if it went."""
    if connection.peer_closed.is_set():
        return True
    waits = {asyncio.ensure_future(changed.wait()),
             asyncio.ensure_future(connection.peer_closed.wait())}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()
        await asyncio.wait(waits)
    return connection.peer_closed.is_set()


RESPONSES = Protocol("openai-responses", PREFIX, ResponsesWire)
