"""Events: frozen dataclasses, each with a ``type`` tag, emitted by every aimu loop.

An agent run emits ``RunStarted``, then chunks, tool calls and results and a
``StepFinished`` per tool round, and exactly one ``RunFinished``, last, whatever
ended the run. A :class:`~aimu.aio.RunHandle` adds its own terminal
``HandleFinished`` after everything the loops inside it emitted. Every run event's
first field, ``source``, names the agent or workflow whose run emitted it; its ``path``
names the agents it runs under when an agent called it as a tool (``agent.as_tool()``),
outermost first: ``()`` for a run's own events, ``("planner",)`` for those of an agent
the planner called, ``("planner", "researcher")`` one level further down.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeAlias, TypeVar

from aimu.aio._frozen import quick_init
from aimu.aio.limits import Spend
from aimu.aio.status import HandleStatus, RunStatus
from aimu.aio.transcript import Message, Usage

__all__ = [
    "CUT_OFF_REASONS",
    "SAFETY_STOP_REASONS",
    "Event",
    "HandleFinished",
    "HandleStatus",
    "ModelRetry",
    "RunFinished",
    "RunResult",
    "RunStarted",
    "RunStatus",
    "StepFinished",
    "TextChunk",
    "ThinkingChunk",
    "ToolCallStarted",
    "ToolProgress",
    "ToolResult",
    "TurnRetried",
]

#: Safety stops with their reason: a reply withheld or cut for its content (Gemini's
#: finish reasons, lowercased), or a prompt refused (``prompt_`` + its block reason).
SAFETY_STOP_REASONS = frozenset({
    "safety", "recitation", "blocklist", "prohibited_content", "spii", "image_safety",
    "image_prohibited_content", "image_recitation", "model_armor",
    "prompt_safety", "prompt_other", "prompt_blocklist", "prompt_prohibited_content",
    "prompt_image_safety", "prompt_model_armor", "prompt_jailbreak",
})
#: The stop reasons (as servers say them) of a reply that was cut off, not finished.
#: An answer the model refused to give (Anthropic's ``refusal``) is cut off too.
CUT_OFF_REASONS = (
    frozenset({"length", "max_tokens", "content_filter", "refusal"}) | SAFETY_STOP_REASONS
)

_Output = TypeVar("_Output", covariant=True)


@quick_init
@dataclass(frozen=True, slots=True)
class RunStarted:
    source: str
    task: str | None
    """The user message this run added, or None for a resume."""
    path: tuple[str, ...] = ()
    type: Literal["run_started"] = field(default="run_started", init=False)


@quick_init
@dataclass(frozen=True, slots=True)
class TextChunk:
    source: str
    text: str
    path: tuple[str, ...] = ()
    type: Literal["text"] = field(default="text", init=False)


@quick_init
@dataclass(frozen=True, slots=True)
class ThinkingChunk:
    source: str
    text: str
    path: tuple[str, ...] = ()
    type: Literal["thinking"] = field(default="thinking", init=False)


@quick_init
@dataclass(frozen=True, slots=True)
class TurnRetried:
    """The model's reply broke off mid-stream (the network, an overloaded server) and
    the turn was asked again; what follows goes on from ``kept``.

    ``mode`` ``"continued"``: the server continues the reply, ``kept`` is its text so far
    and stays. ``"restarted"``: the reply starts again, ``kept`` is ``""``: a reader
    drops the turn's text and thinking it showed since the turn's last tool round (or
    its start) and shows what follows. Either way the turn's text is ``kept`` plus the
    chunks after this event. ``error`` says what broke; ``attempt`` counts the retries.
    """

    source: str
    mode: Literal["continued", "restarted"]
    kept: str
    error: str
    attempt: int = 1
    path: tuple[str, ...] = ()
    type: Literal["turn_retried"] = field(default="turn_retried", init=False)


@quick_init
@dataclass(frozen=True, slots=True)
class ToolCallStarted:
    source: str
    call_id: str
    name: str
    arguments: dict[str, Any]
    path: tuple[str, ...] = ()
    type: Literal["tool_call"] = field(default="tool_call", init=False)


@quick_init
@dataclass(frozen=True, slots=True)
class ToolProgress:
    """A running tool said how far it is (an MCP server's progress notification, or
    ``ToolContext.report_progress``); between its ``ToolCallStarted`` and ``ToolResult``."""

    source: str
    call_id: str
    name: str
    progress: float
    total: float | None = None
    message: str | None = None
    path: tuple[str, ...] = ()
    type: Literal["tool_progress"] = field(default="tool_progress", init=False)


@quick_init
@dataclass(frozen=True, slots=True)
class ToolResult:
    source: str
    call_id: str
    name: str
    content: str
    is_error: bool
    path: tuple[str, ...] = ()
    type: Literal["tool_result"] = field(default="tool_result", init=False)


@quick_init
@dataclass(frozen=True, slots=True)
class StepFinished:
    source: str
    step: int
    """Model turns made so far in this conversation's current task."""
    path: tuple[str, ...] = ()
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
    requests: int = 0
    """Model requests this run made (retries not counted)."""
    retries: int = 0
    """Model requests retried after a failure: before any byte of the reply, or after
    its stream broke (a ``TurnRetried``)."""
    duration: float = 0.0
    """Seconds the run took (monotonic clock)."""
    path: tuple[str, ...] = ()
    type: Literal["run_finished"] = field(default="run_finished", init=False)


@dataclass(frozen=True, slots=True)
class RunResult(Generic[_Output]):
    """What one run of an agent or workflow did, however it ended (``agent.last_run``).

    Set when the run ends, before its :class:`RunFinished` is emitted, on every outcome:
    a run that raised (failed, cancelled) has its result too, then the error propagates.
    The authoritative shape of a run's result (:class:`RunFinished` is it as an event;
    see :mod:`aimu.aio.status` for the record and the live view).
    """

    source: str
    status: RunStatus
    output: _Output | None
    """What ``run()`` returned (the text, or an ``output_type`` value); None when it
    raised."""
    reply: str
    """The text of the answer (``RunFinished.reply``), or the partial text a stop cut."""
    stop_reason: str | None
    """Why the model stopped its last turn, as its server said ("stop", "length"...)."""
    usage: Usage
    """Tokens this run used (a resume counts its own)."""
    requests: int
    """Model requests this run made, retries not counted."""
    retries: int
    """Requests retried after a failure: before any byte of the reply (a 503, a reset)
    or after the reply's stream broke off (see :class:`TurnRetried`)."""
    duration: float
    """Seconds from start to end, on the monotonic clock."""
    started_at: float
    ended_at: float
    """Wall-clock start and end, ``time.time()`` seconds."""
    messages: list[Message]
    """What this run added to the transcript, in order; for a workflow, what the agents
    inside added, run after run. The transcript's own dicts, not copies (a recorded
    message never changes): copy one before changing it."""
    error: str | None = None
    """The error that ended a failed or cancelled run, as ``"Type: message"``."""
    run_id: str | None = None
    """The ``run_id`` of the registered :class:`~aimu.aio.RunHandle` it ran in, if any."""
    spend: Spend | None = None
    """What the run spent (an agent's: a :class:`~aimu.aio.Spend` with requests, tool
    calls, tokens, cost and seconds); None for a workflow."""
    usage_estimated: bool = False
    """True when part of ``usage`` was estimated from streamed text: a stream that was
    cut (a stop, a limit) gets no usage from its server."""
    limit: str | None = None
    """What the usage limit that stopped a ``limited`` run was, in words."""
    continuation: Literal["continued", "re-asked"] | None = None
    """How a resume took up an answer a stop had cut short: ``continued`` (the model went
    on from the cut; one assistant message holds both parts) or ``re-asked`` (the server
    cannot continue, or ``continue_partial`` was not asked: the model answered anew)."""

    @property
    def cut_off(self) -> bool:
        """True when the model's last reply was cut off (``stop_reason`` length, a filter)."""
        return self.stop_reason in CUT_OFF_REASONS


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
    | TurnRetried
    | ToolCallStarted
    | ToolProgress
    | ToolResult
    | StepFinished
    | RunFinished
    | HandleFinished
    | ModelRetry
)

