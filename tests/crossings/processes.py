"""``aimu serve`` child processes for the crossing matrix: the served tools of
``serve_tools``, the MCP test server, the loopback model; started once per module (or per
case, for the endings that kill or drain them)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.crossings.capabilities import MCP_SERVER
from tests.serve.harness import ROOT, clean_env
from tests.services import free_port

TOOLS = ("charge", "look", "wire")


@dataclass
class Process:
    url: str
    process: subprocess.Popen[bytes]
    log: Path


def serve_args(store: Path) -> list[str]:
    tools = [arg for name in TOOLS for arg in ("--tool", f"tests.crossings.serve_tools:{name}")]
    return ["--store", str(store), *tools, "--mcp", f"{sys.executable} {MCP_SERVER} stdio"]


def start_serve(model_url: str, workdir: Path, effects: Path, *args: str, name: str) -> Process:
    """``aimu serve ARGS`` on a free port, answering /health (bounded: a start-up)."""
    port = free_port()
    log = workdir / f"{name}.log"
    env = clean_env(OPENAI_BASE_URL=model_url, OPENAI_API_KEY="sk-test",
                    AIMU_CROSSING_EFFECTS=str(effects))
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "aimu", "serve", "--port", str(port), "--model",
             "openai:loop", "--log-level", "warning", *args],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:  # the server starting up, not a race with the work under test
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return Process(url, process, log)
        if process.poll() is not None or time.monotonic() > deadline:
            stop(Process(url, process, log))
            raise AssertionError(f"aimu serve did not start: {log.read_text()}")
        time.sleep(0.05)


def stop(served: Process) -> None:
    if served.process.poll() is None:
        served.process.terminate()
        try:
            served.process.wait(30)
        except subprocess.TimeoutExpired:
            served.process.kill()
            served.process.wait()


@contextlib.contextmanager
def serving(model_url: str, workdir: Path, effects: Path, *args: str,
            name: str) -> Iterator[Process]:
    served = start_serve(model_url, workdir, effects, *args, name=name)
    try:
        yield served
    finally:
        stop(served)
