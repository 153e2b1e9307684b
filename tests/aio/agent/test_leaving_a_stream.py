"""Leaving a streamed run's ``async for`` loop is a stop (issue 29 item 1, Invariant 8).

``break``, ``return`` or an exception in the loop body, at every event a run streams
(with tools one by one and side by side, with and without a store): the run settles
``cancelled`` by the next turn of the event loop, its transcript valid (every call
answered) and stored, ``agent.last_status`` set, and nothing is printed at exit, even
while a variable still holds the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, Literal

import pytest

from aimu import aio
from aimu.aio.events import Event, RunFinished
from aimu.aio.transcript import dangling_calls, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel

Exit = Literal["break", "return", "raise"]
ROOT = Path(__file__).resolve().parents[3]


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


async def wait_a_little() -> str:
    """Take a few turns of the event loop."""
    for _ in range(3):
        await asyncio.sleep(0)
    return "waited"


def script() -> list[Turn]:
    return [
        Turn(text="let me see", tool_calls=[ScriptedCall("add", {"a": 1, "b": 2}),
                                            ScriptedCall("wait_a_little")]),
        Turn(text="and once more", tool_calls=[ScriptedCall("wait_a_little")]),
        Turn(text="all done now"),
    ]


class Left(Exception):
    """Raised in a loop body to leave it."""


async def leave_at(stream: AsyncGenerator[Event, None], index: int, how: Exit) -> list[Event]:
    """Read ``stream`` and leave the loop at event ``index`` in the way ``how``."""
    seen: list[Event] = []

    async def by_return() -> None:
        async for event in stream:
            seen.append(event)
            if len(seen) > index:
                return

    if how == "return":
        await by_return()
    elif how == "break":
        async for event in stream:
            seen.append(event)
            if len(seen) > index:
                break
    else:
        with pytest.raises(Left):
            async for event in stream:
                seen.append(event)
                if len(seen) > index:
                    raise Left
    return seen


async def one_trial(
    index: int, how: Exit, concurrent: bool, store: aio.SQLiteStore | None, session: str
) -> bool:
    """Leave at event ``index``; False once the run ended before that."""
    model = ScriptedModel(script())
    agent = aio.Agent(model, tools=[add, wait_a_little], concurrent_tools=concurrent,
                      store=store, session=session if store is not None else None)
    stream = agent.run("go", stream=True)  # held by a variable all along
    seen = await leave_at(stream, index, how)
    finished = isinstance(seen[-1], RunFinished)
    await asyncio.sleep(0)  # the next turn of the event loop: the run has settled
    assert agent.last_status == (seen[-1].status if finished else "cancelled"), (index, how)
    assert not agent.running and model.open_streams == 0
    messages = agent.model_client.messages
    validate(messages)
    assert not list(dangling_calls(messages)), "a call left without its result"
    if store is not None:
        assert await store.load(session) == messages  # stored as it is in memory
        info = await store.info(session)
        assert info is not None and info.status == agent.last_status
    await stream.aclose()  # nothing left to wait for: it returns at once
    await agent.aclose()
    return not finished


@pytest.mark.parametrize("stored", [False, True], ids=["memory", "sqlite"])
@pytest.mark.parametrize("concurrent", [False, True], ids=["one-by-one", "side-by-side"])
@pytest.mark.parametrize("how", ["break", "return", "raise"])
async def test_leaving_the_loop_at_every_event_settles_the_run_cancelled(
    how: Exit, concurrent: bool, stored: bool, tmp_path: Path
) -> None:
    store = aio.SQLiteStore(tmp_path / "runs.db") if stored else None
    loop = asyncio.get_running_loop()
    problems: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: problems.append(context))
    try:
        trials = 0
        while await one_trial(trials, how, concurrent, store, f"s{trials}"):
            trials += 1
        assert trials >= 10  # every event of a run with two tool rounds
    finally:
        loop.set_exception_handler(None)
        if store is not None:
            await store.aclose()
    assert problems == []


async def test_the_exception_that_left_the_loop_is_the_one_raised() -> None:
    agent = aio.Agent(ScriptedModel(script()), tools=[add, wait_a_little])
    with pytest.raises(Left):
        async for _ in agent.run("go", stream=True):
            raise Left
    await asyncio.sleep(0)
    assert agent.last_status == "cancelled"
    assert agent.messages[-1] == {"role": "user", "content": "go"}  # nothing half-done


@pytest.mark.parametrize("form", ["async with", "aclosing"])
async def test_a_closing_block_settles_the_run_when_it_ends(form: str) -> None:
    """``async with agent.run(..., stream=True) as events`` and ``contextlib.aclosing``
    wait for the settling on exit: no loop turn to wait for."""
    agent = aio.Agent(ScriptedModel(script()), tools=[add, wait_a_little])
    stream = agent.run("go", stream=True)
    block = stream if form == "async with" else contextlib.aclosing(stream)
    async with block:
        async for event in stream:
            if isinstance(event, aio.ToolCallStarted):
                break
    assert agent.last_status == "cancelled"
    assert not list(dangling_calls(agent.messages))


async def test_a_workflow_stream_left_is_cancelled_too() -> None:
    chain = aio.Chain([aio.Agent(ScriptedModel(script()), tools=[add, wait_a_little])])
    async for event in chain.run("go", stream=True):
        if isinstance(event, aio.ToolCallStarted):
            break
    for _ in range(3):  # the workflow's run is a task of its own: it ends as that is cancelled
        await asyncio.sleep(0)
    assert chain.last_status == "cancelled"


def test_nothing_is_printed_at_exit_when_a_held_stream_was_left() -> None:
    """The stream is still referenced when the program ends: before the fix asyncio
    printed "RuntimeError: async generator ignored GeneratorExit" (the run yielded its
    final event while being closed) and the run was never settled."""
    program = textwrap.dedent("""
        import asyncio
        from aimu import aio
        from aimu.testing.script import ScriptedCall, Turn
        from aimu.testing.scripted import ScriptedModel

        async def slow() -> str:
            \"\"\"Slow.\"\"\"
            await asyncio.sleep(30)
            return "late"

        async def main() -> None:
            model = ScriptedModel([Turn(tool_calls=[ScriptedCall("slow")]), Turn(text="x")])
            agent = aio.Agent(model, tools=[slow])
            stream = agent.run("go", stream=True)
            async for event in stream:
                if isinstance(event, aio.ToolCallStarted):
                    break
            await asyncio.sleep(0)
            print(agent.last_status)

        asyncio.run(main())
    """)
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
        cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "default"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "cancelled\n" and done.stderr == ""


@pytest.mark.parametrize("then", ["run", "stream", "resume"])
async def test_a_run_asked_for_right_after_leaving_waits_for_the_settling(then: str) -> None:
    """The left run settles in a task (a loop turn later); a run asked for at once, in
    the line after the loop, waits for it instead of finding the session busy."""
    agent = aio.Agent(ScriptedModel(script()), tools=[add, wait_a_little])
    async for event in agent.run("go", stream=True):
        if isinstance(event, aio.ToolCallStarted):
            break
    if then == "run":
        reply = await agent.run("go on")
    elif then == "resume":
        reply = await agent.resume()
    else:
        events = [e async for e in agent.run("go on", stream=True)]
        assert isinstance(events[-1], RunFinished)
        reply = events[-1].reply
    assert reply == "all done now" and agent.last_status == "completed"
    assert [m["content"] for m in agent.messages if m["role"] == "user"] == (
        ["go"] if then == "resume" else ["go", "go on"]
    )
    validate(agent.messages)
