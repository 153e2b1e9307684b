"""The served stream's cost per event in each protocol adapter, in instructions.

    python benchmarks/bench_protocol_stream.py [--rounds 20] [--only ag_ui ai_sdk a2a mcp]
    python benchmarks/bench_protocol_stream.py --quick   # a smoke run (CI): no valgrind

A recorded run (the JSON events a follower yields: reasoning, text, tool calls with
progress and results, a retried turn, three steps, the run's end) is translated through
each adapter and every output encoded as the Server-Sent Event it is served as:

- AG-UI and the AI SDK: their stream translators, fed the events one by one, then closed;
- A2A: ``_streamed`` (the JSON-RPC stream responses), on a follower replaying the events
  and a store that holds the task;
- MCP: ``_report`` (the progress notifications), on the same follower.

Each count is ``valgrind --tool=callgrind`` of this script at two lengths (``--rounds``
and a fifth of it); the difference per event removes start-up. Run it on two commits to
compare (deterministic on a loaded host).

Measured (Dec 2026, --rounds 20), before EventStream (6ddb52c) -> with it (ag_ui and
all at the commit with the text fast path; the thinking fast path came after and is
not counted): ag_ui 37,185 -> 36,556; ai_sdk 70,888 ->
34,963; a2a 58,374 -> 61,945; mcp 4,944 -> 8,655 (MCP shows almost nothing, so the
decoding of the events it skips is most of its cost). A text delta alone (the feed, no
encoding): 5,851 -> 4,127. With the thinking fast path (--rounds 10): a2a 61,306,
mcp 8,025: still above their before; not met for those two.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncGenerator, Callable
from types import SimpleNamespace
from typing import Any

from aimu.aio.event_json import event_data
from aimu.aio.events import (
    Event,
    RunFinished,
    StepFinished,
    TextChunk,
    ThinkingChunk,
    ToolCallStarted,
    ToolProgress,
    ToolResult,
    TurnRetried,
)
from aimu.serve import a2a, ag_ui, ai_sdk, mcp_agent
from aimu.serve.stream_runs import sse_data

ADAPTERS = ("ag_ui", "ai_sdk", "a2a", "mcp")


def recorded() -> list[dict[str, Any]]:
    """One run's events as a follower yields them (JSON dicts, in order)."""
    events: list[Event] = []
    events += [ThinkingChunk("agent", f"think {i} ") for i in range(20)]
    events += [TextChunk("agent", f"word{i} ") for i in range(40)]
    events += [ToolCallStarted("agent", "c1", "search", {"q": "aimu", "n": 3}),
               ToolProgress("agent", "c1", "search", 0.5, 1.0, "half"),
               ToolResult("agent", "c1", "search", "found 3", False),
               StepFinished("agent", 1)]
    events += [TextChunk("agent", f"part{i} ") for i in range(10)]
    events += [TurnRetried("agent", "restarted", "", "reset", 1)]
    events += [TextChunk("agent", f"again{i} ") for i in range(60)]
    events += [ToolCallStarted("agent", "c2", "fetch", {"url": "https://x"}),
               ToolResult("agent", "c2", "fetch", "ok", False),
               StepFinished("agent", 2)]
    events += [TextChunk("agent", f"answer{i} ") for i in range(80)]
    events += [StepFinished("agent", 3),
               RunFinished("agent", "completed", "the answer",
                           {"input_tokens": 10, "output_tokens": 20}, stop_reason="stop")]
    return [event_data(event) for event in events]


class _Follower:
    """Replays the recorded events, as a RunFollower would."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self._events = events
        self.end = None
        self.view = SimpleNamespace(run_id="run-1", session="s", messages_from=0)

    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        for event in self._events:
            yield event

    async def aclose(self) -> None:
        return None


class _Store:
    async def load(self, session: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "go"}]


class _Runs:
    store = _Store()

    async def session_run(self, session: str) -> object:
        return SimpleNamespace(messages_from=0)


def _translated(module: Any, old: str, new: str) -> Callable[[list[dict[str, Any]]], int]:
    """Feeds and closes the module's stream translator (its name before and after)."""
    make = getattr(module, new, None) or getattr(module, old)

    def run(events: list[dict[str, Any]]) -> int:
        stream = make("run-1")
        size = 0
        for event in events:
            for out in stream.feed(event):
                size += len(sse_data(out))
        for out in stream.close():
            size += len(sse_data(out))
        return size

    return run


def _a2a(events: list[dict[str, Any]]) -> int:
    async def main() -> int:
        size = 0
        stream = a2a._streamed(_Runs(), 1, "s:0", _Follower(events))  # type: ignore[arg-type]
        async for out in stream:
            size += len(sse_data(out))
        return size

    return asyncio.run(main())


def _mcp(events: list[dict[str, Any]]) -> int:
    sent: list[str] = []

    async def report(done: float, total: float | None, message: str | None) -> None:
        sent.append(sse_data({"progress": done, "message": message}).decode())

    async def main() -> None:
        ctx = SimpleNamespace(report_progress=report)
        await mcp_agent._report(_Follower(events), ctx)  # type: ignore[arg-type]

    asyncio.run(main())
    return sum(map(len, sent))


def runner(adapter: str) -> Callable[[list[dict[str, Any]]], int]:
    if adapter == "ag_ui":
        return _translated(ag_ui, "_Translator", "AgUiStream")
    if adapter == "ai_sdk":
        return _translated(ai_sdk, "_Translator", "AiSdkStream")
    return _a2a if adapter == "a2a" else _mcp


def count(adapter: str, rounds: int) -> int:
    """Instructions of this script translating the run ``rounds`` times under callgrind."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "callgrind.out")
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        subprocess.run(
            ["setarch", os.uname().machine, "-R", "valgrind", "--tool=callgrind",
             f"--callgrind-out-file={out}", sys.executable, __file__, "--one-run",
             str(rounds), "--adapter", adapter],
            check=True, capture_output=True, env=env,
        )
        with open(out) as file:
            for line in file:
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
    raise RuntimeError("callgrind wrote no summary")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--one-run", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--adapter", choices=ADAPTERS, default="ag_ui")
    parser.add_argument("--only", nargs="*", choices=ADAPTERS, default=list(ADAPTERS),
                        help="the adapters to count (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="translate the run once through each adapter, no figures")
    args = parser.parse_args()
    events = recorded()
    if args.quick:
        for adapter in args.only:
            print(f"  {adapter:7} {runner(adapter)(events):8,} bytes served (smoke run)")
        return
    if args.one_run is not None:
        run = runner(args.adapter)
        for _ in range(args.one_run):
            run(events)
        return
    low = max(1, args.rounds // 5)
    print(f"{len(events)} events a run; instructions per event (callgrind, "
          f"{args.rounds} - {low} runs)")
    for adapter in args.only:
        per = (count(adapter, args.rounds) - count(adapter, low)) / (
            (args.rounds - low) * len(events))
        print(f"  {adapter:7} {per:8,.0f}")


if __name__ == "__main__":
    main()
