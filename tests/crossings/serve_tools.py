"""The tools and the model script of the served places (``aimu serve --tool
tests.crossings.serve_tools:charge`` ...): each call of a tool that is not idempotent
leaves a file ``<tool>-<call id>-<n>`` in ``$AIMU_CROSSING_EFFECTS``, so a test sees a
call that ran twice whichever process ran it (a kill -9, a recovery, another server).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aimu import aio
from aimu.testing.script import ScriptedCall, Turn

SEND = "also mention the tides"
ANSWER = "the final answer is here"
#: Seconds between the chunks of a reply: the served run is still going when a stop
#: sent on seeing event k arrives (the model's pace, not a wait in the test).
PACE = 0.01


def _note(tool: str, call_id: str) -> None:
    where = Path(os.environ["AIMU_CROSSING_EFFECTS"])
    done = len(list(where.glob(f"{tool}-{call_id}-*"))) + 1
    (where / f"{tool}-{call_id}-{done}").touch()


def effects(where: Path) -> Counter[tuple[str, str]]:
    """How many times each (tool, call id) ran."""
    counts: Counter[tuple[str, str]] = Counter()
    for path in where.iterdir():
        tool, rest = path.name.split("-", 1)
        counts[(tool, rest.rsplit("-", 1)[0])] += 1
    return counts


@aio.tool
async def charge(amount: int, ctx: aio.ToolContext) -> str:
    """Charge a card (not idempotent)."""
    _note("charge", ctx.call_id)
    return f"charged {amount}"


@aio.tool(idempotent=True)
def look(query: str) -> str:
    """Look a query up (idempotent)."""
    return f"found {query}"


@aio.tool(approval=True)
async def wire(to: str, ctx: aio.ToolContext) -> str:
    """Wire money (a person approves it first)."""
    _note("wire", ctx.call_id)
    return f"wired {to}"


CALLS: dict[str, list[ScriptedCall]] = {
    "plain": [],
    "tools": [ScriptedCall("charge", {"amount": 5}), ScriptedCall("look", {"query": "q"})],
    "send": [ScriptedCall("charge", {"amount": 5}), ScriptedCall("look", {"query": "q"})],
    "approvals": [ScriptedCall("wire", {"to": "x"})],
    "mcp": [ScriptedCall("add", {"a": 2, "b": 3})],
}


def script(request: Mapping[str, Any]) -> Turn:
    """The task ``cross <capability> <case>`` picks the calls; a tool result last: the
    answer (naming the tides once a send joined)."""
    messages = request.get("messages") or []
    task = next((m.get("content") for m in messages if m.get("role") == "user"), "")
    capability = str(task).split()[1] if str(task).startswith("cross ") else "plain"
    sent = any(m.get("role") == "user" and m.get("content") == SEND for m in messages)
    if (messages and messages[-1].get("role") == "tool") or not CALLS[capability]:
        return Turn(text=ANSWER + (" and tides" if sent else ""), chunks=5, delay=PACE)
    return Turn(text="let me see", chunks=2, delay=PACE, tool_calls=CALLS[capability])
