"""The model's side of the control tests: what the loopback server answers to each task."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping
from typing import Any

from aimu.aio.scope import current_scope
from aimu.testing.script import ScriptedCall, Turn

#: A reply long enough (20 s) that only a stop ends it.
ENDLESS = Turn(text=" ".join(f"w{i}" for i in range(1000)), delay=0.02)
NOTE_TURN = Turn(text="noting", delay=0.02, tool_calls=[ScriptedCall("note", {"text": "x"})])
HOLD_TURN = Turn(text="holding", delay=0.02, tool_calls=[ScriptedCall("hold")])


def note(text: str) -> str:
    """Write a note."""
    return f"noted: {text}"


async def hold() -> str:
    """Wait until the run is asked to stop gracefully (a provable point to interrupt at)."""
    scope = current_scope.get()
    assert scope is not None, "hold() runs only inside a RunHandle"
    # The scope has a flag, not an event: poll it (no race, only the wait for it).
    while not scope.interrupt_requested:  # noqa: ASYNC110
        await asyncio.sleep(0.005)
    return "held until interrupted"


TOOLS = [note, hold]


class Answers:
    """By task: ``quick`` answers at once; ``tool...`` calls ``hold`` (which returns once
    the run is interrupted), then streams endlessly (``tool then done``: answers ``done``
    at once); ``resume...`` calls ``note``, then
    streams endlessly the first time and answers ``done`` the next (the resumed run);
    anything else streams endlessly."""

    def __init__(self) -> None:
        self.after_tool: Counter[str] = Counter()

    def __call__(self, body: Mapping[str, Any]) -> Turn:
        messages = body.get("messages") or []
        task = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        if task.startswith("quick"):
            return Turn(text="quick answer")
        if task.startswith(("tool", "resume")):
            if not messages or messages[-1]["role"] != "tool":
                return HOLD_TURN if task.startswith("tool") else NOTE_TURN
            self.after_tool[task] += 1
            if task.startswith("tool then done"):
                return Turn(text="done")
            if task.startswith("resume") and self.after_tool[task] > 1:
                return Turn(text="done")
        return ENDLESS


def steer(body: Mapping[str, Any]) -> Turn:
    """``steer...``: call wait_for_send; after a user message that joined: ``got <it>``."""
    messages = body.get("messages") or []
    last = messages[-1] if messages else {}
    if last.get("role") == "user" and str(last.get("content")).startswith("steer"):
        return Turn(text="waiting", tool_calls=(ScriptedCall("wait_for_send"),))
    if last.get("role") == "user":
        return Turn(text=f"got {last.get('content')}")
    return Turn(text="the send did not join")
