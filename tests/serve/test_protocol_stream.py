"""serve.protocols.EventStream: the one decoding of a run's events and the nesting every
protocol adapter keeps.

The nesting is checked on a trace of the hooks (what an adapter is asked to write):
steps hold the parts; one text or reasoning part open at a time; a tool call whole and
with no part open; everything closed by ``close()``. It holds wherever a stop lands
(every prefix of a real run's events: mid-text, mid-reasoning, between a call and its
result), for a resumed run (shown calls not started again), and across a turn asked
again (``TurnRetried``): a client that follows the parts (dropping the one a restarted
turn names) shows the answer once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from aimu import aio
from aimu.aio.event_json import event_data
from aimu.aio.events import (
    Event,
    HandleFinished,
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
from aimu.aio.providers.anthropic import AnthropicClient
from aimu.aio.providers.ollama import OllamaClient
from aimu.serve.protocols import EventStream, decode
from aimu.testing.script import ScriptedCall, Turn, cut_once
from aimu.testing.server import LoopbackServer

Hook = tuple[Any, ...]
A = "agent"


class Trace(EventStream[Hook]):
    """Every hook as ``(name, *what it was given)``."""

    def step_start(self) -> list[Hook]:
        return [("step_start",)]

    def step_end(self) -> list[Hook]:
        return [("step_end",)]

    def step_finished(self, step: StepFinished) -> list[Hook]:
        return [("step_finished", step.step)]

    def text_start(self, part: str) -> list[Hook]:
        return [("text_start", part)]

    def text_delta(self, part: str, text: str) -> list[Hook]:
        return [("text_delta", part, text)]

    def text_end(self, part: str) -> list[Hook]:
        return [("text_end", part)]

    def reasoning_start(self, part: str) -> list[Hook]:
        return [("reasoning_start", part)]

    def reasoning_delta(self, part: str, text: str) -> list[Hook]:
        return [("reasoning_delta", part, text)]

    def reasoning_end(self, part: str) -> list[Hook]:
        return [("reasoning_end", part)]

    def tool_call_start(self, call: ToolCallStarted, parent: str | None) -> list[Hook]:
        return [("tool_call_start", call.call_id, parent)]

    def tool_call_args(self, call: ToolCallStarted) -> list[Hook]:
        return [("tool_call_args", call.call_id, call.arguments)]

    def tool_call_end(self, call: ToolCallStarted) -> list[Hook]:
        return [("tool_call_end", call.call_id)]

    def tool_result(self, result: ToolResult) -> list[Hook]:
        return [("tool_result", result.call_id)]

    def tool_progress(self, progress: ToolProgress) -> list[Hook]:
        return [("tool_progress", progress.call_id)]

    def turn_retried(self, retried: TurnRetried, part: str | None) -> list[Hook]:
        return [("turn_retried", retried.mode, part)]


def check_nesting(trace: list[Hook]) -> None:
    """Raise AssertionError where ``trace`` (a stream's hooks, closed) is not well nested."""
    step = False
    text: str | None = None
    reasoning: str | None = None
    calls: list[str] = []
    for index, (hook, *args) in enumerate(trace):
        where = f"hook {index} {hook}{tuple(args)} in {trace}"
        if hook == "step_start":
            assert not step, where
            step = True
        elif hook == "step_end":
            assert step and text is None and reasoning is None, where
            step = False
        elif hook in ("text_start", "reasoning_start"):
            assert step and text is None and reasoning is None, where
            text, reasoning = (args[0], reasoning) if hook == "text_start" else (text, args[0])
        elif hook == "text_delta" or hook == "text_end":
            assert text == args[0], where
            text = None if hook == "text_end" else text
        elif hook == "reasoning_delta" or hook == "reasoning_end":
            assert reasoning == args[0], where
            reasoning = None if hook == "reasoning_end" else reasoning
        elif hook == "tool_call_start":
            assert step and text is None and reasoning is None, where
            assert args[0] not in calls, where  # each call started once
            assert [h[0] for h in trace[index:index + 3]] == [
                "tool_call_start", "tool_call_args", "tool_call_end"], where
            calls.append(args[0])
        elif hook in ("tool_result", "tool_progress"):
            assert step and text is None, where
    assert not step and text is None and reasoning is None, f"left open: {trace}"


def run(events: list[Event], stream: EventStream[Hook] | None = None) -> list[Hook]:
    """The hooks ``events`` (as JSON, as a follower yields them) call, then the close."""
    stream = stream or Trace("r")
    out = [hook for event in events for hook in stream.feed(event_data(event))]
    return out + stream.close()


def shown_text(trace: list[Hook]) -> str:
    """The text a client shows following the parts: a restarted turn drops the part it
    names (and what it wrote), a continued one keeps it."""
    parts: dict[str, str] = {}
    for hook, *args in trace:
        if hook == "text_delta":
            parts[args[0]] = parts.get(args[0], "") + args[1]
        elif hook == "turn_retried" and args[0] == "restarted" and args[1] is not None:
            parts.pop(args[1], None)
    return "".join(parts.values())


# -- decoding --------------------------------------------------------------------------------


EVENTS: list[Event] = [
    TextChunk(A, "hi"), TextChunk(A, "inner", ("planner", "researcher")),
    ThinkingChunk(A, "hm"), ToolCallStarted(A, "c1", "f", {"a": [1, {"b": None}]}),
    ToolProgress(A, "c1", "f", 0.5, 2.0, "half"), ToolProgress(A, "c1", "f", 1),
    ToolResult(A, "c1", "f", "ok", True), TurnRetried(A, "continued", "so far", "reset", 3),
    StepFinished(A, 2),
    RunFinished(A, "completed", "done", {"input_tokens": 1, "output_tokens": 2},
                stop_reason="length", requests=2, retries=1, duration=0.25),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda event: type(event).__name__)
def test_an_event_decodes_to_what_was_encoded(event: Event) -> None:
    assert decode(event_data(event)) == event


def test_events_no_protocol_shows_decode_to_nothing() -> None:
    for event in (RunStarted(A, "go"), HandleFinished("h", "completed", None)):
        assert decode(event_data(event)) is None
        assert Trace("r").feed(event_data(event)) == []


# -- nesting -----------------------------------------------------------------------------------


def test_a_stop_mid_text_ends_the_text_then_the_step() -> None:
    trace = run([ThinkingChunk(A, "hm"), TextChunk(A, "a"), TextChunk(A, "b")])
    assert trace == [
        ("step_start",), ("reasoning_start", "r-1"), ("reasoning_delta", "r-1", "hm"),
        ("reasoning_end", "r-1"), ("text_start", "r-2"), ("text_delta", "r-2", "a"),
        ("text_delta", "r-2", "b"), ("text_end", "r-2"), ("step_end",),
    ]


def test_a_stop_mid_reasoning_ends_the_reasoning_then_the_step() -> None:
    trace = run([TextChunk(A, "a"), ThinkingChunk(A, "h"), ThinkingChunk(A, "m")])
    assert trace[-3:] == [("reasoning_delta", "r-2", "m"), ("reasoning_end", "r-2"),
                          ("step_end",)]
    check_nesting(trace)


def test_a_stop_between_a_call_and_its_result_leaves_the_call_whole() -> None:
    trace = run([TextChunk(A, "a"), ToolCallStarted(A, "c1", "f", {"x": 1})])
    assert trace == [
        ("step_start",), ("text_start", "r-1"), ("text_delta", "r-1", "a"), ("text_end", "r-1"),
        ("tool_call_start", "c1", "r-1"), ("tool_call_args", "c1", {"x": 1}),
        ("tool_call_end", "c1"), ("step_end",),
    ]


def test_a_resumed_run_does_not_start_the_calls_the_client_was_shown() -> None:
    stream = Trace("r", shown=["c1"])
    trace = run([ToolCallStarted(A, "c1", "f", {}), ToolResult(A, "c1", "f", "ok", False),
                 ToolCallStarted(A, "c2", "g", {}), ToolResult(A, "c2", "g", "ok", False),
                 StepFinished(A, 2)], stream)
    assert [hook for hook in trace if hook[0].startswith("tool")] == [
        ("tool_result", "c1"), ("tool_call_start", "c2", None), ("tool_call_args", "c2", {}),
        ("tool_call_end", "c2"), ("tool_result", "c2")]
    assert stream.calls == {"c1", "c2"}
    check_nesting(trace)


def test_hidden_calls_and_results_show_nothing_and_open_no_step() -> None:
    stream = Trace("r")
    stream.hidden_calls = stream.hidden_results = frozenset({"c1"})
    assert run([ToolCallStarted(A, "c1", "f", {}), ToolResult(A, "c1", "f", "ok", False)],
               stream) == []


def test_a_restarted_turn_ends_its_parts_and_names_the_text_dropped() -> None:
    trace = run([ThinkingChunk(A, "h"), TextChunk(A, "partial"),
                 TurnRetried(A, "restarted", "", "reset"), ThinkingChunk(A, "h"),
                 TextChunk(A, "whole"), StepFinished(A, 1)])
    check_nesting(trace)
    retried = trace.index(("turn_retried", "restarted", "r-2"))
    assert trace[retried + 1] == ("text_end", "r-2")
    assert shown_text(trace) == "whole"


def test_a_restart_mid_reasoning_ends_the_reasoning() -> None:
    trace = run([ThinkingChunk(A, "h"), TurnRetried(A, "restarted", "", "reset"),
                 ThinkingChunk(A, "h2")])
    assert trace[3:6] == [("turn_retried", "restarted", None), ("reasoning_end", "r-1"),
                          ("reasoning_start", "r-2")]
    check_nesting(trace)


def test_a_continued_turn_goes_on_in_the_same_part() -> None:
    trace = run([TextChunk(A, "so "), TurnRetried(A, "continued", "so ", "reset"),
                 TextChunk(A, "far")])
    assert [hook for hook in trace if hook[0].startswith("text")] == [
        ("text_start", "r-1"), ("text_delta", "r-1", "so "), ("text_delta", "r-1", "far"),
        ("text_end", "r-1")]
    assert shown_text(trace) == "so far"


def test_a_step_opens_once_for_shown_progress_and_not_for_silent_events() -> None:
    trace = run([ToolProgress(A, "c1", "f", 1), ToolProgress(A, "c1", "f", 2),
                 TurnRetried(A, "continued", "", "x"), StepFinished(A, 1), StepFinished(A, 2)])
    assert trace == [("step_start",), ("tool_progress", "c1"), ("tool_progress", "c1"),
                     ("turn_retried", "continued", None), ("step_end",),
                     ("step_finished", 1), ("step_finished", 2)]


# -- a real run, stopped anywhere ----------------------------------------------------------------


REPLY = Turn(thinking="let me see now", text="Looking up the weather in Oslo for you.",
             tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})])
PLAIN = replace(REPLY, thinking="")  # a reply Ollama's client continues
AFTER = Turn(text="It is sunny in Oslo.")


def lookup(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.mark.parametrize(("provider", "reply", "mode"), [
    ("ollama", PLAIN, "continued"), ("ollama", REPLY, "restarted"),
    ("anthropic", REPLY, "restarted"),
])
async def test_a_real_run_cut_and_stopped_anywhere_stays_nested(
    provider: str, reply: Turn, mode: str
) -> None:
    """A reply broken after each of its chunks (asked again: continued or restarted),
    and the stream stopped after each of the run's events: always well nested, and the
    whole run shows each answer once."""
    modes: set[str] = set()
    for cut in range(12):
        async with LoopbackServer(cut_once(reply, AFTER, fault_after=cut)) as server:
            client = (OllamaClient("m", host=server.url, retry_delay=0.001)
                      if provider == "ollama" else
                      AnthropicClient("m", base_url=server.url, api_key="k", retry_delay=0.001))
            async with aio.Agent(client, tools=[lookup]) as agent:
                events = [event async for event in agent.run("weather?", stream=True)]
        where = f"{provider}, cut after chunk {cut}"
        assert isinstance(events[-1], RunFinished) and events[-1].status == "completed", where
        for stop in range(len(events) + 1):  # a stop lands after any event
            check_nesting(run(events[:stop]))
        trace = run(events)
        assert shown_text(trace) == REPLY.text + AFTER.text, where
        assert sum(hook[0] == "tool_call_start" for hook in trace) == 1, where
        modes.update(event.mode for event in events if isinstance(event, TurnRetried))
    assert mode in modes  # (a cut before any text restarts on every wire)
