"""The floor for bench_temporal_throughput.py: a bare Temporal workflow whose one
activity streams one reply from the model (Ollama's ``/api/chat`` over httpx, as aimu's
``ollama:`` client does), run by a plain ``temporalio`` worker with aimu's defaults (10
activities at once). No store, no events, no control: what any run on Temporal pays.

    python bare_worker.py TEMPORAL_ADDRESS TASK_QUEUE   (OLLAMA_HOST: the model)
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from datetime import timedelta

from temporalio import activity, workflow

with workflow.unsafe.imports_passed_through():
    import httpx
    from temporalio.client import Client
    from temporalio.worker import Worker

HTTP: httpx.AsyncClient | None = None


@activity.defn(name="bare.turn")
async def turn(task: str) -> str:
    """One streamed reply to ``task``: its text."""
    assert HTTP is not None
    body = {"model": "test", "messages": [{"role": "user", "content": task}], "stream": True}
    text = []
    async with HTTP.stream("POST", "/api/chat", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line:
                text.append(json.loads(line).get("message", {}).get("content", ""))
    return "".join(text)


@workflow.defn(name="bare.run")
class BareRun:
    @workflow.run
    async def run(self, task: str) -> str:
        return str(await workflow.execute_activity(
            "bare.turn", task, start_to_close_timeout=timedelta(seconds=60),
        ))


async def main(address: str, queue: str) -> None:
    global HTTP
    HTTP = httpx.AsyncClient(base_url=os.environ["OLLAMA_HOST"], timeout=60)
    client = await Client.connect(address)
    worker = Worker(client, task_queue=queue, workflows=[BareRun], activities=[turn],
                    max_concurrent_activities=10)
    async with worker:
        print("taking runs", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
