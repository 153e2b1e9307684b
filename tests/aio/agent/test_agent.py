"""The agent loop: tool rounds, sessions, restore, interrupt, resume, events."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Mapping
from contextlib import aclosing
from typing import Any

import pytest

from aimu import aio
from aimu.aio.agent import FINAL_TURN_PROMPT, INTERRUPTED
from aimu.aio.client import ToolCallDelta, TurnDone
from aimu.aio.events import RunFinished, StepFinished, TextChunk, ToolCallStarted, ToolResult
from aimu.aio.transcript import CANCELLED_RESULT, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


async def lookup(city: str) -> str:
    """Look a city up."""
    await asyncio.sleep(0)
    return f"{city} is sunny"


def call(name: str, **arguments: Any) -> ScriptedCall:
    return ScriptedCall(name, arguments)


def two_round_script() -> list[Turn]:
    return [
        Turn(text="let me add", tool_calls=[call("add", a=1, b=2)]),
        Turn(tool_calls=[call("lookup", city="Paris"), call("add", a=3, b=4)]),
        Turn(text="the answer is 3 and Paris is sunny"),
    ]


def roles(messages: list[Any]) -> list[str]:
    return [m["role"] for m in messages]


async def test_run_records_every_step() -> None:
    model = ScriptedModel(two_round_script())
    agent = aio.Agent(model, tools=[add, lookup], system="be brief")
    reply = await agent.run("what is 1+2?")
    assert reply == "the answer is 3 and Paris is sunny"
    messages = agent.model_client.messages
    assert roles(messages) == [
        "system", "user", "assistant", "tool", "assistant", "tool", "tool", "assistant",
    ]
    assert messages[3]["content"] == "3"
    assert {m["content"] for m in messages[5:7]} == {"Paris is sunny", "7"}
    validate(messages)
    # Every request carried the system prompt once, first, and the tools.
    for request in model.requests:
        assert request["messages"][0] == {"role": "system", "content": "be brief"}
        assert [m["role"] for m in request["messages"]].count("system") == 1
        assert request["tools"] == ["add", "lookup"]
    assert agent.last_status == "completed"
    assert model.open_streams == 0


async def test_stream_events_end_with_exactly_one_terminal_event() -> None:
    agent = aio.Agent(ScriptedModel(two_round_script()), tools=[add, lookup])
    events = [event async for event in agent.run("go", stream=True)]
    kinds = [e.type for e in events]
    assert kinds[0] == "run_started"
    assert kinds[-1] == "run_finished"
    assert kinds.count("run_finished") == 1
    assert kinds.count("tool_call") == 3 and kinds.count("tool_result") == 3
    assert kinds.count("step_finished") == 2
    final = events[-1]
    assert isinstance(final, RunFinished)
    assert final.status == "completed" and final.reply.startswith("the answer")
    text = "".join(e.text for e in events if isinstance(e, TextChunk))
    assert text == "let me add" + "the answer is 3 and Paris is sunny"
    assert all(e.source == "agent" for e in events if hasattr(e, "source"))


async def test_max_rounds_withholds_tools_on_the_final_turn() -> None:
    looping = Turn(tool_calls=[call("add", a=1, b=1)])
    model = ScriptedModel([looping, looping, Turn(text="best I can do")])
    agent = aio.Agent(model, tools=[add], max_rounds=2)
    events = [e async for e in agent.run("loop forever", stream=True)]
    final = events[-1]
    assert isinstance(final, RunFinished) and final.status == "max_rounds"
    assert final.reply == "best I can do"
    assert model.requests[-1]["tools"] == []
    assert model.requests[-1]["messages"][-1] == {"role": "user", "content": FINAL_TURN_PROMPT}
    validate(agent.model_client.messages)


async def test_tool_calls_on_the_final_turn_are_answered_not_run() -> None:
    looping = Turn(tool_calls=[call("add", a=1, b=1)])
    model = ScriptedModel([looping, looping])
    agent = aio.Agent(model, tools=[add], max_rounds=1)
    assert await agent.run("go") == ""
    messages = agent.model_client.messages
    validate(messages)
    assert messages[-1]["role"] == "tool" and "no tool rounds" in messages[-1]["content"]
    assert agent.last_status == "max_rounds"


async def test_sessions_never_mix_under_concurrency() -> None:
    def script(request: Mapping[str, Any]) -> Turn:
        messages = request["messages"]
        task = next(m["content"] for m in messages if m["role"] == "user")
        if messages[-1]["role"] == "user":
            return Turn(tool_calls=[call("lookup", city=task)], delay=0.001)
        return Turn(text=f"answer for {task}: {messages[-1]['content']}", delay=0.001)

    agent = aio.Agent(ScriptedModel(script), tools=[lookup])
    sessions = [agent.start() for _ in range(20)]
    replies = await asyncio.gather(*(s.run(f"city{i}") for i, s in enumerate(sessions)))
    for i, (session, reply) in enumerate(zip(sessions, replies, strict=True)):
        assert reply == f"answer for city{i}: city{i} is sunny"
        contents = " ".join(m["content"] for m in session.model_client.messages)
        assert f"city{i}" in contents
        assert all(f"city{j} " not in contents for j in range(20) if j != i)
    assert agent.model_client.messages == []


async def test_two_overlapping_runs_on_one_session_are_refused() -> None:
    agent = aio.Agent(ScriptedModel([Turn(text="slow", delay=0.01, chunks=3)]))
    first = asyncio.ensure_future(agent.run("one"))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="already in progress"):
        agent.run("two")
    assert await first == "slow"
    assert roles(agent.model_client.messages) == ["user", "assistant"]


async def test_two_run_coroutines_made_before_either_starts() -> None:
    agent = aio.Agent(ScriptedModel([Turn(text="a", delay=0.01), Turn(text="b")]))
    one, two = agent.run("one"), agent.run("two")
    results = await asyncio.gather(one, two, return_exceptions=True)
    assert results[0] == "a"
    assert isinstance(results[1], RuntimeError)


# -- restore -------------------------------------------------------------------------

BAD_TRANSCRIPTS: list[tuple[object, str]] = [
    ("not a list", "list of messages"),
    ([{"role": "banana", "content": "x"}], "unknown role"),
    (["hello"], "must be a dict"),
    ([{"role": "user"}], "content"),
    ([{"role": "user", "content": 3}], "content"),
    ([{"role": "user", "content": "x", "extra": 1}], "unexpected keys"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "s"}], "first message"),
    ([{"role": "tool", "content": "r", "tool_call_id": "c1", "name": "add"}], "answers no"),
    (
        [
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {}}},
            ]},
            {"role": "tool", "content": "r", "tool_call_id": "c1", "name": "add"},
            {"role": "tool", "content": "r", "tool_call_id": "c1", "name": "add"},
        ],
        "already has a result",
    ),
    (
        [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}},
        ]}],
        "arguments must be a dict",
    ),
    (
        [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "", "type": "function", "function": {"name": "add", "arguments": {}}},
        ]}],
        "non-empty string 'id'",
    ),
    (
        [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": {}}},
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": {}}},
        ]}],
        "used twice",
    ),
    (
        [
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {}}},
            ]},
            {"role": "tool", "content": "r", "tool_call_id": "c1", "name": "lookup"},
        ],
        "was to 'add'",
    ),
    (
        [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"x": {1}}}},
        ]}],
        "not JSON data",
    ),
]


@pytest.mark.parametrize(("bad", "expected"), BAD_TRANSCRIPTS)
async def test_restore_rejects_invalid_transcripts_and_changes_nothing(
    bad: object, expected: str
) -> None:
    agent = aio.Agent(ScriptedModel([Turn(text="hi")]), system="sys")
    await agent.run("hello")
    before = copy.deepcopy(agent.model_client.messages)
    with pytest.raises(ValueError, match=expected) as caught:
        agent.restore(bad)  # type: ignore[arg-type]
    assert "message" in str(caught.value) or "list" in str(caught.value)
    assert agent.model_client.messages == before


async def test_restore_copies_settles_and_keeps_the_system_prompt() -> None:
    source: list[Any] = [
        {"role": "user", "content": "add please"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}},
        ]},
    ]
    model = ScriptedModel([Turn(text="done")])
    agent = aio.Agent(model, tools=[add], system="you are careful")
    agent.restore(source)
    messages = agent.model_client.messages
    assert messages[0] == {"role": "system", "content": "you are careful"}
    assert messages[-1] == {
        "role": "tool", "content": CANCELLED_RESULT, "tool_call_id": "c1", "name": "add",
    }
    assert len(source) == 2  # the caller's list is untouched
    source[1]["tool_calls"][0]["function"]["arguments"]["a"] = 99
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert await agent.run("continue") == "done"
    assert model.requests[0]["messages"][0] == {"role": "system", "content": "you are careful"}
    agent.restore(agent.model_client.messages)  # settling is idempotent
    assert [m["role"] for m in agent.model_client.messages].count("system") == 1


# -- graceful interrupt and resume ------------------------------------------------------

async def test_interrupt_finishes_the_step_then_stops() -> None:
    model = ScriptedModel(two_round_script())
    agent = aio.Agent(model, tools=[add, lookup])
    results: list[Any] = []
    async with aclosing(agent.run("go", stream=True)) as events:
        async for event in events:
            results.append(event)
            if isinstance(event, TextChunk):
                assert agent.interrupt() is True
    final = results[-1]
    assert isinstance(final, RunFinished)
    assert final.status == "interrupted" and final.reply == INTERRUPTED
    assert model.turns_served == 1  # no further model call after the boundary
    # The step in flight finished: its tool round is recorded.
    assert roles(agent.model_client.messages) == ["user", "assistant", "tool"]
    assert any(isinstance(e, ToolResult) for e in results)
    assert agent.interrupt_requested is False
    # Resume: no new user message, the round budget goes on.
    assert await agent.resume() == "the answer is 3 and Paris is sunny"
    messages = agent.model_client.messages
    assert roles(messages).count("user") == 1
    assert model.requests[1]["messages"][-1]["role"] == "tool"
    validate(messages)


async def test_resume_continues_the_round_budget() -> None:
    looping = Turn(tool_calls=[call("add", a=1, b=1)])
    model = ScriptedModel([looping, looping, Turn(text="final")])
    agent = aio.Agent(model, tools=[add], max_rounds=2)
    stream = agent.run("go", stream=True)
    async for event in stream:
        if isinstance(event, StepFinished):
            agent.interrupt()
    assert agent.last_status == "interrupted"
    assert await agent.resume() == "final"
    assert agent.last_status == "max_rounds"  # 1 + 1 rounds, not 1 + 2
    assert model.turns_served == 3


async def test_interrupt_without_a_run_does_not_leak() -> None:
    agent = aio.Agent(ScriptedModel([Turn(text="fresh answer")]))
    assert agent.interrupt() is False
    assert await agent.run("hi") == "fresh answer"


async def test_interrupt_on_the_last_step_is_honoured_and_cleared() -> None:
    model = ScriptedModel(
        [Turn(tool_calls=[call("add", a=1, b=1)]), Turn(text="x"), Turn(text="y")]
    )
    agent = aio.Agent(model, tools=[add], max_rounds=1)
    async for event in agent.run("go", stream=True):
        if isinstance(event, ToolCallStarted):
            agent.interrupt()
    assert agent.last_status == "interrupted"
    assert await agent.run("again") == "x"
    assert agent.last_status == "completed"


async def test_interrupt_during_a_final_answer_completes() -> None:
    agent = aio.Agent(ScriptedModel([Turn(text="one two three", delay=0.001)]))
    async for event in agent.run("go", stream=True):
        if isinstance(event, TextChunk):
            agent.interrupt()
        last = event
    assert isinstance(last, RunFinished) and last.status == "completed"
    assert last.reply == "one two three"


async def test_resume_after_a_finished_answer_makes_no_model_call() -> None:
    model = ScriptedModel([Turn(text="done")])
    agent = aio.Agent(model)
    await agent.run("go")
    assert await agent.resume() == "done"
    assert model.turns_served == 1
    with pytest.raises(ValueError, match="nothing to resume"):
        await aio.Agent(ScriptedModel([])).resume()


async def test_reset_starts_clean_and_keeps_the_system_prompt() -> None:
    agent = aio.Agent(ScriptedModel([Turn(text="a"), Turn(text="b")]), system="s")
    await agent.run("one")
    await agent.run("two", reset=True)
    assert roles(agent.model_client.messages) == ["system", "user", "assistant"]


# -- bad input from the model ---------------------------------------------------------

async def test_tool_problems_become_results_the_model_can_read() -> None:
    def boom() -> str:
        """Fail."""
        raise ValueError("kaput")

    model = ScriptedModel([
        Turn(tool_calls=[
            call("nope"), call("add", a="one", b=2), call("boom"),
        ]),
        Turn(text="recovered"),
    ])
    agent = aio.Agent(model, tools=[add, boom])
    assert await agent.run("go") == "recovered"
    results = [m["content"] for m in agent.model_client.messages if m["role"] == "tool"]
    assert "nope" in results[0] and "add" in results[0]
    assert "a" in results[1]
    assert "kaput" in results[2]
    sent = model.requests[1]["messages"]
    assert [m["role"] for m in sent[-3:]] == ["tool", "tool", "tool"]


async def test_unparsable_arguments_become_a_tool_error() -> None:
    class Garbled(ScriptedModel):
        async def stream_turn(
            self, messages: Any, tools: Any = None, *, stream: bool = True
        ) -> Any:
            if self.turns_served == 0:
                self._shared.turns_served += 1
                yield ToolCallDelta(
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {}}},
                    error="the arguments for tool add were not valid JSON: Expecting value",
                )
                yield TurnDone({"input_tokens": 0, "output_tokens": 0})
                return
            async for chunk in super().stream_turn(messages, tools, stream=stream):
                yield chunk

    agent = aio.Agent(Garbled([Turn(text="fixed")]), tools=[add])
    assert await agent.run("go") == "fixed"
    tool_message = agent.model_client.messages[2]
    assert tool_message["role"] == "tool" and "not valid JSON" in tool_message["content"]


async def test_model_failure_mid_stream_keeps_the_partial_turn() -> None:
    model = ScriptedModel([Turn(text="one two three four", fault="drop", fault_after=2)])
    agent = aio.Agent(model)
    events: list[Any] = []
    with pytest.raises(aio.ModelConnectionError):
        async for event in agent.run("go", stream=True):
            events.append(event)
    final = events[-1]
    assert isinstance(final, RunFinished) and final.status == "failed"
    assert final.error is not None and "dropped" in final.error
    assert final.reply == "one two "
    last = agent.model_client.messages[-1]
    assert last == {"role": "assistant", "content": "one two ", "aimu_partial": True,
                    "aimu_model": "scripted:scripted"}
    validate(agent.model_client.messages)
    assert not agent.running


# -- hard cancel ------------------------------------------------------------------------

async def test_seed_cancel_then_restore_and_continue() -> None:
    slow_model = ScriptedModel([Turn(text="a long streamed answer", delay=0.05)])
    agent = aio.Agent(slow_model, tools=[add])
    handle = aio.RunHandle.start(agent.run("a big task"))
    async for event in handle.events():
        if isinstance(event, TextChunk) and event.text.startswith("long"):
            handle.cancel()  # provably mid-answer: two words streamed
    with pytest.raises(asyncio.CancelledError):
        await handle
    partial = list(agent.model_client.messages)
    assert partial[-1]["aimu_partial"] is True and partial[-1]["content"].startswith("a ")

    fresh = aio.Agent(ScriptedModel([Turn(text="picked up")]), tools=[add])
    fresh.restore(partial)
    assert await fresh.run("continue where we left off") == "picked up"
    request = fresh.model_client.requests[0]["messages"]  # type: ignore[attr-defined]
    assert all("aimu_partial" not in m for m in request)
    assert request[1]["content"].startswith("a ")


async def test_consumer_that_breaks_closes_the_run_cleanly() -> None:
    model = ScriptedModel(
        [Turn(text="many words to stream here", tool_calls=[call("add", a=1, b=2)])]
    )
    agent = aio.Agent(model, tools=[add])
    stream = agent.run("go", stream=True)
    async for event in stream:
        if isinstance(event, TextChunk):
            break
    await stream.aclose()
    assert not agent.running and agent.last_status == "cancelled"
    assert model.open_streams == 0
    validate(agent.model_client.messages)
    assert agent.model_client.messages[-1]["aimu_partial"] is True


def slow_sync(ctx: aio.ToolContext, seconds: float = 0) -> str:
    """Block a worker thread, noticing a cancel."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ctx.cancelled:
            return "noticed cancel"
        time.sleep(0.001)
    return "slow done"


async def slow_async(seconds: float = 0.01) -> str:
    """Sleep."""
    await asyncio.sleep(seconds)
    return "async done"


def sweep_script(streamed_text: str) -> list[Turn]:
    # Tools that finish in a few loop iterations, so the sweep reaches every yield point.
    return [
        Turn(text=streamed_text, tool_calls=[call("add", a=1, b=2), call("slow_sync", seconds=0)]),
        Turn(text="again", tool_calls=[call("slow_async", seconds=0), call("slow_sync")]),
        Turn(text="all finished now"),
    ]


async def _sweep(mode: str, concurrent: bool, streamed: bool) -> int:
    """Stop the run after 1, 2, ... loop yields until it completes on its own.

    After each stop the transcript goes, restored into a fresh agent, to the loopback
    server's OpenAI chat, Responses, Gemini or Anthropic endpoint in turn, which reject
    dangling tool calls (and Gemini unsigned ones) as the real servers do.
    """
    async with LoopbackServer(lambda request: Turn(text="ok")) as server:
        follow_models = [
            aio.client("openai:m", base_url=server.openai_base_url, api_key="x"),
            aio.client("openai-responses:m", base_url=server.openai_base_url, api_key="x"),
            aio.client("gemini:m", base_url=server.gemini_base_url, api_key="x"),
            aio.client("anthropic:m", base_url=server.url, api_key="x"),
        ]
        try:
            return await _sweep_against(mode, concurrent, streamed, follow_models)
        finally:
            for follow_model in follow_models:
                await follow_model.aclose()


async def _sweep_against(
    mode: str, concurrent: bool, streamed: bool, follow_models: list[aio.ModelClient]
) -> int:
    for n in range(1, 2000):
        model = ScriptedModel(sweep_script("thinking about it"))
        agent = aio.Agent(model, tools=[add, slow_sync, slow_async], concurrent_tools=concurrent)
        seen: list[Any] = []

        async def consume(agent: aio.Agent = agent, seen: list[Any] = seen) -> str:
            async for event in agent.run("go", stream=True):
                seen.append(event)
            return str(seen[-1].reply)

        task = asyncio.ensure_future(consume() if streamed else agent.run("go"))
        for _ in range(n):
            await asyncio.sleep(0)
            if task.done():
                break
        if task.done():
            assert task.result() == "all finished now"
            return n - 1  # the stops made before this run completed on its own
        if mode == "cancel":
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert agent.last_status == "cancelled"
        else:
            agent.interrupt()
            assert await task in (INTERRUPTED, "all finished now")
        if streamed:
            finals = [e for e in seen if isinstance(e, RunFinished)]
            assert len(finals) == 1 and seen[-1] is finals[0]
            assert finals[0].status == agent.last_status
        messages = agent.model_client.messages
        validate(messages)
        assert model.open_streams == 0
        snapshot = copy.deepcopy(messages)
        await asyncio.sleep(0.005)  # any worker thread still running finishes now
        assert messages == snapshot, "a late tool result leaked into the transcript"
        follow_model = follow_models[n % len(follow_models)]
        follow = aio.Agent(follow_model.fork(), tools=[add, slow_sync, slow_async])
        follow.restore(messages)
        assert await follow.run("continue") == "ok"
    raise AssertionError("the run never completed")


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("concurrent", [False, True])
@pytest.mark.parametrize("mode", ["cancel", "interrupt"])
async def test_stop_sweep_at_every_yield(mode: str, concurrent: bool, streamed: bool) -> None:
    stops = await _sweep(mode, concurrent, streamed)
    # Two tool rounds with streamed text, threads and async tools: many distinct points.
    assert stops >= 15


async def test_cancel_during_concurrent_tools_keeps_finished_results() -> None:
    async def fast() -> str:
        """Fast."""
        return "charged the card"

    slow_started = asyncio.Event()

    async def slow() -> str:
        """Slow."""
        slow_started.set()
        await asyncio.sleep(10)
        return "never"

    model = ScriptedModel([Turn(tool_calls=[call("fast"), call("slow")])])
    for concurrent in (False, True):
        agent = aio.Agent(model.fork(), tools=[fast, slow], concurrent_tools=concurrent)
        model._shared.position = 0
        slow_started.clear()
        task = aio.RunHandle.start(agent.run("pay"))
        async for event in task.events():
            if isinstance(event, ToolResult) and event.name == "fast":
                break  # the fast call's result is recorded
        await slow_started.wait()  # and the slow one is running
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        messages = agent.model_client.messages
        results = {m["name"]: m["content"] for m in messages if m["role"] == "tool"}
        assert results == {"fast": "charged the card", "slow": CANCELLED_RESULT}


async def test_thread_sees_the_cancel_and_its_result_is_dropped() -> None:
    noticed = threading.Event()
    started = threading.Event()

    def blocking(ctx: aio.ToolContext) -> str:
        """Wait for a cancel."""
        started.set()
        if ctx.wait_cancelled(5):
            noticed.set()
        return "late result"

    agent = aio.Agent(ScriptedModel([Turn(tool_calls=[call("blocking")])]), tools=[blocking])
    task = asyncio.ensure_future(agent.run("go"))
    assert await asyncio.to_thread(started.wait, 5)  # the tool's thread is running
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(noticed.wait, 2)
    await asyncio.sleep(0.01)
    assert agent.model_client.messages[-1]["content"] == CANCELLED_RESULT


async def test_cancelled_error_is_never_swallowed_by_a_stream_consumer() -> None:
    agent = aio.Agent(ScriptedModel([Turn(text="a b c d e f", delay=0.01)]))
    seen: list[Any] = []
    two_chunks = asyncio.Event()

    async def consume() -> None:
        async for event in agent.run("go", stream=True):
            seen.append(event)
            if sum(isinstance(e, TextChunk) for e in seen) == 2:
                two_chunks.set()

    task = asyncio.ensure_future(consume())
    await two_chunks.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert isinstance(seen[-1], RunFinished) and seen[-1].status == "cancelled"
    assert seen[-1].reply.startswith("a b")


SIGINT_SCRIPT = textwrap.dedent(
    """
    import asyncio, signal
    from aimu import aio
    from aimu.testing.script import Turn, ScriptedCall
    from aimu.testing.scripted import ScriptedModel

    calls = []

    async def wait(seconds: float = 0.2) -> str:
        '''Wait a while.'''
        calls.append(seconds)
        if len(calls) == 1:
            print("ready", flush=True)  # the run is provably in progress: interrupt it now
        await asyncio.sleep(seconds)
        return "waited"

    turns = [Turn(tool_calls=[ScriptedCall("wait")])] * 50 + [Turn(text="finished")]
    agent = aio.Agent(ScriptedModel(turns), tools=[wait], max_rounds=60)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, agent.interrupt)
        answer = await agent.run("Research this topic thoroughly.")
        print(answer, flush=True)

    asyncio.run(main())
    """
)


def test_sigint_handler_interrupts_gracefully() -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", SIGINT_SCRIPT],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=20)
    assert process.returncode == 0, err
    assert out.strip() == INTERRUPTED


async def test_break_without_aclose_and_with_aclosing_both_close_the_run() -> None:
    def make() -> tuple[ScriptedModel, aio.Agent]:
        model = ScriptedModel([Turn(text="one two three four", delay=0.001)])
        return model, aio.Agent(model)

    model, agent = make()
    async with aclosing(agent.run("go", stream=True)) as events:
        async for event in events:
            if isinstance(event, TextChunk):
                break
    assert not agent.running and model.open_streams == 0
    validate(agent.model_client.messages)

    model, agent = make()
    async for event in agent.run("go", stream=True):
        if isinstance(event, TextChunk):
            break
    # The abandoned generator is finalised by the event loop's async-generator hook.
    for _ in range(20):
        if not agent.running:
            break
        await asyncio.sleep(0)
    assert not agent.running and model.open_streams == 0
    assert agent.last_status == "cancelled"
    validate(agent.model_client.messages)


async def test_resume_after_a_cancel_in_the_final_turn_adds_no_user_message() -> None:
    # Regression (hardening issue, defect 5): the final-turn prompt was added again.
    looping = Turn(tool_calls=[call("add", a=1, b=1)])
    final_turn = Turn(text="one two three four five", delay=30)  # first word, then a wait
    model = ScriptedModel([looping, final_turn, Turn(text="done at last")])
    agent = aio.Agent(model, tools=[add], max_rounds=1)
    handle = aio.RunHandle.start(agent.run("loop"))
    events = handle.events()
    async for event in events:
        if isinstance(event, TextChunk):  # the final turn is streaming: provably in flight
            handle.cancel("stop in the final turn")
            break
    await events.aclose()
    with pytest.raises(asyncio.CancelledError):
        await handle
    before = [m for m in agent.model_client.messages if m["role"] == "user"]
    assert [m["content"] for m in before] == ["loop", FINAL_TURN_PROMPT]
    assert await agent.resume() == "done at last"
    after = [m for m in agent.model_client.messages if m["role"] == "user"]
    assert after == before
    assert model.requests[-1]["tools"] == []  # still the final, tool-less turn
    assert agent.last_status == "max_rounds"
    validate(agent.model_client.messages)


async def test_the_stop_reason_of_the_last_turn_is_on_run_finished() -> None:
    agent = aio.Agent(ScriptedModel(two_round_script()), tools=[add, lookup])
    events = [event async for event in agent.run("go", stream=True)]
    final = events[-1]
    assert isinstance(final, RunFinished) and final.stop_reason == "stop"


async def test_interrupt_requested_tells_the_truth_whoever_asked() -> None:
    agent = aio.Agent(ScriptedModel([Turn(text="slow reply here", delay=30)]))
    assert not agent.interrupt_requested and agent.status == "idle"
    handle = aio.RunHandle.start(agent.run("go"))
    events = handle.events()
    async for event in events:
        if isinstance(event, TextChunk):
            break
    await events.aclose()
    assert agent.status == "running" and not agent.interrupt_requested
    assert handle.interrupt()
    assert agent.interrupt_requested  # the handle's interrupt reaches the agent's run scope
    handle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert not agent.interrupt_requested and agent.status == "cancelled"


# -- a lone surrogate at every entrance (issue 21 item 23) ------------------------------------


LONE = "caf\ud800e"


async def test_a_lone_surrogate_in_a_task_or_a_send_is_refused_and_changes_nothing(
    tmp_path: Any,
) -> None:
    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        model = ScriptedModel(
            lambda request: Turn(text=f"saw {request['messages'][-1]['content']}")
        )
        agent = aio.Agent(model, store=store, session="s")
        assert await agent.run("first") == "saw first"
        before = copy.deepcopy(agent.model_client.messages)
        with pytest.raises(ValueError, match=r"the task given to agent 'agent' holds a lone "
                                             r"surrogate code point at character 3"):
            await agent.run(LONE)
        with pytest.raises(ValueError, match="the text sent holds a lone surrogate"):
            agent.send(LONE)  # refused whether or not a run is in progress
        assert agent.model_client.messages == before == await store.load("s")
        handle = aio.RunHandle.start(agent.run("second"))
        with pytest.raises(ValueError, match="the text sent holds a lone surrogate"):
            handle.send(LONE)
        with pytest.raises(ValueError, match="the text sent holds a lone surrogate"):
            agent.send(LONE)
        assert await handle == "saw second"
        assert agent.model_client.messages == await store.load("s")  # memory = store
        validate(agent.model_client.messages)
        await agent.aclose()


async def test_a_tool_result_with_a_lone_surrogate_is_stored_as_u_fffd(tmp_path: Any) -> None:
    def broken(city: str) -> str:
        """A tool whose text came from a bad decoder."""
        return f"{city}: {LONE}"

    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        model = ScriptedModel([Turn(tool_calls=[ScriptedCall("broken", {"city": "Oslo"})]),
                               Turn(text="done")])
        agent = aio.Agent(model, [broken], store=store, session="s")
        results = [e.content async for e in agent.run("go", stream=True)
                   if isinstance(e, ToolResult)]
        assert results == ["Oslo: caf\ufffde"] and agent.last_status == "completed"
        assert agent.model_client.messages == await store.load("s")
        await agent.aclose()
        fresh = aio.Agent(ScriptedModel([Turn(text="again")]))
        fresh.restore(agent.model_client.messages)  # its own transcript is restorable


async def test_workflow_restore_refuses_a_lone_surrogate_and_changes_nothing() -> None:
    def chain() -> aio.Chain:
        return aio.Chain([aio.Agent(ScriptedModel([Turn(text="one")]), name="a"),
                          aio.Agent(ScriptedModel([Turn(text="two")]), name="b")])

    done = chain()
    assert await done.run("go") == "two"
    for path in (("task",), ("steps", 0, "answer")):
        state = copy.deepcopy(done.state)
        target: Any = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = LONE
        fresh = chain()
        with pytest.raises(ValueError, match="lone surrogate"):
            fresh.restore(state)
        assert fresh.task is None and fresh.state == chain().state
