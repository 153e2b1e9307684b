"""Store overhead: the agent loop with each store against no store, loads, and HTTP rounds.

    python benchmarks/bench_store.py [--rounds 200] [--repeats 7] [--postgres DSN] [--only-budget]

Every figure is printed next to its baseline from the same run (medians of interleaved
repeats, so a noisy neighbour hurts every variant alike):

- per tool round, ``--rounds`` rounds of the scripted model and a no-op tool (two
  messages stored per round), with no store, ``SQLiteStore`` (and ``exclusive=True``),
  ``JSONLStore`` (background fsync, and none) and ``PostgresStore`` (and
  ``synchronous_commit=False``). Targets: SQLite <= 2.5x, PostgreSQL <= 3x no store.
- one ``append`` alone, beside the floor under it: a bare ``sqlite3`` INSERT with the
  same pragmas, a PostgreSQL ``SELECT 1`` round trip and an INSERT commit.
- loading a 10,000-message session (target under 150 ms for PostgreSQL).
- what a store adds to a real HTTP tool round: the same loop against the loopback
  server (``openai:`` over httpx), the figure a user feels.
- what keeping the session's spend before each model request costs (an agent with
  ``session_limits``, a budget never reached, against the same store without): the
  write that makes a kill -9 loop unable to escape a session budget.

PostgreSQL runs when ``--postgres`` (or ``AIMU_BENCH_POSTGRES_DSN``, else the local
``postgresql://postgres@127.0.0.1:5432/test``) answers; it works in a schema of its own,
dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from aimu.aio.agent import Agent
from aimu.aio.client import client
from aimu.aio.limits import UsageLimits
from aimu.aio.store import JSONLStore, SQLiteStore, Store
from aimu.aio.transcript import Message, dumps, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel, tool_turn
from aimu.testing.server import LoopbackServer

LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
Maker = Callable[[], Store | None]


async def noop() -> str:
    """Do nothing."""
    return "ok"


def _script(rounds: int) -> list[Turn]:
    return [*(tool_turn(("noop", {})) for _ in range(rounds)), Turn(text="done")]


def _served(rounds: int) -> Callable[[Mapping[str, Any]], Turn]:
    """The loopback server's model: ``rounds`` tool calls after the task, then "done"."""

    def turn(request: Mapping[str, Any]) -> Turn:
        messages = request["messages"]
        start = max(i for i, m in enumerate(messages) if m["role"] == "user")
        if sum(1 for m in messages[start:] if m["role"] == "tool") < rounds:
            return Turn(tool_calls=(ScriptedCall("noop", {}, id=f"call_{len(messages)}"),))
        return Turn(text="done")

    return turn


async def _postgres_answers(dsn: str) -> bool:
    try:
        import asyncpg
    except ImportError:
        return False
    try:
        conn = await asyncpg.connect(dsn, timeout=3)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return False
    await conn.close()
    return True


def _makers(directory: Path, dsn: str | None, schema: str) -> dict[str, Maker]:
    makers: dict[str, Maker] = {
        "no store": lambda: None,
        "SQLiteStore (WAL, synchronous=NORMAL)": lambda: SQLiteStore(directory / "loop.db"),
        "SQLiteStore (exclusive=True)": lambda: SQLiteStore(
            directory / "loop-x.db", exclusive=True
        ),
        "JSONLStore (fsync per line, background)": lambda: JSONLStore(directory / "jsonl"),
        "JSONLStore (fsync=False)": lambda: JSONLStore(directory / "jsonl-nofsync", fsync=False),
    }
    if dsn is not None:
        from aimu.aio.store import PostgresStore

        makers["PostgresStore (synchronous_commit on)"] = lambda: PostgresStore(
            dsn, schema=schema
        )
        makers["PostgresStore (synchronous_commit=False)"] = lambda: PostgresStore(
            dsn, schema=schema, synchronous_commit=False
        )
    return makers


async def _timed_run(
    model: Any, rounds: int, store: Store | None, session: str,
    session_limits: UsageLimits | None = None,
    limits: UsageLimits | None = None,
) -> float:
    """One run of ``rounds`` tool rounds; the session is opened before the clock starts."""
    agent = Agent(
        model,
        tools=[noop],
        max_rounds=rounds + 1,
        store=store,
        session=session if store is not None else None,
        session_limits=session_limits,
        limits=limits,
    )
    try:
        await agent.open()
        gc.collect()
        start = time.perf_counter()
        reply = await agent.run("go")
        elapsed = time.perf_counter() - start
    finally:
        await agent.aclose()
    assert reply == "done", reply
    return elapsed


async def _compare(
    title: str,
    makers: dict[str, Maker],
    rounds: int,
    repeats: int,
    model: Callable[[], Any],
    targets: dict[str, float],
) -> None:
    print(f"\n{title}")
    stores = {label: make() for label, make in makers.items()}
    times: dict[str, list[float]] = {label: [] for label in makers}
    try:
        await _timed_run(model(), rounds, None, "warmup")
        for repeat in range(repeats):
            for label, store in stores.items():  # interleaved
                session = f"bench-{uuid.uuid4().hex[:8]}-{repeat}"
                times[label].append(await _timed_run(model(), rounds, store, session))
    finally:
        for store in stores.values():
            if store is not None:
                await store.aclose()
    base = statistics.median(times["no store"]) / rounds
    for label, samples in times.items():
        per_round = statistics.median(samples) / rounds
        print(
            f"  {label:<42} {per_round * 1e6:8.1f} us/round   {per_round / base:5.2f}x no store"
            f"   (+{(per_round - base) * 1e6:.1f} us)"
        )
    for label, target in targets.items():
        if label in times:
            ratio = statistics.median(times[label]) / rounds / base
            verdict = "met" if ratio <= target else "MISSED"
            print(f"  target {label} <= {target:.2f}x no store: {verdict} ({ratio:.2f}x)")


async def bench_budget(makers: dict[str, Maker], rounds: int, repeats: int) -> None:
    """Each store with no limit, with ``session_limits`` and with ``limits`` (never
    reached), interleaved: the cost of keeping the spend before each model request (the
    session's state and the run's record; the run's record only)."""
    limits = UsageLimits(requests=10**9)
    labels = [label for label in makers if label != "no store"]
    print(f"\nthe spend kept before each request, {rounds} tool rounds, median of {repeats}: "
          "no limit -> session_limits / limits")
    stores = {label: makers[label]() for label in labels}
    kinds = ("none", "session", "run")
    times: dict[tuple[str, str], list[float]] = {
        (label, kind): [] for label in labels for kind in kinds
    }
    try:
        for repeat in range(repeats):
            for label, store in stores.items():
                for kind in kinds:
                    session = f"budget-{uuid.uuid4().hex[:8]}-{repeat}"
                    model = ScriptedModel(_script(rounds), record=False)
                    times[(label, kind)].append(await _timed_run(
                        model, rounds, store, session,
                        limits if kind == "session" else None, limits if kind == "run" else None,
                    ))
    finally:
        for store in stores.values():
            if store is not None:
                await store.aclose()
    for label in labels:
        plain, session_, run_ = (statistics.median(times[(label, k)]) / rounds for k in kinds)
        print(f"  {label:<42} {plain * 1e6:8.1f} -> {session_ * 1e6:8.1f} / {run_ * 1e6:8.1f} "
              f"us/round   (+{(session_ - plain) * 1e6:.1f} / +{(run_ - plain) * 1e6:.1f} us "
              "a request)")


def _messages(count: int) -> list[Message]:
    messages: list[Message] = [{"role": "user", "content": "a long task"}]
    index = 0
    while len(messages) < count - 1:
        call_id = f"call_{index}"
        messages.append(
            {
                "role": "assistant",
                "content": "checking",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "lookup", "arguments": {"query": f"item {index}"}},
                    }
                ],
            }
        )
        messages.append(
            {"role": "tool", "content": f"result {index} " * 8, "tool_call_id": call_id,
             "name": "lookup"}
        )
        index += 1
    messages.append({"role": "assistant", "content": "all done"})
    return messages[:count]


async def _median_us(operation: Callable[[], Awaitable[object]], count: int) -> float:
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        await operation()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


async def bench_append(
    makers: dict[str, Maker], directory: Path, dsn: str | None, schema: str, count: int
) -> None:
    print(f"\none append, median over {count}, next to the floor under it")
    message: Message = {"role": "user", "content": "x" * 200}
    for label, make in makers.items():
        store = make()
        if store is None:
            continue
        async with store, await store.open_session(f"a-{uuid.uuid4().hex[:8]}") as writer:
            await writer.append(message)
            us = await _median_us(lambda w=writer: w.append(message), count)  # type: ignore[misc]
        print(f"  {label:<42} {us:8.1f} us")
    conn = sqlite3.connect(directory / "raw.db", isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("CREATE TABLE m (seq INTEGER PRIMARY KEY, body TEXT NOT NULL)")
        body = dumps(message)
        samples = []
        for seq in range(count):
            start = time.perf_counter()
            conn.execute("INSERT INTO m (seq, body) VALUES (?, ?)", (seq, body))
            samples.append(time.perf_counter() - start)
    finally:
        conn.close()
    print(f"  {'floor: bare sqlite3 INSERT commit':<42} {statistics.median(samples) * 1e6:8.1f} us")
    if dsn is None:
        return
    import asyncpg

    seqs = iter(range(10**9))
    table = f'"{schema}".floor'
    insert = f"INSERT INTO {table} VALUES ($1, $2)"
    for commit in ("on", "off"):
        pg = await asyncpg.connect(dsn, server_settings={"synchronous_commit": commit})
        try:
            if commit == "on":
                print(f"  {'floor: PostgreSQL SELECT 1 round trip':<42} "
                      f"{await _median_us(lambda p=pg: p.fetchval('SELECT 1'), count):8.1f} us")
                await pg.execute(f"CREATE TABLE {table} (seq integer PRIMARY KEY, body text)")
            us = await _median_us(lambda p=pg: p.execute(insert, next(seqs), body), count)
            label = f"floor: PostgreSQL INSERT, synchronous_commit {commit}"
            print(f"  {label:<42} {us:8.1f} us")
        finally:
            await pg.close()


async def bench_load(makers: dict[str, Maker], repeats: int, count: int = 10_000) -> None:
    print(f"\nloading a {count}-message session, median of {repeats} (target < 150 ms)")
    messages = _messages(count)
    for label, make in makers.items():
        store = make()
        if store is None or "fsync=False" in label or "exclusive" in label or "=False" in label:
            if store is not None:
                await store.aclose()
            continue
        async with store:
            async with await store.open_session("big") as writer:
                await writer.replace(messages)
            samples = []
            for _ in range(repeats):
                gc.collect()
                start = time.perf_counter()
                loaded = await store.load("big")
                samples.append(time.perf_counter() - start)
        assert loaded == messages
        start = time.perf_counter()
        validate(loaded)
        validation = time.perf_counter() - start
        print(
            f"  {label:<42} {statistics.median(samples) * 1e3:8.1f} ms"
            f"   (of which validate() {validation * 1e3:.1f} ms)"
        )


async def _drop(dsn: str, schema: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


async def run(args: argparse.Namespace, directory: Path) -> None:
    dsn = args.postgres or os.environ.get("AIMU_BENCH_POSTGRES_DSN") or LOCAL_POSTGRES
    if not await _postgres_answers(dsn):
        print("(PostgreSQL not reachable at the given DSN: its rows are left out)")
        dsn = None
    schema = f"aimu_bench_{uuid.uuid4().hex[:8]}"
    makers = _makers(directory, dsn, schema)
    targets = {"SQLiteStore (WAL, synchronous=NORMAL)": 2.5,
               "PostgresStore (synchronous_commit on)": 3.0}
    try:
        rounds = args.rounds
        if args.only_budget:
            await bench_budget(makers, rounds, args.repeats)
            return
        await _compare(
            f"agent loop, scripted model, {rounds} tool rounds (2 messages each), "
            f"median of {args.repeats}",
            makers, rounds, args.repeats, lambda: ScriptedModel(_script(rounds), record=False),
            targets,
        )
        await bench_budget(makers, rounds, args.repeats)
        await bench_append(makers, directory, dsn, schema, args.appends)
        await bench_load(makers, args.repeats, args.load)
        http_rounds = min(rounds, 50)
        with LoopbackServer.in_thread(_served(http_rounds)) as server:
            await _compare(
                f"agent loop over HTTP (openai: to the loopback server), {http_rounds} tool "
                f"rounds, median of {args.repeats}",
                makers, http_rounds, args.repeats,
                lambda: client("openai:bench", base_url=server.openai_base_url, api_key="x"),
                {},
            )
    finally:
        if dsn is not None:
            await _drop(dsn, schema)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--appends", type=int, default=1000, help="appends timed per store")
    parser.add_argument("--load", type=int, default=10_000, help="messages in the loaded session")
    parser.add_argument("--postgres", default=None, help="a PostgreSQL DSN to measure")
    parser.add_argument("--only-budget", action="store_true",
                        help="only the cost of keeping the spend before each request")
    args = parser.parse_args(argv)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus")
    with tempfile.TemporaryDirectory(prefix="aimu-bench-store-") as name:
        asyncio.run(run(args, Path(name)))


if __name__ == "__main__":
    main()
