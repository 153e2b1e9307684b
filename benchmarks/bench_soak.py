"""Soak: ``aimu serve --recover`` replicas killed with ``kill -9`` while they run (issue 34
item 6).

Two ``aimu serve --recover`` processes share one PostgreSQL store (and, with ``--redis``,
one Redis). ``--runs`` sessions each run ``--steps`` rounds of a tool with a side effect
recorded outside aimu (a row in ``soak_effects`` keyed by the call's id, its attempts in
``soak_attempts``), at most ``--concurrency`` at a time, started on either replica. Every
``--kill-every`` seconds (jittered) a random replica is killed with SIGKILL and started
again; once every run completed, both get SIGTERM. Then, from the store and the effect
tables alone, it checks:

- every run ends completed (none lost), and each session's transcript says so;
- none resumed twice: each run that died is followed by exactly one run of its session;
- every record right: each ended, a dead run's says why, no mark left;
- no side effect twice: exactly one effect row per (session, step); a call in doubt
  (its process died inside the tool) runs again, and the key makes that a no-op;
- budgets held: no run recorded more requests than ``--max-requests``, and the model
  server received at most that many per run of each session and at most
  ``--session-max-requests`` in all (the replicas' session budget: a request a killed
  replica sent was counted in the store before it went out);
- both replicas exit 0 on SIGTERM.

It prints a table with the time from a kill to each killed run going on again (p50,
p99: the new run's record started minus the kill), and exits 1 if a check failed.

    python benchmarks/bench_soak.py --postgres postgresql://postgres@127.0.0.1/test
    python benchmarks/bench_soak.py --postgres ... --redis redis://127.0.0.1:6379/0

The model is the loopback server, in this process: the figures are aimu's, not a
vendor's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from aimu import aio
from aimu.testing.script import ScriptedCall, Turn

ROOT = Path(__file__).resolve().parents[1]
CRASHED = "its process died"  # aimu.serve.recovery.CRASHED (serve extra not needed here)
_POOLS: dict[int, Any] = {}


@aio.tool(idempotent=True)
async def effect(run: str, step: int, ctx: aio.ToolContext) -> str:
    """Do step ``step`` of ``run``: a row keyed by the run and step (so a second try of
    the same step does nothing), after a while (kills land inside it)."""
    import asyncpg

    loop = id(asyncio.get_running_loop())
    if loop not in _POOLS:
        _POOLS[loop] = await asyncpg.create_pool(os.environ["AIMU_SOAK_DSN"], min_size=1,
                                                 max_size=4)
    pool = _POOLS[loop]
    await pool.execute("INSERT INTO soak_attempts (call_id, session) VALUES ($1, $2)",
                       ctx.call_id, run)
    await asyncio.sleep(float(os.environ.get("AIMU_SOAK_TOOL_SECONDS", "0.2")))
    await pool.execute(
        "INSERT INTO soak_effects (call_id, session, step) VALUES ($1, $2, $3) "
        "ON CONFLICT (session, step) DO NOTHING", ctx.call_id, run, step,
    )
    return f"step {step} of {run} done"


@dataclass
class Model:
    """The loopback model's script: ``soak NAME``: ``steps`` rounds calling effect (the
    call ids are the session's and the step's, as a real model's may not be: the effect
    must not depend on them), then a last text; counts requests per session."""

    steps: int
    requests: Counter[str] = field(default_factory=Counter)

    def __call__(self, request: Mapping[str, Any]) -> Turn:
        messages = list(request.get("messages") or [])
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        said = str(messages[users[-1]].get("content")) if users else ""
        name = said.partition(" ")[2]
        self.requests[name] += 1
        results = [str(m.get("content")) for m in messages[users[-1]:]
                   if m.get("role") == "tool"] if users else []
        done = sum(1 for r in results if _answered(r))
        if done < self.steps:  # a failed try (an error result) is tried again
            tries = len(results) - done
            call = ScriptedCall("effect", {"run": name, "step": done + 1},
                                id=f"{name}-step{done + 1}" + (f"-try{tries}" if tries else ""))
            return Turn(text="working on the next step", tool_calls=(call,), delay=0.02)
        return Turn(text=f"all {self.steps} steps of {name} done", delay=0.02)


def _answered(result: str) -> bool:
    """The tool's answer, or its answer run again after a crash (aimu says so first)."""
    return result.startswith("step ") or (result.startswith("[in doubt") and " done" in result)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Replica:
    """One ``aimu serve --recover`` process, started again after each kill."""

    name: str
    args: list[str]
    env: dict[str, str]
    log: Path
    port: int = field(default_factory=free_port)
    process: asyncio.subprocess.Process | None = None
    kills: list[float] = field(default_factory=list)
    starting: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.starting = True
        try:
            await self._start()
        finally:
            self.starting = False

    async def _start(self) -> None:
        with self.log.open("ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "aimu", "serve", "--port", str(self.port), *self.args,
                cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            )
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as http:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get("/health")).status_code == 200:
                        return
                if self.process.returncode is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} did not start: see {self.log}")
                await asyncio.sleep(0.05)

    @property
    def up(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.kills.append(time.time())
        await self.process.wait()

    async def stop(self) -> int:
        """SIGTERM (a drain); the exit status."""
        assert self.process is not None
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.process.wait(), 120)


@contextlib.asynccontextmanager
async def database(admin_dsn: str) -> AsyncIterator[str]:
    """A PostgreSQL database for one soak, with the effect tables; dropped afterwards."""
    import asyncpg

    name = f"aimu_soak_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        dsn = urlunsplit(urlsplit(admin_dsn)._replace(path=f"/{name}"))
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(
                "CREATE TABLE soak_effects (call_id text NOT NULL, session text NOT NULL,"
                " step integer NOT NULL, PRIMARY KEY (session, step));"
                "CREATE TABLE soak_attempts (call_id text NOT NULL, session text NOT NULL,"
                " at timestamptz NOT NULL DEFAULT now())"
            )
        finally:
            await conn.close()
        yield dsn
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


@dataclass
class Soak:
    runs: int
    steps: int
    concurrency: int
    kill_every: float
    max_requests: int
    session_max_requests: int
    seed: int
    replicas: list[Replica] = field(default_factory=list)
    started: dict[str, float] = field(default_factory=dict)
    completed: set[str] = field(default_factory=set)
    lost_requests: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    _running: set[asyncio.Future[None]] = field(default_factory=set)

    async def feed(self, store: Any) -> None:
        """Start the runs, ``concurrency`` at a time, each on a replica that is up."""
        rng = random.Random(self.seed)
        slots = asyncio.Semaphore(self.concurrency)
        async with httpx.AsyncClient(timeout=10) as http:
            for n in range(self.runs):
                await slots.acquire()
                one = asyncio.ensure_future(self._one(f"soak-{n}", store, http, rng, slots))
                self._running.add(one)
                one.add_done_callback(self._running.discard)
            while self._running:
                await asyncio.gather(*self._running)

    async def _one(
        self, name: str, store: Any, http: httpx.AsyncClient, rng: random.Random,
        slots: asyncio.Semaphore,
    ) -> None:
        """Start run ``name`` and wait until it completed. A 202 comes once the run's
        record is stored: one without (``lost_requests``, a failure: a replica killed
        after answering lost the run) is sent again, so the soak goes on."""
        try:
            while True:
                up = [r for r in self.replicas if r.up] or self.replicas
                replica = rng.choice(up)
                answer = None
                with contextlib.suppress(httpx.TransportError):
                    answer = await http.post(f"{replica.url}/sessions/{name}/runs",
                                             json={"task": f"soak {name}"})
                if answer is None or answer.status_code != 202:
                    await asyncio.sleep(0.1)  # that replica is down or draining: another
                    continue
                if await store.run(answer.json()["run_id"]) is not None:
                    break
                self.lost_requests += 1
            self.started[name] = time.time()
            while name not in self.completed:  # noqa: ASYNC110 - watch() updates it
                await asyncio.sleep(0.1)
        finally:
            slots.release()

    async def watch(self, store: Any) -> None:
        """Note the sessions whose latest run completed, until all did."""
        while len(self.completed) < self.runs:
            latest: dict[str, str] = {}
            before = None
            while True:
                page = await store.runs(limit=1000, before=before)
                for record in page:
                    latest.setdefault(record.session, record.status)
                if len(page) < 1000:
                    break
                before = page[-1].id
            self.completed = {s for s, status in latest.items() if status == "completed"}
            if len(self.completed) >= self.runs:
                self.done.set()
                return
            await asyncio.sleep(0.2)

    async def kill(self) -> None:
        """Kill a random replica every ``kill_every`` seconds (jittered) and start it
        again, until every run completed."""
        rng = random.Random(self.seed + 1)
        while len(self.completed) < self.runs:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(), self.kill_every * rng.uniform(0.6, 1.4))
            if self.done.is_set():
                return
            up = [r for r in self.replicas if r.up and not r.starting]
            if not up:
                continue
            replica = rng.choice(up)
            await replica.kill()
            restart = asyncio.ensure_future(replica.start())  # the other one serves on
            self._running.add(restart)
            restart.add_done_callback(self._running.discard)


async def checks(soak: Soak, store: Any, dsn: str, model: Model) -> dict[str, Any]:
    """What the store and the effect tables say, and the checks' failures."""
    import asyncpg

    failures: list[str] = []
    kills = sorted(k for r in soak.replicas for k in r.kills)
    lags: list[float] = []
    resumed = 0
    for n in range(soak.runs):
        name = f"soak-{n}"
        records = sorted(await store.runs(session=name, limit=1000), key=lambda r: r.started)
        if not records or records[-1].status != "completed":
            failures.append(f"{name}: lost ({[r.status for r in records]})")
            continue
        for record, after in itertools.pairwise(records):
            died = (record.reason or "").startswith(CRASHED)
            if not died and record.status not in ("interrupted", "cancelled"):
                failures.append(f"{name}: run {record.id} {record.status} was followed")
            if record.ended is None or record.recover:
                failures.append(f"{name}: run {record.id} left unended or marked")
            if died:
                resumed += 1
                killed = [k for k in kills if record.started <= k <= after.started]
                if killed:
                    lags.append(after.started - killed[-1])
        # Each run has its budget, and the session one in all: the requests the model
        # server received for the session stay within both.
        if model.requests[name] > min(soak.max_requests * len(records),
                                      soak.session_max_requests):
            failures.append(f"{name}: {model.requests[name]} requests for {len(records)} runs")
        for record in records:
            if (record.spend or {}).get("requests", 0) > soak.max_requests:
                failures.append(f"{name}: run {record.id} spent past its budget")
        last = (await store.load(name))[-1]
        if last["role"] != "assistant" or not str(last.get("content")).endswith(" done"):
            failures.append(f"{name}: its transcript ends {last!r:.80}")
    if soak.lost_requests:
        failures.append(f"{soak.lost_requests} runs answered 202 had no record")
    conn = await asyncpg.connect(dsn)
    try:
        effects = await conn.fetch("SELECT session, step FROM soak_effects")
        attempts = await conn.fetchval("SELECT count(*) FROM soak_attempts")
    finally:
        await conn.close()
    per_step = Counter((row["session"], row["step"]) for row in effects)
    if len(per_step) != soak.runs * soak.steps or max(per_step.values(), default=0) > 1:
        failures.append(f"effects: {len(effects)} rows for {soak.runs * soak.steps} steps")
        for n in range(soak.runs):
            for step in range(1, soak.steps + 1):
                if per_step[(f"soak-{n}", step)] != 1:
                    said = [m.get("content") for m in await store.load(f"soak-{n}")
                            if str(m.get("tool_call_id")).startswith(f"soak-{n}-step{step}")]
                    failures.append(f"soak-{n} step {step}: {per_step[(f'soak-{n}', step)]} "
                                    f"effects; its results: {said}")
    errors = 0
    kinds: Counter[str] = Counter()
    for n in range(soak.runs):
        for m in await store.load(f"soak-{n}"):
            if m.get("role") == "tool" and not _answered(str(m.get("content"))):
                errors += 1
                kinds[str(m.get("content"))[:90]] += 1
    print(f"tool results that were not the tool's answer: {kinds.most_common(3)}",
          file=sys.stderr)
    return {
        "errors": errors, "kills": len(kills), "resumed": resumed, "lags": lags,
        "effects": len(effects),
        "reruns": attempts - len(effects), "failures": failures,
        "lost_requests": soak.lost_requests,
    }


def _serve_args(options: argparse.Namespace, dsn: str, prefix: str) -> list[str]:
    args = ["--model", "openai:loop", "--store", dsn, "--recover",
            "--recover-every", str(options.recover_every),
            "--max-crashes", str(options.max_crashes),
            "--tool", "bench_soak:effect", "--max-requests", str(options.max_requests),
            "--session-max-requests", str(options.session_max_requests),
            "--log-level", "warning", "--drain", "10"]
    if options.redis:
        args += ["--redis", options.redis, "--redis-prefix", prefix]
    return args


async def soak(options: argparse.Namespace) -> dict[str, Any]:
    from aimu.aio.store import PostgresStore
    from aimu.testing.server import LoopbackServer

    model = Model(options.steps)
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as temporary, LoopbackServer.in_thread(model) as server:
        logs = options.logs or temporary
        async with database(options.postgres) as dsn:
            env = {**os.environ, "OPENAI_BASE_URL": server.openai_base_url,
                   "OPENAI_API_KEY": "sk-soak", "AIMU_SOAK_DSN": dsn,
                   "AIMU_SOAK_TOOL_SECONDS": str(options.tool_seconds),
                   "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}
            env.pop("AIMU_API_TOKEN", None)
            args = _serve_args(options, dsn, f"soak{secrets.token_hex(3)}")
            run = Soak(options.runs, options.steps, options.concurrency, options.kill_every,
                       options.max_requests, options.session_max_requests, options.seed)
            run.replicas = [Replica(f"replica-{i}", args, env, Path(logs) / f"{i}.log")
                            for i in range(2)]
            await asyncio.gather(*(r.start() for r in run.replicas))
            store = PostgresStore(dsn)
            try:
                work = asyncio.gather(run.feed(store), run.watch(store), run.kill())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(work, options.timeout)
                await asyncio.gather(*list(run._running), return_exceptions=True)  # restarts
                statuses = await asyncio.gather(*(r.stop() for r in run.replicas))
                found = await checks(run, store, dsn, model)
            finally:
                await store.aclose()
            if any(statuses):
                found["failures"].append(f"exit statuses on SIGTERM: {statuses}")
            if len(run.completed) < options.runs:
                found["failures"].append(f"{len(run.completed)} of {options.runs} completed "
                                         f"within {options.timeout:g} s")
            if found["failures"]:
                for replica in run.replicas:
                    sys.stderr.write(replica.log.read_text(errors="replace")[-3000:])
    found["wall"] = time.monotonic() - began
    return found


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    made.add_argument("--postgres", required=True, metavar="DSN",
                      help="an admin DSN: the soak makes (and drops) its own database")
    made.add_argument("--redis", default=None, metavar="URL", help="replicas share this Redis")
    made.add_argument("--runs", type=int, default=200)
    made.add_argument("--steps", type=int, default=3, help="tool rounds per run")
    made.add_argument("--tool-seconds", type=float, default=0.2,
                      help="how long each tool call takes (kills land inside them)")
    made.add_argument("--concurrency", type=int, default=20, help="runs in flight at once")
    made.add_argument("--kill-every", type=float, default=4.0, metavar="SECONDS")
    made.add_argument("--max-requests", type=int, default=12, help="each run's budget")
    made.add_argument("--session-max-requests", type=int, default=40,
                      help="each session's budget, all its runs together")
    made.add_argument("--recover-every", type=float, default=1.0, metavar="SECONDS",
                      help="how often each replica looks for runs to go on with")
    made.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS")
    made.add_argument("--max-crashes", type=int, default=10, metavar="N",
                      help="the replicas' --max-crashes: kills at random hit one run "
                      "again and again more often than a real crash loop stops at 3")
    made.add_argument("--seed", type=int, default=34)
    made.add_argument("--logs", default=None, metavar="DIR", help="keep the replicas' logs here")
    return made


def main() -> int:
    options = parser().parse_args()
    found = asyncio.run(soak(options))
    lags = found["lags"]
    store = "PostgreSQL" + (" + Redis" if options.redis else "")
    print(f"soak: 2 replicas of aimu serve --recover on {store}, {options.runs} runs of "
          f"{options.steps} tool rounds, {options.concurrency} at a time, a kill -9 every "
          f"~{options.kill_every:g} s; load {os.getloadavg()[0]:.1f}")
    print(f"{'kills':>6} {'resumed':>8} {'reruns':>7} {'effects':>8} "
          f"{'p50 s':>6} {'p99 s':>6} {'max s':>6} {'wall s':>7} {'failed':>6}")
    print(f"{found['kills']:>6} {found['resumed']:>8} {found['reruns']:>7} "
          f"{found['effects']:>8} {_quantile(lags, 0.5):>6.2f} {_quantile(lags, 0.99):>6.2f} "
          f"{max(lags, default=0.0):>6.2f} {found['wall']:>7.1f} {len(found['failures']):>6}")
    if lags:
        print(f"crash -> going on again: n={len(lags)}, mean {statistics.fmean(lags):.2f} s")
    print(f"tool calls that failed (an error result; the model tried the step again): "
          f"{found['errors']}")
    print(f"runs answered 202 without a record (lost; sent again): {found['lost_requests']}")
    for failure in found["failures"]:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if found["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
