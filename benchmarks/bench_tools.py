"""What pydantic-typed tool parameters cost, next to the same parameters the compiler builds.

    python benchmarks/bench_tools.py [--repeats 7] [--calls 20000]

Three figures, each beside its baseline measured in the same run, medians of
interleaved repeats:
- import: ``import aimu.aio`` in a fresh interpreter, and the same plus ``import pydantic``
  (what the first pydantic-typed tool adds once per process);
- building a Tool whose parameter is a dataclass vs an equivalent pydantic model;
- one ``invoke()`` of each, async tools (argument validation and conversion included).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Annotated, Any

import pydantic

from aimu.aio.tools import Tool, ToolContext, as_tool, invoke
from aimu.aio.transcript import ToolCall


@dataclasses.dataclass
class PlaceData:
    city: str
    celsius: float
    tags: list[str] = dataclasses.field(default_factory=list)


class PlaceModel(pydantic.BaseModel):
    city: str
    celsius: Annotated[float, pydantic.Field(ge=-90, le=60)]
    tags: list[str] = []


async def with_dataclass(place: PlaceData, days: int = 1) -> str:
    """Report."""
    return place.city


Days = Annotated[int, pydantic.Field(ge=1, le=7)]


async def with_model(place: PlaceModel, days: Days = 1) -> str:
    """Report."""
    return place.city


ARGUMENTS = {"place": {"city": "Oslo", "celsius": -3.5, "tags": ["cold", "dry"]}, "days": 2}


def import_ms(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return (time.perf_counter() - start) * 1e3


def build_us(fn: Callable[..., Any], count: int = 200) -> float:
    start = time.perf_counter()
    for _ in range(count):
        Tool(fn)
    return (time.perf_counter() - start) / count * 1e6


async def invoke_us(tool: Tool, calls: int) -> float:
    call: ToolCall = {
        "id": "c1", "type": "function", "function": {"name": tool.name, "arguments": ARGUMENTS}
    }
    tools = {tool.name: tool}
    ctx = ToolContext(agent="bench", call_id="c1", tool_name=tool.name)
    start = time.perf_counter()
    for _ in range(calls):
        outcome = await invoke(tools, call, ctx)
    assert not outcome.is_error, outcome.content
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20000)
    options = parser.parse_args()

    bare, with_pydantic = [], []
    for _ in range(options.repeats):  # interleaved, so both see the same machine
        bare.append(import_ms("import aimu.aio"))
        with_pydantic.append(import_ms("import aimu.aio, pydantic"))
    base, plus = statistics.median(bare), statistics.median(with_pydantic)
    print(f"import aimu.aio: {base:.0f} ms; with pydantic: {plus:.0f} ms (+{plus - base:.0f} ms)")

    builds: dict[str, list[float]] = {"dataclass": [], "pydantic": []}
    for _ in range(options.repeats):
        builds["dataclass"].append(build_us(with_dataclass))
        builds["pydantic"].append(build_us(with_model))
    dc, pd = (statistics.median(builds[k]) for k in ("dataclass", "pydantic"))
    print(f"Tool(...) build: dataclass {dc:.0f} µs, pydantic model {pd:.0f} µs ({pd / dc:.2f}×)")

    tools = {"dataclass": as_tool(with_dataclass), "pydantic": as_tool(with_model)}
    calls: dict[str, list[float]] = {"dataclass": [], "pydantic": []}

    async def measure() -> None:
        for _ in range(options.repeats):
            for kind, tool in tools.items():
                calls[kind].append(await invoke_us(tool, options.calls))

    asyncio.run(measure())
    dc, pd = (statistics.median(calls[k]) for k in ("dataclass", "pydantic"))
    print(f"invoke(): dataclass {dc:.2f} µs, pydantic model {pd:.2f} µs ({pd / dc:.2f}×)")


if __name__ == "__main__":
    main()
