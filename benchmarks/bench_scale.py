"""Many concurrent runs in one process: aimu side by side with its peers and a bare floor.

    python benchmarks/bench_scale.py                          # N = 1, 100, 1000, 5000; 3 repeats
    python benchmarks/bench_scale.py --n 100 --contenders aimu,floor --repeats 1   # a smoke run
    .venv-bench/bin/python benchmarks/bench_scale.py          # with the peers installed
    python benchmarks/bench_scale.py --leak 5 --n 1000 --contenders aimu   # RSS over 5 rounds

The loopback server (``aimu.testing.server``) runs in its own process and speaks the
OpenAI-compatible wire. Each run makes one tool call, then streams an answer of 20
chunks. Each measurement runs in a fresh client process (so CPU time, peak RSS and
leaks belong to that contender alone), contenders interleaved within each repeat:

* ``floor``: a bare ``httpx`` streaming loop (parse each SSE line as JSON, call the
  tool, send its result, read the streamed answer): the least code that does the work.
* ``aimu``: ``Agent`` with ``aio.client("openai:...", concurrency=N)``, each run a
  ``RunHandle`` over ``session.run(task, stream=True)``.
* ``pydantic-ai`` (``pydantic-ai-slim[openai]``) and ``openai-agents``: the same tool, the
  same streamed consumption; both get an ``httpx`` pool of N connections, as aimu does.
  Benchmark-only (``benchmarks/requirements-peers.txt``); skipped when not installed.

Per N and contender: runs/s, client CPU ms per run, peak RSS per run in flight, RSS per
run left after the round (gc'd), event-loop lag p99 (a 1 ms ticker), and cancel-all:
N runs each held mid-stream by the server, cancelled at once: ms until every cancel
returned, ms until the server saw every stream closed (CLOCK_MONOTONIC is one clock
for both processes), and whether the library kept the partial reply. Medians over
repeats with the spread (min-max), ratios to the floor of the same repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

PAGE = os.sysconf("SC_PAGE_SIZE")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNKS = 20
HELD_CHUNKS = 2  # cancel-all: the server sends this many text chunks, then holds the stream
TASK = "What is the weather in Paris?"
HELD_TASK = "Hold on: what is the weather in Paris?"  # the server holds its answer mid-way
SERVED = "Served #"  # bench_serve_scale.py: answered at once, held mid-way
REST = "Rest #"  # bench_serve_scale.py: a call of its approval tool, then "done"
ANSWER = " ".join(f"word{i}" for i in range(CHUNKS))
CONTENDERS = ("floor", "aimu", "pydantic-ai", "openai-agents")


def lookup(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


# -- the server process ---------------------------------------------------------------------


def serve(delay: float) -> None:
    """The loopback server; commands on stdin, one JSON answer a line on stdout."""
    from aimu.testing.script import ScriptedCall, Turn
    from aimu.testing.server import LoopbackServer

    call = Turn(tool_calls=[ScriptedCall("lookup", {"city": "Paris"})])
    answer = Turn(text=ANSWER, chunks=CHUNKS, delay=delay)
    held = Turn(text=ANSWER, chunks=CHUNKS, fault="hang", fault_after=HELD_CHUNKS)
    ask, done = Turn(tool_calls=[ScriptedCall("approve_me", {})]), Turn(text="done")
    tags: dict[int, str] = {}  # a served run's stream (its index) -> its task

    def script(body: Mapping[str, Any]) -> Turn:
        task = str(body["messages"][-1].get("content"))
        if str(body["messages"][0].get("content")).startswith(REST):  # paused for approval
            return done if body["messages"][-1].get("role") == "tool" else ask
        if task.startswith(SERVED):  # through aimu serve: no tool, held at once
            tags[len(server.streams)] = task
            return held
        if not any(m.get("role") == "tool" for m in body.get("messages", ())):
            return call
        return held if body["messages"][0].get("content") == HELD_TASK else answer

    server = LoopbackServer(script)

    def held_count(count: int = 0) -> int | bool:  # streams held mid-way: how many, >= count
        done = sum(s.chunks_sent >= HELD_CHUNKS for s in server.streams if s.fault)
        return done >= count if count else done

    def ended(count: int = 0) -> int | bool:  # the held streams ended: how many, or >= count
        done = sum(s.abandoned or s.completed for s in server.streams if s.fault)
        return done >= count if count else done

    async def main() -> None:
        await server.start()
        print(json.dumps({"url": server.openai_base_url}), flush=True)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            command, *args = line.decode().split()
            answer: dict[str, Any] = {}
            if command == "reset":  # forget the last round (its connections counted too)
                server.requests.clear()
                server.streams.clear()
                server.connections_accepted = 0
                tags.clear()
            elif command == "held":  # wait until N streams are held mid-way
                with contextlib.suppress(TimeoutError):
                    await server.wait_until(partial(held_count, int(args[0])), float(args[1]))
                answer = {"held": held_count()}
            elif command == "tags":  # wait until N held streams ended; when each did
                with contextlib.suppress(TimeoutError):
                    await server.wait_until(partial(ended, int(args[0])), float(args[1]))
                answer = {tags[i]: s.abandoned_at for i, s in enumerate(server.streams)
                          if i in tags and s.abandoned_at}
            elif command == "stats":
                answer = {"requests": len(server.requests), "streams": len(server.streams),
                          "held": sum(s.chunks_sent >= HELD_CHUNKS for s in server.streams
                                      if s.fault),
                          "connections": server.connections_accepted}
            elif command == "closed":  # wait until N held streams ended; when the last did
                with contextlib.suppress(TimeoutError):
                    await server.wait_until(partial(ended, int(args[0])), float(args[1]))
                times = [s.abandoned_at or s.finished_at or 0.0 for s in server.streams
                         if s.fault]
                answer = {"ended": ended(), "last": max(times, default=0.0)}
            print(json.dumps(answer), flush=True)
        await server.stop()

    asyncio.run(main())


class Server:
    def __init__(self, delay: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve", "--delay", str(delay)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.url = str(json.loads(self._line())["url"])

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the loopback server process ended")
        return line

    def ask(self, command: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return dict(json.loads(self._line()))

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(10)


# -- the contenders: one run, and one run held mid-stream ------------------------------------
# Each factory gets (url, n) and returns (run, cleanup): run(seen) does one run, calls
# seen() at its first text, and returns the text it streamed; a cancel may land anywhere.

Run = Callable[..., Awaitable[str]]
Kept = Callable[[], int]  # after a cancel-all: how many runs kept their partial reply


async def floor(url: str, n: int) -> tuple[Run, Kept, Callable[[], Awaitable[None]]]:
    import httpx

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300.0, connect=5.0))
    tool_spec = {"type": "function", "function": {
        "name": "lookup", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
    endpoint = url + "/chat/completions"

    async def turn(messages: list[dict[str, Any]], seen: Callable[[], None],
                   parts: list[str]) -> dict[str, Any] | None:
        body = {"model": "test", "stream": True, "messages": messages, "tools": [tool_spec]}
        call: dict[str, Any] | None = None
        async with http.stream("POST", endpoint, json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"] if line[6:] else {}
                if delta.get("content"):
                    if not parts:
                        seen()
                    parts.append(delta["content"])
                for piece in delta.get("tool_calls") or ():
                    if call is None:
                        call = {"id": piece.get("id"), "name": piece["function"].get("name"),
                                "arguments": ""}
                    call["arguments"] += piece["function"].get("arguments") or ""
        return call

    async def run(seen: Callable[[], None], task: str = TASK) -> str:
        messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
        parts: list[str] = []
        call = await turn(messages, seen, parts)
        assert call is not None
        messages.append({"role": "assistant", "content": None, "tool_calls": [{
            "id": call["id"], "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]}}]})
        result = lookup(**json.loads(call["arguments"]))
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        await turn(messages, seen, parts)
        return "".join(parts)

    return run, lambda: 0, http.aclose


async def aimu_runs(url: str, n: int) -> tuple[Run, Kept, Callable[[], Awaitable[None]]]:
    from aimu import aio

    model = aio.client("openai:test", base_url=url, concurrency=max(n, 16))
    agent = aio.Agent(model, tools=[lookup])
    sessions: list[Any] = []

    async def run(seen: Callable[[], None], task: str = TASK) -> str:
        session = agent.start()
        if task == HELD_TASK:  # kept for the cancel-all check only
            sessions.append(session)
        parts: list[str] = []
        async for event in session.run(task, stream=True):
            if isinstance(event, aio.TextChunk):
                if not parts:
                    seen()
                parts.append(event.text)
        return "".join(parts)

    def kept() -> int:
        return sum(
            1 for s in sessions
            if any(m["role"] == "assistant" and m.get("content") for m in s.messages)
        )

    return run, kept, model.aclose


async def pydantic_ai_runs(url: str, n: int) -> tuple[Run, Kept, Callable[[], Awaitable[None]]]:
    import httpx
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300.0, connect=5.0))
    client = AsyncOpenAI(base_url=url, api_key="none", http_client=http, max_retries=0)
    model = OpenAIChatModel("test", provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, tools=[lookup])
    runs: list[Any] = []

    async def run(seen: Callable[[], None], task: str = TASK) -> str:
        parts: list[str] = []
        async with agent.iter(task) as agent_run:
            if task == HELD_TASK:  # kept for the cancel-all check only
                runs.append(agent_run)
            async for node in agent_run:
                if Agent.is_model_request_node(node):
                    async with node.stream(agent_run.ctx) as stream:
                        async for text in stream.stream_text(delta=True):
                            if not parts:
                                seen()
                            parts.append(text)
        return "".join(parts)

    def kept() -> int:
        count = 0
        for agent_run in runs:
            for message in agent_run.all_messages():
                if message.kind == "response" and any(
                    getattr(part, "part_kind", "") == "text" and part.content
                    for part in message.parts
                ):
                    count += 1
                    break
        return count

    return run, kept, http.aclose


async def openai_agents_runs(url: str, n: int) -> tuple[Run, Kept, Callable[[], Awaitable[None]]]:
    import httpx
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI
    from openai.types.responses import ResponseTextDeltaEvent

    set_tracing_disabled(True)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300.0, connect=5.0))
    client = AsyncOpenAI(base_url=url, api_key="none", http_client=http, max_retries=0)
    model = OpenAIChatCompletionsModel(model="test", openai_client=client)
    agent = Agent(name="weather", model=model, tools=[function_tool(lookup)])
    results: list[Any] = []

    async def run(seen: Callable[[], None], task: str = TASK) -> str:
        parts: list[str] = []
        result = Runner.run_streamed(agent, task)
        if task == HELD_TASK:  # kept for the cancel-all check only
            results.append(result)
        try:
            async for event in result.stream_events():
                if event.type == "raw_response_event" and isinstance(
                    event.data, ResponseTextDeltaEvent
                ):
                    if not parts:
                        seen()
                    parts.append(event.data.delta)
        except asyncio.CancelledError:
            result.cancel()
            raise
        return "".join(parts)

    def kept() -> int:
        count = 0
        for result in results:
            for item in result.to_input_list():
                if item.get("role") == "assistant" and item.get("content"):
                    count += 1
                    break
        return count

    return run, kept, http.aclose


FACTORIES = {
    "floor": floor,
    "aimu": aimu_runs,
    "pydantic-ai": pydantic_ai_runs,
    "openai-agents": openai_agents_runs,
}


def available(name: str) -> bool:
    module = {"pydantic-ai": "pydantic_ai", "openai-agents": "agents"}.get(name)
    if module is None:
        return True
    import importlib.util

    return importlib.util.find_spec(module) is not None


# -- one measurement, in a fresh client process -----------------------------------------------


class Ticker:
    """A 1 ms ticker: how late the loop wakes it (event-loop lag); and the peak RSS
    (the process's high-water mark: the warm-up run stays below the round's)."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.peak = rss()
        self.task: asyncio.Task[None] | None = None
        self.gc_began = 0.0
        self.gc_max = 0.0  # the longest garbage collection (it blocks the loop)
        self.gc_total = 0.0  # seconds of collection so far
        self.collections = [0, 0, 0]  # per generation
        self.bare: list[float] = []  # each lag less the collections inside it

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.gc_began = time.perf_counter()
        else:
            took = time.perf_counter() - self.gc_began
            self.gc_max = max(self.gc_max, took)
            self.gc_total += took
            self.collections[info["generation"]] += 1

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        lags, bare = self.lags, self.bare
        while True:
            due, collected = loop.time() + 0.001, self.gc_total
            await asyncio.sleep(0.001)
            lag = loop.time() - due
            lags.append(lag)
            bare.append(max(0.0, lag - (self.gc_total - collected)))

    def __enter__(self) -> Ticker:
        self.task = asyncio.get_running_loop().create_task(self._tick())
        gc.callbacks.append(self._gc)
        return self

    def __exit__(self, *_: object) -> None:
        assert self.task is not None
        self.task.cancel()
        gc.callbacks.remove(self._gc)
        high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.peak = max(self.peak, rss(), high_water)

    def p99_ms(self, lags: list[float] | None = None) -> float:
        """The 99th percentile lag; of ``lags`` if given (e.g. :attr:`bare`)."""
        lags = self.lags if lags is None else lags
        if not lags:
            return 0.0
        ordered = sorted(lags)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000


class Passes:
    """``--passes``: each pass of the event loop (``_run_once``), how many callbacks it
    ran and for how long. A 1 ms timer is run in the pass after it falls due, behind
    every callback ready in that pass: its lag is at least that pass's run time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.counts: list[int] = []
        self.busy: list[float] = []  # seconds of callbacks per pass
        self._count = 0
        self._busy = 0.0
        self.loop, self.run = loop, asyncio.events.Handle._run

    def __enter__(self) -> Passes:
        inner, handle_run = self.loop._run_once, self.run  # type: ignore[attr-defined]

        def run(handle: asyncio.Handle) -> None:
            began = time.perf_counter()
            handle_run(handle)
            self._busy += time.perf_counter() - began
            self._count += 1

        def run_once() -> None:
            inner()
            if self._count:
                self.counts.append(self._count)
                self.busy.append(self._busy)
            self._count, self._busy = 0, 0.0

        asyncio.events.Handle._run = run  # type: ignore[method-assign]
        self.loop._run_once = run_once  # type: ignore[attr-defined]
        return self

    def __exit__(self, *_: object) -> None:
        asyncio.events.Handle._run = self.run  # type: ignore[method-assign]
        del self.loop._run_once  # type: ignore[attr-defined]

    def figures(self, runs: int) -> dict[str, float]:
        if not self.counts:
            return {}
        return {"passes": len(self.counts), "callbacks_run": sum(self.counts) / runs,
                "callbacks_p50": percentile(self.counts, 0.5),
                "callbacks_p99": percentile(self.counts, 0.99),
                "callbacks_max": max(self.counts),
                "pass_p99_ms": percentile(self.busy, 0.99) * 1000,
                "pass_max_ms": max(self.busy) * 1000}


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def throughput(run: Run, n: int, rounds: int) -> dict[str, Any]:
    """N runs at once to their answers, ``rounds`` times; the first round's figures and
    the RSS after each round (gc'd)."""
    out: dict[str, Any] = {}
    after: list[int] = []
    for round_ in range(rounds):
        gc.collect()
        base, cpu0 = rss(), cpu()
        with Ticker() as ticker:
            start = time.perf_counter()
            replies = await asyncio.gather(*(run(lambda: None) for _ in range(n)),
                                           return_exceptions=True)
            wall = time.perf_counter() - start
        used = cpu() - cpu0
        failed = [r for r in replies if not isinstance(r, str)]
        assert all(r.split() == ANSWER.split() for r in replies if isinstance(r, str))
        if failed:
            out["failed"] = out.get("failed", 0) + len(failed)
            out["failure"] = f"{type(failed[0]).__name__}: {failed[0]}"[:200]
        del replies, failed
        gc.collect()
        after.append(rss())
        if round_ == 0:
            out |= {"runs_s": n / wall, "cpu_ms": used / n * 1000,
                   "peak_kb": (ticker.peak - base) / n / 1024,
                   "after_kb": (rss() - base) / n / 1024, "lag_ms": ticker.p99_ms(),
                   "lag_bare_ms": ticker.p99_ms(ticker.bare),
                   "gc_max_ms": ticker.gc_max * 1000, "gc_ms": ticker.gc_total / n * 1000,
                   "young": ticker.collections[0] / n, "full": ticker.collections[2]}
    out["rss_rounds"] = after
    return out


async def cancel_all(run: Run, kept: Kept, n: int) -> dict[str, Any]:
    """N runs, each held mid-stream by the server after its first text, cancelled at once."""
    out: dict[str, Any] = {}
    started = asyncio.Event()
    count = 0

    def seen() -> None:
        nonlocal count
        count += 1
        if count == n:
            started.set()

    tasks = [asyncio.ensure_future(run(seen, HELD_TASK)) for _ in range(n)]
    with Ticker() as ticker:
        try:
            async with asyncio.timeout(120 + n * 0.06):  # 5,000 runs: 7 minutes
                await started.wait()
        except TimeoutError:
            out["never_streamed"] = n - count
        begin, cpu0 = time.monotonic(), cpu()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        returned, used = time.monotonic() - begin, cpu() - cpu0
    out.update({"cancel_at": begin, "cancels_ms": returned * 1000, "kept": kept(),
                "cpu_ms": used / n * 1000,  # CPU per run, cancel to every cancel returned
                "lag_ms": ticker.p99_ms()})
    return out


async def measure(name: str, url: str, n: int, phases: str, rounds: int,
                  passes: bool = False) -> dict[str, Any]:
    run, kept, cleanup = await FACTORIES[name](url, n)
    await run(lambda: None, "warm up")  # lazy imports, the pool's first connection
    out: dict[str, Any] = {}
    if "throughput" in phases:
        with Passes(asyncio.get_running_loop()) if passes else contextlib.nullcontext() as seen:
            out.update(await throughput(run, n, rounds))
        out.update(seen.figures(n * rounds) if seen else {})
    if "cancel" in phases:
        out.update({f"c_{k}": v for k, v in (await cancel_all(run, kept, n)).items()})
    await cleanup()
    return out


def client_main(options: argparse.Namespace) -> None:
    out = asyncio.run(measure(options.client, options.url, options.n, options.phases,
                              options.rounds, options.passes))
    print(json.dumps(out), flush=True)


# -- the orchestrator ---------------------------------------------------------------------------


def one(server: Server, name: str, n: int, phases: str, rounds: int,
        timeout: float = 1800, passes: bool = False) -> dict[str, Any]:
    """One client process: its figures, with the server's view of the cancel-all and the
    requests and connections the server saw from it (the warm-up run's included)."""
    server.ask("reset")
    command = [sys.executable, __file__, "--client", name, "--url", server.url, "--n", str(n),
               "--phases", phases, "--rounds", str(rounds)] + (["--passes"] if passes else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"{name} N={n}: no answer within {timeout:g} s", file=sys.stderr)
        return {"load": os.getloadavg()[0], "crashed": f"timed out after {timeout:g} s"}
    if done.returncode:
        print(f"{name} N={n} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        last = (done.stderr.strip().splitlines() or ["killed"])[-1]
        return {"load": os.getloadavg()[0], "crashed": last}
    out = dict(json.loads(done.stdout.strip().splitlines()[-1]))
    if "c_cancel_at" in out:
        closed = server.ask(f"closed {n} 60")
        if closed["ended"]:  # else no stream ended: no time to give
            out["c_closed_ms"] = (closed["last"] - out["c_cancel_at"]) * 1000
        out["c_open_after"] = n - closed["ended"]
    stats = server.ask("stats")
    out["requests"], out["connections"] = stats["requests"], stats["connections"]
    out["load"] = os.getloadavg()[0]
    return out


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


def spread(values: list[float]) -> str:
    median = statistics.median(values)
    if len(values) < 2:
        return f"{median:.3g}"
    return f"{median:.3g} ({min(values):.3g}-{max(values):.3g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", default="1,100,1000,5000", help="comma-separated N")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--delay", type=float, default=0.005,
                        help="server seconds between answer chunks (default 0.005)")
    parser.add_argument("--phases", default="throughput,cancel",
                        help="throughput (all runs to their answer), cancel (cancel-all)")
    parser.add_argument("--leak", type=int, default=0, metavar="ROUNDS",
                        help="also run ROUNDS rounds of N in one process; RSS growth")
    parser.add_argument("--passes", action="store_true",
                        help="also time each pass of the client's event loop (costs CPU)")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds one contender's process may take (default 1800)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=1, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.serve:
        serve(options.delay)
        return
    if options.client:
        options.n = int(options.n)
        client_main(options)
        return
    sizes = [int(x) for x in options.n.split(",")]
    names = [c for c in options.contenders.split(",") if c]
    for name in names:
        if name not in FACTORIES:
            parser.error(f"unknown contender {name!r}; known: {', '.join(CONTENDERS)}")
    missing = [c for c in names if not available(c)]
    if missing:
        print(f"skipped (not installed; see benchmarks/requirements-peers.txt): "
              f"{', '.join(missing)}")
    names = [c for c in names if c not in missing]
    if "floor" not in names and options.leak < 2:  # the ratios' baseline
        names.insert(0, "floor")
    server = Server(options.delay)
    rows: dict[tuple[int, str], list[dict[str, Any]]] = {}
    try:
        for n in sizes:
            for repeat in range(options.repeats):
                order = names[repeat % len(names):] + names[:repeat % len(names)]
                for name in order:
                    row = one(server, name, n, options.phases, max(1, options.leak),
                              options.timeout, options.passes)
                    row["repeat"] = repeat
                    rows.setdefault((n, name), []).append(row)
                    print(f"  N={n} {name} repeat {repeat + 1}: {json.dumps(row)}",
                          file=sys.stderr, flush=True)
    finally:
        server.close()
    report(rows, sizes, names, options)


def report(rows: dict[tuple[int, str], list[dict[str, Any]]], sizes: list[int],
           names: list[str], options: argparse.Namespace) -> None:
    print(f"\n{options.repeats} repeats, medians (min-max); x: ratio to the floor of the "
          f"same repeat (median); load {os.getloadavg()[0]:.2f} at the end")
    head = ("N", "contender", "runs/s", "CPU ms/run", "x", "peak KB/run", "after KB/run",
            "lag p99 ms", "gc max ms", "cancels ms", "closed ms", "x", "kept", "load")
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for n in sizes:
        floors = {r["repeat"]: r for r in rows.get((n, "floor"), [])}
        for name in names:
            got = rows.get((n, name), [])
            if not got:
                continue

            def ratio(key: str, got: list[dict[str, Any]] = got,
                      floors: dict[int, dict[str, Any]] = floors) -> str:
                values = [r[key] / floors[r["repeat"]][key] for r in got
                          if r["repeat"] in floors and floors[r["repeat"]].get(key)]
                return f"{statistics.median(values):.2f}" if values else "-"

            def col(key: str, got: list[dict[str, Any]] = got) -> str:
                values = [float(r[key]) for r in got if key in r]
                return spread(values) if values else "-"

            kept = "-" if "cancel" not in options.phases else (
                f"{statistics.median(r.get('c_kept', 0) for r in got):.0f}/{n}")
            stuck = [r.get("c_never_streamed", 0) + r.get("c_open_after", 0) for r in got]
            failed = sum(r.get("failed", 0) for r in got)
            crashed = sum("crashed" in r for r in got)
            cells = (f"{n:,}", name, col("runs_s"), col("cpu_ms"), ratio("cpu_ms"),
                     col("peak_kb"), col("after_kb"), col("lag_ms"), col("gc_max_ms"),
                     col("c_cancels_ms"),
                     col("c_closed_ms"), ratio("c_closed_ms"),
                     kept + (f" stuck {max(stuck)}" if any(stuck) else "")
                     + (f" failed {failed}" if failed else "")
                     + (f" crashed {crashed}" if crashed else ""),
                     f"{statistics.median(r.get('load', r.get('c_load', 0)) for r in got):.1f}")
            print("| " + " | ".join(cells) + " |")
    print("\nCounts, load-independent (medians): requests and connections the server saw "
          "from the client process (its warm-up run included), young collections per run, "
          "full collections in the round" + (", loop callbacks per run" if options.passes
                                              else "") + "; and times: seconds of collection "
          "per run, CPU per run of the cancel-all (until every cancel returned), lag p99 "
          "and lag p99 less the collections inside each tick"
          + ("; callbacks run per loop pass p50/p99/max and their time in a pass p99"
             if options.passes else ""))
    head = ("N", "contender", "requests", "connections", "young GCs/run", "GC ms/run",
            "cancel CPU ms/run",
            "full GCs", "lag p99 ms", "less GC", *(("callbacks/run", "callbacks/pass",
                                                    "pass p99 ms")
                                                   if options.passes else ()))
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for (n, name), got in rows.items():
        def med(key: str, got: list[dict[str, Any]] = got, form: str = ".3g") -> str:
            values = [float(r[key]) for r in got if key in r]
            return format(statistics.median(values), form) if values else "-"

        cells = [f"{n:,}", name, med("requests", form=",.0f"), med("connections", form=",.0f"),
                 med("young", form=".3f"), med("gc_ms"), med("c_cpu_ms"),
                 med("full", form=".0f"),
                 med("lag_ms"), med("lag_bare_ms")]
        if options.passes:
            cells += [med("callbacks_run", form=".0f"),
                      f"{med('callbacks_p50', form='.0f')}/{med('callbacks_p99', form='.0f')}"
                      f"/{med('callbacks_max', form='.0f')}", med("pass_p99_ms")]
        print("| " + " | ".join(cells) + " |")
    if options.leak > 1:
        print(f"\nRSS after each of {options.leak} rounds of N (MB, gc'd), growth from the "
              "first round to the last, and from the second (the first round to run with "
              "every connection already open, so all N in flight at once) to the last:")
        for (n, name), got in rows.items():
            for r in got:
                if "rss_rounds" not in r:
                    continue
                mb = [x / 2**20 for x in r["rss_rounds"]]
                growth = (mb[-1] - mb[0]) / mb[0] * 100
                warm = (mb[-1] - mb[1]) / mb[1] * 100 if len(mb) > 2 else growth
                print(f"  N={n} {name}: {' '.join(f'{x:.1f}' for x in mb)} ({growth:+.1f} %; "
                      f"{warm:+.1f} % from the second)")


if __name__ == "__main__":
    main()
