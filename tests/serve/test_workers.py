"""``aimu serve --workers N``: N processes on one port behave as one server.

Connections spread over the processes (a tool that reports the pid it ran in shows
more than one), any process answers for any run (each request on a fresh connection, so
the kernel picks the process anew), a dead process is replaced, and SIGTERM stops them
all with a clean exit.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from tests.serve.harness import ROOT, ServeProcess, clean_env, collect, first_text, start
from tests.services import free_port

pytestmark = pytest.mark.slow

RUNS = 16  # connections spread over 2 processes: all on one happens 1 time in 2**15


async def serving_pid() -> str:
    """The pid of the process this tool runs in, and the kind of its event loop."""
    return f"{os.getpid()} on {type(asyncio.get_running_loop()).__module__}"


def script(request: Mapping[str, Any]) -> Turn:
    messages = request.get("messages") or []
    said = next((str(m.get("content")) for m in reversed(messages) if m["role"] == "user"), "")
    if said.startswith("hold"):
        return Turn(text=" ".join(f"w{i}" for i in range(400)), delay=0.05)
    if messages and messages[-1].get("role") == "tool":
        return Turn(text=f"pid {messages[-1].get('content')}")
    return Turn(tool_calls=(ScriptedCall("serving_pid", {}),))


@pytest.fixture(scope="module")
def pid_model() -> Iterator[LoopbackServer]:
    with LoopbackServer.in_thread(script) as server:
        yield server


def children(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == pid:
                found.add(int(entry))
    return found


def listeners(port: int) -> int:
    """How many sockets listen on ``port`` (the kernel's table: a worker counts once it
    listens, not when its process exists or another worker has answered)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows)
                for row in rows:
                    local, state = row.split()[1], row.split()[3]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        count += 1
        except FileNotFoundError:
            continue
    return count


def fresh(url: str) -> httpx.AsyncClient:
    """A client whose every request opens a new connection (the kernel picks anew)."""
    return httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(
        max_keepalive_connections=0))


@pytest.fixture
async def fleet(
    pid_model: LoopbackServer, tmp_path: Path, redis_url: str
) -> AsyncIterator[ServeProcess]:
    """``aimu serve --workers 2`` (harness.aimu_serve's way, with three processes to start
    on a busy machine: a longer wait for the first answer)."""
    port, log = free_port(), tmp_path / "fleet.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "aimu", "serve", "--port", str(port), "--model", "openai:loop",
            "--log-level", "warning", "--workers", "2", "--redis", redis_url, "--redis-prefix",
            f"aimu_test_fleet_{secrets.token_hex(4)}", "--store", str(tmp_path / "s.db"),
            "--tool", "tests.serve.test_workers:serving_pid", cwd=ROOT,
            env=clean_env(OPENAI_BASE_URL=pid_model.openai_base_url, OPENAI_API_KEY="sk-test"),
            stdin=subprocess.DEVNULL, stdout=out, stderr=out,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url) as http:
            for _ in range(1200):  # starting up: not a race with the work under test
                if process.returncode is not None:
                    raise AssertionError(f"aimu serve --workers exited: {log.read_text()}")
                # Both listen (the kernel's table says so: the first one answering
                # /health and printing the banner says nothing of the second).
                if len(children(process.pid)) == 2 and listeners(port) == 2:
                    try:
                        answers = [(await http.get("/health")).status_code for _ in range(4)]
                        if answers == [200] * 4 and "serving" in log.read_text():
                            break
                    except httpx.TransportError:
                        pass
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"aimu serve --workers did not start: {log.read_text()}")
        yield ServeProcess(url, process, log)
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 60)
            except TimeoutError:
                process.kill()
                await process.wait()


async def test_runs_spread_and_any_process_answers_for_any_run(
    fleet: ServeProcess, pid_model: LoopbackServer
) -> None:
    workers = children(fleet.process.pid)
    assert len(workers) == 2, workers
    async with fresh(fleet.url) as http:
        runs = [await start(http, f"s{i}", "which process?") for i in range(RUNS)]
        ends = [(await collect(http, run))[-1] for run in runs]  # followed from any process
        assert all(end.data["status"] == "completed" for end in ends), ends
        replies = [str((await http.get(f"/runs/{run}")).json()["reply"]) for run in runs]
        pids = {int(reply.removeprefix("pid ").split()[0]) for reply in replies}
        assert pids == workers, (replies, workers)  # both served, nobody else did
        # Each process runs on the engine the first one names (auto: uvloop, httptools).
        assert {reply.split(" on ")[1] for reply in replies} == {"uvloop"}, replies
        assert "  server uvicorn, httptools on uvloop\n" in fleet.log.read_text()

        held = [await start(http, f"h{i}", "hold on") for i in range(4)]
        for run in held:
            await first_text(http, run)
        for run in held:  # each stop reaches whichever process holds the run
            answer = await http.post(f"/runs/{run}/cancel")
            assert answer.status_code == 202, answer.text
        for run in held:
            end = (await collect(http, run))[-1]
            assert end.data["status"] == "cancelled", end
            record = (await http.get(f"/runs/{run}")).json()
            assert record["status"] == "cancelled", record
        for i in range(4):
            session = (await http.get(f"/sessions/h{i}")).json()
            kept = session["messages"][-1]
            assert kept["role"] == "assistant" and kept["content"].startswith("w0"), kept
    await pid_model.wait_until(lambda: sum(s.abandoned for s in pid_model.streams) >= 4, 10)


async def test_a_dead_worker_is_replaced_and_sigterm_stops_them_all(
    fleet: ServeProcess,
) -> None:
    workers = children(fleet.process.pid)
    killed = min(workers)
    os.kill(killed, signal.SIGKILL)
    port = int(fleet.url.rsplit(":", 1)[1])
    for _ in range(1200):  # the parent polls its children every 0.1 s; the new one starts
        now = children(fleet.process.pid)
        if len(now) == 2 and killed not in now and listeners(port) == 2:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(f"no worker replaced {killed}: {children(fleet.process.pid)}")
    async with fresh(fleet.url) as http:
        # Both listen: every fresh connection is answered, whichever process it reaches.
        answers = [(await http.get("/health")).status_code for _ in range(8)]
        assert answers == [200] * 8
    fleet.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(fleet.process.wait(), 60) == 0
    assert children(fleet.process.pid) == set()
    assert "exited on signal 9; starting another" in fleet.log.read_text()


@pytest.mark.parametrize(("options", "said"), [
    (["--workers", "2"], "--workers N needs --redis"),
    (["--workers", "0"], "--workers takes a count from 1 to 64; got 0"),
])
def test_bad_workers_options_are_refused(options: list[str], said: str) -> None:
    done = subprocess.run([sys.executable, "-m", "aimu", "serve", "--port", "0", *options],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert said in done.stderr
