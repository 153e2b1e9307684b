"""Runs' events (as a follower yields them) that every protocol adapter translates, for
test_protocol_wire.py: its golden wire (protocol_wire.json) was written by the adapters
before they shared :class:`~aimu.serve.protocols.EventStream`, so a change on the wire
shows there."""

from __future__ import annotations

from typing import Any

from aimu.aio.event_json import event_data
from aimu.aio.events import (
    Event,
    RunFinished,
    RunStarted,
    StepFinished,
    TextChunk,
    ThinkingChunk,
    ToolCallStarted,
    ToolProgress,
    ToolResult,
    TurnRetried,
)

A = "agent"


def _text(*words: str) -> list[Event]:
    return [TextChunk(A, word) for word in words]


def _thinking(*words: str) -> list[Event]:
    return [ThinkingChunk(A, word) for word in words]


def _call(call_id: str, name: str = "search") -> ToolCallStarted:
    return ToolCallStarted(A, call_id, name, {"q": "é", "n": 1})


def _result(call_id: str, error: bool = False) -> ToolResult:
    return ToolResult(A, call_id, "search", "bad" if error else "found", error)


_FINISHED = RunFinished(A, "completed", "done", {"input_tokens": 3, "output_tokens": 4},
                        stop_reason="length")

#: name: (events, the calls the client was shown before, the calls it answered (AG-UI) /
#: denied (the AI SDK)).
CASES: dict[str, tuple[list[Event], list[str], list[str]]] = {
    "full": ([
        RunStarted(A, "go"), *_thinking("a", "b"), *_text("x", "y"), _call("c1"),
        ToolProgress(A, "c1", "search", 1, 2, "half"), _result("c1"), StepFinished(A, 1),
        *_text("z"), _call("c2"), _result("c2", error=True), *_text("w"),
        StepFinished(A, 2), *_text("end"), StepFinished(A, 3), _FINISHED,
    ], [], []),
    "cancel mid-text": ([*_thinking("a"), *_text("x", "y")], [], []),
    "cancel mid-reasoning": ([*_text("x"), *_thinking("a", "b")], [], []),
    "cancel mid-tool-call": ([*_text("x"), _call("c1")], [], []),
    "cancel after a result": ([_call("c1"), _result("c1"), *_thinking("a")], [], []),
    "resumed": ([_call("c1"), _result("c1"), _call("c2"), _result("c2"), *_text("x"),
                 StepFinished(A, 2), _FINISHED], ["c1"], []),
    "answered and denied": ([_call("c1"), _call("c2"), _result("c1"), _result("c2"),
                             *_text("x"), StepFinished(A, 1)], ["c2"], ["c1"]),
    "continued": ([*_text("x", "y"), TurnRetried(A, "continued", "xy", "reset"),
                   *_text("z"), StepFinished(A, 1)], [], []),
    "restarted": ([*_thinking("a"), *_text("x"), TurnRetried(A, "restarted", "", "reset", 2),
                   *_thinking("b"), *_text("y"), StepFinished(A, 1)], [], []),
    "restarted mid-reasoning": ([*_thinking("a"), TurnRetried(A, "restarted", "", "eof"),
                                 *_text("y")], [], []),
    "empty and stray": ([TextChunk(A, ""), StepFinished(A, 1), ThinkingChunk(A, ""),
                         ToolProgress(A, "c9", "slow", 0.5), StepFinished(A, 2),
                         StepFinished(A, 3), *_text("x")], [], []),
    "progress first": ([ToolProgress(A, "c1", "search", 3, None, None), _call("c1"),
                        _result("c1")], [], []),
    "nested agent": ([*_text("x"), TextChunk(A, "inner", ("planner",)), *_text("y")], [], []),
}


def recorded(name: str) -> list[dict[str, Any]]:
    """The case's events as JSON, as a follower yields them (a nested agent's included:
    the adapters see what they are given)."""
    return [event_data(event) for event in CASES[name][0]]
