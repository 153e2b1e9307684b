"""run_sync(): an agent or workflow run from code with no event loop, again and again.

Each call runs in a new event loop (``asyncio.run``); the agent's connection pool must
not stay tied to the first loop. Over the loopback server, both providers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from aimu import aio
from aimu.testing.server import LoopbackServer


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer.in_thread() as running:  # the embedded test model's behaviour
        yield running


def client_for(protocol: str, server: LoopbackServer) -> aio.ModelClient:
    if protocol == "openai":
        return aio.client("openai:m", base_url=server.openai_base_url, api_key="k")
    return aio.client("ollama:m", host=server.url)


@pytest.mark.parametrize("protocol", ["openai", "ollama"])
def test_one_agent_runs_in_two_successive_event_loops(
    protocol: str, server: LoopbackServer
) -> None:
    agent = aio.Agent(client_for(protocol, server), tools=[add])
    first = agent.run_sync("add some numbers")
    second = agent.run_sync("and again")
    assert first.startswith("I called ") and second.startswith("I called ")
    messages = agent.model_client.messages
    assert [m["content"] for m in messages if m["role"] == "user"] == [
        "add some numbers", "and again"
    ]
    assert [m["role"] for m in messages].count("tool") == 2  # the tool ran in both loops
    assert len(server.requests) >= 4
    asyncio.run(agent.model_client.aclose())


def test_a_workflow_runs_synchronously_too() -> None:
    steps = [aio.Agent(aio.client("test"), name=name) for name in ("a", "b")]
    chain = aio.Chain(steps)
    assert chain.run_sync("hello") == "You said: You said: hello"


async def test_inside_a_running_loop_it_says_to_await_instead() -> None:
    agent = aio.Agent(aio.client("test"))
    with pytest.raises(RuntimeError, match=r"run_sync\(\) cannot run inside a running event loop"):
        agent.run_sync("hello")
    assert agent.model_client.messages == []  # nothing started, nothing recorded
