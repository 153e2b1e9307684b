"""The floor of issue 45's burst goal: N POSTs sent at once to a bare Starlette app under
Uvicorn, and the time from each send to its handler.

    python benchmarks/bench_cancel_burst.py [--n 1000] [--repeats 3]
    python benchmarks/bench_cancel_burst.py --stacks h11/asyncio,httptools/uvloop
    python benchmarks/bench_cancel_burst.py --quick

The app (a child process, Uvicorn with backlog 4096, on each of ``--stacks``: an HTTP
protocol / event loop pair, as ``aimu serve --http ... --loop ...`` picks; the stacks'
bursts interleaved) has one
route that stamps ``time.monotonic()`` (one clock for every process) as its handler
runs, and one that returns the stamps. The client is ``bench_serve_scale.py``'s: httpx
clients of 32 connections each, the connections opened first (as a bench's starts and
followers leave them), then N POSTs at once, each stamped as it is sent. This is what
any Python server on this host pays to reach the handler of the N-th of N requests that
arrive together, with nothing else to do; ``aimu serve``'s figure for the same burst (its
runs held, their followers connected) is ``trace_serve_scale.py``'s "serve: cancel
handler" row.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scale import percentile
from bench_serve_scale import Clients, free_port, until_healthy

APP = """
import os, time, uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

STAMPS: dict[str, float] = {}

async def cancel(request):
    STAMPS[request.path_params["run_id"]] = time.monotonic()
    return JSONResponse({}, status_code=202)

async def stamps(request):
    taken = dict(STAMPS)
    STAMPS.clear()
    return JSONResponse(taken)

async def health(request):
    return JSONResponse({})

app = Starlette(routes=[Route("/runs/{run_id}/cancel", cancel, methods=["POST"]),
                       Route("/stamps", stamps), Route("/health", health)])
uvicorn.run(app, host="127.0.0.1", port=int(os.environ["BENCH_PORT"]), log_level="warning",
            backlog=4096, timeout_keep_alive=600, http=os.environ["BENCH_HTTP"],
            loop=os.environ["BENCH_LOOP"])
"""


async def burst(clients: Clients, n: int) -> list[float]:
    """N POSTs at once; ms from each send to its handler."""
    sent: dict[str, float] = {}

    async def post(i: int) -> None:
        sent[f"r{i}"] = time.monotonic()
        (await clients.call(i).post(f"/runs/r{i}/cancel")).raise_for_status()

    await asyncio.gather(*(post(i) for i in range(n)))
    handled = (await clients.call(0).get("/stamps")).json()
    return [(handled[run] - at) * 1000 for run, at in sent.items()]


def spawn(port: int, stack: str) -> subprocess.Popen[bytes]:
    http, loop = stack.split("/")
    return subprocess.Popen([sys.executable, "-c", APP],
                            env={**os.environ, "BENCH_PORT": str(port), "BENCH_HTTP": http,
                                 "BENCH_LOOP": loop})


class Stack:
    """One server process on one HTTP protocol / loop pair, its connections open."""

    def __init__(self, stack: str, n: int) -> None:
        self.name, self.n = stack, n
        port = free_port()
        self.process = spawn(port, stack)
        self.clients = Clients(f"http://127.0.0.1:{port}", n)
        self.rows: list[tuple[float, float, float]] = []

    async def open(self) -> None:
        await until_healthy(self.clients.call(0))
        # Open the connections first (one request on each), as the runs' starts do.
        await asyncio.gather(*(self.clients.call(i).get("/health") for i in range(self.n)))

    async def burst(self) -> None:
        latencies = await burst(self.clients, self.n)
        self.rows.append((percentile(latencies, 0.5), percentile(latencies, 0.99),
                          max(latencies)))

    async def close(self) -> None:
        await self.clients.aclose()
        self.process.terminate()
        self.process.wait(30)


async def main(options: argparse.Namespace) -> None:
    n = 50 if options.quick else options.n
    repeats = 1 if options.quick else options.repeats
    stacks = [Stack(name, n) for name in options.stacks.split(",")]
    try:
        for stack in stacks:
            await stack.open()
        for _ in range(repeats):
            for stack in stacks:  # interleaved: each stack's bursts beside the others'
                await stack.burst()
        print(f"{n} POSTs at once to a bare Starlette app under Uvicorn; ms from each send "
              f"to its handler, median of {repeats} bursts")
        print("| HTTP / loop | N | p50 ms | p99 ms | max ms |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for stack in stacks:
            p50, p99, most = (statistics.median(r[k] for r in stack.rows) for k in range(3))
            print(f"| {stack.name} | {n} | {p50:.1f} | {p99:.1f} | {most:.1f} |")
    finally:
        for stack in stacks:
            await stack.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="POSTs at once")
    parser.add_argument("--repeats", type=int, default=3, help="bursts")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 50 POSTs, once")
    parser.add_argument("--stacks", default="h11/asyncio",
                        help="HTTP protocol/loop pairs, comma-separated (httptools, uvloop)")
    asyncio.run(main(parser.parse_args()))
