"""The assistant people run: a chat loop whose turns can be stopped at any moment.

:class:`Assistant` reads input lines while a turn runs. Each turn is a background
:class:`~aimu.aio.RunHandle` that streams its reply to ``out``; ``/stop`` cancels the
turn running now (its partial reply stays in the session), input typed meanwhile runs
after it in order, and every message is durable in a store session, so a restart with
the same session continues the conversation. ``aimu chat`` and
``examples/personal-assistant`` both run this loop.

Output is line-oriented and flushed: reply text as it streams, ``[calling ...]`` and
``[tool → ...]`` lines for tool rounds, ``(thinking…)``, ``(stopped)`` and
``(interrupted)`` on lines of their own. An expected error is one ``error: ...`` line
on ``err`` (stderr), never a traceback, and :meth:`Assistant.serve` returns 1 when the
last turn failed. A ``> `` prompt is shown only on a terminal.

One concept a module: :mod:`.settings` (what a chat runs with, its options),
:mod:`.client` (the model client and errors in the chat's terms), :mod:`.tools` (the
demo tools), :mod:`.screen` (what it prints), :mod:`.stdin` (reading lines in a
thread), :mod:`.commands` (the session commands), :mod:`.loop` (the chat loop),
:mod:`.run` (``aimu chat`` itself).
"""

from aimu.assistant.client import TEST_MODEL_DELAY, make_client
from aimu.assistant.loop import Assistant, Mode
from aimu.assistant.run import run_chat
from aimu.assistant.settings import ChatSettings, add_chat_options, default_home
from aimu.assistant.tools import (
    DEMO_TOOLS,
    RESEARCH_SECONDS,
    current_time,
    research,
    word_count,
)

__all__ = [
    "DEMO_TOOLS",
    "RESEARCH_SECONDS",
    "TEST_MODEL_DELAY",
    "Assistant",
    "ChatSettings",
    "Mode",
    "add_chat_options",
    "current_time",
    "default_home",
    "make_client",
    "research",
    "run_chat",
    "word_count",
]
