"""Crash loop for the tool journal (issue 13 §3): kill -9 a run inside its tools, resume.

A child process runs an agent on a stored session whose model asks, each turn, for
``charge(n)`` (not idempotent) and ``touch(n)`` (``idempotent=True``); both append a line
to a file, the side effect. Each tool prints ``start`` before its side effect and
``appended`` after it, and then waits for the parent's ``go``: so the parent kills at a
provable point -- inside each tool before its effect, inside it after its effect (before
the result is recorded), right after each tool's result was seen, or at a random moment.
Each point twice (``AIMU_CRASH_KILLS=50``: 50 more, at points drawn at random), a new
child resuming each time, then one child that finishes. Then the count: every
charge ran at most once, every journalled touch at least once, and every call killed
inside its tool is marked in doubt in the transcript.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from aimu.aio.journal import IN_DOUBT_RESULT, RERUN_NOTE
from aimu.aio.transcript import CANCELLED_RESULT, Message, validate
from tests.aio.store.store_backends import SOAK_KILLS, Backend, backend

ROOT = Path(__file__).resolve().parents[2]
STEPS = 200
MARKERS = ("start", "appended", "result")
# Every distinct landing: (marker, tool) for each marker and each tool ("c": charge, not
# idempotent; "t": touch, idempotent), and a random moment; twice over, the second time
# past a few lines of the same kind.
POINTS = [(marker, tool) for marker in MARKERS for tool in "ct"] + [("random", "")]
SESSION = "journal-crash"

CHILD = """
import asyncio, json, sys
from aimu import aio
from aimu.aio.events import RunFinished, ToolResult
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel

SPEC, EFFECTS, STEPS = sys.argv[1], sys.argv[2], int(sys.argv[3])


def say(*fields):
    print(json.dumps(fields), flush=True)


async def checkpoint(marker, call_id):
    "Tell the parent where we are; go on only when it says so (or get killed here)."
    say(marker, call_id)
    line = await asyncio.to_thread(sys.stdin.readline)
    assert line == "go\\n", line


async def effect(kind, call_id):
    await checkpoint("start", call_id)
    with open(EFFECTS, "a") as f:
        f.write(f"{kind} {call_id}\\n")
        f.flush()
    await checkpoint("appended", call_id)


async def charge(n: int, ctx: aio.ToolContext) -> str:
    "Charge a card: must never run twice."
    await effect("charge", ctx.call_id)
    return f"charged {n}"


@aio.tool(idempotent=True)
async def touch(n: int, ctx: aio.ToolContext) -> str:
    "Touch a marker: safe to run again."
    await effect("touch", ctx.call_id)
    return f"touched {n}"


def turn(request):
    done = sum(1 for m in request["messages"] if m["role"] == "assistant")
    if done < STEPS:
        return Turn(tool_calls=(ScriptedCall("charge", {"n": done}, id=f"c{done}"),
                                ScriptedCall("touch", {"n": done}, id=f"t{done}")))
    return Turn(text="all steps done")


async def main():
    store = eval(SPEC, {"aio": aio})
    try:
        agent = aio.Agent(ScriptedModel(turn), tools=[charge, touch], max_rounds=STEPS + 5,
                          store=store, session="journal-crash")
        async with agent:
            if agent.resumable:
                events = agent.resume(stream=True)
            else:
                events = agent.run("do every step", stream=True)
            async for event in events:
                if isinstance(event, ToolResult):
                    say("result", event.call_id)
                elif isinstance(event, RunFinished):
                    say("finished", event.status)
    finally:
        await store.aclose()
    say("all done")


asyncio.run(main())
"""


class Child:
    """One child run: its lines read without blocking for long; its checkpoints answered."""

    def __init__(self, where: Backend, scratch: Path) -> None:
        self._stderr = (scratch / "child-stderr.txt").open("w+b")
        self.process = subprocess.Popen(
            [sys.executable, "-c", CHILD, where.spec, str(scratch / "effects.txt"), str(STEPS)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, cwd=ROOT,
        )
        assert self.process.stdout is not None
        self._fd = self.process.stdout.fileno()
        self._buffer = b""
        self.lines: list[list[Any]] = []
        self.eof = False

    def next_line(self, timeout: float = 30.0) -> list[Any] | None:
        """The next line it prints (None at its end)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            if self.eof:
                return None
            if time.monotonic() > deadline:
                raise AssertionError(f"the child printed nothing for {timeout} s")
            ready, _, _ = select.select([self._fd], [], [], 0.5)
            if ready:
                data = os.read(self._fd, 65536)
                self.eof = not data
                self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        self.lines.append(json.loads(line))
        return self.lines[-1]

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(b"go\n")
        self.process.stdin.flush()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.reap()

    def reap(self) -> None:
        self.process.wait(timeout=30)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()
        self._stderr.seek(0)
        self.stderr = self._stderr.read().decode(errors="replace")
        self._stderr.close()


def _run_until_killed(
    child: Child, rng: random.Random, mode: str, tool: str, passes: int
) -> tuple[str, str | None]:
    """Drive ``child`` and kill it at the ``passes``-th next ``mode`` line of ``tool``'s
    calls (``random``: at a random moment); return where it landed (``start``/``appended``:
    inside that call's tool, provably) and the call id."""
    deadline = time.monotonic() + rng.uniform(0.0, 0.3) if mode == "random" else None
    while True:
        timeout = 30.0 if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            line = child.next_line(timeout=timeout) if timeout or deadline is None else None
        except AssertionError:
            line = None  # the random moment came while the child was busy
        if deadline is not None and time.monotonic() >= deadline:
            child.kill()
            return "random", None
        if line is None:
            child.reap()
            raise AssertionError(f"the child ended before it was killed: {child.stderr[-2000:]}")
        kind = line[0]
        if kind == mode and line[1].startswith(tool) and passes == 0:
            child.kill()
            return kind, line[1]
        if kind == mode and line[1].startswith(tool):
            passes -= 1
        if kind in ("start", "appended"):
            child.go()


def _stored(where: Backend) -> tuple[list[Message], list[str]]:
    async def read() -> tuple[list[Message], list[str]]:
        store = where.make()
        try:
            starts = await store.tool_starts(SESSION)
            return await store.load(SESSION), [s.call_id for s in starts]
        finally:
            await store.aclose()

    return asyncio.run(read())


@pytest.fixture(params=["sqlite"])
async def where(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    async with backend(str(request.param), tmp_path) as location:
        yield location


@pytest.mark.slow
def test_kill_9_inside_tools_then_resume_runs_no_side_effect_twice_unknowingly(
    where: Backend, tmp_path: Path
) -> None:
    rng = random.Random("journal-crash")
    points = [(mode, tool, 0) for mode, tool in POINTS]
    points += [(mode, tool, rng.randint(1, 3)) for mode, tool in POINTS]
    points += [
        (*rng.choice(POINTS), rng.randint(0, 5)) for _ in range(SOAK_KILLS)
    ]
    killed_inside: dict[str, str] = {}  # call id -> "start" / "appended"
    landings: Counter[str] = Counter()
    for mode, tool, passes in points:
        child = Child(where, tmp_path)
        try:
            landing, call_id = _run_until_killed(child, rng, mode, tool, passes)
        finally:
            if child.process.poll() is None:
                child.process.kill()
                child.reap()
        assert child.process.returncode == -signal.SIGKILL
        landings[f"{landing} {call_id and call_id[0]}"] += 1
        if call_id is not None and landing in ("start", "appended"):
            killed_inside.setdefault(call_id, landing)
        validate(_stored(where)[0])

    final = Child(where, tmp_path)
    while (line := final.next_line()) is not None:
        if line[0] in ("start", "appended"):
            final.go()
    final.reap()
    assert final.process.returncode == 0, final.stderr[-3000:]
    assert ["finished", "completed"] in final.lines

    transcript, journal = _stored(where)
    validate(transcript)
    effects = Counter((tmp_path / "effects.txt").read_text().splitlines())
    result_of = {m["tool_call_id"]: m["content"] for m in transcript if m["role"] == "tool"}
    calls = [call["id"] for m in transcript if m["role"] == "assistant"
             for call in m.get("tool_calls", ())]
    assert len(calls) == 2 * STEPS and sorted(result_of) == sorted(calls)
    in_doubt = set()
    for call_id in calls:
        result, journalled = result_of[call_id], call_id in journal
        if call_id.startswith("c"):  # charge: not idempotent
            runs = effects[f"charge {call_id}"]
            assert runs <= 1, f"{call_id} charged {runs} times"
            if result == IN_DOUBT_RESULT:
                in_doubt.add(call_id)
            elif result == CANCELLED_RESULT:  # it never started
                assert runs == 0 and not journalled, call_id
            else:
                assert result.startswith("charged") and runs == 1, (call_id, result, runs)
        else:  # touch: idempotent
            runs = effects[f"touch {call_id}"]
            if result.startswith(RERUN_NOTE):
                in_doubt.add(call_id)
            if result == CANCELLED_RESULT:
                assert runs == 0 and not journalled, call_id
            else:
                assert runs >= 1, f"{call_id} has a result but never ran"
            assert result != IN_DOUBT_RESULT, f"{call_id} is idempotent: it runs again"
    # Every call killed inside its tool is marked in doubt in the transcript, and only
    # a call that was started and cut by a kill is.
    assert set(killed_inside) <= in_doubt, set(killed_inside) - in_doubt
    assert in_doubt <= set(journal)
    # Every point was landed on (a kill aimed inside a tool lands there, provably).
    assert {f"{mode} {tool}" for mode in MARKERS for tool in "ct"} <= set(landings), landings
    print(f"landings {dict(landings)}; {len(in_doubt)} calls in doubt, "
          f"{sum(effects.values())} side effects")


APPROVED_CHILD = """
import asyncio, sys
from aimu import aio
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel

SPEC, EFFECTS = sys.argv[1], sys.argv[2]


@aio.tool(approval=True)
async def pay(amount: int) -> str:
    "Pay: a person approves each payment."
    with open(EFFECTS, "a") as f:
        f.write(f"paid {amount}\\n")
    print("paid", flush=True)
    await asyncio.sleep(3600)  # killed here: after the effect, before the result
    return "paid"


async def main():
    store = eval(SPEC, {"aio": aio})
    model = ScriptedModel([Turn(tool_calls=[ScriptedCall("pay", {"amount": 5})])])
    agent = aio.Agent(model, tools=[pay], store=store, session="pay")
    await agent.run("pay the bill")  # paused: pay waits for a person
    (pending,) = agent.pending_approvals
    agent.approve(pending.call_id)
    await agent.aclose()  # the decision is stored; a new agent resumes it
    again = aio.Agent(model.fork(), tools=[pay], store=store, session="pay")
    await again.resume()

asyncio.run(main())
"""


def test_an_approved_call_killed_mid_call_comes_back_in_doubt_and_waits(
    where: Backend, tmp_path: Path
) -> None:
    """Issue 21 item 22: it came back with no pending approval and resume() ran it again."""
    effects = tmp_path / "effects.txt"
    with (tmp_path / "child-stderr.txt").open("w+b") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", APPROVED_CHILD, where.spec, str(effects)],
            stdout=subprocess.PIPE, stderr=stderr, cwd=ROOT,
        )
        assert process.stdout is not None
        line = process.stdout.readline()  # the side effect happened; the result did not
        process.send_signal(signal.SIGKILL)
        process.wait()
        process.stdout.close()
        stderr.seek(0)
        assert line == b"paid\n", stderr.read().decode()[-3000:]

    async def after_the_crash() -> None:
        from aimu import aio
        from aimu.testing.script import Turn
        from aimu.testing.scripted import ScriptedModel

        ran: list[int] = []

        @aio.tool(approval=True)
        def pay(amount: int) -> str:
            """Pay."""
            ran.append(amount)
            return "paid"

        store = where.make()
        model = ScriptedModel([Turn(text="done")])
        agent = aio.Agent(model, tools=[pay], store=store, session="pay")
        await agent.open()
        (pending,) = agent.pending_approvals
        assert pending.tool == "pay" and pending.in_doubt
        with pytest.raises(ValueError, match="wait for a decision"):
            agent.resume()
        state = await store.load_state("pay")  # what another process (serve) reads
        assert [p["in_doubt"] for p in state["approvals"]["pending"]] == [True]
        assert state["approvals"]["decisions"] == {}
        agent.deny(pending.call_id, "it may have been paid already")
        assert await agent.resume() == "done"
        assert ran == []
        results = [m["content"] for m in agent.model_client.messages if m["role"] == "tool"]
        assert results == ["[denied: it may have been paid already]"]
        await agent.aclose()
        await store.aclose()

    asyncio.run(after_the_crash())
    assert effects.read_text() == "paid 5\n"  # once: never run again unknowingly
