"""Reading one reply: the :class:`TurnDecoder` a provider implements, the server-sent
events one (:class:`SSETurnDecoder`), and the helpers its tool calls and usage share."""

from __future__ import annotations

import abc
import uuid
from typing import Any, ClassVar

from aimu.aio._numbers import is_count
from aimu.aio._sse import SSEParser
from aimu.aio.providers._report import Reporter
from aimu.aio.providers._unicode import TurnText, clean
from aimu.aio.providers._wire import decode_arguments
from aimu.aio.providers.base import (
    Chunk,
    ToolCallDelta,
)
from aimu.aio.transcript import ToolCall, Usage

__all__ = [
    "SSETurnDecoder",
    "TurnDecoder",
    "as_dict",
    "as_list",
    "call_id",
    "tool_call",
    "unique_id",
    "with_cached",
]


def call_id() -> str:
    """A fresh tool-call id for a call the server sent without one."""
    return f"call_{uuid.uuid4().hex[:16]}"


def unique_id(raw: object, seen: set[str]) -> str:
    """The id a call is kept under: the server's (cleaned) unless it gave none or one
    this reply already used (then a fresh one); added to ``seen``."""
    identifier = clean(raw) if isinstance(raw, str) and raw else call_id()
    if identifier in seen:
        identifier = call_id()
    seen.add(identifier)
    return identifier


def tool_call(
    identifier: str, name: str, arguments: dict[str, Any], error: str | None
) -> ToolCallDelta:
    """A complete tool call (``error``: why its arguments could not be used)."""
    call: ToolCall = {
        "id": identifier,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
    return ToolCallDelta(call, error)


def decoded_call(raw_id: object, name: str, raw: str, seen: set[str]) -> ToolCallDelta:
    """The call of tool ``name`` (cleaned) with the JSON arguments ``raw``, under the
    server's id ``raw_id`` made unique in ``seen`` (see :func:`unique_id`)."""
    identifier = unique_id(raw_id, seen)
    name = clean(name)
    arguments, error = decode_arguments(raw, name)
    return tool_call(identifier, name, arguments, error)


def with_cached(usage: Usage, cached: object) -> Usage:
    """``usage`` with ``cached_input_tokens`` when the server gave a count above zero."""
    if is_count(cached) and cached:
        usage["cached_input_tokens"] = cached
    return usage


def as_dict(value: object) -> dict[str, Any]:
    """``value`` if a JSON object, else an empty one (a reply's field of the wrong type)."""
    return value if isinstance(value, dict) else {}


def as_list(value: object) -> list[Any]:
    """``value`` if a JSON array, else an empty one."""
    return value if isinstance(value, list) else []


class TurnDecoder(abc.ABC):
    """Reads one reply of a provider's protocol into chunks."""

    #: True once the reply's final marker was read: what follows is only the body's end.
    finished: bool = False
    #: The stream is binary messages, not lines: :meth:`split` cuts it into what
    #: :meth:`line` reads (AWS's event stream).
    framed: ClassVar[bool] = False

    def split(self, data: bytes) -> tuple[list[bytes], bytes]:
        """The whole units at the head of ``data`` and the rest (a framed decoder's)."""
        units = data.split(b"\n")
        return units, units.pop()

    @abc.abstractmethod
    def line(self, line: bytes) -> list[Chunk]:
        """The chunks of one line of a streamed body (without its newline)."""

    @abc.abstractmethod
    def end(self) -> list[Chunk]:
        """The last chunks when the body ends; raise if the reply did not finish."""

    @abc.abstractmethod
    def whole(self, body: bytes) -> list[Chunk]:
        """The chunks of a reply that was asked for in one piece."""

    def salvage(self) -> list[Chunk] | None:
        """The last chunks of a reply whose stream broke after the reply had finished
        (only its end was lost: a usage event, the final marker), or None if it had not
        finished (the default): the turn is then asked again."""
        return None


class SSETurnDecoder(TurnDecoder):
    """A reply streamed as server-sent events: each event's data goes to :meth:`event`.

    A stream that ends without its final marker ends the reply if :meth:`end_unmarked`
    says it may; else the reply did not finish, and :attr:`unfinished` says so.
    """

    #: What the server did when its stream ended before the reply finished
    #: (:meth:`Reporter.unfinished` makes the error of it).
    unfinished: ClassVar[str]

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.parser = SSEParser()
        self.text = TurnText()

    @abc.abstractmethod
    def event(self, data: str) -> list[Chunk]:
        """The chunks of one event's data."""

    def line(self, line: bytes) -> list[Chunk]:
        event = self.parser.feed(line.decode("utf-8", "replace").rstrip("\r"))
        return [] if event is None else self.event(event.data)

    def end(self) -> list[Chunk]:
        last = self.parser.flush()  # an event the stream ended without its blank line
        chunks = self.event(last.data) if last is not None else []
        if self.finished:
            return chunks
        rest = self.end_unmarked()
        if rest is None:
            raise self.reporter.unfinished(self.unfinished)
        return chunks + rest

    def end_unmarked(self) -> list[Chunk] | None:
        """The last chunks of a reply whose stream ended without the final marker, or
        None if such a reply did not finish (the default)."""
        return None

    def salvage(self) -> list[Chunk] | None:
        return None if self.finished else self.end_unmarked()
