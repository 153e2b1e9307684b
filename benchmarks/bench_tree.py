"""Agent trees (``agent.as_tool()``): what a nested call costs, and how fast a cancel
closes every level.

    python benchmarks/bench_tree.py [--repeats 15] [--callgrind]
    python benchmarks/bench_tree.py --quick                  # a smoke run (CI)

1. **A nested call over a direct tool call.** One agent, ``rounds`` tool rounds on the
   in-process scripted model; each round calls either

   - ``direct``: a no-op async tool;
   - ``by hand``: a tool that runs another agent itself (``await leaf.start().run(task)``,
     a fresh session a call, no tree machinery);
   - ``nested``: the same agent as ``leaf.as_tool()`` (its session nested under the
     caller's, its events relayed with a path, the caller's budget shared).

   The leaf answers in one turn. Printed: µs per round (medians of interleaved repeats,
   with the load average) and, with ``--callgrind``, instructions per round
   (``valgrind --tool=callgrind``, runs of 150 and 50 rounds, the difference / 100, so
   start-up and imports cancel). ``nested - by hand`` is what the tree machinery adds
   to a call; ``by hand - direct`` is an agent run's own cost.

2. **Cancel to every level closed, depth 3.** root -> mid -> leaf, each on the loopback
   server's OpenAI wire (in a thread of this process: one clock); the leaf streams a
   long reply. After the leaf's first text chunk the root's handle is cancelled; timed:
   until the server sees the leaf's stream go, and until every level's run has ended
   (its ``RunFinished`` reached the handle) and the handle is done. Beside it, the same
   for a single agent (depth 1). p50 and p90 in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from aimu import aio
from aimu.aio.events import Event, RunFinished, TextChunk
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel

KINDS = ("direct", "by hand", "nested")


async def noop(task: str) -> str:
    """Do nothing."""
    return "ok"


def caller_script(rounds: int) -> Any:
    served = 0

    def script(request: Mapping[str, Any]) -> Turn:
        nonlocal served
        served += 1
        if served <= rounds:
            return Turn(text="step", tool_calls=[ScriptedCall("ask", {"task": "look"})])
        return Turn(text="done")

    return script


def caller(kind: str, rounds: int) -> aio.Agent:
    """The agent of one ``kind`` of call: its tool ``ask`` a no-op, a by-hand agent run,
    or an agent as a tool."""
    leaf = aio.Agent(ScriptedModel(lambda request: Turn(text="leaf done"), record=False),
                     name="leaf")

    async def by_hand(task: str) -> str:
        """Ask the leaf."""
        return await leaf.start().run(task)

    tool = {
        "direct": aio.tool(noop, name="ask"),
        "by hand": aio.tool(by_hand, name="ask"),
        "nested": leaf.as_tool(name="ask"),
    }[kind]
    return aio.Agent(ScriptedModel(caller_script(rounds), record=False), [tool],
                     max_rounds=rounds + 5, name="root")


async def one_run(kind: str, rounds: int) -> float:
    agent = caller(kind, rounds)
    started = time.perf_counter()
    reply = await agent.run("go")
    elapsed = time.perf_counter() - started
    assert reply == "done" and agent.last_status == "completed", reply
    return elapsed


async def per_round(rounds: int, repeats: int) -> dict[str, float]:
    """µs per round of each kind: medians of interleaved repeats (a warm-up run first)."""
    samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for kind in KINDS:
        await one_run(kind, 5)
    for _ in range(repeats):
        for kind in KINDS:
            samples[kind].append(await one_run(kind, rounds) / rounds * 1e6)
    return {kind: statistics.median(times) for kind, times in samples.items()}


def count(kind: str, rounds: int) -> int:
    """Instructions of this script doing one run of ``kind`` under callgrind."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "callgrind.out")
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        subprocess.run(
            ["setarch", os.uname().machine, "-R", "valgrind", "--tool=callgrind",
             f"--callgrind-out-file={out}", sys.executable, __file__, "--one-run",
             str(rounds), "--kind", kind],
            check=True, capture_output=True, env=env,
        )
        with open(out) as file:
            for line in file:
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
    raise RuntimeError("callgrind wrote no summary")


def instructions(low: int, high: int) -> dict[str, float]:
    return {kind: (count(kind, high) - count(kind, low)) / (high - low) for kind in KINDS}


# -- cancel to every level closed -----------------------------------------------------------


def tree_script(depth: int) -> Any:
    """The loopback model of a chain of ``depth`` agents: each calls the next (the tool
    it is offered); the last streams a long reply."""
    words = " ".join(f"w{i}" for i in range(400))

    def script(body: Mapping[str, Any]) -> Turn:
        tools = [t["function"]["name"] for t in body.get("tools") or ()]
        if not tools:
            return Turn(text=words, delay=0.001)
        return Turn(tool_calls=[ScriptedCall(tools[0], {"task": "go deeper"})])

    return script


def chain(depth: int, url: str) -> aio.Agent:
    agent: aio.Agent | None = None
    for level in reversed(range(depth)):
        model = aio.client("openai:bench", base_url=url, api_key="sk-bench")
        tools = [] if agent is None else [agent.as_tool()]
        agent = aio.Agent(model, tools, name=f"a{level}")
    assert agent is not None
    return agent


async def cancel_once(top: aio.Agent, server: Any, depth: int) -> tuple[float, float]:
    """(ms until the server saw the deepest stream go, ms until every level ended)."""
    first = asyncio.Event()
    ended: list[float] = []

    def hear(event: Event) -> None:
        if isinstance(event, TextChunk) and len(event.path) == depth - 1:
            first.set()
        elif isinstance(event, RunFinished):
            ended.append(time.monotonic())

    before = len([s for s in server.streams if s.abandoned])
    handle = aio.RunHandle.start(top.start().run("go"))
    handle.add_listener(hear)
    await first.wait()
    cancelling = time.monotonic()
    handle.cancel("bench")
    await handle.wait()
    done = time.monotonic()
    records = await server.wait_abandoned(before + 1)
    assert len(ended) == depth, ended
    closed = max(r.abandoned_at or 0.0 for r in records) - cancelling
    return closed * 1000, (max(done, *ended) - cancelling) * 1000


async def cancel_to_closed(repeats: int) -> dict[int, tuple[list[float], list[float]]]:
    from aimu.testing.server import LoopbackServer

    found: dict[int, tuple[list[float], list[float]]] = {}
    for depth in (1, 3):
        with LoopbackServer.in_thread(tree_script(depth)) as server:
            top = chain(depth, server.openai_base_url)
            closed, levels = [], []
            for _ in range(repeats + 1):
                one, every = await cancel_once(top, server, depth)
                closed.append(one)
                levels.append(every)
            found[depth] = (closed[1:], levels[1:])  # the first opened the pool: left out
            for agent in _agents(top):
                await agent.model_client.aclose()
    return found


def _agents(top: aio.Agent) -> list[aio.Agent]:
    found = [top]
    for tool in top.tools:
        nested = getattr(tool, "agent", None)
        if isinstance(nested, aio.Agent):
            found.extend(_agents(nested))
    return found


def _p(times: list[float], q: float) -> float:
    times = sorted(times)
    return times[min(len(times) - 1, int(len(times) * q))]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--one-run", type=int, metavar="ROUNDS", help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=KINDS, default="nested", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run is not None:
        await one_run(args.kind, args.one_run)
        return
    if args.quick:
        args.repeats, args.rounds = 1, 3
    print(f"load average {os.getloadavg()[0]:.1f}")
    wall = await per_round(args.rounds, args.repeats)
    print(f"\nµs per round, {args.rounds} rounds, median of {args.repeats} interleaved:")
    for kind in KINDS:
        print(f"{kind:<8} {wall[kind]:>9.1f}")
    print(f"nested over by hand: +{wall['nested'] - wall['by hand']:.1f} µs a call")
    if args.callgrind:
        ir = instructions(50, 150)
        print("\ninstructions per round (callgrind, (150 rounds - 50 rounds) / 100):")
        for kind in KINDS:
            print(f"{kind:<8} {ir[kind]:>12,.0f}")
        print(f"nested over by hand: +{ir['nested'] - ir['by hand']:,.0f} "
              f"({ir['nested'] / ir['by hand']:.3f}x); over direct: "
              f"{ir['nested'] / ir['direct']:.2f}x")
    found = await cancel_to_closed(2 if args.quick else args.repeats * 4)
    print("\ncancel after the deepest agent's first text chunk, ms (p50 / p90):")
    print(f"{'depth':<6} {'deepest stream closed':>22} {'every level ended':>20}")
    for depth, (closed, levels) in found.items():
        print(f"{depth:<6} {_p(closed, 0.5):>10.2f} / {_p(closed, 0.9):<9.2f} "
              f"{_p(levels, 0.5):>9.2f} / {_p(levels, 0.9):<9.2f}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    asyncio.run(main())
