"""The agent: a tool loop whose transcript survives any stop.

The package is in rooms, one concept each: :mod:`.config` (the options, checked and
frozen), :mod:`.state` (a run in flight and its step outcomes), :mod:`.session` (the
transcript, the stored record, approvals: the only writer), :mod:`.turn` (a model
turn), :mod:`.tool_round`, :mod:`.settle` (the one place a run's record and result are
made), :mod:`.loop` (the driver: ``match run.next``, one ``finally`` that settles) and
:mod:`.wall` (the wall-clock cut). :class:`Agent`, here, is the public surface.

One async generator (:func:`.loop.run_events`) does the work; ``run()`` drains it and
``run(stream=True)`` hands it out, so both share one code path. Whatever ends a run, the
transcript in ``agent.messages`` is valid to send to a model again.

``interrupt()`` stops the run at the next step boundary; ``resume()`` continues where
it stopped.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Mapping, Sequence
from types import EllipsisType
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

from typing_extensions import Unpack

from aimu.aio._session import Carried, shared_copy
from aimu.aio.approvals import ApprovalPolicy, Approvals, Decision, PendingApproval, bound
from aimu.aio.client import ModelClient
from aimu.aio.context import ContextPolicy, Summary
from aimu.aio.ends import INTERRUPTED
from aimu.aio.events import Event
from aimu.aio.guardrails import Guardrail, ToolGuardrail
from aimu.aio.instructions import Instructions
from aimu.aio.limits import Spend, UsageLimits
from aimu.aio.runnable import NO_DEPS, NO_OPTIONS, OutputT, RunOptions, load_usage
from aimu.aio.scope import RunScope, sent_message
from aimu.aio.steering import Steer, send_kept
from aimu.aio.store import validate_session_name
from aimu.aio.tools import Tool, Toolset
from aimu.aio.transcript import Message, Usage, zero_usage

from .base import AgentBase
from .config import AgentOptions, Config, make_config
from .loop import run_events
from .session import Session, StoredSession
from .state import FINAL_TURN_PROMPT, Ended, NeedsModel, NeedsTools, Next
from .transfer import Handoff
from .tree import (
    DEFAULT_MAX_DEPTH,
    AgentTool,
    check_tree,
    close_held,
    held_pending,
    open_held,
    route_decision,
)

if TYPE_CHECKING:
    from aimu.aio.store import SessionWriter, Store

__all__ = [
    "FINAL_TURN_PROMPT", "INTERRUPTED", "Agent", "Ended", "NeedsModel", "NeedsTools", "Next",
]

_T = TypeVar("_T")


class Agent(AgentBase[OutputT]):
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
    ``input_guardrails``, ``output_guardrails`` and ``tool_guardrails`` check the task
    (beside the first turn), the final answer and tool calls; a tripwire ends the run
    ``blocked`` (see :mod:`aimu.aio.guardrails`). ``handoffs`` (agents, or
    :class:`~aimu.aio.Handoff`) offers the model a transfer tool per target: the target
    answers the user from then on in this session (see :mod:`aimu.aio.agent.handoffs`).
    """

    kind = "agent"

    @overload
    def __init__(
        self: Agent[str],
        client: ModelClient,
        tools: Sequence[Callable[..., Any] | Tool | Toolset | EllipsisType] = (),
        *,
        output_type: None = None,
        **options: Unpack[AgentOptions],
    ) -> None: ...

    @overload
    def __init__(
        self: Agent[_T],
        client: ModelClient,
        tools: Sequence[Callable[..., Any] | Tool | Toolset | EllipsisType] = (),
        *,
        output_type: type[_T],
        **options: Unpack[AgentOptions],
    ) -> None: ...

    @overload
    def __init__(  # a union or other special form: annotate the agent to type it
        self: Agent[Any],
        client: ModelClient,
        tools: Sequence[Callable[..., Any] | Tool | Toolset | EllipsisType] = (),
        *,
        output_type: object,
        **options: Unpack[AgentOptions],
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
        input_guardrails: Sequence[Guardrail] | None = None,
        output_guardrails: Sequence[Guardrail] | None = None,
        tool_guardrails: Sequence[ToolGuardrail] | None = None,
        handoffs: Sequence[Agent[Any] | Handoff] | None = None,
    ) -> None:
        config = make_config(
            client, tools, system=system, max_rounds=max_rounds, name=name, store=store,
            session=session, concurrent_tools=concurrent_tools, approve=approve,
            output_type=output_type, output_retries=output_retries, tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls, limits=limits,
            session_limits=session_limits, deps=deps, context=context,
            input_guardrails=input_guardrails, output_guardrails=output_guardrails,
            tool_guardrails=tool_guardrails, handoffs=handoffs,
        )
        self._setup(config, client, store, session, owns_client=True)
        if any(isinstance(tool, AgentTool) for tool in config.table.local):
            check_tree(self)

    def _setup(
        self,
        config: Config,
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
        #: The session: transcript, store record, approvals (see session.py).
        kind = Session if store is None else StoredSession
        self._session = kind(config, client, store, session)
        self._take_seat(config.name)
        if session is not None:
            validate_session_name(session)
        self._session.place_system()

    # -- configuration -------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._config.name

    @property
    def config(self) -> Config:
        """The agent's configuration: frozen, shared by every session of it."""
        return self._config

    @property
    def loaded(self) -> bool:
        """The session is in memory: no store, or its stored session opened (or
        restored); until then its transcript and waiting calls are not known."""
        return self._session.loaded

    @property
    def system(self) -> str | None:
        """The system prompt: the text given, or the one a ``system=`` function gave
        for the last run (None before its first)."""
        return self._session.system_text

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
        """The session's totals: what it spent in all its runs (requests, tool calls,
        tokens, cost, seconds), in this process and, with a store, every earlier one, as
        the store keeps it. A copy. (:attr:`local_usage` counts this object's runs.)"""
        copy = Spend()
        copy.add(self._session.durable.spend)
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
        return self._session.name

    @property
    def local_usage(self) -> Usage:
        """Tokens used by this object's runs, resumes included; 0 for a new object on a
        stored session (see :attr:`spend` for the session's totals)."""
        usage = self._session.usage
        return {"input_tokens": usage["input_tokens"], "output_tokens": usage["output_tokens"]}

    @property
    def resumable(self) -> bool:
        return self._session.resumable

    def _check_resumable(self) -> None:
        self._session.check_resumable()
        if self._session.held:
            self._check_new_task()  # calls of agents it called wait for a decision

    # -- approvals -------------------------------------------------------------------

    @property
    def pending_approvals(self) -> list[PendingApproval]:
        """The tool calls the paused run waits on (call id, tool, arguments).

        With a store, ``RuntimeError`` until the session is opened: they are not known."""
        self._session.check_loaded("pending_approvals")
        waiting = self._session.approvals.waiting()
        if self._session.held:  # and those of the agents it called, with their path
            waiting.extend(held_pending(self._session))
        return waiting

    @property
    def messages(self) -> list[Message]:
        """This session's transcript: the session owns it. ``model_client.messages`` is
        the same list: the user's view of it through the client (the client itself holds
        no conversation and never reads it); change it through :meth:`restore` and runs.

        With a store, ``RuntimeError`` until the session is opened: an unopened session
        is not empty, its transcript is not loaded yet."""
        self._session.check_loaded("messages")
        return self._session.messages

    def _check_new_task(self) -> None:
        # Before the session is loaded its approvals are unknown: opening it checks them.
        if self._session.loaded:
            super()._check_new_task()

    def approve(self, call: str | PendingApproval) -> None:
        """Let the waiting call run when the run resumes: ``call`` is its id, or the
        :class:`PendingApproval` shown (then the decision holds for that pause only).
        A call an agent called as a tool waits on is decided here too: it goes down."""
        if not self._decided_below(call, True, None):
            self._decide(*bound(call, True))

    def deny(self, call: str | PendingApproval, reason: str | None = None) -> None:
        """Refuse the waiting call (its id, or the PendingApproval shown): on resume the
        model reads that it was denied, and ``reason``."""
        if not self._decided_below(call, False, reason):
            self._decide(*bound(call, False, reason))

    def _decided_below(
        self, call: str | PendingApproval, approved: bool, reason: str | None,
        result: str | None = None,
    ) -> bool:
        """True when ``call`` waits in an agent this one called (it is decided there)."""
        if not self._session.held:
            return False
        if self.running:
            raise RuntimeError(
                f"agent {self.name!r}: cannot decide while a run is in progress; decide "
                "once it has paused"
            )
        below = route_decision(self._session, call)
        if below is None:
            return False
        agent, call = below
        if result is not None:
            agent.answer(call, result)
        elif approved:
            agent.approve(call)
        else:
            agent.deny(call, reason)
        return True

    def answer(self, call: str | PendingApproval, result: str) -> None:
        """Give the result of a waiting call of an external tool (its id, or the
        PendingApproval shown): on resume the model reads ``result`` as the tool's result,
        and the run goes on from there (the model is not asked the turn again)."""
        if not isinstance(result, str):
            raise TypeError(f"a tool result is text, got {type(result).__name__}")
        if not self._decided_below(call, True, None, result):
            self._decide(*bound(call, True, None, result))

    @property
    def external_tools(self) -> tuple[Tool, ...]:
        """The external tools this session offers besides the agent's own
        (:meth:`set_external_tools`)."""
        return tuple(self._session.durable.external.values())

    def set_external_tools(self, tools: Sequence[Tool]) -> None:
        """Offer ``tools`` (made by :func:`~aimu.aio.external_tool`, such as the tools a
        web page declares) to the model besides the agent's own, from the next run on,
        replacing those set before (``[]``: none). With a store they are kept in the
        session's state: a resume, in this process or another, offers them again."""
        self._session.check_loaded("external tools")
        if self.running:
            raise RuntimeError(
                f"agent {self.name!r}: cannot change its external tools while a run is in "
                "progress"
            )
        self._session.set_external(tools)

    @property
    def shared_state(self) -> dict[str, Any] | None:
        """The state this session shares with its frontend (None: none): JSON data its
        tools read and may change in place (``ctx.shared_state``), as do ``system=``
        functions (``RunContext.shared_state``); with a store it is kept with the session
        and saved as each run settles."""
        return self._session.durable.shared

    def set_shared_state(self, state: Mapping[str, Any] | None) -> None:
        """Replace the session's shared state (a JSON object, copied; None: none) from the
        next run on; ``ValueError`` if it is not JSON."""
        self._session.check_loaded("shared state")
        if self.running:
            raise RuntimeError(
                f"agent {self.name!r}: cannot replace its shared state while a run is in "
                "progress (its tools may change it in place)"
            )
        self._session.durable.shared = None if state is None else shared_copy(state)
        self._session.durable.state_stale = True

    async def asend(self, text: str, *, images: Sequence[object] = ()) -> bool:
        """:meth:`send`, kept first: with a store, the text is in the session's store
        (a pending input) before this returns True, so a process killed before the
        run's next step boundary loses none of it: the session's next run (a resume in
        any process) joins it, once. False, and nothing kept, when no run is in
        progress or the run ended first. Without a store, the same as :meth:`send`."""
        scope, session = self._scope, self._session
        message = sent_message(text, images)
        if scope is None:
            return False
        store, name = session.store, session.name
        if store is None or name is None or session.durable.writer is None:
            return scope.post(message)
        request = Steer("send", text=text, images=tuple(message.get("images", ())))
        return await send_kept(store, name, request, lambda kept: _posted(scope, kept))

    def _decide(self, call_id: str, decision: Decision) -> None:
        self._session.check_loaded("pending approvals")
        if self.running:
            raise RuntimeError(
                f"agent {self.name!r}: cannot decide on call {call_id!r:.80} while a run is "
                "in progress; decide once it has paused"
            )
        self._session.decide(call_id, decision)

    # -- sessions ----------------------------------------------------------------------

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

    def as_tool(
        self,
        name: str | None = None,
        description: str | None = None,
        *,
        deps: object = NO_DEPS,
        max_depth: int = DEFAULT_MAX_DEPTH,
    ) -> Tool:
        """This agent as a tool for another agent's ``tools=``: a task in, its answer out.

        Each call runs this agent in a session of its own nested under the caller's (a
        store's session beside the caller's, named from it and the call id), with the
        caller's deps unless ``deps=`` is given. One stop, pause, budget and crash
        covers the tree: see :mod:`aimu.aio.agent.tree`. ``max_depth``: how many agents deep
        a call of this tool may be (the top agent's calls are 1 deep)."""
        return AgentTool.of(self, name, description, deps, max_depth)

    def nested(self, store: Store | None, session: str | None) -> Agent[OutputT]:
        """A session of this agent for one call of it as a tool (see :meth:`as_tool`): in
        ``store`` under ``session`` (both None: in memory)."""
        fresh: Agent[OutputT] = Agent.__new__(type(self))
        fresh._setup(self._config, self.model_client.fork(), store, session, owns_client=False)
        return fresh

    async def end_dead_run(self, reason: str) -> None:
        """Record this session's last run ``failed`` (with ``reason``) when its record
        still says ``running`` (its process died) and this process holds the session."""
        await self._session.end_dead_run(reason)

    def __repr__(self) -> str:
        state = "running" if self.running else "idle"
        return (
            f"<Agent {self.name!r} {state} messages={len(self._session.messages)} "
            f"tools={[t.name for t in self.tools]}>"
        )

    @property
    def session_writer(self) -> SessionWriter | None:
        """The open writer of this agent's stored session: it holds the session's write
        lock, so what it writes (a run's record, the session's status) cannot race
        another process. None before :meth:`open` (or the first run), after
        :meth:`aclose`, or without a store. ``aimu serve --recover`` records how a dead
        run ended through it; a run records its own."""
        return self._session.durable.writer

    async def open(self) -> None:
        """Open the store session now: take its write lock and load its transcript.

        ``SessionLockedError`` if another writer holds it. The first run does this
        itself; without a store this does nothing. Idempotent.
        """
        await self._session.open()
        await open_held(self._session)  # agents it called that wait for a decision

    async def aclose(self) -> None:
        """Release the store session and, for the agent that was given it, the client.

        A transcript given to :meth:`restore` since the last run is stored first, and
        approval decisions given since (so they survive a restart before ``resume()``).
        """
        try:
            await close_held(self._session)
            await self._session.close()
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

    def restore(self, messages: Sequence[Message]) -> Awaitable[None]:
        """Load ``messages`` as this session's transcript, validating them first.

        An invalid transcript raises ``ValueError`` naming the bad message and changes
        nothing. Messages are copied in; dangling tool calls get "cancelled" results;
        this agent's system prompt is kept. With a store, ``await agent.restore(...)``:
        it opens the session and returns once the transcript is stored (durable).
        """
        if self.running:
            raise RuntimeError("cannot restore() while a run is in progress on this session")
        session = self._session
        session.restore(messages, Approvals())
        if not isinstance(session, StoredSession):
            return _DONE
        return session.store_restored()

    # -- progress, for workflows ---------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """This session's transcript and token usage as plain JSON data (copies)."""
        return self._session.snapshot()

    def blank_snapshot(self) -> dict[str, Any]:
        return {"messages": [], "usage": zero_usage(), **Approvals().state()}

    def session_from(self, snapshot: Mapping[str, Any]) -> Agent[OutputT] | None:
        """A new session holding ``snapshot``; None when it holds no transcript."""
        messages = snapshot.get("messages") or []
        if not messages:
            return None
        fresh = self.start()
        approvals = Approvals.from_state(snapshot, "the snapshot")
        session = fresh._session
        session.restore(cast(list[Message], messages), approvals)
        session.durable.carried = Carried.load(snapshot.get("sent"), messages, "the snapshot")
        session.durable.summary = Summary.load(
            snapshot.get("summary"), len(messages), "the snapshot"
        )
        session.usage = load_usage(snapshot.get("usage"), "the snapshot")
        return fresh

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
        for model in self.model_client.priced_models:
            limits.price_of(model)  # a cost limit needs the price of each model

    def _events(
        self, task: str | None, reset: bool, options: RunOptions = NO_OPTIONS
    ) -> AsyncGenerator[Event, None]:
        return run_events(self._session, task, reset, options, self._seat)


class _Done(Awaitable[None]):
    """What restore() returns without a store: nothing to wait for, awaited or not."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        return
        yield  # a generator that ends at once


_DONE = _Done()


async def _posted(scope: RunScope, request: Steer) -> bool:
    return scope.post(request.message())
