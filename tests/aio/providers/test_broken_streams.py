"""A reply whose stream breaks mid-way is asked again (issue 44), on every wire, over the
loopback server cutting the connection at every chunk of a reply (thinking, text, a tool
call's arguments, the final usage event): the run ends as it would have without the cut,
the transcript holds the reply once, a consumer's view (``TurnRetried``) never doubles
text, and no tool runs on half its arguments. Stops landing while the retry waits win."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from provider_support import assert_only_current_task, client_at

from aimu import aio
from aimu.aio.client import ModelClient
from aimu.aio.errors import ModelConnectionError
from aimu.aio.events import Event, ModelRetry, TextChunk, TurnRetried
from aimu.aio.transcript import Message, validate
from aimu.testing.script import Fault, ScriptedCall, Turn, cut_once
from aimu.testing.server import LoopbackServer

#: Wires whose client can continue a trailing assistant message (given the option).
CONTINUING = ("ollama", "openai", "anthropic")

REPLY = Turn(thinking="let me see", text="Looking up the weather in Oslo for you now.",
             tool_calls=[ScriptedCall("lookup", {"city": "Oslo", "note": "a longer note"})])
AFTER = Turn(text="It is sunny in Oslo.")
TEXT = Turn(text="one two three four five six seven eight nine ten")


def model(provider: str, server: LoopbackServer, **options: Any) -> ModelClient:
    options.setdefault("retry_delay", 0.001)
    return client_at(provider, server.url, **options)


async def pieces_of(provider: str, turn: Turn) -> int:
    """How many chunks the wire streams ``turn`` in (its final ones counted)."""
    async with LoopbackServer([turn]) as server, model(provider, server) as client:
        async for _ in client.stream_turn([{"role": "user", "content": "x"}]):
            pass
    return server.streams[0].chunks_sent


def shown(events: list[Event]) -> str:
    """The text a consumer shows, following the rule of TurnRetried."""
    text = ""
    for event in events:
        if isinstance(event, TurnRetried):
            text = event.kept
        elif isinstance(event, TextChunk):
            text += event.text
    return text


def assistants(messages: list[Message]) -> list[Message]:
    return [m for m in messages if m["role"] == "assistant"]


async def test_a_cut_anywhere_in_a_reply_is_asked_again_and_kept_once(provider: str) -> None:
    calls: list[dict[str, str]] = []

    def lookup(city: str, note: str = "") -> str:
        """The weather in a city."""
        calls.append({"city": city, "note": note})
        return f"sunny in {city}"

    count, restarts = await pieces_of(provider, REPLY), 0
    assert count >= 5
    for cut in range(count):
        calls.clear()
        async with (
            LoopbackServer(cut_once(REPLY, AFTER, fault_after=cut)) as server,
            aio.Agent(model(provider, server), tools=[lookup]) as agent,
        ):
            events = [e async for e in agent.run("weather?", stream=True)]
            messages = list(agent.model_client.messages)
        where = f"{provider}, cut in chunk {cut} of {count}"
        assert agent.last_run is not None and agent.last_run.status == "completed", where
        assert calls == [{"city": "Oslo", "note": "a longer note"}], where  # once, whole
        first, second = assistants(messages)
        assert first["content"] == REPLY.text and not first.get("aimu_partial"), where
        assert [c["function"]["arguments"] for c in first["tool_calls"]] == [  # type: ignore[typeddict-item]
            {"city": "Oslo", "note": "a longer note"}
        ], where
        assert second["content"] == AFTER.text, where
        validate(messages)
        turn_events = events[: events.index(next(e for e in events if e.type == "tool_call"))]
        assert shown(turn_events) == REPLY.text, where  # a reader shows the text once
        retried = [e.mode for e in events if isinstance(e, TurnRetried)]
        restarts += bool(retried)
        if agent.last_run.retries == 0:  # cut after the reply had finished: its end lost
            assert provider in ("openai", "anthropic") and cut >= count - 2, where
            assert not retried and len(server.requests) == 2, where
            continue
        assert retried in ([], ["restarted"]), where  # [] when nothing had come yet
        assert len(server.requests) == 3, where
    assert restarts >= count // 2  # most cuts came after part of the reply went out
    await assert_only_current_task()


@pytest.mark.parametrize("fault", ["cut", "drop", "overloaded_event", "no_done"])
async def test_a_text_reply_continues_where_the_wire_can(provider: str, fault: Fault) -> None:
    if fault == "overloaded_event" and provider == "ollama":
        await test_an_error_line_that_names_no_status_is_not_asked_again(fault)
        return
    continues = provider in CONTINUING
    options = {"continues_partial": True} if continues else {}
    async with (
        LoopbackServer(cut_once(TEXT, fault=fault, fault_after=4)) as server,
        aio.Agent(model(provider, server, **options)) as agent,
    ):
        events = [e async for e in agent.run("count", stream=True)]
        messages = list(agent.model_client.messages)
    (retried,) = [e for e in events if isinstance(e, TurnRetried)]
    so_far = TEXT.text if fault == "no_done" else "one two three four "
    assert (retried.mode, retried.kept) == (
        ("continued", so_far) if continues else ("restarted", "")
    )
    assert [m["content"] for m in assistants(messages)] == [TEXT.text]
    assert shown(events) == TEXT.text
    second = server.requests[1].view or server.requests[1].body
    last = second["messages"][-1]
    if continues:  # the text so far went as the answer to continue (no trailing space:
        assert last["role"] == "assistant"  # Anthropic refuses one)
        assert TEXT.text.startswith(last["content"]) and last["content"].strip() == (
            so_far.strip()
        )
    else:
        assert last["role"] == "user"
    assert agent.last_run is not None and agent.last_run.retries == 1
    # The broken attempt is paid for: its request again and its text, estimated.
    assert agent.last_run.usage_estimated
    assert agent.last_run.usage["input_tokens"] > 0


async def test_an_error_line_that_names_no_status_is_not_asked_again(
    fault: Fault = "error_event",
) -> None:
    """Ollama's error line is only words: nothing says asking again would help."""
    async with (
        LoopbackServer(cut_once(TEXT, fault=fault, fault_after=3)) as server,
        aio.Agent(model("ollama", server)) as agent,
    ):
        with pytest.raises(aio.ModelHTTPError, match=f"scripted {fault}"):
            await agent.run("count")
        assert agent.model_client.messages[-1].get("aimu_partial") is True
    assert len(server.requests) == 1


async def test_a_llama_cpp_style_echo_of_the_kept_text_is_taken_out() -> None:
    script = cut_once(TEXT, fault_after=3)
    async with (
        LoopbackServer(script, echoes_prefill=True) as server,
        aio.Agent(model("openai", server, continues_partial=True)) as agent,
    ):
        events = [e async for e in agent.run("count", stream=True)]
        assert [m["content"] for m in assistants(agent.model_client.messages)] == [TEXT.text]
    assert shown(events) == TEXT.text


async def test_a_stalled_stream_is_asked_again_after_the_read_timeout(provider: str) -> None:
    async with (
        LoopbackServer(cut_once(TEXT, fault="stall", fault_after=2)) as server,
        aio.Agent(model(provider, server, timeout=0.5)) as agent,
    ):
        assert await agent.run("count") == TEXT.text
    assert agent.last_run is not None and agent.last_run.retries == 1
    await server.wait_abandoned(1, timeout=5)


async def test_with_no_retry_left_the_run_fails_with_the_partial_kept(provider: str) -> None:
    cut = Turn(text=TEXT.text, fault="cut", fault_after=3)
    async with (
        LoopbackServer([cut] * 3) as server,
        aio.Agent(model(provider, server, retries=2)) as agent,
    ):
        with pytest.raises(ModelConnectionError):
            await agent.run("count")
        last = agent.model_client.messages[-1]
    assert last["role"] == "assistant" and last.get("aimu_partial") is True
    assert last["content"] and TEXT.text.startswith(last["content"])
    assert agent.last_run is not None and agent.last_run.status == "failed"
    assert agent.last_run.retries == 2 and len(server.requests) == 3


async def start_and_wait_for_retry(
    provider: str, server: LoopbackServer, **options: Any
) -> tuple[aio.Agent, aio.RunHandle[str]]:
    """A run whose reply broke, its retry waiting 30 s: returned once it waits."""
    agent = aio.Agent(model(provider, server, retry_delay=30.0), **options)
    handle = aio.RunHandle.start(agent.run("count"))
    async for event in handle.events():
        if isinstance(event, ModelRetry):
            break
    return agent, handle


def kept_partial(agent: aio.Agent) -> Message:
    last = agent.model_client.messages[-1]
    assert last["role"] == "assistant" and last.get("aimu_partial") is True, last
    assert last["content"] == "one two three ", last
    validate(agent.model_client.messages)
    return last


@pytest.mark.parametrize("stop", ["cancel", "interrupt", "deadline"])
async def test_a_stop_while_the_retry_waits_ends_the_run_at_once(provider: str, stop: str) -> None:
    async with LoopbackServer(cut_once(TEXT, fault_after=3)) as server:
        if stop == "deadline":  # due while the retry would wait: no retry is made
            agent = aio.Agent(model(provider, server, retry_delay=30.0))
            handle = aio.RunHandle.start(agent.run("count"), timeout=5.0)
        else:
            agent, handle = await start_and_wait_for_retry(provider, server)
            handle.cancel() if stop == "cancel" else handle.interrupt()
        async with asyncio.timeout(10):  # a guard against a hang: the stop lands at once
            if stop == "interrupt":
                await handle
            else:
                with pytest.raises((asyncio.CancelledError, ModelConnectionError)):
                    await handle
        kept_partial(agent)
        expected = {"cancel": "cancelled", "interrupt": "interrupted", "deadline": "failed"}
        assert agent.last_run is not None and agent.last_run.status == expected[stop]
        assert len(server.requests) == 1  # the request was not sent again
        await agent.aclose()


async def test_a_budget_the_broken_attempt_crosses_ends_the_run_limited(provider: str) -> None:
    # The request's ~100 tokens and the cut text fit 150; paid again for a retry, not.
    limits = aio.UsageLimits(total_tokens=150)
    async with (
        LoopbackServer(cut_once(TEXT, fault_after=3)) as server,
        aio.Agent(model(provider, server), system="s" * 400, limits=limits) as agent,
    ):
        reply = await agent.run("count")
        last = kept_partial(agent)
    assert agent.last_run is not None and agent.last_run.status == "limited"
    assert agent.last_run.limit is not None and "total_tokens" in agent.last_run.limit
    assert reply == last["content"]
    assert len(server.requests) == 1  # the retry was not sent


async def test_a_handles_events_tell_of_the_retry(provider: str) -> None:
    async with (
        LoopbackServer(cut_once(TEXT, fault_after=3)) as server,
        aio.Agent(model(provider, server)) as agent,
    ):
        handle = aio.RunHandle.start(agent.run("count"))
        events = [event async for event in handle.events()]
        assert await handle == TEXT.text
    (retried,) = [e for e in events if isinstance(e, TurnRetried)]
    # Ollama's client continues a trailing assistant message by default.
    assert retried.mode == ("continued" if provider == "ollama" else "restarted")
    assert retried.attempt == 1 and shown(events) == TEXT.text


async def test_a_background_response_is_re_attached_and_says_continued() -> None:
    async with LoopbackServer([Turn(text=TEXT.text, fault="drop", fault_after=4)]) as server:
        client = model("openai-responses", server, background=True)
        async with aio.Agent(client) as agent:
            events = [e async for e in agent.run("count", stream=True)]
            assert [m["content"] for m in assistants(agent.model_client.messages)] == [TEXT.text]
    (retried,) = [e for e in events if isinstance(e, TurnRetried)]
    assert (retried.mode, retried.kept) == ("continued", "one two three four ")
    assert shown(events) == TEXT.text
    assert agent.last_run is not None and agent.last_run.retries == 1
    assert [r.method for r in server.requests] == ["POST", "GET"]  # re-attached: not asked


@pytest.mark.parametrize("wire", CONTINUING)
async def test_a_continued_reply_is_whole_wherever_the_cut_lands(wire: str) -> None:
    """Pieces of uneven length: cuts land mid-word and right after a space (which
    Anthropic's prefill leaves off and the continuation brings back once)."""
    reply = Turn(text="Lighthouses guided ships with fire, then lamps and lenses.", chunks=9)
    count = await pieces_of(wire, reply)
    continued = 0
    for cut in range(count):
        async with (
            LoopbackServer(cut_once(reply, fault_after=cut)) as server,
            aio.Agent(model(wire, server, continues_partial=True)) as agent,
        ):
            events = [e async for e in agent.run("tell me", stream=True)]
            answers = [m["content"] for m in assistants(agent.model_client.messages)]
        where = f"{wire}, cut in chunk {cut} of {count}"
        assert answers == [reply.text] and shown(events) == reply.text, where
        continued += any(isinstance(e, TurnRetried) and e.mode == "continued" for e in events)
    assert continued >= count // 2


async def test_a_wall_limit_reached_while_the_retry_waits_ends_the_run_limited(
    provider: str,
) -> None:
    limits = aio.UsageLimits(wall=1.0)  # the retry would wait 15 to 30 s
    async with (
        LoopbackServer(cut_once(TEXT, fault_after=3)) as server,
        aio.Agent(model(provider, server, retry_delay=30.0), limits=limits) as agent,
    ):
        async with asyncio.timeout(20):  # a guard against a hang, not a timing bet
            reply = await agent.run("count")
        last = kept_partial(agent)
    assert agent.last_run is not None and agent.last_run.status == "limited"
    assert reply == last["content"] and len(server.requests) == 1
