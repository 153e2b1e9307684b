"""Worker processes on a real Temporal dev server: ``aimu worker`` x2 and ``aimu serve
--temporal`` over HTTP; Stop mid-stream, ``kill -9`` of a worker in a tool call and
mid-stream. Slow: processes start, and a dead worker is noticed after a heartbeat timeout."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from aimu import aio
from aimu.aio.journal import IN_DOUBT_RESULT
from aimu.aio.store import SQLiteStore
from aimu.temporal import RunsClient
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from tests.serve.harness import sse_events
from tests.services import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WORDS = " ".join(f"w{i}" for i in range(200))
ENDLESS = " ".join(f"e{i}" for i in range(1500))
#: A process that does not say it is ready within this many seconds has failed to start.
START_SECONDS = 90.0


def scripted() -> Callable[[Mapping[str, Any]], Turn]:
    """The model's script: ``long ...``: a slow reply (~8 s); ``endless ...``: one
    stopped before its end (asked again, by a resume: "resumed"); ``pay``: a call of
    charge, then "paid"."""
    asked: set[str] = set()

    def script(request: Mapping[str, Any]) -> Turn:
        messages = request.get("messages") or []
        said = next((m.get("content") or "" for m in reversed(messages)
                     if m["role"] == "user"), "")
        if said.startswith("pay"):
            if messages[-1]["role"] == "tool":
                return Turn("paid")
            return Turn(tool_calls=(ScriptedCall("charge", {"amount": 5}),))
        if said.startswith("long"):
            return Turn(WORDS, delay=0.04)
        if said.startswith("endless"):  # ~75 s: stopped long before, however loaded
            # A resume asks again (the cut reply's partial is not sent back to the model).
            again = said in asked
            asked.add(said)
            return Turn("resumed") if again else Turn(ENDLESS, delay=0.05)
        return Turn(f"answer to {said}")

    return script


class Processes:
    """The worker and server processes of one test; each killed at the end."""

    def __init__(self, tmp: Path, temporal: str, queue: str, model: LoopbackServer) -> None:
        self.tmp, self.temporal, self.queue = tmp, temporal, queue
        self.store = str(tmp / "sessions.db")
        self.env = {
            **os.environ,
            "OPENAI_BASE_URL": model.openai_base_url,
            "OPENAI_API_KEY": "test-key",
            "AIMU_TEST_CHARGES": str(tmp / "charges"),
            "AIMU_TEST_GATE": str(tmp / "gate"),
            "PYTHONPATH": str(ROOT),
        }
        self.running: list[subprocess.Popen[bytes]] = []

    def _spawn(self, name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.tmp / f"{name}-{len(self.running)}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "aimu", *args], cwd=ROOT, env=self.env,
                stdout=out, stderr=subprocess.STDOUT,
            )
        self.running.append(process)
        return process, log

    async def worker(self, *extra: str) -> subprocess.Popen[bytes]:
        process, log = self._spawn(
            "worker", "worker", "--temporal", self.temporal, "--task-queue", self.queue,
            "--store", self.store, "--model", "openai:test",
            "--tool", "tests.temporal.tools:charge", "--heartbeat", "0.25", *extra,
        )
        await _said(process, log, "taking runs from")
        return process

    async def serve(self) -> str:
        port = free_port()
        process, log = self._spawn(
            "serve", "serve", "--temporal", self.temporal, "--task-queue", self.queue,
            "--store", self.store, "--model", "openai:test", "--no-tools",
            "--port", str(port), "--log-level", "warning",
        )
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient() as client:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(url + "/health")).status_code == 200:
                        return url
                if process.poll() is not None:
                    raise AssertionError(f"aimu serve exited: {log.read_text()[-2000:]}")
                await asyncio.sleep(0.1)

    def kill(self) -> None:
        for process in self.running:
            if process.poll() is None:
                process.kill()
            process.wait()


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


async def _poll(condition: Any, seconds: float = START_SECONDS) -> None:
    """Wait until ``condition()`` holds: another process's file, which sends no event."""
    async with asyncio.timeout(seconds):
        while True:
            if condition():
                return
            await asyncio.sleep(0.02)


async def _said(process: subprocess.Popen[bytes], log: Path, line: str) -> None:
    """Wait until ``process`` wrote ``line`` to its log (it is ready)."""

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"process exited: {_text(log)[-2000:]}")
        return line in _text(log)

    await _poll(ready)


@pytest.fixture
async def model() -> AsyncIterator[LoopbackServer]:
    async with LoopbackServer(scripted()) as server:
        yield server


@pytest.fixture
def processes(
    tmp_path: Path, temporal: str, queue: str, model: LoopbackServer
) -> Iterator[Processes]:
    made = Processes(tmp_path, temporal, queue, model)
    try:
        yield made
    finally:
        made.kill()


async def _worker_of(runs: RunsClient, run_id: str) -> int:
    """The pid of the worker whose activity runs ``run_id`` now (Temporal knows it)."""
    handle = runs.client.get_workflow_handle(run_id)
    while True:
        described = await handle.describe()
        for pending in described.raw_description.pending_activities:
            identity = pending.last_worker_identity
            if pending.state == 2 and identity:  # STARTED
                return int(identity.partition("@")[0])
        await asyncio.sleep(0.05)


async def _restorable(store: Path, session: str) -> list[Any]:
    opened = SQLiteStore(store)
    try:
        messages = await opened.load(session)
    finally:
        await opened.aclose()
    aio.Agent(aio.client("test")).restore(messages)
    return messages


async def test_kill_9_in_a_tool_call_settles_it_by_the_journal_on_the_other_worker(
    processes: Processes, temporal: str, queue: str, tmp_path: Path
) -> None:
    await processes.worker()
    await processes.worker()
    runs = await RunsClient.connect(temporal, queue, heartbeat_timeout=2.0)
    run_id = await runs.start("s1", "pay")
    charges = tmp_path / "charges"
    await _poll(lambda: _text(charges) != "")  # the tool began: its side effect is written
    [pid] = _text(charges).split()
    os.kill(int(pid), signal.SIGKILL)
    (tmp_path / "gate").touch()  # a re-run would now complete: it must not happen
    state = await runs.wait(run_id, timeout=120)
    assert state["status"] == "completed", state
    assert _text(charges).split() == [pid], "the non-idempotent tool ran once"
    messages = await _restorable(tmp_path / "sessions.db", "s1")
    results = [m["content"] for m in messages if m["role"] == "tool"]
    assert results == [IN_DOUBT_RESULT]
    assert [m["content"] for m in messages if m["role"] == "user"] == ["pay"]
    assert messages[-1]["content"] == "paid"


async def test_kill_9_mid_stream_finishes_on_the_other_worker(
    processes: Processes, temporal: str, queue: str, tmp_path: Path, model: LoopbackServer
) -> None:
    await processes.worker()
    await processes.worker()
    runs = await RunsClient.connect(temporal, queue, heartbeat_timeout=2.0)
    run_id = await runs.start("s1", "long story")
    async for _, event in runs.events(run_id):
        if event["type"] == "text":
            break  # mid-stream
    os.kill(await _worker_of(runs, run_id), signal.SIGKILL)
    state = await runs.wait(run_id, timeout=120)
    assert state["status"] == "completed", state
    messages = await _restorable(tmp_path / "sessions.db", "s1")
    assert [m["role"] for m in messages] == ["user", "assistant"]  # nothing lost or doubled
    assert messages[-1]["content"] == WORDS
    assert len(model.streams) == 2  # the cut stream, then the whole one on the other worker


#: Runs the served test hands to the workers, every other one stopped mid-stream.
RUNS = 20


async def test_serve_hands_20_runs_to_two_workers_and_stops_10_mid_stream(
    processes: Processes, tmp_path: Path, model: LoopbackServer
) -> None:
    await processes.worker()
    await processes.worker("--no-sandbox")  # the runs' workflows move between the two
    url = await processes.serve()
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        started = []
        for i in range(RUNS):
            task = f"endless {i}" if i % 2 == 0 else f"short {i}"
            reply = await http.post(f"/sessions/s{i}/runs", json={"task": task})
            assert reply.status_code == 202, reply.text
            started.append(reply.json()["run_id"])

        async def follow(run_id: str, stop: bool) -> str:
            """Follow the run's events; Stop it at its first text if ``stop``."""
            async for event in sse_events(http, f"/runs/{run_id}/events"):
                if stop and event.type == "text":
                    stop = False
                    answer = await http.post(f"/runs/{run_id}/cancel", json={})
                    assert answer.status_code == 202, answer.text
                if event.type == "handle_finished":
                    return str(event.data["status"])
            raise AssertionError(f"run {run_id}: the event stream ended without its end")

        statuses = await asyncio.gather(*(follow(r, i % 2 == 0) for i, r in enumerate(started)))
        assert statuses == ["cancelled", "completed"] * (RUNS // 2)
        await model.wait_abandoned(RUNS // 2, timeout=60)
        for i in range(0, RUNS, 2):
            messages = await _restorable(tmp_path / "sessions.db", f"s{i}")
            assert messages[-1].get("aimu_partial"), messages[-1]
            body = (await http.get(f"/runs/{started[i]}")).json()
            assert body["status"] == "cancelled"
        resumed = await http.post("/sessions/s0/resume", json={})
        assert resumed.status_code == 202, resumed.text
        assert await follow(resumed.json()["run_id"], False) == "completed"
