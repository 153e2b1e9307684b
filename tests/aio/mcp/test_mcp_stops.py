"""Stops around an MCP tool: a cancel and an interrupt landed at every event of a run
that calls one (valid transcript, resumable, the server keeps no call running), and no
server process outlives its parent: closed, Ctrl+C, ``kill -9``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.transcript import dangling_calls, validate
from aimu.testing.scripted import ScriptedModel, Turn, tool_turn
from tests.aio.mcp.helpers import SERVER, ServerLog, alive, stdio_server, wait_gone

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]


def script(request: Mapping[str, Any]) -> Turn:
    """Call the server's wait (which reports progress twice) and add; then answer."""
    messages = request["messages"]
    if messages and messages[-1]["role"] == "tool":
        return Turn("all done", chunks=2)
    return tool_turn(("wait", {"tag": "s", "seconds": 0}), ("add", {"a": 1, "b": 2}))


async def run_stopped_at(
    server: aio.MCPServer, index: int, stop: str
) -> tuple[aio.Agent, str, list[str]]:
    """A run stopped (``cancel`` or ``interrupt``) at its ``index``-th event."""
    agent = aio.Agent(ScriptedModel(script), tools=[server])
    seen: list[str] = []
    handle = aio.RunHandle.start(agent.run("go"))

    def hear(event: aio.Event) -> None:
        seen.append(event.type)
        if len(seen) == index + 1:
            handle.cancel() if stop == "cancel" else handle.interrupt()

    handle.add_listener(hear)
    with contextlib.suppress(asyncio.CancelledError):
        await handle
    return agent, handle.status, seen


async def test_a_stop_at_every_event_leaves_a_valid_resumable_transcript(tmp_path: Path) -> None:
    log = ServerLog(tmp_path / "server.log")
    async with stdio_server(log) as server:
        tools = {t.name: t for t in await server.list_tools()}
        pid = int((await tools["pid"].fn({}, aio.ToolContext(agent="t", call_id="c",
                                                              tool_name="pid"))).content)
        _, status, events = await run_stopped_at(server, 10_000, "cancel")
        assert status == "completed" and "tool_progress" in events
        for stop in ("cancel", "interrupt"):
            for index in range(len(events) - 1):  # the last is RunFinished: nothing to stop
                agent, status, seen = await run_stopped_at(server, index, stop)
                where = f"{stop} at event {index} ({seen[index]})"
                messages = agent.model_client.messages
                validate(messages)
                assert dangling_calls(messages) == [], where
                assert status in ("cancelled", "interrupted", "completed"), where
                assert await agent.resume() == "all done", where
                validate(agent.model_client.messages)
        # Every call the server started ended, finished or cancelled: none runs on.
        lines = log.lines()
        assert lines.count("started s") == lines.count("finished s") + lines.count("cancelled s")
    wait_gone(pid)


CHILD = textwrap.dedent("""
    import asyncio, sys
    from aimu import aio
    from aimu.testing.scripted import ScriptedModel, tool_turn

    async def main():
        server = aio.MCPServer.stdio(sys.executable, [sys.argv[1], "stdio"])
        agent = aio.Agent(ScriptedModel([tool_turn(("pid", {})),
                                         tool_turn(("wait", {"tag": "k", "seconds": 3600}))]),
                          tools=[server])
        handle = aio.RunHandle.start(agent.run("go"))
        def hear(event):
            if isinstance(event, aio.ToolResult):
                print(event.content, flush=True)  # the server's pid
            if isinstance(event, aio.ToolProgress):
                print("waiting", flush=True)  # mid-call now
        handle.add_listener(hear)
        await handle

    asyncio.run(main())
""")


@pytest.mark.parametrize("how", ["kill -9", "Ctrl+C"])
def test_no_server_outlives_its_parent(how: str) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, SERVER], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True,
    )
    try:
        assert child.stdout is not None
        pid = int(child.stdout.readline())
        assert child.stdout.readline().strip() == "waiting"  # a call is in flight
        assert alive(pid)
        stat = Path(f"/proc/{pid}/stat").read_text()
        launcher = int(stat.rsplit(")", 1)[1].split()[1])  # its parent: the launcher
        os.kill(child.pid, signal.SIGKILL if how == "kill -9" else signal.SIGINT)
        child.wait(60)
        wait_gone(pid)
        wait_gone(launcher)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
