"""Runs per second on Temporal: ``aimu worker`` beside a bare Temporal workflow.

    python benchmarks/bench_temporal_throughput.py [--runs 40] [--repeats 5] [--redis URL]
    python benchmarks/bench_temporal_throughput.py --quick     # the smoke run

One Temporal dev server (started here; its history in a SQLite file, or in memory with
``--in-memory``), one loopback model server (the embedded test
model's one-line answers, in this process). Per sample, one worker process on a fresh
task queue, ``--runs`` one-turn runs started at once and waited for; runs per second from
the first start to the last result. The kinds, interleaved (their order rotates each
repeat), medians over the repeats:

- ``bare``: a workflow whose one activity streams the reply over httpx
  (``peers/temporal/bare_worker.py``): the floor any run on Temporal pays;
- ``aimu``: ``aimu worker`` (the store, the run's events, its controls), started with
  ``RunsClient.start`` and awaited with ``RunsClient.wait``;
- ``aimu, no sandbox``: ``aimu worker --no-sandbox`` (the workflow outside Temporal's
  sandbox);
- ``aimu + redis`` (``--redis``): the same with Redis control on the worker and client.

Beside the rate, where the time goes, per run: the CPU each process spent (the worker,
the dev server, this client process; from ``/proc``) and the events in its history (each
workflow task is a round trip through the dev server). On a two-core host the three
processes share the cores, so CPU per run bounds the rate.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from aimu.temporal import RunsClient
from aimu.testing.server import LoopbackServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_temporal import dev_server_process

ROOT = Path(__file__).resolve().parents[1]
BARE = Path(__file__).resolve().parent / "peers" / "temporal" / "bare_worker.py"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its reaped children, in seconds."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / TICKS


def worker_command(kind: str, temporal: str, queue: str, folder: Path,
                   redis: str | None) -> list[str]:
    if kind == "bare":
        return [sys.executable, str(BARE), temporal, queue]
    command = [sys.executable, "-m", "aimu", "worker", "--temporal", temporal,
               "--task-queue", queue, "--store", str(folder / "s.db"), "--model", "ollama:test",
               "--no-tools", "--log-level", "warning"]
    if kind == "aimu, no sandbox":
        command.append("--no-sandbox")
    if kind == "aimu + redis":
        assert redis is not None
        command += ["--redis", redis, "--redis-prefix", f"bench-{queue}"]
    return command


def spawn(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)


async def sample(kind: str, temporal: str, server_pid: int | None, model: LoopbackServer,
                 runs: int, redis: str | None) -> dict[str, float]:
    """One sample of ``kind``: runs/s and, per run, CPU ms of each process and history
    events."""
    queue = f"bench-{secrets.token_hex(4)}"
    folder = Path(tempfile.mkdtemp(prefix="aimu-bench-tput-"))
    env = {**os.environ, "OLLAMA_HOST": model.url, "PYTHONPATH": str(ROOT)}
    log = folder / "worker.log"
    process = spawn(worker_command(kind, temporal, queue, folder, redis), env, log)
    control = None
    try:
        while "taking runs" not in log.read_text(errors="replace"):  # another process's log
            if process.poll() is not None:
                raise SystemExit(f"{kind} worker exited: {log.read_text()[-2000:]}")
            await asyncio.sleep(0.05)
        if kind == "bare":
            client = await Client.connect(temporal)

            async def one(i: int) -> str:
                handle = await client.start_workflow("bare.run", f"hi {i}", id=f"{queue}-{i}",
                                                     task_queue=queue)
                await handle.result()
                return handle.id
        else:
            if kind == "aimu + redis":
                from aimu import aio

                assert redis is not None
                control = aio.RedisControl(redis, f"bench-{queue}")
                await control.connect()
            started_with = await RunsClient.connect(temporal, queue, redis=control)
            client = started_with.client

            async def one(i: int) -> str:
                run_id = await started_with.start(f"s{i}", f"hi {i}")
                await started_with.wait(run_id)
                return run_id

        await asyncio.gather(*(one(-1 - i) for i in range(2)))  # warm: imports, connections
        server = (lambda: cpu_seconds(server_pid)) if server_pid else (lambda: 0.0)
        before = (cpu_seconds(process.pid), server(), time.process_time())
        started = time.perf_counter()
        ids = await asyncio.gather(*(one(i) for i in range(runs)))
        elapsed = time.perf_counter() - started
        after = (cpu_seconds(process.pid), server(), time.process_time())
        history = await client.get_workflow_handle(ids[-1]).fetch_history()
        kinds = collections.Counter(EventType.Name(e.event_type) for e in history.events)
        figures = {
            "runs/s": runs / elapsed,
            "worker CPU ms/run": (after[0] - before[0]) * 1e3 / runs,
            "dev server CPU ms/run": (after[1] - before[1]) * 1e3 / runs,
            "client CPU ms/run": (after[2] - before[2]) * 1e3 / runs,
            "history events/run": len(history.events),
            "workflow tasks/run": kinds["EVENT_TYPE_WORKFLOW_TASK_COMPLETED"],
        }
        if server_pid is None:  # a server of somebody else's: its pid is not known
            del figures["dev server CPU ms/run"]
        return figures
    finally:
        if control is not None:
            await control.aclose()
        process.kill()
        process.wait()
        shutil.rmtree(folder, ignore_errors=True)


async def main(options: argparse.Namespace) -> None:
    runs = 8 if options.quick else options.runs
    repeats = 1 if options.quick else options.repeats
    kinds = ["bare", "aimu", "aimu, no sandbox"] + (["aimu + redis"] if options.redis else [])
    results: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    with dev_server_process(options.temporal, in_memory=options.in_memory) as (
        temporal, server_pid
    ):
        async with LoopbackServer() as model:
            for repeat in range(repeats):
                order = kinds[repeat % len(kinds):] + kinds[:repeat % len(kinds)]
                for kind in order:
                    results[kind].append(await sample(kind, temporal, server_pid, model,
                                                      runs, options.redis))
    print(f"{runs} one-turn runs started at once on one worker; median of {repeats}")
    figures = list(results[kinds[0]][0])
    print("| kind | " + " | ".join(figures) + " |")
    print("| --- |" + " ---: |" * len(figures))
    for kind in kinds:
        medians = [statistics.median(s[f] for s in results[kind]) for f in figures]
        print(f"| {kind} | " + " | ".join(f"{m:.1f}" for m in medians) + " |")
    bare = statistics.median(s["runs/s"] for s in results["bare"])
    for kind in kinds[1:]:
        rate = statistics.median(s["runs/s"] for s in results[kind])
        print(f"{kind}: {rate / bare:.2f}x the bare workflow's rate")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40, help="runs started at once a sample")
    parser.add_argument("--repeats", type=int, default=5, help="samples of each kind")
    parser.add_argument("--redis", default=None, help="Redis URL: also aimu with Redis")
    parser.add_argument("--temporal", default=None,
                        help="a Temporal frontend HOST:PORT (default: start a dev server)")
    parser.add_argument("--in-memory", action="store_true",
                        help="the dev server keeps its history in memory (default: a file)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 8 runs, 1 repeat")
    asyncio.run(main(parser.parse_args()))
