"""Where a cancel's time goes: ``bench_serve_scale.py`` with each process tracing its steps.

    python benchmarks/trace_serve_scale.py /tmp/trace --n 200 --scenarios temporal \\
        --redis redis://127.0.0.1:6379 --temporal dev

Takes the first argument as a file prefix, the rest as ``bench_serve_scale.py``'s (one
scenario a run: the tags of its runs repeat between scenarios). Each process (the bench,
``aimu serve``, the worker) writes ``PREFIX.<pid>`` lines of (``time.monotonic()``, one
clock for every process, a step, a run id); then a table of each step's time since the
run's cancel was sent: the handler of ``POST /runs/{id}/cancel`` in serve, the Redis
cancel written and answered, the control's pub/sub message in the worker, the steer of
the run, the model server seeing its stream closed; and the Redis connects each process
made. It wraps private functions: a tool for reading a run, not an API.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from collections import defaultdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serve_scale as bench
import httpx

# Prepended to the serve and worker children: each wrapped step writes one line.
TRACE = """
import time as _time, os as _os, json as _json
_TR = open(_os.environ["BENCH_TRACE"] + "." + str(_os.getpid()), "a", buffering=1)
def _t(step, run_id, **more):
    _TR.write(_json.dumps({"t": _time.monotonic(), "k": step, "r": run_id, **more}) + "\\n")
def _wrap(owner, name, step, run_id, asynchronous=True):
    original = getattr(owner, name)
    if asynchronous:
        async def wrapped(self, *args, **kwargs):
            _t(step, run_id(self, *args))
            try: return await original(self, *args, **kwargs)
            finally: _t(step + " done", run_id(self, *args))
    else:
        def wrapped(self, *args, **kwargs):
            _t(step, run_id(self, *args)); return original(self, *args, **kwargs)
    setattr(owner, name, wrapped)
import aimu.aio.control.worker as _W, aimu.temporal._client as _C
import aimu.serve.backends.temporal as _T, aimu.serve.backends.redis as _R
_steer = _W.steer
def _steered(handle, request, spawn):
    _t("worker: the run steered", handle.run_id); return _steer(handle, request, spawn)
_W.steer = _steered
def _message_run(self, payload):
    try: return _json.loads(payload)["run"]
    except Exception: return None
_wrap(_W.Worker, "_on_message", "worker: pub/sub message", _message_run, False)
_wrap(_C.RunsClient, "_redis_cancel", "serve: Redis cancel", lambda self, r, *a: r)
_wrap(_T.TemporalBackend, "request", "serve: cancel handler", lambda self, r, *a: r)
_wrap(_R.RedisBackend, "request", "serve: cancel handler", lambda self, r, *a: r)
import redis.asyncio.connection as _RC
_connect = _RC.AbstractConnection.connect
async def _connected(self, *args, **kwargs):
    if self.is_connected: return await _connect(self, *args, **kwargs)
    began = _time.monotonic()
    try: return await _connect(self, *args, **kwargs)
    finally: _t("redis connect", None, seconds=_time.monotonic() - began)
_RC.AbstractConnection.connect = _connected
"""


def trace_bench(prefix: str) -> None:
    """Run the bench with the children traced and the bench's own steps written."""
    os.environ["BENCH_TRACE"] = prefix
    bench.APP = TRACE + bench.APP
    bench.WORKER = TRACE + bench.WORKER
    mine = open(f"{prefix}.bench", "a", buffering=1)  # noqa: SIM115 - open while the bench runs

    def write(step: str, run_id: str | None, **more: Any) -> None:
        mine.write(json.dumps({"t": time.monotonic(), "k": step, "r": run_id, **more}) + "\n")

    start_run, post, ask = bench.start_run, httpx.AsyncClient.post, bench.Server.ask

    async def started(http: httpx.AsyncClient, session: str, task: str) -> str:
        run_id = await start_run(http, session, task)
        write("started", run_id, task=task)
        return run_id

    async def posted(self: httpx.AsyncClient, url: Any, *args: Any, **kwargs: Any) -> Any:
        if str(url).endswith("/cancel"):
            write("cancel sent", str(url).split("/")[2])
        return await post(self, url, *args, **kwargs)

    def asked(self: bench.Server, command: str) -> dict[str, Any]:
        answer = ask(self, command)
        if command.startswith("tags"):
            write("closed", None, tags=answer)
        return answer

    bench.start_run = started  # type: ignore[assignment]
    httpx.AsyncClient.post = posted  # type: ignore[method-assign]
    bench.Server.ask = asked  # type: ignore[method-assign]
    bench.main()
    mine.close()


def traces(prefix: str) -> list[str]:
    """The trace files of ``prefix``: ``PREFIX.bench`` and one ``PREFIX.<pid>`` a process
    (not the output a shell may be writing beside them)."""
    return [path for path in glob.glob(f"{prefix}.*")
            if path.rpartition(".")[2] == "bench" or path.rpartition(".")[2].isdigit()]


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def report(prefix: str) -> None:
    rows = [json.loads(line) for path in traces(prefix) for line in open(path)]  # noqa: SIM115
    task_of = {r["r"]: r["task"] for r in rows if r["k"] == "started"}
    closed = {tag: at for r in rows if r["k"] == "closed" for tag, at in r["tags"].items()}
    first: dict[str, dict[str, float]] = defaultdict(dict)
    for r in sorted(rows, key=lambda r: r["t"]):
        if r.get("r"):
            first[r["r"]].setdefault(r["k"], r["t"])
    for run_id, task in task_of.items():
        if task in closed:
            first[run_id]["model server: stream closed"] = closed[task]
    since: dict[str, list[float]] = defaultdict(list)
    for steps in first.values():
        sent = steps.get("cancel sent")
        for step, at in steps.items():
            if sent is not None and step not in ("started", "cancel sent"):
                since[step].append((at - sent) * 1000)
    print("\n| step (ms since the cancel was sent) | runs | p50 | p99 | max |")
    print("| --- | --- | --- | --- | --- |")
    for step, values in sorted(since.items(), key=lambda kv: percentile(kv[1], 0.5)):
        print(f"| {step} | {len(values)} | {percentile(values, 0.5):.0f} | "
              f"{percentile(values, 0.99):.0f} | {max(values):.0f} |")
    connects = [r["seconds"] * 1000 for r in rows if r["k"] == "redis connect"]
    if connects:
        print(f"\nRedis connects: {len(connects)}, p50 {percentile(connects, 0.5):.0f} ms, "
              f"p99 {percentile(connects, 0.99):.0f} ms")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        raise SystemExit(__doc__)
    target = sys.argv.pop(1)
    for old in traces(target):
        os.remove(old)
    trace_bench(target)
    report(target)
