"""A reply whose stream broke, asked again: continued from its text, or restarted.

:class:`TurnSoFar` follows what one turn's stream gave its reader, across the attempts
of :meth:`HTTPModelClient.stream_turn <aimu.aio.providers._http.HTTPModelClient.stream_turn>`.
When the stream breaks after part of the reply went out (a reset, a body ending early, a
read timeout, an overloaded or failed event), the turn is asked again within the client's
retries and backoff. A client that continues a trailing assistant message
(``continues_partial``) is sent the text so far as that message and goes on from it;
any other (or a reply that streamed thinking or a tool call) starts the turn again.
Either way the reader gets one :class:`~aimu.aio.providers.base.TurnRetry` after the
backoff, before the request is sent again, saying which (and what the broken attempt
cost: a budget counts it before the next request goes), so it never keeps text twice. A tool call is
given only whole (its arguments complete), so a cut inside one is asked again whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from aimu.aio.errors import ModelConnectionError, ModelError, ModelHTTPError, ModelProtocolError
from aimu.aio.limits import estimate_tokens, transcript_chars
from aimu.aio.providers._retry import Retry
from aimu.aio.providers._wire import PrefillEcho
from aimu.aio.providers.base import (
    Chunk,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    TurnRetry,
)
from aimu.aio.transcript import AssistantMessage, Message, Usage

__all__ = ["Reading", "TurnSoFar", "broken_stream", "tail"]

#: Statuses of an error event mid-reply that are asked again: those retried before a
#: reply (429, 502, 503, 504, 529) and a 500 (the request was good: it was streaming).
_MID_REPLY = frozenset({500})


def broken_stream(error: ModelError, at_end: bool, began: bool) -> bool:
    """True when ``error`` broke a reply's stream in a way that asking again may mend:
    the connection failed (reset, read timeout, body cut), the body ended before the
    reply finished (``at_end``: raised reading the end of the body), or the server sent
    an error event whose status is retried. ``began``: part of the turn went out."""
    if isinstance(error, ModelHTTPError):
        status = error.status_code
        return Retry.retry_status(status) or (began and status in _MID_REPLY)
    if isinstance(error, ModelConnectionError):
        return True
    return isinstance(error, ModelProtocolError) and at_end


class Decoding(Protocol):
    """What reading needs of a reply's decoder (``_decoder.TurnDecoder``)."""

    finished: bool

    @property
    def framed(self) -> bool: ...

    def split(self, data: bytes) -> tuple[list[bytes], bytes]: ...

    def line(self, line: bytes) -> list[Chunk]: ...

    def end(self) -> list[Chunk]: ...

    def whole(self, body: bytes) -> list[Chunk]: ...


class Reading:
    """How one attempt's body is read: line by line through its decoder, with a server's
    echo of the prefill taken out (:class:`PrefillEcho`) and, once, the trailing
    ``space`` the prefill was sent without (Anthropic refuses a prefill ending in
    whitespace: the continuation's text loses that space if it starts with it, since
    the transcript keeps it already)."""

    __slots__ = ("at_end", "decoder", "echo", "failed", "plain", "rest", "space")

    def __init__(self, decoder: Decoding, prefix: str, space: str) -> None:
        self.decoder = decoder
        self.echo = PrefillEcho(prefix) if prefix else None
        self.space = space
        #: True once nothing is left to take out: chunks pass as they come.
        self.plain = self.echo is None and not space
        self.rest = b""
        #: A line's error, raised once the chunks of the lines before it went out.
        self.failed: ModelError | None = None
        #: The body ended (a failure now is the reply's end missing).
        self.at_end = False

    def lines(self, piece: bytes) -> list[Chunk]:
        """The chunks of the lines ``piece`` completes (none after the final marker)."""
        if self.failed is not None:
            raise self.failed
        decoder = self.decoder
        if decoder.framed:  # a binary stream of frames (Bedrock's), not lines
            lines, self.rest = decoder.split(self.rest + piece)
        else:
            lines = (self.rest + piece).split(b"\n")
            self.rest = lines.pop()
        if len(lines) == 1:  # most pieces are one event's line
            chunks = decoder.line(lines[0])
        else:
            chunks = []
            for line in lines:
                try:
                    chunks += decoder.line(line)
                except ModelError as error:
                    if not chunks:
                        raise
                    self.failed = error
                    break
                if decoder.finished:
                    break
        return chunks if self.plain else self.chunks(chunks)

    def end(self) -> list[Chunk]:
        """The chunks of the body's end (what it left after its last newline)."""
        if self.failed is not None:
            raise self.failed
        self.at_end = True
        return self.chunks(tail(self.decoder, self.rest))

    def whole(self, body: bytes) -> list[Chunk]:
        return self.chunks(self.decoder.whole(body))

    def chunks(self, chunks: list[Chunk]) -> list[Chunk]:
        echo = self.echo
        if echo is not None:
            chunks = echo.chunks(chunks)
            if echo.settled:
                self.echo = None
        if self.space and self.echo is None:
            for position, chunk in enumerate(chunks):
                if isinstance(chunk, TextDelta):
                    space, self.space = self.space, ""
                    if chunk.text.startswith(space):
                        text = chunk.text[len(space):]
                        chunks = list(chunks)
                        chunks[position: position + 1] = [TextDelta(text)] if text else []
                    break
        self.plain = self.echo is None and not self.space
        return chunks


def tail(decoder: Decoding, rest: bytes) -> list[Chunk]:
    """The chunks of what the stream left after its last newline, and its end's."""
    chunks = decoder.line(rest) if rest else []
    if not decoder.finished:
        chunks += decoder.end()
    return chunks


class TurnSoFar:
    """What a turn's stream gave its reader so far, over every attempt, and the
    messages the next attempt sends (``sent``: the turn's, or with the text so far as a
    trailing assistant message to continue). The chunks are only kept as they go (one
    list extend a piece); they are read when the stream breaks."""

    __slots__ = ("given", "kept", "messages", "sent")

    def __init__(self, messages: Sequence[Message]) -> None:
        self.messages = messages
        self.sent = messages
        #: The chunks given to the reader since the turn's start or its last retry
        #: (after a continued one, the text kept first, as one TextDelta).
        self.kept: list[Chunk] = []
        #: Anything of the turn went out (in any attempt).
        self.given = False

    def chunks(self, chunks: list[Chunk]) -> list[Chunk]:
        """``chunks``, noted as given to the reader."""
        if chunks:
            self.kept += chunks
            self.given = True
        return chunks

    def broke(
        self, error: ModelError, attempt: int, continues: bool, counted_input: int | None
    ) -> TurnRetry:
        """The stream broke after part of the turn went out, and is asked again (retry
        ``attempt``): continued when ``continues`` and the turn so far is text only,
        else restarted. ``counted_input``: the broken request's tokens as its server
        counted them, if it did. Returns what the reader is told."""
        text, output, plain = _read(self.kept, self.sent is not self.messages)
        inputs = counted_input
        if inputs is None:
            inputs = estimate_tokens(transcript_chars(self.sent, 0))
        spent: Usage = {"input_tokens": inputs, "output_tokens": estimate_tokens(output)}
        continued = continues and bool(text) and plain
        if continued:
            self.kept = [TextDelta(text)]
            self.sent = _with_prefill(self.messages, text)
        else:
            text, self.kept, self.sent = "", [], self.messages
        return TurnRetry(continued, text, spent, str(error), attempt)


def _read(chunks: list[Chunk], carried: bool) -> tuple[str, int, bool]:
    """The text of ``chunks``, the characters of output the last attempt made (the text
    ``carried`` over from a continued attempt, the first chunk, not counted), and True
    when they are text only (no thinking, no tool call). A TurnRetry among them (an
    inner client's own: a FallbackModel's model) keeps its text and drops the rest."""
    text: list[str] = []
    output, plain = 0, True
    for position, chunk in enumerate(chunks):
        if isinstance(chunk, TextDelta):
            text.append(chunk.text)
            output += 0 if carried and position == 0 else len(chunk.text)
        elif isinstance(chunk, ThinkingDelta):
            plain = False
            output += len(chunk.text)
        elif isinstance(chunk, ToolCallDelta):
            plain = False
        elif isinstance(chunk, TurnRetry):
            text, output = ([chunk.kept] if chunk.kept else []), 0
            plain = plain if chunk.continued else True
    return "".join(text), output, plain


def _with_prefill(messages: Sequence[Message], text: str) -> list[Message]:
    """``messages`` with ``text`` at the end of the answer: added to a trailing assistant
    message without tool calls (a continuation's prefix), else as a new one."""
    sent = list(messages)
    last = sent[-1] if sent else None
    if last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
        sent[-1] = {**last, "content": last["content"] + text}
        return sent
    prefill: AssistantMessage = {"role": "assistant", "content": text}
    sent.append(prefill)
    return sent
