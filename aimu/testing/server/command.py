"""``python -m aimu.testing.server``: serve the embedded test model until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Sequence

from aimu.testing.server.loopback import LoopbackServer
from aimu.testing.server.model import default_script

__all__ = ["main"]


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
            await stop_requested.wait()
    finally:
        for number in signals:
            loop.remove_signal_handler(number)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aimu.testing.server``: serve the embedded test model until a signal."""
    parser = argparse.ArgumentParser(
        prog="python -m aimu.testing.server",
        description="Serve the embedded test model over the Ollama and OpenAI protocols.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (0: a free one)")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds between chunks")
    options = parser.parse_args(argv)
    asyncio.run(_serve(options.host, options.port, options.delay))
    return 0
