"""A personal assistant you can stop mid-sentence, interrupt, and pick up tomorrow.

    python examples/personal-assistant/assistant.py                      # offline
    python examples/personal-assistant/assistant.py --model ollama:qwen3:8b

This is ``aimu chat`` with a tool of its own. The serve loop (:class:`Assistant`) reads
your input while a turn runs, runs each turn as a background ``RunHandle`` and keeps
every message in ``$AIMU_HOME/sessions.db``; see README.md beside this file.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from typing import Annotated

from aimu import aio
from aimu.assistant import DEMO_TOOLS, Assistant, ChatSettings, add_chat_options, make_client


def roll_dice(sides: Annotated[int, "how many sides the die has"] = 6) -> int:
    """Roll a die and say which side came up."""
    return random.randint(1, max(sides, 1))


TOOLS = [*DEMO_TOOLS, roll_dice]


async def serve(settings: ChatSettings) -> int:
    """Serve one session on stdin/stdout until EOF (Ctrl+D) or Ctrl+C when idle."""
    model = make_client(settings.model)  # "test" streams slowly enough to /stop
    try:
        settings.home.mkdir(parents=True, exist_ok=True)
        with aio.SQLiteStore(settings.store_path) as store:
            assistant = Assistant(
                model,
                store,
                session=settings.session,  # the same name next time continues it
                system=settings.system,
                tools=TOOLS if settings.tools else (),
                prompt=sys.stdin.isatty() and sys.stdout.isatty(),
            )
            try:
                return await assistant.serve(stdin=True, sigint=True)
            finally:
                await assistant.aclose()
    finally:
        await model.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A personal assistant you can /stop.")
    add_chat_options(parser)
    settings = ChatSettings.from_options(parser.parse_args(argv))
    try:
        return asyncio.run(serve(settings))
    except (aio.AimuError, ValueError) as error:  # a bad --model, a session open elsewhere
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
