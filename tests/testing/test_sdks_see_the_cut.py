"""The loopback server's ``cut`` fault, as each vendor's own SDK meets it: the chunks
before the cut arrive, then the SDK's stream fails as a real connection cut mid-body
fails it (httpx's incomplete chunked read), not as a protocol error of its own.
What aimu does on such a cut is tested in tests/aio/providers/test_broken_streams.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import types

from aimu.testing.script import Turn
from aimu.testing.server import LoopbackServer

TEXT = "one two three four five six seven eight"
CUT = Turn(text=TEXT, fault="cut", fault_after=4)
#: What a connection closed mid-body is to httpx, under every SDK here.
INCOMPLETE = (httpx.RemoteProtocolError.__name__, httpx.ReadError.__name__)


def cut_short(seen: str) -> None:
    assert seen and TEXT.startswith(seen) and seen != TEXT, seen


def incomplete(error: BaseException) -> None:
    """The error (or what it wraps) is httpx's own for a body cut mid-way, as aimu's
    client meets it too (ModelConnectionError "dropped mid-reply")."""
    chain: list[BaseException] = [error]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)  # type: ignore[arg-type]
    # (Some SDKs here run on a fork of httpx, ``httpx2``: the same error by another module.)
    assert any(type(e).__name__ in INCOMPLETE for e in chain), repr(chain)
    assert "incomplete chunked read" in " ".join(map(str, chain)), repr(chain)


async def read_to_the_cut(
    start: Callable[[], Awaitable[AsyncIterator[Any]]], text_of: Callable[[Any], str]
) -> None:
    """Open the SDK's stream and read it: the text before the cut, then its error."""
    seen = ""
    with pytest.raises(Exception) as caught:  # which one: the point
        async for item in await start():
            seen += text_of(item)
    cut_short(seen)
    incomplete(caught.value)


async def test_the_openai_sdk_sees_a_cut_chat_completion() -> None:
    async with LoopbackServer([CUT]) as server:
        client = openai.AsyncOpenAI(base_url=server.openai_base_url, api_key="k", max_retries=0)
        await read_to_the_cut(
            lambda: client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], stream=True
            ),
            lambda chunk: (chunk.choices[0].delta.content or "") if chunk.choices else "",
        )
        await client.close()


async def test_the_openai_sdk_sees_a_cut_response() -> None:
    async with LoopbackServer([CUT]) as server:
        client = openai.AsyncOpenAI(base_url=server.openai_base_url, api_key="k", max_retries=0)
        await read_to_the_cut(
            lambda: client.responses.create(model="m", input="x", stream=True),
            lambda event: event.delta if event.type == "response.output_text.delta" else "",
        )
        await client.close()


async def test_the_anthropic_sdk_sees_a_cut_message() -> None:
    async with LoopbackServer([CUT]) as server:
        client = anthropic.AsyncAnthropic(base_url=server.url, api_key="k", max_retries=0)
        await read_to_the_cut(
            lambda: client.messages.create(
                model="m", max_tokens=100, messages=[{"role": "user", "content": "x"}],
                stream=True,
            ),
            lambda event: event.delta.text if event.type == "content_block_delta"
            and event.delta.type == "text_delta" else "",
        )
        await client.close()


async def test_the_google_genai_sdk_sees_a_cut_stream() -> None:
    async with LoopbackServer([CUT]) as server:
        options = types.HttpOptions(base_url=server.url, api_version="v1beta",
                                    retry_options=types.HttpRetryOptions(attempts=1))
        client = genai.Client(api_key="AIza-test", http_options=options)
        await read_to_the_cut(
            lambda: client.aio.models.generate_content_stream(model="gemini-test", contents="x"),
            lambda response: response.text or "",
        )
        await client.aio.aclose()
        client.close()
