"""A workflow's ``run(limits=)`` bounds all its agent runs together, one after another or
side by side: the agent run that would cross it stops ``limited``, so does the workflow,
and ``resume(limits=larger)`` goes on. An agent's own ``limits=`` still holds inside."""

from __future__ import annotations

import math
from typing import Any

import pytest

from aimu import aio
from aimu.aio.ends import LIMITED
from aimu.aio.transcript import validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel

FOREVER = 3600.0


def lookup(city: str) -> str:
    """Look a city up."""
    return f"{city} is sunny"


def look_then_answer(request: dict[str, Any]) -> Turn:
    """Two requests a task: a tool call, then (with its result) the answer."""
    if request["messages"][-1]["role"] == "tool":
        return Turn(text="sunny", input_tokens=10, output_tokens=5)
    return Turn(tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})], input_tokens=10,
                output_tokens=5)


def agent(name: str, **options: Any) -> aio.Agent:
    return aio.Agent(ScriptedModel(look_then_answer), tools=[lookup], name=name, **options)


def requests_made(workflow: aio.Chain | aio.Parallel) -> int:
    assert workflow.last_run is not None
    return workflow.last_run.requests


async def test_a_chains_limit_counts_every_agent_run_inside_together() -> None:
    # Each agent needs 2 requests: 3 in all lets the first finish and stops the second.
    chain = aio.Chain([agent("first"), agent("second")])
    assert await chain.run("weather?", limits=aio.UsageLimits(requests=3)) == LIMITED
    result = chain.last_run
    assert result is not None and (result.status, result.stop_reason) == (
        "limited", "limit:requests"
    )
    assert requests_made(chain) == 3
    state = chain.state
    statuses = [step["status"] for step in state["steps"]]
    assert statuses == ["finished", "in_flight"]
    second = state["steps"][1]["messages"]
    validate(second)
    # A larger budget for the rest: the second agent goes on where it stopped.
    assert await chain.resume(limits=aio.UsageLimits(requests=5)) == "sunny"
    assert chain.last_status == "completed"
    assert requests_made(chain) == 1  # only the second agent's answer was asked for


async def test_side_by_side_branches_share_the_budget_and_never_spend_past_it() -> None:
    branches = [agent(f"b{i}") for i in range(3)]
    parallel = aio.Parallel(branches)
    assert await parallel.run("weather?", limits=aio.UsageLimits(requests=4)) == LIMITED
    assert parallel.last_status == "limited"
    assert requests_made(parallel) == 4  # 3 first requests, then one more: never 5 or 6
    statuses = [branch["status"] for branch in parallel.state["branches"]]
    assert "in_flight" in statuses
    assert await parallel.resume(limits=aio.UsageLimits(requests=10)) != LIMITED
    assert parallel.last_status == "completed"


async def test_a_workflows_token_limit_is_the_total_of_its_agents() -> None:
    chain = aio.Chain([agent("first"), agent("second")])
    # 15 tokens a request: the first agent's two requests (30) fit, the second's do not.
    assert await chain.run("weather?", limits=aio.UsageLimits(total_tokens=40)) == LIMITED
    result = chain.last_run
    assert result is not None and result.stop_reason == "limit:total_tokens"
    assert [step["status"] for step in chain.state["steps"]] == ["finished", "in_flight"]


async def test_an_agents_own_limits_still_hold_inside_a_workflow() -> None:
    chain = aio.Chain([agent("first", limits=aio.UsageLimits(requests=1)), agent("second")])
    assert await chain.run("weather?", limits=aio.UsageLimits(requests=100)) == LIMITED
    result = chain.last_run
    assert result is not None and result.stop_reason == "limit:requests"
    assert chain.state["steps"][0]["status"] == "in_flight"
    assert requests_made(chain) == 1


async def test_a_workflows_wall_limit_cuts_every_branch_streaming() -> None:
    def endless(request: dict[str, Any]) -> Turn:
        return Turn(text="a b c", delay=FOREVER)

    models = [ScriptedModel(endless) for _ in range(2)]
    parallel = aio.Parallel([aio.Agent(m, name=f"b{i}") for i, m in enumerate(models)])
    # Only the limit can end these streams.
    assert await parallel.run("talk", limits=aio.UsageLimits(wall=0.3)) == LIMITED
    result = parallel.last_run
    assert result is not None and (result.status, result.stop_reason) == ("limited", "limit:wall")
    assert all(model.open_streams == 0 for model in models)
    for branch in parallel.state["branches"]:
        validate(branch["messages"])
        assert branch["messages"][-1].get("aimu_partial") is True


@pytest.mark.parametrize(
    ("limits", "error"),
    [("requests=3", TypeError), (aio.UsageLimits, TypeError)],
)
async def test_limits_that_are_not_usage_limits_are_refused_and_nothing_runs(
    limits: object, error: type[Exception]
) -> None:
    model = ScriptedModel(look_then_answer)
    chain = aio.Chain([aio.Agent(model, tools=[lookup])])
    with pytest.raises(error, match=r"aio\.UsageLimits"):
        await chain.run("weather?", limits=limits)  # type: ignore[arg-type]
    assert chain.last_run is None and model.requests == []


@pytest.mark.parametrize(("field", "bad"), [("requests", -1), ("cost", math.nan),
                                            ("wall", -0.5)])
def test_negative_or_nan_workflow_limits_are_refused(field: str, bad: float) -> None:
    with pytest.raises(ValueError, match=field):
        aio.UsageLimits(**{field: bad})
