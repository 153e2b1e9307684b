"""What budgets cost: the limit check an agent makes each round, and whole runs with and
without limits.

The check is timed in a tight loop against a baseline measured in the same run (a bound
method call that returns None, and the check of a budget without limits, which is what
every agent pays). Whole runs use an in-process scripted model making ten tool rounds, so
the difference is the checks and the counting. Medians of interleaved repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from aimu import aio
from aimu.aio.limits import Budget, Spend
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel

ROUNDS = 10
ALL = aio.UsageLimits(
    requests=10**9, tool_calls=10**9, input_tokens=10**9, output_tokens=10**9,
    total_tokens=10**9, cost=1e9, wall=1e9, prices={"m": aio.ModelPrice(1.0, 2.0)},
)


class _Nothing:
    def check(self) -> None:
        return None


def per_call_ns(check: Callable[[], object], count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        check()
    return (time.perf_counter() - start) / count * 1e9


def tool_rounds(request: Mapping[str, Any]) -> Turn:
    done = sum(1 for m in request["messages"] if m["role"] == "tool")
    if done < ROUNDS:
        return Turn(text="looking", tool_calls=[ScriptedCall("lookup", {"n": done})],
                    input_tokens=100, output_tokens=5)
    return Turn(text="done", input_tokens=100, output_tokens=1)


def lookup(n: int) -> int:
    """Echo."""
    return n


async def run_us(runs: int, limits: aio.UsageLimits | None) -> float:
    agent = aio.Agent(ScriptedModel(tool_rounds, model="m", record=False), tools=[lookup],
                      max_rounds=ROUNDS + 1, limits=limits)
    start = time.perf_counter()
    for _ in range(runs):
        await agent.run("go", reset=True)
    return (time.perf_counter() - start) / runs * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--count", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=200)
    options = parser.parse_args()
    count, repeats = options.count, options.repeats

    nothing = _Nothing().check
    unlimited = Budget(None, None, Spend(), "m")
    run_only = Budget(ALL, None, Spend(), "m")
    both = Budget(ALL, ALL, Spend(), "m")
    cases: dict[str, Callable[[], object]] = {
        "baseline: a method returning None": nothing,
        "no limits (budget.limited, what every run pays)": lambda: unlimited.limited,
        "before_request(), every run limit set": run_only.before_request,
        "before_request(), every run and session limit": both.before_request,
        "before_tools(1), every run and session limit": lambda: both.before_tools(1),
        "streamed(), a chunk against every token limit": lambda: both.streamed(
            {"input_tokens": 0, "output_tokens": 7}
        ),
    }
    figures: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):  # interleaved, so every case sees the same machine
        for name, check in cases.items():
            figures[name].append(per_call_ns(check, count))
    base = statistics.median(figures["baseline: a method returning None"])
    print(f"{'limit check (per call)':52} {'ns':>8} {'minus baseline':>15}")
    for name, values in figures.items():
        median = statistics.median(values)
        print(f"{name:52} {median:8.0f} {median - base:15.0f}")

    runs: dict[str, list[float]] = {"no limits": [], "every limit": []}

    async def measure() -> None:
        await run_us(2, None)  # warm: imports, first-run caches
        await run_us(2, ALL)
        for repeat in range(repeats):  # interleaved, the order alternating
            order = [("no limits", None), ("every limit", ALL)]
            for name, limits in order if repeat % 2 else reversed(order):
                runs[name].append(await run_us(options.runs, limits))

    asyncio.run(measure())
    plain, limited = statistics.median(runs["no limits"]), statistics.median(runs["every limit"])
    print(f"\nwhole run, {ROUNDS} tool rounds ({ROUNDS + 1} requests), scripted model:")
    print(f"  no limits {plain:.1f} µs, every limit {limited:.1f} µs: "
          f"+{limited - plain:.1f} µs a run, +{(limited - plain) / (ROUNDS + 1):.2f} µs a round "
          f"({limited / plain:.3f}x)")


if __name__ == "__main__":
    main()
