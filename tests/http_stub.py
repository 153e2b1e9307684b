"""A tiny HTTP/1.1 server in a thread whose every answer a test writes: a server that is
not what it claims (a proxy, a broken Ollama), where the loopback server is too faithful.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

#: (status, content type, body) for (method, path, body).
Handler = Callable[[str, str, bytes], Awaitable[tuple[int, str, bytes]]]


@dataclass
class Stub:
    url: str
    #: (method, path) of every request, in order.
    requests: list[tuple[str, str]]


async def _serve_one(
    handler: Handler, stub: Stub, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        method, path, _ = (await reader.readline()).decode().split(" ", 2)
        length = 0
        while (line := await reader.readline()).strip():
            name, _, value = line.decode().partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        body = await reader.readexactly(length)
        stub.requests.append((method, path))
        status, content_type, answer = await handler(method, path, body)
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(answer)}\r\nConnection: close\r\n\r\n".encode() + answer
        )
        await writer.drain()
    finally:
        writer.close()


@contextlib.contextmanager
def stub_server(handler: Handler) -> Iterator[Stub]:
    """Serve ``handler`` on 127.0.0.1 (one request a connection) until the block ends."""
    ready = threading.Event()
    stub = Stub("", [])
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def main() -> None:
        server = await asyncio.start_server(
            lambda r, w: _serve_one(handler, stub, r, w), "127.0.0.1", 0
        )
        stub.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        ready.set()
        async with server:
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield stub
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()
