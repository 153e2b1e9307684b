"""Tools for ``aimu serve`` child processes in the drain and recovery tests.

A call of ``held`` or ``held_once`` writes ``entered-<query>`` into the directory named
by ``AIMU_TEST_HELD`` (the provable point: the tool runs), then waits until the file
``open`` is there, and writes ``ran-<query>-<n>`` for its n-th completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from pathlib import Path

from aimu import aio
from aimu.testing.script import ScriptedCall, Turn


def _note(query: str, entered: bool) -> bool:
    """Note the call entered (``entered``) or done; True once the gate is open."""
    where = Path(os.environ["AIMU_TEST_HELD"])
    if entered:
        (where / f"entered-{query}").touch()
        with (where / f"entries-{query}").open("a") as entries:  # one line each time
            entries.write("entered\n")
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


def blocking(query: str) -> str:
    """Do something slow in a thread (a sync tool that never looks at a cancel): it
    writes ``entered-<query>``, then blocks for 60 s unless ``open`` appears."""
    opened = _note(query, entered=True)
    until = time.monotonic() + 60
    while not opened and time.monotonic() < until:
        time.sleep(0.05)
        opened = (Path(os.environ["AIMU_TEST_HELD"]) / "open").exists()
    _note(query, entered=False)
    return f"blocked {query}"


async def stubborn(query: str) -> str:
    """Do something that swallows its cancel (a bug in a tool): it writes
    ``entered-<query>``, then goes on for 60 s unless ``open`` appears."""
    opened = _note(query, entered=True)
    until = time.monotonic() + 60
    while not opened and time.monotonic() < until:
        with contextlib.suppress(asyncio.CancelledError):  # the bug: the run cannot settle
            await asyncio.sleep(0.05)
        opened = (Path(os.environ["AIMU_TEST_HELD"]) / "open").exists()
    _note(query, entered=False)
    return f"stubborn {query}"


@aio.tool
def tick() -> str:
    """Count one round."""
    return "tick"


#: Set (in the test's process, where the model server runs): ``loop`` and ``slow`` turns
#: stream fast.
LOOP_FAST = threading.Event()


#: The steps the helper takes for ``step Q`` (tests.serve.tree_tools.step).
STEPS = 3


def script(request: dict[str, object]) -> Turn:
    """``hold Q`` calls held, ``once Q`` held_once, ``ask Q`` held_asked (``asks Q``:
    held_asked twice, on Q1 and Q2), ``block Q`` blocking, ``stub Q`` stubborn, ``tree Q``
    the agent ``helper`` (:mod:`tests.serve.tree_tools`) with the task ``once Q``
    (``steps Q``: ``step Q``, which calls ``step`` STEPS times, one a turn), then each says
    it is done; ``slow Q``: a slow reply; ``loop``: every turn calls tick, for ever (each
    streams for about 8 s until LOOP_FAST is set); anything else: ``answer to <it>``."""
    messages = list(request.get("messages") or [])  # type: ignore[call-overload]
    said = next(
        (str(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), ""
    )
    if said == "loop":
        slow = not LOOP_FAST.is_set()
        return Turn(text=" ".join(f"w{i}" for i in range(400 if slow else 3)),
                    tool_calls=(ScriptedCall("tick", {}),), delay=0.02 if slow else 0)
    if messages and messages[-1].get("role") == "tool" and not said.startswith("step "):
        return Turn(text=f"done: {messages[-1].get('content')}")
    word, _, query = said.partition(" ")
    if word == "asks":  # two calls, each waiting for a person's decision
        return Turn(text="asking ", tool_calls=tuple(
            ScriptedCall("held_asked", {"query": f"{query}{n}"}) for n in (1, 2)))
    names = {"hold": "held", "once": "held_once", "ask": "held_asked", "block": "blocking",
             "stub": "stubborn"}
    if word == "slow":  # a reply that streams for about 8 s (at once with LOOP_FAST)
        return Turn(text=" ".join(f"w{i}" for i in range(400)),
                    delay=0 if LOOP_FAST.is_set() else 0.02)
    if word in ("tree", "steps"):  # the agent helper, called to do `once Q` or `step Q`
        task = f"{'once' if word == 'tree' else 'step'} {query}"
        return Turn(text="asking ", tool_calls=(ScriptedCall("helper", {"task": task}),))
    if word == "step":  # three steps, one a turn, then the answer
        taken = sum(1 for m in messages if m.get("role") == "tool")
        if taken < STEPS:
            return Turn(text="stepping ", tool_calls=(ScriptedCall("step", {"n": taken}),))
        return Turn(text=f"took {taken} steps")
    if word in names:
        name = names[word]
        return Turn(text="calling ", tool_calls=(ScriptedCall(name, {"query": query}),))
    return Turn(text=f"answer to {said}")
