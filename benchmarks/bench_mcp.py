"""MCP tools through aimu vs the bare ``mcp`` SDK, side by side, on one stdio server.

    python benchmarks/bench_mcp.py [--calls N] [--cancels N] [--repeats N] [--quick]

Per call: ``aimu.aio.tools.invoke()`` of an ``MCPServer`` tool (what the agent runs:
arguments bound, the call sent, the result made text) against ``ClientSession.call_tool``
on a connection of its own to the same server program; medians of interleaved repeats.
Cancel: a call cancelled once the server's tool reported progress, the agent's way
(``RunHandle.cancel()`` on a run inside the tool) against cancelling the bare SDK call's
task; the latency is until the server-side tool sees its cancellation (it sends a
datagram with its monotonic clock), p50 and p99.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters

from aimu import aio
from aimu.aio.tools import ToolContext, invoke
from aimu.testing.scripted import ScriptedModel, Turn, tool_turn

ROOT = Path(__file__).resolve().parents[1]
SERVER = str(ROOT / "tests" / "aio" / "mcp" / "mcp_server.py")


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class CancelWatch:
    """The datagrams the server's tool sends when it sees a cancel: tag -> its clock."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.setblocking(False)

    async def seen(self, tag: str) -> float:
        loop = asyncio.get_running_loop()
        while True:
            data = await loop.sock_recv(self.sock, 256)
            got, at = data.decode().split()
            if got == tag:
                return float(at)

    def close(self) -> None:
        self.sock.close()


async def bare_call(client: Client) -> None:
    await client.session.call_tool("add", {"a": 1, "b": 2})


async def aimu_call(tools: dict[str, aio.Tool]) -> None:
    call: Any = {"id": "c", "type": "function", "function": {"name": "add",
                                                             "arguments": {"a": 1, "b": 2}}}
    outcome = await invoke(tools, call, ToolContext(agent="bench", call_id="c", tool_name="add"))
    assert outcome.content == "3", outcome


async def per_call(client: Client, tools: dict[str, aio.Tool], calls: int,
                   repeats: int) -> tuple[float, float]:
    bare: list[float] = []
    ours: list[float] = []
    for _ in range(3):  # warm both paths
        await bare_call(client)
        await aimu_call(tools)
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            await bare_call(client)
        bare.append((time.perf_counter() - start) / calls)
        start = time.perf_counter()
        for _ in range(calls):
            await aimu_call(tools)
        ours.append((time.perf_counter() - start) / calls)
    return statistics.median(bare), statistics.median(ours)


async def bare_cancel(client: Client, watch: CancelWatch, tag: str) -> float:
    progressed = asyncio.Event()

    async def progress(progress: float, total: float | None, message: str | None) -> None:
        progressed.set()

    task = asyncio.ensure_future(client.session.call_tool(
        "wait", {"tag": tag, "seconds": 60}, progress_callback=progress))
    await progressed.wait()
    cancelled_at = time.monotonic()
    task.cancel()
    seen = await watch.seen(tag)
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return seen - cancelled_at


async def aimu_cancel(server: aio.MCPServer, watch: CancelWatch, tag: str) -> float:
    model = ScriptedModel([tool_turn(("wait", {"tag": tag, "seconds": 60})), Turn("x")],
                          record=False)
    agent = aio.Agent(model, tools=[server])
    handle = aio.RunHandle.start(agent.run("wait"))
    cancelled_at: list[float] = []

    def hear(event: aio.Event) -> None:
        if isinstance(event, aio.ToolProgress) and not cancelled_at:
            cancelled_at.append(time.monotonic())
            handle.cancel()

    handle.add_listener(hear)
    seen = await watch.seen(tag)
    with contextlib.suppress(asyncio.CancelledError):
        await handle
    return seen - cancelled_at[0]


async def cancels(client: Client, server: aio.MCPServer, watch: CancelWatch,
                  count: int) -> tuple[list[float], list[float]]:
    bare: list[float] = []
    ours: list[float] = []
    for i in range(count):  # interleaved
        bare.append(await bare_cancel(client, watch, f"b{i}"))
        ours.append(await aimu_cancel(server, watch, f"a{i}"))
    return bare, ours


async def main(calls: int, cancel_count: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cancels")
        watch = CancelWatch(path)
        env = {"AIMU_MCP_CANCEL_SOCKET": path}
        parameters = StdioServerParameters(command=sys.executable, args=[SERVER, "stdio"], env=env)
        try:
            async with Client(parameters, cache=None) as client, aio.MCPServer.stdio(
                sys.executable, [SERVER, "stdio"], env=env
            ) as server:
                tools = {t.name: t for t in await server.list_tools()}
                bare_s, ours_s = await per_call(client, tools, calls, repeats)
                bare_c, ours_c = await cancels(client, server, watch, cancel_count)
        finally:
            watch.close()
    print(f"{'measure':<44} {'bare mcp SDK':>14} {'aimu':>10} {'ratio':>7}")
    print(f"{'per call (median of ' + str(repeats) + ' x ' + str(calls) + ')':<44} "
          f"{bare_s * 1e3:>11.3f} ms {ours_s * 1e3:>7.3f} ms {ours_s / bare_s:>6.2f}x")
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        b, o = quantile(bare_c, q) * 1e3, quantile(ours_c, q) * 1e3
        print(f"{'cancel -> server tool sees it, ' + name + ' (' + str(cancel_count) + ')':<44} "
              f"{b:>11.3f} ms {o:>7.3f} ms {o / b:>6.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per repeat")
    parser.add_argument("--cancels", type=int, default=100, help="cancels on each side")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few samples")
    options = parser.parse_args()
    if options.quick:
        options.calls, options.cancels, options.repeats = 5, 3, 1
    asyncio.run(main(options.calls, options.cancels, options.repeats))
