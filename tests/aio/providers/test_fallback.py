"""FallbackModel over the loopback server: the turn goes to the next model on a refused
connection, a 5xx or a 429 that outlasted the retries, and never on a 4xx, a cancel, an
interrupt, a deadline, a limit or a reply already begun; the transcript crosses wires
and each assistant message names the model that wrote it; usage is counted per model."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from provider_support import assert_only_current_task, closed_port

from aimu import aio
from aimu.aio.errors import ModelHTTPError
from aimu.aio.transcript import validate
from aimu.testing.script import ScriptedCall, Turn, cut_once
from aimu.testing.server import LoopbackServer


def chat(server: LoopbackServer, **options: Any) -> aio.ModelClient:
    options.setdefault("retries", 0)
    return aio.client("openai:gpt-a", base_url=server.openai_base_url, api_key="sk-a",
                      **options)


def responses(server: LoopbackServer, **options: Any) -> aio.ModelClient:
    return aio.client("openai-responses:gpt-b", base_url=server.openai_base_url,
                      api_key="sk-b", **options)


def lookup(city: str) -> str:
    """Weather for a city."""
    return f"snow in {city}"


@pytest.mark.parametrize("fault", ["http_503", "http_500", "http_429", "refused"])
async def test_a_failing_primary_hands_the_turn_to_the_next_model(fault: str) -> None:
    script = [Turn(text="from b", input_tokens=3, output_tokens=2)]
    if fault != "refused":  # a 429 twice: the primary retries once on its own first
        failing = Turn(fault=fault, retry_after="0")  # type: ignore[arg-type]
        script[:0] = [failing] * (2 if fault == "http_429" else 1)
    async with LoopbackServer(script) as server:
        primary = (
            aio.client("openai:gpt-a", base_url=f"http://127.0.0.1:{closed_port()}/v1",
                       api_key="k", retries=0)
            if fault == "refused"
            else chat(server, retries=1 if fault == "http_429" else 0, retry_delay=0)
        )
        model = aio.FallbackModel(primary, responses(server))
        agent = aio.Agent(model)
        assert await agent.run("hi") == "from b"
        reply = model.messages[-1]
        assert reply["aimu_model"] == "openai-responses:gpt-b"  # type: ignore[typeddict-item]
        assert model.usage_by_model == {
            "openai-responses:gpt-b": {"input_tokens": 3, "output_tokens": 2}
        }
        assert server.requests[-1].path == "/v1/responses"
        if fault == "http_429":  # the primary's own retry came first
            assert [r.path for r in server.requests] == ["/v1/chat/completions"] * 2 + [
                "/v1/responses"]
        await model.aclose()


async def test_a_bad_request_is_not_handed_on() -> None:
    async with LoopbackServer([Turn(text="never")]) as server:
        primary = chat(server)
        model = aio.FallbackModel(primary, responses(server))
        model.messages = [{"role": "assistant", "content": "",
                           "tool_calls": [{"id": "c1", "type": "function",
                                           "function": {"name": "f", "arguments": {}}}]}]
        with pytest.raises(ModelHTTPError) as caught:
            async for _ in model.stream_turn(model.messages):
                pass
        assert caught.value.status_code == 400
        assert [r.path for r in server.requests] == ["/v1/chat/completions"]
        await model.aclose()


async def test_a_reply_broken_mid_stream_is_restarted_by_the_next_model() -> None:
    """Issue 44 item 6: the primary's stream breaks after text (its retries spent): the
    next model, which cannot continue a reply, takes the turn from the start; the cut
    text is replaced, never kept beside the new answer."""
    script = [Turn(text="a b c d", fault="drop", fault_after=2), Turn(text="from b")]
    async with LoopbackServer(script) as server:
        model = aio.FallbackModel(chat(server), responses(server))
        agent = aio.Agent(model)
        events = [e async for e in agent.run("go", stream=True)]
        assert [r.path for r in server.requests] == ["/v1/chat/completions", "/v1/responses"]
        answers = [m for m in model.messages if m["role"] == "assistant"]
        assert [(m["content"], m.get("aimu_model")) for m in answers] == [
            ("from b", "openai-responses:gpt-b")]
        assert "aimu_partial" not in answers[0]
        (retried,) = [e for e in events if isinstance(e, aio.TurnRetried)]
        assert (retried.mode, retried.kept) == ("restarted", "")
        assert "dropped mid-reply" in retried.error
        validate(model.messages)
        await model.aclose()


async def test_a_reply_broken_mid_stream_is_continued_by_a_next_model_that_can() -> None:
    reply = Turn(text="one two three four five six")
    async with LoopbackServer(cut_once(reply, fault_after=3)) as server:
        nxt = aio.client("ollama:llama", host=server.url)  # continues a trailing answer
        model = aio.FallbackModel(chat(server), nxt)
        agent = aio.Agent(model)
        events = [e async for e in agent.run("go", stream=True)]
        (retried,) = [e for e in events if isinstance(e, aio.TurnRetried)]
        assert (retried.mode, retried.kept) == ("continued", "one two three ")
        sent = server.requests[1].body["messages"][-1]
        assert sent == {"role": "assistant", "content": "one two three "}
        answers = [m for m in model.messages if m["role"] == "assistant"]
        assert [(m["content"], m.get("aimu_model")) for m in answers] == [
            (reply.text, "ollama:llama")]
        await model.aclose()


async def test_when_every_model_fails_the_error_names_each_and_its_failure() -> None:
    """Issue 42 item 10: not only the last model's failure (the first's was a log line)."""
    async with LoopbackServer([Turn(fault="http_503"), Turn(fault="http_502")]) as server:
        model = aio.FallbackModel(chat(server), responses(server, retries=0))
        with pytest.raises(ModelHTTPError) as caught:
            await aio.Agent(model).run("go")
        await model.aclose()
        host = server.openai_base_url
    message = str(caught.value)
    assert message.startswith("every model of the FallbackModel failed the turn: ")
    first, second = message.split("; ")
    assert "openai:gpt-a at " in first and "ModelHTTPError" in first and "HTTP 503" in first
    assert "openai-responses:gpt-b at " in second and "HTTP 502" in second
    assert caught.value.status_code == 502 and caught.value.host == host
    assert "sk-a" not in message and "sk-b" not in message


async def test_a_cancel_during_the_primary_request_never_reaches_the_next_model() -> None:
    async with LoopbackServer([Turn(text="late", first_byte_delay=30)]) as server:
        model = aio.FallbackModel(chat(server), responses(server))
        handle = aio.RunHandle.start(aio.Agent(model).run("go"))
        await server.wait_requests(1)
        handle.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handle
        (record,) = await server.wait_abandoned(1)
        assert record.path == "/v1/chat/completions"
        assert len(server.requests) == 1
        await model.aclose()
    await assert_only_current_task()


async def test_an_interrupt_during_a_retry_wait_is_not_handed_on() -> None:
    async with LoopbackServer([Turn(fault="http_503", retry_after="30")]) as server:
        model = aio.FallbackModel(chat(server, retries=1), responses(server))
        agent = aio.Agent(model)
        handle = aio.RunHandle.start(agent.run("go"))
        async for event in handle.events():
            if isinstance(event, aio.ModelRetry):
                handle.interrupt()  # lands in the primary's backoff
                break
        assert await handle == "Run interrupted."
        assert len(server.requests) == 1  # the next model was never asked
        await model.aclose()


@pytest.mark.parametrize("stop", ["deadline", "wall limit"])
async def test_a_deadline_or_a_limit_during_the_primary_never_reaches_the_next_model(
    stop: str,
) -> None:
    """The primary's reply never comes; the run's deadline (``timeout=``) or its wall
    limit ends the turn, and the next model is never asked."""
    async with LoopbackServer([Turn(text="late", first_byte_delay=30)]) as server:
        model = aio.FallbackModel(chat(server), responses(server))
        limits = aio.UsageLimits(wall=0.3) if stop == "wall limit" else None
        agent = aio.Agent(model, limits=limits)
        handle = aio.RunHandle.start(
            agent.run("go"), timeout=0.3 if stop == "deadline" else None
        )
        await handle.wait()
        if stop == "wall limit":
            assert agent.last_status == "limited"
        else:
            assert handle.status == "timed_out"
        (record,) = await server.wait_abandoned(1)  # the primary's stream was closed
        assert record.path == "/v1/chat/completions"
        assert [r.path for r in server.requests] == ["/v1/chat/completions"]
        validate(model.messages)
        await model.aclose()
    await assert_only_current_task()


async def test_a_session_crosses_wires_and_each_reply_names_its_model() -> None:
    """Turn 1 on the chat wire calls a tool; turn 2 fails there and goes to the Responses
    wire with the call and its result translated; each reply records its model."""
    script = [
        Turn(tool_calls=[ScriptedCall("lookup", {"city": "Oslo"}, id="call_x")],
             input_tokens=5, output_tokens=1),
        Turn(fault="http_502"),
        Turn(text="Snow in Oslo.", input_tokens=9, output_tokens=3),
    ]
    async with LoopbackServer(script) as server:
        model = aio.FallbackModel(chat(server), responses(server))
        agent = aio.Agent(model, tools=[lookup])
        assert await agent.run("weather?") == "Snow in Oslo."
        messages = model.messages
        validate(messages)
        writers = [m.get("aimu_model") for m in messages if m["role"] == "assistant"]
        assert writers == ["openai:gpt-a", "openai-responses:gpt-b"]
        items = server.requests[-1].body["input"]
        assert {"type": "function_call", "call_id": "call_x", "name": "lookup",
                "arguments": '{"city":"Oslo"}'} in items
        assert {"type": "function_call_output", "call_id": "call_x",
                "output": "snow in Oslo"} in items
        assert all("aimu_" not in str(item) for item in items)
        assert model.usage_by_model == {
            "openai:gpt-a": {"input_tokens": 5, "output_tokens": 1},
            "openai-responses:gpt-b": {"input_tokens": 9, "output_tokens": 3},
        }
        assert agent.last_run is not None
        assert agent.last_run.usage == {"input_tokens": 14, "output_tokens": 4}
        twin = model.fork()
        assert twin.messages == [] and twin.models[1].host == model.models[1].host
        await model.aclose()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="argument 1"):
        aio.FallbackModel(aio.client("test"), "openai:gpt")  # type: ignore[arg-type]
    only = aio.client("test")
    with pytest.raises(ValueError, match="same client twice"):
        aio.FallbackModel(only, only)


async def test_cost_is_priced_by_the_model_that_answered() -> None:
    """Turn 1 answered by the primary, turn 2 handed to the fallback: each priced as its
    own model; a cost limit needs a price for every model of the fallback."""
    script = [
        Turn(tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})],
             input_tokens=1_000_000, output_tokens=0),
        Turn(fault="http_503"),
        Turn(text="done", input_tokens=1_000_000, output_tokens=0),
    ]
    prices = {"gpt-a": aio.ModelPrice(input=1.0, output=1.0),
              "gpt-b": aio.ModelPrice(input=10.0, output=10.0)}
    async with LoopbackServer(script) as server:
        model = aio.FallbackModel(chat(server), responses(server))
        with pytest.raises(ValueError, match="gpt-b"):
            aio.Agent(model, limits=aio.UsageLimits(cost=100.0, prices={"gpt-a": prices["gpt-a"]}))
        agent = aio.Agent(model, tools=[lookup],
                          limits=aio.UsageLimits(cost=100.0, prices=prices))
        assert await agent.run("go") == "done"
        assert agent.last_run is not None and agent.last_run.spend is not None
        assert agent.last_run.spend.cost == pytest.approx(11.0)  # 1 at gpt-a, 10 at gpt-b
        await model.aclose()
