"""`aimu serve` over real HTTP: events per second through SSE, and how fast Stop lands.

    python benchmarks/bench_serve.py [--quick] [--redis URL]

Servers run in child processes (Uvicorn, as `aimu serve` runs it), so the clients here
and the servers do not share a GIL.

- SSE throughput: a run of a scripted in-process model with no delay emits N text events;
  1 and then 100 followers read the whole stream from the start. Events per second
  delivered to each follower and to all of them, beside the same run consumed in-process
  (``RunHandle.events()``, no HTTP), measured in the same run.
- Stop latency: a run streams from the loopback model server (in this process); once a
  follower saw its first text event, ``POST /runs/{id}/cancel``; time from sending the
  request to the model server recording the stream abandoned. Through one server, and,
  with Redis, across two (start on A, Stop on B), beside ``handle.cancel()`` in-process
  on the same loopback server. Medians and p90 of interleaved repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from aimu import aio
from aimu.testing.script import Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer

ROOT = Path(__file__).resolve().parents[1]

# The child: aimu.serve.app on Uvicorn, model from the environment.
LAUNCH = """
import os, uvicorn
from aimu import aio, serve
from aimu.testing.script import Turn
from aimu.testing.scripted import ScriptedModel
url = os.environ.get("BENCH_MODEL_URL")
words = int(os.environ.get("BENCH_WORDS", "0"))
reply = lambda request: Turn(text=" ".join(f"w{i}" for i in range(words)))
model = aio.client("openai:loop", base_url=url, api_key="x") if url else ScriptedModel(reply)
app = serve.app(model, store=os.environ["BENCH_STORE"], redis=os.environ.get("BENCH_REDIS"),
                redis_prefix=os.environ.get("BENCH_PREFIX", "aimu"))
uvicorn.run(app, host="127.0.0.1", port=int(os.environ["BENCH_PORT"]), log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.asynccontextmanager
async def server(store: Path, **env: str) -> AsyncIterator[str]:
    port = free_port()
    child_env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_STORE": str(store),
                 "BENCH_PORT": str(port), **env}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LAUNCH, env=child_env, stdin=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url) as http:
            for _ in range(600):
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get("/health")).status_code == 200:
                        break
                await asyncio.sleep(0.05)
            else:
                raise RuntimeError("the server did not start")
        yield url
    finally:
        process.terminate()
        await process.wait()


async def follow(http: httpx.AsyncClient, run_id: str, *, until: str = "handle_finished") -> int:
    """Read the run's events until an event of type ``until``; return how many were read."""
    count = 0
    async with http.stream("GET", f"/runs/{run_id}/events") as response:
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                count += 1
                if line[7:] == until:
                    break
    return count


async def start(http: httpx.AsyncClient, session: str, task: str) -> str:
    response = await http.post(f"/sessions/{session}/runs", json={"task": task})
    response.raise_for_status()
    return str(response.json()["run_id"])


# -- throughput ----------------------------------------------------------------------------


def words_reply(words: int) -> Callable[[Mapping[str, Any]], Turn]:
    return lambda request: Turn(text=" ".join(f"w{i}" for i in range(words)))


async def in_process_rate(words: int) -> tuple[int, float]:
    agent = aio.Agent(ScriptedModel(words_reply(words)))
    handle = aio.RunHandle.start(agent.run("go"))
    events = handle.events(maxsize=1 << 20)
    begin = time.perf_counter()
    count = 0
    async for _ in events:
        count += 1
    elapsed = time.perf_counter() - begin
    await agent.aclose()
    return count, elapsed


async def sse_rate(url: str, task: str, followers: int, session: str) -> tuple[int, float]:
    limits = httpx.Limits(max_connections=followers + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        begin = time.perf_counter()
        run_id = await start(http, session, task)
        counts = await asyncio.gather(*(follow(http, run_id) for _ in range(followers)))
        elapsed = time.perf_counter() - begin
    assert len(set(counts)) == 1, counts
    return counts[0], elapsed


async def throughput(words: int, repeats: int) -> list[tuple[str, str, str]]:
    task = "go"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        async with server(Path(tmp) / "s.db", BENCH_WORDS=str(words)) as url:
            for followers in (1, 100):
                local: list[float] = []
                remote: list[float] = []
                count = 0
                for repeat in range(repeats):
                    n, seconds = await in_process_rate(words)
                    local.append(n / seconds)
                    count, seconds = await sse_rate(url, task, followers, f"t{followers}-{repeat}")
                    remote.append(count / seconds)
                per = statistics.median(remote)
                rows.append((
                    f"{count} events to {followers} follower{'s' if followers > 1 else ''}",
                    f"{per:,.0f} events/s per follower ({per * followers:,.0f}/s in all)",
                    f"{statistics.median(local):,.0f} events/s",
                ))
    return rows


# -- stop latency ----------------------------------------------------------------------------


async def stop_through(model: LoopbackServer, start_on: str, stop_on: str, session: str) -> float:
    async with (
        httpx.AsyncClient(base_url=start_on, timeout=30) as a,
        httpx.AsyncClient(base_url=stop_on, timeout=30) as b,
    ):
        abandoned = len([s for s in model.streams if s.abandoned])
        run_id = await start(a, session, "long")
        await follow(b, run_id, until="text")
        sent = time.monotonic()
        response = await b.post(f"/runs/{run_id}/cancel")
        response.raise_for_status()
        records = await model.wait_abandoned(abandoned + 1, timeout=30)
        seen = max(r.abandoned_at or 0.0 for r in records)
        await follow(a, run_id)  # the run has ended before the next sample
        return (seen - sent) * 1000


async def stop_in_process(model: LoopbackServer) -> float:
    agent = aio.Agent(aio.client("openai:loop", base_url=model.openai_base_url, api_key="x"))
    handle = aio.RunHandle.start(agent.run("long"))
    events = handle.events()
    async for event in events:
        if event.type == "text":
            break
    abandoned = len([s for s in model.streams if s.abandoned])
    sent = time.monotonic()
    handle.cancel()
    records = await model.wait_abandoned(abandoned + 1, timeout=30)
    seen = max(r.abandoned_at or 0.0 for r in records)
    with contextlib.suppress(asyncio.CancelledError):
        await handle
    await events.aclose()
    await agent.aclose()
    return (seen - sent) * 1000


async def round_trip(url: str) -> float:
    async with httpx.AsyncClient(base_url=url) as http:
        await http.get("/health")  # connected
        sent = time.monotonic()
        await http.get("/health")
        return (time.monotonic() - sent) * 1000


def slow_reply(request: Mapping[str, Any]) -> Turn:
    return Turn(text=" ".join(f"x{i}" for i in range(2000)), delay=0.01)


def summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
    return f"median {statistics.median(samples):.2f} ms, p90 {p90:.2f} ms"


async def stop_latency(repeats: int, redis: str | None) -> list[tuple[str, str, str]]:
    with LoopbackServer.in_thread(slow_reply) as model, tempfile.TemporaryDirectory() as tmp:
        env = {"BENCH_MODEL_URL": model.openai_base_url}
        if redis:
            env.update(BENCH_REDIS=redis, BENCH_PREFIX=f"bench-serve-{secrets.token_hex(4)}")
        store = Path(tmp) / "s.db"
        async with server(store, **env) as a, contextlib.AsyncExitStack() as stack:
            b = await stack.enter_async_context(server(store, **env)) if redis else None
            one: list[float] = []
            two: list[float] = []
            base: list[float] = []
            trip: list[float] = []
            for repeat in range(repeats):
                trip.append(await round_trip(a))
                base.append(await stop_in_process(model))
                one.append(await stop_through(model, a, a, f"one-{repeat}"))
                if b is not None:
                    two.append(await stop_through(model, a, b, f"two-{repeat}"))
        rows = [("GET /health round trip (what any request costs here)", summary(trip), "-"),
                ("Stop → model server sees the stream abandoned, one server",
                 summary(one), summary(base))]
        if two:
            rows.append(("... across two servers (start on A, Stop on B, Redis)",
                         summary(two), summary(base)))
        return rows


def table(rows: list[tuple[str, str, str]]) -> None:
    header = ("measurement", "aimu serve", "in-process, same run")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


async def main(quick: bool, redis: str | None) -> None:
    print(f"Python {sys.version.split()[0]}, {sys.platform}")
    rows = await throughput(words=200 if quick else 2000, repeats=1 if quick else 5)
    rows += await stop_latency(repeats=2 if quick else 20, redis=redis)
    table(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: few samples")
    parser.add_argument("--redis", default=None, help="Redis URL: also measure across two servers")
    options = parser.parse_args()
    asyncio.run(main(options.quick, options.redis))
