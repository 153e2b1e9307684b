"""send() takes images beside the text, as run() does: checked at the call (a bad image
is a clear error and nothing is sent), joined at the next step boundary as one user
message with its images, sent as each wire takes them, carried by a pause into the
resumed run exactly once, and across Redis to a run in another process. Sent at each
await point of a run (pending, streaming, in a tool call, in a summarising request),
the images join once."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from aimu import aio
from aimu.aio.client import ModelClient
from aimu.aio.context import SUMMARY_INSTRUCTIONS
from aimu.aio.transcript import validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer
from tests.aio.test_images import JPEG, png

PNG_URL = "data:image/png;base64," + base64.b64encode(png()).decode()
JPEG_URL = "data:image/jpeg;base64," + base64.b64encode(JPEG).decode()


class Gate:
    """A tool that waits inside its call until released: the provable point to send."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def look(self) -> str:
        """Look at the screen."""
        self.entered.set()
        await self.release.wait()
        return "a screen"


def users(messages: list[aio.Message]) -> list[aio.Message]:
    return [m for m in messages if m["role"] == "user"]


async def test_an_image_sent_during_a_tool_call_goes_as_each_wire_takes_it(
    make_client: Callable[..., ModelClient], server: LoopbackServer, provider: str,
    tmp_path: Path,
) -> None:
    (tmp_path / "photo.jpg").write_bytes(JPEG)
    gate = Gate()
    server.script = [Turn(tool_calls=[ScriptedCall("look", {})]), Turn(text="I see both")]
    agent = aio.Agent(make_client(), tools=[gate.look])
    handle = aio.RunHandle.start(agent.run("What is on screen?"))
    await gate.entered.wait()
    assert handle.send("and this photo?", images=[png(), tmp_path / "photo.jpg"])
    gate.release.set()
    assert await handle == "I see both"
    sent = users(agent.model_client.messages)[-1]
    assert sent == {"role": "user", "content": "and this photo?",
                    "images": [PNG_URL, JPEG_URL], "aimu_sent": True}
    if provider == "openai-responses":
        wire = server.requests[-1].body["input"][-1]
        assert wire["content"][0] == {"type": "input_text", "text": "and this photo?"}
        assert [p["image_url"] for p in wire["content"][1:]] == [PNG_URL, JPEG_URL]
        return
    if provider == "gemini":  # the user turn after the function response
        parts = server.requests[-1].body["contents"][-1]["parts"]
        assert parts[-3] == {"text": "and this photo?"}
        assert [p["inlineData"] for p in parts[-2:]] == [
            {"mimeType": "image/png", "data": PNG_URL.split(",")[1]},
            {"mimeType": "image/jpeg", "data": JPEG_URL.split(",")[1]},
        ]
        validate(agent.model_client.messages)
        return
    wire = server.requests[-1].body["messages"][-1]
    if provider == "ollama":
        assert wire["images"] == [PNG_URL.split(",")[1], JPEG_URL.split(",")[1]]
    elif provider == "bedrock":  # the tool's result first, then the images and the text
        assert "toolResult" in wire["content"][0]
        assert [p["image"] for p in wire["content"][1:3]] == [
            {"format": "png", "source": {"bytes": PNG_URL.split(",")[1]}},
            {"format": "jpeg", "source": {"bytes": JPEG_URL.split(",")[1]}},
        ]
        assert wire["content"][3] == {"text": "and this photo?"}
    elif provider == "anthropic":  # the tool's result first, then the images and the text
        assert wire["content"][0]["type"] == "tool_result"
        assert [p["source"]["data"] for p in wire["content"][1:3]] == [
            PNG_URL.split(",")[1], JPEG_URL.split(",")[1]
        ]
        assert wire["content"][3] == {"type": "text", "text": "and this photo?"}
    else:
        assert wire["content"][0] == {"type": "text", "text": "and this photo?"}
        assert [p["image_url"]["url"] for p in wire["content"][1:]] == [PNG_URL, JPEG_URL]
    validate(agent.model_client.messages)


@pytest.mark.parametrize(
    ("images", "error", "words"),
    [
        ([b"not an image"], ValueError, "not an image aimu can send"),
        (["/no/such/file.png"], ValueError, "no such file"),
        (["data:image/png;base64,%%%"], ValueError, "does not decode"),
        (["data:image/png,rawbytes"], ValueError, "data:<type>;base64"),
        ([42], TypeError, "bytes, a path or a data: URL"),
        (b"\x89PNG", TypeError, "a list of images"),
    ],
)
async def test_a_bad_image_in_send_is_a_clear_error_and_nothing_is_sent(
    images: object, error: type[Exception], words: str
) -> None:
    gate = Gate()
    model = ScriptedModel([Turn(tool_calls=[ScriptedCall("look", {})]), Turn(text="done")])
    agent = aio.Agent(model, tools=[gate.look])
    handle = aio.RunHandle.start(agent.run("look"))
    await gate.entered.wait()
    with pytest.raises(error, match=words):
        agent.send("see this", images=images)  # type: ignore[arg-type]
    with pytest.raises(error, match=words):
        handle.send("see this", images=images)  # type: ignore[arg-type]
    gate.release.set()
    assert await handle == "done"
    assert [m["content"] for m in users(agent.model_client.messages)] == ["look"]


async def test_a_data_url_from_a_transcript_is_taken_as_it_is() -> None:
    gate = Gate()
    model = ScriptedModel([Turn(tool_calls=[ScriptedCall("look", {})]), Turn(text="done")])
    agent = aio.Agent(model, tools=[gate.look])
    handle = aio.RunHandle.start(agent.run("look"))
    await gate.entered.wait()
    assert agent.send("again", images=[PNG_URL])
    gate.release.set()
    await handle
    assert users(agent.model_client.messages)[-1]["images"] == [PNG_URL]


async def test_images_sent_to_a_run_that_pauses_join_the_resumed_run_once(
    tmp_path: Path,
) -> None:
    @aio.tool(approval=True)
    def pay(amount: int) -> str:
        """Pay an amount."""
        return f"paid {amount}"

    script = [
        Turn(text="paying now", tool_calls=[ScriptedCall("pay", {"amount": 5})]),
        Turn(text="paid, and I see the pixel"),
    ]
    model = ScriptedModel(script)
    store = aio.SQLiteStore(tmp_path / "s.db")
    async with aio.Agent(model, tools=[pay], store=store, session="s") as agent:
        handle = aio.RunHandle.start(agent.run("pay"))
        async for event in handle.events():
            if isinstance(event, aio.TextChunk) and event.text.startswith("paying"):
                # Mid-turn: the next boundary is the pay round, which pauses the run.
                assert handle.send("this one too", images=[png()])
        assert handle.status == "paused"
        assert users(agent.model_client.messages)[-1]["content"] == "pay"
    # Another agent object, as another process would: the state carries the message.
    async with aio.Agent(model.fork(), tools=[pay], store=store, session="s") as again:
        again.approve(again.pending_approvals[0].call_id)
        assert await again.resume() == "paid, and I see the pixel"
        sent = [m for m in users(again.model_client.messages) if m.get("images")]
        assert sent == [{"role": "user", "content": "this one too", "images": [PNG_URL],
                         "aimu_sent": True}]
        assert await store.load("s") == again.model_client.messages
        validate(again.model_client.messages)
    await store.aclose()


@pytest.mark.parametrize("point", ["pending", "streaming", "tool call", "summary request"])
async def test_a_send_with_images_at_each_await_point_joins_once(
    make_client: Callable[..., ModelClient], server: LoopbackServer, provider: str,
    point: str,
) -> None:
    """Sent before the run starts, while a reply streams, while a tool runs, or while the
    model writes a summary (SummarizeOlderTurns): the images join once, as one message."""
    gate = Gate()
    # Fifteen chunks with a wait between each: the loopback server runs in this loop, so
    # once wait_requests() wakes the test (the request read), the send below lands before
    # the server's next chunk, however short the wait or loaded the machine (0.2 s a
    # chunk made each of these tests sit out ~3 s of stream, twice for the summary).
    slow = Turn(text=" ".join(["word"] * 15), delay=0.02)

    def script(request: dict[str, object]) -> Turn:
        messages = request["messages"]
        assert isinstance(messages, list)
        if messages[0]["content"] == SUMMARY_INSTRUCTIONS:
            return Turn(text="SUMMARY " + slow.text) if point != "summary request" else slow
        last = messages[-1]
        if last["role"] == "user" and last["content"] == "now":
            if point == "tool call":
                return Turn(tool_calls=[ScriptedCall("look", {})])
            if point == "streaming":
                return slow
        return Turn(text=f"answer after {last['role']}")

    server.script = script  # type: ignore[assignment]
    context = aio.SummarizeOlderTurns(keep=1) if point == "summary request" else None
    agent = aio.Agent(make_client(), tools=[gate.look], context=context)
    if context is not None:
        await agent.run("before")  # an older turn: the next run asks for a summary first
    before = len(server.requests)
    handle = aio.RunHandle.start(agent.run("now"))
    if point == "pending":
        assert handle.status == "pending"
    elif point == "tool call":
        await gate.entered.wait()
    else:  # the server has read the streaming or summarising request
        await server.wait_requests(before + 1)
    assert handle.send("and this?", images=[png()])
    gate.release.set()
    await handle
    assert handle.status == "completed"
    messages = agent.model_client.messages
    validate(messages)
    assert [m for m in messages if m.get("images")] == [
        {"role": "user", "content": "and this?", "images": [PNG_URL], "aimu_sent": True}
    ]
    # The last request carried the image exactly once, as the wire takes it.
    sent = PNG_URL if provider in ("openai", "openai-responses") else PNG_URL.partition(",")[2]
    last = server.requests[-1].body
    assert json.dumps(last).count(sent) == 1
    if point == "summary request":
        assert server.requests[before].messages[0]["content"] == SUMMARY_INSTRUCTIONS
        assert sent not in json.dumps(server.requests[before].body)
    await agent.aclose()
