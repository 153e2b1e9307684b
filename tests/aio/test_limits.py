"""Budgets: UsageLimits stop a run at the boundary before crossing, or cut a stream at once;
the run ends ``limited`` with a valid transcript and resume(limits=larger) goes on."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.client import ModelClient
from aimu.aio.ends import LIMITED
from aimu.aio.events import TextChunk
from aimu.aio.limits import Budget, Spend
from aimu.aio.providers.ollama import OllamaClient
from aimu.aio.providers.openai import OpenAIClient
from aimu.aio.store import RunRecord
from aimu.aio.transcript import dangling_calls, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer


def lookup(city: str) -> str:
    """Look a city up."""
    return f"{city} is sunny"


def three_rounds() -> list[Turn]:
    """Two tool rounds, then an answer: three requests, two tool calls."""
    return [
        Turn(tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})], input_tokens=10,
             output_tokens=5),
        Turn(tool_calls=[ScriptedCall("lookup", {"city": "Rome"})], input_tokens=20,
             output_tokens=5),
        Turn(text="both are sunny", input_tokens=30, output_tokens=5),
    ]


def assert_valid(agent: aio.Agent) -> None:
    validate(agent.model_client.messages)


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"requests": -1}, ValueError),
        ({"output_tokens": -5}, ValueError),
        ({"cost": math.nan}, ValueError),
        ({"wall": math.inf}, ValueError),
        ({"wall": -0.5}, ValueError),
        ({"wall": 10**400}, ValueError),  # no float holds it: not an OverflowError
        ({"cost": 10**400}, ValueError),
        ({"requests": 10**400}, ValueError),
        ({"total_tokens": 2**63}, ValueError),  # more than a store's integer holds
        ({"requests": 1.5}, TypeError),
        ({"tool_calls": True}, TypeError),
        ({"prices": {"m": (1, 2)}}, TypeError),
    ],
)
def test_bad_limits_are_refused_naming_the_field(options: dict[str, Any], error: type) -> None:
    with pytest.raises(error, match=next(iter(options))):
        aio.UsageLimits(**options)


def test_bad_prices_are_refused() -> None:
    with pytest.raises(ValueError, match="input"):
        aio.ModelPrice(input=-1.0, output=1.0)
    with pytest.raises(ValueError, match="input must be a non-negative finite number"):
        aio.ModelPrice(input=10**400, output=1.0)
    with pytest.raises(ValueError, match=r"output .* at most 1e"):
        aio.ModelPrice(input=1.0, output=1e308)  # a cost of inf, which no store takes
    with pytest.raises(TypeError, match="input"):
        aio.ModelPrice(input=None, output=1.0)  # type: ignore[arg-type]


def test_a_huge_limit_is_refused_in_a_short_message() -> None:
    with pytest.raises(ValueError, match="wall") as refused:
        aio.UsageLimits(wall=10**400)
    assert "401 characters" in str(refused.value) and len(str(refused.value)) < 200


async def test_a_cost_limit_without_a_price_for_the_model_is_refused_and_nothing_changes() -> None:
    model = ScriptedModel(three_rounds(), model="m1")
    with pytest.raises(ValueError, match="price for model 'm1'"):
        aio.Agent(model, limits=aio.UsageLimits(cost=1.0))
    agent = aio.Agent(model, tools=[lookup])
    with pytest.raises(ValueError, match="price for model 'm1'"):
        agent.run("go", limits=aio.UsageLimits(cost=1.0, prices={"other": aio.ModelPrice(1, 1)}))
    assert agent.model_client.messages == [] and model.turns_served == 0
    assert agent.status == "idle"


async def test_limits_must_be_usage_limits() -> None:
    agent = aio.Agent(ScriptedModel(three_rounds()))
    with pytest.raises(TypeError, match="UsageLimits"):
        agent.run("go", limits={"requests": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="UsageLimits"):
        aio.Agent(ScriptedModel([]), limits=3)  # type: ignore[arg-type]


# -- each limit, scripted ---------------------------------------------------------------------


async def test_requests_limit_stops_before_the_request_then_resume_with_more_goes_on() -> None:
    model = ScriptedModel(three_rounds())
    agent = aio.Agent(model, tools=[lookup], limits=aio.UsageLimits(requests=2))
    assert await agent.run("weather?") == LIMITED
    result = agent.last_run
    assert result is not None
    assert (result.status, result.stop_reason, result.requests) == ("limited", "limit:requests", 2)
    assert result.limit is not None and "requests limit of 2" in result.limit
    assert model.turns_served == 2  # the third request was never made
    assert_valid(agent)
    assert dangling_calls(agent.model_client.messages) == []
    assert await agent.resume(limits=aio.UsageLimits(requests=5)) == "both are sunny"
    assert agent.last_status == "completed"


async def test_tool_calls_limit_stops_before_the_round_and_resume_runs_the_calls() -> None:
    model = ScriptedModel(three_rounds())
    agent = aio.Agent(model, tools=[lookup], limits=aio.UsageLimits(tool_calls=1))
    await agent.run("weather?")
    assert agent.last_run is not None and agent.last_run.stop_reason == "limit:tool_calls"
    assert agent.last_run.spend is not None and agent.last_run.spend.tool_calls == 1
    open_calls = dangling_calls(agent.model_client.messages)
    assert [call["function"]["arguments"] for _, call in open_calls] == [{"city": "Rome"}]
    assert_valid(agent)
    assert await agent.resume(limits=aio.UsageLimits(tool_calls=1)) == "both are sunny"
    tool_results = [m["content"] for m in agent.model_client.messages if m["role"] == "tool"]
    assert tool_results == ["Oslo is sunny", "Rome is sunny"]


@pytest.mark.parametrize(
    ("limits", "name", "requests"),
    [
        (aio.UsageLimits(input_tokens=30), "input_tokens", 2),  # 10 + 20 reached after turn 2
        (aio.UsageLimits(output_tokens=5), "output_tokens", 1),
        (aio.UsageLimits(total_tokens=16), "total_tokens", 2),
        (aio.UsageLimits(cost=0.00002, prices={"scripted": aio.ModelPrice(1.0, 1.0)}), "cost", 2),
        (aio.UsageLimits(wall=0.0), "wall", 0),
    ],
)
async def test_a_limit_reached_stops_at_the_next_boundary(
    limits: aio.UsageLimits, name: str, requests: int
) -> None:
    model = ScriptedModel(three_rounds())
    agent = aio.Agent(model, tools=[lookup], limits=limits)
    await agent.run("weather?")
    assert agent.last_run is not None
    assert (agent.last_run.status, agent.last_run.stop_reason) == ("limited", f"limit:{name}")
    assert model.turns_served == requests
    assert_valid(agent)
    assert await agent.resume(limits=aio.UsageLimits()) == "both are sunny"


async def test_the_cost_is_priced_per_model() -> None:
    price = aio.ModelPrice(input=2.0, output=10.0)
    limits = aio.UsageLimits(cost=100.0, prices={"scripted": price})
    agent = aio.Agent(ScriptedModel(three_rounds()), tools=[lookup], limits=limits)
    await agent.run("weather?")
    spend = agent.last_run.spend if agent.last_run else None
    assert spend is not None
    assert spend.cost == pytest.approx((60 * 2.0 + 15 * 10.0) / 1_000_000)
    assert (spend.requests, spend.tool_calls, spend.input_tokens, spend.output_tokens) == (
        3, 2, 60, 15
    )


async def test_a_streamed_reply_that_crosses_the_output_limit_is_cut_at_once() -> None:
    words = " ".join(f"word{i:02d}" for i in range(40))  # 40 chunks of ~7 characters
    model = ScriptedModel([Turn(text=words, output_tokens=80), Turn(text="the rest")])
    agent = aio.Agent(model, limits=aio.UsageLimits(output_tokens=10))
    seen = [e.text async for e in agent.run("talk", stream=True) if isinstance(e, TextChunk)]
    result = agent.last_run
    assert result is not None and result.status == "limited"
    assert result.stop_reason == "limit:output_tokens" and result.usage_estimated
    assert 8 < result.usage["output_tokens"] <= 12  # estimated from what streamed
    last = agent.model_client.messages[-1]
    assert last["role"] == "assistant" and last.get("aimu_partial") is True
    assert last["content"] == "".join(seen) and len(seen) < 40
    assert result.reply == last["content"]
    assert model.open_streams == 0  # the stream was closed, not left running
    assert_valid(agent)
    assert await agent.resume(limits=aio.UsageLimits()) == "the rest"


async def test_a_cancelled_stream_counts_its_usage_as_estimated() -> None:
    started = asyncio.Event()
    model = ScriptedModel([Turn(text="a b c d e f g h", delay=3600)])
    agent = aio.Agent(model)

    async def run() -> None:
        async for event in agent.run("talk", stream=True):
            if isinstance(event, TextChunk):
                started.set()

    task = asyncio.ensure_future(run())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    result = agent.last_run
    assert result is not None and result.status == "cancelled" and result.usage_estimated
    assert result.usage["output_tokens"] >= 1 and result.usage["input_tokens"] >= 1
    assert agent.spend.estimated and agent.spend.output_tokens >= 1


async def test_stopping_cannot_escape_a_session_budget() -> None:
    """Each run is cancelled mid-reply; the estimated spend still adds up to the limit."""
    model = ScriptedModel(lambda request: Turn(text="x" * 40 + " y", delay=3600))
    agent = aio.Agent(model, session_limits=aio.UsageLimits(output_tokens=25))
    runs = 0
    while True:
        started = asyncio.Event()

        async def run(started: asyncio.Event) -> None:
            async for event in agent.run("talk", stream=True):
                if isinstance(event, TextChunk):
                    started.set()

        task = asyncio.ensure_future(run(started))
        done, _ = await asyncio.wait([task, asyncio.ensure_future(started.wait())],
                                     return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            await task
            break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        runs += 1
        assert runs < 5
    # 11 estimated output tokens a cancelled run: the third crosses 25 as it streams.
    assert agent.last_status == "limited" and runs == 2
    assert agent.spend.estimated and agent.spend.output_tokens == 33


async def test_the_context_window_stops_a_request_that_would_not_fit(
    make_client: Callable[..., ModelClient], server: LoopbackServer
) -> None:
    agent = aio.Agent(make_client(context_window=50))
    assert await agent.run("x" * 400) == LIMITED
    assert agent.last_run is not None and agent.last_run.stop_reason == "limit:context_window"
    assert agent.last_run.limit is not None and "context window of 50" in agent.last_run.limit
    assert server.requests == []  # never sent: no provider error, a clear reason
    with pytest.raises(ValueError, match="context_window"):
        make_client(context_window=0)


# -- over the loopback server, both providers -------------------------------------------------


async def test_requests_and_tool_calls_limits_over_the_wire(
    make_client: Callable[..., ModelClient], server: LoopbackServer
) -> None:
    server.script = three_rounds()
    agent = aio.Agent(make_client(), tools=[lookup], limits=aio.UsageLimits(requests=1))
    assert await agent.run("weather?") == LIMITED
    assert len(server.requests) == 1
    await agent.resume(limits=aio.UsageLimits(tool_calls=0))  # per run: Rome's call waits
    assert agent.last_run is not None and agent.last_run.stop_reason == "limit:tool_calls"
    assert await agent.resume() == "both are sunny"  # the loopback server accepted each


async def test_an_output_limit_cuts_the_stream_and_the_server_sees_it_go(
    make_client: Callable[..., ModelClient], server: LoopbackServer
) -> None:
    words = " ".join(f"w{i:03d}" for i in range(200))
    server.script = [Turn(text=words, delay=0.001), Turn(text="done")]
    agent = aio.Agent(make_client(), limits=aio.UsageLimits(output_tokens=20))
    reply = await agent.run("talk")
    assert agent.last_status == "limited" and reply and reply in words
    (record,) = await server.wait_abandoned(1)
    assert not record.completed
    assert await agent.resume(limits=aio.UsageLimits()) == "done"


async def test_a_token_limit_on_a_server_that_reports_no_usage_says_so(
    server: LoopbackServer,
) -> None:
    server.script = [Turn(text="hello")]
    client = OpenAIClient(
        "gpt-test", base_url=server.openai_base_url, options={"stream_options": {}}
    )
    async with client:
        agent = aio.Agent(client, limits=aio.UsageLimits(total_tokens=100))
        with pytest.raises(aio.ModelProtocolError, match="reported no token usage"):
            await agent.run("hi")
        assert_valid(agent)


# -- the session's spend, in the store ---------------------------------------------------------


async def test_a_session_budget_holds_across_processes(tmp_path: Path) -> None:
    store = aio.SQLiteStore(tmp_path / "s.db")
    limits = aio.UsageLimits(requests=4)
    first = aio.Agent(ScriptedModel(three_rounds()), tools=[lookup], store=store,
                      session="s", session_limits=limits)
    async with first:
        assert await first.run("weather?") == "both are sunny"
        assert first.spend.requests == 3
    again = aio.Agent(ScriptedModel(three_rounds()), tools=[lookup], store=store,
                      session="s", session_limits=limits)
    async with again:
        await again.run("and again?")
        assert again.last_run is not None and again.last_run.stop_reason == "limit:requests"
        assert again.spend.requests == 4 and again.spend.tool_calls == 3
        assert again.last_run.limit is not None and "session's requests" in again.last_run.limit
    await store.aclose()


async def _died_after(store: aio.SQLiteStore, requests: int, **mark: Any) -> None:
    """The session of a run whose process died after ``requests`` requests: its task
    stored, its record as a kill -9 leaves it (running, its spend counted before each
    request), or as ``mark`` says (a drain's, a recovery's)."""
    writer = await store.open_session("s")
    try:
        await writer.append({"role": "user", "content": "weather?"})
        spend = Spend()
        spend.requests = requests
        fields: dict[str, Any] = {"status": "running", **mark}
        await writer.record_run(RunRecord(
            id="dead", session="s", agent="agent", started=1.0, spend=spend.dump(),
            messages_from=0, **fields,
        ))
    finally:
        await writer.aclose()


@pytest.mark.parametrize("mark", [{}, {"status": "failed", "recover": True}])
async def test_a_resume_of_a_run_that_died_goes_on_with_its_budget(
    tmp_path: Path, mark: dict[str, Any]
) -> None:
    """Issue 42 item 8: the run died after 3 of its 4 requests (its record says running,
    or a recovering server marked it to go on): its resume may send 1 more, not 4."""
    store = aio.SQLiteStore(tmp_path / "s.db")
    await _died_after(store, 3, **mark)
    model = ScriptedModel(three_rounds())
    async with aio.Agent(model, tools=[lookup], store=store, session="s",
                         limits=aio.UsageLimits(requests=4)) as agent:
        assert await agent.resume() == LIMITED
        assert model.turns_served == 1
        assert agent.last_run is not None and agent.last_run.requests == 1
        [latest, _] = await store.runs(session="s")
        assert latest.spend is not None and latest.spend["requests"] == 4
    await store.aclose()


async def test_a_resume_of_a_run_that_ended_has_a_new_budget(tmp_path: Path) -> None:
    store = aio.SQLiteStore(tmp_path / "s.db")
    await _died_after(store, 3, status="interrupted")
    model = ScriptedModel(three_rounds())
    async with aio.Agent(model, tools=[lookup], store=store, session="s",
                         limits=aio.UsageLimits(requests=4)) as agent:
        assert await agent.resume() == "both are sunny"
        assert model.turns_served == 3
    await store.aclose()


# -- workflows and handles ------------------------------------------------------------------------


async def test_a_workflow_run_passes_its_limits_to_the_agents_inside() -> None:
    agent = aio.Agent(ScriptedModel(three_rounds()), tools=[lookup])
    chain = aio.Chain([agent, agent])
    assert await chain.run("weather?", limits=aio.UsageLimits(requests=1)) == LIMITED
    assert chain.last_run is not None
    assert (chain.last_run.status, chain.last_run.stop_reason) == ("limited", "limit:requests")


async def test_a_handle_reports_limited() -> None:
    agent = aio.Agent(ScriptedModel(three_rounds()), tools=[lookup])
    handle = aio.RunHandle.start(agent.run("weather?", limits=aio.UsageLimits(requests=1)))
    assert await handle == LIMITED
    assert handle.status == "limited"


async def test_a_typed_run_that_is_limited_raises_no_output() -> None:
    agent = aio.Agent(ScriptedModel(three_rounds()), tools=[lookup], output_type=int,
                      limits=aio.UsageLimits(requests=1))
    with pytest.raises(aio.NoOutputError, match="limited"):
        await agent.run("count")


# -- the check itself ---------------------------------------------------------------------------


def test_a_budget_without_limits_checks_nothing() -> None:
    budget = Budget(None, None, Spend(), "m")
    assert not budget.limited and budget.before_request() is None


def test_spend_round_trips_and_bad_stored_spend_is_named() -> None:
    spend = Spend()
    spend.requests, spend.cost = 3, 0.5
    assert Spend.load(spend.dump(), "here").dump() == spend.dump()
    with pytest.raises(ValueError, match=r"session 'x'.*requests"):
        Spend.load({"requests": -1}, "session 'x'")


# -- the sweep: every limit crossed at every step -----------------------------------------------


def by_progress(request: Any) -> Turn:
    """Oslo's call, then Rome's, then the answer, by the results the request holds; each
    turn streams a few words first, so a token limit can cut it anywhere."""
    done = sum(1 for m in request["messages"] if m["role"] == "tool")
    if done == 0:
        return Turn(text="let me look up Oslo", input_tokens=10, output_tokens=6,
                    tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})])
    if done == 1:
        return Turn(text="and now Rome please", input_tokens=20, output_tokens=6,
                    tool_calls=[ScriptedCall("lookup", {"city": "Rome"})])
    return Turn(text="both are sunny today", input_tokens=30, output_tokens=5)


_SWEEP = [
    *[("requests", aio.UsageLimits(requests=n)) for n in range(4)],
    *[("tool_calls", aio.UsageLimits(tool_calls=n)) for n in range(3)],
    *[("input_tokens", aio.UsageLimits(input_tokens=n)) for n in (0, 5, 10, 25, 30, 59, 60)],
    *[("output_tokens", aio.UsageLimits(output_tokens=n)) for n in range(18)],
    *[("total_tokens", aio.UsageLimits(total_tokens=n)) for n in range(0, 80, 4)],
    *[
        ("cost", aio.UsageLimits(cost=n / 1e6, prices={"scripted": aio.ModelPrice(1.0, 1.0)}))
        for n in range(0, 80, 4)
    ],
    ("wall", aio.UsageLimits(wall=0.0)),
]


@pytest.mark.parametrize(
    ("name", "limits"), _SWEEP, ids=[f"{n}-{i}" for i, (n, _) in enumerate(_SWEEP)]
)
async def test_every_limit_crossed_at_every_step_leaves_a_resumable_transcript(
    name: str, limits: aio.UsageLimits
) -> None:
    model = ScriptedModel(by_progress)
    agent = aio.Agent(model, tools=[lookup], limits=limits)
    await agent.run("weather?")
    result = agent.last_run
    assert result is not None and result.status in ("limited", "completed")
    assert_valid(agent)
    if result.status == "limited":
        assert result.stop_reason == f"limit:{name}" and result.limit
        open_calls = dangling_calls(agent.model_client.messages)
        assert not open_calls or name == "tool_calls"  # only a tool round waits for resume()
        assert await agent.resume(limits=aio.UsageLimits()) == "both are sunny today"
    assert model.open_streams == 0
    assert_valid(agent)
    assert dangling_calls(agent.model_client.messages) == []
    tool_results = [m["content"] for m in agent.model_client.messages if m["role"] == "tool"]
    assert tool_results == ["Oslo is sunny", "Rome is sunny"]  # each call ran once
    answers = [m for m in agent.model_client.messages if m["role"] == "assistant"]
    assert answers[-1]["content"] == "both are sunny today"


async def test_ollama_says_the_models_context_window_once_a_request_grows(
    server: LoopbackServer,
) -> None:
    from aimu.testing.server.ollama import CONTEXT_LENGTH

    async with OllamaClient("llama-test", host=server.url) as client:
        agent = aio.Agent(client)
        assert await agent.run("hello") != LIMITED
        assert [r.path for r in server.requests] == ["/api/chat"]  # small: nothing asked
        assert await agent.run("y " * (CONTEXT_LENGTH * 2)) == LIMITED
        assert agent.last_run is not None
        assert agent.last_run.stop_reason == "limit:context_window"
        assert f"context window of {CONTEXT_LENGTH}" in (agent.last_run.limit or "")
        assert [r.path for r in server.requests] == ["/api/chat", "/api/show"]
        await agent.run("y " * (CONTEXT_LENGTH * 2))
        assert [r.path for r in server.requests].count("/api/show") == 1  # asked once
    async with OllamaClient("llama-test", host=server.url, options={"num_ctx": 100}) as small:
        assert await small.discover_context_window() == 100  # what Ollama then uses
