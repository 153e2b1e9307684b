"""Scripts of model turns, shared by the loopback server and the in-process scripted model.

A script is a list of :class:`Turn` (served in order, one per request) or a function
from the request to a ``Turn``. A turn says what the model "says": text split into
chunks with a delay between them, tool calls, thinking, and an optional fault.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from aimu.aio.providers.test import split_text

__all__ = ["Fault", "Script", "ScriptedCall", "Turn", "cut_once", "split_text"]

Fault: TypeAlias = Literal[
    "http_500",  # answer 500 with an error body
    "http_429",  # answer 429 with an error body and Retry-After (see Turn.retry_after)
    "http_502",  # answer 502 (bad gateway)
    "http_503",  # answer 503 (unavailable), with Retry-After if Turn.retry_after is set
    "http_503_loading",  # answer 503 "Loading model", as llama.cpp's server does meanwhile
    "http_504",  # answer 504 (gateway timeout)
    "http_529",  # answer 529 (Anthropic's "overloaded")
    "reset",  # read the request, then close the connection without a byte of reply
    "bad_json",  # after `fault_after` chunks, send a line that is not JSON
    "drop",  # after `fault_after` chunks, close the connection mid-stream
    "hang",  # after `fault_after` chunks, never send anything again
    "error_event",  # after `fault_after` chunks, send the protocol's error event and end
    "overloaded_event",  # the same, the error saying the server is overloaded (a 529's)
    "no_done",  # send every chunk, then end the stream without the final marker
    "cut",  # after `fault_after` chunks (the final ones counted), half the next chunk's
    # bytes, then close the connection mid-body (a proxy or the network cutting it)
    "stall",  # the same, but the connection stays open and silent (a read timeout)
]


@dataclass(frozen=True)
class ScriptedCall:
    """A tool call the scripted model makes; ``id`` is generated when left out."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    id: str | None = None


@dataclass(frozen=True)
class Turn:
    text: str = ""
    tool_calls: Sequence[ScriptedCall] = ()
    thinking: str = ""
    chunks: int | None = None
    """How many pieces to stream ``text`` in; None: one piece per word."""
    delay: float = 0.0
    """Seconds to wait before each chunk after the first."""
    first_byte_delay: float = 0.0
    fault: Fault | None = None
    fault_after: int = 0
    input_tokens: int = 0
    output_tokens: int | None = None
    """None: the number of text chunks."""
    stop_reason: str | None = None
    """The reply's done/finish reason (e.g. ``"length"``); None: stop or tool_calls."""
    retry_after: str | None = None
    """The ``Retry-After`` header of an HTTP fault; None: ``"1"`` on a 429, else none."""


Script: TypeAlias = Sequence[Turn] | Callable[[Mapping[str, Any]], Turn]


def cut_once(
    reply: Turn, *then: Turn, fault: Fault = "cut", fault_after: int = 1
) -> Script:
    """A script whose first reply is ``reply`` broken by ``fault`` after ``fault_after``
    chunks. A request that asks for it again (the first request's messages, and at most
    a trailing assistant message: the part a client kept, sent to be continued) is
    answered as a model would: the rest of the text when it continues ``reply``'s text
    (trailing whitespace may be left off), else the whole ``reply``. Any other request
    gets the next turn of ``then``."""
    from dataclasses import replace

    first: list[int] = []
    later = iter(then)

    def answer(request: Mapping[str, Any]) -> Turn:
        messages = request.get("messages")
        messages = messages if isinstance(messages, list) else []
        last = messages[-1] if messages else None
        prefill = isinstance(last, Mapping) and last.get("role") == "assistant"
        if not first:
            first.append(len(messages))
            return replace(reply, fault=fault, fault_after=fault_after)
        if len(messages) - prefill != first[0]:
            return next(later, Turn(text="(the script has no more turns)"))
        kept = last.get("content") if prefill and isinstance(last, Mapping) else None
        if isinstance(kept, str) and kept and reply.text.startswith(kept):
            return replace(reply, text=reply.text[len(kept):], thinking="",
                           input_tokens=reply.input_tokens + len(kept) // 4)
        return reply

    return answer
