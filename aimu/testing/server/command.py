"""``python -m aimu.testing.server``: serve the embedded test model until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Sequence
from typing import Final

from aimu.testing.server.loopback import LoopbackServer
from aimu.testing.server.model import default_script

__all__ = ["WIRES", "main", "wire_lines"]


async def _serve(host: str, port: int, delay: float) -> None:
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for number in signals:
        loop.add_signal_handler(number, stop_requested.set)
    try:
        async with LoopbackServer(
            default_script(delay), host=host, port=port, keep_records=False
        ) as server:
            print(f"listening on {server.url}", flush=True)
            for line in wire_lines(server.url):
                print(line, flush=True)
            await stop_requested.wait()
    finally:
        for number in signals:
            loop.remove_signal_handler(number)


#: Each wire the server speaks: its model prefix, the variable that points a client at a
#: server, and the path under the server's URL that variable takes.
WIRES: Final = (
    ("ollama", "OLLAMA_HOST", ""),
    ("openai", "OPENAI_BASE_URL", "/v1"),
    ("openai-responses", "OPENAI_BASE_URL", "/v1"),
    ("anthropic", "ANTHROPIC_BASE_URL", ""),
    ("gemini", "GEMINI_BASE_URL", "/v1beta"),
)


def wire_lines(url: str) -> list[str]:
    """A line per wire: its model prefix and the base URL a client of it takes."""
    width = max(len(prefix) for prefix, _, _ in WIRES) + 1
    return [f"  {prefix + ':':<{width}} {variable}={url}{path}"
            for prefix, variable, path in WIRES]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aimu.testing.server``: serve the embedded test model until a signal."""
    parser = argparse.ArgumentParser(
        prog="python -m aimu.testing.server",
        description="Serve the embedded test model over every wire aimu speaks (Ollama, "
        "OpenAI chat completions, OpenAI Responses, Anthropic, Gemini); the first line says "
        "where it listens, the next ones each wire's base URL.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (0: a free one)")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds between chunks")
    options = parser.parse_args(argv)
    asyncio.run(_serve(options.host, options.port, options.delay))
    return 0
