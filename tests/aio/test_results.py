"""Run results (``agent.last_run``, ``workflow.last_run``, ``handle.last_run`` and the
numbers on ``RunFinished``) over the loopback server, with the real HTTP clients: every
outcome, an answer cut off by the length limit, retries, resume, workflows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from aimu import aio
from aimu.aio.agent import INTERRUPTED
from aimu.aio.approvals import PAUSED
from aimu.aio.client import ModelClient
from aimu.aio.errors import ModelHTTPError
from aimu.aio.events import RunFinished, RunResult, TextChunk
from aimu.aio.providers.ollama import OllamaClient
from aimu.aio.providers.openai import OpenAIClient
from aimu.aio.transcript import validate
from aimu.testing.script import Script, ScriptedCall, Turn
from aimu.testing.server import LoopbackServer

Serve = Callable[[Script], Awaitable[ModelClient]]


@pytest.fixture(params=["ollama", "openai"])
async def serve(request: pytest.FixtureRequest) -> AsyncIterator[Serve]:
    """Starts a loopback server playing a script; returns a client of the protocol."""
    servers: list[LoopbackServer] = []
    clients: list[ModelClient] = []

    async def make(script: Script) -> ModelClient:
        server = LoopbackServer(script)
        await server.start()
        servers.append(server)
        client: ModelClient
        if request.param == "ollama":
            client = OllamaClient("llama-test", host=server.url, retry_delay=0.001)
        else:
            client = OpenAIClient(
                "gpt-test", base_url=server.url + "/v1", api_key="k", retry_delay=0.001
            )
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.aclose()
    for server in servers:
        await server.stop()


def tool_call(name: str, **arguments: Any) -> ScriptedCall:
    return ScriptedCall(name, arguments)


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def finished(events: list[Any]) -> RunFinished:
    final = events[-1]
    assert isinstance(final, RunFinished)
    return final


def check_same(result: RunResult[str], final: RunFinished) -> None:
    """RunFinished carries the result's numbers."""
    assert (final.status, final.reply, final.stop_reason, final.error) == (
        result.status, result.reply, result.stop_reason, result.error,
    )
    assert (final.requests, final.retries, final.duration) == (
        result.requests, result.retries, result.duration,
    )


async def test_a_completed_run_reports_what_it_did(serve: Serve) -> None:
    client = await serve([
        Turn(tool_calls=[tool_call("add", a=1, b=2)], input_tokens=10, output_tokens=3),
        Turn(text="it is 3", input_tokens=20, output_tokens=2),
    ])
    agent = aio.Agent(client, tools=[add], system="be brief")
    assert agent.last_run is None
    await agent.open()
    events = [e async for e in agent.run("1+2?", stream=True)]
    result = agent.last_run
    assert result is not None
    assert (result.status, result.output, result.reply) == ("completed", "it is 3", "it is 3")
    assert result.stop_reason == "stop" and not result.cut_off
    assert result.usage == {"input_tokens": 30, "output_tokens": 5}
    assert (result.requests, result.retries, result.error) == (2, 0, None)
    assert result.duration > 0 and result.started_at <= result.ended_at
    assert [m["role"] for m in result.messages] == ["user", "assistant", "tool", "assistant"]
    assert result.messages == client.messages[1:]  # the system prompt was there before
    assert result.messages[0] is client.messages[1]  # the transcript's own, no copy
    assert result.run_id is None and result.source == "agent"
    check_same(result, finished(events))


async def test_a_resumed_run_reports_only_what_the_resume_added(serve: Serve) -> None:
    charged: list[int] = []

    @aio.tool(approval=True)
    def charge(amount: int) -> str:
        """Charge money."""
        charged.append(amount)
        return "charged"

    client = await serve([Turn(tool_calls=[tool_call("charge", amount=5)]), Turn(text="done")])
    agent = aio.Agent(client, tools=[charge])
    assert await agent.run("pay") == PAUSED
    paused = agent.last_run
    assert paused is not None and paused.status == "paused" and paused.output == PAUSED
    assert [m["role"] for m in paused.messages] == ["user", "assistant"]
    agent.approve(agent.pending_approvals[0].call_id)
    assert await agent.resume() == "done"
    resumed = agent.last_run
    assert resumed is not None and resumed is not paused
    assert resumed.status == "completed" and resumed.requests == 1
    assert [m["role"] for m in resumed.messages] == ["tool", "assistant"]
    assert charged == [5]


async def test_the_sessions_totals_are_spend_and_this_objects_are_local_usage(
    tmp_path: Any,
) -> None:
    """``agent.usage`` said "this session's runs" but read 0 in a new process while
    ``agent.spend`` held the stored totals: ``spend`` is the session's totals,
    ``local_usage`` this object's, and ``usage`` still works, with a warning."""
    store = aio.SQLiteStore(tmp_path / "s.db")
    first = aio.Agent(aio.client("test"), store=store, session="s")
    await first.run("hello there")
    await first.run("and again")
    used = first.local_usage
    assert used["output_tokens"] > 0
    assert (first.spend.input_tokens, first.spend.output_tokens) == (
        used["input_tokens"], used["output_tokens"]
    )
    await first.aclose()

    later = aio.Agent(aio.client("test"), store=store, session="s")  # as a new process would
    await later.open()
    assert later.local_usage == {"input_tokens": 0, "output_tokens": 0}
    assert later.spend.output_tokens == used["output_tokens"]  # the session's, as stored
    assert later.spend.requests == 2
    with pytest.warns(DeprecationWarning, match=r"Agent.usage counts only this object's runs"):
        assert later.usage == later.local_usage
    await later.aclose()
    await store.aclose()


async def test_an_answer_cut_off_by_the_length_limit_is_incomplete(serve: Serve) -> None:
    client = await serve([Turn(text="the beginning of a long", stop_reason="length")])
    agent = aio.Agent(client)
    handle = aio.RunHandle.start(agent.run("tell me everything"))
    assert await handle == "the beginning of a long"  # run() still returns the text
    result = agent.last_run
    assert result is not None
    assert (result.status, result.stop_reason, result.cut_off) == ("incomplete", "length", True)
    assert result.output == "the beginning of a long"
    assert handle.status == "incomplete" and handle.last_run is result
    assert agent.status == "incomplete"


async def test_a_content_filter_stop_is_incomplete_too(serve: Serve) -> None:
    agent = aio.Agent(await serve([Turn(text="I can't", stop_reason="content_filter")]))
    events = [e async for e in agent.run("x", stream=True)]
    assert finished(events).status == "incomplete"
    assert finished(events).stop_reason == "content_filter"


async def test_a_cut_off_turn_that_called_tools_is_not_the_answer(serve: Serve) -> None:
    client = await serve([
        Turn(tool_calls=[tool_call("add", a=1, b=1)], stop_reason="length"),
        Turn(text="2"),
    ])
    agent = aio.Agent(client, tools=[add])
    assert await agent.run("1+1") == "2"
    assert agent.last_run is not None and agent.last_run.status == "completed"


async def test_retries_are_counted(serve: Serve) -> None:
    client = await serve([Turn(fault="http_503", retry_after="0"), Turn(text="made it")])
    agent = aio.Agent(client)
    events = [e async for e in agent.run("x", stream=True)]
    result = agent.last_run
    assert result is not None
    assert (result.status, result.requests, result.retries) == ("completed", 1, 1)
    check_same(result, finished(events))
    assert agent.start().last_run is None  # a new session has run nothing yet


async def test_a_failed_run_has_its_result_and_raises(serve: Serve) -> None:
    agent = aio.Agent(await serve([Turn(fault="http_500")]))
    with pytest.raises(ModelHTTPError):
        await agent.run("x")
    result = agent.last_run
    assert result is not None
    assert (result.status, result.output, result.requests) == ("failed", None, 1)
    assert result.error is not None and result.error.startswith("ModelHTTPError")
    assert [m["role"] for m in result.messages] == ["user"]


async def test_a_hard_cancel_propagates_and_the_result_tells_what_happened(
    serve: Serve,
) -> None:
    agent = aio.Agent(await serve([Turn(text="one two three four five six", delay=30)]))
    handle = aio.RunHandle.start(agent.run("talk"))
    stream = handle.events()
    async for event in stream:
        if isinstance(event, TextChunk):
            break  # a byte of the reply arrived: the run is mid-stream
    await stream.aclose()
    handle.cancel("stop it")
    with pytest.raises(asyncio.CancelledError):
        await handle
    result = agent.last_run
    assert result is not None and handle.last_run is result
    assert (result.status, result.output, result.stop_reason) == ("cancelled", None, None)
    assert result.error is not None and result.error.startswith("CancelledError")
    assert result.reply == "one "
    assert [m["role"] for m in result.messages] == ["user", "assistant"]
    assert result.messages[-1].get("aimu_partial") is True
    validate(agent.model_client.messages)


async def test_a_cancel_of_the_awaiting_task_still_propagates(serve: Serve) -> None:
    agent = aio.Agent(await serve([Turn(text="a b c", delay=30)]))
    chunks: asyncio.Queue[object] = asyncio.Queue()

    async def consume() -> None:
        async for event in agent.run("x", stream=True):
            chunks.put_nowait(event)

    task = asyncio.create_task(consume())
    while not isinstance(await chunks.get(), TextChunk):
        pass
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert agent.last_run is not None and agent.last_run.status == "cancelled"


async def test_a_deadline_ends_the_run_timed_out_everywhere(serve: Serve, tmp_path: Any) -> None:
    """One status for a deadline's stop: the handle, last_run, RunFinished, the store
    (it was ``cancelled`` in all but the handle)."""
    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        client = await serve([Turn(text="never finishes", fault="hang", fault_after=1)])
        agent = aio.Agent(client, store=store, session="s")
        handle = aio.RunHandle.start(agent.run("x"), timeout=0.2)
        finished = []
        async for event in handle.events():
            if isinstance(event, RunFinished):
                finished.append(event)
        with pytest.raises(TimeoutError):
            await handle
        assert handle.status == "timed_out"
        result = agent.last_run
        assert result is not None and handle.last_run is result
        assert result.status == "timed_out" and result.output is None
        assert agent.status == "timed_out" and [f.status for f in finished] == ["timed_out"]
        info = await store.info("s")
        assert info is not None and info.status == "timed_out"
        await agent.aclose()
    chain = aio.Chain([aio.Agent(await serve([Turn(text="hangs", fault="hang", fault_after=1)]))])
    handle = aio.RunHandle.start(chain.run("x"), timeout=0.2)
    with pytest.raises(TimeoutError):
        await handle
    assert chain.last_status == "timed_out" and chain.state["status"] == "timed_out"


async def test_an_interrupted_run_reports_the_step_it_finished(serve: Serve) -> None:
    client = await serve([Turn(tool_calls=[tool_call("stop_here")]), Turn(text="never asked")])
    agent: aio.Agent

    async def stop_here() -> str:
        """Ask the run to stop."""
        agent.interrupt()
        return "stopping"

    agent = aio.Agent(client, tools=[stop_here])
    assert await agent.run("x") == INTERRUPTED
    result = agent.last_run
    assert result is not None
    assert (result.status, result.output, result.requests) == ("interrupted", INTERRUPTED, 1)
    assert [m["role"] for m in result.messages] == ["user", "assistant", "tool"]


async def test_max_rounds_is_reported(serve: Serve) -> None:
    looping = Turn(tool_calls=[tool_call("add", a=1, b=1)])
    agent = aio.Agent(await serve([looping, Turn(text="best I can")]), tools=[add], max_rounds=1)
    assert await agent.run("loop") == "best I can"
    result = agent.last_run
    assert result is not None and result.status == "max_rounds" and result.requests == 2


async def test_a_registered_handle_gives_its_run_id() -> None:
    class Control:
        def run_id(self, wanted: str | None) -> str:
            return wanted or "made"

        def attach(self, handle: aio.RunHandle[Any]) -> None:
            pass

    agent = aio.Agent(aio.client("test"))
    handle = aio.RunHandle.start(agent.run("x"), run_id="r-1", control=Control())
    await handle
    assert agent.last_run is not None and agent.last_run.run_id == "r-1"


async def test_a_typed_run_keeps_its_value_and_a_cut_off_json_is_corrected(
    serve: Serve,
) -> None:
    @dataclass
    class Weather:
        city: str
        degrees: int

    client = await serve([
        Turn(text='{"city": "Os', stop_reason="length"),
        Turn(text='{"city": "Oslo", "degrees": 3}'),
    ])
    agent = aio.Agent(client, output_type=Weather)
    weather = await agent.run("weather in Oslo")
    result = agent.last_run
    assert result is not None and result.output == weather == Weather("Oslo", 3)
    assert (result.status, result.requests) == ("completed", 2)  # one correction


# -- workflows -----------------------------------------------------------------------------


async def test_a_chain_totals_its_steps(serve: Serve) -> None:
    first = aio.Agent(await serve([Turn(text="draft", input_tokens=3, output_tokens=1)]), name="a")
    second = aio.Agent(await serve([Turn(text="final", input_tokens=5, output_tokens=1)]), name="b")
    chain = aio.Chain([first, second])
    assert chain.last_run is None
    events = [e async for e in chain.run("go", stream=True)]
    result = chain.last_run
    assert result is not None
    assert (result.status, result.output, result.stop_reason) == ("completed", "final", "stop")
    assert (result.requests, result.retries) == (2, 0)
    assert result.usage == {"input_tokens": 8, "output_tokens": 2}
    assert [(m["role"], m["content"]) for m in result.messages] == [
        ("user", "go"), ("assistant", "draft"), ("user", "draft"), ("assistant", "final"),
    ]
    check_same(result, finished(events))


async def test_a_chain_whose_answer_was_cut_off_is_incomplete(serve: Serve) -> None:
    first = aio.Agent(await serve([Turn(text="draft")]), name="a")
    second = aio.Agent(await serve([Turn(text="fin", stop_reason="length")]), name="b")
    handle = aio.RunHandle.start(aio.Chain([first, second]).run("go"))
    assert await handle == "fin"
    assert handle.status == "incomplete"
    assert handle.last_run is not None and handle.last_run.stop_reason == "length"


async def test_a_cut_off_middle_step_leaves_the_chain_completed(serve: Serve) -> None:
    first = aio.Agent(await serve([Turn(text="dra", stop_reason="length")]), name="a")
    second = aio.Agent(await serve([Turn(text="final")]), name="b")
    chain = aio.Chain([first, second])
    await chain.run("go")
    assert chain.last_run is not None and chain.last_run.status == "completed"
    # The state says which step was cut off, and a restored workflow knows it.
    (cut, whole) = chain.state["steps"]
    assert cut["incomplete"] is True and cut["stop_reason"] == "length"
    assert "incomplete" not in whole


async def test_parallel_is_incomplete_when_a_branch_was_cut_off(serve: Serve) -> None:
    left = aio.Agent(await serve([Turn(text="left")]), name="left")
    right = aio.Agent(await serve([Turn(text="rig", stop_reason="length")]), name="right")
    parallel = aio.Parallel([left, right])
    await parallel.run("go")
    result = parallel.last_run
    assert result is not None and result.status == "incomplete"
    assert result.stop_reason == "length" and result.requests == 2


async def test_a_workflow_resume_reports_only_the_resumed_part(serve: Serve) -> None:
    first = aio.Agent(await serve([Turn(text="draft")]), name="a")
    second = aio.Agent(await serve([Turn(text="final")]), name="b")
    chain = aio.Chain([first, second])
    handle = aio.RunHandle.start(chain.run("go"))

    def stop_after_the_first_step(event: object) -> None:
        if isinstance(event, RunFinished) and event.source == "a":
            handle.interrupt()  # the first step answered: stop before the second

    handle.scope.add_listener(stop_after_the_first_step)
    assert await handle == INTERRUPTED
    stopped = chain.last_run
    assert stopped is not None and stopped.status == "interrupted" and stopped.requests == 1
    assert await chain.resume() == "final"
    resumed = chain.last_run
    assert resumed is not None and resumed.status == "completed" and resumed.requests == 1
    assert [m["content"] for m in resumed.messages] == ["draft", "final"]


async def test_a_failed_workflow_has_its_result(serve: Serve) -> None:
    first = aio.Agent(await serve([Turn(text="draft")]), name="a")
    second = aio.Agent(await serve([Turn(fault="http_500")]), name="b")
    chain = aio.Chain([first, second])
    with pytest.raises(ModelHTTPError):
        await chain.run("go")
    result = chain.last_run
    assert result is not None and result.status == "failed" and result.output is None
    assert result.requests == 2 and result.error is not None
