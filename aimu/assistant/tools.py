"""The harmless demo tools ``aimu chat`` (and ``aimu serve``) offer the model by default."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Annotated, Any

from aimu.aio.tools import ToolContext

__all__ = ["DEMO_TOOLS", "RESEARCH_SECONDS", "current_time", "research", "word_count"]

#: How long the demo ``research`` tool works, so a person can stop it midway.
RESEARCH_SECONDS = 1.5


def current_time() -> str:
    """The current local date and time, in ISO 8601."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def word_count(text: Annotated[str, "the text whose words to count"]) -> int:
    """Count the words in a text."""
    return len(text.split())


def research(topic: Annotated[str, "what to look into"], ctx: ToolContext) -> str:
    """Look into a topic and return notes on it. Slow: it takes a moment."""
    # A sync tool runs in a worker thread: waiting on the context lets a cancel end it.
    if ctx.wait_cancelled(RESEARCH_SECONDS) or ctx.cancelled:
        return f"research on {topic!r} was cancelled"
    return f"notes on {topic!r}: it is well documented and worth a closer look"


#: The harmless tools ``aimu chat`` offers, so the test model's tool rounds show.
DEMO_TOOLS: tuple[Callable[..., Any], ...] = (current_time, word_count, research)
