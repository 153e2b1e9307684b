"""SummarizeOlderTurns: the model summarises the turns older than the last ``keep``; what
is sent is the system prompt with that summary and the recent turns whole, while the
transcript stays whole. The summary is asked once per new old turn, kept in the
session's state (no other process asks again), counted in the run's usage, and a stop
during it leaves everything as it was."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.client import ModelClient
from aimu.aio.context import SUMMARY_INSTRUCTIONS, render
from aimu.aio.ends import LIMITED
from aimu.aio.transcript import validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer

FOREVER = 3600.0


def is_summary(request: dict[str, Any]) -> bool:
    messages = request["messages"]
    return bool(messages) and messages[0]["content"] == SUMMARY_INSTRUCTIONS


class Script:
    """Answers each task, summarises when asked (SUMMARY 1, SUMMARY 2...), and calls
    ``lookup`` once for a task that starts with "tool"."""

    def __init__(self, *, hold_summary: bool = False) -> None:
        self.summaries = 0
        self.hold_summary = hold_summary
        self.summary_asked = asyncio.Event()

    def __call__(self, request: dict[str, Any]) -> Turn:
        messages = request["messages"]
        if is_summary(request):
            self.summaries += 1
            self.summary_asked.set()
            held = self.hold_summary
            return Turn(text=f"SUMMARY {self.summaries}", delay=FOREVER if held else 0.0,
                        input_tokens=50, output_tokens=5)
        last = messages[-1]
        if last["role"] == "user" and last["content"].startswith("tool"):
            return Turn(tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})])
        task = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        return Turn(text=f"answer to {task}", input_tokens=10, output_tokens=3)


def lookup(city: str) -> str:
    """Look a city up."""
    return f"{city} is sunny"


def chat_requests(model: ScriptedModel) -> list[dict[str, Any]]:
    return [r for r in model.requests if not is_summary(r)]


async def test_older_turns_are_sent_as_a_summary_and_the_transcript_stays_whole() -> None:
    script = Script()
    model = ScriptedModel(script)
    agent = aio.Agent(model, system="Be brief.", tools=[lookup],
                      context=aio.SummarizeOlderTurns(keep=2))
    assert await agent.run("t1") == "answer to t1"
    assert await agent.run("tool t2") == "answer to tool t2"
    assert script.summaries == 0  # two turns: nothing is old yet
    assert await agent.run("t3") == "answer to t3"
    assert script.summaries == 1
    summary_request = next(r for r in model.requests if is_summary(r))
    assert summary_request["messages"][1]["content"] == "user: t1\nassistant: answer to t1"
    sent = chat_requests(model)[-1]["messages"]
    assert sent[0] == {"role": "system",
                       "content": "Be brief.\n\nSummary of the earlier conversation:\nSUMMARY 1"}
    # The kept turns whole: the tool call with its result, then the new task.
    assert [m["role"] for m in sent[1:]] == ["user", "assistant", "tool", "assistant", "user"]
    assert sent[1]["content"] == "tool t2" and sent[-1]["content"] == "t3"
    # The transcript is whole: every turn, no summary in it.
    messages = agent.model_client.messages
    validate(messages)
    assert [m["content"] for m in messages if m["role"] == "user"] == ["t1", "tool t2", "t3"]
    assert not any("SUMMARY" in str(m["content"]) for m in messages)
    # The summary request is one of the run's, in its usage.
    result = agent.last_run
    assert result is not None and result.requests == 2
    assert result.usage["input_tokens"] == 60 and result.usage["output_tokens"] == 8
    # The next run rolls the summary on: the old one and the turn that became old.
    await agent.run("t4")
    assert script.summaries == 2
    second = [r for r in model.requests if is_summary(r)][1]["messages"][1]["content"]
    assert second.startswith("The summary so far:\nSUMMARY 1\n\nWhat came after it:\n")
    assert second.endswith(render(messages[3:7]))  # tool t2's turn, its call and result


async def test_the_summary_is_kept_in_the_session_and_not_asked_again(tmp_path: Path) -> None:
    script = Script()
    model = ScriptedModel(script)
    store = aio.SQLiteStore(tmp_path / "s.db")
    policy = aio.SummarizeOlderTurns(keep=1)
    async with aio.Agent(model, store=store, session="s", context=policy) as agent:
        await agent.run("t1")
        handle = aio.RunHandle.start(agent.run("t2"))
        async for event in handle.events():
            if isinstance(event, aio.TextChunk):
                handle.cancel()  # the answer streams: the summary was made before it
        assert handle.status == "cancelled"
    assert script.summaries == 1
    state = await store.load_state("s")
    assert state["summary"] == {"upto": 2, "text": "SUMMARY 1"}
    # Another agent object (another process, say) resumes: it sends the stored summary.
    async with aio.Agent(model.fork(), store=store, session="s", context=policy) as again:
        assert await again.resume() == "answer to t2"
        assert script.summaries == 1
        sent = chat_requests(model)[-1]["messages"]
        assert sent[0]["content"] == "Summary of the earlier conversation:\nSUMMARY 1"
        assert [m["content"] for m in sent[1:]] == ["t2"]
    await store.aclose()


async def test_a_stop_during_the_summary_request_keeps_nothing_of_it_and_resume_asks_again(
) -> None:
    script = Script(hold_summary=True)
    model = ScriptedModel(script)
    agent = aio.Agent(model, context=aio.SummarizeOlderTurns(keep=1))
    await agent.run("t1")
    handle = aio.RunHandle.start(agent.run("t2"))
    await script.summary_asked.wait()  # the summarising request is in flight
    handle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert handle.status == "cancelled"
    assert agent._session.durable.summary is None and model.open_streams == 0
    validate(agent.model_client.messages)
    script.hold_summary = False
    assert await agent.resume() == "answer to t2"
    assert script.summaries == 2  # asked again, and answered this time
    assert chat_requests(model)[-1]["messages"][0]["content"].endswith("SUMMARY 2")


async def test_an_interrupt_during_the_summary_request_stops_at_the_next_boundary() -> None:
    script = Script()
    model = ScriptedModel(script)
    agent = aio.Agent(model, context=aio.SummarizeOlderTurns(keep=1))
    await agent.run("t1")
    handle = aio.RunHandle.start(agent.run("t2"))
    await script.summary_asked.wait()
    handle.interrupt()  # the summary is part of the model turn: the turn ends first
    assert await handle == "answer to t2"
    assert handle.status == "completed" and agent._session.durable.summary is not None
    validate(agent.model_client.messages)


async def test_a_wall_limit_cuts_the_summary_request() -> None:
    script = Script(hold_summary=True)
    model = ScriptedModel(script)
    agent = aio.Agent(model, context=aio.SummarizeOlderTurns(keep=1))
    await agent.run("t1")
    # Only the limit can end the held summary request.
    assert await agent.run("t2", limits=aio.UsageLimits(wall=0.2)) == LIMITED
    result = agent.last_run
    assert result is not None and (result.status, result.stop_reason) == ("limited", "limit:wall")
    assert result.requests == 1  # the summary's only: the turn's own request was never made
    assert agent._session.durable.summary is None and model.open_streams == 0
    validate(agent.model_client.messages)


@pytest.mark.parametrize(
    "options",
    [{"keep": 0}, {"keep": True}, {"keep": "2"}, {"instructions": " "}, {"instructions": 3}],
)
def test_bad_settings_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="SummarizeOlderTurns"):
        aio.SummarizeOlderTurns(**options)


async def test_the_summary_goes_over_the_wire(
    make_client: Callable[..., ModelClient], server: LoopbackServer
) -> None:
    script = Script()
    server.script = script  # type: ignore[assignment]
    agent = aio.Agent(make_client(), context=aio.SummarizeOlderTurns(keep=1))
    await agent.run("t1")
    assert await agent.run("t2") == "answer to t2"
    bodies = [{"messages": r.messages} for r in server.requests]
    assert [is_summary(b) for b in bodies] == [False, True, False]
    assert bodies[2]["messages"][0]["content"] == (
        "Summary of the earlier conversation:\nSUMMARY 1"
    )


@pytest.mark.parametrize(
    ("unusable", "said"),
    [(Turn(text=""), "nothing"), (Turn(text="  \n "), "only whitespace"),
     (Turn(tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})]), "only a tool call")],
    ids=["empty", "whitespace", "tool call"],
)
async def test_an_unusable_summary_fails_the_run_and_keeps_the_older_turns(
    unusable: Turn, said: str, tmp_path: Path
) -> None:
    """Issue 29 item 4: a summary of "", whitespace or only a tool call was kept, and the
    older turns vanished from every later request. Now the run ends failed naming the
    policy, nothing is summarised (stored or not), and a resume asks again."""
    script = Script()
    answers: list[Turn] = [unusable]

    def model_turn(request: dict[str, Any]) -> Turn:
        if is_summary(request) and answers:
            return answers.pop()
        return script(request)

    model = ScriptedModel(model_turn)
    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        agent = aio.Agent(model, tools=[lookup], store=store, session="s",
                          context=aio.SummarizeOlderTurns(keep=1))
        assert await agent.run("t1") == "answer to t1"
        with pytest.raises(aio.ModelError, match=rf"SummarizeOlderTurns\(keep=1\).*{said}"):
            await agent.run("t2")
        assert agent.last_status == "failed" and agent.last_run is not None
        assert agent.last_run.error is not None and "older turns stay" in agent.last_run.error
        assert len(chat_requests(model)) == 1  # the turn was not asked without its past
        assert "summary" not in await store.load_state("s")
        validate(agent.messages)
        assert await agent.resume() == "answer to t2"  # asked again, and this one is good
        assert script.summaries == 1
        sent = chat_requests(model)[-1]["messages"]
        assert "SUMMARY 1" in sent[0]["content"] and sent[-1]["content"] == "t2"
        await agent.aclose()


async def test_a_workflow_snapshot_carries_the_summary_so_a_restored_one_does_not_ask() -> None:
    """Issue 29 item 4: a step's summary is in the workflow's state; a workflow restored
    from it resumes without asking for that summary again."""
    script = Script()
    model = ScriptedModel(script)

    def chain() -> aio.Chain:
        return aio.Chain([aio.Agent(model, tools=[lookup],
                                    context=aio.SummarizeOlderTurns(keep=1))])

    first = chain()
    calls = 0
    async for event in first.run("tool t1", stream=True):
        if isinstance(event, aio.ToolCallStarted):
            calls += 1
            if calls == 1:
                first.send("tool t2")  # a second turn: the first becomes old
            else:
                first.interrupt()  # after the summary was made for it
    assert first.last_status == "interrupted" and script.summaries == 1
    state = first.state
    assert state["steps"][0]["summary"]["text"] == "SUMMARY 1"
    again = chain()
    again.restore(state)
    assert await again.resume() == "answer to tool t2"
    assert script.summaries == 1  # not asked again
    sent = chat_requests(model)[-1]["messages"]
    assert "SUMMARY 1" in sent[0]["content"]
