"""Tools for ``aimu serve`` child processes in the drain and recovery tests.

A call of ``held`` or ``held_once`` writes ``entered-<query>`` into the directory named
by ``AIMU_TEST_HELD`` (the provable point: the tool runs), then waits until the file
``open`` is there, and writes ``ran-<query>-<n>`` for its n-th completion.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

from aimu import aio
from aimu.testing.script import ScriptedCall, Turn


def _note(query: str, entered: bool) -> bool:
    """Note the call entered (``entered``) or done; True once the gate is open."""
    where = Path(os.environ["AIMU_TEST_HELD"])
    if entered:
        (where / f"entered-{query}").touch()
    else:
        done = len(list(where.glob(f"ran-{query}-*"))) + 1
        (where / f"ran-{query}-{done}").touch()
    return (where / "open").exists()


async def _hold(query: str) -> str:
    opened = _note(query, entered=True)
    while not opened:
        await asyncio.sleep(0.02)
        opened = (Path(os.environ["AIMU_TEST_HELD"]) / "open").exists()
    _note(query, entered=False)
    return f"held {query}"


@aio.tool(idempotent=True)
async def held(query: str) -> str:
    """Look something up (safe to run again after a crash)."""
    return await _hold(query)


@aio.tool
async def held_once(query: str) -> str:
    """Do something once (a crash mid-call leaves it in doubt)."""
    return await _hold(query)


@aio.tool(approval=True)
async def held_asked(query: str) -> str:
    """Do something a person approves first (a crash mid-call: asked again)."""
    return await _hold(query)


@aio.tool
def tick() -> str:
    """Count one round."""
    return "tick"


#: Set (in the test's process, where the model server runs): ``loop`` and ``slow`` turns
#: stream fast.
LOOP_FAST = threading.Event()


def script(request: dict[str, object]) -> Turn:
    """``hold Q`` calls held, ``once Q`` held_once, ``ask Q`` held_asked (``asks Q``:
    held_asked twice, on Q1 and Q2), then each says it is done; ``slow Q``: a slow
    reply; ``loop``: every turn calls tick, for ever (each streams for about 8 s until
    LOOP_FAST is set); anything else: ``answer to <it>``."""
    messages = list(request.get("messages") or [])  # type: ignore[call-overload]
    said = next(
        (str(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), ""
    )
    if said == "loop":
        slow = not LOOP_FAST.is_set()
        return Turn(text=" ".join(f"w{i}" for i in range(400 if slow else 3)),
                    tool_calls=(ScriptedCall("tick", {}),), delay=0.02 if slow else 0)
    if messages and messages[-1].get("role") == "tool":
        return Turn(text=f"done: {messages[-1].get('content')}")
    word, _, query = said.partition(" ")
    if word == "asks":  # two calls, each waiting for a person's decision
        return Turn(text="asking ", tool_calls=tuple(
            ScriptedCall("held_asked", {"query": f"{query}{n}"}) for n in (1, 2)))
    names = {"hold": "held", "once": "held_once", "ask": "held_asked"}
    if word == "slow":  # a reply that streams for about 8 s (at once with LOOP_FAST)
        return Turn(text=" ".join(f"w{i}" for i in range(400)),
                    delay=0 if LOOP_FAST.is_set() else 0.02)
    if word in names:
        name = names[word]
        return Turn(text="calling ", tool_calls=(ScriptedCall(name, {"query": query}),))
    return Turn(text=f"answer to {said}")
