"""Every protocol adapter on the shared EventStream says on the wire what it said before.

protocol_wire.json is what the adapters served for each case of protocol_wire_cases.py
before they shared :class:`~aimu.serve.protocols.EventStream` (each with its own
translation of the JSON events): every byte of every Server-Sent Event, in order, and
what the routes read off a translator afterwards (AG-UI's parent text, the AI SDK's
finish reason). A2A and MCP run their own stream functions on a follower replaying the
events (and a store holding the task, for A2A).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from aimu.serve import a2a, mcp_agent
from aimu.serve.ag_ui import AgUiStream
from aimu.serve.ai_sdk import AiSdkStream
from aimu.serve.protocols import EventStream
from aimu.serve.stream_runs import sse_data
from tests.serve.protocol_wire_cases import CASES, recorded

GOLDEN: dict[str, dict[str, list[str]]] = json.loads(
    (Path(__file__).parent / "protocol_wire.json").read_text()
)


class _Follower:
    """Replays recorded events as a RunFollower yields them."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self._events = events
        self.end = None
        self.view = SimpleNamespace(run_id="run-1", session="s", messages_from=0)

    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        for event in self._events:
            yield event

    async def aclose(self) -> None:
        return None


class _Store:
    async def load(self, session: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "go"}]


class _Runs:
    store = _Store()

    async def session_run(self, session: str) -> object:
        return SimpleNamespace(messages_from=0)


def _translated(stream: EventStream[dict[str, Any]], events: list[dict[str, Any]],
                read: str) -> list[str]:
    """The stream's events for ``events``, then what a route reads off it (``read``:
    an attribute), then its close."""
    out = [sse_data(item).decode() for event in events for item in stream.feed(event)]
    return [*out, f"{read}={getattr(stream, read)}",
            *(sse_data(item).decode() for item in stream.close())]


def wire(adapter: str, name: str) -> list[str]:
    events = recorded(name)
    _, shown, other = CASES[name]
    if adapter == "ag_ui":
        ag_ui = AgUiStream("run-1", frozenset(other), frozenset(shown))
        return _translated(ag_ui, events, "step_text")
    if adapter == "ai_sdk":
        ai_sdk = AiSdkStream("run-1", frozenset(shown), frozenset(other))
        return _translated(ai_sdk, events, "stop_reason")
    out: list[str] = []
    if adapter == "a2a":

        async def streamed() -> None:
            stream = a2a._streamed(_Runs(), 7, "s:0", _Follower(events))  # type: ignore[arg-type]
            async for item in stream:
                out.append(sse_data(item).decode())

        asyncio.run(streamed())
        return out

    async def report(done: float, total: float | None, message: str | None) -> None:
        out.append(f"{done} {total} {message}")

    ctx = SimpleNamespace(report_progress=report)
    asyncio.run(mcp_agent._report(_Follower(events), ctx))  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("adapter", ["ag_ui", "ai_sdk", "a2a", "mcp"])
def test_the_wire_is_what_it_was(adapter: str, name: str) -> None:
    expected = GOLDEN[adapter][name]
    if (adapter, name) == ("mcp", "empty and stray"):
        # The one change, on purpose: MCP said "writing" for an empty text chunk too,
        # though nothing was written (no partial to keep if the client cancels then);
        # it says it at the step's first text now, as its docstring always said.
        assert expected[0] == "1 None writing"
        expected = [f"{i} {line.split(' ', 1)[1]}" for i, line in enumerate(expected[1:], 1)]
    assert wire(adapter, name) == expected
