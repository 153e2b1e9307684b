"""What the MCP tests share: the test server started over stdio or HTTP, its log, and
waiting for a process to be gone."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from aimu import aio
from tests.services import free_port

SERVER = str(Path(__file__).with_name("mcp_server.py"))
RAW_SERVER = str(Path(__file__).with_name("raw_server.py"))
_WAIT_SECONDS = 30.0


class ServerLog:
    """The lines the test server wrote (``started TAG``, ``cancelled TAG``...)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")

    def lines(self) -> list[str]:
        return self.path.read_text().splitlines()

    async def wait_for(self, line: str) -> None:
        """Until the server wrote ``line`` (bounded: a safety net, not a timing)."""
        deadline = time.monotonic() + _WAIT_SECONDS
        while line not in self.lines():
            assert time.monotonic() < deadline, f"the server never wrote {line!r}: {self.lines()}"
            await asyncio.sleep(0.01)


def stdio_server(log: ServerLog, **options: object) -> aio.MCPServer:
    """The test server as a child process over stdio."""
    return aio.MCPServer.stdio(
        sys.executable, [SERVER, "stdio"], env={"AIMU_MCP_LOG": str(log.path)}, **options  # type: ignore[arg-type]
    )


@contextlib.contextmanager
def http_server_process(log: ServerLog) -> Iterator[str]:
    """The test server listening on Streamable HTTP; yields its URL."""
    port = free_port()
    env = {**os.environ, "AIMU_MCP_LOG": str(log.path)}
    process = subprocess.Popen(
        [sys.executable, SERVER, "http", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + _WAIT_SECONDS
        while True:
            assert process.poll() is None, "the HTTP test server exited at start"
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "the HTTP test server never listened"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, seconds: float = _WAIT_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while alive(pid):
        assert time.monotonic() < deadline, f"process {pid} is still alive"
        time.sleep(0.02)
