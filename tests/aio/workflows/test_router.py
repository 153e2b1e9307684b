"""Router: the classifier picks one route; unknown names; stop and resume."""

from __future__ import annotations

import asyncio

import pytest
from workflow_support import agent, check_state, default_answer, scripted, sweep

from aimu import aio
from aimu.aio.agent import INTERRUPTED
from aimu.aio.events import ToolCallStarted
from aimu.aio.workflows import Chain, Router
from aimu.testing.scripted import ScriptedModel


def answer(role: str, task: str) -> str:
    if role == "classifier":
        return "Tech." if "printer" in task else "Billing"
    return default_answer(role, task)


def routed(model: ScriptedModel) -> Router:
    return Router(
        {"billing": agent(model, "billing"), "tech": agent(model, "tech")},
        classifier=agent(model, "classifier"),
    )


async def test_the_classifier_agent_names_the_route() -> None:
    model = scripted(answer)
    router = routed(model)
    assert await router.run("my printer is on fire") == "tech<my printer is on fire>"
    assert router.route == "tech"
    state = check_state(router.state)
    assert state["route"] == "tech"
    assert state["classifier"]["answer"] == "Tech."
    assert state["routes"]["billing"]["status"] == "pending"
    assert state["routes"]["tech"]["status"] == "finished"
    asked = state["classifier"]["messages"][1]["content"]
    assert "one of: billing, tech" in asked and asked.endswith("my printer is on fire")
    assert await router.run("refund please") == "billing<refund please>"


async def test_a_function_classifier_is_called_once_even_across_a_resume() -> None:
    calls: list[str] = []

    async def classify(task: str) -> str:
        calls.append(task)
        await asyncio.sleep(0)
        return " `tech` "

    model = scripted(answer)
    router = Router({"billing": agent(model, "billing"), "tech": agent(model, "tech")},
                    classifier=classify)
    handle = aio.RunHandle.start(router.run("printer"))
    async for event in handle.events():
        if isinstance(event, ToolCallStarted):
            handle.interrupt()
    assert await handle == INTERRUPTED
    state = check_state(router.state)
    assert state["classifier"] == {"kind": "function", "status": "finished", "answer": " `tech` "}
    fresh = Router({"billing": agent(model, "billing"), "tech": agent(model, "tech")},
                   classifier=classify)
    fresh.restore(state)
    assert await fresh.resume() == "tech<printer>"
    assert calls == ["printer"]
    sync_router = Router({"a": agent(model, "a")}, classifier=lambda task: "A")
    assert await sync_router.run("x") == "a<x>"


async def test_an_unknown_route_is_a_clear_error_or_goes_to_the_default() -> None:
    model = scripted(tools=False)
    routes = {"billing": agent(model, "billing"), "tech": agent(model, "tech")}
    router = Router(routes, classifier=lambda task: "weather")
    with pytest.raises(ValueError, match=r"chose 'weather'.*valid routes: 'billing', 'tech'"):
        await router.run("is it raining")
    assert router.last_status == "failed"
    with pytest.raises(ValueError, match="chose 'weather'"):
        await router.resume()  # the classifier's answer is on record; it is not asked again
    fallback = Router(routes, classifier=lambda task: "weather", default="tech")
    assert await fallback.run("is it raining") == "tech<is it raining>"
    assert fallback.route == "tech"
    with pytest.raises(ValueError, match=r"default='nope' is not a route; routes: 'billing'"):
        Router(routes, classifier=lambda task: "x", default="nope")
    with pytest.raises(TypeError, match="must return a route name"):
        await Router(routes, classifier=lambda task: 3).run("x")  # type: ignore[arg-type, return-value]
    with pytest.raises(TypeError, match="classifier must be"):
        Router(routes, classifier="tech")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one route"):
        Router({}, classifier=lambda task: "x")


def test_route_names_are_matched_loosely_but_never_guessed() -> None:
    model = scripted()
    router = Router({"Billing": agent(model, "b"), "tech": agent(model, "t")},
                    classifier=lambda task: "")
    assert router.resolve("  billing.\n") == "Billing"
    assert router.resolve('"tech"') == "tech"
    assert router.resolve("**TECH**") == "tech"
    with pytest.raises(ValueError, match="not a route"):
        router.resolve("tech support")


@pytest.mark.parametrize("mode", ["cancel", "interrupt"])
async def test_stopped_at_every_point_resumes_to_the_same_answer(mode: str) -> None:
    stops = await sweep(routed, "my printer jams", mode, answer)
    assert stops >= 10


async def test_shape_mismatches() -> None:
    model = scripted(answer)
    router = routed(model)
    await router.run("printer")
    state = router.state
    other = Router({"billing": agent(model, "billing"), "sales": agent(model, "sales")},
                   classifier=agent(model, "classifier"))
    with pytest.raises(ValueError, match=r"routes \['billing', 'sales'\] and the state has "
                                         r"\['billing', 'tech'\]"):
        other.restore(state)
    by_function = Router({"billing": agent(model, "billing"), "tech": agent(model, "tech")},
                         classifier=lambda task: "tech")
    with pytest.raises(ValueError, match="classifies with 'agent'"):
        by_function.restore(state)
    nested = Router({"billing": agent(model, "billing"), "tech": Chain([agent(model, "t")])},
                    classifier=agent(model, "classifier"))
    with pytest.raises(ValueError, match="route 'tech': the state has an agent here"):
        nested.restore(state)
