"""RedisControl costs: cross-process cancel latency, and what registering adds to a run.

    python benchmarks/bench_control.py [--redis URL] [--workers 4] [--runs 50] [--quick]

- cross-process cancel: ``--workers`` worker processes each keep one streamed agent run
  going against the loopback model server (on a thread of this process); this process,
  the controller, cancels them one at a time with ``control.cancel()`` until each worker
  has had ``--runs`` runs cancelled. Measured from ``cancel()`` to the worker's handle
  being done (the worker stamps ``time.monotonic()``, one clock for every process on
  Linux) and to the model server recording the abandoned stream: p50 and p99, beside
  the same in-process cancel (``handle.cancel()``) of the same runs measured in this run.
  Target: p50 under 5 ms, p99 under 20 ms on loopback.
- registration: trivial runs started with and without ``control=`` (each awaited, then
  everything published: ``control.flush()``), interleaved; the difference per run.
- events: a run of an in-process scripted model emitting 2,000 text chunks, with and
  without ``control=``; the difference per event, published to Redis included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from aimu import aio
from aimu.aio.events import TextChunk
from aimu.testing.script import Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer

ENDLESS = Turn(text=" ".join(f"w{i}" for i in range(5000)), delay=0.01)
PREFIX = f"bench-{os.getpid()}"


async def pop(client: Any, key: str, seconds: float = 60.0) -> str:
    """BLPOP in short blocks (a block longer than the socket timeout would fail)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        popped = await client.blpop([key], timeout=1)
        if popped is not None:
            return str(popped[1])
    raise TimeoutError(f"nothing arrived on {key} within {seconds:g} s")


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def ms(values: list[float]) -> str:
    p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
    return f"p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms"


# -- the worker process ---------------------------------------------------------------------


async def worker_main(url: str, prefix: str, index: int, model_url: str) -> None:
    """Start a streamed run per job from ``PREFIX:jobs:INDEX``; stamp when each is done."""
    global PREFIX
    PREFIX = prefix
    async with aio.RedisControl(url, PREFIX) as control:
        client = control._client
        agent = aio.Agent(aio.client("ollama:m", host=model_url))
        reports: set[asyncio.Future[Any]] = set()
        await client.rpush(f"{PREFIX}:ready", index)
        while True:
            run_id = await pop(client, f"{PREFIX}:jobs:{index}", 3600)
            if run_id == "stop":
                break
            session = agent.start()
            handle = aio.RunHandle.start(session.run("go"), run_id=run_id, control=control)

            def stamp(done: aio.RunHandle[str], run_id: str = run_id) -> None:
                at = time.monotonic()
                report = client.rpush(f"{PREFIX}:done", json.dumps([run_id, at]))
                reports.add(task := asyncio.ensure_future(report))
                task.add_done_callback(reports.discard)

            handle.add_done_callback(stamp)
        await control.flush()
        await agent.aclose()


# -- cross-process cancel ---------------------------------------------------------------------


async def first_chunk(control: aio.RedisControl, run_id: str) -> None:
    async for seen in control.events(run_id):
        if isinstance(seen.event, TextChunk):
            return


def spawn_workers(url: str, workers: int, model_url: str) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                str(i),
                "--redis",
                url,
                "--model",
                model_url,
                "--prefix",
                PREFIX,
            ],
            env=env,
        )
        for i in range(workers)
    ]


async def cross_process(url: str, workers: int, runs: int) -> list[tuple[str, str, str]]:
    with LoopbackServer.in_thread(lambda body: ENDLESS) as server:
        processes = spawn_workers(url, workers, server.url)
        async with aio.RedisControl(url, PREFIX) as control:
            client = control._client
            try:
                for _ in range(workers):
                    dead = [p.args for p in processes if p.poll() is not None]
                    assert not dead, f"a worker process exited: {dead}"
                    await pop(client, f"{PREFIX}:ready")
                serial = 0

                async def launch(worker: int) -> str:
                    nonlocal serial
                    serial += 1
                    run_id = await control.reserve(f"w{worker}-{serial}")
                    await client.rpush(f"{PREFIX}:jobs:{worker}", run_id)
                    await first_chunk(control, run_id)
                    return run_id

                live = [await launch(w) for w in range(workers)]
                to_done: list[float] = []
                to_server: list[float] = []
                for turn in range(workers * runs + workers):  # the first round warms up
                    worker = turn % workers
                    run_id = live[worker]
                    cancelled_at = time.monotonic()
                    await control.cancel(run_id, "benchmark")
                    done_run, done_at = json.loads(await pop(client, f"{PREFIX}:done", 30))
                    assert done_run == run_id
                    records = await server.wait_abandoned(turn + 1, timeout=30)
                    newest = max(r.abandoned_at or 0.0 for r in records)
                    if turn >= workers:
                        to_done.append(done_at - cancelled_at)
                        to_server.append(newest - cancelled_at)
                    live[worker] = await launch(worker)
                for run_id in live:
                    await control.cancel(run_id, "benchmark over")
                    await control.wait(run_id, timeout=30)
            finally:
                for i in range(workers):
                    await client.rpush(f"{PREFIX}:jobs:{i}", "stop")
                for process in processes:
                    await asyncio.to_thread(process.wait, 60)
                keys = [key async for key in client.scan_iter(match=f"{PREFIX}:*")]
                if keys:
                    await client.delete(*keys)
        local_done, local_server = await in_process(server, runs)
    count = f"{workers} workers x {runs} runs"
    return [
        ("control.cancel() -> worker's handle done", ms(to_done), count),
        ("control.cancel() -> server saw the disconnect", ms(to_server), count),
        ("in-process handle.cancel() -> handle done", ms(local_done), f"{runs} runs"),
        ("in-process handle.cancel() -> server saw it", ms(local_server), f"{runs} runs"),
    ]


async def in_process(server: LoopbackServer, runs: int) -> tuple[list[float], list[float]]:
    agent = aio.Agent(aio.client("ollama:m", host=server.url))
    to_done: list[float] = []
    to_server: list[float] = []
    before = len([r for r in server.streams if r.abandoned])
    for n in range(runs + 1):
        session = agent.start()
        handle = aio.RunHandle.start(session.run("go", stream=False))
        async for event in handle.events():
            if isinstance(event, TextChunk):
                break
        cancelled_at = time.monotonic()
        handle.cancel("benchmark")
        try:
            await handle
        except asyncio.CancelledError:
            done_at = time.monotonic()
        records = await server.wait_abandoned(before + n + 1, timeout=30)
        newest = max(r.abandoned_at or 0.0 for r in records)
        if n:
            to_done.append(done_at - cancelled_at)
            to_server.append(newest - cancelled_at)
    await agent.aclose()
    return to_done, to_server


# -- costs per run and per event -----------------------------------------------------------


async def trivial() -> None:
    return None


async def per_run(url: str, runs: int, repeats: int) -> tuple[str, str, str]:
    async with aio.RedisControl(url, PREFIX + "-r") as control:
        bare: list[float] = []
        controlled: list[float] = []
        for repeat in range(repeats):
            for with_control in (False, True) if repeat % 2 else (True, False):
                begin = time.perf_counter()
                for _ in range(runs):
                    if with_control:
                        await aio.RunHandle.start(trivial(), control=control)
                    else:
                        await aio.RunHandle.start(trivial())
                await control.flush()
                (controlled if with_control else bare).append((time.perf_counter() - begin) / runs)
        await _clean(control)
    extra = statistics.median(controlled) - statistics.median(bare)
    return (
        "registering a run (start + await + published)",
        f"+{extra * 1e6:.0f} µs per run",
        f"{statistics.median(bare) * 1e6:.1f} µs without control",
    )


async def per_event(url: str, chunks: int, repeats: int) -> tuple[str, str, str]:
    text = " ".join(f"w{i}" for i in range(chunks))
    async with aio.RedisControl(url, PREFIX + "-e", max_events=chunks * 2) as control:
        bare: list[float] = []
        controlled: list[float] = []
        for repeat in range(repeats):
            for with_control in (False, True) if repeat % 2 else (True, False):
                agent = aio.Agent(ScriptedModel([Turn(text=text)]))
                begin = time.perf_counter()
                if with_control:
                    await aio.RunHandle.start(agent.run("go"), control=control)
                    await control.flush()
                else:
                    await aio.RunHandle.start(agent.run("go"))
                (controlled if with_control else bare).append(
                    (time.perf_counter() - begin) / chunks
                )
        await _clean(control)
    extra = statistics.median(controlled) - statistics.median(bare)
    return (
        f"publishing events ({chunks} text chunks per run)",
        f"+{extra * 1e6:.1f} µs per event",
        f"{statistics.median(bare) * 1e6:.1f} µs per event without control",
    )


async def _clean(control: aio.RedisControl) -> None:
    client = control._client
    keys = [key async for key in client.scan_iter(match=f"{control.prefix}:*")]
    if keys:
        await client.delete(*keys)


async def main(args: argparse.Namespace) -> None:
    runs, repeats, chunks = (3, 2, 100) if args.quick else (args.runs, 7, 2000)
    rows = await cross_process(args.redis, args.workers, runs)
    rows.append(await per_run(args.redis, 100 if args.quick else 500, repeats))
    rows.append(await per_event(args.redis, chunks, repeats))
    print("| measurement | RedisControl | note |\n| --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--redis", default=os.environ.get("AIMU_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few samples")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.worker is not None:
        asyncio.run(worker_main(parsed.redis, parsed.prefix, parsed.worker, parsed.model))
    else:
        asyncio.run(main(parsed))
