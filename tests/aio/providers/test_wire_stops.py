"""The stop sweep over every wire: a run with thinking, streamed text and two tool rounds,
cancelled and interrupted at each of its events in turn, through each provider against
the loopback server (``provider`` runs it once per wire).

After every stop: the transcript is valid, its cut reply is kept and marked partial
(a prefix of what the model said), every reply the server began was either finished or
seen abandoned (the stream closed, not left open), and the same agent goes on with the
conversation on the same wire, whose loopback server refuses what the real one refuses
(an unanswered call, a forged or missing signature).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from contextlib import aclosing
from typing import Any

import pytest

from aimu import aio
from aimu.aio.agent import INTERRUPTED
from aimu.aio.events import StepFinished, TextChunk
from aimu.aio.transcript import validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer

FIRST = "let me look both up"
SECOND = "and one more place"
FINAL = "all done now for today"
SAID = (FIRST, SECOND, FINAL, "ok")


def lookup(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def script(request: Mapping[str, Any]) -> Turn:
    """The round follows from the request: the tool results since the task."""
    messages = request["messages"]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    if messages[last_user]["content"].endswith("continue"):  # maybe merged with "go"
        return Turn(text="ok")
    results = sum(m["role"] == "tool" for m in messages[last_user:])
    if results == 0:
        calls = [ScriptedCall("lookup", {"city": "Oslo"}), ScriptedCall("lookup", {"city": "Rome"})]
        return Turn(thinking="two cities", text=FIRST, tool_calls=calls, input_tokens=5)
    if results == 2:
        return Turn(text=SECOND, tool_calls=[ScriptedCall("lookup", {"city": "Paris"})])
    return Turn(text=FINAL, input_tokens=9)


async def stop_at(agent: aio.Agent, k: int, mode: str) -> str | None:
    """Run, stopping at the ``k``-th event (1-based); the run's reply, None if cancelled."""
    reached = asyncio.Event()

    async def consume() -> str:
        seen = 0
        reply = ""
        async with aclosing(agent.run("go", stream=True)) as events:
            async for event in events:
                seen += 1
                if seen == k:
                    if mode == "interrupt":
                        agent.interrupt()
                    else:
                        reached.set()
                        await asyncio.Event().wait()  # cancelled here, the run held at k
                reply = getattr(event, "reply", reply)
        return str(reply)

    task = asyncio.ensure_future(consume())
    if mode == "interrupt":
        return await task
    waiter = asyncio.ensure_future(reached.wait())
    await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return None


@pytest.mark.parametrize("mode", ["cancel", "interrupt"])
async def test_a_stop_at_every_event_leaves_a_transcript_the_wire_accepts(
    make_client: Callable[..., aio.ModelClient], server: LoopbackServer, mode: str
) -> None:
    server.script = script
    whole = aio.Agent(make_client(), tools=[lookup])
    events = [event async for event in whole.run("go", stream=True)]
    assert whole.last_status == "completed" and len(events) >= 20
    partials = 0
    for k in range(1, len(events)):
        agent = aio.Agent(make_client(), tools=[lookup])
        before = len(server.streams)
        reply = await stop_at(agent, k, mode)
        if mode == "cancel":
            assert reply is None and agent.last_status == "cancelled", k
        else:
            assert reply in (INTERRUPTED, FINAL), (k, reply)
        messages = agent.model_client.messages
        validate(messages)
        for message in messages:
            if message["role"] == "assistant" and message.get("aimu_partial"):
                assert any(text.startswith(message["content"]) for text in SAID), message
                assert "aimu_native" not in message  # a cut turn keeps no signature
                partials += 1
        # Every reply the server began ended: finished, or seen abandoned (stream closed).
        await server.wait_until(
            lambda b=before: all(s.completed or s.abandoned for s in server.streams[b:]),
            what=lambda k=k: f"a reply of stop {k} was left open",
        )
        assert await agent.run("continue") == "ok", k  # the wire takes the transcript
        await agent.aclose()
    await whole.aclose()
    assert partials >= (10 if mode == "cancel" else 0)


@pytest.mark.parametrize(("round_", "pieces"), [(0, 1), (0, 4), (1, 2), (2, 3)])
async def test_a_cancel_mid_stream_closes_it_and_keeps_the_text_so_far(
    make_client: Callable[..., aio.ModelClient], server: LoopbackServer, round_: int,
    pieces: int,
) -> None:
    """The server holds the reply after ``pieces`` text chunks of round ``round_``; the
    run is cancelled once it has shown them: the server sees the stream abandoned, the
    text so far is kept, marked partial, and the wire takes the transcript."""

    def held(request: Mapping[str, Any]) -> Turn:
        turn = script(request)
        if turn.text == (FIRST, SECOND, FINAL)[round_]:
            return Turn(text=turn.text, tool_calls=turn.tool_calls, fault="hang",
                        fault_after=pieces + (1 if round_ == 0 else 0))  # after its thinking
        return turn

    server.script = held
    agent = aio.Agent(make_client(), tools=[lookup])
    shown: list[str] = []
    reached = asyncio.Event()

    async def consume() -> None:
        rounds = 0
        async with aclosing(agent.run("go", stream=True)) as events:
            async for event in events:
                if isinstance(event, StepFinished):
                    rounds += 1
                elif isinstance(event, TextChunk) and rounds == round_:
                    shown.append(event.text)
                    if len(shown) == pieces:
                        reached.set()

    task = asyncio.ensure_future(consume())
    await reached.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (record,) = await server.wait_abandoned(1)
    assert record.chunks_sent == pieces + (1 if round_ == 0 else 0)
    messages = agent.model_client.messages
    validate(messages)
    assert messages[-1] == {"role": "assistant", "content": "".join(shown), "aimu_partial": True,
                            "aimu_model": agent.model_client.answered_by}
    assert await agent.run("continue") == "ok"
    await agent.aclose()
