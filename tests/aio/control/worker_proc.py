"""A worker process for the cross-process control tests: runs jobs taken from Redis.

``python worker_proc.py REDIS_URL PREFIX MODEL_URL STORE_PATH LEASE`` connects a
RedisControl, says it is ready (``PREFIX:test:ready``), then takes jobs from
``PREFIX:test:jobs`` (JSON): ``{"run": id, "task": text}`` starts an agent run under
that id, with the run id as its store session; ``{"claim": id}`` claims a lost run
and, if it won, resumes it; each claim's outcome goes to ``PREFIX:test:claims``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from redis.exceptions import ConnectionError as RedisConnectionError

from aimu import aio
from tests.aio.control.scripts import TOOLS


async def main(url: str, prefix: str, model_url: str, store_path: str, lease: float) -> None:
    store = aio.SQLiteStore(store_path)
    async with aio.RedisControl(url, prefix, lease=lease) as control:
        jobs = control._client  # the same connection pool, for the test's job list
        handles: list[aio.RunHandle[str]] = []

        def agent(session: str) -> aio.Agent:
            return aio.Agent(
                aio.client("ollama:m", host=model_url), TOOLS, store=store, session=session
            )

        await jobs.rpush(f"{prefix}:test:ready", str(os.getpid()))
        while True:
            # Short blocks: a read longer than the client's socket timeout would fail.
            try:
                popped = await jobs.blpop([f"{prefix}:test:jobs"], timeout=1)
            except RedisConnectionError:  # Redis restarting: the runs go on, so do we
                await asyncio.sleep(0.1)
                continue
            if popped is None:
                continue
            job = json.loads(popped[1])
            if "stop" in job:
                break
            if "claim" in job:
                run_id = job["claim"]
                info = await control.claim(run_id)
                await jobs.rpush(f"{prefix}:test:claims", "won" if info else "lost")
                if info is not None:
                    resumed = agent(info.info["session"])
                    handle = aio.RunHandle.start(resumed.resume(), run_id=run_id, control=control)
                    handles.append(handle)
                continue
            run_agent = agent(job["run"])
            handles.append(
                aio.RunHandle.start(
                    run_agent.run(job["task"]),
                    run_id=job["run"],
                    control=control.with_info(session=job["run"]),
                )
            )
        for handle in handles:
            await asyncio.wait([asyncio.ensure_future(handle.stop(0))])
    await store.aclose()


if __name__ == "__main__":
    url, prefix, model_url, store_path, lease = sys.argv[1:6]
    asyncio.run(main(url, prefix, model_url, store_path, float(lease)))
