"""A run's state: what the loop, its steps and the settling share while it is in flight.

Each step leaves its outcome in ``run.next`` (:data:`Next`): :class:`NeedsModel` (a model
turn comes next), :class:`NeedsTools` (a tool round), or :class:`Ended` (the run has its
outcome). Where the run is in its life is its :class:`Phase`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from aimu.aio._frozen import quick_init
from aimu.aio._run_options import NO_OPTIONS, RunClock, RunOptions, options_in
from aimu.aio._stops import past_deadline
from aimu.aio._tracing import RunSpans
from aimu.aio.client import TurnAssembler
from aimu.aio.ends import INTERRUPTED, LIMITED, Halt, error_text, stopped_status
from aimu.aio.errors import StoreError
from aimu.aio.events import CUT_OFF_REASONS, Event, RunStatus
from aimu.aio.guardrails import InputGuard, Tripped
from aimu.aio.limits import Budget, LimitHit, estimate_tokens, transcript_chars
from aimu.aio.scope import RunScope
from aimu.aio.tools import ToolContext, ToolOutcome
from aimu.aio.transcript import AssistantMessage, Message, ToolCall, Usage, add_usage, zero_usage

from .wall import WallTimer

__all__ = [
    "FINAL_TURN_PROMPT", "NEEDS_MODEL", "Ended", "Held", "NeedsModel", "NeedsTools", "Next",
    "Phase", "RunState", "TurnInFlight",
]

#: The user message that opens the last turn once ``max_rounds`` model turns were made.
FINAL_TURN_PROMPT = (
    "You have used every tool round allowed for this task. Answer now with your best "
    "final answer, without calling any tool."
)


class Phase(Enum):
    """Where a run is in its life. The settling reads it: an ``OPENING`` run has nothing
    of its own to settle; an ``INSTRUCTING`` one failed in its ``system=`` function
    before it changed anything (the session's stored status stays as it was)."""

    #: The session being put in order for the run (store opened, task recorded).
    OPENING = "opening"
    #: The agent's ``system=`` function is being evaluated for the run.
    INSTRUCTING = "instructing"
    #: The run is taking steps.
    RUNNING = "running"
    #: The consumer closed the event stream; the step in flight is being closed.
    CLOSING = "closing"
    #: The run's record and result are made: nothing more is recorded.
    SETTLED = "settled"


@dataclass(frozen=True, slots=True)
class NeedsModel:
    """A step's outcome: a model turn comes next (the run's first, or after a tool
    round, a correction, or text sent to the run)."""


#: The one NeedsModel (it holds nothing).
NEEDS_MODEL = NeedsModel()


@dataclass(slots=True)
class NeedsTools:
    """A step's outcome: the model called tools, so a tool round comes next. ``reruns``:
    the ids of calls a crash left in doubt that this round runs again; ``argument_errors``:
    by call id, the calls whose arguments did not parse (answered with the error)."""

    calls: list[ToolCall]
    reruns: frozenset[str] = frozenset()
    argument_errors: Mapping[str, str] = field(default_factory=dict)


@quick_init
@dataclass(frozen=True, slots=True)
class Ended:
    """A step's outcome: the run ends with ``status`` (completed, incomplete,
    max_rounds, interrupted, paused or limited) and ``reply``."""

    status: RunStatus
    reply: str


@dataclass(frozen=True, slots=True)
class Held(ToolOutcome):
    """A tool call's outcome: the agent it called (``agent.as_tool()``) paused, so there is
    no result yet; the calling run pauses, and its resume runs the call again, which
    continues the agent (see :mod:`.tree`)."""


#: What a step decided comes next: a model turn, a tool round, or the end.
Next = NeedsModel | NeedsTools | Ended


@dataclass(slots=True)
class TurnInFlight:
    """The model turn in flight: what has streamed, where its request's messages end (to
    estimate a cut turn's usage), whether it is the last turn ``max_rounds`` allows, the
    cut answer it continues (sent as the assistant's prefix), whether its request asked
    for the output schema, and the argument errors of its calls by id. ``counted``: the
    tokens its request was counted for before it was sent (an estimate that the usage,
    or a cut turn's estimate, replaces)."""

    assembler: TurnAssembler
    request_end: int
    final_turn: bool = False
    prefix: AssistantMessage | None = None
    schema_asked: bool = False
    argument_errors: dict[str, str] = field(default_factory=dict)
    counted: Usage | None = None


class RunState:
    """One run in flight: its scope, progress, and what the settling ``finally`` needs."""

    __slots__ = (
        "budget", "calls_in_flight", "clock", "continuation", "cut_answer", "deps", "error",
        "final_prompted", "first", "guard", "held", "limit", "next", "options", "output",
        "output_failures", "phase", "reply", "requests", "rounds", "scope", "spans", "status",
        "stop_reason", "store_error", "turn", "usage", "usage_estimated", "wall",
    )

    def __init__(
        self,
        scope: RunScope,
        spans: RunSpans,
        messages: list[Message],
        options: RunOptions,
    ) -> None:
        self.scope = scope
        #: The call's options, or those of a workflow run around it.
        self.options = options if options is not NO_OPTIONS else options_in(scope.parent)
        #: Set when the run opens: its budget, and the deps its tools see.
        self.budget: Budget | None = None
        self.deps: object = None
        #: With a ``wall`` limit, the event loop's time when it is reached (else None).
        self.wall: WallTimer | None = None
        #: The limit that stopped the run, if one did.
        self.limit: LimitHit | None = None
        #: The answer a stop cut short that this resume found last in the transcript.
        self.cut_answer: AssistantMessage | None = None
        #: How the cut answer was taken up: "continued" (sent as the assistant's prefix)
        #: or "re-asked" (left out of the request: the model answers anew).
        self.continuation: Literal["continued", "re-asked"] | None = None
        #: Some of ``usage`` was estimated from streamed text (a cut stream reports none).
        self.usage_estimated = False
        #: Where the run is in its life.
        self.phase = Phase.OPENING
        #: The run's OpenTelemetry spans (no-ops unless a tracer provider is set).
        self.spans = spans
        self.clock = RunClock()
        #: Where this run's messages start in the transcript: the run's result reports
        #: what came after.
        self.first = len(messages)
        self.requests = 0
        #: What the last step decided comes next (see Next).
        self.next: Next = NEEDS_MODEL
        self.status: RunStatus = "failed"
        self.reply = ""
        self.error: str | None = None
        self.stop_reason: str | None = None
        self.rounds = 0
        #: Answers that failed the agent's output_type in this run (corrections sent).
        self.output_failures = 0
        #: The answer parsed as the agent's output_type, once one passed.
        self.output: object = None
        #: The final-turn prompt is in the transcript for this task (after max_rounds).
        self.final_prompted = False
        #: The model turn in flight (None between turns).
        self.turn: TurnInFlight | None = None
        #: The contexts of the tool calls running now: those a stop leaves running are
        #: marked cancelled as the run settles (a finished call's context is let go).
        self.calls_in_flight: set[ToolContext] = set()
        #: Calls of agents called as tools that paused: open until a resume runs them.
        self.held: list[ToolCall] = []
        self.usage: Usage = zero_usage()
        #: A store write that failed while the run settled; the run then ends ``failed``.
        self.store_error: StoreError | None = None
        #: The input guardrails beside the first turn, while they may still decide.
        self.guard: InputGuard | None = None

    def publish(self, event: Event) -> Event:
        """Send ``event`` to the scope's listeners; return it for the consumer."""
        self.scope.emit(event)
        return event

    def interrupt_asked(self) -> bool:
        return self.scope.interrupt_requested

    def end(self, status: RunStatus, reply: str) -> None:
        """The run's outcome is known: it ends with ``status`` and ``reply``."""
        if status == "completed" and self.stop_reason in CUT_OFF_REASONS:
            status = "incomplete"  # an answer, but cut off: never a plain completed
        self.next = Ended(status, reply)
        self.status, self.reply = status, reply

    def limited(self, hit: LimitHit) -> None:
        """A usage limit stops the run: it ends ``limited``, naming the limit."""
        self.end("limited", self.reply or LIMITED)
        self.limit, self.stop_reason = hit, hit.stop_reason
        self.scope.note_halt(Halt("limited", hit.stop_reason))

    def blocked(self, tripped: Tripped) -> None:
        """A guardrail's tripwire ends the run ``blocked``, naming it and why."""
        self.end("blocked", tripped.reply)
        self.stop_reason = tripped.stop_reason
        self.scope.note_halt(Halt("blocked", tripped.stop_reason, tripped.reply))

    def interrupted(self) -> None:
        """The interrupt is honoured: the run returns INTERRUPTED."""
        self.end("interrupted", INTERRUPTED)
        self.scope.note_interrupted()

    def stopped_by(self, error: BaseException) -> None:
        """The run ends by ``error`` (GeneratorExit: the consumer closed the stream; a
        cancel by the deadline of a handle around: timed_out)."""
        self.status = stopped_status(
            error, not isinstance(error, Exception) and past_deadline(self.scope)
        )
        if not isinstance(error, GeneratorExit):
            self.error = error_text(error)

    def count_estimated(self, messages: list[Message], inflight: TurnInFlight) -> None:
        """Count a cut turn's usage, which no server reports: its request's and its
        streamed text's size, estimated (so stopping a reply never escapes a budget)."""
        assembler = inflight.assembler
        sent = estimate_tokens(transcript_chars(messages[: inflight.request_end], 0))
        streamed = len(assembler.text) + sum(len(t) for t in assembler.thinking_parts)
        usage: Usage = {"input_tokens": sent, "output_tokens": estimate_tokens(streamed)}
        add_usage(self.usage, usage)
        self.usage_estimated = True
        if self.budget is not None:
            self.budget.count_tokens(usage, estimated=True, less=inflight.counted)

    def count_unanswered(self, inflight: TurnInFlight) -> None:
        """A request that no byte of a reply answered: its tokens counted up front are
        taken back (the request itself stays counted)."""
        if self.budget is not None and inflight.counted is not None:
            self.budget.count_tokens(zero_usage(), estimated=False, less=inflight.counted)
