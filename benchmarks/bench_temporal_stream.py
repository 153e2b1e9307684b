"""Does a reply stream under ``aimu serve --temporal``? The first text event's delay and
how the text arrives, beside the local backend, in one run.

    python benchmarks/bench_temporal_stream.py [--temporal HOST:PORT] [--redis URL]
        [--repeats N] [--quick]

Starts a Temporal dev server unless ``--temporal`` names one (as ``bench_temporal.py``).
Each repeat starts the same run on each backend (interleaved), through the backend as
serve's routes do (``start`` then ``follow``), and the model server streams a reply of
``--words`` words, one every ``--delay`` seconds. Per backend, medians of:

- first text: from ``start()`` to the follower's first text event;
- text spread: from the first text event to the last, as the follower received them
  (the model spends ``(words - 1) x delay`` streaming; a reply that arrives in one burst
  at the end has a spread near 0);
- bursts: how many batches of text events the follower received.

Backends: ``local`` (in this process), ``temporal`` (an in-process worker; events reach
serve through the workflow) and, with ``--redis``, ``temporal+redis`` (the worker
publishes the run's events to Redis, where serve follows them live).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_temporal import dev_server

from aimu import aio
from aimu.aio.store import SQLiteStore
from aimu.serve.agents import agent_factory
from aimu.serve.backends.local import LocalBackend
from aimu.serve.backends.temporal import TemporalBackend
from aimu.serve.runs import RunsBackend
from aimu.temporal import AgentWorker
from aimu.testing.script import Turn
from aimu.testing.server import LoopbackServer


async def one_run(backend: RunsBackend, session: str) -> tuple[float, float, int]:
    """Start a run on ``backend`` and follow it: (first text, spread, bursts)."""
    began = time.perf_counter()
    view = await backend.start(session, "tell me", None)
    texts: list[float] = []
    bursts = 0
    async for batch in backend.follow(view.run_id, None):
        now = time.perf_counter()
        found = [e for _, e in batch if e.get("type") == "text"]
        if found:
            bursts += 1
            texts.extend(now for _ in found)
        if any(e.get("type") == "handle_finished" for _, e in batch):
            break
    if not texts:
        raise SystemExit(f"no text event reached the follower of {view.run_id}")
    return texts[0] - began, texts[-1] - texts[0], bursts


async def main(options: argparse.Namespace) -> None:
    repeats = 1 if options.quick else options.repeats
    words = 5 if options.quick else options.words
    reply = " ".join(f"w{i}" for i in range(words))
    with dev_server(options.temporal) as temporal:
        async with LoopbackServer(lambda request: Turn(reply, delay=options.delay)) as model:
            folder = Path(tempfile.mkdtemp(prefix="aimu-bench-stream-"))
            store = SQLiteStore(folder / "s.db")
            client = aio.client("ollama:test", host=model.url)
            agents, close = agent_factory(client, store)
            control = None
            if options.redis:
                control = aio.RedisControl(options.redis, f"bench-stream-{os.getpid()}")
                await control.connect()
            queue = f"bench-{secrets.token_hex(4)}"
            worker = AgentWorker(agents, store, temporal=temporal, task_queue=queue,
                                 redis=control, heartbeat=0.25)
            backends: dict[str, Any] = {"local": LocalBackend(agents, store)}
            backends["temporal"] = TemporalBackend(temporal, queue, store)
            if control is not None:
                backends["temporal+redis"] = TemporalBackend(temporal, queue, store,
                                                             redis=control)
            results: dict[str, list[tuple[float, float, int]]] = {n: [] for n in backends}
            try:
                async with worker:
                    for backend in backends.values():
                        if isinstance(backend, TemporalBackend):
                            await backend.connect()
                    for repeat in range(repeats + 1):  # the first round warms up
                        for name, backend in backends.items():
                            measured = await one_run(backend, f"{name.replace('+', '-')}-{repeat}")
                            if repeat:
                                results[name].append(measured)
            finally:
                for backend in backends.values():
                    await backend.aclose()
                if control is not None:
                    await control.aclose()
                await close()
                await store.aclose()
                shutil.rmtree(folder, ignore_errors=True)
    streaming = (words - 1) * options.delay
    print(f"a {words}-word reply, one word every {options.delay * 1e3:g} ms "
          f"(the model streams for {streaming * 1e3:.0f} ms); medians of {repeats}")
    print(f"  {'backend':<15} {'first text':>12} {'text spread':>12} {'bursts':>7}")
    base = statistics.median(r[0] for r in results["local"])
    for name, values in results.items():
        first = statistics.median(v[0] for v in values)
        spread = statistics.median(v[1] for v in values)
        bursts = statistics.median(v[2] for v in values)
        print(f"  {name:<15} {first * 1e3:9.1f} ms {spread * 1e3:9.1f} ms {bursts:7.0f}"
              f"   first text {first / base:5.1f}x local")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temporal", default=None, help="a Temporal frontend (default: start one)")
    parser.add_argument("--redis", default=None, help="Redis URL: also follow through Redis")
    parser.add_argument("--repeats", type=int, default=7, help="runs per backend")
    parser.add_argument("--words", type=int, default=23, help="words in the reply")
    parser.add_argument("--delay", type=float, default=0.03, help="seconds between words")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few samples")
    asyncio.run(main(parser.parse_args()))
