"""Structured output's cost: building a typed agent, validating an answer, and a whole run.

An in-process scripted model answers the same JSON text to a text agent and to an agent
with ``output_type=Weather``, so the difference is the schema in the request and the
validation of the answer. Medians of interleaved repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from aimu import aio
from aimu.aio.output import OutputSpec
from aimu.testing.script import Turn
from aimu.testing.scripted import ScriptedModel

ANSWER = '{"city": "Oslo", "temperature": 3.5, "conditions": ["rain", "wind"]}'


class Weather(BaseModel):
    city: str
    temperature: float
    conditions: list[str]


def answer(request: Mapping[str, Any]) -> Turn:
    return Turn(text=ANSWER, chunks=1)


def build_us(count: int, output_type: Any) -> float:
    model = aio.client("test")
    start = time.perf_counter()
    for _ in range(count):
        aio.Agent(model, output_type=output_type)
    return (time.perf_counter() - start) / count * 1e6


def parse_us(count: int) -> float:
    spec: OutputSpec[Weather] = OutputSpec(Weather, 2)
    start = time.perf_counter()
    for _ in range(count):
        spec.parse(ANSWER)
    return (time.perf_counter() - start) / count * 1e6


async def run_us(runs: int, output_type: Any) -> float:
    agent = aio.Agent(ScriptedModel(answer, record=False), output_type=output_type)
    start = time.perf_counter()
    for _ in range(runs):
        await agent.run("weather in Oslo", reset=True)
    return (time.perf_counter() - start) / runs * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--count", type=int, default=2000)
    options = parser.parse_args()
    count, repeats = options.count, options.repeats

    build_us(1, Weather)  # pydantic imported once, outside the figures
    text = [build_us(count, None) for _ in range(repeats)]
    typed = [build_us(count, Weather) for _ in range(repeats)]
    t, w = statistics.median(text), statistics.median(typed)
    print(f"Agent(...) build: text {t:.1f} µs, output_type=Weather {w:.1f} µs (+{w - t:.1f} µs)")

    parses = [parse_us(count * 5) for _ in range(repeats)]
    print(f"validating one answer (OutputSpec.parse): {statistics.median(parses):.2f} µs")

    runs: dict[str, list[float]] = {"text": [], "typed": []}

    async def measure() -> None:
        for _ in range(repeats):  # interleaved, so both see the same machine
            runs["text"].append(await run_us(count, None))
            runs["typed"].append(await run_us(count, Weather))

    asyncio.run(measure())
    t, w = statistics.median(runs["text"]), statistics.median(runs["typed"])
    print(
        f"agent.run() one turn: text {t:.1f} µs, typed {w:.1f} µs (+{w - t:.1f} µs, {w / t:.2f}×)"
    )


if __name__ == "__main__":
    main()
