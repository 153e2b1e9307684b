"""An agent session: its transcript, its stored record, its approvals; the only writer.

:class:`Session` holds what one session of an agent keeps between runs (the transcript
in :attr:`Session.messages`, the store session and the state beside it, the calls waiting
for a person) and is the one place that changes them: loading and restoring, recording
each message the moment it exists, answering open calls.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from aimu.aio._session import SessionRecord, input_id
from aimu.aio.approvals import Approvals, Decision
from aimu.aio.client import ModelClient
from aimu.aio.instructions import RunContext
from aimu.aio.journal import IN_DOUBT_RESULT, resolve_in_doubt
from aimu.aio.limits import Budget, Spend
from aimu.aio.output import is_correction
from aimu.aio.providers._unicode import clean
from aimu.aio.scope import RunScope
from aimu.aio.store._protocol import check_run_status
from aimu.aio.tools import Tool, ToolOutcome
from aimu.aio.transcript import (
    CANCELLED_RESULT,
    AssistantMessage,
    Message,
    ToolCall,
    ToolMessage,
    ToolSpec,
    Usage,
    answer_open_calls,
    copy_messages,
    dangling_calls,
    validate,
    zero_usage,
)

from .config import Config
from .state import FINAL_TURN_PROMPT
from .transfer import Handoff

if TYPE_CHECKING:
    from aimu.aio._stops import Stop
    from aimu.aio.events import RunStatus
    from aimu.aio.store import SessionStatus, SessionWriter, Store, ToolStart

    from .base import AgentBase
    from .state import RunState

__all__ = ["NO_RERUNS", "Session", "Speaker", "StoredSession", "joined", "tool_message"]

#: No call a crash left in doubt: one empty set shared by every session (an empty
#: ``set()`` is 216 bytes a session).
NO_RERUNS: frozenset[str] = frozenset()


class Speaker:
    """Who may have a session's conversation, with handoffs (see :mod:`.handoffs`): the
    home agent (the session's own configuration and client) and every agent reachable by
    handoffs, by name, with the handoff that reaches it."""

    __slots__ = ("client", "config", "known")

    def __init__(self, config: Config, client: ModelClient, known: dict[str, Handoff]) -> None:
        self.config = config
        self.client = client
        self.known = known


class Session:
    """One session of an agent without a store: its transcript (:attr:`messages`), the
    state kept beside it (``durable``: what a pause carries, the summary, the spend),
    and its approvals. Memory is all there is: recording is appending, and nothing is
    journalled, saved, opened or closed. :class:`StoredSession` adds the store."""

    __slots__ = (
        "approvals", "client", "config", "durable", "handoff", "held", "known", "loaded",
        "messages",
        "name", "reruns", "store", "system_text", "usage",
    )

    def __init__(
        self, config: Config, client: ModelClient, store: Store | None, name: str | None
    ) -> None:
        self.config = config
        #: The model client: what the session's turns are asked of (it holds no state
        #: of the session's; any number of sessions may share one).
        self.client = client
        #: The transcript: this session owns it, and is the only one to change it. A
        #: client given to the agent hands over the conversation it showed (its
        #: deprecated ``chat()``'s), then shows this list as its ``messages``: the user's view
        #: (``agent.model_client.messages``); the client never reads it.
        self.messages: list[Message] = client.messages
        self.store = store
        #: The store session's name (None without a store).
        self.name = name
        #: The store session and the state kept beside the transcript (see _session.py).
        self.durable = SessionRecord(store, name)
        #: Ids of the in-doubt calls of idempotent tools found on load: resume() runs
        #: them again (their results start with RERUN_NOTE).
        self.reruns: frozenset[str] = NO_RERUNS
        self.approvals = Approvals()
        #: The sessions of agents called as tools whose calls are held open (paused
        #: inside), by call id: a resume continues them (see aimu.aio.agent.tree).
        self.held: dict[str, AgentBase[Any]] = {}
        #: Memory holds the session: no store, or its session loaded (open()) or replaced
        #: (restore()). Until then the transcript and approvals are not known.
        self.loaded = store is None
        #: Tokens used by this session's runs so far, resumes included.
        self.usage: Usage = zero_usage()
        self.system_text: str | None = config.system if isinstance(config.system, str) else None
        #: (messages, tokens): the transcript's length after the last finished turn and
        #: the tokens the server counted for it, so a request's size is estimated from
        #: what was added since.
        self.known = (0, 0)
        #: With handoffs: who may have the conversation (see .handoffs), else None.
        self.handoff: Speaker | None = None

    @property
    def agent_name(self) -> str:
        """The name of the agent this session is of: its runs' (their records and their
        start and end events), whichever agent has the conversation (handoffs)."""
        speaker = self.handoff
        return self.config.name if speaker is None else speaker.config.name

    # -- checks ------------------------------------------------------------------------

    @property
    def resumable(self) -> bool:
        return any(m["role"] == "user" for m in self.messages)

    def check_resumable(self) -> None:
        self.require_task()

    def require_task(self) -> None:
        if not self.resumable:
            raise ValueError("nothing to resume: the transcript has no task yet; use run(task)")
        self.approvals.check_decided(f"agent {self.config.name!r}")

    def check_loaded(self, what: str) -> None:
        if not self.loaded:
            raise RuntimeError(
                f"agent {self.config.name!r}: session {self.name!r} is not open, so its "
                f"{what} are not loaded yet: await agent.open() (or use `async with agent`) "
                "first"
            )

    def decide(self, call_id: str, decision: Decision) -> None:
        self.approvals.decide(call_id, decision, f"agent {self.config.name!r}")
        self.durable.state_stale = True

    # -- the tools: the agent's, and the external tools this session offers --------------

    def tool_named(self, name: str) -> Tool | None:
        return self.config.table.by_name.get(name) or self.durable.external.get(name)

    def tool_specs(self) -> tuple[ToolSpec, ...]:
        external = self.durable.external
        if not external:
            return self.config.table.specs
        return (*self.config.table.specs, *(tool.spec for tool in external.values()))

    def set_external(self, tools: Sequence[Tool]) -> None:
        """Offer ``tools`` (external tools) besides the agent's own, from the next run
        on, replacing those offered before; kept in the session's state."""
        by_name: dict[str, Tool] = {}
        for tool in tools:
            if not isinstance(tool, Tool) or not tool.external:
                raise TypeError(
                    "a session's extra tools must be external tools (aio.external_tool()), "
                    f"got {tool!r:.80}"
                )
            if tool.name in self.config.table.by_name or tool.name in by_name:
                raise ValueError(
                    f"agent {self.config.name!r}: an external tool named {tool.name!r} "
                    "clashes with another tool of that name"
                )
            by_name[tool.name] = tool
        self.durable.external = by_name
        self.durable.state_stale = True

    # -- what a store keeps (here: nothing) ----------------------------------------------

    async def open(self) -> None:
        """Open the store session: take its write lock and load its transcript."""

    async def close(self) -> None:
        """Store what restore() and decisions changed since the last run; release the
        store session."""

    async def save_state(self) -> None:
        """Store the state kept beside the transcript."""

    async def keep_spend(self, budget: Budget) -> None:
        """Store what the run has spent (and, with session limits, the session), before
        a request."""

    async def drop_inputs(self) -> None:
        """A reset: the text sent to earlier runs and not joined goes (from the store)."""

    async def continued_spend(self) -> Spend | None:
        """What the run a resume goes on with spent, when that run did not end (its
        process died: its record still says ``running``; or it is marked to be
        recovered): a resume goes on with its budget. None: a fresh budget."""
        return None

    async def store_added(self, added: Sequence[Message]) -> None:
        """Store ``added``, already last in the transcript."""

    async def before_run(self) -> None:
        """Store what memory changed since the store last saw it, before a run starts."""

    async def set_status(self, status: SessionStatus) -> None:
        """Store how the session's last run stands (``in_progress`` while it runs)."""

    async def journal_start(self, call: ToolCall) -> None:
        """Durably note that ``call`` starts (see :mod:`aimu.aio.journal`)."""

    async def start_run(self, run: RunState) -> None:
        """Store the record of the run starting now (status ``running``)."""

    async def end_run(self, run: RunState, stop: Stop) -> None:
        """Store how the run started by :meth:`start_run` ended (``stop``)."""

    async def end_dead_run(self, reason: str) -> None:
        """Record the session's last run ``failed`` (``reason``) if its record still says
        ``running``: its process died (this one holds the session now)."""

    # -- the transcript ----------------------------------------------------------------

    def place_system(self) -> bool:
        """Keep the system prompt present exactly once, first; True if it changed."""
        system = self.system_text
        messages = self.messages
        if system is None:
            return False
        if messages and messages[0]["role"] == "system":
            if messages[0]["content"] == system:
                return False
            messages[0] = {"role": "system", "content": system}
        else:
            messages.insert(0, {"role": "system", "content": system})
        return True

    def restore(self, messages: Sequence[Message], approvals: Approvals) -> None:
        """Hold ``messages`` (validated, copied, dangling calls answered) and
        ``approvals`` in memory; the system prompt kept."""
        validate(messages)
        restored = copy_messages(messages)
        self.answer_loaded_calls(restored, approvals, ())
        self.approvals = approvals
        self.known = (0, 0)
        system = self.system_text
        if system is not None and restored and restored[0]["role"] == "system":
            restored[0] = {"role": "system", "content": system}
        elif system is not None:
            restored.insert(0, {"role": "system", "content": system})
        self.messages[:] = restored
        self.durable.forget()  # what the state said of the transcript replaced goes
        self.loaded = True

    def answer_loaded_calls(
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
        found = resolve_in_doubt(
            messages, starts, self.config.table.by_name, approvals.pending, approved
        )
        found.log(f"agent {self.config.name!r}, session {self.name!r}")
        for call_id in approved:
            approvals.take(call_id)
        for call in found.asked:
            approvals.ask(call, in_doubt=True)
        self.durable.state_stale = self.durable.state_stale or bool(approved)
        self.reruns = frozenset(call["id"] for call in found.rerun)
        return len(messages) != before

    def snapshot(self) -> dict[str, Any]:
        """The transcript and token usage as plain JSON data (copies)."""
        snapshot = {
            "messages": copy_messages(self.messages),
            "usage": {"input_tokens": self.usage["input_tokens"],
                      "output_tokens": self.usage["output_tokens"]},
            **self.approvals.state(),
        }
        if self.durable.carried.messages:  # text sent to a paused run: it joins the resumed one
            snapshot["sent"] = self.durable.carried.dump()
        if self.durable.summary is not None:  # so a restored workflow does not ask again
            snapshot["summary"] = self.durable.summary.dump()
        return snapshot

    def mark_speaker(self, message: AssistantMessage) -> AssistantMessage:
        """With handoffs, note on an assistant message which agent spoke."""
        if self.handoff is not None:
            message["aimu_agent"] = self.config.name
        return message

    async def record(self, message: Message) -> None:
        """Add ``message`` to the transcript (and the store) the moment it exists."""
        self.messages.append(message)

    async def keep_continued(
        self, prefix: AssistantMessage, message: AssistantMessage
    ) -> AssistantMessage:
        """Record a continuation of ``prefix``: it replaces the answer it continued,
        joined to it (one assistant message). Returns the message as recorded."""
        whole = joined(prefix, message)
        self.messages[-1] = whole
        return whole

    async def join_sent(self, scope: RunScope) -> bool:
        """Record the text sent to the run as user messages; True if there was any.

        Sent text joins the run: it does not renew the run's round budget."""
        carried = self.durable.carried.take()
        sent = [*carried, *scope.take_sent()]
        for message in sent:
            await self.record(message)
        if carried:
            await self.save_state()  # in the transcript now: no longer in the state
        return bool(sent)

    async def drop_undone_calls(self) -> None:
        """A new task instead of resume(): calls still open are not run; they get
        "cancelled" results (or, in doubt after a crash, IN_DOUBT_RESULT)."""
        self.approvals.check_decided(f"agent {self.config.name!r}")
        await self.store_added(self.close_open_calls())
        if self.approvals.pending:
            self.approvals.clear()
            await self.save_state()

    async def answer_cut_calls(self) -> None:
        """A limit cut the last turn short: its calls still open are answered "cancelled"
        (they come last in the transcript: in memory, then in the store)."""
        await self.store_added(self.cancel_last_calls())

    def cancel_last_calls(self) -> list[ToolMessage]:
        """Give each dangling call of the last assistant turn a "cancelled" result (in
        memory); return those results."""
        messages = self.messages
        last_assistant = len(messages) - 1
        while last_assistant > 0 and messages[last_assistant]["role"] == "tool":
            last_assistant -= 1
        return self.close_open_calls(start=max(last_assistant, 0))

    def close_open_calls(self, start: int = 0) -> list[ToolMessage]:
        """Answer the open calls in memory: an external tool's call with the result
        given from outside (``answer()``: accepted, so never lost to a stop that lands
        before the resume used it), else "cancelled", or IN_DOUBT_RESULT for a call a
        crash left in doubt that is now not run again; return the results."""
        reruns, self.reruns = self.reruns, NO_RERUNS
        given = self.given_results()
        return answer_open_calls(
            self.messages,
            lambda _index, call: given.get(call["id"])
            or (IN_DOUBT_RESULT if call["id"] in reruns else CANCELLED_RESULT),
            start=start,
        )

    def given_results(self) -> dict[str, str]:
        """The results given from outside for the waiting calls of external tools, by
        call id (a decision bound to the pause that still waits)."""
        approvals = self.approvals
        given: dict[str, str] = {}
        for call_id, decision in approvals.decisions.items():
            pending = approvals.pending.get(call_id)
            if (pending is not None and pending.external and decision.approved
                    and decision.result is not None
                    and decision.pause_id in (None, pending.pause_id)):
                given[call_id] = decision.result
        return given

    async def store_settled(self, unstored: list[Message], status: RunStatus | None) -> None:
        """Store what the settling added, the session's spend and ``status`` (None: the
        run changed nothing, so the session's status stays as it was)."""

    # -- reading the transcript --------------------------------------------------------

    def rounds_used(self) -> tuple[int, bool]:
        """Model turns made for the current task (from the transcript), and whether its
        final-turn prompt was given already."""
        rounds = 0
        for message in reversed(self.messages):
            role = message["role"]
            if role == "user":
                if message["content"] == FINAL_TURN_PROMPT:
                    return self.config.max_rounds, True
                if is_correction(message) or message.get("aimu_sent"):
                    continue  # the same task: a correction, or text sent into its run
                break
            if role == "assistant" and not message.get("aimu_partial"):
                rounds += 1
        return rounds, False

    def run_context(self, task: str | None, deps: object) -> RunContext[Any]:
        """What a ``system=`` function or a guardrail knows of the run."""
        return RunContext(self.config.name, self.name, task, deps, self.durable.shared)

    def task_text(self) -> str | None:
        """The current task's text: the last user message that is not a correction, text
        sent into a run, or the final-turn prompt (None: none)."""
        for message in reversed(self.messages):
            if message["role"] == "user" and not (
                is_correction(message) or message.get("aimu_sent")
                or message["content"] == FINAL_TURN_PROMPT
            ):
                return str(message["content"])
        return None

    def finished_answer(self) -> AssistantMessage | None:
        """The transcript's last message if it is a whole answer (no tool call)."""
        messages = self.messages
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant":
            return None
        if last.get("tool_calls") or last.get("aimu_partial"):
            return None
        return last


class StoredSession(Session):
    """A session kept in a store: every message is written as it is recorded, each tool
    call's start journalled, the state saved beside the transcript. Until it is opened
    (by :meth:`open`, or a run) its writer is None and memory does not hold it yet."""

    __slots__ = ()

    def __init__(
        self, config: Config, client: ModelClient, store: Store | None, name: str | None
    ) -> None:
        super().__init__(config, client, store, name)
        client.on_remote_turn = self.remote_turn  # a background response's handle is kept

    async def remote_turn(self, handle: dict[str, Any]) -> None:
        """Keep the handle of a turn the server makes on its own (a background response),
        durably, so a run that dies in it re-attaches instead of asking again."""
        if self.durable.writer is None:
            return
        self.durable.remote = {**handle, "at": len(self.messages)}
        await self.save_state()

    def check_resumable(self) -> None:
        if self.durable.writer is None:
            return  # checked once the run has loaded the stored session
        self.require_task()

    async def open(self) -> None:
        if self.store is None or self.name is None or self.durable.writer is not None:
            return
        await self.config.table.ready()  # a loaded call in doubt needs its tool's flags
        writer = self.durable.writer = await self.store.open_session(self.name)
        try:
            await self.load_stored(writer)
        except BaseException:
            self.durable.writer = None
            await writer.aclose()
            raise

    async def close(self) -> None:
        await self.durable.close(self.messages, self.approvals)

    async def save_state(self) -> None:
        await self.durable.save_state(self.approvals)

    async def keep_spend(self, budget: Budget) -> None:
        if self.durable.writer is not None:
            if budget.session_limits_set:
                await self.durable.save_state(self.approvals)
            await self.durable.keep_run_spend(budget.run)

    async def drop_inputs(self) -> None:
        if self.durable.writer is not None and self.store is not None and self.name is not None:
            for pending in await self.store.inputs(self.name):
                await self.store.drop_input(self.name, pending.id)

    async def continued_spend(self) -> Spend | None:
        if self.durable.writer is None or self.store is None or self.name is None:
            return None
        latest = await self.store.runs(session=self.name, limit=1)
        if not latest or not (latest[0].status == "running" or latest[0].recover):
            return None
        return Spend.load(latest[0].spend, f"run {latest[0].id!r}")

    async def store_added(self, added: Sequence[Message]) -> None:
        await self.durable.store_added(self.messages, added)

    async def before_run(self) -> None:
        if self.durable.writer is not None:
            await self.durable.sync(self.messages)
            if self.durable.state_stale:
                await self.save_state()

    async def set_status(self, status: SessionStatus) -> None:
        if self.durable.writer is not None:
            await self.durable.writer.set_status(status)

    async def start_run(self, run: RunState) -> None:
        around = run.scope.parent  # an agent called as a tool: its caller's run is the parent
        parent = None if around is None else around.record
        await self.durable.start_run(self.agent_name, run.scope, run.first, parent)

    async def end_run(self, run: RunState, stop: Stop) -> None:
        if self.durable.run is None:
            return
        await self.durable.end_run(  # the transcript, not a client's (a handoff forks one)
            self.messages, run.first, status=check_run_status(stop.status),
            reason=stop.reason, stop_reason=run.stop_reason, usage=dict(run.usage),
            spend=None if run.budget is None else run.budget.run.dump(),
            limit=None if run.limit is None else run.limit.message,
        )

    async def end_dead_run(self, reason: str) -> None:
        writer, store, name = self.durable.writer, self.store, self.name
        if writer is None or store is None or name is None:
            return
        latest = await store.runs(session=name, limit=1)
        if latest and latest[0].status == "running":
            await writer.record_run(replace(
                latest[0], status="failed", ended=time.time(), reason=reason
            ))

    async def journal_start(self, call: ToolCall) -> None:
        """With the store open, durably note that ``call`` starts: if the process dies
        before its result is recorded, the next load knows the call is in doubt."""
        function = call["function"]
        if self.durable.writer is not None and function["name"] in self.config.table.by_name:
            await self.durable.writer.record_tool_start(
                call["id"], function["name"], function["arguments"]
            )

    def place_system(self) -> bool:
        changed = super().place_system()
        if changed and self.durable.writer is not None:
            self.durable.transcript_stale = True
        return changed

    async def load_stored(self, writer: SessionWriter) -> None:
        """Take the stored transcript into memory (a restore() before this one wins).
        StaleDecisionError, once loaded, if a decision given while the session was not
        open was for a pause that no longer waits (it is dropped: decide again)."""
        messages = self.messages
        stale = None
        stored = [] if self.durable.transcript_stale else await writer.load()
        if not stored and not self.durable.transcript_stale:
            # No transcript yet, but its state may hold what was set before its first
            # run (its external tools, its shared state: by another process).
            assert self.store is not None and self.name is not None
            self.durable.load_extras(await self.store.load_state(self.name))
        if stored:
            validate(stored)
            settled = copy_messages(stored)
            assert self.store is not None and self.name is not None
            state = await self.store.load_state(self.name)
            approvals = Approvals.from_state(state, f"session {self.name!r}")
            # Decisions given since the session was last open hold only for their pauses.
            stale = approvals.adopt(self.approvals, f"agent {self.config.name!r}")
            starts = await self.store.tool_starts(self.name)
            self.durable.transcript_stale = self.answer_loaded_calls(settled, approvals, starts)
            self.approvals = approvals
            self.durable.load_state(state, settled)
            messages[:] = settled
            if self.durable.remote is not None:  # the run died while the server made a turn
                self.client.reattach_turn(self.durable.remote)
        elif messages:
            validate(messages)
            self.durable.transcript_stale = True
        self.place_system()
        await self.durable.sync(messages)
        if self.durable.state_stale:
            await self.save_state()
        await self.load_inputs()
        self.loaded = True
        if stale is not None:
            raise stale

    async def load_inputs(self) -> None:
        """Carry the store's pending inputs (text sent to a run that did not join it
        before its process stopped) into the next run's first step boundary; those a
        rewrite of the transcript holds already are taken off the pending inputs."""
        assert self.store is not None and self.name is not None
        pending = await self.store.inputs(self.name)
        if not pending:
            return
        joined = {input_id(m) for m in self.messages} - {None}
        for each in pending:
            if each.id in joined:
                await self.store.drop_input(self.name, each.id)
        fresh = [each.message for each in pending if each.id not in joined]
        self.durable.carried.add_inputs(fresh, len(self.messages))

    async def store_restored(self) -> None:
        """Write what restore() put in memory to the store (the session opened first)."""
        if self.durable.writer is None:
            await self.open()  # memory is stale, so opening writes it instead of loading
        if self.durable.writer is not None:
            await self.durable.sync(self.messages)
            if self.durable.state_stale:
                await self.save_state()

    async def record(self, message: Message) -> None:
        await self.durable.record(self.messages, message)

    async def keep_continued(
        self, prefix: AssistantMessage, message: AssistantMessage
    ) -> AssistantMessage:
        whole = await super().keep_continued(prefix, message)
        if self.durable.writer is not None:
            self.durable.transcript_stale = True  # the stored answer replaced: rewrite it
            await self.durable.sync(self.messages)
        return whole

    async def store_settled(self, unstored: list[Message], status: RunStatus | None) -> None:
        await self.durable.store_added(self.messages, unstored)
        if self.durable.writer is not None and status is not None:
            await self.save_state()
            await self.durable.writer.set_status(status)


def joined(prefix: AssistantMessage, more: AssistantMessage) -> AssistantMessage:
    """The answer ``prefix`` continued by ``more``: one message (partial while ``more`` is)."""
    whole: AssistantMessage = {"role": "assistant", "content": prefix["content"] + more["content"]}
    if "tool_calls" in more:
        whole["tool_calls"] = more["tool_calls"]
    thinking = prefix.get("thinking", "") + more.get("thinking", "")
    if thinking:
        whole["thinking"] = thinking
    if more.get("aimu_partial"):
        whole["aimu_partial"] = True
    if "aimu_stop_reason" in more:
        whole["aimu_stop_reason"] = more["aimu_stop_reason"]
    return whole


def tool_message(call: ToolCall, outcome: ToolOutcome) -> ToolMessage:
    """The tool message for ``outcome``; a lone surrogate in a tool's text (which no
    store or server takes) becomes U+FFFD, as in a model's reply."""
    return {
        "role": "tool",
        "content": clean(outcome.content),
        "tool_call_id": call["id"],
        "name": call["function"]["name"],
    }
