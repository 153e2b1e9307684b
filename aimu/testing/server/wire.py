"""What a wire protocol is to the loopback server: its endpoints and how it frames a turn.

A protocol module (:mod:`.ollama`, :mod:`.openai`) defines a :class:`Wire` subclass,
which frames one scripted :class:`~aimu.testing.script.Turn` (streamed chunks, the final
marker, a whole reply, an error body), and a :class:`Protocol` naming its chat path and
its other endpoints. To serve another endpoint, add a function to the protocol's
``endpoints``: it gets the server's view and the request body and returns a reply.
"""

from __future__ import annotations

import abc
import base64
import json
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from aimu.testing.script import Turn, split_text
from aimu.testing.server.records import Headers, WireProtocol

__all__ = [
    "JSON",
    "Endpoint",
    "Protocol",
    "Reply",
    "ServerView",
    "Wire",
    "alternation_error",
    "image_error",
    "json_bytes",
    "output_tokens",
    "prefill",
    "trailing_assistant_error",
]

JSON = "application/json"


def json_bytes(value: object) -> bytes:
    """Compact UTF-8 JSON."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:
        # A scripted lone surrogate goes out as a JSON escape, as a buggy server sends it.
        return json.dumps(value, separators=(",", ":")).encode()


def output_tokens(turn: Turn) -> int:
    """The output tokens a turn reports: as scripted, else one per streamed piece."""
    if turn.output_tokens is not None:
        return turn.output_tokens
    return len(split_text(turn.text, turn.chunks))


class Wire(abc.ABC):
    """How one protocol frames a scripted turn for one chat request."""

    protocol: WireProtocol
    stream_content_type: str

    def __init__(self, model: str, body: Mapping[str, Any], call_ids: Iterator[int]) -> None:
        self.model = model
        self.body = body
        self.call_ids = call_ids
        self._script_body: Mapping[str, Any] | None = None

    def streamed(self) -> bool:
        """Whether the request asks for a streamed reply: by default, when its body says
        ``"stream": true`` (a protocol that streams otherwise overrides this)."""
        return self.body.get("stream") is True

    def refusal(self) -> str | None:
        """Why a real server of this protocol would answer the request 400, if it would."""
        return None

    def script_body(self) -> Mapping[str, Any]:
        """What a script function is handed: :meth:`script_view`, made once."""
        if self._script_body is None:
            self._script_body = self.script_view()
        return self._script_body

    def script_view(self) -> Mapping[str, Any]:
        """The request body (a protocol whose body is not in the chat shape adds the chat
        shape's keys, so one script serves all)."""
        return self.body

    @abc.abstractmethod
    def error_body(self, status: int, message: str) -> bytes: ...

    def error_headers(self, status: int) -> list[tuple[str, str]]:
        """Headers an error reply of ``status`` carries (AWS's ``x-amzn-ErrorType``)."""
        return []

    @abc.abstractmethod
    def chunks(self, turn: Turn) -> list[bytes]:
        """The framed content lines/events of a streamed turn, without the final marker."""

    @abc.abstractmethod
    def final(self, turn: Turn) -> list[bytes]:
        """The framed lines/events that end a streamed turn (usage, done marker)."""

    @abc.abstractmethod
    def bad_line(self) -> bytes:
        """A framed line/event whose JSON is broken (the ``bad_json`` fault)."""

    def error_event(self, message: str) -> bytes:
        """A framed error the server sends mid-stream (the ``error_event`` fault)."""
        return json_bytes({"error": message}) + b"\n"

    def overloaded_event(self, message: str) -> bytes:
        """A framed error saying the server is overloaded, sent mid-stream (the
        ``overloaded_event`` fault; Anthropic's ``overloaded_error``); else as
        :meth:`error_event`."""
        return self.error_event(message)

    @abc.abstractmethod
    def whole(self, turn: Turn, *, finished: bool = True) -> bytes:
        """The non-streamed reply; ``finished=False`` leaves out the done marker."""


class ServerView(typing.Protocol):
    """What an endpoint may read of the server."""

    @property
    def models(self) -> Mapping[str, None]:
        """The model names the server has been asked for, in order (``test`` first)."""
        ...

    @property
    def missing_models(self) -> set[str]:
        """Model names the registry does not have (pulls of them fail)."""
        ...

    @property
    def not_pulled(self) -> set[str]:
        """Model names not on the server until a pull fetches them."""
        ...


@dataclass(frozen=True)
class Reply:
    """A whole reply an endpoint gives."""

    body: bytes
    status: int = 200
    content_type: str = JSON
    headers: tuple[tuple[str, str], ...] = ()


#: An endpoint other than chat: the server's view and the request's JSON body to a reply.
Endpoint = Callable[[ServerView, Mapping[str, Any]], Reply]


@dataclass(frozen=True)
class Protocol:
    """A wire protocol: its name, chat path, framing, and other endpoints by path."""

    name: WireProtocol
    chat_path: str
    wire: type[Wire]
    endpoints: Mapping[str, tuple[str, Endpoint]] = field(default_factory=dict)
    """path -> (method, endpoint)."""

    def is_chat(self, path: str) -> bool:
        """Whether ``path`` is this protocol's chat endpoint."""
        return path == self.chat_path

    def make_wire(self, target: str, body: Mapping[str, Any], call_ids: Iterator[int]) -> Wire:
        """The framing of one request to ``target`` (its path and query): for the model
        its body names."""
        return self.wire(str(body.get("model") or "test"), body, call_ids)

    def authorize(self, method: str, target: str, headers: Headers, body: bytes) -> Reply | None:
        """The refusal a request gets before anything else (a bad signature), or None."""
        return None

    def method(self, path: str) -> str | None:
        """The method ``path`` takes, or None if this protocol has no such endpoint."""
        if self.is_chat(path):
            return "POST"
        found = self.endpoints.get(path)
        return found[0] if found else None


_IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a")


def _bad_image(encoded: object) -> bool:
    """True unless ``encoded`` is base64 of a PNG, JPEG, GIF or WebP image."""
    if not isinstance(encoded, str):
        return True
    try:
        data = base64.b64decode(encoded, validate=True)
    except ValueError:
        return True
    webp = data[:4] == b"RIFF" and data[8:12] == b"WEBP"
    return not (webp or data.startswith(_IMAGE_MAGIC))


def image_error(messages: object) -> str | None:
    """The 400 a server gives an image it cannot decode: Ollama's ``images`` (base64) or
    an OpenAI ``image_url`` content part (a ``data:`` URL)."""
    if not isinstance(messages, list):
        return None
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            continue
        encoded: list[object] = list(message.get("images") or [])
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if isinstance(part, Mapping) and part.get("type") == "image_url":
                url = part.get("image_url", {}).get("url", "")
                prefix, _, data = str(url).partition(";base64,")
                encoded.append(data if prefix.startswith("data:image/") else None)
        if any(_bad_image(item) for item in encoded):
            return f"invalid image input in message {index}: not a base64 PNG, JPEG, GIF or WebP"
    return None


def prefill(messages: object) -> str:
    """The text of a trailing assistant message (what a server continues), else ``""``."""
    last = messages[-1] if isinstance(messages, list) and messages else None
    if isinstance(last, Mapping) and last.get("role") == "assistant":
        content = last.get("content")
        return content if isinstance(content, str) else ""
    return ""


def trailing_assistant_error(messages: object) -> str | None:
    """The 400 of a server that cannot continue an assistant message (the chat must end
    with a user or tool message), for a request whose last message is the assistant's."""
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if isinstance(last, Mapping) and last.get("role") == "assistant":
        return (
            "this server cannot continue an assistant message: the last message must be "
            "from the user or a tool"
        )
    return None


def alternation_error(messages: object) -> str | None:
    """The 400 a strict chat template gives two user, or two assistant, turns in a row."""
    if not isinstance(messages, list):
        return None
    previous = ""
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else None
        if role in ("user", "assistant") and role == previous:
            return (
                "Conversation roles must alternate user/assistant/user/assistant/...: "
                f"messages {index - 1} and {index} are both {role!r}"
            )
        previous = str(role)
    return None
