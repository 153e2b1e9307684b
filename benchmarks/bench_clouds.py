"""The clouds' doors: ``azure:``, ``azure-responses:`` and ``vertex:`` whole tool rounds
against bare httpx on the same wire and door, and how soon the server sees a cancelled
stream closed.

    python benchmarks/bench_clouds.py              # 50 rounds, 15 repeats; 105 cancels
    python benchmarks/bench_clouds.py --callgrind  # + instructions per round (valgrind)
    python benchmarks/bench_clouds.py --quick      # a smoke run (CI)

As benchmarks/bench_wire.py (whose loopback server process and bare turns this reuses):
each sample is a whole run built as a user builds it (a client made, an agent with one
no-op tool, ``rounds`` tool rounds, the answer, the client closed); the baseline is a bare
``httpx.AsyncClient`` with the door's credential header doing the same requests in the
same run, keeping the transcript as wire dicts. The server checks every credential.
Rows with a changing credential: ``azure: (provider)`` asks an async Entra ID token
provider before each request, ``azure: (sync provider)`` a plain function (in a worker
thread), ``vertex: (credentials)`` checks google-auth credentials (valid: no refresh).

Prints µs per round at ``--rounds`` rounds, ours / bare (target ≤ 1.1x), wall and client
CPU; then cancel to closed (target: median < 1 ms), with ``openai:`` and ``gemini:``
measured beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
from bench_wire import (
    GEMINI_TOOLS,
    Run,
    _bare_responses_turn,
    _bare_turn,
    interleaved,
    noop,
    server_process,
)
from bench_wire import client as wire_client

from aimu import aio
from aimu.aio.providers._http import ssl_context
from aimu.testing.server.clouds import AZURE_KEY, TOKEN

PROJECT, LOCATION = "bench-project", "us-central1"
VERTEX_PATH = (f"/v1/projects/{PROJECT}/locations/{LOCATION}/publishers/google/models/"
               "bench:streamGenerateContent?alt=sse")


async def _async_token() -> str:
    return TOKEN


def _sync_token() -> str:
    return TOKEN


def client(name: str, url: str) -> aio.ModelClient:
    """Our client for the row ``name`` at the loopback server's root ``url``."""
    if name.startswith("vertex"):
        auth: dict[str, Any] = {"token": TOKEN}
        if "credentials" in name:
            from google.oauth2.credentials import Credentials

            auth = {"credentials": Credentials(TOKEN)}
        return aio.client("vertex:bench", project=PROJECT, location=LOCATION, base_url=url,
                          **auth)
    wire = name.split()[0]
    auth = {"api_key": AZURE_KEY}
    if "sync provider" in name:
        auth = {"azure_ad_token_provider": _sync_token}
    elif "provider" in name:
        auth = {"azure_ad_token_provider": _async_token}
    return aio.client(f"{wire}bench", base_url=url + "/openai/v1", **auth)


def ours(name: str, url: str, rounds: int) -> Run:
    async def run() -> None:
        model = client(name, url)
        agent = aio.Agent(model, tools=[noop], max_rounds=rounds + 1)
        await agent.run(f"rounds={rounds}")
        await model.aclose()

    return run


def _http(headers: dict[str, str]) -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=ssl_context(), timeout=30, headers=headers)


def bare_azure(url: str, rounds: int) -> Run:
    """Chat completions at ``/openai/v1`` with the ``api-key`` header."""

    async def run() -> None:
        async with _http({"api-key": AZURE_KEY}) as http:
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"rounds={rounds}"}]
            while True:
                text, calls = await _bare_turn(http, "openai", url + "/openai", messages)
                reply: dict[str, Any] = {"role": "assistant", "content": text}
                if calls:
                    reply["tool_calls"] = calls
                messages.append(reply)
                if not calls:
                    return
                for call in calls:
                    result = await noop(**json.loads(call["function"]["arguments"]))
                    messages.append({"role": "tool", "content": result,
                                     "tool_call_id": call["id"]})

    return run


def bare_azure_responses(url: str, rounds: int) -> Run:
    """The Responses API at ``/openai/v1`` with the ``api-key`` header."""

    async def run() -> None:
        async with _http({"api-key": AZURE_KEY}) as http:
            items: list[dict[str, Any]] = [{"role": "user", "content": f"rounds={rounds}"}]
            while True:
                text, calls = await _bare_responses_turn(http, url + "/openai", items)
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


def bare_vertex(url: str, rounds: int) -> Run:
    """streamGenerateContent at the Vertex path with a bearer token."""

    async def run() -> None:
        async with _http({"Authorization": f"Bearer {TOKEN}"}) as http:
            contents: list[dict[str, Any]] = [
                {"role": "user", "parts": [{"text": f"rounds={rounds}"}]}]
            while True:
                parts: list[dict[str, Any]] = []
                body = {"contents": contents, "tools": GEMINI_TOOLS}
                async with http.stream("POST", url + VERTEX_PATH, json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            for candidate in json.loads(line[6:]).get("candidates") or ():
                                parts += (candidate.get("content") or {}).get("parts") or ()
                contents.append({"role": "model", "parts": parts})
                calls = [p["functionCall"] for p in parts if "functionCall" in p]
                if not calls:
                    return
                contents.append({"role": "user", "parts": [
                    {"functionResponse": {"name": c["name"],
                                          "response": {"output": await noop(**c["args"])}}}
                    for c in calls]})

    return run


#: Each row of ours and the bare client it is held against.
ROWS = {
    "azure:": bare_azure,
    "azure: (provider)": bare_azure,
    "azure: (sync provider)": bare_azure,
    "azure-responses:": bare_azure_responses,
    "vertex:": bare_vertex,
    "vertex: (credentials)": bare_vertex,
}


async def rounds_table(url: str, repeats: int, rounds: int) -> None:
    runs: dict[str, Run] = {}
    for name, bare in ROWS.items():
        runs[f"bare {name}"] = bare(url, rounds)
        runs[name] = ours(name, url, rounds)
    medians = await interleaved(runs, repeats)
    per = {name: (w * 1000 / rounds, c * 1000 / rounds) for name, (w, c) in medians.items()}
    print(f"\nWhole tool rounds, {rounds} rounds, median of {repeats} interleaved runs, "
          "µs/round")
    print(f"{'client':<23} {'wall ours':>10} {'bare':>8} {'ratio':>6}   "
          f"{'client CPU ours':>15} {'bare':>8} {'ratio':>6}")
    for name in ROWS:
        (wall, cpu), (bare_wall, bare_cpu) = per[name], per[f"bare {name}"]
        print(f"{name:<23} {wall:>10.0f} {bare_wall:>8.0f} {wall / bare_wall:>5.2f}x   "
              f"{cpu:>15.0f} {bare_cpu:>8.0f} {cpu / bare_cpu:>5.2f}x")


#: The clients cancel_to_closed() measures: the doors, and the public wires beside them
#: (on the same server and machine load).
NAMES = ("openai:", "azure:", "azure-responses:", "vertex:", "gemini:")


async def cancel_to_closed(repeats: int) -> None:
    """A streamed turn closed after its first chunk: ms until the server sees it go."""
    from aimu.testing.script import Turn
    from aimu.testing.server import LoopbackServer

    words = " ".join(f"w{i}" for i in range(200))
    print(f"\nCancel to closed: a streamed turn closed after its first chunk, ms until the "
          f"server sees the connection go, {repeats} tries")
    with LoopbackServer.in_thread(lambda request: Turn(text=words, delay=0.005)) as server:
        for name in NAMES:
            if name in ("openai:", "gemini:"):
                model = wire_client(name[:-1], server.url)
            else:
                model = client(name, server.url)
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
            print(f"{name:<17} median {statistics.median(times):.2f} ms, p90 {p90:.2f} ms")


def count(url: str, name: str, runs: int, rounds: int) -> int:
    """Instructions of this script doing ``runs`` runs of row ``name`` under callgrind."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "callgrind.out")
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
             sys.executable, __file__, "--instructions", name, "--url", url,
             "--runs", str(runs), "--rounds", str(rounds)],
            check=True, capture_output=True,
        )
        with open(out) as file:
            for line in file:
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
    raise RuntimeError("callgrind wrote no summary")


def instructions(url: str, rounds: int, rows: tuple[str, ...]) -> None:
    """Per round, the client alone: a 2-run process minus a 1-run process (start-up,
    imports and the first run's one-time costs cancel); deterministic, unlike wall time
    on a shared machine."""
    print(f"\nInstructions per round (callgrind), {rounds} rounds: (2 runs - 1 run)")
    print(f"{'client':<23} {'ours':>12} {'bare httpx':>12} {'ratio':>7}")
    for name in rows:
        per = [(count(url, which, 2, rounds) - count(url, which, 1, rounds)) / rounds
               for which in (name, f"bare {name}")]
        print(f"{name:<23} {per[0]:>12,.0f} {per[1]:>12,.0f} {per[0] / per[1]:>6.2f}x",
              flush=True)


def play(name: str, url: str, runs: int, rounds: int) -> None:
    """``--instructions``: one warm-up run (excluded by the difference), then ``runs``."""
    row = name.removeprefix("bare ")
    run = ROWS[row](url, rounds) if name.startswith("bare ") else ours(row, url, rounds)

    async def main() -> None:
        for _ in range(runs):
            await run()

    asyncio.run(main())


async def main(options: argparse.Namespace) -> None:
    with server_process() as url:
        if options.quick:
            await rounds_table(url, 1, 5)
            await cancel_to_closed(3)
            return
        await rounds_table(url, options.repeats, options.rounds)
        if options.callgrind:
            instructions(url, options.rounds, ("azure:", "azure-responses:", "vertex:"))
        await cancel_to_closed(options.repeats * 7)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--callgrind", action="store_true", help="also count instructions")
    parser.add_argument("--instructions", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=1, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.instructions:
        play(options.instructions, options.url, options.runs, options.rounds)
    else:
        print(f"python {sys.version.split()[0]}, httpx {httpx.__version__}")
        asyncio.run(main(options))
