"""``aimu models`` and ``aimu pull`` against the loopback server's Ollama endpoints."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aimu import cli
from aimu.testing.server import LoopbackServer
from aimu.testing.server.ollama import CONTEXT_LENGTH
from tests.http_stub import stub_server
from tests.services import refused_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer.in_thread() as running:
        yield running


def test_models_lists_name_size_and_context_length(
    server: LoopbackServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["pull", "--host", server.url, "qwen3:8b"]) == 0
    assert cli.main(["models", "--host", server.url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-3].split() == ["MODEL", "SIZE", "CONTEXT"]
    assert out[-1].split() == ["test", "4.0", "MB", f"{CONTEXT_LENGTH:,}"]
    assert out[-2].split() == ["qwen3:8b", "4.0", "MB", f"{CONTEXT_LENGTH:,}"]


def test_pull_prints_plain_progress_lines_when_not_a_terminal(
    server: LoopbackServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["pull", "--host", server.url, "llama3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "pulling manifest"
    assert [line.split()[-4] for line in out if "% of" in line] == [
        "0%", "20%", "50%", "70%", "100%"
    ]
    assert out[-2:] == ["success", "pulled llama3"]
    assert "llama3" in server.models


def test_a_pull_of_a_model_that_does_not_exist_is_one_clear_line(
    server: LoopbackServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server.missing_models.add("nope")
    assert cli.main(["pull", "--host", server.url, "nope"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        f"aimu pull: cannot pull 'nope' from {server.url}: "
        "pull model manifest: file does not exist"
    )
    assert "nope" not in server.models


@pytest.mark.parametrize(
    "lines",
    [
        [b"<html>not an Ollama server</html>"],  # a line that is not JSON
        [b'{"status": "pulling manifest"}', b'{"status": "pulling", "total": "lots"}'],
        [b'{"status": "pulling", "total": 1.5, "completed": 0}'],
        [b'{"status": "pulling", "total": -10, "completed": 5}'],
        [b'{"status": "pulling", "total": 10, "completed": -5}'],
        [b'["status"]'],  # JSON, but not a progress line
    ],
    ids=["not-json", "total-lots", "total-fraction", "total-negative", "done-negative",
         "not-an-object"],
)
def test_a_pull_from_a_server_that_is_not_ollama_is_one_line_naming_it(
    lines: list[bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    async def answer(method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        return 200, "application/x-ndjson", b"".join(line + b"\n" for line in lines)

    with stub_server(answer) as stub:
        assert cli.main(["pull", "--host", stub.url, "m"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith(f"aimu pull: {stub.url} does not answer as Ollama does: ")
    assert err.count("\n") == 1, err
    assert "%" not in out and "-" not in out  # no nonsense progress


@pytest.mark.parametrize("command", [["pull", "llama3"], ["models"]])
def test_a_server_that_is_down_is_one_clear_line(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    host = f"http://127.0.0.1:{refused_port()}"
    assert cli.main([*command, "--host", host]) == 1
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"cannot reach Ollama at {host}: is it running? (--host or "
                        "OLLAMA_HOST sets the address)")
    assert "\n" not in err


def test_pull_shows_a_progress_bar_on_a_terminal(server: LoopbackServer) -> None:
    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "aimu", "pull", "--host", server.url, "mistral"],
        stdin=secondary, stdout=secondary, stderr=secondary, cwd=ROOT,
        env={**os.environ, "TERM": "xterm", "COLUMNS": "80", "LINES": "24"},
    )
    os.close(secondary)
    output = b""
    while True:
        try:
            data = os.read(primary, 65536)
        except OSError:
            break
        if not data:
            break
        output += data
    assert process.wait(timeout=60) == 0
    os.close(primary)
    text = output.decode(errors="replace")
    assert "pulling mistral" in text  # the bar's title
    assert "\x1b[" in text  # drawn with terminal escapes, not plain lines
    assert "pulled mistral" in text


def test_ctrl_c_stops_a_pull_cleanly(tmp_path: Path) -> None:
    """A server that sends the first progress line and then nothing: SIGINT (Ctrl+C)
    ends the pull with one line and status 130, and the server sees the client go."""
    import asyncio
    import signal
    import threading

    gone = threading.Event()
    ready: list[int] = []
    started = threading.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (await reader.readline()).strip():
            pass  # the request head; the body is small and ignored
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        line = b'{"status":"pulling manifest"}\n'
        writer.write(b"%x\r\n%s\r\n" % (len(line), line))
        await writer.drain()
        await reader.read()  # until the client closes the connection
        gone.set()
        writer.close()

    def serve() -> None:
        async def main() -> None:
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            ready.append(server.sockets[0].getsockname()[1])
            started.set()
            async with server:
                await asyncio.sleep(60)

        asyncio.run(main())

    threading.Thread(target=serve, daemon=True).start()
    started.wait(10)
    process = subprocess.Popen(
        [sys.executable, "-m", "aimu", "pull", "--host", f"http://127.0.0.1:{ready[0]}", "m"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    assert process.stdout is not None
    assert process.stdout.readline() == "pulling manifest\n"  # the pull is under way
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130
    assert err.strip() == "aimu pull: stopped; pull m again to resume"
    assert gone.wait(10)  # the connection was closed: the server stops sending
