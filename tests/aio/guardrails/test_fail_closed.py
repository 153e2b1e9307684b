"""Guardrails fail closed (issue 42 item 6): a guardrail that ends any way other than
"passed" or a tripwire (it raised, or it ended cancelled while the run was not
stopped) fails the run, and no tool ever runs on a task the input guardrails have not
passed; a stop of the run while a guardrail runs stays a stop (``cancelled``, the
CancelledError reaching the caller). Each kind: input, output, tool before and after."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from aimu import aio
from aimu.aio.instructions import RunContext
from aimu.aio.transcript import dangling_calls, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from tests.aio.guardrails.test_guardrails import Gate


async def _awaits_a_cancelled_future(ctx: RunContext[Any], value: object) -> None:
    """A guardrail whose own await ends cancelled (a library under it cancelled a
    future it waited on); nobody stopped the run."""
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.cancel()
    await future


async def _cancels_its_own_task(ctx: RunContext[Any], value: object) -> None:
    """A guardrail that cancels the task it runs in (the input guardrails' own)."""
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    await asyncio.sleep(0)


def _raises_cancelled(ctx: RunContext[Any], value: object) -> None:
    """A sync guardrail that raises CancelledError itself."""
    raise asyncio.CancelledError


def _script() -> ScriptedModel:
    """A tool call, then an answer: the call runs only if the task was passed."""
    return ScriptedModel([
        Turn(tool_calls=[ScriptedCall("effect", {"q": "x"}, id="c1")]),
        Turn(text="done"),
    ])


class Effects:
    """A tool with a side effect the test can count."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def effect(self, q: str) -> str:
        """Do something that cannot be undone."""
        self.ran.append(q)
        return f"did {q}"


def _valid(agent: aio.Agent[Any]) -> None:
    validate(agent.messages)
    assert dangling_calls(agent.messages) == []


def _other_tasks() -> set[asyncio.Task[Any]]:
    current = asyncio.current_task()
    return {t for t in asyncio.all_tasks() if t is not current and not t.done()}


Check = Callable[[RunContext[Any], object], Awaitable[None] | None]
_UNDECIDED: list[Check] = [_awaits_a_cancelled_future, _raises_cancelled]


@pytest.mark.parametrize("guardrail", [*_UNDECIDED, _cancels_its_own_task])
async def test_an_input_guardrail_that_ends_cancelled_fails_the_run_and_no_tool_runs(
    guardrail: Check,
) -> None:
    effects = Effects()
    agent = aio.Agent(_script(), [effects.effect], input_guardrails=[guardrail])
    handle = aio.RunHandle.start(agent.run("do it"))
    with pytest.raises(aio.GuardrailError, match="ended cancelled") as raised:
        await handle
    assert raised.value.guardrail == guardrail.__name__ and raised.value.kind == "input"
    assert effects.ran == []  # never run on a task nobody passed
    assert handle.status == "failed"
    assert agent.last_run is not None and agent.last_run.status == "failed"
    _valid(agent)
    assert _other_tasks() == set()


@pytest.mark.parametrize("sync", [True, False])
async def test_an_input_tripwire_decided_before_the_turn_ends_runs_no_tool(sync: bool) -> None:
    """The guardrails decided while the turn streamed, their task's done callback not
    yet run when the turn asked for the decision: the tripwire still holds."""
    def refuse(ctx: RunContext[Any], text: object) -> None:
        raise aio.Tripwire("no")

    async def refuse_async(ctx: RunContext[Any], text: object) -> None:
        raise aio.Tripwire("no")

    effects = Effects()
    agent = aio.Agent(_script(), [effects.effect],
                      input_guardrails=[refuse if sync else refuse_async])
    reply = await agent.run("do it")
    assert reply.startswith("Run blocked by guardrail") and effects.ran == []
    assert agent.last_run is not None and agent.last_run.status == "blocked"
    _valid(agent)


@pytest.mark.parametrize("guardrail", _UNDECIDED)
async def test_an_output_guardrail_that_ends_cancelled_fails_the_run(guardrail: Check) -> None:
    agent = aio.Agent(ScriptedModel([Turn(text="the answer")]), output_guardrails=[guardrail])
    handle = aio.RunHandle.start(agent.run("ask"))
    with pytest.raises(aio.GuardrailError, match=r"output guardrail .* ended cancelled"):
        await handle
    assert handle.status == "failed"  # not "cancelled": nobody stopped it
    assert agent.last_run is not None and agent.last_run.status == "failed"
    _valid(agent)


@pytest.mark.parametrize("guardrail", _UNDECIDED)
@pytest.mark.parametrize("side", ["before", "after"])
async def test_a_tool_guardrail_that_ends_cancelled_fails_the_run(
    guardrail: Check, side: str
) -> None:
    effects = Effects()
    model = _script()
    agent = aio.Agent(model, [effects.effect],
                      tool_guardrails=[aio.ToolGuardrail(**{side: guardrail})])
    handle = aio.RunHandle.start(agent.run("do it"))
    with pytest.raises(aio.GuardrailError, match=r"tool guardrail .* ended cancelled"):
        await handle
    assert handle.status == "failed"
    assert effects.ran == ([] if side == "before" else ["x"])
    assert len(model.requests) == 1  # the model never read an unchecked result
    _valid(agent)
    assert _other_tasks() == set()


def _agent_guarded_by(kind: str, gate: Gate, effects: Effects) -> aio.Agent[Any]:
    model = ScriptedModel([
        Turn(text="thinking", chunks=2, fault="hang", fault_after=2) if kind == "input"
        else Turn(tool_calls=[ScriptedCall("effect", {"q": "x"}, id="c1")]),
        Turn(text="done"),
    ])
    options: dict[str, Any] = {
        "input": {"input_guardrails": [gate]},
        "output": {"output_guardrails": [gate]},
        "before": {"tool_guardrails": [aio.ToolGuardrail(before=gate)]},
        "after": {"tool_guardrails": [aio.ToolGuardrail(after=gate)]},
    }[kind]
    return aio.Agent(model, [effects.effect], **options)


KINDS = ["input", "output", "before", "after"]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_cancel_of_the_run_while_a_guardrail_runs_stays_a_cancel(kind: str) -> None:
    gate, effects = Gate(), Effects()
    agent = _agent_guarded_by(kind, gate, effects)
    handle = aio.RunHandle.start(agent.run("do it"))
    await gate.entered.wait()
    handle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert handle.status == "cancelled" and gate.cancelled
    assert agent.last_run is not None and agent.last_run.status == "cancelled"
    assert effects.ran == ([] if kind in ("input", "before") else ["x"])
    _valid(agent)
    assert _other_tasks() == set()


@pytest.mark.parametrize("kind", KINDS)
async def test_a_cancel_and_a_guardrail_ending_cancelled_in_one_moment_is_a_cancel(
    kind: str,
) -> None:
    """The run is cancelled in the same loop step as the guardrail's own await ends
    cancelled: the run's stop wins (``cancelled``, CancelledError), never swallowed
    into a failure, and never a pass."""
    gate, effects = Gate(), Effects()
    agent = _agent_guarded_by(kind, gate, effects)
    handle = aio.RunHandle.start(agent.run("do it"))
    await gate.entered.wait()
    gate.decide(asyncio.CancelledError())  # next step it ends cancelled by itself...
    handle.cancel()  # ...and the run is cancelled in the same step
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert handle.status == "cancelled"
    assert agent.last_run is not None and agent.last_run.status == "cancelled"
    assert effects.ran == ([] if kind in ("input", "before") else ["x"])
    _valid(agent)
    assert _other_tasks() == set()
