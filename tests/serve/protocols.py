"""What the protocol tests (AG-UI, the AI SDK stream, A2A, MCP) share: a session read over
the runs API once its run has ended, the protocols' own JavaScript clients run in Node, and
a server killed with SIGKILL in the middle of a streamed run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from tests.serve.harness import Served, aimu_serve
from tests.services import npm_clients


async def session(http: httpx.AsyncClient, name: str) -> dict[str, Any]:
    response = await http.get(f"/sessions/{name}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def settled(http: httpx.AsyncClient, name: str) -> dict[str, Any]:
    """The session once its run has ended (the run's own event stream says when)."""
    state = await session(http, name)
    if state["run_id"] is not None:
        async with http.stream("GET", f"/runs/{state['run_id']}/events") as response:
            async for _ in response.aiter_lines():
                pass
        state = await session(http, name)
    return state


async def node_client(
    script: Path, served: Served, *args: str, on_first_chunk: Callable[[], None] | None = None,
    on_line: Callable[[Any], Awaitable[bytes | None]] | None = None,
) -> list[Any]:
    """Run ``node SCRIPT URL ARGS...``: the JSON lines it printed. ``on_first_chunk`` is
    called when a line with a ``chunk`` arrives (a provable point: the client is reading);
    ``on_line`` with every line, and what it returns is written to the script's stdin."""
    prefix = npm_clients()
    process = await asyncio.create_subprocess_exec(
        "node", str(script), args[0], served.url, *args[1:],
        env={**os.environ, "AIMU_NPM_CLIENTS": str(prefix)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.PIPE if on_line is not None else None,
    )
    assert process.stdout is not None and process.stderr is not None
    lines: list[Any] = []
    async with asyncio.timeout(120):
        async for raw in process.stdout:
            lines.append(json.loads(raw))
            if on_first_chunk is not None and "chunk" in lines[-1]:
                on_first_chunk()
                on_first_chunk = None
            said = None if on_line is None else await on_line(lines[-1])
            if said is not None and process.stdin is not None:
                process.stdin.write(said)
                await process.stdin.drain()
        err = await process.stderr.read()
        assert await process.wait() == 0, err.decode()
    return lines


@contextlib.asynccontextmanager
async def restarted_after_a_kill(
    served: Served, tmp_path: Path,
    stream: Callable[[httpx.AsyncClient], AsyncIterator[dict[str, Any]]],
    first_text: Callable[[dict[str, Any]], bool],
) -> AsyncIterator[httpx.AsyncClient]:
    """``aimu serve`` on a store in ``tmp_path``, killed with SIGKILL once ``stream`` (its
    request) yielded its first text; then a new server on the same store, for the block."""
    store = tmp_path / "killed.db"
    async with (
        aimu_serve(served.model, tmp_path, "--store", str(store), name="one") as one,
        httpx.AsyncClient(base_url=one.url, timeout=30) as http,
    ):
        events = stream(http)
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            async for event in events:
                if first_text(event):
                    one.process.send_signal(signal.SIGKILL)
                    break
        await one.process.wait()
    async with (
        aimu_serve(served.model, tmp_path, "--store", str(store), name="two") as two,
        httpx.AsyncClient(base_url=two.url, timeout=30) as http,
    ):
        yield http
