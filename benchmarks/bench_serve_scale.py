"""Many runs held by one ``aimu serve`` process, or by one Temporal worker process.

    python benchmarks/bench_serve_scale.py --n 1000 --redis redis://127.0.0.1:6379 \\
        --temporal dev --postgres postgresql://postgres@127.0.0.1:5432/test
    python benchmarks/bench_serve_scale.py --quick     # a smoke run: 10 runs, local and at rest

The model is the loopback server (``aimu.testing.server``, OpenAI-compatible wire) in its
own process (``bench_scale.Server``). Scenarios (``--scenarios``; by default every one
the options allow):

* ``local``, ``redis``: N runs started over HTTP (``POST /sessions/{s}/runs``) on one
  ``aimu serve`` process (SQLite store; ``redis``: the Redis backend), each followed over
  SSE (``GET /runs/{id}/events``) and held mid-stream by the model server after its first
  text, then all cancelled over HTTP at once (``POST /runs/{id}/cancel``): p50/p99 of
  cancel sent -> the model server saw that run's stream closed (``time.monotonic``, one
  clock for every process), the time until every cancel was answered, and the server's
  RSS per run in flight (less its RSS after one warm-up run).
* ``temporal``: the same, ``aimu serve`` handing the runs to Temporal (``--temporal``;
  ``dev`` starts a dev server) and one worker process (``AgentWorker``, concurrency N,
  Redis control) running them: the worker's RSS per run.
* ``rest-sqlite``, ``rest-postgres``: N runs each paused for an approval (its one tool
  has ``approval=True``), started ``--batch`` at a time: the server's RSS per paused run
  (gc'd), the asyncio tasks it still holds per run, and the store's bytes per run
  (SQLite: pages in use; PostgreSQL: ``pg_total_relation_size`` of the store's schema, a
  schema of its own, dropped after); then every run approved at once: seconds until all
  finished, and how many did not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scale import REST, ROOT, SERVED, Server, percentile

SCENARIOS = ("local", "redis", "temporal", "rest-sqlite", "rest-postgres")

# The serve child: the runs API, plus a stats route of this benchmark's own.
APP = """
import asyncio, gc, logging, os, uvicorn
from aimu import aio, serve
from aimu.aio.store import PostgresStore

def approve_me() -> str:
    \"\"\"A step a person approves.\"\"\"
    return "approved"

logging.basicConfig(level=logging.WARNING, format="  serve: %(levelname)s %(message)s")
model = aio.client("openai:test", base_url=os.environ["BENCH_MODEL_URL"])
store = os.environ["BENCH_STORE"]
if store.startswith("postgresql://"):
    store = PostgresStore(store, schema=os.environ["BENCH_SCHEMA"],
                          max_writers=int(os.environ["BENCH_WRITERS"]))
app = serve.app(model, store=store, token=None, tools=[aio.tool(approve_me, approval=True)],
                redis=os.environ.get("BENCH_REDIS") or None,
                redis_prefix=os.environ["BENCH_PREFIX"],
                temporal=os.environ.get("BENCH_TEMPORAL") or None,
                task_queue=os.environ.get("BENCH_QUEUE") or None)

async def stats() -> dict[str, int]:
    gc.collect()
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"rss": rss, "tasks": len(asyncio.all_tasks())}

app.add_api_route("/bench/stats", stats, methods=["GET"])
# Kept-alive connections outlive the bench's pauses: one closed for idleness just as a
# request went out on it failed that request (httpx.ReadError) with nothing wrong.
uvicorn.run(app, host="127.0.0.1", port=int(os.environ["BENCH_PORT"]), log_level="warning",
            backlog=4096, timeout_keep_alive=600)
"""

# The Temporal worker child: one AgentWorker taking N runs at once, Redis control.
WORKER = """
import asyncio, os
from aimu import aio
from aimu.aio.control import RedisControl
from aimu.serve.agents import agent_factory, open_store
from aimu.temporal import AgentWorker

async def main() -> None:
    store, close_store = open_store(os.environ["BENCH_STORE"])
    model = aio.client("openai:test", base_url=os.environ["BENCH_MODEL_URL"])
    agents, close_model = agent_factory(model, store)
    control = RedisControl(os.environ["BENCH_REDIS"], os.environ["BENCH_PREFIX"])
    await control.connect()
    worker = AgentWorker(agents, store, temporal=os.environ["BENCH_TEMPORAL"],
                         task_queue=os.environ["BENCH_QUEUE"], redis=control,
                         concurrency=int(os.environ["BENCH_N"]),
                         heartbeat=float(os.environ["BENCH_HEARTBEAT"]))
    await worker.start()
    print("ready", flush=True)
    await worker.run()

asyncio.run(main())
"""


def vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Clients:
    """httpx clients of 32 connections each (one pool of 2N would cost this side O(N) a
    request); followers on fresh connections: a GET sent on a kept-alive one just as the
    server closes it for idleness fails before any event."""

    def __init__(self, url: str, n: int) -> None:
        self.calls = [httpx.AsyncClient(base_url=url, timeout=300,
                                        limits=httpx.Limits(max_connections=32))
                      for _ in range(n // 32 + 1)]
        self.watchers = [httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(
            max_connections=32, max_keepalive_connections=0)) for _ in range(n // 32 + 1)]

    def call(self, i: int) -> httpx.AsyncClient:
        return self.calls[i % len(self.calls)]

    async def aclose(self) -> None:
        for http in self.calls + self.watchers:
            await http.aclose()


@contextlib.asynccontextmanager
async def child(code: str, env: dict[str, str], ready: str | None = None
                ) -> AsyncIterator[asyncio.subprocess.Process]:
    """A child process running ``code``; with ``ready``, wait for that line on stdout."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, env={**os.environ, "PYTHONPATH": ROOT, **env},
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if ready else None)
    try:
        if ready:
            assert process.stdout is not None
            async with asyncio.timeout(120):
                while (line := await process.stdout.readline()) and line.strip() != b"ready":
                    pass
            if process.returncode is not None:
                raise RuntimeError("the worker process ended")
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            async with asyncio.timeout(30):
                await process.wait()
        except TimeoutError:  # said, then killed: the figures measured are kept
            print(f"  a child ({code.split(chr(10))[1][:40]!r}...) did not exit 30 s after "
                  "SIGTERM: killed", file=sys.stderr, flush=True)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


async def until_healthy(http: httpx.AsyncClient) -> None:
    for _ in range(1200):
        with contextlib.suppress(httpx.TransportError):
            if (await http.get("/health")).status_code == 200:
                return
        await asyncio.sleep(0.05)
    raise RuntimeError("aimu serve did not start")


async def start_run(http: httpx.AsyncClient, session: str, task: str) -> str:
    response = await http.post(f"/sessions/{session}/runs", json={"task": task})
    response.raise_for_status()
    return str(response.json()["run_id"])


async def wait_status(clients: Clients, run_ids: list[str], wanted: set[str],
                      seconds: float) -> dict[str, dict[str, Any]]:
    """Poll the runs until each is in ``wanted`` or ``seconds`` passed; their last views."""
    views: dict[str, dict[str, Any]] = {}
    left = list(run_ids)
    deadline = time.monotonic() + seconds

    async def view(i: int, run_id: str) -> None:
        # A kept-alive connection the server closed for idleness: asked again next time.
        with contextlib.suppress(httpx.TransportError):
            views[run_id] = (await clients.call(i).get(f"/runs/{run_id}")).json()

    while left and time.monotonic() < deadline:
        await asyncio.gather(*(view(i, r) for i, r in enumerate(left)))
        left = [r for r in left if views.get(r, {}).get("status") not in wanted]
        if left:
            await asyncio.sleep(0.2)
    return views


# -- N runs streaming, followed over SSE, cancelled over HTTP ----------------------------


async def streaming(server: Server, url: str, n: int, measured: Callable[[], int],
                    wait: float = 300.0) -> dict[str, Any]:
    """N runs held mid-stream with their followers, then cancelled at once (after
    ``wait`` s at most for every follower to see text); ``measured`` reads the RSS of the
    process that runs them."""
    clients = Clients(url, n)
    try:
        await until_healthy(clients.call(0))
        warm = await start_run(clients.call(0), "warm-up", "warm up")  # imports, connections
        await wait_status(clients, [warm], {"completed"}, 120)
        idle = measured()
        texts = dropped = 0
        all_text = asyncio.Event()

        async def follow(i: int, run_id: str) -> None:
            nonlocal texts, dropped
            seen = False
            http = clients.watchers[i % len(clients.watchers)]
            try:
                async with http.stream("GET", f"/runs/{run_id}/events") as response:
                    async for line in response.aiter_lines():
                        if line == "event: text" and not seen:
                            seen = True
                            texts += 1
                        if texts + dropped >= n:
                            all_text.set()
                        if line == "event: handle_finished":
                            return
            except httpx.HTTPError:  # the server dropped this follower
                dropped += 1
            finally:
                if texts + dropped >= n:
                    all_text.set()

        began = time.perf_counter()
        started = await asyncio.gather(
            *(start_run(clients.call(i), f"scale-{i}", f"{SERVED}{i}") for i in range(n)),
            return_exceptions=True)
        failures = [r for r in started if not isinstance(r, str)]
        if failures:
            print(f"  {len(failures)} of {n} starts failed; the first: {failures[0]!r:.300}",
                  file=sys.stderr, flush=True)
            texts = len(failures)  # no text to wait for from these
        runs = [(i, r) for i, r in enumerate(started) if isinstance(r, str)]
        run_ids = [r for _, r in runs]
        followers = [asyncio.ensure_future(follow(i, r)) for i, r in runs]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await all_text.wait()
        started_s = time.perf_counter() - began
        held = server.ask(f"held {n} 1")["held"]
        print(f"  streaming: {texts} of {n} followers saw text, {dropped} dropped; the model "
              f"server: {server.ask('stats')}", file=sys.stderr, flush=True)
        in_flight = measured()
        sent: dict[str, float] = {}

        refused: list[int] = []

        async def cancel(i: int, run_id: str) -> None:
            sent[f"{SERVED}{i}"] = time.monotonic()
            response = await clients.call(i).post(f"/runs/{run_id}/cancel")
            if response.status_code >= 400:  # 409: the run had ended (failed) already
                refused.append(response.status_code)

        begin = time.monotonic()
        await asyncio.gather(*(cancel(i, r) for i, r in runs))
        cancels = time.monotonic() - begin
        if refused:
            print(f"  {len(refused)} cancels refused: {sorted(set(refused))}", file=sys.stderr)
        closed = server.ask(f"tags {held} 120")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(120):
                await asyncio.gather(*followers, return_exceptions=True)
        ended = await wait_status(clients, run_ids, {"cancelled", "completed", "failed"}, 60)
        latencies = [(closed[tag] - at) * 1000 for tag, at in sent.items() if tag in closed]
        return {
            "n": n, "start_failed": len(failures), "start_s": started_s, "held": held,
            "closed": len(latencies),
            "dropped": dropped, "texts": texts - len(failures),
            "live_after": sum(v.get("status") in ("pending", "running") for v in ended.values()),
            "cancel_p50_ms": percentile(latencies, 0.5) if latencies else float("nan"),
            "cancel_p99_ms": percentile(latencies, 0.99) if latencies else float("nan"),
            "cancels_ms": cancels * 1000, "rss_per_run_kb": (in_flight - idle) / n / 1024,
            "load": os.getloadavg()[0],
        }
    finally:
        await clients.aclose()


def base_env(server: Server, store: str) -> dict[str, str]:
    return {"BENCH_MODEL_URL": server.url, "BENCH_STORE": store, "BENCH_PORT": str(free_port()),
            "BENCH_PREFIX": f"bench-{secrets.token_hex(4)}", "BENCH_SCHEMA": "aimu",
            "BENCH_WRITERS": "32"}


async def serve_scale(server: Server, n: int, store: str, redis: str | None,
                      wait: float) -> dict[str, Any]:
    server.ask("reset")
    env = {**base_env(server, store), "BENCH_REDIS": redis or ""}
    async with child(APP, env) as app:
        row = await streaming(server, f"http://127.0.0.1:{env['BENCH_PORT']}", n,
                              lambda: vm_rss(app.pid), wait)
    return {"scenario": "redis" if redis else "local", "process": "aimu serve", **row}


async def temporal_scale(server: Server, n: int, store: str, redis: str, temporal: str,
                         heartbeat: float, wait: float) -> dict[str, Any]:
    server.ask("reset")
    env = {**base_env(server, store), "BENCH_REDIS": redis, "BENCH_TEMPORAL": temporal,
           "BENCH_QUEUE": f"bench-scale-{secrets.token_hex(4)}", "BENCH_N": str(n),
           "BENCH_HEARTBEAT": str(heartbeat)}
    async with child(WORKER, env, ready="ready") as worker, child(APP, env):
        row = await streaming(server, f"http://127.0.0.1:{env['BENCH_PORT']}", n,
                              lambda: vm_rss(worker.pid), wait)
    return {"scenario": "temporal", "process": "worker", **row}


# -- N runs at rest: paused for an approval -------------------------------------------------


def sqlite_bytes(path: str) -> int:
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        free = db.execute("PRAGMA freelist_count").fetchone()[0]
        size = db.execute("PRAGMA page_size").fetchone()[0]
    return int((pages - free) * size)


async def postgres_bytes(dsn: str, schema: str, drop: bool = False) -> int:
    import asyncpg

    db = await asyncpg.connect(dsn)
    try:
        if drop:
            await db.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            return 0
        return int(await db.fetchval(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            "JOIN pg_namespace s ON s.oid = c.relnamespace "
            "WHERE s.nspname = $1 AND c.relkind = 'r'", schema))
    finally:
        await db.close()


async def at_rest(server: Server, n: int, store: str, batch: int) -> dict[str, Any]:
    """N runs paused for an approval, started ``batch`` at a time; then all approved."""
    server.ask("reset")
    env = base_env(server, store)
    schema = env["BENCH_SCHEMA"] = f"bench_scale_{secrets.token_hex(4)}"
    postgres = store.startswith("postgresql://")

    async def store_bytes() -> int:
        if postgres:
            return await postgres_bytes(store, schema)
        return await asyncio.to_thread(sqlite_bytes, store)

    clients = Clients(f"http://127.0.0.1:{env['BENCH_PORT']}", batch)
    try:
        async with child(APP, env):
            http = clients.call(0)
            await until_healthy(http)
            warm = await start_run(http, "rest-warm", f"{REST}warm")
            await wait_status(clients, [warm], {"paused"}, 120)
            idle = (await http.get("/bench/stats")).json()
            idle_bytes = await store_bytes()
            run_ids: list[str] = []
            began = time.perf_counter()
            for first in range(0, n, batch):
                started = await asyncio.gather(*(
                    start_run(clients.call(i), f"rest-{i}", f"{REST}{i}")
                    for i in range(first, min(n, first + batch))))
                await wait_status(clients, started, {"paused", "failed", "cancelled"}, 120)
                run_ids += started
            paused_s = time.perf_counter() - began
            views = await wait_status(clients, run_ids, {"paused"}, 1)
            paused = [r for r in run_ids if views[r].get("status") == "paused"]
            rest = (await http.get("/bench/stats")).json()
            rest_bytes = await store_bytes()

            async def approve(i: int, run_id: str) -> str | None:
                call = views[run_id]["pending"][0]
                response = await clients.call(i).post(
                    f"/runs/{run_id}/approvals/{call['call_id']}", json={"approve": True})
                response.raise_for_status()
                resumed = response.json().get("resumed_run_id")
                return str(resumed) if resumed else None

            began = time.perf_counter()
            resumed = await asyncio.gather(*(approve(i, r) for i, r in enumerate(paused)))
            finished = await wait_status(clients, [r for r in resumed if r],
                                         {"completed", "failed", "cancelled"}, 300)
            approved_s = time.perf_counter() - began
        return {
            "scenario": "rest-postgres" if postgres else "rest-sqlite", "n": n,
            "paused": len(paused), "paused_s": paused_s,
            "rss_per_run_kb": (rest["rss"] - idle["rss"]) / n / 1024,
            "tasks_per_run": (rest["tasks"] - idle["tasks"]) / n,
            "bytes_per_run": (rest_bytes - idle_bytes) / n,
            "completed": sum(v.get("status") == "completed" for v in finished.values()),
            "approved_s": approved_s, "load": os.getloadavg()[0],
        }
    finally:
        await clients.aclose()
        if postgres:
            await postgres_bytes(store, schema, drop=True)


# -- the orchestrator -------------------------------------------------------------------------


def fmt(value: Any, digits: str = ".0f") -> str:
    return "-" if value is None else format(value, digits)


def table(title: str, head: tuple[str, ...], lines: list[tuple[Any, ...]]) -> None:
    print(f"\n{title}")
    for cells in (head, ("---",) * len(head), *lines):
        print("| " + " | ".join(str(c) for c in cells) + " |")


def report(rows: list[dict[str, Any]], n: int) -> None:
    moving = [r for r in rows if not r["scenario"].startswith("rest")]
    if moving:
        table(f"{n:,} runs started over HTTP, each followed over SSE, held mid-stream, then "
              "all cancelled over HTTP at once",
              ("scenario", "runs in", "started (of N)", "streaming", "s to all streaming",
               "cancel → stream closed p50 ms", "p99 ms", "closed", "all cancels answered ms",
               "RSS KB/run", "live after", "load"),
              [(r["scenario"], r["process"], r["n"] - r["start_failed"], r["texts"],
                f"{r['start_s']:.1f}", fmt(r["cancel_p50_ms"]), fmt(r["cancel_p99_ms"]),
                f"{r['closed']}/{r['held']}", f"{r['cancels_ms']:.0f}",
                f"{r['rss_per_run_kb']:.1f}", r["live_after"], f"{r['load']:.1f}")
               for r in moving])
    resting = [r for r in rows if r["scenario"].startswith("rest")]
    if resting:
        table(f"{n:,} runs at rest (paused for an approval) in one aimu serve process; then "
              "all approved at once",
              ("store", "paused (of N)", "s to pause all", "RSS KB/run", "tasks/run",
               "store bytes/run", "s to finish all approved", "completed", "load"),
              [(r["scenario"][5:], r["paused"], f"{r['paused_s']:.1f}",
                f"{r['rss_per_run_kb']:.1f}", f"{r['tasks_per_run']:.3f}",
                f"{r['bytes_per_run']:.0f}", f"{r['approved_s']:.1f}", r["completed"],
                f"{r['load']:.1f}") for r in resting])


async def scenario_row(options: argparse.Namespace, server: Server, scenario: str,
                       temporal: str | None, sqlite: str) -> dict[str, Any]:
    n = options.n
    if scenario in ("local", "redis"):
        return await serve_scale(server, n, sqlite, options.redis if scenario == "redis" else None,
                                 options.wait)
    if scenario == "temporal":
        return await temporal_scale(server, n, sqlite, options.redis, str(temporal),
                                    options.heartbeat, options.wait)
    store = options.postgres if scenario == "rest-postgres" else sqlite
    return await at_rest(server, n, store, options.batch)


async def run_all(options: argparse.Namespace, scenarios: list[str],
                  temporal: str | None) -> list[dict[str, Any]]:
    server = Server(options.delay)
    rows: list[dict[str, Any]] = []
    try:
        for _ in range(options.repeats):
            for scenario in scenarios:
                with tempfile.TemporaryDirectory() as home:
                    row = await scenario_row(options, server, scenario, temporal,
                                             os.path.join(home, "sessions.db"))
                print(f"  {row}", file=sys.stderr, flush=True)
                rows.append(row)
    finally:
        server.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000, help="runs at once (default 1000)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--redis", help="redis://... for the redis and temporal scenarios")
    parser.add_argument("--postgres", help="postgresql://... for rest-postgres (a schema of "
                        "its own is made and dropped)")
    parser.add_argument("--temporal", help="HOST:PORT, or 'dev' to start a dev server")
    parser.add_argument("--heartbeat", type=float, default=1.0,
                        help="the worker's heartbeat seconds (default 1.0)")
    parser.add_argument("--wait", type=float, default=300.0,
                        help="seconds to wait for every follower to see text before the "
                        "cancel-all (default 300)")
    parser.add_argument("--batch", type=int, default=16,
                        help="runs at rest: started this many at a time (default 16)")
    parser.add_argument("--delay", type=float, default=0.005, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a smoke run: N=10")
    options = parser.parse_args()
    if options.quick:
        options.n = 10
    needs = {"redis": options.redis, "temporal": options.redis and options.temporal,
             "rest-postgres": options.postgres}
    scenarios = [s for s in options.scenarios.split(",") if s]
    for scenario in scenarios:
        if scenario not in SCENARIOS:
            parser.error(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    skipped = [s for s in scenarios if s in needs and not needs[s]]
    if skipped:
        print(f"skipped (give --redis, --temporal, --postgres): {', '.join(skipped)}")
    scenarios = [s for s in scenarios if s not in skipped]
    with contextlib.ExitStack() as stack:
        temporal = options.temporal
        if "temporal" in scenarios and temporal == "dev":
            from bench_temporal import dev_server

            temporal = stack.enter_context(dev_server(None))
        rows = asyncio.run(run_all(options, scenarios, temporal))
    report(rows, options.n)


if __name__ == "__main__":
    main()
