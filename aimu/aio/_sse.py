"""Server-Sent Events (the WHATWG ``text/event-stream`` format): framing and parsing.

One module for every side that speaks it: ``aimu serve`` frames its run events, the
OpenAI-compatible provider parses a chat stream, the loopback server frames one.
:func:`frame` makes one event's bytes; :class:`SSEParser`, fed one line at a time
(without its line ending), returns each event when its blank line arrives.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["CONTENT_TYPE", "KEEP_ALIVE", "SSEParser", "ServerSentEvent", "comment", "frame"]

CONTENT_TYPE = "text/event-stream"


class ServerSentEvent(NamedTuple):
    """One dispatched event: its data (lines joined by ``\\n``), type and id."""

    data: str
    event: str = "message"
    id: str = ""


def _field(name: bytes, value: str | None) -> bytes:
    if value is None:
        return b""
    if "\n" in value or "\r" in value:
        raise ValueError(f"an SSE {name.decode()} cannot hold a line break: {value[:40]!r}")
    return name + b": " + value.encode() + b"\n"


def frame(data: bytes, *, event: str | None = None, id: str | None = None) -> bytes:
    """One event: ``id:`` and ``event:`` lines if given, ``data:`` lines, a blank line.

    Data with line breaks becomes one ``data:`` line per line, which a reader joins again.
    """
    head = _field(b"id", id) + _field(b"event", event)
    if b"\n" in data or b"\r" in data:
        lines = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        return head + b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"
    return head + b"data: " + data + b"\n\n"


def comment(text: str = "") -> bytes:
    """A comment line and a blank line: readers skip it; it keeps a quiet stream alive."""
    return b":" + (b" " + text.encode() if text else b"") + b"\n\n"


KEEP_ALIVE = comment("keep-alive")


class SSEParser:
    """Server-sent events, fed line by line: returns each event when it completes.

    Multi-line data is joined with newlines; comments and unknown fields are skipped;
    an event without data is not dispatched; an event is dispatched at its blank line
    (or by :meth:`flush` at the end of the stream). ``last_id`` keeps the last ``id:``
    seen, as a reconnecting reader sends it in ``Last-Event-ID``.
    """

    __slots__ = ("_data", "_event", "last_id")

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = ""
        self.last_id = ""

    def feed(self, line: str) -> ServerSentEvent | None:
        if not line:
            return self.flush()
        if line.startswith("data: "):  # nearly every line: its value copied once, not thrice
            self._data.append(line[6:])
            return None
        if line[0] == ":":
            return None
        name, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self.last_id = value
        return None  # retry: and unknown fields mean nothing to these readers

    def flush(self) -> ServerSentEvent | None:
        """The event collected so far, if it has data; the collection starts afresh."""
        event, self._event = self._event or "message", ""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return ServerSentEvent(data, event, self.last_id)
