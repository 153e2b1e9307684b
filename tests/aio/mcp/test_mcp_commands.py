"""``--mcp`` and ``--mcp-url`` on ``aimu chat`` and ``aimu serve``: the server's tools are
offered, a server that cannot start is one clear error, and no server process is left."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from aimu._mcp_options import mcp_servers
from tests.aio.mcp.helpers import RAW_SERVER, SERVER
from tests.serve.harness import aimu_serve, collect, model_server, start  # noqa: F401

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]


def chat(home: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AIMU_HOME": str(home)}
    env.pop("AIMU_MODEL", None)
    return subprocess.run(
        [sys.executable, "-m", "aimu", "chat", "--plain", "--no-tools", *args],
        input=stdin, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env,
    )


def server_command(*only: str) -> str:
    return shlex.join([sys.executable, SERVER, "stdio", "--only", ",".join(only)])


def test_chat_offers_an_mcp_servers_tools(tmp_path: Path) -> None:
    done = chat(tmp_path, "--mcp", server_command("add", "remove"), stdin="add some numbers\n")
    assert done.returncode == 0, done.stderr
    # It says what it loaded, before the banner; the tools that ask first are marked.
    assert done.stdout.startswith(
        "(MCP server 'mcp_server': 2 tools: add, remove (asks first))\naimu chat: model test"
    )
    # The test model calls each offered tool once: here only the server's add.
    assert "add(" in done.stdout and "error" not in done.stderr
    assert "--no-tools" not in done.stdout


def test_chat_with_a_server_that_cannot_start_is_one_error_line(tmp_path: Path) -> None:
    done = chat(tmp_path, "--mcp", "no-such-mcp-command --flag")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "MCP server 'no-such-mcp-command'" in lines[0] and "not found" in lines[0]
    done = chat(tmp_path, "--mcp", "'unclosed")
    assert done.returncode == 2 and "--mcp" in done.stderr
    # A tool list nested too deeply to read: one line saying so, no SDK traceback.
    done = chat(tmp_path, "--mcp", shlex.join([sys.executable, RAW_SERVER, "deep-schema"]))
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert "nests deeper than a JSON parser allows" in line


def test_option_parsing() -> None:
    servers = mcp_servers(["tool-a --x", "tool-a"], ["http://127.0.0.1:9/mcp"])
    assert [s.name for s in servers] == ["tool-a", "tool-a_2", "127_0_0_1"]
    with pytest.raises(ValueError, match="--mcp-url 'ftp://x'"):
        mcp_servers([], ["ftp://x"])
    with pytest.raises(ValueError, match="--mcp needs a command"):
        mcp_servers([" "], [])


async def test_serve_offers_the_servers_tools_and_streams_their_progress(
    model_server, tmp_path: Path  # noqa: F811
) -> None:
    store = tmp_path / "sessions.db"
    serving = aimu_serve(model_server, tmp_path, "--store", str(store),
                         "--mcp", server_command("lookup"))
    async with serving as served, httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        run_id = await start(http, "s1", "tool find it")
        events = await collect(http, run_id)
    kinds = [e.type for e in events]
    assert "tool_progress" in kinds, kinds
    assert kinds.index("tool_call") < kinds.index("tool_progress") < kinds.index("tool_result")
    assert kinds[-1] == "handle_finished"


def test_worker_with_a_server_that_cannot_start_is_one_error_line(tmp_path: Path) -> None:
    env = {**os.environ, "AIMU_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "aimu", "worker", "--temporal", "127.0.0.1:1", "--task-queue",
         "q", "--mcp", "no-such-mcp-command"],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        "aimu worker: MCP server 'no-such-mcp-command'"
    )
