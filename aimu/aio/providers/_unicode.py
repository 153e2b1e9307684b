"""Text from a server made encodable: the rule at the wire edge.

JSON may carry UTF-16 surrogate escapes. A pair split across two stream chunks is
joined into its character; a lone surrogate becomes U+FFFD. So every transcript can
be written as UTF-8 (a store, a log, the next request) whatever a server sent.
"""

from __future__ import annotations

import re
from typing import Any

from aimu.aio.providers.base import Chunk, TextDelta, ThinkingDelta

__all__ = [
    "REPLACEMENT", "SurrogateJoiner", "TurnText", "clean", "clean_json", "has_surrogate"
]

REPLACEMENT = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")


def has_surrogate(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def clean(text: str) -> str:
    """``text`` with surrogate pairs joined and lone surrogates replaced by U+FFFD."""
    if not has_surrogate(text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def clean_json(value: Any) -> Any:
    """``value`` (parsed JSON) with every string, keys included, :func:`clean`-ed."""
    if isinstance(value, str):
        return clean(value)
    if isinstance(value, dict):
        return {clean(key): clean_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [clean_json(item) for item in value]
    return value


class SurrogateJoiner:
    """Cleans one channel of streamed text (a reply's text, or its thinking).

    A high surrogate at the end of a piece is held back until the next piece shows
    whether its partner follows; :meth:`flush` gives what is held at the turn's end.
    """

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = ""

    def feed(self, text: str) -> str:
        if self.held:
            text, self.held = self.held + text, ""
        elif text.isascii():
            return text
        if text and "\ud800" <= text[-1] <= "\udbff":
            text, self.held = text[:-1], text[-1]
        return clean(text)

    def flush(self) -> str:
        """U+FFFD for a high surrogate whose partner never came, else ``""``."""
        held, self.held = self.held, ""
        return REPLACEMENT if held else ""



class TurnText:
    """The two text channels of one streamed reply, thinking and text, each cleaned."""

    __slots__ = ("text", "thinking")

    def __init__(self) -> None:
        self.thinking = SurrogateJoiner()
        self.text = SurrogateJoiner()

    def chunks(self, thinking: object, text: object) -> list[Chunk]:
        """The chunks for a piece of ``thinking`` and ``text`` (either may be absent)."""
        chunks: list[Chunk] = []
        if isinstance(thinking, str) and thinking:
            thinking = self.thinking.feed(thinking)
            if thinking:
                chunks.append(ThinkingDelta(thinking))
        if isinstance(text, str) and text:
            text = self.text.feed(text)
            if text:
                chunks.append(TextDelta(text))
        return chunks

    def flush(self) -> list[Chunk]:
        """The chunks still held at the turn's end (U+FFFD for a lone half)."""
        chunks: list[Chunk] = []
        if self.thinking.flush():
            chunks.append(ThinkingDelta(REPLACEMENT))
        if self.text.flush():
            chunks.append(TextDelta(REPLACEMENT))
        return chunks
