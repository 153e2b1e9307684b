"""EvaluatorOptimizer: draft, evaluate, revise; rounds kept in state; stop and resume."""

from __future__ import annotations

import pytest
from workflow_support import agent, check_state, scripted, sweep

from aimu import aio
from aimu.aio.agent import INTERRUPTED
from aimu.aio.events import Event, StepFinished
from aimu.aio.workflows import Chain, EvaluatorOptimizer, is_accepted
from aimu.testing.scripted import ScriptedModel


def answer(role: str, task: str) -> str:
    if role == "writer":
        return "draft two" if "Feedback on it" in task else "draft one"
    if role == "critic":
        return "ACCEPT" if "draft two" in task else "Too short; add detail."
    return f"{role}<{task}>"


def optimizer(model: ScriptedModel) -> EvaluatorOptimizer:
    return EvaluatorOptimizer(agent(model, "writer"), agent(model, "critic"))


async def test_feedback_goes_back_until_the_evaluator_accepts() -> None:
    model = scripted(answer)
    loop = optimizer(model)
    assert await loop.run("write a poem") == "draft two"
    assert loop.last_status == "completed" and loop.rounds == 2
    state = check_state(loop.state)
    first, second = state["rounds"]
    assert first["accepted"] is False and first["feedback"] == "Too short; add detail."
    assert second["accepted"] is True
    revise = second["generate"]["messages"][1]["content"]
    assert "draft one" in revise and "Too short; add detail." in revise
    assert revise.startswith("write a poem")


async def test_out_of_rounds_gives_the_last_draft() -> None:
    async def never(task: str, draft: str) -> tuple[bool, str]:
        return False, f"not yet ({draft})"

    model = scripted(tools=False)
    loop = EvaluatorOptimizer(agent(model, "w"), never, max_rounds=2)
    reply = await loop.run("t")
    assert loop.last_status == "max_rounds" and loop.rounds == 2
    assert reply.startswith("w<t\n\nYour previous answer:\nw<t>")
    state = check_state(loop.state)
    assert [r["evaluate"]["kind"] for r in state["rounds"]] == ["function", "function"]
    assert state["rounds"][0]["feedback"] == "not yet (w<t>)"
    assert state["status"] == "max_rounds"
    fresh = EvaluatorOptimizer(agent(model, "w"), never, max_rounds=2)
    fresh.restore(state)
    served = model.turns_served
    assert await fresh.resume() == reply
    assert model.turns_served == served


async def test_a_function_evaluator_accepts() -> None:
    verdicts = iter([(False, "shorter"), (True, "")])
    loop = EvaluatorOptimizer(agent(scripted(tools=False), "w"),
                              lambda task, draft: next(verdicts))
    assert (await loop.run("t")).startswith("w<t\n\nYour previous answer")
    assert loop.rounds == 2
    bad = EvaluatorOptimizer(agent(scripted(tools=False), "w"), lambda task, draft: "yes")  # type: ignore[arg-type, return-value]
    with pytest.raises(TypeError, match=r"must return \(accepted: bool, feedback: str\)"):
        await bad.run("t")


def test_acceptance_protocol() -> None:
    for reply in ("ACCEPT", "accept", "  Accepted.", "**ACCEPT** looks good", "ACCEPT: fine"):
        assert is_accepted(reply), reply
    for reply in ("Acceptable, but", "I cannot accept this", "REJECT", "", "accepting"):
        assert not is_accepted(reply), reply


async def test_interrupt_between_draft_and_evaluation() -> None:
    model = scripted(answer)
    loop = optimizer(model)
    handle = aio.RunHandle.start(loop.run("write"))

    def on_event(event: Event) -> None:
        # Called as the event is emitted, so the interrupt lands exactly at the boundary.
        if isinstance(event, StepFinished) and event.source == "evaluator_optimizer":
            handle.interrupt()

    handle.scope.add_listener(on_event)
    assert await handle == INTERRUPTED
    state = check_state(loop.state)
    assert state["rounds"][0]["generate"]["status"] == "finished"
    assert state["rounds"][0]["evaluate"]["status"] == "pending"
    assert model.turns_served == 2
    fresh_model = scripted(answer)
    fresh = optimizer(fresh_model)
    fresh.restore(state)
    assert await fresh.resume() == "draft two"
    assert fresh_model.turns_served == 6  # critic, writer, critic: two turns each


@pytest.mark.parametrize("mode", ["cancel", "interrupt"])
async def test_stopped_at_every_point_resumes_to_the_same_answer(mode: str) -> None:
    stops = await sweep(optimizer, "write a poem", mode, answer)
    assert stops >= 20


async def test_shape_mismatches_and_bad_arguments() -> None:
    model = scripted(answer)
    loop = optimizer(model)
    await loop.run("x")
    state = loop.state
    with pytest.raises(ValueError, match="max_rounds=5 and the state has max_rounds=3"):
        EvaluatorOptimizer(agent(model, "writer"), agent(model, "critic"),
                           max_rounds=5).restore(state)
    with pytest.raises(ValueError, match="round 1 evaluator: the state has an agent"):
        EvaluatorOptimizer(agent(model, "writer"), Chain([agent(model, "c")])).restore(state)
    by_function = EvaluatorOptimizer(agent(model, "writer"), lambda t, d: (True, ""))
    with pytest.raises(ValueError, match="evaluates with 'agent'"):
        by_function.restore(state)
    with pytest.raises(ValueError, match="max_rounds must be a positive int"):
        EvaluatorOptimizer(agent(model, "w"), agent(model, "c"), max_rounds=0)
    with pytest.raises(TypeError, match="evaluator must be"):
        EvaluatorOptimizer(agent(model, "w"), "ACCEPT")  # type: ignore[arg-type]
