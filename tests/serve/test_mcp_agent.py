"""An aimu agent as an MCP server, driven by the official ``mcp`` client: ``aimu mcp`` over
stdio and ``aimu serve``'s ``/mcp`` over Streamable HTTP.

Stops land at provable points: the model server recorded the run's request, or its
stream's first chunk was sent; the client's cancel is its own (the SDK sends MCP's cancel).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from aimu.aio.transcript import validate
from tests.serve.harness import GATE, MAILED, ROOT, Served
from tests.serve.protocols import settled

mcp = pytest.importorskip("mcp")
from mcp import Client, MCPError, StdioServerParameters, types  # noqa: E402


def text_of(result: types.CallToolResult) -> str:
    return "".join(c.text for c in result.content if isinstance(c, types.TextContent))


async def load_session(path: Path, session: str) -> list[dict[str, Any]]:
    from aimu.aio.store import SQLiteStore

    store = SQLiteStore(path)
    try:
        return [dict(m) for m in await store.load(session)]
    finally:
        await store.aclose()


def stdio_server(served: Served, store: Path) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "aimu", "mcp", "--model", "openai:loop", "--store", str(store),
              "--tool", "tests.serve.harness:lookup", "--tool", "tests.serve.harness:send_email",
              "--log-level", "warning"],
        env={**os.environ, "PYTHONPATH": str(ROOT), "OPENAI_BASE_URL":
             served.model.openai_base_url, "OPENAI_API_KEY": "sk-test"},
        cwd=str(ROOT),
    )


async def call_and_cancel(client: Client, served: Served, arguments: dict[str, Any]) -> None:
    """Call the tool, and cancel the call once the run has seen its reply begin (the
    "writing" progress; chunks the model server sent may not have arrived yet)."""
    requests = len(served.model.requests)
    writing = asyncio.Event()

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        if message == "writing":
            writing.set()

    call = asyncio.create_task(
        client.call_tool("run_agent", arguments, progress_callback=on_progress))
    await served.model.wait_until(
        lambda: any(s.chunks_sent for s in served.model.streams[-1:])
        and len(served.model.requests) > requests, timeout=30,
        what=lambda: "the run's reply did not start streaming",
    )
    await asyncio.wait_for(writing.wait(), 30)  # the run has text: its partial is not empty
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the pid in /proc")
async def test_aimu_mcp_over_stdio(served: Served, tmp_path: Path) -> None:
    store = tmp_path / "mcp.db"
    progress: list[str] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    async with Client(stdio_server(served, store)) as client:
        (tool,) = (await client.list_tools()).tools
        assert tool.name == "run_agent" and tool.annotations is not None
        result = await client.call_tool("run_agent", {"task": "tool please", "session": "io"},
                                        progress_callback=on_progress)
        assert not result.is_error and text_of(result) == "answer to tool please"
        assert "calling lookup" in progress and "lookup answered" in progress

        abandoned = len([s for s in served.model.streams if s.abandoned])
        await call_and_cancel(client, served, {"task": "long tale", "session": "io-stop"})
        await served.model.wait_abandoned(abandoned + 1, timeout=30)
        # The cancelled run's end is written as it settles, after the model's stream
        # closed: read the store (while the server lives) until it holds the partial.
        async with asyncio.timeout(30):
            while (messages := await load_session(store, "io-stop"))[-1]["role"] == "user":  # noqa: ASYNC110 - another process writes it
                await asyncio.sleep(0.05)
        # The server is still there for the next call.
        again = await client.call_tool("run_agent", {"task": "hi", "session": "io-2"})
        assert text_of(again) == "answer to hi"
        await kill_mid_call(client, served, store)
    validate(messages)
    assert messages[-1]["role"] == "assistant" and messages[-1]["aimu_partial"] is True
    await resume_after_the_kill(served, store)


def pid_with(marker: str) -> int:
    """The pid of the ``aimu mcp`` process whose command line holds ``marker``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in command and b"mcp" in command:
            return int(entry.name)
    raise AssertionError(f"no aimu mcp process with {marker!r}")


async def stored_run(store: Path, session: str) -> tuple[str | None, list[str]]:
    """The session's status in the store, and the statuses of its run records."""
    from aimu.aio.store import SQLiteStore

    opened = SQLiteStore(store)
    try:
        info = await opened.info(session)
        records = await opened.runs(session=session)
        return (None if info is None else info.status), [r.status for r in records]
    finally:
        await opened.aclose()


async def kill_mid_call(client: Client, served: Served, store: Path) -> None:
    """``kill -9`` of the ``aimu mcp`` serving ``client`` in the middle of a call."""
    requests = len(served.model.requests)
    call = asyncio.create_task(
        client.call_tool("run_agent", {"task": "short 300", "session": "io-kill"}))
    await served.model.wait_until(
        lambda: len(served.model.requests) > requests
        and any(s.chunks_sent for s in served.model.streams[-1:]), timeout=30,
        what=lambda: "the run's reply did not start streaming",
    )
    os.kill(pid_with(str(store)), signal.SIGKILL)
    with pytest.raises(MCPError, match="Connection closed"):
        await call


async def resume_after_the_kill(served: Served, store: Path) -> None:
    """The store keeps the killed run as it was (``in_progress``, its record ``running``),
    and a new ``aimu mcp`` on that store goes on with it when called with task
    ``continue``, as the docs say."""
    status, records = await stored_run(store, "io-kill")
    assert status == "in_progress" and records == ["running"]
    assert [m["role"] for m in await load_session(store, "io-kill")] == ["user"]
    async with Client(stdio_server(served, store)) as client:
        result = await client.call_tool("run_agent", {"task": "continue", "session": "io-kill"})
    assert not result.is_error, text_of(result)
    assert text_of(result).endswith("c299")
    messages = await load_session(store, "io-kill")
    validate(messages)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    status, records = await stored_run(store, "io-kill")
    assert status == "completed" and "completed" in records


async def test_serve_mcp_answers_and_a_cancel_stops_the_run(served: Served) -> None:
    async with Client(f"{served.url}/mcp") as client:
        result = await client.call_tool("run_agent", {"task": "hello", "session": "mh"})
        assert text_of(result) == "answer to hello"
        abandoned = len([s for s in served.model.streams if s.abandoned])
        await call_and_cancel(client, served, {"task": "long one", "session": "mh-stop"})
        await served.model.wait_abandoned(abandoned + 1, timeout=30)
        bad = await client.call_tool("run_agent", {"task": "hi", "session": "../x"})
        assert bad.is_error
        empty = await client.call_tool("run_agent", {"task": "  ", "session": "mh-empty"})
        assert empty.is_error and "empty" in text_of(empty)
    async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
        messages = (await settled(http, "mh-stop"))["messages"]
    validate(messages)
    assert messages[-1]["aimu_partial"] is True


async def test_a_cancel_mid_tool_settles_the_call(served: Served) -> None:
    GATE.reset()
    async with Client(f"{served.url}/mcp") as client:
        call = asyncio.create_task(
            client.call_tool("run_agent", {"task": "gate 1 3", "session": "mt"}))
        await GATE.entered(1)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
        state = await settled(http, "mt")
    GATE.open()
    assert state["status"] == "cancelled"
    validate(state["messages"])
    assert state["messages"][-1]["role"] == "tool"
    assert "cancelled" in state["messages"][-1]["content"]


async def test_a_call_on_a_busy_session_is_refused(served: Served) -> None:
    GATE.reset()
    async with Client(f"{served.url}/mcp") as client:
        first = asyncio.create_task(
            client.call_tool("run_agent", {"task": "gate 1 2", "session": "mb"}))
        await GATE.entered(1)
        busy = await client.call_tool("run_agent", {"task": "meanwhile", "session": "mb"})
        assert busy.is_error and "in progress" in text_of(busy)
        GATE.open()
        assert text_of(await first) == "w0 w1"


async def test_an_approval_is_an_elicitation(served: Served) -> None:
    MAILED.clear()
    asked: list[str] = []

    async def elicit(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"approve": True, "reason": ""})

    async with Client(f"{served.url}/mcp", elicitation_callback=elicit) as client:
        result = await client.call_tool("run_agent", {"task": "mail ann", "session": "me"})
    assert not result.is_error, text_of(result)
    assert text_of(result) == "mail result: sent to mail ann"
    assert len(asked) == 1 and "send_email" in asked[0]
    assert MAILED == ["mail ann"]


async def test_without_elicitation_the_call_says_how_to_decide(served: Served) -> None:
    MAILED.clear()
    async with Client(f"{served.url}/mcp") as client:
        paused = await client.call_tool("run_agent", {"task": "mail bo", "session": "mn"})
        assert "[paused]" in text_of(paused) and "send_email" in text_of(paused)
        assert MAILED == []
        vague = await client.call_tool("run_agent", {"task": "hmm", "session": "mn"})
        assert vague.is_error and "approve" in text_of(vague)
        done = await client.call_tool("run_agent", {"task": "approve", "session": "mn"})
    assert text_of(done) == "mail result: sent to mail bo"
    assert MAILED == ["mail bo"]


@pytest.mark.parametrize(("level", "info_lines"), [((), False), (("--log-level", "info"), True)])
def test_aimu_mcp_on_stdio_logs_warnings_only_unless_asked(
    tmp_path: Path, level: tuple[str, ...], info_lines: bool
) -> None:
    """A stdio server's stderr lands in the client's output: by default no INFO line (a
    run that ends other than completed, here at a budget of no request, is one at INFO,
    as ``--log-level info`` shows)."""
    import subprocess

    process = subprocess.Popen(
        [sys.executable, "-m", "aimu", "mcp", "--model", "test", "--no-tools",
         "--max-requests", "0", "--store", str(tmp_path / "s.db"), *level],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=str(tmp_path),
    )
    assert process.stdin is not None and process.stdout is not None
    for message in (
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"}}},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
         "params": {"name": "run_agent", "arguments": {"task": "hi", "session": "s"}}},
    ):
        process.stdin.write(json.dumps(message) + "\n")
        process.stdin.flush()
    while (answer := json.loads(process.stdout.readline())).get("id") != 2:
        pass  # the run has ended: its end was logged (or not) before this answer
    assert answer["result"]["isError"] and "limited" in json.dumps(answer["result"])
    _, errors = process.communicate(timeout=60)  # stdin closed: the server ends
    assert process.returncode == 0, errors
    assert ("INFO " in errors) is info_lines, errors
