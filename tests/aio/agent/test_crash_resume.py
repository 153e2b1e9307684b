"""Crash loop: kill -9 an agent run at every kind of moment, resume it in a new process,
lose nothing.

A child process runs an agent with tool rounds on a stored session, against the
loopback server (OpenAI protocol with SQLiteStore and PostgresStore, Ollama with
JSONLStore), and prints one acknowledgement line when its store is open and one per
recorded message (from the run's events, which come after the message is recorded).
The test SIGKILLs it at each distinct point in turn (during start-up and loading of a
fresh and of an interrupted session, as a resumed run settles, mid-stream, mid-tool,
right after a result, between tasks), starting a new child on the same session each
time; that child resumes the interrupted run or starts the next task.
``AIMU_CRASH_KILLS=50`` adds 50 kills at seeded random moments after those.
After every kill the stored transcript must validate and hold every acknowledged message;
at the end it holds each task once, each step once, and every final answer.
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
import warnings
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.transcript import CANCELLED_RESULT, Message, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from tests.aio.store.store_backends import KINDS, SOAK_KILLS, Backend, backend, conversation

ROOT = Path(__file__).resolve().parents[3]
TASKS = 3
ROUNDS = 20 + SOAK_KILLS  # steps per task: work enough that no kill finds it all done
SESSION = "crash"

# Where each kill lands, in an order that makes every point happen: ("start-up", _) kills
# at a seeded moment from the child's start (imports, opening and loading the store,
# settling); (kind, n) kills right after the child's n-th acknowledgement of that kind.
LANDINGS: list[tuple[str, int]] = [
    ("start-up", 1),  # a fresh, empty session
    ("user", 1),  # task 0 recorded, its first reply streaming
    ("call", 1),  # a tool call recorded, the tool running
    ("opened", 1),  # an interrupted session loaded: the resumed run settles and goes on
    ("start-up", 1),  # an interrupted session, during start-up and loading
    ("call", 2),  # a resumed run, mid-tool
    ("result", 1),  # a result recorded, the next reply streaming
    ("result", 5),
    ("finished", 1),  # between tasks: an answer recorded, the next task starting
    ("start-up", 1),
    ("call", 3),
    ("result", 2),
]

CHILD = """
import asyncio, json, sys
from aimu import aio
from aimu.aio.agent import Agent
from aimu.aio.client import client
from aimu.aio.events import RunFinished, RunStarted, ToolCallStarted, ToolResult

SPEC, PROTOCOL, URL = sys.argv[1:4]
TASKS, ROUNDS = int(sys.argv[4]), int(sys.argv[5])


def ack(*fields):
    print(json.dumps(fields), flush=True)


async def step(task: str, n: int) -> str:
    "Do one step of a task."
    await asyncio.sleep(0.002)
    return f"{task} step {n} done"


async def consume(events):
    async for event in events:
        if isinstance(event, RunStarted) and event.task is not None:
            ack("user", event.task)
        elif isinstance(event, ToolCallStarted):
            ack("call", event.call_id)
        elif isinstance(event, ToolResult):
            ack("result", event.call_id, event.content)
        elif isinstance(event, RunFinished):
            ack("finished", event.status, event.reply)


async def main():
    store = eval(SPEC, {"aio": aio})
    if PROTOCOL == "openai":
        model = client("openai:crash", base_url=URL, api_key="unused")
    else:
        model = client("ollama:crash", host=URL)
    try:
        agent = Agent(model, tools=[step], max_rounds=ROUNDS + 5, store=store, session="crash")
        async with agent:
            messages = agent.model_client.messages
            ack("opened", len(messages))
            tasks = [m["content"] for m in messages if m["role"] == "user"]
            last = messages[-1] if messages else {}
            answered = last.get("role") == "assistant" and not last.get("tool_calls")
            if tasks and not answered:
                await consume(agent.resume(stream=True))
            for index in range(len(tasks), TASKS):
                await consume(agent.run(f"task {index}", stream=True))
    finally:
        await store.aclose()
    ack("all done")


asyncio.run(main())
"""


def model_turn(request: Mapping[str, Any]) -> Turn:
    """The loopback server's model: a function of the transcript, so a resumed run
    picks up at the right step (a step settled as cancelled counts as done)."""
    messages = request["messages"]
    start = max(i for i, m in enumerate(messages) if m["role"] == "user")
    task = messages[start]["content"]
    done = sum(1 for m in messages[start:] if m["role"] == "tool")
    if done < ROUNDS:
        call = ScriptedCall("step", {"task": task, "n": done}, id=f"call_{len(messages)}")
        return Turn(text=f"{task}: step {done}", tool_calls=(call,), delay=0.0005)
    return Turn(text=f"{task} finished after {ROUNDS} steps", chunks=3, delay=0.0005)


class Child:
    """A child run whose acknowledgement lines are read without ever blocking for long."""

    def __init__(
        self, where: Backend, scratch: Path, protocol: str, url: str,
        program: str = CHILD, args: tuple[str, ...] = (str(TASKS), str(ROUNDS)),
    ) -> None:
        self._stderr = (scratch / "child-stderr.txt").open("w+b")
        self.process = subprocess.Popen(
            [sys.executable, "-c", program, where.spec, protocol, url, *args],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            cwd=ROOT,
        )
        assert self.process.stdout is not None
        self._fd = self.process.stdout.fileno()
        self._buffer = b""
        self.lines: list[list[Any]] = []
        self.eof = False

    def _read(self, timeout: float) -> None:
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if not ready:
            return
        data = os.read(self._fd, 65536)
        if not data:
            self.eof = True
            return
        self._buffer += data
        *complete, self._buffer = self._buffer.split(b"\n")
        self.lines.extend(json.loads(line) for line in complete)

    def wait_for_lines(self, count: int, kind: str | None = None, timeout: float = 30.0) -> None:
        """Until it printed ``count`` lines (of ``kind`` if given), or ended."""
        deadline = time.monotonic() + timeout
        while not self.eof:
            seen = [line for line in self.lines if kind is None or line[0] == kind]
            if len(seen) >= count:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the child printed {len(seen)} of {count} {kind} lines")
            self._read(0.5)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.finish()

    def finish(self, timeout: float = 60.0) -> None:
        """Read everything it printed (each complete line is an acknowledgement), reap it."""
        deadline = time.monotonic() + timeout
        while not self.eof:
            if time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError("the child did not finish in time")
            self._read(0.5)
        self.process.wait()
        assert self.process.stdout is not None
        self.process.stdout.close()
        self._stderr.seek(0)
        self.stderr = self._stderr.read().decode(errors="replace")
        self._stderr.close()


def _check_acknowledged(transcript: list[Message], acks: list[list[Any]]) -> None:
    """Every acknowledged message is in the transcript, exactly as acknowledged."""
    users = {m["content"] for m in transcript if m["role"] == "user"}
    calls = {
        call["id"]
        for m in transcript
        if m["role"] == "assistant"
        for call in m.get("tool_calls", ())
    }
    results = {
        m["tool_call_id"]: m["content"]
        for m in transcript
        if m["role"] == "tool"
    }
    answers = {
        m["content"]
        for m in transcript
        if m["role"] == "assistant" and not m.get("tool_calls")
    }
    for ack in acks:
        kind = ack[0]
        if kind == "user":
            assert ack[1] in users, f"acknowledged task {ack[1]!r} was lost"
        elif kind == "call":
            assert ack[1] in calls, f"acknowledged tool call {ack[1]!r} was lost"
        elif kind == "result":
            assert results.get(ack[1]) == ack[2], f"acknowledged result of {ack[1]!r} was lost"
        elif kind == "finished":
            assert ack[1] == "completed", ack
            assert ack[2] in answers, f"acknowledged answer {ack[2]!r} was lost"
        else:
            assert kind in ("opened", "all done"), ack


def _load(where: Backend) -> tuple[list[Message], int, Any]:
    """The stored transcript, how many torn-record warnings loading it gave, its info."""

    async def read() -> tuple[list[Message], Any]:
        store = where.make()
        try:
            return await store.load(SESSION), await store.info(SESSION)
        finally:
            await store.aclose()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        transcript, info = asyncio.run(read())
    torn = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(torn) == len(caught), [str(w.message) for w in caught]
    return transcript, len(torn), info


def _check_final(transcript: list[Message]) -> None:
    validate(transcript)
    users = [m["content"] for m in transcript if m["role"] == "user"]
    assert users == [f"task {i}" for i in range(TASKS)], "each task exactly once, in order"
    call_ids = [
        call["id"]
        for m in transcript
        if m["role"] == "assistant"
        for call in m.get("tool_calls", ())
    ]
    assert len(call_ids) == len(set(call_ids)) == TASKS * ROUNDS, "no step duplicated"
    result_ids = [m["tool_call_id"] for m in transcript if m["role"] == "tool"]
    assert sorted(result_ids) == sorted(call_ids), "every call answered exactly once"
    task_starts = [i for i, m in enumerate(transcript) if m["role"] == "user"]
    for index, start in enumerate(task_starts):
        end = task_starts[index + 1] if index + 1 < len(task_starts) else len(transcript)
        turns = [m for m in transcript[start:end] if m["role"] == "assistant"]
        steps = [turn["tool_calls"][0]["function"]["arguments"]["n"] for turn in turns[:-1]]
        assert steps == list(range(ROUNDS)), f"task {index}: each step once, in order"
        assert "tool_calls" not in turns[-1]
        assert turns[-1]["content"] == f"task {index} finished after {ROUNDS} steps"
        assert transcript[end - 1] is turns[-1], f"task {index} ends with its answer"


def _ended_mid_run(transcript: list[Message]) -> bool:
    if not transcript:
        return False
    last = transcript[-1]
    return last["role"] != "assistant" or "tool_calls" in last


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def server(kind: str) -> Iterator[tuple[str, str]]:
    """The loopback server, and how a child reaches it (OpenAI for SQLite, Ollama for JSONL)."""
    with LoopbackServer.in_thread(model_turn) as running:
        if kind != "jsonl":
            yield "openai", running.openai_base_url
        else:
            yield "ollama", running.url


@pytest.fixture
async def where(kind: str, tmp_path: Path) -> AsyncIterator[Backend]:
    async with backend(kind, tmp_path) as location:
        yield location


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume_loses_nothing(
    kind: str, where: Backend, tmp_path: Path, server: tuple[str, str]
) -> None:
    protocol, url = server
    rng = random.Random(f"crash-resume-{kind}")
    landings = LANDINGS + [
        ("start-up", 1) if rng.random() < 0.25 else ("any", rng.randint(1, 4))
        for _ in range(SOAK_KILLS)
    ]
    acks: list[list[Any]] = []
    mid_run_kills = 0
    torn_records = 0
    for point, count in landings:
        child = Child(where, tmp_path, protocol, url)
        try:
            if point == "start-up":
                # Anywhere from start-up through loading, settling and the first steps.
                time.sleep(rng.uniform(0.0, 0.3))
            else:
                child.wait_for_lines(count, None if point == "any" else point)
                time.sleep(rng.uniform(0.0, 0.004))
            if child.eof:
                child.finish()
                raise AssertionError(
                    f"the child ended before it was killed (exit {child.process.returncode}): "
                    f"{child.stderr[-3000:] or 'the work ran out; make it longer'}"
                )
            child.kill()
        finally:
            if child.process.poll() is None:
                child.process.kill()
                child.finish()
        assert child.process.returncode == -signal.SIGKILL
        acks.extend(child.lines)
        transcript, torn, _ = _load(where)
        torn_records += torn
        validate(transcript)  # dangling calls are allowed here; the next load settles them
        _check_acknowledged(transcript, acks)
        if _ended_mid_run(transcript):
            mid_run_kills += 1

    final = Child(where, tmp_path, protocol, url)
    final.finish()
    assert final.process.returncode == 0, final.stderr[-3000:]
    assert final.lines[-1] == ["all done"]
    finished = [line for line in final.lines if line[0] == "finished"]
    last_answer = f"task {TASKS - 1} finished after {ROUNDS} steps"
    assert finished[-1] == ["finished", "completed", last_answer]
    acks.extend(final.lines)

    transcript, _, info = _load(where)
    _check_final(transcript)
    _check_acknowledged(transcript, acks)
    assert info is not None
    assert (info.status, info.message_count) == ("completed", len(transcript))
    # The kills landed mid-run (not only between tasks), so resume and settle were exercised.
    assert mid_run_kills >= len(landings) // 2, mid_run_kills
    settled = sum(1 for m in transcript if m["role"] == "tool" and m["content"] == CANCELLED_RESULT)
    print(f"{kind}: {mid_run_kills} kills mid-run, {settled} steps settled as cancelled, "
          f"{torn_records} torn records seen, {len(acks)} acknowledgements")


RESTORE_CHILD = """
import asyncio, json, sys
from aimu import aio
from tests.aio.store.store_backends import conversation

async def main():
    store = eval(sys.argv[1], {"aio": aio})
    agent = aio.Agent(aio.client("test"), system="be brief", store=store, session="crash")
    restoring = agent.restore(conversation(2))
    if restoring is not None:
        await restoring
    print(json.dumps(["restored"]), flush=True)
    await asyncio.sleep(3600)  # killed here: nothing may still be only in memory

asyncio.run(main())
"""


def test_restore_is_durable_when_it_returns_a_kill_9_then_loses_nothing(
    kind: str, where: Backend, tmp_path: Path
) -> None:
    """Issue 21 item 3: restore() with a store wrote only memory until the next write."""
    with (tmp_path / "child-stderr.txt").open("w+b") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", RESTORE_CHILD, where.spec],
            stdout=subprocess.PIPE, stderr=stderr, cwd=ROOT,
        )
        assert process.stdout is not None
        line = process.stdout.readline()  # blocks until the child says so, or ends
        process.send_signal(signal.SIGKILL)
        process.wait()
        process.stdout.close()
        stderr.seek(0)
        assert json.loads(line or "null") == ["restored"], stderr.read().decode()[-3000:]
    transcript, _, _ = _load(where)
    assert transcript == conversation(2)


BUDGET_CHILD = """
import asyncio, json, sys
from aimu import aio
from aimu.aio.events import RunFinished, TextChunk

SPEC, PROTOCOL, URL, LIMIT, MOST = sys.argv[1:6]


def ack(*fields):
    print(json.dumps(fields), flush=True)


async def main():
    store = eval(SPEC, {"aio": aio})
    model = aio.client("openai:budget", base_url=URL, api_key="unused")
    limits = aio.UsageLimits(**{LIMIT: int(MOST)})
    try:
        async with aio.Agent(model, store=store, session="budget", session_limits=limits) as agent:
            async for event in agent.run("tell me a story", stream=True):
                if isinstance(event, TextChunk):
                    ack("text")
                elif isinstance(event, RunFinished):
                    ack("finished", event.status, event.stop_reason)
    finally:
        await store.aclose()


asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "limit", "most"),
    [("sqlite", "requests", 3), ("jsonl", "total_tokens", 40), ("postgres", "requests", 3)],
    indirect=["kind"],
)
def test_a_kill_9_loop_cannot_escape_a_session_budget(
    kind: str, limit: str, most: int, where: Backend, tmp_path: Path
) -> None:
    """Issue 29 item 3 (issue 34 item 2): with ``session_limits`` and a store, kill -9 the
    process while a reply streams, again and again: the spend is stored before each
    request is sent (its tokens estimated), so the kills end once the budget is spent
    and the next run is refused; before, each run counted nothing and all seven ran."""
    streams = Turn(text="once upon a time", fault="hang", fault_after=1)  # then silence
    with LoopbackServer.in_thread(lambda request: streams) as server:
        kills = 0
        outcomes: list[list[Any]] = []
        for _ in range(7):
            child = Child(where, tmp_path, "openai", server.openai_base_url,
                          BUDGET_CHILD, (limit, str(most)))
            try:
                child.wait_for_lines(1)  # a reply streams, or the run was refused
                if child.lines[0] == ["text"]:
                    child.kill()
                    kills += 1
                    continue
                child.finish()
                assert child.process.returncode == 0, child.stderr[-3000:]
                outcomes.append(child.lines[0])
                break  # refused: so is every later run (the spend only grows)
            finally:
                if child.process.poll() is None:
                    child.process.kill()
                    child.finish()
        chats = [r for r in server.requests if r.path.endswith("/chat/completions")]

    assert outcomes == [["finished", "limited", f"limit:{limit}"]]
    assert kills == len(chats) < 7
    if limit == "requests":
        assert kills == most  # the fourth run and every later one: refused before sending

    async def stored() -> tuple[dict[str, Any], list[Any]]:
        store = where.make()
        try:
            state = await store.load_state("budget")
            return dict(state["spend"]), await store.runs(session="budget")
        finally:
            await store.aclose()

    spend, runs = asyncio.run(stored())
    assert spend["requests"] == kills
    # Each killed run's record holds its request, counted before it was sent; it says
    # running (its process died), or limited when a token limit cut the reply first.
    sent = [r for r in runs if r.spend is not None and r.spend["requests"] == 1]
    assert len(sent) == kills, [(r.status, r.spend) for r in runs]
    assert all(r.status in ("running", "limited") for r in sent)
    assert spend["input_tokens"] > 0  # estimated before each request was sent
    if limit == "total_tokens":
        assert spend["input_tokens"] + spend["output_tokens"] >= most


SEND_CHILD = """
import asyncio, json, sys
from aimu import aio
from aimu.aio.events import TextChunk

SPEC, PROTOCOL, URL = sys.argv[1:4]


async def main():
    store = eval(SPEC, {"aio": aio})
    model = aio.client("openai:send", base_url=URL, api_key="unused")
    async with aio.Agent(model, store=store, session="sent") as agent:
        async for event in agent.run("tell me a story", stream=True):
            if isinstance(event, TextChunk):  # the reply streams: no step boundary yet
                print(json.dumps(["sent", await agent.asend("only the short version")]),
                      flush=True)
                await asyncio.sleep(3600)  # killed here, before the run's next boundary


asyncio.run(main())
"""


def test_a_send_kept_before_it_returns_survives_a_kill_9_and_joins_once(
    kind: str, where: Backend, tmp_path: Path
) -> None:
    """Issue 42 item 3: ``await agent.asend(text)`` returned True, then kill -9 while the
    reply streams (before the run's next step boundary): the resumed session joins the
    text exactly once (``send()`` kept it in memory only, so a kill lost it)."""
    streams = Turn(text="once upon a time", fault="hang", fault_after=1)  # then silence
    with LoopbackServer.in_thread(lambda request: streams) as server:
        child = Child(where, tmp_path, "openai", server.openai_base_url, SEND_CHILD, ())
        try:
            child.wait_for_lines(1)
        finally:
            child.kill()
        assert child.lines == [["sent", True]], child.stderr[-3000:]

    async def resume(times: int) -> list[Message]:
        store = where.make()
        try:
            for _ in range(times):  # a second resume finds nothing pending any more
                async with aio.Agent(aio.client("test"), store=store, session="sent") as agent:
                    await agent.resume()
            assert await store.inputs("sent") == []
            return await store.load("sent")
        finally:
            await store.aclose()

    transcript = asyncio.run(resume(2))
    users = [m["content"] for m in transcript if m["role"] == "user"]
    assert users == ["tell me a story", "only the short version"]
    assert transcript[-1]["role"] == "assistant"
