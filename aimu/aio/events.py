"""Events: frozen dataclasses, each with a ``type`` tag, emitted by every aimu loop.

An agent run emits ``RunStarted``, then chunks, tool calls and results and a
``StepFinished`` per tool round, and exactly one ``RunFinished``, last, whatever
ended the run. A :class:`~aimu.aio.RunHandle` adds its own terminal
``HandleFinished`` after everything the loops inside it emitted. Every run event's
first field, ``source``, names the agent or workflow whose run emitted it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from aimu.aio.transcript import Usage

__all__ = [
    "Event",
    "HandleFinished",
    "HandleStatus",
    "ModelRetry",
    "RunFinished",
    "RunStarted",
    "RunStatus",
    "StepFinished",
    "TextChunk",
    "ThinkingChunk",
    "ToolCallStarted",
    "ToolResult",
]

RunStatus: TypeAlias = Literal[
    "completed", "interrupted", "cancelled", "failed", "max_rounds", "paused"
]
HandleStatus: TypeAlias = Literal[
    "pending", "running", "completed", "interrupted", "paused", "cancelled", "timed_out",
    "failed",
]


@dataclass(frozen=True, slots=True)
class RunStarted:
    source: str
    task: str | None
    """The user message this run added, or None for a resume."""
    type: Literal["run_started"] = field(default="run_started", init=False)


@dataclass(frozen=True, slots=True)
class TextChunk:
    source: str
    text: str
    type: Literal["text"] = field(default="text", init=False)


@dataclass(frozen=True, slots=True)
class ThinkingChunk:
    source: str
    text: str
    type: Literal["thinking"] = field(default="thinking", init=False)


@dataclass(frozen=True, slots=True)
class ToolCallStarted:
    source: str
    call_id: str
    name: str
    arguments: dict[str, Any]
    type: Literal["tool_call"] = field(default="tool_call", init=False)


@dataclass(frozen=True, slots=True)
class ToolResult:
    source: str
    call_id: str
    name: str
    content: str
    is_error: bool
    type: Literal["tool_result"] = field(default="tool_result", init=False)


@dataclass(frozen=True, slots=True)
class StepFinished:
    source: str
    step: int
    """Model turns made so far in this conversation's current task."""
    type: Literal["step_finished"] = field(default="step_finished", init=False)


@dataclass(frozen=True, slots=True)
class RunFinished:
    """The last event of every agent or workflow run, on every outcome."""

    source: str
    status: RunStatus
    reply: str
    """The answer, ``"Run interrupted."``, or the partial text a stop cut short."""
    usage: Usage
    error: str | None = None
    stop_reason: str | None = None
    """Why the model stopped its last turn ("stop", "length", ...), as its server said;
    None when no turn finished or the server did not say."""
    type: Literal["run_finished"] = field(default="run_finished", init=False)


@dataclass(frozen=True, slots=True)
class HandleFinished:
    """The last event of a :class:`~aimu.aio.RunHandle`: exactly one, on every outcome."""

    name: str
    status: HandleStatus
    reason: str | None
    """Why it was cancelled, when a reason was given."""
    result: object = None
    error: str | None = None
    type: Literal["handle_finished"] = field(default="handle_finished", init=False)


@dataclass(frozen=True, slots=True)
class ModelRetry:
    """A model request failed before any byte of its reply and is tried again.

    Emitted to the current run scope before the backoff wait; ``error`` is the failure's
    message (credentials removed), ``delay`` the seconds waited before ``attempt``.
    """

    host: str
    model: str
    attempt: int
    delay: float
    error: str
    type: Literal["model_retry"] = field(default="model_retry", init=False)


Event: TypeAlias = (
    RunStarted
    | TextChunk
    | ThinkingChunk
    | ToolCallStarted
    | ToolResult
    | StepFinished
    | RunFinished
    | HandleFinished
    | ModelRetry
)

