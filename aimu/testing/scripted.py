"""An in-process scripted model: a ModelClient that plays a script without any wire.

For unit tests and benchmarks where the HTTP protocol is not the point. Every chunk
is preceded by an event-loop yield (or the turn's ``delay``), so a cancel can land
between any two chunks, exactly as with a real stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any, Self

from aimu.aio.errors import ModelConnectionError, ModelHTTPError, ModelProtocolError
from aimu.aio.providers.base import (
    Chunk,
    ModelClient,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    TurnDone,
    TurnRequest,
)
from aimu.aio.transcript import Message, ToolCall, ToolSpec, Usage, wire_view
from aimu.testing.script import Script, Turn, split_text

__all__ = ["ScriptExhausted", "ScriptedModel"]


class ScriptExhausted(AssertionError):
    """The model was asked for more turns than its script has."""


class _Shared:
    """What forks of one scripted model share, like clients of one server."""

    __slots__ = ("open_streams", "position", "requests", "script", "turns_served")

    def __init__(self, script: Script) -> None:
        self.script = script
        self.position = 0
        self.requests: list[dict[str, Any]] = []
        self.turns_served = 0
        self.open_streams = 0


class ScriptedModel(ModelClient):
    """Plays ``script`` (a list of :class:`Turn`, or a function of the request).

    ``requests`` records what each turn was asked (the messages as a provider would
    see them, the tool names, and under ``"request"`` the :class:`TurnRequest` if one
    was given) unless ``record=False``.
    """

    provider = "scripted"

    def __init__(
        self,
        script: Script,
        *,
        model: str = "scripted",
        record: bool = True,
        continues_partial: bool = False,
    ) -> None:
        super().__init__(model)
        self._shared = _Shared(script)
        self._record = record
        #: Play the next turn as the continuation of a trailing assistant message.
        self.continues_partial = continues_partial

    @property
    def host(self) -> str:
        return "in-process"

    @property
    def requests(self) -> list[dict[str, Any]]:
        return self._shared.requests

    @property
    def turns_served(self) -> int:
        return self._shared.turns_served

    @property
    def open_streams(self) -> int:
        """Streams started and not yet finished or closed (should be 0 after a run)."""
        return self._shared.open_streams

    def fork(self) -> Self:
        twin = type(self).__new__(type(self))
        ModelClient.__init__(twin, self.model)
        twin._shared = self._shared
        twin._record = self._record
        twin.continues_partial = self.continues_partial
        return twin

    def _next_turn(self, request: Mapping[str, Any]) -> Turn:
        script = self._shared.script
        if callable(script):
            return script(request)
        position = self._shared.position
        if position >= len(script):
            raise ScriptExhausted(
                f"the script has {len(script)} turns and turn {position + 1} was requested"
            )
        self._shared.position = position + 1
        return script[position]

    async def stream_turn(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec] | None = None,
        *,
        stream: bool = True,
        request: TurnRequest | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        asked: dict[str, Any] = {
            "messages": [wire_view(m) for m in messages] if self._record else messages,
            "tools": [t["function"]["name"] for t in tools or ()],
            "stream": stream,
        }
        if request is not None:
            asked["request"] = request
        if self._record:
            self._shared.requests.append(asked)
        turn = self._next_turn(asked)
        shared = self._shared
        shared.open_streams += 1
        try:
            # Closed with the stream (a consumer that stops at a chunk): never left to
            # the garbage collector's finalizer task.
            async with aclosing(_play(turn, self._shared.turns_served)) as chunks:
                async for chunk in chunks:
                    yield chunk
            shared.turns_served += 1
        finally:
            shared.open_streams -= 1


async def _pause(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def _play(turn: Turn, serial: int) -> AsyncGenerator[Chunk, None]:
    if turn.first_byte_delay:
        await _pause(turn.first_byte_delay)
    if turn.fault in ("http_500", "http_429"):
        raise _http_error(turn.fault)
    pieces: list[Chunk] = []
    if turn.thinking:
        pieces.append(ThinkingDelta(turn.thinking))
    pieces.extend(TextDelta(piece) for piece in split_text(turn.text, turn.chunks))
    for position, call in enumerate(turn.tool_calls):
        tool_call: ToolCall = {
            "id": call.id or f"call_{serial}_{position}",
            "type": "function",
            "function": {"name": call.name, "arguments": dict(call.arguments)},
        }
        pieces.append(ToolCallDelta(tool_call))
    for position, piece in enumerate(pieces):
        if turn.fault in _MID_STREAM and position == turn.fault_after:
            await _fault(turn)
        await _pause(turn.delay if position else 0)
        yield piece
    if turn.fault in _MID_STREAM and turn.fault_after >= len(pieces):
        await _fault(turn)
    if turn.fault == "no_done":
        raise ModelProtocolError(
            "in-process model stream ended without its final marker", host="in-process"
        )
    text_chunks = sum(isinstance(p, TextDelta) for p in pieces)
    output = turn.output_tokens if turn.output_tokens is not None else text_chunks
    usage: Usage = {"input_tokens": turn.input_tokens, "output_tokens": output}
    yield TurnDone(usage, turn.stop_reason or "stop")


_MID_STREAM = ("bad_json", "drop", "hang", "error_event")

#: The faults that are an HTTP error: its status, its body, what the error says.
_HTTP_ERRORS = {
    "http_500": (500, "scripted failure", "answered HTTP 500: scripted failure"),
    "http_429": (429, "rate limited", "answered HTTP 429: rate limited"),
    "error_event": (200, "internal error", "reported an error mid-reply: internal error"),
}


def _http_error(fault: str) -> ModelHTTPError:
    status, body, what = _HTTP_ERRORS[fault]
    return ModelHTTPError(
        f"in-process model {what}", host="in-process", status_code=status, body=body
    )


async def _fault(turn: Turn) -> None:
    if turn.fault == "hang":
        await asyncio.Event().wait()
    if turn.fault == "error_event":
        raise _http_error(turn.fault)
    if turn.fault == "drop":
        raise ModelConnectionError(
            "in-process model dropped the connection mid-stream", host="in-process"
        )
    raise ModelProtocolError("in-process model sent a line that is not JSON", host="in-process")


def tool_turn(*calls: tuple[str, Mapping[str, Any]], text: str = "") -> Turn:
    """A turn that calls each ``(name, arguments)`` in order."""
    from aimu.testing.script import ScriptedCall

    return Turn(text=text, tool_calls=tuple(ScriptedCall(n, a) for n, a in calls))


ScriptFunction = Callable[[Mapping[str, Any]], Turn]
