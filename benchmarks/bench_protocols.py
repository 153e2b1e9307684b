"""A Stop through each protocol `aimu serve` speaks, beside aimu's own cancel route.

    python benchmarks/bench_protocols.py [--repeats N]

One `aimu serve` in a child process (Uvicorn, as the command runs it) on the loopback
model server (in this process), whose slow reply streams for about 20 s unless stopped.
Each sample starts a run, reads its stream until the first text, then stops it; the
figure is the time from the stop to the model server recording the stream abandoned:

- aimu: ``POST /runs/{id}/cancel`` (the baseline);
- AG-UI: the client leaves ``POST /ag-ui``'s stream (what ``abortRun()`` does);
- AI SDK: the client leaves ``POST /api/chat``'s stream (what ``stop()`` does);
- AI SDK stop route: a resumable run, left, then ``POST /api/chat/{id}/stop``;
- A2A: ``CancelTask`` once ``SendStreamingMessage`` streamed its first text;
- MCP: the ``mcp`` client cancels its ``run_agent`` call (``/mcp``) once the model's reply
  has begun (the model server's record: MCP shows no text until the answer).

The contenders take turns within each repeat; medians, p90 and the ratio to the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from bench_serve import follow, server, slow_reply, start

from aimu.testing.server import LoopbackServer

USER_AG_UI = {"id": "u1", "role": "user", "content": "long"}
USER_AI_SDK = {"id": "u1", "role": "user", "parts": [{"type": "text", "text": "long"}]}


async def _abandoned(model: LoopbackServer, before: int, since: float) -> float:
    records = await model.wait_abandoned(before + 1, timeout=30)
    return (max(r.abandoned_at or 0.0 for r in records) - since) * 1000


async def _leave_at_text(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], marker: str
) -> float:
    """Read the stream until its first text event (a line holding ``marker``), then
    leave; when it left."""
    async with http.stream("POST", path, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if marker in line:
                break
        left = time.monotonic()
    return left


async def aimu_cancel(http: httpx.AsyncClient, model: LoopbackServer, session: str) -> float:
    before = len([s for s in model.streams if s.abandoned])
    run_id = await start(http, session, "long")
    await follow(http, run_id, until="text")
    sent = time.monotonic()
    (await http.post(f"/runs/{run_id}/cancel")).raise_for_status()
    return await _abandoned(model, before, sent)


async def ag_ui_abort(http: httpx.AsyncClient, model: LoopbackServer, session: str) -> float:
    before = len([s for s in model.streams if s.abandoned])
    body = {"threadId": session, "runId": "r1", "messages": [USER_AG_UI]}
    left = await _leave_at_text(http, "/ag-ui", body, '"type":"TEXT_MESSAGE_CONTENT"')
    return await _abandoned(model, before, left)


async def ai_sdk_abort(http: httpx.AsyncClient, model: LoopbackServer, session: str) -> float:
    before = len([s for s in model.streams if s.abandoned])
    body = {"id": session, "messages": [USER_AI_SDK]}
    left = await _leave_at_text(http, "/api/chat", body, '"type":"text-delta"')
    return await _abandoned(model, before, left)


async def ai_sdk_stop(http: httpx.AsyncClient, model: LoopbackServer, session: str) -> float:
    before = len([s for s in model.streams if s.abandoned])
    body = {"id": session, "messages": [USER_AI_SDK], "resumable": True}
    await _leave_at_text(http, "/api/chat", body, '"type":"text-delta"')
    sent = time.monotonic()
    (await http.post(f"/api/chat/{session}/stop", json={})).raise_for_status()
    return await _abandoned(model, before, sent)


async def a2a_cancel(http: httpx.AsyncClient, model: LoopbackServer, session: str) -> float:
    before = len([s for s in model.streams if s.abandoned])
    message = {"messageId": session, "role": "ROLE_USER", "contextId": session,
               "parts": [{"text": "long"}]}
    body = {"jsonrpc": "2.0", "id": 1, "method": "SendStreamingMessage",
            "params": {"message": message}}
    await _leave_at_text(http, "/a2a", body, '"artifactUpdate"')  # leaving only detaches
    sent = time.monotonic()
    cancel = {"jsonrpc": "2.0", "id": 2, "method": "CancelTask", "params": {"id": f"{session}:0"}}
    cancelled = asyncio.create_task(http.post("/a2a", json=cancel))
    result = await _abandoned(model, before, sent)
    (await cancelled).raise_for_status()
    return result


async def mcp_cancel(http: httpx.AsyncClient, model: LoopbackServer, session: str) -> float:
    from mcp import Client

    before = len([s for s in model.streams if s.abandoned])
    streams = len(model.streams)
    async with Client(str(http.base_url.join("/mcp"))) as client:
        call = asyncio.create_task(
            client.call_tool("run_agent", {"task": "long", "session": session}))
        await model.wait_until(
            lambda: len(model.streams) > streams and model.streams[-1].chunks_sent > 0, 30)
        sent = time.monotonic()
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        return await _abandoned(model, before, sent)


Contender = Callable[[httpx.AsyncClient, LoopbackServer, str], Awaitable[float]]
CONTENDERS: dict[str, Contender] = {
    "aimu: POST /runs/{id}/cancel (baseline)": aimu_cancel,
    "AG-UI: the client leaves POST /ag-ui": ag_ui_abort,
    "AI SDK: the client leaves POST /api/chat": ai_sdk_abort,
    "AI SDK: POST /api/chat/{id}/stop": ai_sdk_stop,
    "A2A: CancelTask": a2a_cancel,
    "MCP: the client cancels its call": mcp_cancel,
}


def p90(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]


async def main(repeats: int) -> None:
    print(f"Python {sys.version.split()[0]}, {sys.platform}; {repeats} interleaved repeats")
    samples: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    with LoopbackServer.in_thread(slow_reply) as model, tempfile.TemporaryDirectory() as tmp:
        env = {"BENCH_MODEL_URL": model.openai_base_url}
        async with (
            server(Path(tmp) / "s.db", **env) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as http,
        ):
            for repeat in range(repeats):
                for index, (name, measure) in enumerate(CONTENDERS.items()):
                    samples[name].append(await measure(http, model, f"s{repeat}-{index}"))
    base = statistics.median(samples[next(iter(CONTENDERS))])
    header = ("Stop → the model server sees its stream closed", "median", "p90", "ratio")
    rows = [(name, f"{statistics.median(s):.2f} ms", f"{p90(s):.2f} ms",
             f"{statistics.median(s) / base:.2f}x") for name, s in samples.items()]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="samples per contender")
    asyncio.run(main(parser.parse_args().repeats))
