"""Helpers shared by the provider tests (imported by path: the tests have no package)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Callable
from typing import Any, TypeVar

from aimu.aio.client import ModelClient
from aimu.aio.providers.anthropic import AnthropicClient
from aimu.aio.providers.base import Chunk
from aimu.aio.providers.bedrock import BedrockClient
from aimu.aio.providers.gemini import GeminiClient
from aimu.aio.providers.ollama import OllamaClient
from aimu.aio.providers.openai import OpenAIClient
from aimu.aio.providers.openai_responses import OpenAIResponsesClient
from aimu.aio.transcript import Message
from aimu.testing.server.bedrock import CREDENTIALS, REGION, TEST_KEY_ID
from tests.services import refused_port

C = TypeVar("C", bound=ModelClient)

MakeClient = Callable[..., ModelClient]


def client_at(provider: str, url: str, key: str = "sk-test", **options: Any) -> ModelClient:
    """A client of ``provider`` for the loopback server (or any server) at root ``url``."""
    if provider == "ollama":
        return OllamaClient("llama-test", host=url, **options)
    if provider == "gemini":
        return GeminiClient("gemini-test", base_url=url + "/v1beta", api_key=key, **options)
    if provider == "anthropic":
        return AnthropicClient("claude-test", base_url=url, api_key=key, **options)
    if provider == "openai-responses":
        return OpenAIResponsesClient("gpt-test", base_url=url + "/v1", api_key=key, **options)
    if provider == "openai":
        return OpenAIClient("gpt-test", base_url=url + "/v1", api_key=key, **options)
    if provider == "bedrock":  # signed with the loopback server's test key (not ``key``)
        return BedrockClient(
            "anthropic.claude-test-v1:0", region=REGION, base_url=url,
            aws_access_key_id=TEST_KEY_ID, aws_secret_access_key=CREDENTIALS[TEST_KEY_ID],
            **options,
        )
    raise ValueError(f"client_at: no client for provider {provider!r}")


async def turn(model: ModelClient, messages: list[Message], **options: Any) -> list[Chunk]:
    """Every chunk of one streamed turn."""
    return [chunk async for chunk in model.stream_turn(messages, **options)]


def lookup(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def assert_key_hidden(errors: list[Exception], key: str) -> None:
    """No error shows the key: not its message, its repr or the body it kept."""
    for error in errors:
        assert key not in str(error) and key not in repr(error)
        assert key not in getattr(error, "body", "")


#: Clients made by a test module's helper, closed when each test ends (conftest.py): a
#: pooled connection left open is a ResourceWarning at whichever later test the garbage
#: collector runs in.
MADE: list[ModelClient] = []


def closed_after_test(client: C) -> C:
    """``client``, to be closed when the test that made it ends."""
    MADE.append(client)
    return client


def closed_port() -> int:
    """A local port that refuses connections for the rest of the test process."""
    return refused_port()


class RawServer:
    """Answers every request with fixed bytes and closes: for replies no script can make.

    Records each request's head (as text) and body.
    """

    def __init__(self, response: bytes) -> None:
        self.response = response
        self.requests: list[tuple[str, bytes]] = []
        self._server: asyncio.Server | None = None
        self.url = ""
        self._handlers: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            length = 0
            for line in head.split("\r\n"):
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            body = await reader.readexactly(length)
            self.requests.append((head, body))
            writer.write(self.response)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


def http_response(body: bytes, *, status: str = "200 OK", content_type: str) -> bytes:
    """A close-delimited HTTP/1.1 response (no length, no chunking), as some servers send."""
    head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nConnection: close\r\n\r\n"
    return head.encode() + body


async def assert_only_current_task() -> None:
    """Nothing left running: no task besides the test's own.

    httpx reads a body through nested async generators that only the event loop's
    asyncgen finalizer closes (the connection itself is closed already): let those
    finish first, so what remains is a real leak.
    """
    for _ in range(5):
        gc.collect()
        await asyncio.sleep(0)
    left = asyncio.all_tasks() - {asyncio.current_task()}
    assert not left, f"tasks left pending: {left}"


def open_connections(model: ModelClient) -> int:
    """Connections the client's httpx pool holds open right now (idle or in use), summed
    over the pool's httpx clients."""
    pool: Any = model._pool  # type: ignore[attr-defined]
    if pool.http is None:
        return 0
    return sum(
        not connection.is_closed()
        for shard in pool._shards
        for connection in shard.http._transport._pool.connections
    )
