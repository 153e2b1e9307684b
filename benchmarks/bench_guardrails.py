"""What an input guardrail beside the first turn costs: runs of one streamed answer
(no tool), without guardrails, with a sync one, and with an async one, on the in-process
scripted model.

    python benchmarks/bench_guardrails.py                  # wall, interleaved medians
    python benchmarks/bench_guardrails.py --one-run KIND N # N runs of one kind, for
        # valgrind --tool=callgrind (KIND: none, sync, async)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from aimu import aio
from aimu.testing.script import Turn
from aimu.testing.scripted import ScriptedModel

CHUNKS = 10


def _sync_ok(ctx: Any, text: str) -> None:
    return None


async def _async_ok(ctx: Any, text: str) -> None:
    return None


def _agent(kind: str, runs: int) -> aio.Agent[str]:
    model = ScriptedModel([Turn(text="word " * CHUNKS, chunks=CHUNKS)] * runs, record=False)
    guards = {"none": None, "sync": [_sync_ok], "async": [_async_ok]}[kind]
    return aio.Agent(model, input_guardrails=guards)


async def _runs(kind: str, runs: int) -> float:
    agent = _agent(kind, runs)
    started = time.perf_counter()
    for _ in range(runs):
        await agent.run("hello", reset=True)
    return (time.perf_counter() - started) / runs


async def _table(repeats: int, runs: int) -> None:
    seen: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    for _ in range(repeats):  # interleaved: each repeat measures every kind
        for kind in seen:
            seen[kind].append(await _runs(kind, runs))
    base = statistics.median(seen["none"])
    print("| input guardrails | µs a run | over none |")
    print("| --- | --- | --- |")
    for kind, times in seen.items():
        median = statistics.median(times)
        print(f"| {kind} | {median * 1e6:,.0f} | {(median - base) * 1e6:+,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one-run", nargs=2, metavar=("KIND", "N"))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--runs", type=int, default=300)
    options = parser.parse_args()
    if options.one_run:
        kind, runs = options.one_run[0], int(options.one_run[1])
        asyncio.run(_runs(kind, runs))
        return
    asyncio.run(_table(options.repeats, options.runs))


if __name__ == "__main__":
    main()
