"""Agent loop overhead, flatness over long runs, and memory per concurrent session.

    python benchmarks/bench_agent.py [--repeats 7]
    valgrind --tool=callgrind --callgrind-out-file=/dev/null \
        python benchmarks/bench_agent.py --one-run 300    # and 100: instructions per round
        python benchmarks/bench_agent.py --one-run 300 --limits every   # the same, limited
        python benchmarks/bench_agent.py --one-run 300 --bare   # the bare loop's (the floor)
        python benchmarks/bench_agent.py --one-run 300 --bare-stream   # the bare stream's
    python benchmarks/bench_agent.py --bytecodes   # Python bytecodes a round, each loop

The loop's own cost is the time per round of ``Agent.run`` minus the time per round of
a bare hand-written loop driving the same in-process scripted model and the same
no-op async tool, measured in the same process; medians over repeats. The bare stream
is that loop as one async generator yielding the events a round of ``Agent.run``
streams (two ``TextChunk``, ``ToolCallStarted``, ``ToolResult``, ``StepFinished``, made
as aimu makes them): what streaming a run's events costs at the least, the part of the
overhead no stoppable streaming loop can do without.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import statistics
import sys
import time
import tracemalloc
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from types import FrameType
from typing import Any

from aimu import aio
from aimu.aio.client import TextDelta, TurnAssembler
from aimu.aio.events import Event, StepFinished, TextChunk, ToolCallStarted, ToolResult
from aimu.aio.tools import Tool, ToolContext, as_tool, invoke
from aimu.aio.transcript import Message, ToolMessage, ToolSpec, copy_messages
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel


async def noop(n: int) -> str:
    """Do nothing."""
    return "ok"


CALL = Turn(text="step", tool_calls=[ScriptedCall("noop", {"n": 1})])
ANSWER = Turn(text="done")


def script_for(rounds: int) -> Any:
    served = 0

    def script(request: Mapping[str, Any]) -> Turn:
        nonlocal served
        served += 1
        return CALL if served <= rounds else ANSWER

    return script


def bare_parts(
    rounds: int,
) -> tuple[ScriptedModel, dict[str, Tool], tuple[ToolSpec, ...], list[Message]]:
    """What the bare loops drive: the model, the tool (by name, and its spec), the task."""
    tool = as_tool(noop)
    messages: list[Message] = [{"role": "user", "content": "go"}]
    return ScriptedModel(script_for(rounds), record=False), {tool.name: tool}, (tool.spec,), \
        messages


async def bare_loop(rounds: int) -> float:
    """The same model and tool, driven by the least code that records a transcript."""
    model, tools, specs, messages = bare_parts(rounds)
    start = time.perf_counter()
    while True:
        assembler = TurnAssembler()
        async for chunk in model.stream_turn(messages, specs):
            assembler.add(chunk)
        message = assembler.message()
        messages.append(message)
        calls = message.get("tool_calls")
        if not calls:
            break
        for call in calls:
            outcome = await invoke(tools, call, ToolContext(
                agent="bare", call_id=call["id"], tool_name="noop",
                interrupt_probe=lambda: False))
            result: ToolMessage = {"role": "tool", "content": outcome.content,
                                   "tool_call_id": call["id"], "name": "noop"}
            messages.append(result)
    return time.perf_counter() - start


async def bare_events(rounds: int) -> AsyncGenerator[Event, None]:
    """The bare loop as a stream of the events each round of ``Agent.run`` streams."""
    model, tools, specs, messages = bare_parts(rounds)
    steps = 0
    while True:
        assembler = TurnAssembler()
        async for chunk in model.stream_turn(messages, specs):
            assembler.add(chunk)
            if type(chunk) is TextDelta:
                yield TextChunk("bare", chunk.text)
        message = assembler.message()
        messages.append(message)
        calls = message.get("tool_calls")
        if not calls:
            return
        for call in calls:
            yield ToolCallStarted("bare", call["id"], "noop", call["function"]["arguments"])
            outcome = await invoke(tools, call, ToolContext(
                agent="bare", call_id=call["id"], tool_name="noop",
                interrupt_probe=lambda: False))
            result: ToolMessage = {"role": "tool", "content": outcome.content,
                                   "tool_call_id": call["id"], "name": "noop"}
            messages.append(result)
            yield ToolResult("bare", call["id"], "noop", outcome.content, outcome.is_error)
        steps += 1
        yield StepFinished("bare", steps)


async def bare_stream(rounds: int) -> float:
    start = time.perf_counter()
    async for _ in bare_events(rounds):
        pass
    return time.perf_counter() - start


async def bytecodes_per_round(loop: Callable[[int], Awaitable[object]]) -> float:
    """The Python bytecodes ``loop`` runs a round (every frame's, asyncio's included):
    traced at 300 rounds and at 100, the difference / 200. Time follows this count more
    closely than the instructions callgrind counts (see docs/benchmarks.md)."""

    async def count(rounds: int) -> int:
        executed = 0

        def opcode(frame: FrameType, event: str, arg: object) -> Any:
            nonlocal executed
            if event == "opcode":
                executed += 1
            return opcode

        def called(frame: FrameType, event: str, arg: object) -> Any:
            frame.f_trace_opcodes, frame.f_trace_lines = True, False
            return opcode

        sys.settrace(called)  # frames entered from here on: the loop's and asyncio's
        try:
            await loop(rounds)
        finally:
            sys.settrace(None)
        return executed

    await loop(20)  # warmed up first: what the first run imports or caches is not a round's
    return (await count(300) - await count(100)) / 200


def limits_for(name: str) -> dict[str, Any]:
    """The ``Agent`` arguments of ``--limits name``: limits no run of the bench reaches, set
    on the run and on the session, so each round checks them all and none stops it. Nothing
    for ``none``, so the bench still runs against checkouts older than limits."""
    if name == "none":
        return {}
    high = 10**9
    limits = aio.UsageLimits(requests=high, tool_calls=high)
    if name == "every":
        limits = aio.UsageLimits(
            requests=high, tool_calls=high, input_tokens=high, output_tokens=high,
            total_tokens=high, cost=1e9, prices={"scripted": aio.ModelPrice(1.0, 2.0)},
        )
    return {"limits": limits, "session_limits": limits}


async def agent_loop(rounds: int, limits: str = "none") -> tuple[float, list[float]]:
    """``limits``: see :func:`limits_for`."""
    agent = aio.Agent(ScriptedModel(script_for(rounds), record=False), tools=[noop],
                      max_rounds=rounds + 1, **limits_for(limits))
    marks: list[float] = []
    start = time.perf_counter()
    async for event in agent.run("go", stream=True):
        if isinstance(event, StepFinished):
            marks.append(time.perf_counter())
    return time.perf_counter() - start, [start, *marks]


async def overhead(rounds: int, repeats: int) -> dict[str, float]:
    bare, stream, loop, first, last = [], [], [], [], []
    for _ in range(repeats):
        gc.collect()
        bare.append(await bare_loop(rounds) / rounds)
        gc.collect()
        stream.append(await bare_stream(rounds) / rounds)
        gc.collect()
        total, marks = await agent_loop(rounds)
        loop.append(total / rounds)
        steps = [b - a for a, b in itertools.pairwise(marks)]
        first.append(sum(steps[:20]))
        last.append(sum(steps[-20:]))
    bare_us = statistics.median(bare) * 1e6
    loop_us = statistics.median(loop) * 1e6
    return {
        "rounds": rounds,
        "bare_us": bare_us,
        "stream_us": statistics.median(stream) * 1e6,
        "agent_us": loop_us,
        "overhead_us": loop_us - bare_us,
        "last20_over_first20": statistics.median(last) / statistics.median(first),
    }


def _transcript_bytes(transcripts: list[list[Message]]) -> int:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    copies = [copy_messages(t) for t in transcripts]
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del copies
    return after - before


async def concurrent_sessions(count: int = 1000) -> dict[str, float]:
    def script(request: Mapping[str, Any]) -> Turn:
        tool_turns = sum(1 for m in request["messages"] if m["role"] == "assistant")
        return CALL if tool_turns < 3 else ANSWER

    agent = aio.Agent(ScriptedModel(script, record=False), tools=[noop])
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    sessions = [agent.start() for _ in range(count)]
    start = time.perf_counter()
    replies = await asyncio.gather(*(s.run("go") for s in sessions))
    wall = time.perf_counter() - start
    await asyncio.sleep(0)  # the gather's wake-up let go: its tasks are not the sessions'
    gc.collect()
    retained = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert all(r == "done" for r in replies)
    transcripts = _transcript_bytes([s.model_client.messages for s in sessions])
    return {
        "sessions": count,
        "wall_s": wall,
        "retained_per_session_kib": retained / count / 1024,
        "transcript_per_session_kib": transcripts / count / 1024,
        "beyond_transcript_kib": (retained - transcripts) / count / 1024,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--one-run", type=int, metavar="ROUNDS",
                        help="make one Agent.run of ROUNDS tool rounds and exit (to count "
                             "its instructions with callgrind at two sizes)")
    parser.add_argument("--limits", choices=("none", "counts", "every"), default="none",
                        help="with --one-run: the usage limits set on the run and the session "
                             "(counts: requests and tool calls; every: all but wall)")
    parser.add_argument("--bare", action="store_true",
                        help="with --one-run: the bare loop instead of Agent.run (the floor)")
    parser.add_argument("--bare-stream", action="store_true",
                        help="with --one-run: the bare loop streaming a round's events")
    parser.add_argument("--bytecodes", action="store_true",
                        help="print the Python bytecodes a round of each loop and exit")
    args = parser.parse_args()
    if args.bytecodes:
        for name, loop in (("bare", bare_loop), ("bare stream", bare_stream),
                           ("agent", agent_loop)):
            print(f"{name:<12} {await bytecodes_per_round(loop):8.1f} bytecodes a round")
        return
    if args.one_run is not None:
        if args.bare:
            await bare_loop(args.one_run)
        elif args.bare_stream:
            await bare_stream(args.one_run)
        else:
            await agent_loop(args.one_run, args.limits)
        return
    print("agent loop overhead (scripted model, no-op async tool; medians of "
          f"{args.repeats} repeats)")
    print(f"{'rounds':>7} {'bare µs/round':>14} {'bare stream':>12} {'agent µs/round':>15} "
          f"{'overhead µs':>12} {'last20/first20':>15}")
    for rounds in (200, 1000):
        row = await overhead(rounds, args.repeats)
        print(f"{rounds:>7} {row['bare_us']:>14.1f} {row['stream_us']:>12.1f} "
              f"{row['agent_us']:>15.1f} {row['overhead_us']:>12.1f} "
              f"{row['last20_over_first20']:>15.2f}")
    row = await concurrent_sessions()
    print(f"\n{row['sessions']:.0f} concurrent sessions of one agent, 3 tool rounds each:")
    print(f"  wall time {row['wall_s'] * 1000:.0f} ms; retained per session "
          f"{row['retained_per_session_kib']:.1f} KiB, of which transcript "
          f"{row['transcript_per_session_kib']:.1f} KiB; beyond the transcript "
          f"{row['beyond_transcript_kib']:.1f} KiB")


if __name__ == "__main__":
    asyncio.run(main())
