"""Tools for ``aimu serve`` child processes in the drain and recovery tests.

A call of ``held`` or ``held_once`` writes ``entered-<query>`` into the directory named
by ``AIMU_TEST_HELD`` (the provable point: the tool runs), then waits until the file
``open`` is there, and writes ``ran-<query>-<n>`` for its n-th completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
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


def script(request: dict[str, object]) -> Turn:
    """``hold Q`` calls held, ``once Q`` held_once, ``ask Q`` held_asked, ``block Q``
    blocking, ``stub Q`` stubborn, then each says it is done; ``slow Q``: a slow reply;
    anything else: ``answer to <it>``."""
    messages = list(request.get("messages") or [])  # type: ignore[call-overload]
    said = next(
        (str(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), ""
    )
    if messages and messages[-1].get("role") == "tool":
        return Turn(text=f"done: {messages[-1].get('content')}")
    word, _, query = said.partition(" ")
    names = {"hold": "held", "once": "held_once", "ask": "held_asked", "block": "blocking",
             "stub": "stubborn"}
    if word == "slow":  # a reply that streams for about 8 s
        return Turn(text=" ".join(f"w{i}" for i in range(400)), delay=0.02)
    if word in names:
        name = names[word]
        return Turn(text="calling ", tool_calls=(ScriptedCall(name, {"query": query}),))
    return Turn(text=f"answer to {said}")
