"""What the tool journal costs: an agent's tool round with the start journalled, and not.

    python benchmarks/bench_journal.py [--rounds 100] [--repeats 15] [--postgres DSN]

Per tool round of the scripted model and a no-op tool on each store, the agent as
shipped (the call's start written durably before the tool runs: one more write beside
the two messages) against the same agent with ``StoredSession.journal_start`` replaced by a
no-op, the baseline (an ablation, for measuring only). Medians of interleaved repeats,
the order alternating, so a noisy neighbour hurts both alike. PostgreSQL runs when
``--postgres`` (or ``AIMU_BENCH_POSTGRES_DSN``, else the local server) answers; it works
in a schema of its own, dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aimu.aio.agent import Agent
from aimu.aio.agent.session import StoredSession
from aimu.aio.store import JSONLStore, PostgresStore, SQLiteStore, Store
from aimu.aio.transcript import ToolCall
from aimu.testing.script import Turn
from aimu.testing.scripted import ScriptedModel, tool_turn

LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"


async def noop() -> str:
    """Do nothing."""
    return "ok"


async def _no_journal(self: StoredSession, call: ToolCall) -> None:
    return None


async def per_round(make: Callable[[], Store], rounds: int, journal: bool) -> float:
    """Seconds per tool round of one run on a fresh session."""
    store = make()
    script = [*(tool_turn(("noop", {})) for _ in range(rounds)), Turn(text="done")]
    agent = Agent(ScriptedModel(script, record=False), tools=[noop], store=store,
                  session=f"b{uuid.uuid4().hex[:8]}", max_rounds=rounds + 2)
    shipped = StoredSession.journal_start
    if not journal:
        StoredSession.journal_start = _no_journal  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        async with agent:
            await agent.run("go")
        return (time.perf_counter() - start) / rounds
    finally:
        StoredSession.journal_start = shipped  # type: ignore[method-assign]
        await store.aclose()


async def postgres_answers(dsn: str) -> bool:
    try:
        import asyncpg

        conn = await asyncio.wait_for(asyncpg.connect(dsn), 3)
    except Exception:
        return False
    await conn.close()
    return True


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--postgres", default=os.environ.get("AIMU_BENCH_POSTGRES_DSN",
                                                             LOCAL_POSTGRES))
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-journal-"))
    schema = f"aimu_bench_{uuid.uuid4().hex[:10]}"
    stores: dict[str, Callable[[], Store]] = {
        "SQLiteStore": lambda: SQLiteStore(scratch / "s.db"),
        "JSONLStore": lambda: JSONLStore(scratch / "jsonl"),
    }
    if await postgres_answers(args.postgres):
        stores["PostgresStore"] = lambda: PostgresStore(args.postgres, schema=schema)
    else:
        print("PostgresStore: skipped (no server answers at the DSN given)")
    try:
        for name, make in stores.items():
            await per_round(make, args.rounds, True)  # warm up: schema, files, imports
            with_journal: list[float] = []
            without: list[float] = []
            for repeat in range(args.repeats):
                order = (True, False) if repeat % 2 else (False, True)
                for journal in order:
                    figure = await per_round(make, args.rounds, journal)
                    (with_journal if journal else without).append(figure)
            on, off = statistics.median(with_journal), statistics.median(without)
            print(f"{name}: per tool round {off * 1e6:.0f} µs without the journal, "
                  f"{on * 1e6:.0f} µs with it: {on / off:.2f}x")
    finally:
        if "PostgresStore" in stores:
            import asyncpg

            conn: Any = await asyncpg.connect(args.postgres)
            try:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            finally:
                await conn.close()


if __name__ == "__main__":
    asyncio.run(main())
