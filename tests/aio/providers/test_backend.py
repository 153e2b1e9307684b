"""The pool's network backend (``_backend._Native``): httpcore's connections on asyncio's
own transports, driven directly and through a model client, over TCP, TLS and a Unix
socket. Each test lands its stop or its check at a provable point (bytes seen by the
other side, the transport paused), never after a sleep."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpcore
import pytest
import trustme
from provider_support import assert_only_current_task

from aimu import aio
from aimu.aio.client import TextDelta
from aimu.aio.errors import ModelConnectionError
from aimu.aio.providers import _backend, _pool
from aimu.testing.script import Turn
from aimu.testing.server import LoopbackServer


class _Slots:
    def __init__(self) -> None:
        self.connecting = asyncio.Semaphore(2)


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def _server(handler: Handler, path: str | None = None,
                  **options: object) -> AsyncIterator[int]:
    """A server on 127.0.0.1 (or the Unix socket ``path``) running ``handler`` per
    connection; yields its port. Leaving it cancels the handlers still running and closes
    every connection it accepted."""
    served: set[asyncio.Task[None]] = set()
    working: set[asyncio.Future[None]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.add(asyncio.current_task())  # type: ignore[arg-type]
        work = asyncio.ensure_future(handler(reader, writer))
        working.add(work)
        try:
            await asyncio.wait([work])  # cancelled at the end: not this task's own cancel
        finally:
            working.discard(work)
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await writer.wait_closed()
        if not work.cancelled():
            work.exception()  # a handler that failed on a closed connection is not news

    if path is None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0, **options)  # type: ignore[arg-type]
    else:
        server = await asyncio.start_unix_server(serve, path)
    try:
        yield server.sockets[0].getsockname()[1] if path is None else 0
    finally:
        server.close()
        for work in tuple(working):
            work.cancel()
        await asyncio.gather(*served, return_exceptions=True)
        await server.wait_closed()


async def _until(condition: Callable[[], bool]) -> None:
    """Let the loop run until ``condition`` holds (30 s at most: then fail)."""
    async with asyncio.timeout(30):
        while not condition():  # noqa: ASYNC110 - a state of the transport, not an event
            await asyncio.sleep(0)


async def test_a_large_reply_read_slowly_pauses_the_connection_and_arrives_whole() -> None:
    size = 4 * 1024 * 1024
    payload = bytes(range(256)) * (size // 256)

    async def send_all(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(payload)
        await writer.drain()
        writer.write_eof()
        await reader.read()

    async with _server(send_all) as port:
        stream = await _backend._Native(_Slots()).connect_tcp("127.0.0.1", port, timeout=5)
        assert isinstance(stream, _backend._Stream)
        # Nobody reads: the connection stops reading once HIGH_WATER bytes wait.
        await _until(lambda: stream.reader.paused)
        assert _backend.HIGH_WATER < stream.reader.size < size
        received = bytearray()
        while chunk := await stream.read(65536, timeout=10):
            received += chunk
        assert bytes(received) == payload
        assert not stream.reader.paused
        await stream.aclose()


async def test_a_large_request_waits_for_the_server_to_read_it() -> None:
    size = 16 * 1024 * 1024
    reading = asyncio.Event()
    got = 0

    async def read_when_told(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal got
        await reading.wait()
        while data := await reader.read(1 << 20):
            got += len(data)

    async with _server(read_when_told) as port:
        stream = await _backend._Native(_Slots()).connect_tcp("127.0.0.1", port, timeout=5)
        assert isinstance(stream, _backend._Stream)
        write = asyncio.create_task(stream.write(b"x" * size, timeout=30))
        await _until(lambda: stream.reader.blocked is not None)  # the transport is full
        assert not write.done()
        reading.set()
        await write
        await stream.aclose()  # the FIN: the server's read loop ends
        await _until(lambda: got == size)


async def test_a_read_that_gets_nothing_times_out() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with _server(silent) as port:
        stream = await _backend._Native(_Slots()).connect_tcp("127.0.0.1", port, timeout=5)
        with pytest.raises(httpcore.ReadTimeout):
            await stream.read(1024, timeout=0.05)
        await stream.aclose()


async def test_a_cancelled_read_shuts_the_socket_and_the_server_sees_it() -> None:
    closed = asyncio.Event()

    async def wait_for_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hello")
        await reader.read()  # b"" once the client's FIN arrives
        closed.set()

    async with _server(wait_for_eof) as port:
        stream = await _backend._Native(_Slots()).connect_tcp("127.0.0.1", port, timeout=5)
        assert await stream.read(1024, timeout=5) == b"hello"
        read = asyncio.create_task(stream.read(1024, timeout=None))
        await _until(lambda: stream.reader.waiter is not None)  # it waits on the socket
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        await asyncio.wait_for(closed.wait(), 30)  # shut at once, before any aclose
        assert stream.reader.waiter is None
        await stream.aclose()


async def test_an_idle_connection_the_server_closed_reads_as_readable() -> None:
    async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        return

    async with _server(close_at_once) as port:
        stream = await _backend._Native(_Slots()).connect_tcp("127.0.0.1", port, timeout=5)
        await _until(lambda: stream.reader.ended)
        assert stream.get_extra_info("is_readable") is True  # httpcore drops it, not reuses
        assert await stream.read(1024, timeout=5) == b""
        with pytest.raises(httpcore.WriteError):
            await stream.write(b"late", timeout=5)
        await stream.aclose()


async def test_a_refused_connect_is_a_connect_error_with_the_os_reason() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(httpcore.ConnectError) as caught:
        await _backend._Native(_Slots()).connect_tcp("127.0.0.1", port, timeout=5)
    assert isinstance(caught.value.__cause__, OSError)


async def test_a_unix_socket_connection_reads_and_writes(tmp_path: Path) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readexactly(4))
        await writer.drain()

    path = str(tmp_path / "s")
    async with _server(echo, path):
        stream = await _backend._Native(_Slots()).connect_unix_socket(path, timeout=5)
        await stream.write(b"ping", timeout=5)
        assert await stream.read(1024, timeout=5) == b"ping"
        await stream.aclose()


# -- over TLS, through a model client -------------------------------------------------------


@pytest.fixture
def tls(monkeypatch: pytest.MonkeyPatch) -> ssl.SSLContext:
    """The server's TLS context for "localhost", its CA trusted by the pool's context."""
    ca = trustme.CA()
    client = ssl.create_default_context()
    ca.configure_trust(client)
    monkeypatch.setattr(_pool, "ssl_context", lambda: client)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server)
    return server


@contextlib.asynccontextmanager
async def _tls_in_front_of(loopback: LoopbackServer, context: ssl.SSLContext
                           ) -> AsyncIterator[int]:
    """A TLS terminator relaying each connection to ``loopback``'s plain port."""
    host, port = loopback.openai_base_url.split("//")[1].split("/")[0].split(":")

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        inner_reader, inner_writer = await asyncio.open_connection(host, int(port))

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            with contextlib.suppress(OSError, RuntimeError):
                if sink.can_write_eof():
                    sink.write_eof()
                else:
                    sink.close()

        try:
            await asyncio.gather(pipe(reader, inner_writer), pipe(inner_reader, writer))
        finally:
            inner_writer.close()

    async with _server(relay, ssl=context) as tls_port:
        yield tls_port


async def _answers_then_stops(model: aio.ModelClient, loopback: LoopbackServer,
                               answer: str) -> None:
    """A whole reply (``answer``), then a reply stopped at its first text: the loopback
    server sees that stream abandoned before its end."""
    chunks = model.stream_turn([{"role": "user", "content": "1"}])
    assert "".join([c.text async for c in chunks if isinstance(c, TextDelta)]) == answer
    stream = model.stream_turn([{"role": "user", "content": "2"}])
    async for chunk in stream:
        if isinstance(chunk, TextDelta):
            break  # the first text: the reply streams
    await stream.aclose()  # a stop mid-reply
    abandoned = await loopback.wait_abandoned(1, timeout=30)
    assert abandoned[0].chunks_sent < 200


def _answer_then_a_long_one(answer: str) -> LoopbackServer:
    return LoopbackServer([
        Turn(text=answer),
        Turn(text=" ".join(f"w{i}" for i in range(200)), chunks=200, delay=0.05),
    ])


async def test_a_model_over_tls_answers_and_a_stop_closes_its_stream(
    tls: ssl.SSLContext,
) -> None:
    loopback = _answer_then_a_long_one("over tls")
    await loopback.start()
    try:
        async with _tls_in_front_of(loopback, tls) as port:
            model = aio.client("openai:test", base_url=f"https://localhost:{port}/v1")
            await _answers_then_stops(model, loopback, "over tls")
            await model.aclose()
    finally:
        await loopback.stop()
    await assert_only_current_task()


async def test_a_server_with_an_untrusted_certificate_is_refused(
    tls: ssl.SSLContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_pool, "ssl_context", ssl.create_default_context)  # CA not trusted
    loopback = LoopbackServer([Turn(text="never")])
    await loopback.start()
    try:
        async with _tls_in_front_of(loopback, tls) as port:
            model = aio.client("openai:test", base_url=f"https://localhost:{port}/v1",
                               retries=0)
            with pytest.raises(ModelConnectionError, match="TLS certificate not trusted: "
                               "unable to get local issuer certificate"):
                async for _ in model.stream_turn([{"role": "user", "content": "1"}]):
                    pass
            await model.aclose()
    finally:
        await loopback.stop()
    assert loopback.requests == []


async def test_a_cancel_in_the_pass_before_a_request_is_sent_sends_nothing() -> None:
    # A turn lets the loop take one pass between taking its slot and sending (so that
    # many runs started together do not all send in one pass). A cancel landing in that
    # pass (provable: the slot is taken, the server has seen nothing) gives the slot back
    # and sends nothing.
    loopback = LoopbackServer([Turn(text="the first request seen")])
    await loopback.start()
    model = aio.client("openai:test", base_url=loopback.openai_base_url)
    pool = model._pool  # type: ignore[attr-defined]
    try:
        turn = model.stream_turn([{"role": "user", "content": "1"}])
        first = asyncio.ensure_future(anext(turn))
        await _until(lambda: pool.busy == 1)  # its first step ran: the slot is taken
        assert not first.done() and loopback.requests == []
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await turn.aclose()
        assert pool.busy == 0 and loopback.requests == []
        chunks = model.stream_turn([{"role": "user", "content": "2"}])  # the slot serves on
        assert "".join([c.text async for c in chunks if isinstance(c, TextDelta)]) \
        == "the first request seen"
        await model.aclose()
    finally:
        await loopback.stop()
    await assert_only_current_task()


def test_on_uvloop_a_reply_streams_and_a_stop_closes_it() -> None:
    # uvloop's transports are not asyncio.Transport subclasses (uvicorn runs on uvloop
    # when it is installed): the backend must not ask for one.
    import uvloop

    async def main() -> None:
        loopback = _answer_then_a_long_one("on uvloop")
        await loopback.start()
        model = aio.client("openai:test", base_url=loopback.openai_base_url)
        try:
            await _answers_then_stops(model, loopback, "on uvloop")
        finally:
            await model.aclose()
            await loopback.stop()
        await assert_only_current_task()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
