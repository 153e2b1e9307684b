"""What the loopback server records: every request it read, and how every chat reply ended."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, TypeVar, overload

from aimu.testing.server.gemini_chat import chat_view

__all__ = ["Headers", "RecordedRequest", "StreamRecord", "WireProtocol"]

WireProtocol: TypeAlias = Literal[
    "ollama", "openai", "gemini", "openai-responses", "anthropic", "bedrock"
]

_T = TypeVar("_T")


class Headers(dict[str, str]):
    """Request headers: keys stored lower-case, looked up case-insensitively."""

    def __getitem__(self, key: str) -> str:
        return super().__getitem__(key.lower())

    def __contains__(self, key: object) -> bool:
        return super().__contains__(key.lower() if isinstance(key, str) else key)

    @overload
    def get(self, key: str, default: None = None, /) -> str | None: ...
    @overload
    def get(self, key: str, default: str, /) -> str: ...
    @overload
    def get(self, key: str, default: _T, /) -> str | _T: ...
    def get(self, key: str, default: object = None, /) -> object:
        return super().get(key.lower(), default)


@dataclass
class RecordedRequest:
    """One request as the server received it (secret header values redacted)."""

    method: str
    path: str
    protocol: WireProtocol
    body: dict[str, Any]
    headers: Headers
    time: float
    """``time.monotonic()`` when the request was fully read."""
    connection: int = 0
    """Serial number of the TCP connection it came on (equal numbers: keep-alive)."""
    view: dict[str, Any] | None = None
    """The body in the chat shape, for a wire of another shape (as scripts see it)."""

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The request's transcript in the chat shape, whatever its wire (Gemini's
        ``contents`` and ``systemInstruction`` translated; ``[]`` if it has none)."""
        if self.view is not None:
            return list(self.view.get("messages") or [])
        if self.protocol == "gemini":
            return list(chat_view(self.body)["messages"])
        messages = self.body.get("messages")
        return list(messages) if isinstance(messages, list) else []


@dataclass
class StreamRecord:
    """One chat reply (streamed or not) and how it ended.

    ``completed``: the final marker was sent; ``abandoned``: the client closed the
    connection before that, noticed at ``abandoned_at`` (``time.monotonic()``).
    """

    path: str
    protocol: WireProtocol
    streamed: bool
    started_at: float
    fault: str | None = None
    finished_at: float | None = None
    completed: bool = False
    abandoned: bool = False
    abandoned_at: float | None = None
    chunks_sent: int = 0
