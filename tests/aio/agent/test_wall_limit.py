"""A ``wall`` limit cuts a streamed reply or a running tool call at once, like a deadline,
but the run ends ``limited`` (not ``timed_out``), its transcript valid and resumable.

The cut comes from the clock, so no test waits for it to land at a chosen moment: each
asserts what holds wherever it lands (the kept text is exactly what streamed), or runs
a hanging stream or tool that only the limit can end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from aimu import aio
from aimu.aio.client import ModelClient
from aimu.aio.ends import LIMITED
from aimu.aio.events import TextChunk, ToolCallStarted
from aimu.aio.transcript import CANCELLED_RESULT, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer

FOREVER = 3600.0


async def streamed_text(agent: aio.Agent, task: str) -> str:
    return "".join(
        [e.text async for e in agent.run(task, stream=True) if isinstance(e, TextChunk)]
    )


async def test_a_wall_limit_cuts_a_hanging_stream_over_the_wire(
    make_client: Callable[..., ModelClient], server: LoopbackServer
) -> None:
    server.script = [Turn(text="one two three four", fault="hang", fault_after=2),
                     Turn(text="the rest")]
    agent = aio.Agent(make_client(), limits=aio.UsageLimits(wall=0.3))
    seen = await streamed_text(agent, "talk")  # the stream never ends: only the limit can
    result = agent.last_run
    assert result is not None and result.status == "limited"
    assert result.stop_reason == "limit:wall" and result.usage_estimated
    assert result.limit is not None and "run's wall limit of 0.3" in result.limit
    last = agent.model_client.messages[-1]
    assert last["role"] == "assistant" and last.get("aimu_partial") is True
    assert last["content"] == seen == result.reply
    (record,) = await server.wait_abandoned(1)  # the server saw the stream go
    assert not record.completed
    validate(agent.model_client.messages)
    assert await agent.resume(limits=aio.UsageLimits()) == "the rest"
    validate(agent.model_client.messages)


async def test_a_session_wall_limit_cuts_a_stream_too() -> None:
    model = ScriptedModel([Turn(text="a b c", delay=FOREVER), Turn(text="done")])
    agent = aio.Agent(model, session_limits=aio.UsageLimits(wall=0.2))
    await streamed_text(agent, "talk")
    result = agent.last_run
    assert result is not None and result.status == "limited"
    assert result.limit is not None and "session's wall limit" in result.limit
    assert model.open_streams == 0
    assert agent.spend.wall >= 0.2
    # The session's clock is spent: the next run stops before its request.
    assert await agent.resume() == LIMITED
    assert len(model.requests) == 1
    validate(agent.model_client.messages)


@pytest.mark.parametrize("concurrent", [False, True], ids=["one call", "side by side"])
async def test_a_wall_limit_cuts_running_tool_calls_and_answers_them_cancelled(
    concurrent: bool, tmp_path: Path
) -> None:
    # A tool that never returns; only the limit ends it. Where the clock lands is not
    # ours to choose: a wall so short that it cut the model turn instead is doubled.
    entered: list[str] = []
    cancelled: list[str] = []

    async def wait_forever(name: str) -> str:
        """Wait for ever."""
        entered.append(name)
        try:
            await asyncio.sleep(FOREVER)
        except asyncio.CancelledError:
            cancelled.append(name)
            raise
        return name

    for wall in (0.3, 1.0, 4.0, 16.0):
        entered.clear()
        cancelled.clear()
        calls = [ScriptedCall("wait_forever", {"name": n}) for n in ("a", "b")]
        model = ScriptedModel([Turn(tool_calls=calls), Turn(text="after")])
        store = aio.SQLiteStore(tmp_path / f"{wall}.db")
        agent = aio.Agent(
            model, tools=[wait_forever], concurrent_tools=concurrent,
            limits=aio.UsageLimits(wall=wall), store=store, session="s",
        )
        async with agent:
            events = [e async for e in agent.run("wait", stream=True)]
            stored = await store.load("s")
        await store.aclose()
        if not entered:
            continue
        result = agent.last_run
        assert result is not None and result.status == "limited"
        assert result.stop_reason == "limit:wall"
        assert cancelled == entered  # every call that ran was cancelled, none left behind
        assert entered == (["a", "b"] if concurrent else ["a"])
        assert [e.call_id for e in events if isinstance(e, ToolCallStarted)]
        tool_results = [m for m in agent.model_client.messages if m["role"] == "tool"]
        assert [m["content"] for m in tool_results] == [CANCELLED_RESULT] * 2
        validate(agent.model_client.messages)
        assert stored == agent.model_client.messages  # the store holds the same, once each
        store = aio.SQLiteStore(tmp_path / f"{wall}.db")  # another process, say
        agent = aio.Agent(model, tools=[wait_forever], store=store, session="s")
        async with agent:
            assert await agent.resume(limits=aio.UsageLimits()) == "after"
        await store.aclose()
        return
    pytest.fail("the wall limit cut the model turn every time, even at 16 s")


async def test_a_users_cancel_under_a_wall_limit_is_still_a_cancel() -> None:
    model = ScriptedModel([Turn(text="a b c", delay=FOREVER)])
    agent = aio.Agent(model, limits=aio.UsageLimits(wall=FOREVER))
    handle = aio.RunHandle.start(agent.run("talk"))
    async for event in handle.events():
        if isinstance(event, TextChunk):
            handle.cancel()
    assert handle.status == "cancelled"
    assert agent.last_run is not None and agent.last_run.status == "cancelled"
    with pytest.raises(asyncio.CancelledError):
        await handle
    validate(agent.model_client.messages)


async def test_a_run_that_ends_before_its_wall_limit_leaves_no_timer() -> None:
    model = ScriptedModel([Turn(text="quick")])
    agent = aio.Agent(model, limits=aio.UsageLimits(wall=FOREVER))
    assert await agent.run("hi") == "quick"
    assert agent.last_status == "completed"
    loop = asyncio.get_running_loop()
    assert not [h for h in loop._scheduled if not h.cancelled()  # type: ignore[attr-defined]
                and h.when() > loop.time() + FOREVER / 2]
