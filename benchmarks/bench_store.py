"""Store overhead: the agent loop with each store against no store, and large loads.

    python benchmarks/bench_store.py [--rounds 200] [--repeats 7]

Prints each figure next to its baseline measured in the same run:

- per-round time of a run of ``--rounds`` tool rounds with the scripted model and a
  no-op async tool, with no store, ``SQLiteStore`` and ``JSONLStore`` (fsync on a
  background thread, and off); median over ``--repeats`` fresh sessions. Target:
  ``SQLiteStore`` at most 2x the no-store time per round (the script says whether it
  was met).
- one ``append`` alone, next to a bare ``sqlite3`` autocommit INSERT with the same
  pragmas (the floor of a durable commit), and what an fsync per line would cost if it
  ran on the loop.
- loading a 10,000-message session (target under 100 ms), split into read+parse and
  the transcript validation.
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
from collections.abc import Callable
from pathlib import Path

from aimu.aio.agent import Agent
from aimu.aio.store import JSONLStore, SQLiteStore, Store
from aimu.aio.transcript import Message, dumps, validate
from aimu.testing.script import Turn
from aimu.testing.scripted import ScriptedModel, tool_turn


async def noop() -> str:
    """Do nothing."""
    return "ok"


def _script(rounds: int) -> list[Turn]:
    return [*(tool_turn(("noop", {})) for _ in range(rounds)), Turn(text="done")]


async def _run_once(rounds: int, store: Store | None, session: str) -> float:
    model = ScriptedModel(_script(rounds), record=False)
    agent = Agent(
        model,
        tools=[noop],
        max_rounds=rounds + 1,
        store=store,
        session=session if store is not None else None,
    )
    try:
        gc.collect()
        start = time.perf_counter()
        reply = await agent.run("go")
        elapsed = time.perf_counter() - start
    finally:
        await agent.aclose()
    assert reply == "done", reply
    return elapsed


def bench_loop(rounds: int, repeats: int, directory: Path) -> None:
    print(f"\nagent loop, {rounds} tool rounds (2 messages each), median of {repeats}")
    makers: dict[str, Callable[[], Store | None]] = {
        "no store": lambda: None,
        "SQLiteStore (WAL, synchronous=NORMAL)": lambda: SQLiteStore(directory / "loop.db"),
        "JSONLStore (fsync per line, background)": lambda: JSONLStore(directory / "jsonl"),
        "JSONLStore (fsync=False)": lambda: JSONLStore(directory / "jsonl-nofsync", fsync=False),
    }
    stores = {label: make() for label, make in makers.items()}
    times: dict[str, list[float]] = {label: [] for label in makers}
    try:
        asyncio.run(_run_once(rounds, None, "warmup"))
        for repeat in range(repeats):
            # Interleave the variants so a noisy neighbour hurts them all alike.
            for label, store in stores.items():
                elapsed = asyncio.run(_run_once(rounds, store, f"bench-{repeat}"))
                times[label].append(elapsed)
    finally:
        for store in stores.values():
            if store is not None:
                store.close()
    base = statistics.median(times["no store"]) / rounds
    for label, samples in times.items():
        per_round = statistics.median(samples) / rounds
        print(
            f"  {label:<42} {per_round * 1e6:8.1f} us/round   {per_round / base:5.2f}x no store"
            f"   (+{(per_round - base) * 1e6:.1f} us)"
        )
    sqlite = statistics.median(times["SQLiteStore (WAL, synchronous=NORMAL)"]) / rounds
    verdict = "met" if sqlite <= 2 * base else "MISSED"
    print(f"  target SQLiteStore <= 2.00x no store: {verdict} ({sqlite / base:.2f}x)")


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


async def _append_samples(store: Store, message: Message, count: int) -> list[float]:
    samples = []
    async with store, await store.open_session("a") as writer:
        for _ in range(count):
            start = time.perf_counter()
            await writer.append(message)
            samples.append(time.perf_counter() - start)
    return samples


async def _load_samples(
    store: Store, messages: list[Message], repeats: int
) -> tuple[list[float], list[Message]]:
    samples = []
    async with store:
        async with await store.open_session("big") as writer:
            await writer.replace(messages)
        for _ in range(repeats):
            gc.collect()
            start = time.perf_counter()
            loaded = await store.load("big")
            samples.append(time.perf_counter() - start)
    return samples, loaded


def bench_append(directory: Path, count: int = 2000) -> None:
    print(f"\none append from the loop thread, median over {count}")
    message: Message = {"role": "user", "content": "x" * 200}
    for label, store in (
        ("SQLiteStore", SQLiteStore(directory / "append.db")),
        ("JSONLStore (background fsync)", JSONLStore(directory / "append")),
        ("JSONLStore (fsync=False)", JSONLStore(directory / "append-nofsync", fsync=False)),
    ):
        samples = asyncio.run(_append_samples(store, message, count))
        print(f"  {label:<42} {statistics.median(samples) * 1e6:8.1f} us")
    # The floor under SQLiteStore.append: one autocommit INSERT on a bare connection with
    # the same settings, so the per-round overhead above can be read against it.
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
    label = "raw sqlite3 INSERT commit (same pragmas)"
    print(f"  {label:<42} {statistics.median(samples) * 1e6:8.1f} us")
    # What the loop would wait for if every line were fsynced before append returned.
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        line = (dumps(message) + "\n").encode()
        samples = []
        for _ in range(200):
            start = time.perf_counter()
            os.write(fd, line)
            os.fsync(fd)
            samples.append(time.perf_counter() - start)
    finally:
        os.close(fd)
    label = "write + fsync on the loop (not used)"
    print(f"  {label:<42} {statistics.median(samples) * 1e6:8.1f} us")


def bench_load(directory: Path, repeats: int, count: int = 10_000) -> None:
    print(f"\nloading a {count}-message session, median of {repeats} (target < 100 ms)")
    messages = _messages(count)
    for label, store in (
        ("SQLiteStore", SQLiteStore(directory / "load.db")),
        ("JSONLStore", JSONLStore(directory / "load")),
    ):
        samples, loaded = asyncio.run(_load_samples(store, messages, repeats))
        assert loaded == messages
        start = time.perf_counter()
        validate(loaded)
        validation = time.perf_counter() - start
        print(
            f"  {label:<42} {statistics.median(samples) * 1e3:8.1f} ms"
            f"   (of which validate() {validation * 1e3:.1f} ms)"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus")
    with tempfile.TemporaryDirectory(prefix="aimu-bench-store-") as name:
        directory = Path(name)
        bench_loop(args.rounds, args.repeats, directory)
        bench_append(directory)
        bench_load(directory, args.repeats)


if __name__ == "__main__":
    main()
