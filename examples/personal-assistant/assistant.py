"""A personal assistant you can stop mid-sentence, interrupt, and pick up tomorrow.

    python examples/personal-assistant/assistant.py                      # offline
    python examples/personal-assistant/assistant.py --model ollama:qwen3:8b

This is ``aimu chat`` with a tool of its own. The serve loop (:class:`~aimu.assistant.
Assistant`, run by :func:`~aimu.assistant.run_chat`) reads your input while a turn
runs, runs each turn as a background ``RunHandle`` and keeps every message in
``$AIMU_HOME/sessions.db``; see README.md beside this file.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from typing import Annotated

from aimu.assistant import DEMO_TOOLS, ChatSettings, add_chat_options, run_chat


def roll_dice(sides: Annotated[int, "how many sides the die has"] = 6) -> int:
    """Roll a die and say which side came up."""
    return random.randint(1, max(sides, 1))


TOOLS = [*DEMO_TOOLS, roll_dice]


def main(argv: list[str] | None = None) -> int:
    """Serve one session on stdin/stdout until EOF (Ctrl+D) or Ctrl+C when idle."""
    parser = argparse.ArgumentParser(description="A personal assistant you can /stop.")
    add_chat_options(parser)
    settings = ChatSettings.from_options(parser.parse_args(argv))
    # run_chat opens the store under $AIMU_HOME, wires stdin and Ctrl+C, and turns a bad
    # --model or a session open elsewhere into one error line.
    return asyncio.run(run_chat(settings, tools=TOOLS))


if __name__ == "__main__":
    sys.exit(main())
