"""Guardrails (issue 33 item 3): input beside the first turn, output before the answer
counts, tool calls before and after; the ``blocked`` status; stops at each await point,
landed at provable points (an event seen, a guardrail entered), never after a sleep."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import BaseModel

from aimu import aio
from aimu.aio.instructions import RunContext
from aimu.aio.providers.base import Chunk
from aimu.aio.transcript import dangling_calls, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel


def _other_tasks() -> set[asyncio.Task[Any]]:
    current = asyncio.current_task()
    return {t for t in asyncio.all_tasks() if t is not current and not t.done()}


def _valid(agent: aio.Agent[Any]) -> None:
    validate(agent.messages)
    assert dangling_calls(agent.messages) == []


class Gate:
    """A guardrail the test drives: it says when it is entered, then waits for the test
    to say how it ends (pass, trip, raise)."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.go = asyncio.Event()
        self.verdict: BaseException | None = None
        self.cancelled = False
        self.seen: list[tuple[RunContext[Any], object]] = []

    async def __call__(self, ctx: RunContext[Any], value: object) -> None:
        self.seen.append((ctx, value))
        self.entered.set()
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if self.verdict is not None:
            raise self.verdict

    def decide(self, verdict: BaseException | None) -> None:
        self.verdict = verdict
        self.go.set()


def _hanging(text: str = "Hello there friend", calls: int = 0) -> ScriptedModel:
    """A first turn that streams ``text`` then hangs (the stream never ends by itself)."""
    return ScriptedModel([
        Turn(text=text, chunks=3, fault="hang", fault_after=3 + calls,
             tool_calls=[ScriptedCall("lookup", {"q": "x"}) for _ in range(calls)]),
        Turn(text="second"),
    ])


class Signalling(ScriptedModel):
    """A scripted model that says when it was asked and when a turn streamed whole."""

    def __init__(self, turns: list[Turn]) -> None:
        super().__init__(turns)
        self.asked = asyncio.Event()
        self.streamed = asyncio.Event()

    async def stream_turn(  # type: ignore[override]
        self, *args: Any, **options: Any
    ) -> AsyncIterator[Chunk]:
        self.asked.set()
        async for chunk in super().stream_turn(*args, **options):
            yield chunk
        self.streamed.set()


def lookup(q: str) -> str:
    """Look something up."""
    return f"found {q}"


async def test_a_tripwire_while_the_model_streams_cuts_the_turn_and_blocks() -> None:
    gate = Gate()
    agent = aio.Agent(_hanging(), input_guardrails=[gate])
    stream = agent.run("hi", stream=True)
    texts = []
    async for event in stream:
        if isinstance(event, aio.TextChunk):
            texts.append(event.text)
            if len(texts) == 3:  # the model streams (and will hang): the tripwire lands
                gate.decide(aio.Tripwire("no greetings"))
        if isinstance(event, aio.RunFinished):
            final = event
    assert final.status == "blocked"
    assert final.stop_reason == "guardrail:Gate"
    assert "no greetings" in final.reply
    last = agent.messages[-1]
    assert last["role"] == "assistant" and last.get("aimu_partial") is True
    assert last["content"] == "".join(texts)
    _valid(agent)
    assert agent.last_run is not None and agent.last_run.status == "blocked"
    assert agent.model_client.open_streams == 0  # type: ignore[attr-defined]
    assert _other_tasks() == set()


async def test_the_guardrail_runs_beside_the_turn_not_before_it() -> None:
    gate = Gate()
    model = Signalling([Turn(text="Hi!", chunks=2)])
    agent = aio.Agent(model, input_guardrails=[gate])
    task = asyncio.create_task(agent.run("hello"))
    await gate.entered.wait()
    # the guardrail is running and the model was already asked
    await model.asked.wait()
    assert [m["content"] for m in model.requests[0]["messages"]] == ["hello"]
    await model.streamed.wait()
    assert not task.done()  # the finished turn waits for the guardrail's decision
    gate.decide(None)
    assert await task == "Hi!"
    ctx, value = gate.seen[0]
    assert value == "hello" and ctx.task == "hello" and ctx.agent == "agent"
    assert agent.last_run is not None and agent.last_run.status == "completed"


async def test_a_turn_that_ends_first_waits_and_its_tool_calls_never_run() -> None:
    gate = Gate()
    ran: list[str] = []

    def tool(q: str) -> str:
        """A tool with a side effect."""
        ran.append(q)
        return "done"

    model = Signalling([Turn(tool_calls=[ScriptedCall("tool", {"q": "x"})])])
    agent = aio.Agent(model, [tool], input_guardrails=[gate])
    task = asyncio.create_task(agent.run("do it"))
    await gate.entered.wait()
    await model.streamed.wait()  # the whole turn (a call) has streamed
    gate.decide(aio.Tripwire("not allowed"))
    reply = await task
    assert reply.startswith("Run blocked by guardrail 'Gate'") and ran == []
    assert agent.messages[-2].get("aimu_partial") is True
    assert agent.messages[-1]["role"] == "tool"  # the call answered as not run
    _valid(agent)


async def test_a_cancel_while_the_input_guardrail_runs() -> None:
    gate = Gate()
    agent = aio.Agent(_hanging(), input_guardrails=[gate])
    handle = aio.RunHandle.start(agent.run("hi"))
    await gate.entered.wait()
    handle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert handle.status == "cancelled" and gate.cancelled
    _valid(agent)
    assert _other_tasks() == set()


async def test_a_tripwire_and_a_cancel_in_the_same_moment_inside_the_run() -> None:
    """The stream hangs inside the run; a cancel and the tripwire land together: the
    cancel wins (reported once, as cancelled), never a blocked run that swallowed it."""
    gate = Gate()
    agent = aio.Agent(_hanging(), input_guardrails=[gate])
    seen = asyncio.Event()
    finished: list[aio.RunFinished] = []

    async def consume() -> None:
        async for event in agent.run("hi", stream=True):
            if isinstance(event, aio.RunFinished):
                finished.append(event)
            if isinstance(event, aio.TextChunk) and event.text.strip() == "friend":
                seen.set()

    runner = asyncio.create_task(consume())
    await seen.wait()
    for _ in range(3):  # the run is back in the hanging stream step
        await asyncio.sleep(0)
    gate.decide(aio.Tripwire("no"))
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert agent.last_run is not None and agent.last_run.status == "cancelled"
    assert len(finished) <= 1
    _valid(agent)
    assert agent.messages[-1].get("aimu_partial") is True
    assert _other_tasks() == set()


async def test_an_interrupt_before_the_first_turn_cancels_the_guardrail() -> None:
    gate = Gate()
    agent = aio.Agent(_hanging(), input_guardrails=[gate])
    handle = aio.RunHandle.start(agent.run("hi"))
    await gate.entered.wait()
    handle.cancel()  # cancelled while the guardrail waits (first turn streaming)
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert gate.cancelled and _other_tasks() == set()


async def test_a_guardrail_that_raises_fails_the_run_naming_it() -> None:
    def strict(ctx: RunContext[Any], text: str) -> None:
        raise KeyError("oops")

    agent = aio.Agent(_hanging(), input_guardrails=[strict])
    with pytest.raises(aio.GuardrailError, match="input guardrail 'strict' raised KeyError"):
        await agent.run("hi")
    assert agent.last_run is not None and agent.last_run.status == "failed"
    assert "strict" in (agent.last_run.error or "")
    _valid(agent)
    assert _other_tasks() == set()


async def test_sync_and_async_guardrails_pass() -> None:
    calls = []

    def sync_ok(ctx: RunContext[Any], text: str) -> None:
        calls.append(("sync", text))

    async def async_ok(ctx: RunContext[Any], text: str) -> bool:
        calls.append(("async", text))
        return True

    agent = aio.Agent(aio.client("test"), input_guardrails=[sync_ok, async_ok],
                      output_guardrails=[sync_ok])
    reply = await agent.run("hello")
    assert calls[:2] == [("sync", "hello"), ("async", "hello")]
    assert calls[2] == ("sync", reply)


async def test_an_output_tripwire_blocks_the_answer() -> None:
    def no_secrets(ctx: RunContext[Any], text: str) -> None:
        if "secret" in text:
            raise aio.Tripwire("the answer leaks a secret")

    model = ScriptedModel([Turn(text="the secret is 42"), Turn(text="I cannot say")])
    agent = aio.Agent(model, output_guardrails=[no_secrets])
    reply = await agent.run("what is it?")
    assert reply == "Run blocked by guardrail 'no_secrets': the answer leaks a secret"
    result = agent.last_run
    assert result is not None and result.status == "blocked"
    assert result.stop_reason == "guardrail:no_secrets"
    assert agent.messages[-1].get("aimu_partial") is True  # never the session's answer
    _valid(agent)
    # a resume asks the model again, and the new answer is checked again
    assert await agent.resume() == "I cannot say"


async def test_an_output_guardrail_sees_the_typed_output() -> None:
    class Answer(BaseModel):
        value: int

    seen: list[object] = []

    def positive(ctx: RunContext[Any], answer: Answer) -> None:
        seen.append(answer)
        if answer.value < 0:
            raise aio.Tripwire("negative")

    model = ScriptedModel([Turn(text='{"value": -1}')])
    agent = aio.Agent(model, output_type=Answer, output_guardrails=[positive])
    with pytest.raises(aio.NoOutputError):
        await agent.run("a number")
    assert seen == [Answer(value=-1)]
    assert agent.last_run is not None and agent.last_run.status == "blocked"


async def test_blocked_is_stored_with_the_run(tmp_path: Any) -> None:
    store = aio.SQLiteStore(tmp_path / "s.db")
    agent = aio.Agent(ScriptedModel([Turn(text="the secret")]), store=store, session="s1",
                      output_guardrails=[_no_secret])
    async with agent:
        await agent.run("tell")
    async with aio.Agent(ScriptedModel([]), store=store, session="s1") as again:
        assert again.messages[-1].get("aimu_partial") is True
    info = await store.info("s1")
    assert info is not None and info.status == "blocked"
    runs = await store.runs()
    assert runs[0].status == "blocked"
    await store.aclose()


def _no_secret(ctx: RunContext[Any], text: str) -> None:
    if "secret" in text:
        raise aio.Tripwire("secret")


async def test_bad_guardrail_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="input_guardrails"):
        aio.Agent(aio.client("test"), input_guardrails=[1])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="output_guardrails"):
        aio.Agent(aio.client("test"), output_guardrails=_no_secret)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tool_guardrails"):
        aio.Agent(aio.client("test"), tool_guardrails=[_no_secret])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="before="):
        aio.ToolGuardrail()


def _tool_script() -> ScriptedModel:
    return ScriptedModel([
        Turn(tool_calls=[ScriptedCall("lookup", {"q": "secret"}, id="c1")]),
        Turn(text="done"),
    ])


async def test_a_tool_guardrail_refuses_the_arguments_and_the_tool_never_runs() -> None:
    ran: list[str] = []

    def lookup(q: str) -> str:
        """Look something up."""
        ran.append(q)
        return f"found {q}"

    def no_secret_queries(ctx: RunContext[Any], call: dict[str, Any]) -> None:
        if "secret" in call["arguments"]["q"]:
            raise aio.Tripwire("no secret lookups")

    model = _tool_script()
    agent = aio.Agent(model, [lookup],
                      tool_guardrails=[aio.ToolGuardrail(before=no_secret_queries)])
    assert await agent.run("find it") == "done"
    assert ran == []
    result = agent.messages[2]
    assert result["role"] == "tool" and "no secret lookups" in result["content"]
    assert "no_secret_queries" in result["content"]
    # the model read the refusal as the tool's result
    assert "no secret lookups" in model.requests[1]["messages"][-1]["content"]


async def test_a_tool_guardrail_withholds_a_result() -> None:
    def hide(ctx: RunContext[Any], call: dict[str, Any]) -> None:
        if "found" in call["result"]:
            raise aio.Tripwire("results are private")

    model = _tool_script()
    agent = aio.Agent(model, [lookup], tool_guardrails=[
        aio.ToolGuardrail(after=hide, tools=frozenset({"lookup"})),
        aio.ToolGuardrail(before=_no_secret, tools=frozenset({"other"})),  # not this tool
    ])
    assert await agent.run("find it") == "done"
    assert agent.messages[2]["content"] == (
        "[result withheld by guardrail 'hide': results are private]"
    )
    _valid(agent)


async def test_a_tool_guardrail_that_raises_fails_the_run() -> None:
    def broken(ctx: RunContext[Any], call: dict[str, Any]) -> None:
        raise RuntimeError("bug")

    agent = aio.Agent(_tool_script(), [lookup],
                      tool_guardrails=[aio.ToolGuardrail(before=broken)])
    with pytest.raises(aio.GuardrailError, match="tool guardrail 'broken' raised RuntimeError"):
        await agent.run("find it")
    _valid(agent)


async def test_a_cancel_while_a_tool_guardrail_runs() -> None:
    gate = Gate()
    agent = aio.Agent(_tool_script(), [lookup], tool_guardrails=[aio.ToolGuardrail(after=gate)])
    handle = aio.RunHandle.start(agent.run("find it"))
    await gate.entered.wait()  # the tool ran; its result is being checked
    handle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert gate.cancelled and handle.status == "cancelled"
    _valid(agent)
    assert agent.messages[-1]["role"] == "tool"  # the call settled, never left open
    assert _other_tasks() == set()


async def test_a_workflow_with_a_blocked_agent_ends_blocked() -> None:
    def refuse(ctx: RunContext[Any], text: str) -> None:
        raise aio.Tripwire("refused")

    first = aio.Agent(aio.client("test"), name="first", input_guardrails=[refuse])
    second = aio.Agent(aio.client("test"), name="second")
    chain = aio.Chain([first, second])
    handle = aio.RunHandle.start(chain.run("x"))
    assert await handle == "Run blocked by guardrail 'refuse': refused"
    assert handle.status == "blocked"
    assert chain.last_run is not None and chain.last_run.status == "blocked"
    assert chain.last_run.stop_reason == "guardrail:refuse"
    assert second.messages == []  # the chain stopped at the blocked step


async def test_a_resume_of_a_blocked_task_is_checked_again_first() -> None:
    model = ScriptedModel([Turn(text="partial reply", chunks=3), Turn(text="fine")])

    def no_pins(ctx: RunContext[Any], text: str) -> None:
        if "PIN" in text:
            raise aio.Tripwire("no PINs")

    agent = aio.Agent(model, input_guardrails=[no_pins])
    assert (await agent.run("my PIN")).startswith("Run blocked")
    asked = len(model.requests)
    assert (await agent.resume()).startswith("Run blocked")  # never sent to the model
    assert len(model.requests) == asked
    assert agent.last_run is not None and agent.last_run.status == "blocked"
    assert await agent.run("something else") == "fine"
    _valid(agent)


async def test_an_interrupted_caller_of_a_blocked_agent_reports_interrupted() -> None:
    handles: list[aio.RunHandle[Any]] = []

    def refuse_and_interrupt(ctx: RunContext[Any], text: str) -> None:
        handles[0].interrupt()  # the caller stops at its next step boundary
        raise aio.Tripwire("refused")

    child = aio.Agent(ScriptedModel([Turn(text="child text", chunks=3)]), name="child",
                      input_guardrails=[refuse_and_interrupt])
    parent = aio.Agent(
        ScriptedModel([Turn(tool_calls=[ScriptedCall("child", {"task": "t"})]),
                       Turn(text="after")]),
        [child.as_tool()], name="parent",
    )
    handles.append(aio.RunHandle.start(parent.run("go")))
    assert await handles[0] == aio.agent.INTERRUPTED
    assert handles[0].status == "interrupted"  # not "completed", not "blocked"
    assert "blocked" in parent.messages[-1]["content"]  # the call's result says so
    _valid(parent)
