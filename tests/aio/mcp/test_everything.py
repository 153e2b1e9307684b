"""Against a server nobody here wrote: the MCP reference server
``@modelcontextprotocol/server-everything`` (npm), started with ``npx``. ``.ci/run``
installs it into ``$AIMU_MCP_NPM_PREFIX`` beforehand, so no test downloads anything."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.transcript import CANCELLED_RESULT, validate
from aimu.testing.scripted import ScriptedModel, Turn, tool_turn
from tests.services import unavailable

pytestmark = pytest.mark.slow

PACKAGE = "@modelcontextprotocol/server-everything"
PREFIX = Path(os.environ.get("AIMU_MCP_NPM_PREFIX") or "~/.cache/aimu/npm").expanduser()
TEE = str(Path(__file__).with_name("tee.py"))
LONG = "trigger-long-running-operation"


def npx_command() -> list[str]:
    """``npx`` running the installed reference server (skip, or fail in CI, without it)."""
    npx = shutil.which("npx")
    if npx is None:
        unavailable("npx not found: install Node.js to run the MCP reference server tests")
    if not (PREFIX / "node_modules" / PACKAGE / "package.json").exists():
        unavailable(f"{PACKAGE} is not installed in {PREFIX}: run .ci/run, or "
                    f"npm install --prefix {PREFIX} {PACKAGE}")
    return [npx, "--no-install", "--prefix", str(PREFIX), "mcp-server-everything", "stdio"]


@pytest.fixture
async def everything(tmp_path: Path) -> AsyncIterator[tuple[aio.MCPServer, Path]]:
    """The reference server, its traffic both ways logged by tee.py."""
    command = npx_command()
    log = tmp_path / "traffic.log"
    server = aio.MCPServer.stdio(sys.executable, [TEE, str(log), *command], name="everything",
                                 timeout=120)
    async with server:
        yield server, log


def traffic(log: Path) -> list[tuple[str, dict[str, Any]]]:
    lines = []
    for line in log.read_text().splitlines():
        try:
            lines.append((line[:1], json.loads(line[2:])))
        except ValueError:
            continue  # the server's own non-JSON output, if any
    return lines


async def wait_for(log: Path, what: str, test: Any) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        for _, message in traffic(log):
            if test(message):
                return message
        assert time.monotonic() < deadline, f"never saw {what} in {traffic(log)[-20:]}"
        await asyncio.sleep(0.02)


async def test_lists_its_tools_with_their_schemas_and_annotations(
    everything: tuple[aio.MCPServer, Path],
) -> None:
    server, _ = everything
    tools = {t.name: t for t in await server.list_tools()}
    assert {"echo", "get-sum", LONG} <= set(tools)
    assert all(t.parameters["type"] == "object" for t in tools.values())
    assert tools["echo"].parameters["properties"]["message"]["type"] == "string"
    assert tools[LONG].idempotent and not tools[LONG].approval  # its annotations say so


async def test_an_agent_calls_its_tools(everything: tuple[aio.MCPServer, Path]) -> None:
    server, _ = everything
    script = [tool_turn(("echo", {"message": "hello"}), ("get-sum", {"a": 2, "b": 3})),
              Turn("done")]
    agent = aio.Agent(ScriptedModel(script), tools=[server])
    assert await agent.run("use them") == "done"
    echoed, summed = [m["content"] for m in agent.model_client.messages if m["role"] == "tool"]
    assert "hello" in echoed and "5" in summed


async def test_a_cancel_mid_progress_reaches_the_server(
    everything: tuple[aio.MCPServer, Path],
) -> None:
    server, log = everything
    script = [tool_turn((LONG, {"duration": 3, "steps": 3})),
              tool_turn(("echo", {"message": "after"})), Turn("ok")]
    agent = aio.Agent(ScriptedModel(script), tools=[server])
    progressed = asyncio.Event()
    handle = aio.RunHandle.start(agent.run("long"))
    handle.add_listener(lambda e: progressed.set() if isinstance(e, aio.ToolProgress) else None)
    await progressed.wait()  # mid-progress: the server is inside the operation
    handle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handle
    messages = agent.model_client.messages
    validate(messages)
    assert messages[-1]["content"] == CANCELLED_RESULT

    call = await wait_for(log, "the tools/call", lambda m: m.get("method") == "tools/call"
                          and m["params"]["name"] == LONG)
    await wait_for(log, "notifications/cancelled for the call", lambda m: (
        m.get("method") == "notifications/cancelled" and m["params"]["requestId"] == call["id"]))
    token = call["params"]["_meta"]["progressToken"]
    # The operation's loop runs on (it does not watch the abort signal), but its last step
    # is where it would answer: the server saw the cancel if no answer to the call follows.
    await wait_for(log, "the operation's last step", lambda m: (
        m.get("method") == "notifications/progress" and m["params"]["progressToken"] == token
        and m["params"]["progress"] == 3))
    assert await agent.run("again") == "ok"  # the same connection, still usable
    assert [m["content"] for m in agent.model_client.messages if m["role"] == "tool"][-1] == (
        "Echo: after"
    )
    answers = [m for d, m in traffic(log) if d == "<" and m.get("id") == call["id"]]
    assert answers == [], f"the server answered the cancelled call: {answers}"
