"""The floor for bench_served.py: the least a server of runs does. Each run is one asyncio
task that asks the model (httpx, OpenAI's chat completions wire), runs the one tool,
streams the answer and relays each text chunk as a Server-Sent Event to its follower; a
cancel cancels the task. No store, no events kept, no partial kept, no recovery.

    POST /runs {"task": ...} -> {"run_id"};  GET /runs/{id}/events;  POST /runs/{id}/cancel
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

MODEL = os.environ["BENCH_MODEL_URL"].rstrip("/") + "/chat/completions"
TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
HTTP = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0),
                         limits=httpx.Limits(max_connections=5000,
                                             max_keepalive_connections=5000))
RUNS: dict[str, tuple[asyncio.Task[None], asyncio.Queue[str | None]]] = {}


async def turn(messages: list[dict[str, Any]], out: asyncio.Queue[str | None]) -> Any:
    """One streamed model turn: its tool call (None if it answered in text)."""
    body = {"model": "test", "stream": True, "messages": messages, "tools": [TOOL]}
    call: dict[str, Any] | None = None
    async with HTTP.stream("POST", MODEL, json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("content"):
                out.put_nowait(delta["content"])
            for piece in delta.get("tool_calls") or ():
                function = piece.get("function") or {}
                if call is None:
                    call = {"id": piece.get("id"), "name": function.get("name"), "args": ""}
                call["args"] += function.get("arguments") or ""
    return call


async def run(task: str, out: asyncio.Queue[str | None]) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    try:
        while (call := await turn(messages, out)) is not None:
            city = json.loads(call["args"] or "{}").get("city", "")
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": call["id"], "type": "function",
                    "function": {"name": call["name"], "arguments": call["args"]}}]},
                {"role": "tool", "tool_call_id": call["id"], "content": f"sunny in {city}"},
            ]
    finally:
        out.put_nowait(None)


async def start(request: Request) -> JSONResponse:
    task = (await request.json())["task"]
    run_id = uuid.uuid4().hex
    out: asyncio.Queue[str | None] = asyncio.Queue()
    RUNS[run_id] = (asyncio.create_task(run(task, out)), out)
    return JSONResponse({"run_id": run_id}, status_code=202)


async def events(request: Request) -> StreamingResponse:
    _, out = RUNS[request.path_params["run_id"]]

    async def stream() -> AsyncIterator[bytes]:
        while (text := await out.get()) is not None:
            yield b"event: text\ndata: " + json.dumps({"type": "text", "text": text}).encode() \
                + b"\n\n"
        yield b"event: end\ndata: {}\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


async def cancel(request: Request) -> JSONResponse:
    running, _ = RUNS[request.path_params["run_id"]]
    running.cancel()
    return JSONResponse({}, status_code=202)


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


app = Starlette(routes=[
    Route("/health", health), Route("/runs", start, methods=["POST"]),
    Route("/runs/{run_id}/events", events), Route("/runs/{run_id}/cancel", cancel,
                                                  methods=["POST"]),
])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(os.environ["BENCH_PORT"]), log_level="warning",
                backlog=4096, timeout_keep_alive=600)
