"""RunHandle costs, each next to a bare asyncio task measured in the same run.

    python benchmarks/bench_run_handle.py [--quick]   # --quick: a smoke run, no figures

- overhead, in instructions: the same two loops, each counted by
  ``valgrind --tool=callgrind`` (deterministic on a noisy machine) at two loop lengths;
  the difference per iteration removes start-up. Target at most 1.25 (stretch 1.15).
- overhead, wall clock: ``await RunHandle.start(trivial())`` against
  ``await asyncio.create_task(trivial())``, in interleaved batches; the ratio is the
  median of the per-pair ratios.
- cancel latency: a run awaits a streamed reply from the loopback server (httpx, the
  server on its own thread); from ``cancel()`` to the awaiting caller seeing
  ``CancelledError`` (median, p99), against a bare task; and from ``cancel()`` to the
  server recording the abandoned stream. Targets: within 2x of the bare task; server
  median under 1 ms.
- scale: 10,000 handles awaiting a slow in-process stream, all cancelled at once: time
  until every one is done (target under 1 s) and memory per handle (tracemalloc).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import re
import shutil
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from aimu.aio.run_handle import RunHandle
from aimu.testing.script import Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer

Rows = list[tuple[str, str, str, str]]


async def trivial() -> None:
    return None


# -- overhead -------------------------------------------------------------------------------


async def _batch(start: Callable[[Any], Awaitable[None]], size: int) -> float:
    begin = time.perf_counter()
    for _ in range(size):
        await start(trivial())
    return time.perf_counter() - begin


async def overhead(pairs: int, size: int) -> Rows:
    create_task = asyncio.create_task
    start = RunHandle.start
    await _batch(create_task, size)
    await _batch(start, size)
    ratios: list[float] = []
    bare: list[float] = []
    handle: list[float] = []
    for pair in range(pairs):
        if pair % 2:  # alternate the order so drift does not favour either
            b = await _batch(create_task, size)
            h = await _batch(start, size)
        else:
            h = await _batch(start, size)
            b = await _batch(create_task, size)
        bare.append(b / size)
        handle.append(h / size)
        ratios.append(h / b)
    ratio = statistics.median(ratios)
    return [
        (
            "start(trivial()) + await, wall clock",
            f"{statistics.median(handle) * 1e6:.2f} µs",
            f"{statistics.median(bare) * 1e6:.2f} µs",
            f"{ratio:.3f}x",
        )
    ]


_COUNTED_LOOP = """
import asyncio, sys
from aimu.aio.run_handle import RunHandle

async def trivial():
    return None

async def main(start, n):
    for _ in range(200 + n):
        await start(trivial())

use_handle, n = sys.argv[1] == "handle", int(sys.argv[2])
asyncio.run(main(RunHandle.start if use_handle else asyncio.create_task, n))
"""


def _instructions(mode: str, iterations: int) -> int:
    """Instructions callgrind counts for the whole process running ``iterations`` loops."""
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
         sys.executable, "-c", _COUNTED_LOOP, mode, str(iterations)],
        capture_output=True, text=True, check=True,
    )
    found = re.search(r"Collected\s*:\s*([\d,]+)", done.stderr) or re.search(
        r"I\s+refs:\s*([\d,]+)", done.stderr
    )
    if found is None:
        raise RuntimeError(f"no instruction count in callgrind's output:\n{done.stderr}")
    return int(found.group(1).replace(",", ""))


def instructions(short: int, long: int, quick: bool) -> Rows:
    """Instructions per start + await, from the difference of two loop lengths (a smoke
    run: one callgrind run, its whole-process count read, no figure)."""
    if shutil.which("valgrind") is None:
        return [("start(trivial()) + await, instructions", "-", "-", "valgrind not found")]
    if quick:
        count = _instructions("handle", short)
        return [("whole process, instructions (smoke run)", f"{count:,}", "-", "-")]
    jobs = [(mode, n) for mode in ("handle", "bare") for n in (short, long)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: _instructions(*job), jobs), strict=True))
    per = {
        mode: (counts[mode, long] - counts[mode, short]) / (long - short)
        for mode in ("handle", "bare")
    }
    ratio = per["handle"] / per["bare"]
    verdict = "met" if ratio <= 1.25 else "missed"
    return [
        (
            "start(trivial()) + await, instructions",
            f"{per['handle']:,.0f}",
            f"{per['bare']:,.0f}",
            f"{ratio:.3f}x (target ≤ 1.25: {verdict}; stretch ≤ 1.15)",
        )
    ]


# -- cancel latency -------------------------------------------------------------------------


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


async def _streamed_reply(client: httpx.AsyncClient, url: str, first: asyncio.Event) -> None:
    body = {"model": "test", "messages": [{"role": "user", "content": "go"}], "stream": True}
    async with client.stream("POST", url + "/api/chat", json=body) as response:
        async for _ in response.aiter_lines():
            first.set()


async def _one_cancel(
    client: httpx.AsyncClient, url: str, use_handle: bool
) -> tuple[float, float]:
    """Seconds from cancel() to CancelledError in the caller, and cancel() as monotonic."""
    first = asyncio.Event()
    run = _streamed_reply(client, url, first)
    if use_handle:
        handle = RunHandle.start(run)
        await first.wait()
        cancelled_at = time.monotonic()
        begin = time.perf_counter()
        handle.cancel("benchmark")
        try:
            await handle
        except asyncio.CancelledError:
            elapsed = time.perf_counter() - begin
        else:
            raise AssertionError("the handle was not cancelled")
    else:
        task = asyncio.ensure_future(run)
        await first.wait()
        cancelled_at = time.monotonic()
        begin = time.perf_counter()
        task.cancel("benchmark")
        try:
            await task
        except asyncio.CancelledError:
            elapsed = time.perf_counter() - begin
        else:
            raise AssertionError("the task was not cancelled")
    return elapsed, cancelled_at


async def cancel_latency(samples: int) -> Rows:
    words = " ".join(f"w{i}" for i in range(400))
    with LoopbackServer.in_thread([Turn(text=words, delay=0.005)] * (2 * samples + 4)) as server:
        caller: dict[bool, list[float]] = {True: [], False: []}
        disconnect: dict[bool, list[float]] = {True: [], False: []}
        async with httpx.AsyncClient(timeout=10) as client:
            for warm in (True, False):
                await _one_cancel(client, server.url, warm)
            await server.wait_abandoned(2, timeout=10)
            for sample in range(2 * samples):
                use_handle = sample % 2 == 0
                elapsed, cancelled_at = await _one_cancel(client, server.url, use_handle)
                (record,) = await _last_abandoned(server, sample + 3)
                assert record.abandoned_at is not None
                caller[use_handle].append(elapsed)
                disconnect[use_handle].append(record.abandoned_at - cancelled_at)
    rows: Rows = []
    for label, data, target in (
        ("cancel() → caller sees CancelledError", caller, "median within 2x"),
        ("cancel() → server records abandoned", disconnect, "median < 1 ms"),
    ):
        ours, bare = data[True], data[False]
        rows.append(
            (
                label,
                f"median {statistics.median(ours) * 1e3:.3f} ms, "
                f"p99 {_percentile(ours, 0.99) * 1e3:.3f} ms",
                f"median {statistics.median(bare) * 1e3:.3f} ms, "
                f"p99 {_percentile(bare, 0.99) * 1e3:.3f} ms",
                f"{statistics.median(ours) / statistics.median(bare):.2f}x ({target})",
            )
        )
    return rows


async def _last_abandoned(server: LoopbackServer, count: int) -> list[Any]:
    records = await server.wait_abandoned(count, timeout=10)
    return [records[-1]]


# -- scale ----------------------------------------------------------------------------------


def _slow_model() -> ScriptedModel:
    slow = Turn(text="slow " * 50, delay=60)  # the first chunk at once, then a long wait
    return ScriptedModel(lambda _request: slow, record=False)


async def _await_stream(model: ScriptedModel) -> None:
    async for _ in model.stream_turn([{"role": "user", "content": "go"}]):
        pass


async def _start_all(count: int, use_handle: bool) -> list[Any]:
    model = _slow_model()
    start: Callable[[Any], Any] = RunHandle.start if use_handle else asyncio.ensure_future
    runs = [start(_await_stream(model)) for _ in range(count)]
    for _ in range(3):  # every run reaches the stream's slow await
        await asyncio.sleep(0)
    return runs


async def _cancel_all(runs: list[Any]) -> float:
    """Cancel every run; seconds until each one has finished (its done callback ran)."""
    all_done = asyncio.Event()
    left = len(runs)

    def one_done(_: object) -> None:
        nonlocal left
        left -= 1
        if not left:
            all_done.set()

    for run in runs:
        run.add_done_callback(one_done)
    begin = time.perf_counter()
    for run in runs:
        run.cancel()
    await all_done.wait()
    elapsed = time.perf_counter() - begin
    for run in runs:  # every one raises CancelledError to its caller
        try:
            await run
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("a run was not cancelled")
    return elapsed


async def _memory_per_run(count: int, use_handle: bool) -> float:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    runs = await _start_all(count, use_handle)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    size = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    await _cancel_all(runs)
    return size / count


async def scale(count: int, repeats: int) -> Rows:
    times: dict[bool, list[float]] = {True: [], False: []}
    for repeat in range(repeats):
        for use_handle in (True, False) if repeat % 2 == 0 else (False, True):
            runs = await _start_all(count, use_handle)
            times[use_handle].append(await _cancel_all(runs))
            del runs
            gc.collect()
    memory = {flag: await _memory_per_run(count, flag) for flag in (True, False)}
    ours, bare = statistics.median(times[True]), statistics.median(times[False])
    return [
        (
            f"{count:,} awaiting a stream, all cancelled",
            f"{ours * 1e3:.1f} ms",
            f"{bare * 1e3:.1f} ms",
            f"{ours / bare:.2f}x (target < 1 s)",
        ),
        (
            "memory per run (tracemalloc)",
            f"{memory[True]:,.0f} B",
            f"{memory[False]:,.0f} B",
            f"+{memory[True] - memory[False]:,.0f} B per handle",
        ),
    ]


# -- table ----------------------------------------------------------------------------------


def print_table(rows: Rows) -> None:
    header = ("measurement", "RunHandle", "bare task", "ratio")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    line = "  ".join("-" * w for w in widths)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print(line)
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


async def main(quick: bool) -> None:
    rows: Rows = []
    rows += await asyncio.to_thread(instructions, 500, 3000, quick)
    rows += await overhead(pairs=3 if quick else 101, size=100 if quick else 2000)
    rows += await cancel_latency(samples=5 if quick else 200)
    rows += await scale(count=100 if quick else 10_000, repeats=1 if quick else 5)
    print(f"Python {sys.version.split()[0]}, {sys.platform}")
    print_table(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    asyncio.run(main(parser.parse_args().quick))
