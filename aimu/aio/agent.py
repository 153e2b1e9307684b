"""The agent: a tool loop whose transcript survives any stop.

One async generator (:meth:`Agent._events`) does the work; ``run()`` drains it and
``run(stream=True)`` hands it out, so both share one code path. It runs named steps,
a model turn (:meth:`Agent._model_turn`) and the tool round it asked for
(:meth:`Agent._tool_round`); each step leaves its outcome, tagged with its data, in
``run.next`` (:data:`Next`: :class:`NeedsTools`, :class:`Ended`, or None for another
model turn), and :meth:`Agent._next_step` matches on it. Every message is
recorded the moment it exists and one ``finally`` settles the run: whatever ends it
(answer, error, cancel, interrupt, a consumer that stops iterating), the transcript in
``agent.model_client.messages`` is valid to send to a model again.

``interrupt()`` stops the run at the next step boundary; ``resume()`` continues where
it stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Mapping,
    Sequence,
)
from contextlib import aclosing
from dataclasses import dataclass, field
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Literal, TypedDict, TypeVar, cast, overload

from typing_extensions import Unpack

from aimu.aio._session import Carried, SessionRecord
from aimu.aio._stops import Stop, past_deadline, stop_of
from aimu.aio._tool_table import ToolTable
from aimu.aio._tracing import RunSpans
from aimu.aio.approvals import (
    PAUSED,
    ApprovalPolicy,
    Approvals,
    Decision,
    PendingApproval,
    denied_result,
)
from aimu.aio.client import (
    Chunk,
    ModelClient,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    TurnAssembler,
    TurnDone,
)
from aimu.aio.context import ContextPolicy, SummarizeOlderTurns, Summary
from aimu.aio.errors import ModelError, ModelProtocolError, StoreError
from aimu.aio.events import (
    CUT_OFF_REASONS,
    Event,
    RunFinished,
    RunResult,
    RunStarted,
    RunStatus,
    StepFinished,
    TextChunk,
    ThinkingChunk,
    ToolCallStarted,
    ToolProgress,
    ToolResult,
)
from aimu.aio.instructions import Instructions, RunContext, check_instructions, instructions_text
from aimu.aio.journal import IN_DOUBT_RESULT, RERUN_NOTE, settle_in_doubt
from aimu.aio.limits import (
    LIMITED,
    Budget,
    LimitHit,
    Spend,
    UsageLimits,
    estimate_tokens,
    transcript_chars,
)
from aimu.aio.output import OutputSpec, check_tool_choice, is_correction, turn_request
from aimu.aio.providers._unicode import clean
from aimu.aio.runnable import (
    NO_DEPS,
    NO_OPTIONS,
    OutputT,
    RunClock,
    Runnable,
    RunOptions,
    load_usage,
    options_in,
)
from aimu.aio.scope import RunScope, current_scope
from aimu.aio.store import validate_session_name
from aimu.aio.tools import Tool, ToolContext, ToolOutcome, Toolset, invoke
from aimu.aio.transcript import (
    CANCELLED_RESULT,
    AssistantMessage,
    Message,
    ToolCall,
    ToolMessage,
    Usage,
    UserMessage,
    add_usage,
    copy_messages,
    dangling_calls,
    settle,
    validate,
    zero_usage,
)

if TYPE_CHECKING:
    from aimu.aio.store import SessionWriter, Store, ToolStart

__all__ = ["FINAL_TURN_PROMPT", "INTERRUPTED", "Agent", "Ended", "NeedsTools", "Next"]

#: What a run returns when ``interrupt()`` stopped it at a step boundary.
INTERRUPTED = "Run interrupted."

#: The user message that opens the last turn once ``max_rounds`` model turns were made.
FINAL_TURN_PROMPT = (
    "You have used every tool round allowed for this task. Answer now with your best "
    "final answer, without calling any tool."
)

#: Requests smaller than this (estimated tokens) fit every model: no need to ask the
#: server for the model's context window until one grows past it.
_ASK_WINDOW_FROM = 1024

_NO_ROUNDS_LEFT = "[not run: no tool rounds were left]"

_T = TypeVar("_T")


class _Options(TypedDict, total=False):
    """The keyword arguments of :class:`Agent` besides ``output_type`` (for its overloads)."""

    system: Instructions | None
    max_rounds: int
    name: str | None
    store: Store | None
    session: str | None
    concurrent_tools: bool
    approve: ApprovalPolicy | None
    output_retries: int
    tool_choice: str | None
    parallel_tool_calls: bool | None
    limits: UsageLimits | None
    session_limits: UsageLimits | None
    deps: object
    context: ContextPolicy | None


@dataclass(frozen=True, slots=True)
class _Config:
    """What every session of one agent shares; never changes after construction."""

    name: str
    #: The system prompt, or a function of the run's context giving it at each run start.
    system: Instructions | None
    max_rounds: int
    concurrent_tools: bool
    #: The tools by name and their specs; a toolset's once it is open (shared by sessions).
    table: ToolTable
    approve: ApprovalPolicy | None
    #: ``output_type=`` (None: the answer is text) and the tool-only request options.
    output: OutputSpec[Any] | None = None
    tool_choice: str | None = None
    parallel_tool_calls: bool | None = None
    #: The budget of each run, and of the session (kept in the store).
    limits: UsageLimits | None = None
    session_limits: UsageLimits | None = None
    #: The app state a run hands its tools as ``ctx.deps`` (never stored or sent).
    deps: object = None
    #: What of the transcript each request sends (None: all of it).
    context: ContextPolicy | None = None


@dataclass(frozen=True, slots=True)
class NeedsTools:
    """A step's outcome: the model called tools, so a tool round comes next. ``reruns``:
    the ids of calls a crash left in doubt that this round runs again; ``argument_errors``:
    by call id, the calls whose arguments did not parse (answered with the error)."""

    calls: list[ToolCall]
    reruns: frozenset[str] = frozenset()
    argument_errors: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _Turn:
    """The model turn in flight: what has streamed, where its request's messages end (to
    estimate a cut turn's usage), the cut answer it continues (sent as the assistant's
    prefix), and the argument errors of its calls by id."""

    assembler: TurnAssembler
    request_end: int
    prefix: AssistantMessage | None = None
    argument_errors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Ended:
    """A step's outcome: the run ends with ``status`` (completed, incomplete,
    max_rounds, interrupted, paused or limited) and ``reply``."""

    status: RunStatus
    reply: str


#: What a step decided comes next: a tool round, the end, or (None) a model turn.
Next = NeedsTools | Ended | None


#: How a run ends when something stopped it mid-step (its open calls get results).
_STOPPED = frozenset({"cancelled", "timed_out", "failed"})


class _Run:
    """One run in flight: its scope, progress, and what the settling ``finally`` needs."""

    __slots__ = (
        "budget", "clock", "closing", "contexts", "continuation", "cut_answer", "deps",
        "error", "final_prompted", "first", "limit", "next", "opened", "options", "output",
        "output_failures", "reply", "requests", "retries_from", "rounds", "scope", "settled",
        "spans", "status", "stop_reason", "store_error", "turn", "untouched", "usage",
        "usage_estimated", "wall",
    )

    def __init__(
        self, scope: RunScope, spans: RunSpans, client: ModelClient, options: RunOptions
    ) -> None:
        self.scope = scope
        #: The call's options, or those of a workflow run around it.
        self.options = options if options is not NO_OPTIONS else options_in(scope.parent)
        #: Set when the run opens: its budget, and the deps its tools see.
        self.budget: Budget | None = None
        self.deps: object = None
        #: With a ``wall`` limit, the event loop's time when it is reached (else None).
        self.wall: _WallTimer | None = None
        #: The limit that stopped the run, if one did.
        self.limit: LimitHit | None = None
        #: The answer a stop cut short that this resume found last in the transcript.
        self.cut_answer: AssistantMessage | None = None
        #: How the cut answer was taken up: "continued" (sent as the assistant's prefix)
        #: or "re-asked" (left out of the request: the model answers anew).
        self.continuation: Literal["continued", "re-asked"] | None = None
        #: Some of ``usage`` was estimated from streamed text (a cut stream reports none).
        self.usage_estimated = False
        #: The run failed before it changed anything (its instructions raised): the
        #: session's stored status stays as it was.
        self.untouched = False
        #: The run's OpenTelemetry spans (no-ops unless a tracer provider is set).
        self.spans = spans
        self.clock = RunClock()
        #: Where this run's messages start in the transcript, and the client's retries
        #: before it: the run's result reports what came after.
        self.first = len(client.messages)
        self.retries_from = client.retry_count
        self.requests = 0
        #: What the last step decided comes next (see Next).
        self.next: Next = None
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
        self.turn: _Turn | None = None
        self.contexts: list[ToolContext] = []
        self.usage: Usage = zero_usage()
        #: The consumer closed the stream (GeneratorExit came in at a yield).
        self.closing = False
        self.settled = False
        #: The session was put in order for this run (until then nothing is its to settle).
        self.opened = False
        #: A store write that failed while the run settled; the run then ends ``failed``.
        self.store_error: StoreError | None = None

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
        self.scope.note_limited(hit.stop_reason)

    def interrupted(self) -> None:
        """The interrupt is honoured: the run returns INTERRUPTED."""
        self.end("interrupted", INTERRUPTED)
        self.scope.note_interrupted()

    def stopped_by(self, error: BaseException) -> None:
        """The run ends by ``error`` (GeneratorExit: the consumer closed the stream; a
        cancel by the deadline of a handle around: timed_out)."""
        self.status = "failed" if isinstance(error, Exception) else "cancelled"
        if self.status == "cancelled" and past_deadline(self.scope):
            self.status = "timed_out"
        if not isinstance(error, GeneratorExit):
            self.error = _describe(error)


class Agent(Runnable[OutputT]):
    """A model client, tools and a system prompt, running a tool loop on one transcript.

    ``agent.start()`` makes another session of the same agent with its own transcript.
    With ``store`` and ``session`` every message is written durably as it is recorded,
    and a new process building the same agent continues from the stored transcript: the
    session is opened (its write lock taken, its transcript loaded) by :meth:`open`,
    ``async with agent``, or the first run. Each tool call's start is journalled first,
    so a call a crash cut is known to be in doubt (see :mod:`aimu.aio.journal`).

    With ``output_type`` (a pydantic model, dataclass, TypedDict, ``list[int]``...) the
    model is asked for JSON of that type and ``run()`` returns it validated; an invalid
    answer goes back to the model with the error, ``output_retries`` times a run (see
    :mod:`aimu.aio.output`). ``tool_choice`` and ``parallel_tool_calls`` go to servers
    that have them, on turns that offer tools.

    ``limits`` (:class:`~aimu.aio.UsageLimits`) bound each run and ``session_limits`` the
    session's total (kept in the store); a run that reaches one ends ``limited``. ``deps``
    is handed to tools as ``ctx.deps`` and never stored. ``system`` may be a function
    (sync or async) of a :class:`~aimu.aio.RunContext`, evaluated at each run's start.
    ``context`` (a policy such as :class:`~aimu.aio.KeepLastTurns`) chooses what of a
    long transcript each request sends; the transcript itself stays whole.
    """

    kind = "agent"

    @overload
    def __init__(
        self: Agent[str],
        client: ModelClient,
        tools: Sequence[Callable[..., Any] | Tool | Toolset | EllipsisType] = (),
        *,
        output_type: None = None,
        **options: Unpack[_Options],
    ) -> None: ...

    @overload
    def __init__(
        self: Agent[_T],
        client: ModelClient,
        tools: Sequence[Callable[..., Any] | Tool | Toolset | EllipsisType] = (),
        *,
        output_type: type[_T],
        **options: Unpack[_Options],
    ) -> None: ...

    @overload
    def __init__(  # a union or other special form: annotate the agent to type it
        self: Agent[Any],
        client: ModelClient,
        tools: Sequence[Callable[..., Any] | Tool | Toolset | EllipsisType] = (),
        *,
        output_type: object,
        **options: Unpack[_Options],
    ) -> None: ...

    def __init__(
        self,
        client: ModelClient,
        tools: Sequence[Callable[..., Any] | Tool | Toolset | EllipsisType] = (),
        *,
        system: Instructions | None = None,
        max_rounds: int = 10,
        name: str | None = None,
        store: Store | None = None,
        session: str | None = None,
        concurrent_tools: bool = False,
        approve: ApprovalPolicy | None = None,
        output_type: object = None,
        output_retries: int = 2,
        tool_choice: str | None = None,
        parallel_tool_calls: bool | None = None,
        limits: UsageLimits | None = None,
        session_limits: UsageLimits | None = None,
        deps: object = None,
        context: ContextPolicy | None = None,
    ) -> None:
        if not isinstance(client, ModelClient):
            raise TypeError(
                "Agent needs a model client such as aio.client('test'), "
                f"got {type(client).__name__}"
            )
        if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
            raise ValueError(f"max_rounds must be a positive int, got {max_rounds!r}")
        check_instructions(system)
        for label, given in (("limits", limits), ("session_limits", session_limits)):
            if given is not None and not isinstance(given, UsageLimits):
                raise TypeError(
                    f"{label} must be aio.UsageLimits or None, got {type(given).__name__}"
                )
            if given is not None:
                given.price_of(client.model)  # a cost limit needs this model's price
        if context is not None and not isinstance(context, ContextPolicy):
            raise TypeError(
                "context must be a context policy (aio.KeepLastTurns(n), or an object with "
                f"view(messages)), got {type(context).__name__}"
            )
        if (store is None) != (session is None):
            raise ValueError("store and session go together: give both, or neither")
        table = ToolTable(tools)
        if not table.toolsets:  # a toolset's names are known once it is open
            check_tool_choice(tool_choice, list(table.by_name))
        config = _Config(
            name=name or "agent",
            system=system,
            max_rounds=max_rounds,
            concurrent_tools=concurrent_tools,
            table=table,
            approve=approve,
            output=None if output_type is None else OutputSpec(output_type, output_retries),
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            limits=limits,
            session_limits=session_limits,
            deps=deps,
            context=context,
        )
        self._setup(config, client, store, session, owns_client=True)

    def _setup(
        self,
        config: _Config,
        client: ModelClient,
        store: Store | None,
        session: str | None,
        *,
        owns_client: bool,
    ) -> None:
        self._config = config
        self.model_client = client
        self._owns_client = owns_client
        self._store = store
        self._session = session
        #: The store session and the state kept beside the transcript (see _session.py).
        self._durable = SessionRecord(store, session)
        #: Ids of the in-doubt calls of idempotent tools found on load: resume() runs
        #: them again (their results start with RERUN_NOTE).
        self._reruns: set[str] = set()
        self._scope: RunScope | None = None
        self._approvals = Approvals()
        #: Memory holds the session: no store, or its session loaded (open()) or replaced
        #: (restore()). Until then the transcript and approvals are not known.
        self._loaded = store is None
        self._usage = zero_usage()
        self._system_text: str | None = (
            config.system if isinstance(config.system, str) else None
        )
        #: (messages, tokens): the transcript's length after the last finished turn and
        #: the tokens the server counted for it, so a request's size is estimated from
        #: what was added since.
        self._known = (0, 0)
        self.last_status: RunStatus | None = None
        self.last_run: RunResult[OutputT] | None = None
        if session is not None:
            validate_session_name(session)
        self._place_system()

    # -- configuration -------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._config.name

    @property
    def system(self) -> str | None:
        """The system prompt: the text given, or the one a ``system=`` function gave
        for the last run (None before its first)."""
        return self._system_text

    @property
    def limits(self) -> UsageLimits | None:
        """The budget of each run (``limits=``), and of the session in all
        (:attr:`session_limits`)."""
        return self._config.limits

    @property
    def session_limits(self) -> UsageLimits | None:
        return self._config.session_limits

    @property
    def spend(self) -> Spend:
        """What this session spent in all (requests, tool calls, tokens, cost, seconds),
        as its store keeps it across processes. A copy."""
        copy = Spend()
        copy.add(self._durable.spend)
        return copy

    @property
    def max_rounds(self) -> int:
        return self._config.max_rounds

    @property
    def tools(self) -> tuple[Tool, ...]:
        """The tools offered to the model (a toolset's once the agent opened it)."""
        return self._config.table.tools

    @property
    def session(self) -> str | None:
        """The store session this agent writes to, if any."""
        return self._session

    @property
    def usage(self) -> Usage:
        """Tokens used by this session's runs so far, resumes included."""
        return {"input_tokens": self._usage["input_tokens"],
                "output_tokens": self._usage["output_tokens"]}

    @property
    def resumable(self) -> bool:
        return any(m["role"] == "user" for m in self.model_client.messages)

    def _check_resumable(self) -> None:
        if self._store is not None and self._durable.writer is None:
            return  # checked once the run has loaded the stored session
        self._require_task()

    def _require_task(self) -> None:
        if not self.resumable:
            raise ValueError("nothing to resume: the transcript has no task yet; use run(task)")
        self._approvals.check_decided(f"agent {self.name!r}")

    # -- approvals -------------------------------------------------------------------

    @property
    def pending_approvals(self) -> list[PendingApproval]:
        """The tool calls the paused run waits on (call id, tool, arguments).

        With a store, ``RuntimeError`` until the session is opened: they are not known."""
        self._check_loaded("pending_approvals")
        return self._approvals.waiting()

    @property
    def messages(self) -> list[Message]:
        """This session's transcript (``model_client.messages``, the same list).

        With a store, ``RuntimeError`` until the session is opened: an unopened session
        is not empty, its transcript is not loaded yet."""
        self._check_loaded("messages")
        return self.model_client.messages

    def _check_loaded(self, what: str) -> None:
        if not self._loaded:
            raise RuntimeError(
                f"agent {self.name!r}: session {self._session!r} is not open, so its {what} "
                "are not loaded yet: await agent.open() (or use `async with agent`) first"
            )

    def _check_new_task(self) -> None:
        # Before the session is loaded its approvals are unknown: opening it checks them.
        if self._loaded:
            super()._check_new_task()

    def approve(self, call_id: str) -> None:
        """Let the waiting call ``call_id`` run when the run resumes."""
        self._decide(call_id, Decision(True))

    def deny(self, call_id: str, reason: str | None = None) -> None:
        """Refuse the waiting call ``call_id``: on resume the model reads that it was
        denied, and ``reason``."""
        self._decide(call_id, Decision(False, reason))

    def _decide(self, call_id: str, decision: Decision) -> None:
        self._check_loaded("pending approvals")
        if self.running:
            raise RuntimeError(
                f"agent {self.name!r}: cannot decide on call {call_id!r:.80} while a run is "
                "in progress; decide once it has paused"
            )
        self._approvals.decide(call_id, decision, f"agent {self.name!r}")
        self._durable.state_stale = True

    async def _save_state(self) -> None:
        await self._durable.save_state(self._approvals)

    def start(self, *, session: str | None = None) -> Agent[OutputT]:
        """A new session of this agent: same model settings, tools and limits.

        It has its own transcript and interrupt state, so many conversations can run
        concurrently. With ``session=`` it persists to this agent's store under that name.
        """
        if session is not None and self._store is None:
            raise ValueError("start(session=...) needs an agent built with a store")
        fresh: Agent[OutputT] = Agent.__new__(Agent)
        fresh._setup(
            self._config,
            self.model_client.fork(),
            self._store if session is not None else None,
            session,
            owns_client=False,
        )
        return fresh

    def __repr__(self) -> str:
        state = "running" if self.running else "idle"
        return (
            f"<Agent {self.name!r} {state} messages={len(self.model_client.messages)} "
            f"tools={[t.name for t in self.tools]}>"
        )

    async def open(self) -> None:
        """Open the store session now: take its write lock and load its transcript.

        ``SessionLockedError`` if another writer holds it. The first run does this
        itself; without a store this does nothing. Idempotent.
        """
        if self._store is None or self._session is None or self._durable.writer is not None:
            return
        await self._config.table.ready()  # a loaded call in doubt needs its tool's flags
        writer = self._durable.writer = await self._store.open_session(self._session)
        try:
            await self._load_stored(writer)
        except BaseException:
            self._durable.writer = None
            await writer.aclose()
            raise

    async def aclose(self) -> None:
        """Release the store session and, for the agent that was given it, the client.

        A transcript given to :meth:`restore` since the last run is stored first, and
        approval decisions given since (so they survive a restart before ``resume()``).
        """
        try:
            await self._durable.close(self.model_client.messages, self._approvals)
        finally:
            if self._owns_client:
                try:
                    await self._config.table.aclose()
                finally:
                    await self.model_client.aclose()

    async def __aenter__(self) -> Agent[OutputT]:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- transcript ----------------------------------------------------------------

    async def _record(self, message: Message) -> None:
        await self._durable.record(self.model_client.messages, message)

    def _place_system(self) -> None:
        """Keep the system prompt present exactly once, first."""
        system = self._system_text
        messages = self.model_client.messages
        if system is None:
            return
        if messages and messages[0]["role"] == "system":
            if messages[0]["content"] == system:
                return
            messages[0] = {"role": "system", "content": system}
        else:
            messages.insert(0, {"role": "system", "content": system})
        if self._durable.writer is not None:
            self._durable.transcript_stale = True

    async def _load_stored(self, writer: SessionWriter) -> None:
        """Take the stored transcript into memory (a restore() before this one wins)."""
        messages = self.model_client.messages
        stored = [] if self._durable.transcript_stale else await writer.load()
        if stored:
            validate(stored)
            settled = copy_messages(stored)
            assert self._store is not None and self._session is not None
            state = await self._store.load_state(self._session)
            approvals = Approvals.from_state(state, f"session {self._session!r}")
            starts = await self._store.tool_starts(self._session)
            self._durable.transcript_stale = self._settle_loaded(settled, approvals, starts)
            self._approvals = approvals
            self._durable.load_state(state, settled)
            messages[:] = settled
        elif messages:
            validate(messages)
            self._durable.transcript_stale = True
        self._place_system()
        await self._durable.sync(messages)
        if self._durable.state_stale:
            await self._save_state()
        self._loaded = True

    def restore(self, messages: Sequence[Message]) -> Awaitable[None]:
        """Load ``messages`` as this session's transcript, validating them first.

        An invalid transcript raises ``ValueError`` naming the bad message and changes
        nothing. Messages are copied in; dangling tool calls get "cancelled" results;
        this agent's system prompt is kept. With a store, ``await agent.restore(...)``:
        it opens the session and returns once the transcript is stored (durable).
        """
        if self.running:
            raise RuntimeError("cannot restore() while a run is in progress on this session")
        self._restore(messages, Approvals())
        if self._store is None:
            return _DONE
        return self._store_restored()

    async def _store_restored(self) -> None:
        """Write what restore() put in memory to the store (the session opened first)."""
        if self._durable.writer is None:
            await self.open()  # memory is stale, so opening writes it instead of loading
        if self._durable.writer is not None:
            await self._durable.sync(self.model_client.messages)
            if self._durable.state_stale:
                await self._save_state()

    def _restore(self, messages: Sequence[Message], approvals: Approvals) -> None:
        validate(messages)
        restored = copy_messages(messages)
        self._settle_loaded(restored, approvals, ())
        self._approvals = approvals
        self._known = (0, 0)
        system = self._system_text
        if system is not None and restored and restored[0]["role"] == "system":
            restored[0] = {"role": "system", "content": system}
        elif system is not None:
            restored.insert(0, {"role": "system", "content": system})
        self.model_client.messages[:] = restored
        self._durable.forget()  # what the state said of the transcript replaced goes
        self._loaded = True

    def _settle_loaded(
        self, messages: list[Message], approvals: Approvals, starts: Sequence[ToolStart]
    ) -> bool:
        """Answer the dangling calls of a loaded transcript, the tool journal ``starts``
        deciding which were in doubt (see :mod:`aimu.aio.journal`); True if any was
        answered. Calls waiting for a person stay open, and so do in-doubt calls of
        idempotent tools (resume runs them again) and of approval tools (a person
        decides: they join the waiting calls)."""
        approvals.keep_only({call["id"]: call for _, call in dangling_calls(messages)})
        # An approved call the journal saw start was running when the process stopped:
        # its approval is spent, and it is in doubt like any other.
        journaled = {start.call_id for start in starts}
        approved = {
            call_id for call_id, decision in approvals.decisions.items()
            if decision.approved and call_id in journaled
        }
        before = len(messages)
        found = settle_in_doubt(
            messages, starts, self._config.table.by_name, approvals.pending, approved
        )
        found.log(f"{self.kind} {self.name!r}, session {self._session!r}")
        for call_id in approved:
            approvals.take(call_id)
        for call in found.asked:
            approvals.ask(call, in_doubt=True)
        self._durable.state_stale = self._durable.state_stale or bool(approved)
        self._reruns = {call["id"] for call in found.rerun}
        return len(messages) != before

    # -- progress, for workflows ---------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """This session's transcript and token usage as plain JSON data (copies)."""
        snapshot = {
            "messages": copy_messages(self.model_client.messages),
            "usage": self.usage,
            **self._approvals.state(),
        }
        if self._durable.carried.messages:  # text sent to a paused run: it joins the resumed one
            snapshot["sent"] = self._durable.carried.dump()
        return snapshot

    def blank_snapshot(self) -> dict[str, Any]:
        return {"messages": [], "usage": zero_usage(), **Approvals().state()}

    def session_from(self, snapshot: Mapping[str, Any]) -> Agent[OutputT] | None:
        """A new session holding ``snapshot``; None when it holds no transcript."""
        messages = snapshot.get("messages") or []
        if not messages:
            return None
        session = self.start()
        approvals = Approvals.from_state(snapshot, "the snapshot")
        session._restore(cast(list[Message], messages), approvals)
        session._durable.carried = Carried.load(snapshot.get("sent"), messages, "the snapshot")
        session._usage = load_usage(snapshot.get("usage"), "the snapshot")
        return session

    # -- the run ---------------------------------------------------------------------

    async def _reply(
        self, task: str | None, reset: bool, options: RunOptions = NO_OPTIONS
    ) -> OutputT:
        """The answer: its text, or with ``output_type`` the validated value (NoOutputError
        when the run ended without one: interrupted, paused, limited)."""
        final = await self._finish(task, reset, options)
        output = self._config.output
        return cast(OutputT, final.reply if output is None else output.result(final))

    def _check_limits(self, limits: UsageLimits) -> None:
        limits.price_of(self.model_client.model)  # a cost limit needs this model's price

    async def _events(
        self, task: str | None, reset: bool, options: RunOptions = NO_OPTIONS
    ) -> AsyncGenerator[Event, None]:
        client = self.model_client
        scope = self._open_scope(options)
        spans = RunSpans(self.name, client.model, client.provider)
        run = _Run(scope, spans, client, options)
        failure: BaseException | None = None
        stopped_by: BaseException | None = None
        try:
            await self._open(run, task, reset)
            run.opened = True
            yield run.publish(RunStarted(self.name, task))
            await self._pick_up(run, task)
            while (step := await self._next_step(run)) is not None:
                async with aclosing(step):
                    async for event in step:
                        try:
                            yield run.publish(event)
                        except GeneratorExit:
                            run.closing = True  # closing the step awaits: a cancel may come
                            raise
        except BaseException as error:
            run.stopped_by(error)
            stopped_by = error
            if isinstance(error, GeneratorExit) or run.closing:
                raise  # the consumer stopped iterating: settle below, never yield again
            failure = error
        finally:
            final = await self._settle(run)
            stop = self._stop(run, final, stopped_by or run.store_error)
            run.spans.finished(final, stop.status, stop.reason)
            stop.log(self.name)
        if failure is None:
            failure = run.store_error
        if failure is None:
            yield final
            return
        # Deliver the terminal event, then the exception, whatever the consumer does next.
        try:
            yield final
        except GeneratorExit:
            raise failure from None
        raise failure

    async def _open(self, run: _Run, task: str | None, reset: bool) -> None:
        """Put the session in order for a run: the store opened, the instructions
        evaluated (a raising ``system=`` function fails the run here, nothing stored),
        reset, system prompt, the task recorded (the first of the run's messages)."""
        config, options = self._config, run.options
        run.deps = config.deps if options.deps is NO_DEPS else options.deps
        await config.table.ready()
        await self.open()
        if config.system is not None and not isinstance(config.system, str):
            context = RunContext(self.name, self._session, task, run.deps)
            run.untouched = True
            self._system_text = await instructions_text(config.system, context, self.name)
            run.untouched = False
        # A workflow's limits bound all its agent runs together (shared), not each one.
        shared = options_in(run.scope.parent).shared
        own = options.limits if options.shared is None else None
        run.budget = budget = Budget(
            config.limits if own is None else own, config.session_limits, self._durable.spend,
            self.model_client.model, shared,
        )
        if budget.wall_at is not None:  # one timer for the run, armed now
            loop = asyncio.get_running_loop()
            run.wall = _WallTimer(loop.time() + budget.wall_at - time.monotonic())
        if reset:
            self.model_client.messages.clear()
            self._reruns = set()
            self._approvals.clear()
            self._durable.forget()
        self._place_system()
        if self._durable.writer is not None:
            await self._durable.sync(self.model_client.messages)
            if self._durable.state_stale:
                await self._save_state()
        run.first = len(self.model_client.messages)
        if task is None:
            self._require_task()
        else:
            await self._drop_undone_calls()
            message: UserMessage = {"role": "user", "content": task}
            if run.options.images:
                message["images"] = list(run.options.images)
            await self._record(message)
        if self._durable.writer is not None:
            await self._durable.writer.set_status("in_progress")

    async def _drop_undone_calls(self) -> None:
        """A new task instead of resume(): calls still open are not run; they get
        "cancelled" results (or, in doubt after a crash, IN_DOUBT_RESULT)."""
        self._approvals.check_decided(f"agent {self.name!r}")
        for result in self._close_open_calls():
            if self._durable.writer is not None:
                await self._durable.writer.append(result)
        if self._approvals.pending:
            self._approvals.clear()
            await self._save_state()

    async def _pick_up(self, run: _Run, task: str | None) -> None:
        """Where the run starts: the rounds the task has used, the calls a pause or a
        crash left open (resume runs them), or a resumed answer: cut off if it was, and
        corrected first if it is not a valid typed answer."""
        run.rounds, run.final_prompted = self._rounds_used()
        if task is None:
            open_calls = [call for _, call in dangling_calls(self.model_client.messages)]
            if open_calls:
                run.next = NeedsTools(open_calls, frozenset(self._reruns))
                self._reruns = set()
                return
            answer = self._finished_answer()
            if answer is not None:
                run.stop_reason = answer.get("aimu_stop_reason")
                # A fresh run: a correction here costs none of its output retries.
                if await self._output_checked(run, answer["content"], schema_asked=False):
                    run.end("completed", answer["content"])
                return
            last = self.model_client.messages[-1] if self.model_client.messages else None
            if last is not None and last["role"] == "assistant" and last.get("aimu_partial"):
                run.cut_answer = last

    async def _next_step(self, run: _Run) -> AsyncGenerator[Event, None] | None:
        """The step to run next, or None once the run has its outcome. Text sent to the
        run joins it here, at the boundary, even after an answer; a usage limit the
        step would cross stops the run here."""
        budget = run.budget
        assert budget is not None
        match run.next:
            case NeedsTools(calls) as tools:
                hit = budget.before_tools(len(calls)) if budget.limited else None
                if hit is not None:
                    run.limited(hit)  # the calls stay open: resume() runs them
                    return None
                return self._tool_round(run, tools)
            case Ended("completed" | "incomplete") if await self._join_sent(run):
                run.next = None  # text sent as the answer came: the run goes on with it
            case Ended():
                return None
        await self._join_sent(run)
        if run.interrupt_asked():  # the step boundary
            run.interrupted()
            return None
        hit = budget.before_request() if budget.limited else None
        if hit is None and (self.model_client.context_window is not None
                            or self.model_client.discovers_context_window):
            hit = await self._context_hit()
        if hit is not None:
            run.limited(hit)
            return None
        return self._model_turn(run)

    def _taken_up(self, run: _Run, inflight: _Turn) -> list[Message]:
        """The messages this turn sends: with an answer a stop cut short last, either all
        of them (``resume(continue_partial=True)`` on a server that continues a trailing
        assistant message: the model goes on from the cut) or all but that answer (the
        model answers anew). Sets the turn's prefix and ``run.continuation``."""
        messages = self.model_client.messages
        cut, run.cut_answer = run.cut_answer, None
        if cut is None or not messages or messages[-1] is not cut:
            return messages
        if run.options.continue_partial and self.model_client.continues_partial:
            inflight.prefix, run.continuation = cut, "continued"
            return messages
        run.continuation = "re-asked"
        return messages[:-1]

    async def _keep(
        self, prefix: AssistantMessage | None, message: AssistantMessage
    ) -> AssistantMessage:
        """Record a turn's message; a continuation (of ``prefix``) replaces the answer it
        continued, joined to it (one assistant message). Returns the message as recorded."""
        if prefix is None:
            await self._record(message)
            return message
        joined = _joined(prefix, message)
        messages = self.model_client.messages
        messages[-1] = joined
        if self._durable.writer is not None:
            self._durable.transcript_stale = True  # the stored answer replaced: rewrite it
            await self._durable.sync(messages)
        return joined

    async def _context_hit(self) -> LimitHit | None:
        """The model's context window, if the next request would not fit it. A server
        that can say the window is asked once a request grows past _ASK_WINDOW_FROM."""
        client = self.model_client
        policy = self._config.context
        needed = (
            self._prompt_tokens() if policy is None
            else estimate_tokens(transcript_chars(self._policy_view(policy), 0))
        )
        window = client.context_window
        if window is None and needed > _ASK_WINDOW_FROM:
            window = await client.discover_context_window()
        if window is None:
            return None
        return LimitHit("context_window", window, needed) if needed > window else None

    def _policy_view(self, policy: ContextPolicy) -> Sequence[Message]:
        """What the context policy will send next (a summary due counted as the old one)."""
        messages = self.model_client.messages
        if not isinstance(policy, SummarizeOlderTurns):
            return policy.view(messages)
        summary, due = self._durable.summary, policy.due(messages, self._durable.summary)
        if due is not None:
            summary = Summary(due[0], "" if summary is None else summary.text)
        return policy.view_with(messages, summary)

    def _prompt_tokens(self) -> int:
        """The next request's size in tokens: what the server counted for the last turn,
        and an estimate of what was added since."""
        messages = self.model_client.messages
        count, tokens = self._known
        if count > len(messages):
            count, tokens = 0, 0
        return tokens + estimate_tokens(transcript_chars(messages, count))

    async def _model_turn(self, run: _Run) -> AsyncGenerator[Event, None]:
        """One model turn, streamed; it ends recorded, with ``run.next`` set."""
        config = self._config
        final_turn = run.rounds >= config.max_rounds
        if final_turn and not run.final_prompted:
            await self._record({"role": "user", "content": FINAL_TURN_PROMPT})
            run.final_prompted = True
        client = self.model_client
        budget = run.budget
        assert budget is not None
        if isinstance(config.context, SummarizeOlderTurns):
            try:  # first, if one is due: a request of its own, before this turn's
                await self._summarize(run, config.context)
            except _WallReached:
                run.limited(budget.wall_hit())
                return
        assembler = TurnAssembler()
        inflight = run.turn = _Turn(assembler, len(client.messages))
        run.requests += 1
        budget.count_request()
        run.spans.turn_started()
        # After a correction the model must answer: the schema goes, the tools wait.
        must_answer = final_turn or (config.output is not None and _after_correction(client))
        specs = None if must_answer else config.table.specs
        sent = self._taken_up(run, inflight)
        if isinstance(config.context, SummarizeOlderTurns):
            sent = config.context.view_with(sent, self._durable.summary)
        elif config.context is not None:
            sent = list(config.context.view(sent))
        request = turn_request(
            config.output, config.tool_choice, config.parallel_tool_calls, specs, sent
        )
        turn = _in_scope(
            client.stream_turn(sent, specs)
            if request is None  # a client of our own without request= keeps working
            else client.stream_turn(sent, specs, request=request),
            run.scope,
            run.wall,
        )
        watch, streamed, hit = budget.watch, 0, None
        try:
            async for chunk in turn:
                assembler.add(chunk)
                event = self._chunk_event(chunk, run, inflight)
                if event is not None:
                    yield event
                    if watch:  # a token or cost limit: crossed by this reply yet?
                        streamed += len(event.text)  # type: ignore[union-attr]
                        hit = budget.streamed(
                            {"input_tokens": 0, "output_tokens": estimate_tokens(streamed)}
                        )
                        if hit is not None:
                            break
        except _WallReached:
            hit = budget.wall_hit()
        except ModelError as error:
            if assembler.started or not run.interrupt_asked():
                raise
            # No byte of a reply came (an interrupt cut a retry's backoff short): nothing of
            # this turn exists, so the interrupt is honoured as at a step boundary.
            run.error = _describe(error)
            run.interrupted()
            return
        finally:
            await turn.aclose()
        if hit is not None:
            await self._cut_by_limit(run, inflight, hit)
            return
        if not assembler.done:
            raise ModelProtocolError(
                f"the model at {client.host} ended its turn without finishing it",
                host=client.host,
            )
        run.turn = None
        run.spans.turn_ended(assembler.usage, assembler.stop_reason)
        schema_asked = request is not None and request.output_schema is not None
        message = assembler.message()
        if run.stop_reason in CUT_OFF_REASONS and not message.get("tool_calls"):
            # Kept with the answer: a resumed run must not take it as complete.
            message["aimu_stop_reason"] = run.stop_reason
        message = await self._keep(inflight.prefix, message)
        await self._end_turn(run, message, inflight, final_turn, schema_asked)
        if not assembler.usage_reported and budget.watch:
            raise ModelProtocolError(
                f"the model at {client.host} reported no token usage, so the token or cost "
                "limit cannot be checked (aimu does not guess); remove that limit, or use a "
                "server that reports usage",
                host=client.host,
            )

    async def _summarize(self, run: _Run, policy: SummarizeOlderTurns) -> None:
        """Ask the model for a new summary of the older turns if the policy says one is
        due; a request of the run's (counted in its usage and limits), stored in the
        session's state. A stop cuts it like any model turn: nothing is kept of it."""
        due = policy.due(self.model_client.messages, self._durable.summary)
        if due is None:
            return
        cut, older = due
        budget = run.budget
        assert budget is not None
        run.requests += 1
        budget.count_request()
        assembler = TurnAssembler()
        stream = _in_scope(
            self.model_client.stream_turn(policy.request(self._durable.summary, older), None),
            run.scope, run.wall,
        )
        try:
            async for chunk in stream:
                assembler.add(chunk)
        finally:
            await stream.aclose()
        add_usage(run.usage, assembler.usage)
        budget.count_tokens(assembler.usage, estimated=False)
        self._durable.summary = Summary(cut, assembler.text.strip())
        await self._save_state()

    async def _cut_by_limit(self, run: _Run, inflight: _Turn, hit: LimitHit) -> None:
        """A streamed reply crossed a token, cost or wall limit: keep what came (marked partial,
        its usage estimated, any complete tool call answered as not run) and end limited."""
        run.turn = None
        message = await self._keep(inflight.prefix, inflight.assembler.message())
        await self._answer_cut_calls()
        self._count_estimated(run, inflight)
        run.reply = message["content"]
        run.limited(hit)
        run.spans.turn_ended(run.usage, hit.stop_reason)

    def _count_estimated(self, run: _Run, inflight: _Turn) -> None:
        """Count a cut turn's usage, which no server reports: its request's and its
        streamed text's size, estimated (so stopping a reply never escapes a budget)."""
        messages = self.model_client.messages
        assembler = inflight.assembler
        sent = estimate_tokens(transcript_chars(messages[: inflight.request_end], 0))
        streamed = len(assembler.text) + sum(len(t) for t in assembler.thinking_parts)
        usage: Usage = {"input_tokens": sent, "output_tokens": estimate_tokens(streamed)}
        add_usage(run.usage, usage)
        run.usage_estimated = True
        if run.budget is not None:
            run.budget.count_tokens(usage, estimated=True)

    def _chunk_event(self, chunk: Chunk, run: _Run, inflight: _Turn) -> Event | None:
        """The event for a streamed chunk, if the consumer sees one; notes the rest."""
        if isinstance(chunk, TextDelta):
            return TextChunk(self._config.name, chunk.text)
        if isinstance(chunk, ThinkingDelta):
            return ThinkingChunk(self._config.name, chunk.text)
        if isinstance(chunk, ToolCallDelta):
            if chunk.error is not None:
                inflight.argument_errors[chunk.call["id"]] = chunk.error
        elif isinstance(chunk, TurnDone):
            run.stop_reason = chunk.done_reason
        return None

    async def _end_turn(
        self,
        run: _Run,
        message: AssistantMessage,
        inflight: _Turn,
        final_turn: bool,
        schema_asked: bool = True,
    ) -> None:
        """Decide the outcome of a finished turn (recorded): answered, tools, or out of
        rounds."""
        usage = inflight.assembler.usage
        add_usage(run.usage, usage)
        if run.budget is not None:
            run.budget.count_tokens(usage, estimated=False)
            if run.budget.session_limits_set and self._durable.writer is not None:
                await self._save_state()  # the session's spend, durable turn by turn
        if usage["input_tokens"]:  # the server counted: later estimates start from here
            self._known = (
                len(self.model_client.messages), usage["input_tokens"] + usage["output_tokens"]
            )
        run.rounds += 1
        calls = message.get("tool_calls")
        if not calls and not await self._output_checked(run, message["content"], schema_asked):
            run.next = None  # a correction was sent: the model answers again
        elif not calls:
            run.end("max_rounds" if final_turn else "completed", message["content"])
        elif final_turn:
            for call in calls:
                await self._record(_result(call, ToolOutcome(_NO_ROUNDS_LEFT, True)))
            run.end("max_rounds", message["content"])
        else:
            run.next = NeedsTools(calls, argument_errors=inflight.argument_errors)

    async def _output_checked(self, run: _Run, text: str, schema_asked: bool = True) -> bool:
        """True if ``text`` is a valid answer (always, without ``output_type``); else the
        model is sent a correction, or, its corrections used up, OutputValidationError.
        An answer on a turn that was not sent the schema (one offering tools) costs no
        correction: the model had not been told the format."""
        output = self._config.output
        if output is None:
            return True
        try:
            run.output = output.parse(text)
        except ValueError as error:
            await self._record(output.correction(str(error)))
            run.output_failures += schema_asked
            if run.output_failures > output.retries:
                raise output.failed(self.name, text, str(error), run.output_failures) from None
            return False
        return True

    async def _join_sent(self, run: _Run) -> bool:
        """Record the text sent to the run as user messages; True if there was any.

        Sent text joins the run: it does not renew the run's round budget."""
        carried = self._durable.carried.take()
        sent = [*carried, *run.scope.take_sent()]
        for message in sent:
            await self._record(message)
        if carried:
            await self._save_state()  # in the transcript now: no longer in the state
        return bool(sent)

    def _sort_calls(
        self, calls: list[ToolCall]
    ) -> tuple[list[ToolCall], list[tuple[ToolCall, str]], list[ToolCall]]:
        """The calls to run now, those refused (with the result the model reads), and
        those that wait for a person: by the decision given, else the policy or tool."""
        run_now: list[ToolCall] = []
        refused: list[tuple[ToolCall, str]] = []
        asked: list[ToolCall] = []
        for call in calls:
            decision = self._approvals.take(call["id"]) or self._policy(call)
            if decision is None:
                asked.append(call)
            elif decision.approved:
                run_now.append(call)
            else:
                refused.append((call, denied_result(decision.reason)))
        return run_now, refused, asked

    def _policy(self, call: ToolCall) -> Decision | None:
        """What the agent's ``approve=`` policy, or the tool's ``approval`` flag, says
        of a call no person decided on; None: ask a person."""
        function = call["function"]
        policy = self._config.approve
        if policy is not None:
            verdict = policy(function["name"], function["arguments"])
            if verdict == "ask":
                return None
            return Decision(True) if verdict else Decision(False, "refused by the policy")
        tool = self._config.table.by_name.get(function["name"])
        return None if tool is not None and tool.approval else Decision(True)

    async def _tool_round(self, run: _Run, step: NeedsTools) -> AsyncGenerator[Event, None]:
        """Run the last turn's calls, recording each result as it exists; ends the step
        (a model turn comes next), or pauses the run when calls wait for a person."""
        name = self._config.name
        calls, refused, asked = self._sort_calls(step.calls)
        if run.budget is not None:
            run.budget.count_tools(len(calls))
        for call, refusal in refused:
            yield _call_started(name, call)
            yield await self._call_tool(call, run, refusal=refusal)
        try:
            if self._config.concurrent_tools and len(calls) > 1:
                for call in calls:
                    yield _call_started(name, call)
                async with aclosing(self._calls_as_tasks(calls, run, step)) as events:
                    async for event in events:
                        yield event
            else:
                by_name = self._config.table.by_name
                for call in calls:
                    yield _call_started(name, call)
                    tool = by_name.get(call["function"]["name"])
                    if tool is None or not tool.from_schema_given:
                        called = self._call_tool(call, run, **_as_in(step, call))
                        yield await (called if run.wall is None else run.wall.guard(called))
                        continue
                    # A server's tool may report progress while it runs: its events come
                    # first (a task runs the call; a wall limit cuts the wait for it).
                    async with aclosing(self._calls_as_tasks([call], run, step)) as events:
                        async for event in events:
                            yield event
        except _WallReached:
            assert run.budget is not None
            await self._answer_cut_calls()
            run.limited(run.budget.wall_hit())
            return
        run.next = None
        if asked:
            for call in asked:
                self._approvals.ask(call, run_id=run.scope.run_id)
            await self._save_state()
            run.end("paused", PAUSED)
            run.scope.note_paused()
            return
        yield StepFinished(name, run.rounds)

    async def _calls_as_tasks(
        self, calls: list[ToolCall], run: _Run, step: NeedsTools
    ) -> AsyncGenerator[ToolResult | ToolProgress, None]:
        """Run ``calls`` side by side; yield their progress and results as they come.
        Leaving early (a cancel, a close) cancels the calls still running and waits."""
        queue: asyncio.Queue[ToolProgress | asyncio.Task[ToolResult]] = asyncio.Queue()
        tasks = [
            asyncio.ensure_future(
                self._call_tool(call, run, queue.put_nowait, **_as_in(step, call))
            )
            for call in calls
        ]
        for task in tasks:
            task.add_done_callback(queue.put_nowait)
        try:
            left = len(tasks)
            while left:
                item = await (queue.get() if run.wall is None else run.wall.guard(queue.get()))
                if isinstance(item, asyncio.Task):
                    left -= 1
                    yield item.result()
                else:
                    yield item
        finally:
            pending = [t for t in tasks if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    async def _call_tool(
        self,
        call: ToolCall,
        run: _Run,
        progress: Callable[[ToolProgress], None] | None = None,
        refusal: str | None = None,
        *,
        rerun: bool = False,
    ) -> ToolResult:
        """Run one call (its start journaled first, with a store) and record its result
        the moment it exists; a refused call gets ``refusal`` as its result."""
        if refusal is not None:
            outcome = ToolOutcome(refusal, True)
        else:
            await self._journal_start(call)
            context = ToolContext(
                agent=self._config.name,
                call_id=call["id"],
                tool_name=call["function"]["name"],
                interrupt_probe=run.interrupt_asked,
                deps=run.deps,
                progress=None if progress is None else _progress_sink(self.name, call, progress),
            )
            run.contexts.append(context)
            with run.spans.tool_calls():
                outcome = await invoke(self._config.table.by_name, call, context)
            context.mark_finished()
            if rerun:  # a call a crash left in doubt, run again
                outcome = ToolOutcome(f"{RERUN_NOTE}\n{outcome.content}", outcome.is_error)
        result = _result(call, outcome)
        if not run.settled:
            await self._record(result)
        return ToolResult(
            self._config.name, call["id"], result["name"], result["content"], outcome.is_error
        )

    async def _journal_start(self, call: ToolCall) -> None:
        """With a store, durably note that ``call`` starts: if the process dies before
        its result is recorded, the next load knows the call is in doubt."""
        function = call["function"]
        if self._durable.writer is not None and function["name"] in self._config.table.by_name:
            await self._durable.writer.record_tool_start(
                call["id"], function["name"], function["arguments"]
            )

    async def _settle(self, run: _Run) -> RunFinished:
        """Leave a valid transcript however the run ended, release the session, and
        publish the run's RunFinished (returned for the consumer).

        Memory is settled first; a store that fails now is kept in ``run.store_error``
        (the run ends ``failed``, its transcript in memory and restorable).
        """
        run.settled = True
        if run.wall is not None:
            run.wall.close()
        for context in run.contexts:
            context.mark_cancelled()
        unstored: list[Message] = []
        inflight = run.turn
        if inflight is not None and inflight.assembler.started:
            partial = inflight.assembler.message()
            if inflight.prefix is not None:  # a continuation cut short: one answer, partial
                partial = _joined(inflight.prefix, partial)
                self.model_client.messages[-1] = partial
                self._durable.transcript_stale = True
            else:
                unstored.append(partial)
                self.model_client.messages.append(partial)
            run.reply = run.reply or partial["content"]
            self._count_estimated(run, inflight)
        if run.status in _STOPPED and run.opened:
            unstored.extend(self._settle_calls())
            self._approvals.clear()
        sent = run.scope.take_sent(close=True)
        if run.status == "paused":
            # Joins the resumed run at its first boundary; stored in the session's state.
            self._durable.carried.add(sent, len(self.model_client.messages))
        else:
            unstored.extend(sent)
            self.model_client.messages.extend(sent)
        if run.budget is not None:
            run.budget.finish()
        try:
            await self._store_settled(unstored, None if run.untouched else run.status)
        except StoreError as error:
            run.store_error = error
            run.status, run.error = "failed", _describe(error)
        finally:
            add_usage(self._usage, run.usage)
            result = self._result_of(run)
            self._close_scope(result)
        final = RunFinished(
            self._config.name, run.status, run.reply, run.usage, run.error, run.stop_reason,
            result.requests, result.retries, result.duration,
        )
        run.scope.emit(final)
        return final

    def _stop(self, run: _Run, final: RunFinished, error: BaseException | None) -> Stop:
        """How the run ended, for its span and the log (a deadline's cancel: timed_out)."""
        waiting = [f"{p.tool} ({p.call_id})" for p in self._approvals.pending.values()]
        limit = None if run.limit is None else run.limit.message
        return stop_of(final, error, run.scope, waiting, self._config.max_rounds, limit)

    def _result_of(self, run: _Run) -> RunResult[OutputT]:
        """The run's result, once settled: what it returned and added, and its numbers."""
        client = self.model_client
        duration, started_at, ended_at = run.clock.span()
        return RunResult(
            source=self._config.name,
            status=run.status,
            output=self._output_of(run),
            reply=run.reply,
            stop_reason=run.stop_reason,
            usage=run.usage,
            requests=run.requests,
            retries=client.retry_count - run.retries_from,
            duration=duration,
            started_at=started_at,
            ended_at=ended_at,
            messages=client.messages[run.first:],  # no copy: ~6 us a message, per run
            error=run.error,
            run_id=run.scope.run_id,
            spend=None if run.budget is None else run.budget.run,
            continuation=run.continuation,
            usage_estimated=run.usage_estimated,
            limit=None if run.limit is None else run.limit.message,
        )

    def _output_of(self, run: _Run) -> OutputT | None:
        """What ``run()`` returns for ``run``: its text, or its ``output_type`` value (None
        when it raises, or ended without a valid answer)."""
        if run.status in _STOPPED:
            return None
        if self._config.output is None:
            return cast(OutputT, run.reply)
        answered = run.status in ("completed", "incomplete", "max_rounds")
        return cast(OutputT, run.output) if answered else None

    async def _answer_cut_calls(self) -> None:
        """A limit cut the last turn short: its calls still open are answered "cancelled"
        (they come last in the transcript: in memory, then in the store)."""
        await self._durable.store_added(self.model_client.messages, self._settle_calls())

    def _settle_calls(self) -> list[ToolMessage]:
        """Give each dangling call of the last assistant turn a "cancelled" result (in
        memory); return those results."""
        messages = self.model_client.messages
        last_assistant = len(messages) - 1
        while last_assistant > 0 and messages[last_assistant]["role"] == "tool":
            last_assistant -= 1
        return self._close_open_calls(start=max(last_assistant, 0))

    def _close_open_calls(self, start: int = 0) -> list[ToolMessage]:
        """Answer the open calls in memory: "cancelled", or IN_DOUBT_RESULT for a call
        a crash left in doubt that is now not run again; return the results."""
        reruns, self._reruns = self._reruns, set()
        return settle(
            self.model_client.messages,
            lambda _index, call: IN_DOUBT_RESULT if call["id"] in reruns else CANCELLED_RESULT,
            start=start,
        )

    async def _store_settled(self, unstored: list[Message], status: RunStatus | None) -> None:
        """Store what the settling added, the session's spend and ``status`` (None: the
        run changed nothing, so the session's status stays as it was)."""
        await self._durable.store_added(self.model_client.messages, unstored)
        if self._durable.writer is not None and status is not None:
            await self._save_state()
            await self._durable.writer.set_status(status)

    def _rounds_used(self) -> tuple[int, bool]:
        """Model turns made for the current task (from the transcript), and whether its
        final-turn prompt was given already."""
        rounds = 0
        for message in reversed(self.model_client.messages):
            role = message["role"]
            if role == "user":
                if message["content"] == FINAL_TURN_PROMPT:
                    return self._config.max_rounds, True
                if is_correction(message):
                    continue  # the same task: the model was asked to fix its answer
                break
            if role == "assistant" and not message.get("aimu_partial"):
                rounds += 1
        return rounds, False

    def _finished_answer(self) -> AssistantMessage | None:
        """The transcript's last message if it is a whole answer (no tool call)."""
        messages = self.model_client.messages
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant":
            return None
        if last.get("tool_calls") or last.get("aimu_partial"):
            return None
        return last


class _Done(Awaitable[None]):
    """What restore() returns without a store: nothing to wait for, awaited or not."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        return
        yield  # a generator that ends at once


_DONE = _Done()


class _WallReached(Exception):
    """The run's ``wall`` limit came while a reply streamed or a tool call ran."""


class _WallTimer:
    """A run's ``wall`` limit: one timer for the whole run, armed when it opens. When it
    comes, the step waiting in :meth:`guard` (a stream step, a tool call) is cancelled
    and :meth:`guard` raises _WallReached in its place; a guard after that raises at
    once. The cancel accounting is asyncio.timeout's: a cancel from elsewhere in the same
    moment stays a CancelledError."""

    __slots__ = ("_fired", "_handle", "_task", "reached")

    def __init__(self, deadline: float) -> None:
        self.reached = False
        self._task: asyncio.Task[Any] | None = None
        self._fired = False
        self._handle = asyncio.get_running_loop().call_at(deadline, self._fire)

    def _fire(self) -> None:
        self.reached = True
        if self._task is not None:
            self._fired = True
            self._task.cancel()

    async def guard(self, awaitable: Awaitable[_T]) -> _T:
        """``awaitable``'s value, or _WallReached (``awaitable`` cancelled) if the limit
        comes first."""
        if self.reached:
            if isinstance(awaitable, Coroutine):
                awaitable.close()
            raise _WallReached
        task = asyncio.current_task()
        assert task is not None
        cancelling = task.cancelling()
        self._task, self._fired = task, False
        try:
            result = await awaitable
        except asyncio.CancelledError:
            if self._fired and task.uncancel() <= cancelling:
                raise _WallReached from None
            raise
        finally:
            self._task = None
        if self._fired and task.uncancel() <= cancelling:  # the cut was swallowed below
            raise _WallReached
        return result

    def close(self) -> None:
        """The run has ended: the timer goes."""
        self._handle.cancel()


async def _in_scope(
    chunks: AsyncGenerator[Chunk, None], scope: RunScope, wall: _WallTimer | None = None
) -> AsyncGenerator[Chunk, None]:
    """``chunks`` with the run's ``scope`` as ``current_scope`` for the first step, so the
    provider's retry wait sees the run's interrupt and deadline even outside any handle;
    with a ``wall`` timer, each step is cut (_WallReached) when the wall limit comes.

    A provider opens its request, and retries it, in the first step only (no retry once a
    byte of the reply came), so later steps need not set the scope. Without a wall limit
    they are a plain ``async for``: stepping each with ``anext()`` and catching the
    StopAsyncIteration that ends the turn in Python cost ~3 % of a scripted round."""
    try:
        token = current_scope.set(scope)
        try:
            first = await (anext(chunks) if wall is None else wall.guard(anext(chunks)))
        except StopAsyncIteration:
            return
        finally:
            current_scope.reset(token)
        yield first
        if wall is None:  # no wall limit: the common case
            async for chunk in chunks:
                yield chunk
            return
        while True:
            try:
                chunk = await wall.guard(anext(chunks))
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        await chunks.aclose()


class _CallOptions(TypedDict):
    refusal: str | None
    rerun: bool


def _as_in(step: NeedsTools, call: ToolCall) -> _CallOptions:
    """How ``step`` runs ``call``: answered with its argument error, if its arguments did
    not parse; run again with a note, if a crash left it in doubt."""
    return {"refusal": step.argument_errors.get(call["id"]), "rerun": call["id"] in step.reruns}


def _progress_sink(
    source: str, call: ToolCall, emit: Callable[[ToolProgress], None]
) -> Callable[[float, float | None, str | None], None]:
    call_id, name = call["id"], call["function"]["name"]

    def report(progress: float, total: float | None, message: str | None) -> None:
        emit(ToolProgress(source, call_id, name, progress, total, message))

    return report


def _after_correction(client: ModelClient) -> bool:
    """True when the transcript ends with a correction of an invalid typed answer."""
    messages = client.messages
    return bool(messages) and is_correction(messages[-1])


def _joined(prefix: AssistantMessage, more: AssistantMessage) -> AssistantMessage:
    """The answer ``prefix`` continued by ``more``: one message (partial while ``more`` is)."""
    joined: AssistantMessage = {"role": "assistant", "content": prefix["content"] + more["content"]}
    if "tool_calls" in more:
        joined["tool_calls"] = more["tool_calls"]
    thinking = prefix.get("thinking", "") + more.get("thinking", "")
    if thinking:
        joined["thinking"] = thinking
    if more.get("aimu_partial"):
        joined["aimu_partial"] = True
    if "aimu_stop_reason" in more:
        joined["aimu_stop_reason"] = more["aimu_stop_reason"]
    return joined


def _call_started(name: str, call: ToolCall) -> ToolCallStarted:
    function = call["function"]
    return ToolCallStarted(name, call["id"], function["name"], function["arguments"])


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _result(call: ToolCall, outcome: ToolOutcome) -> ToolMessage:
    """The tool message for ``outcome``; a lone surrogate in a tool's text (which no
    store or server takes) becomes U+FFFD, as in a model's reply."""
    return {
        "role": "tool",
        "content": clean(outcome.content),
        "tool_call_id": call["id"],
        "name": call["function"]["name"],
    }
