"""Whole tool rounds over the wire: ``ollama:``, ``openai:``, ``anthropic:``,
``openai-responses:`` and ``gemini:`` against bare httpx; and how soon the server sees a
cancelled stream closed.

    python benchmarks/bench_wire.py                    # wall time, growth, concurrency
    python benchmarks/bench_wire.py --callgrind        # + instructions (valgrind)
    python benchmarks/bench_wire.py --quick            # a smoke run (CI)

The loopback server runs in a separate process, so the client side is all that this
process (and callgrind) measures. Each sample is one whole run built the way a user
builds it: a client made, an agent with one no-op tool, ``rounds`` tool rounds (the
transcript grows by two messages a round), the answer, the client closed. The baseline
is a bare ``httpx.AsyncClient`` doing the same requests in the same run: it keeps the
transcript as wire dicts, posts it with ``json=``, parses each streamed line and joins
the tool-call fragments. Both share one TLS context, as every aimu client does.

Prints, with medians of interleaved repeats:

- µs per round at 50 rounds, ours / bare (target ≤ 1.2x);
- growth: µs per round at 10, 100, 500 rounds and the per-message slope, ours / bare
  (target ≤ 2x);
- with ``--callgrind``: instructions per round at 50 rounds (runs of 1 and 2, the
  difference, so start-up, imports and the first run's one-time costs cancel);
- 1,000 and 10,000 concurrent single-turn runs: client CPU per request, and memory per
  run in flight;
- cancel to closed: a streamed turn cancelled after its first chunk, ms until the
  loopback server (in a thread of this process, one clock) sees the connection go:
  median and 90th percentile per client (goal: median < 2 ms);
- a background response (``openai-responses:``, ``background=True``) stopped: ms until
  the server (a process of its own, timed on the same system-wide monotonic clock) sees
  the stream closed and has taken the cancel.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import httpx

from aimu import aio
from aimu.aio.providers._pool import DEFAULT_CONCURRENCY, ssl_context

Run = Callable[[], Awaitable[None]]
PROVIDERS = ("ollama", "openai", "anthropic", "openai-responses", "gemini")


async def noop(n: int) -> str:
    """Does nothing; returns its argument."""
    return f"done {n}"


TOOLS = [{"type": "function", "function": {
    "name": "noop", "description": "Does nothing; returns its argument.",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer"}},
                   "required": ["n"]}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "noop", "strict": False,
                    "description": TOOLS[0]["function"]["description"],
                    "parameters": TOOLS[0]["function"]["parameters"]}]
GEMINI_TOOLS = [{"functionDeclarations": [{
    "name": "noop", "description": "Does nothing; returns its argument.",
    "parametersJsonSchema": TOOLS[0]["function"]["parameters"]}]}]
ANTHROPIC_TOOLS = [{"name": "noop", "description": "Does nothing; returns its argument.",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]


def client(provider: str, url: str) -> aio.ModelClient:
    """Our client of ``provider`` for the loopback server at ``url``."""
    if provider == "ollama":
        return aio.client("ollama:bench", host=url)
    if provider == "anthropic":
        return aio.client("anthropic:bench", base_url=url, api_key="sk-ant-bench")
    if provider == "gemini":
        return aio.client("gemini:bench", base_url=url, api_key="AIza-bench")
    return aio.client(f"{provider}:bench", base_url=url + "/v1", api_key="sk-bench")


# -- the server process --------------------------------------------------------------


def serve() -> None:
    """``--serve``: a loopback server that plays "rounds=N": N tool calls, then an answer."""
    from aimu.testing.script import ScriptedCall, Turn
    from aimu.testing.server import LoopbackServer

    def script(request: Mapping[str, Any]) -> Turn:
        messages = request.get("messages") or []
        task = next((m.get("content", "") for m in messages if m.get("role") == "user"), "")
        found = re.search(r"rounds=(\d+)", str(task))
        rounds = int(found.group(1)) if found else 0
        done = sum(1 for m in messages if m.get("role") == "tool")
        if done < rounds:
            return Turn(text="Calling.", tool_calls=[ScriptedCall("noop", {"n": done})])
        return Turn(text="All rounds are done.", delay=0.2 if "slow" in str(task) else 0.0)

    async def main() -> None:
        # Nothing asks this server what it recorded: kept, the records made its full
        # collections grow to 100-250 ms pauses that landed on whichever run was talking
        # (the "gemini 2x" of an earlier measurement).
        async with LoopbackServer(script, keep_records=False) as server:
            print(server.url, flush=True)
            await asyncio.Event().wait()

    asyncio.run(main())


@contextlib.contextmanager
def server_process() -> Iterator[str]:
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        yield process.stdout.readline().strip()
    finally:
        process.terminate()
        process.wait()


# -- one run each way ----------------------------------------------------------------


def ours(
    provider: str, url: str, rounds: int,
    make: Callable[[str, str], aio.ModelClient] | None = None,
) -> Run:
    """Our run (``make``: the client of a row, else :func:`client`'s)."""

    async def run() -> None:
        model = (make or client)(provider, url)
        agent = aio.Agent(model, tools=[noop], max_rounds=rounds + 1)
        await agent.run(f"rounds={rounds}")
        await model.aclose()

    return run


async def _bare_anthropic_turn(
    http: httpx.AsyncClient, url: str, messages: list[dict[str, Any]]
) -> tuple[str, list[dict[str, Any]]]:
    """Messages API SSE: text deltas, tool_use blocks with their input's JSON fragments."""
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    body = {"model": "bench", "max_tokens": 4096, "messages": messages,
            "tools": ANTHROPIC_TOOLS, "stream": True}
    headers = {"x-api-key": "sk-ant-bench", "anthropic-version": "2023-06-01"}
    async with http.stream("POST", url + "/v1/messages", json=body, headers=headers) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            kind = event["type"]
            if kind == "content_block_delta":
                delta = event["delta"]
                if delta["type"] == "text_delta":
                    text.append(delta["text"])
                elif delta["type"] == "input_json_delta":
                    calls[event["index"]]["input"] += delta["partial_json"]
            elif kind == "content_block_start" and event["content_block"]["type"] == "tool_use":
                block = event["content_block"]
                calls[event["index"]] = {"id": block["id"], "name": block["name"], "input": ""}
    # Read to the body's end, as every bare client here does: leaving at message_stop
    # closed the connection (httpx does not reuse an unfinished one), a new one a round.
    return "".join(text), list(calls.values())


def _bare_anthropic(url: str, rounds: int) -> Run:
    async def run() -> None:
        async with httpx.AsyncClient(verify=ssl_context(), timeout=30) as http:
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"rounds={rounds}"}]
            while True:
                text, calls = await _bare_anthropic_turn(http, url, messages)
                blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
                uses = [{"type": "tool_use", "id": c["id"], "name": c["name"],
                         "input": json.loads(c["input"] or "{}")} for c in calls]
                messages.append({"role": "assistant", "content": blocks + uses})
                if not calls:
                    return
                results = [{"type": "tool_result", "tool_use_id": use["id"],
                            "content": await noop(**use["input"])} for use in uses]
                messages.append({"role": "user", "content": results})

    return run


async def _bare_responses_turn(
    http: httpx.AsyncClient, url: str, items: list[dict[str, Any]]
) -> tuple[str, list[dict[str, Any]]]:
    """Responses SSE: text deltas, each function call whole at its output_item.done."""
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    body = {"model": "bench", "input": items, "tools": RESPONSES_TOOLS, "stream": True,
            "store": False}
    async with http.stream("POST", url + "/v1/responses", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            kind = event["type"]
            if kind == "response.output_text.delta":
                text.append(event["delta"])
            elif kind == "response.output_item.done" and event["item"]["type"] == "function_call":
                calls.append(event["item"])
    return "".join(text), calls


def _bare_responses(url: str, rounds: int, headers: Mapping[str, str] | None = None) -> Run:
    async def run() -> None:
        async with httpx.AsyncClient(verify=ssl_context(), timeout=30, headers=headers) as http:
            items: list[dict[str, Any]] = [{"role": "user", "content": f"rounds={rounds}"}]
            while True:
                text, calls = await _bare_responses_turn(http, url, items)
                if text:
                    items.append({"role": "assistant", "content": text})
                if not calls:
                    return
                for call in calls:
                    items.append({"type": "function_call", "call_id": call["call_id"],
                                  "name": call["name"], "arguments": call["arguments"]})
                    result = await noop(**json.loads(call["arguments"]))
                    items.append({"type": "function_call_output", "call_id": call["call_id"],
                                  "output": result})

    return run


async def _bare_gemini_turn(
    http: httpx.AsyncClient, url: str, contents: list[dict[str, Any]], endpoint: str = ""
) -> list[dict[str, Any]]:
    """streamGenerateContent SSE: the reply's parts as they came (signatures included).
    ``endpoint``: another URL (Vertex AI's), whose credential the client carries."""
    parts: list[dict[str, Any]] = []
    body = {"contents": contents, "tools": GEMINI_TOOLS}
    headers = None if endpoint else {"x-goog-api-key": "AIza-bench"}
    endpoint = endpoint or url + "/v1beta/models/bench:streamGenerateContent?alt=sse"
    async with http.stream("POST", endpoint, json=body, headers=headers) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            for candidate in json.loads(line[6:]).get("candidates") or ():
                parts += (candidate.get("content") or {}).get("parts") or ()
    return parts


def _bare_gemini(
    url: str, rounds: int, headers: Mapping[str, str] | None = None, endpoint: str = ""
) -> Run:
    async def run() -> None:
        async with httpx.AsyncClient(verify=ssl_context(), timeout=30, headers=headers) as http:
            contents: list[dict[str, Any]] = [
                {"role": "user", "parts": [{"text": f"rounds={rounds}"}]}]
            while True:
                parts = await _bare_gemini_turn(http, url, contents, endpoint)
                contents.append({"role": "model", "parts": parts})
                calls = [p["functionCall"] for p in parts if "functionCall" in p]
                if not calls:
                    return
                contents.append({"role": "user", "parts": [
                    {"functionResponse": {"name": c["name"],
                                          "response": {"output": await noop(**c["args"])}}}
                    for c in calls]})

    return run


async def _bare_turn(
    http: httpx.AsyncClient, provider: str, url: str, messages: list[dict[str, Any]]
) -> tuple[str, list[dict[str, Any]]]:
    if provider == "openai-responses":
        return await _bare_responses_turn(http, url, messages)
    if provider == "anthropic":
        return await _bare_anthropic_turn(http, url, messages)
    if provider == "gemini":
        contents = [{"role": "user", "parts": [{"text": m["content"]}]} for m in messages]
        parts = await _bare_gemini_turn(http, url, contents)
        text_parts = "".join(p.get("text", "") for p in parts)
        return text_parts, [p["functionCall"] for p in parts if "functionCall" in p]
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    if provider == "ollama":
        body = {"model": "bench", "messages": messages, "tools": TOOLS, "stream": True}
        async with http.stream("POST", url + "/api/chat", json=body) as response:
            async for line in response.aiter_lines():
                if line:
                    message = json.loads(line)["message"]
                    text.append(message.get("content", ""))
                    for call in message.get("tool_calls") or ():
                        calls[len(calls)] = call
        return "".join(text), list(calls.values())
    body = {"model": "bench", "messages": messages, "tools": TOOLS, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                text.append(delta.get("content") or "")
                for fragment in delta.get("tool_calls") or ():
                    call = calls.setdefault(fragment["index"], {
                        "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                    call["id"] = fragment.get("id") or call["id"]
                    function = fragment.get("function") or {}
                    call["function"]["name"] = function.get("name") or call["function"]["name"]
                    call["function"]["arguments"] += function.get("arguments") or ""
    return "".join(text), list(calls.values())


def bare(
    provider: str,
    url: str,
    rounds: int,
    headers: Mapping[str, str] | None = None,
    endpoint: str = "",
) -> Run:
    """The bare twin of ``provider`` (``headers``: a credential every request carries;
    ``endpoint``: gemini's URL elsewhere, as bench_clouds.py's doors need)."""
    if provider == "openai-responses":
        return _bare_responses(url, rounds, headers)
    if provider == "anthropic":
        return _bare_anthropic(url, rounds)
    if provider == "gemini":
        return _bare_gemini(url, rounds, headers, endpoint)

    async def run() -> None:
        async with httpx.AsyncClient(verify=ssl_context(), timeout=30, headers=headers) as http:
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"rounds={rounds}"}]
            while True:
                text, calls = await _bare_turn(http, provider, url, messages)
                reply: dict[str, Any] = {"role": "assistant", "content": text}
                if calls:
                    reply["tool_calls"] = calls
                messages.append(reply)
                if not calls:
                    return
                for call in calls:
                    arguments = call["function"]["arguments"]
                    if isinstance(arguments, str):
                        arguments = json.loads(arguments)
                    result = await noop(**arguments)
                    if provider == "ollama":
                        messages.append({"role": "tool", "content": result,
                                         "tool_name": call["function"]["name"]})
                    else:
                        messages.append({"role": "tool", "content": result,
                                         "tool_call_id": call["id"]})

    return run


# -- measurements --------------------------------------------------------------------


async def interleaved(runs: Mapping[str, Run], repeats: int) -> dict[str, tuple[float, float]]:
    """Median ms per run of each, wall and this process's CPU, run in turn so drift and
    noise hit all alike (the server's CPU is its own process's, not counted)."""
    for run in runs.values():
        await run()  # warm-up
    walls: dict[str, list[float]] = {name: [] for name in runs}
    cpus: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            gc.collect()
            wall, cpu = time.perf_counter(), time.process_time()
            await run()
            cpus[name].append((time.process_time() - cpu) * 1000)
            walls[name].append((time.perf_counter() - wall) * 1000)
    return {
        name: (statistics.median(walls[name]), statistics.median(cpus[name])) for name in runs
    }


async def per_round(url: str, rounds: int, repeats: int) -> dict[str, tuple[float, float]]:
    """µs per round, wall and client CPU, of each client and its bare twin."""
    runs: dict[str, Run] = {}
    for provider in PROVIDERS:
        runs[f"bare {provider}"] = bare(provider, url, rounds)
        runs[f"{provider}:"] = ours(provider, url, rounds)
    medians = await interleaved(runs, repeats)
    return {name: (w * 1000 / rounds, c * 1000 / rounds) for name, (w, c) in medians.items()}


async def rounds_table(url: str, repeats: int, rounds: int = 50) -> None:
    figures = await per_round(url, rounds, repeats)
    print(f"\nWhole tool rounds, {rounds} rounds, median of {repeats} interleaved runs, "
          "µs/round")
    print(f"{'client':<11} {'wall ours':>10} {'bare':>8} {'ratio':>6}   "
          f"{'client CPU ours':>15} {'bare':>8} {'ratio':>6}")
    for provider in PROVIDERS:
        (wall, cpu), (bare_wall, bare_cpu) = figures[f"{provider}:"], figures[f"bare {provider}"]
        print(f"{provider + ':':<11} {wall:>10.0f} {bare_wall:>8.0f} {wall / bare_wall:>5.2f}x   "
              f"{cpu:>15.0f} {bare_cpu:>8.0f} {cpu / bare_cpu:>5.2f}x")


async def growth(url: str, repeats: int, sizes: tuple[int, ...]) -> None:
    print(f"\nGrowth: client CPU µs/round at {', '.join(map(str, sizes))} rounds (a run of R "
          f"rounds sends ~R messages per request on average), median of {repeats}")
    table = {size: await per_round(url, size, repeats if size < 500 else max(3, repeats // 3))
             for size in sizes}
    for provider in PROVIDERS:
        mine, base = f"{provider}:", f"bare {provider}"
        cells = "  ".join(
            f"{size}: {table[size][mine][1]:.0f} vs {table[size][base][1]:.0f}" for size in sizes
        )
        print(f"{provider + ':':<11} {cells}")
        low, high = sizes[-2], sizes[-1]
        slopes = [
            (table[high][name][1] - table[low][name][1]) / (high - low)
            for name in (f"{provider}:", f"bare {provider}")
        ]
        print(f"{'':<11} per-message slope ({low}->{high}): ours {slopes[0] * 1000:.0f} ns, "
              f"bare {slopes[1] * 1000:.0f} ns, ratio {slopes[0] / slopes[1]:.2f}x")


# -- instructions ----------------------------------------------------------------------


def count(url: str, name: str, runs: int, rounds: int, script: str = __file__) -> int:
    """Instructions of ``script`` (this one) doing ``runs`` runs of ``name`` under
    callgrind."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "callgrind.out")
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
             sys.executable, script, "--instructions", name, "--url", url,
             "--runs", str(runs), "--rounds", str(rounds)],
            check=True, capture_output=True,
        )
        with open(out) as file:
            for line in file:
                if line.startswith("summary:") or line.startswith("totals:"):
                    return int(line.split()[1])
    raise RuntimeError("callgrind wrote no summary")


def instructions(
    url: str, rounds: int, rows: Sequence[str] = PROVIDERS, script: str = __file__
) -> None:
    """Per row (``bench_clouds.py`` passes its own, and itself as ``script``)."""
    print(f"\nInstructions per round (callgrind), {rounds} rounds: (2 runs - 1 run)")
    per: dict[str, float] = {}
    for provider in rows:
        for name in (f"bare {provider}", f"{provider}:"):
            one = count(url, name, 1, rounds, script)
            per[name] = (count(url, name, 2, rounds, script) - one) / rounds
    print(f"{'client':<11} {'ours':>12} {'bare httpx':>12} {'ratio':>7}")
    for provider in rows:
        mine, base = per[f"{provider}:"], per[f"bare {provider}"]
        print(f"{provider + ':':<11} {mine:>12,.0f} {base:>12,.0f} {mine / base:>6.2f}x",
              flush=True)


def play(name: str, url: str, runs: int, rounds: int) -> None:
    """``--instructions``: one warm-up run (excluded by the difference), then ``runs``."""
    provider = name.split()[-1].rstrip(":")
    run = bare(provider, url, rounds) if name.startswith("bare") else ours(provider, url, rounds)

    async def main() -> None:
        for _ in range(runs):
            await run()

    asyncio.run(main())


# -- many runs at once ------------------------------------------------------------------


async def concurrent(url: str, provider: str, count_: int, mine: bool) -> tuple[float, float]:
    """Client CPU µs per request for ``count_`` concurrent single-turn runs, and KiB of
    memory per run in flight (traced in a second pass while every run awaits its reply)."""

    async def go(slow: bool) -> None:
        task = "rounds=0 slow" if slow else "rounds=0"
        if mine:
            model = client(provider, url)
            agent = aio.Agent(model, tools=[noop])
            sessions = [agent.start() for _ in range(count_)]
            await asyncio.gather(*(s.run(task) for s in sessions))
            await model.aclose()
        else:
            # The same pool size as ours, without the bound in front: requests queue in
            # httpcore, which scans the queue on every start and finish.
            limits = httpx.Limits(max_connections=DEFAULT_CONCURRENCY,
                                  max_keepalive_connections=DEFAULT_CONCURRENCY)
            timeout = httpx.Timeout(60, pool=None)
            async with httpx.AsyncClient(verify=ssl_context(), timeout=timeout,
                                         limits=limits) as http:
                await asyncio.gather(*(
                    _bare_turn(http, provider, url, [{"role": "user", "content": task}])
                    for _ in range(count_)
                ))

    await go(False)  # warm-up: connections open
    gc.collect()
    start = time.process_time()
    await go(False)
    cpu = (time.process_time() - start) * 1e6 / count_
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    task = asyncio.create_task(go(True))
    await asyncio.sleep(0.1)  # every run has started and waits: the reply takes 0.2 s
    in_flight = tracemalloc.get_traced_memory()[0] - base
    await task
    tracemalloc.stop()
    return cpu, in_flight / count_ / 1024


async def concurrency(url: str, sizes: tuple[int, ...]) -> None:
    """Ours at every size; bare httpx at the first only (with 10,000 requests queued in
    httpcore, whose scans grow with the queue, it takes many minutes here)."""
    print("\nConcurrent single-turn runs: client CPU µs per request, KiB per run in flight")
    for provider in PROVIDERS:
        for size in sizes:
            mine = await concurrent(url, provider, size, True)
            line = f"{provider + ':':<11} {size:>6} runs: ours {mine[0]:>6.0f} µs "
            line += f"{mine[1]:>5.1f} KiB"
            if size == sizes[0]:
                base = await concurrent(url, provider, size, False)
                line += (f" | bare httpx, queued in httpcore {base[0]:>6.0f} µs "
                         f"{base[1]:>5.1f} KiB | ratio {mine[0] / base[0]:.2f}x")
            print(line, flush=True)


# -- cancel to closed --------------------------------------------------------------------


async def cancel_to_closed(
    repeats: int,
    rows: Sequence[str] = PROVIDERS,
    make: Callable[[str, str], aio.ModelClient] | None = None,
) -> None:
    """A streamed turn cancelled after its first chunk: ms until the server sees it go
    (each row's client from ``make``, else :func:`client`)."""
    from aimu.testing.script import Turn
    from aimu.testing.server import LoopbackServer

    words = " ".join(f"w{i}" for i in range(200))
    print(f"\nCancel to closed: a streamed turn closed after its first chunk, ms until the "
          f"server sees the connection go, {repeats} tries")
    with LoopbackServer.in_thread(lambda request: Turn(text=words, delay=0.005)) as server:
        for provider in rows:
            model = (make or client)(provider, server.url)
            times: list[float] = []
            for _ in range(repeats + 1):
                before = len([s for s in server.streams if s.abandoned])
                turn = model.stream_turn([{"role": "user", "content": "go"}])
                await anext(turn)
                closing = time.monotonic()
                await turn.aclose()
                records = await server.wait_abandoned(before + 1)
                times.append((max(r.abandoned_at or 0.0 for r in records) - closing) * 1000)
            await model.aclose()
            times = sorted(times[1:])  # the first opened the connection pool: left out
            p90 = times[min(len(times) - 1, int(len(times) * 0.9))]
            print(f"{provider + ':':<11} median {statistics.median(times):.2f} ms, "
                  f"p90 {p90:.2f} ms")


# -- a background response stopped ---------------------------------------------------------


def serve_background() -> None:
    """``--serve-background``: a loopback server of long replies that prints, on its clock
    (``time.monotonic()``, one system-wide clock on Linux), when it saw each stream closed
    and each background response cancelled: ``closed T`` and ``cancelled T`` lines."""
    from aimu.testing.script import Turn
    from aimu.testing.server import LoopbackServer

    words = " ".join(f"w{i}" for i in range(200))

    async def main() -> None:
        async with LoopbackServer(lambda request: Turn(text=words, delay=0.005)) as server:
            print(server.url, flush=True)
            closed = cancelled = 0

            def news(closed: int, cancelled: int) -> bool:
                return (len(server.background.cancelled) > cancelled
                        or sum(s.abandoned for s in server.streams) > closed)

            while True:
                await server.wait_until(lambda c=closed, k=cancelled: news(c, k), timeout=3600)
                for record in [s for s in server.streams if s.abandoned][closed:]:
                    print(f"closed {record.abandoned_at}", flush=True)
                    closed += 1
                for _ in server.background.cancelled[cancelled:]:
                    print(f"cancelled {time.monotonic()}", flush=True)
                    cancelled += 1

    asyncio.run(main())


async def background_stop(repeats: int) -> None:
    """``openai-responses:`` with ``background=True``, a streamed turn closed after its first
    chunk: ms until the server sees the stream closed, and until it has taken the
    ``POST /v1/responses/{id}/cancel`` (its work stopped). The server runs in a process of
    its own, as a remote one would: in a thread of this process it waited for the GIL
    while the client built the cancel request, which measured the GIL (3-10 ms), not
    the stop."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--serve-background", stdout=subprocess.PIPE
    )
    assert process.stdout is not None
    lines = process.stdout
    url = (await lines.readline()).decode().strip()
    closed: list[float] = []
    cancelled: list[float] = []
    try:
        model = aio.client("openai-responses:bench", base_url=url + "/v1", api_key="k",
                           background=True)
        for _ in range(repeats + 1):
            turn = model.stream_turn([{"role": "user", "content": "go"}])
            await anext(turn)
            closing = time.monotonic()
            await turn.aclose()
            seen: dict[str, float] = {}
            while len(seen) < 2:
                kind, _, at = (await lines.readline()).decode().partition(" ")
                seen[kind] = float(at)
            closed.append((seen["closed"] - closing) * 1000)
            cancelled.append((seen["cancelled"] - closing) * 1000)
        await model.aclose()
    finally:
        process.terminate()
        await process.wait()
    print(f"\nA background response stopped after its first chunk, {repeats} tries, ms:")
    for name, times in (("stream closed", closed[1:]), ("cancel taken", cancelled[1:])):
        times.sort()
        p90 = times[min(len(times) - 1, int(len(times) * 0.9))]
        print(f"{name:<14} median {statistics.median(times):.2f}, p90 {p90:.2f}")


async def main(options: argparse.Namespace) -> None:
    with server_process() as url:
        if options.quick:
            await rounds_table(url, 1, 5)
            await growth(url, 1, (2, 4))
            await concurrency(url, (10,))
            await cancel_to_closed(3)
            await background_stop(3)
            return
        await rounds_table(url, options.repeats)
        await growth(url, options.repeats, (10, 100, 500))
        if options.callgrind:
            instructions(url, 50)
        await concurrency(url, (1000, 10000))
        await cancel_to_closed(options.repeats * 7)
        await background_stop(options.repeats * 7)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--callgrind", action="store_true", help="also count instructions")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-background", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--instructions", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=50, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.serve:
        serve()
    elif options.serve_background:
        serve_background()
    elif options.instructions:
        play(options.instructions, options.url, options.runs, options.rounds)
    else:
        print(f"python {sys.version.split()[0]}, httpx {httpx.__version__}")
        asyncio.run(main(options))
