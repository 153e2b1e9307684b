"""Images in: run() takes images (bytes or paths) beside the task, sent as each wire takes
them, kept in the transcript as data: URLs, stored, restored and resumed; a bad image
is a clear error that changes nothing."""

from __future__ import annotations

import base64
import contextlib
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.client import ModelClient
from aimu.aio.events import TextChunk
from aimu.aio.images import MAX_IMAGE_BYTES, image_urls
from aimu.aio.providers.ollama import OllamaClient
from aimu.aio.providers.openai import OpenAIClient
from aimu.aio.transcript import validate
from aimu.testing.script import Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer


def png() -> bytes:
    """A real 1x1 PNG."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\x00\xff\x00\x00")
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(
        b"IEND", b""
    )


JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 60 + b"\xff\xd9"


def make(provider: str, server: LoopbackServer) -> ModelClient:
    if provider == "ollama":
        return OllamaClient("llava-test", host=server.url)
    return OpenAIClient("gpt-test", base_url=server.openai_base_url)


async def test_images_go_as_each_wire_takes_them(
    provider: str, server: LoopbackServer, tmp_path: Path
) -> None:
    (tmp_path / "photo.jpg").write_bytes(JPEG)
    server.script = [Turn(text="a green pixel and a photo")]
    async with make(provider, server) as client:
        agent = aio.Agent(client)
        answer = await agent.run("What is in these?", images=[png(), tmp_path / "photo.jpg"])
        assert answer == "a green pixel and a photo"
    (user,) = [m for m in agent.model_client.messages if m["role"] == "user"]
    assert user["images"] == [
        "data:image/png;base64," + base64.b64encode(png()).decode(),
        "data:image/jpeg;base64," + base64.b64encode(JPEG).decode(),
    ]
    sent = server.requests[-1].body["messages"][-1]
    if provider == "ollama":
        assert sent == {"role": "user", "content": "What is in these?",
                        "images": [base64.b64encode(png()).decode(),
                                   base64.b64encode(JPEG).decode()]}
    else:
        assert sent["content"][0] == {"type": "text", "text": "What is in these?"}
        assert [p["image_url"]["url"] for p in sent["content"][1:]] == user["images"]


async def test_images_are_stored_restored_and_resumed(
    provider: str, server: LoopbackServer, tmp_path: Path
) -> None:
    server.script = [Turn(text="one two three four"), Turn(text="it is a pixel")]
    store = aio.SQLiteStore(tmp_path / "s.db")
    async with make(provider, server) as client:
        async with aio.Agent(client, store=store, session="s") as agent:
            stream = agent.run("Describe it.", stream=True, images=[png()])
            async with contextlib.aclosing(stream):
                async for event in stream:
                    if isinstance(event, TextChunk):
                        break  # a stop mid-answer
            assert agent.last_status == "cancelled"
        async with aio.Agent(client.fork(), store=store, session="s") as again:
            assert again.model_client.messages == await store.load("s")
            assert await again.resume() == "it is a pixel"
            assert server.requests[-1].body["messages"][0] == server.requests[0].body[
                "messages"
            ][0]  # the image went again, as first sent
        other = aio.Agent(client.fork())
        other.restore(await store.load("s"))
        validate(other.model_client.messages)
    await store.aclose()


@pytest.mark.parametrize(
    ("image", "error", "words"),
    [
        (b"just some text", ValueError, "image 0 is not an image"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * MAX_IMAGE_BYTES, ValueError, "MB"),
        ("missing.png", ValueError, "no such file"),
        (42, TypeError, "image 0 must be bytes, a path or a data: URL"),
    ],
)
async def test_a_bad_image_is_a_clear_error_and_nothing_changes(
    image: object, error: type, words: str
) -> None:
    model = ScriptedModel([Turn(text="x")])
    agent = aio.Agent(model)
    with pytest.raises(error, match=words):
        agent.run("look", images=[image])
    assert agent.model_client.messages == [] and model.turns_served == 0
    assert agent.status == "idle"


def test_a_large_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    big = tmp_path / "big.png"
    with big.open("wb") as file:
        file.truncate(MAX_IMAGE_BYTES + 1)
    with pytest.raises(ValueError, match=r"big\.png.*MB"):
        image_urls([big])


def test_images_is_a_list() -> None:
    agent = aio.Agent(ScriptedModel([]))
    with pytest.raises(TypeError, match="images must be a list"):
        agent.run("look", images=png())  # type: ignore[arg-type]


@pytest.mark.parametrize("images", ["data:image/png;base64,AAAA", [42], ["http://x/y.png"]])
def test_a_transcript_with_bad_images_is_refused(images: Any) -> None:
    agent = aio.Agent(ScriptedModel([]))
    with pytest.raises(aio.TranscriptError, match="message 0: 'images'"):
        agent.restore([{"role": "user", "content": "x", "images": images}])


async def test_the_loopback_server_refuses_an_image_it_cannot_decode(
    provider: str, server: LoopbackServer
) -> None:
    async with make(provider, server) as client:
        agent = aio.Agent(client)
        agent.restore([{"role": "user", "content": "x",
                        "images": ["data:image/png;base64,bm90IGFuIGltYWdl"]}])
        with pytest.raises(aio.ModelHTTPError, match="invalid image"):
            await agent.resume()


async def test_a_workflow_takes_no_images() -> None:
    chain = aio.Chain([aio.Agent(ScriptedModel([Turn(text="x")]))])
    with pytest.raises(TypeError, match="images go to an agent"):
        await chain.run("look", images=[png()])
