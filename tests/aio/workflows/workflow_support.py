"""Shared pieces of the workflow tests: a deterministic scripted model, sweeps, checks."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from aimu import aio
from aimu.aio.agent import INTERRUPTED
from aimu.aio.transcript import CANCELLED_RESULT, validate
from aimu.aio.workflows import Workflow
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel

Answer = Callable[[str, str], str]


async def note(topic: str) -> str:
    """Look a topic up."""
    await asyncio.sleep(0)
    return f"note on {topic}"


def default_answer(role: str, task: str) -> str:
    return f"{role}<{task}>"


def split_request(request: Mapping[str, Any]) -> tuple[str, str, list[dict[str, Any]]]:
    """(system prompt, last user message, tool results after it) of a scripted request."""
    messages = request["messages"]
    role = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    results = [m for m in messages[last_user + 1 :] if m["role"] == "tool"]
    return role, messages[last_user]["content"], results


def scripted(answer: Answer = default_answer, *, tools: bool = True, delay: float = 0.0,
             delays: Mapping[str, float] | None = None) -> ScriptedModel:
    """A model whose every agent (named by its system prompt) makes one tool round, then
    answers ``answer(role, task)``: the same answer however often it is stopped.

    ``delay`` is the pause between chunks; ``delays`` sets it per role."""

    def script(request: Mapping[str, Any]) -> Turn:
        role, task, results = split_request(request)
        pause = delay if delays is None else delays.get(role, delay)
        if tools and not results:
            return Turn(text="let me check", tool_calls=[ScriptedCall("note", {"topic": role})],
                        delay=pause)
        return Turn(text=answer(role, task), delay=pause)

    return ScriptedModel(script)


def agent(model: ScriptedModel, role: str) -> aio.Agent:
    return aio.Agent(model.fork(), tools=[note], system=role, name=role)


def request_keys(model: ScriptedModel) -> Counter[tuple[str, str]]:
    """How many model turns each (agent role, first task of its transcript) was served."""
    keys: Counter[tuple[str, str]] = Counter()
    for request in model.requests:
        messages = request["messages"]
        role = messages[0]["content"] if messages[0]["role"] == "system" else ""
        task = next(m["content"] for m in messages if m["role"] == "user")
        keys[role, task] += 1
    return keys


def agent_records(state: object) -> Iterator[dict[str, Any]]:
    """Every agent step record anywhere in a workflow state, nested ones included."""
    if isinstance(state, dict):
        if state.get("kind") == "agent" and "messages" in state:
            yield state
        for value in state.values():
            yield from agent_records(value)
    elif isinstance(state, list):
        for value in state:
            yield from agent_records(value)


def record_key(record: Mapping[str, Any]) -> tuple[str, str]:
    messages = record["messages"]
    role = messages[0]["content"] if messages[0]["role"] == "system" else ""
    return role, next(m["content"] for m in messages if m["role"] == "user")


def check_state(state: dict[str, Any]) -> dict[str, Any]:
    """Every transcript in ``state`` is valid; the state survives JSON; returns it reloaded."""
    for record in agent_records(state):
        validate(record["messages"])
        if record["status"] == "pending":
            assert not any(m["role"] == "user" for m in record["messages"]), record
    text = json.dumps(state)
    reloaded: dict[str, Any] = json.loads(text)
    assert reloaded == state
    return reloaded


async def stop_after(task: asyncio.Future[Any], yields: int) -> bool:
    """Let the loop run ``yields`` times; True if ``task`` finished meanwhile."""
    for _ in range(yields):
        await asyncio.sleep(0)
        if task.done():
            return True
    return task.done()


async def sweep(
    build: Callable[[ScriptedModel], Workflow],
    task: str,
    mode: str,
    answer: Answer = default_answer,
) -> int:
    """Stop the workflow after 1, 2, ... loop yields until it completes on its own.

    Each stop: every transcript valid, state through JSON into a freshly built workflow,
    ``resume()`` gives the uninterrupted answer, and no finished step's turns repeat.
    Returns how many distinct stops were made.
    """
    reference_model = scripted(answer)
    expected = await build(reference_model).run(task)
    reference = request_keys(reference_model)
    for n in range(1, 5000):
        model = scripted(answer)
        workflow = build(model)
        running = asyncio.ensure_future(workflow.run(task))
        if await stop_after(running, n):
            assert running.result() == expected
            return n - 1
        if mode == "cancel":
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running
            assert workflow.last_status == "cancelled"
        else:
            assert workflow.interrupt() is True
            reply = await running
            assert reply in (INTERRUPTED, expected)
            assert workflow.last_status == ("interrupted" if reply == INTERRUPTED else "completed")
        assert not workflow.running
        assert model.open_streams == 0
        state = check_state(workflow.state)
        if mode == "interrupt":
            # The step in flight finished its turn and tool round: nothing is cut short.
            for record in agent_records(state):
                for message in record["messages"]:
                    assert "aimu_partial" not in message
                    assert message["content"] != CANCELLED_RESULT
        first = request_keys(model)
        fresh_model = scripted(answer)
        fresh = build(fresh_model)
        fresh.restore(state)
        assert await fresh.resume() == expected
        assert fresh.last_status == "completed"
        resumed = request_keys(fresh_model)
        for record in agent_records(state):
            if record["status"] == "finished":
                key = record_key(record)
                assert first[key] == reference[key]
                assert resumed[key] == 0, f"finished step {key} was run again"
        assert sum(resumed.values()) <= sum(reference.values())
    raise AssertionError("the workflow never completed")
