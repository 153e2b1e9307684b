"""Agents as tools: an agent tree that stops, spends, pauses and resumes as one run.

``agent.as_tool()`` makes an :class:`AgentTool`: a task string in, the agent's answer
out. Each call runs the agent in a session of its own, nested under the caller's:

- **Its session** is named from the caller's (``planner--3.call_1``: the caller's
  session, the index of the turn that made the call, the call id), so a resume in
  another process finds it; with a store it is stored beside the caller's, without
  one it lives in memory.
- **Its run** opens under a :class:`CallScope`: an interrupt of any run around reaches
  it at its next step boundary, a cancel reaches it as a cancel of the call's task,
  a deadline bounds it, and its budget is its caller's run's (counted in it, and
  checked against its limits: see :class:`~aimu.aio.limits.SharedBudget`).
- **Its events** reach the caller's stream (``stream()``, a handle, serve's SSE) with a
  ``path`` naming the agents above it; text sent to the caller stays the caller's.
- **How it ended** is the call's result: its answer (typed output as JSON), or for an
  interrupt or a limit what it had produced; a cancel records that in the caller's
  transcript before the cancel goes on. A pause holds the call open (:class:`Held`):
  the caller pauses too, its pending calls are listed at the top with their
  ``path``, decided there, and the caller's resume continues inside the agent.
- **A crash** leaves the call in doubt in the caller's journal: it is neither re-run
  nor answered unknown, but continued (the agent's own journal knows what it did).

A cycle of agents is refused when the agent is built; a tree deeper than
``max_depth`` is refused then too, and a call that would go deeper at run time (a
toolset's tools) ends as a ``limit:depth`` result the calling model reads.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final, cast

from aimu.aio._run_options import NO_DEPS, RunOptions
from aimu.aio._stops import past_deadline
from aimu.aio.approvals import Approvals, PendingApproval
from aimu.aio.ends import ANSWERED
from aimu.aio.events import Event, HandleFinished, ModelRetry, RunFinished
from aimu.aio.scope import RunScope, current_scope
from aimu.aio.tools import Tool, ToolContext, ToolOutcome
from aimu.aio.tools._json_values import to_text
from aimu.aio.transcript import (
    AssistantMessage,
    Message,
    ToolMessage,
    dangling_calls,
    is_correction,
)

from .base import AgentBase
from .state import FINAL_TURN_PROMPT, Held, Phase

if TYPE_CHECKING:
    from collections.abc import Callable

    from aimu.aio.store import Store

    from .session import Session
    from .state import RunState

#: Any agent, as a tree sees it (the seam: see .base).
AnyAgent = AgentBase[Any]

__all__ = [
    "DEFAULT_MAX_DEPTH", "DIED", "AgentTool", "CallScope", "check_tree", "held_pending",
    "nested_session_name", "open_held", "route_decision",
]

#: How the record of a run whose process died says so (its reason starts so).
DIED: Final = "its process died"
#: How many agents deep a tree may call (the top agent's callees are at depth 1).
DEFAULT_MAX_DEPTH: Final = 5

_TASK_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "task": {"type": "string", "description": "What the agent should do, in full."}
    },
    "required": ["task"],
}
_SAFE = re.compile(r"[A-Za-z0-9._-]+")
#: The most of an agent's text a stopped call's result repeats.
_SHOWN = 2000


class CallScope(RunScope):
    """The scope between a calling run and the run of the agent it called.

    To the callee it is the top of its scope chain for what stays with a run (events
    are relayed from here to the caller's tool round with the path added; text sent,
    halts and results stay below), and a window on the caller for what a stop needs
    (its interrupt, deadline, run id). Its options give the callee the caller's deps
    and budget."""

    __slots__ = ("_asked", "around", "caller", "configs", "path", "record")

    def __init__(
        self,
        caller: RunScope,
        path: tuple[str, ...],
        configs: tuple[object, ...],
        relay: Callable[[Event], None] | None,
        options: RunOptions,
        record: str | None = None,
    ) -> None:
        #: The caller's run scope (``caller`` too: what RunHandle ownership reads).
        self.around = self.caller = caller
        #: The id of the caller's run record (with a store): the callee's record's parent.
        self.record = record
        self._asked = False
        RunScope.__init__(self, path[-1], None, caller.deadline)
        #: The agents above the callee, outermost first, and their configurations.
        self.path = path
        self.configs = configs
        self.options = options
        if relay is not None:
            above = path[-1:]  # each level adds its caller: the levels above add theirs

            def forward(event: Event) -> None:
                if not isinstance(event, HandleFinished | ModelRetry):
                    event = replace(event, path=above + event.path)
                relay(event)

            self.add_listener(forward)

    # The callee reads these through the chain: they look through to the caller.
    @property
    def _interrupt_requested(self) -> bool:
        return self._asked or self.around.interrupt_requested

    @_interrupt_requested.setter
    def _interrupt_requested(self, value: bool) -> None:
        self._asked = value

    @property
    def _interrupt_waiters(self) -> list[Any]:
        # A wait for an interrupt below (a retry's backoff) registers with the caller's
        # scopes too: the caller's interrupt wakes it at once.
        return _Waiters(self.around)

    @_interrupt_waiters.setter
    def _interrupt_waiters(self, value: object) -> None:
        pass

    @property
    def expiring(self) -> bool:
        return past_deadline(self.around)

    @property
    def run_id(self) -> str | None:
        return self.around.run_id


class _Waiters(list[Any]):
    """What a CallScope shows as its interrupt waiters: entries go to its caller's."""

    def __init__(self, caller: RunScope) -> None:
        super().__init__()
        self.caller = caller

    def append(self, entry: Any) -> None:
        for scope in self.caller._chain():  # the lock is held by the one who registers
            if scope._interrupt_waiters is None:
                scope._interrupt_waiters = []
            scope._interrupt_waiters.append(entry)

    def remove(self, entry: Any) -> None:
        for scope in self.caller._chain():
            waiters = scope._interrupt_waiters
            if isinstance(waiters, _Waiters) or (waiters is not None and entry in waiters):
                waiters.remove(entry)


class AgentTool(Tool):
    """An agent offered to another agent as a tool (``agent.as_tool()``)."""

    __slots__ = ("agent", "max_depth", "task_deps")
    resumes = True
    agent: AnyAgent
    #: The deps its runs get (NO_DEPS: the caller's run's, else the agent's own).
    task_deps: object
    max_depth: int

    @classmethod
    def of(
        cls,
        agent: AnyAgent,
        name: str | None,
        description: str | None,
        deps: object,
        max_depth: int,
    ) -> AgentTool:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
            raise ValueError(f"as_tool(max_depth=...) must be a positive int, got {max_depth!r}")
        name = name if name is not None else _tool_name(agent.name)
        if description is None:
            description = (
                f"Hand a task to the agent {agent.name!r}; it works on it on its own and "
                "answers with its result."
            )
        made = cls.from_schema(name, description, dict(_TASK_SCHEMA), _Call(), idempotent=False)
        assert isinstance(made, AgentTool)
        made.agent, made.task_deps, made.max_depth = agent, deps, max_depth
        fn = made.fn
        assert isinstance(fn, _Call)
        fn.tool = made
        return made

    def __repr__(self) -> str:
        return f"<AgentTool {self.name!r} -> agent {self.agent.name!r}>"


def _tool_name(name: str) -> str:
    cleaned = "_".join(_SAFE.findall(name.replace(".", "_")))[:64]
    return cleaned or "agent"


# -- a call ---------------------------------------------------------------------------


class _Call:
    """What an AgentTool runs: one call of the agent, nested under the caller's run."""

    __slots__ = ("tool",)
    tool: AgentTool

    async def __call__(self, arguments: dict[str, Any], ctx: ToolContext) -> str | ToolOutcome:
        task = arguments.get("task")
        if not isinstance(task, str) or not task.strip():
            return ToolOutcome("the argument 'task' must be a non-empty string", True)
        caller = ctx.caller
        if not isinstance(caller, tuple):  # called by hand, outside an agent's run
            fresh = self.tool.agent.nested(None, None)
            return _answer(fresh, await fresh.finish(task))
        session, run, relay = caller
        return await _nested(self.tool, session, run, relay, ctx, task)


async def _nested(
    tool: AgentTool,
    session: Session,
    run: RunState,
    relay: Callable[[Event], None] | None,
    ctx: ToolContext,
    task: str,
) -> str | ToolOutcome:
    """Run (or continue) the called agent in its session under the caller's run."""
    outer = run.scope.parent if isinstance(run.scope.parent, CallScope) else None
    path = (*(outer.path if outer else ()), session.config.name)
    configs = (*(outer.configs if outer else ()), session.config)
    refusal = _refused(tool, path, configs)
    if refusal is not None:
        return refusal
    assert run.budget is not None
    deps = tool.task_deps
    if deps is NO_DEPS:
        deps = run.deps if run.deps is not None else tool.agent.config.deps
    options = RunOptions(deps=deps, shared=run.budget.for_callee())
    record = session.durable.run
    scope = CallScope(run.scope, path, configs, relay, options,
                      None if record is None else record.id)
    child = session.held.pop(ctx.call_id, None) or tool.agent.nested(
        session.store, _session_name(session, ctx.call_id)
    )
    token = current_scope.set(scope)
    final: RunFinished | None = None
    held = False
    try:
        final = await _run_child(child, task)
        held = final is None or final.status == "paused"
    except asyncio.CancelledError:
        await _record_stop(session, run, ctx, child)
        raise
    finally:
        current_scope.reset(token)
        if held:
            session.held[ctx.call_id] = child  # open until the caller's resume
        else:
            await child.aclose()
    if final is None or held:
        return Held(f"[paused: agent {child.name!r} waits for a decision]", False)
    return _answer(child, final)


def _refused(
    tool: AgentTool, path: tuple[str, ...], configs: tuple[object, ...]
) -> ToolOutcome | None:
    """The result of a call that must not run: a cycle, or past the depth limit."""
    if tool.agent.config in configs:
        chain = " -> ".join((*path, tool.agent.name))
        return ToolOutcome(f"[not run: agent {tool.agent.name!r} is already running above "
                           f"this call ({chain}); an agent cannot call itself]", True)
    if len(path) > tool.max_depth:
        return ToolOutcome(
            f"[limit:depth: agent {tool.agent.name!r} not run: the agent tree's depth limit "
            f"of {tool.max_depth} would be crossed ({len(path)})]", True
        )
    return None


async def _run_child(child: AnyAgent, task: str) -> RunFinished | None:
    """The called agent's run: continued where it stopped if its session holds this
    task unfinished (a pause, a crash), else the task from the start; None when it
    still waits for a decision (the call stays held)."""
    await child.open()
    if child.resumable and _last_task(child.messages) == task:
        await _end_dead_run(child)
        if child.pending_approvals:
            return None
        return await child.finish(None)
    return await child.finish(task, reset=True)


async def _end_dead_run(child: AnyAgent) -> None:
    """A crash left the called agent's last run ``running`` (its record says so while a
    writer holds the session, and this process holds it now): record it failed, as
    recovery records a top-level run that died. Its call goes on as a new run."""
    await child.end_dead_run(
        f"{DIED} (at message {len(child.messages)}); it went on inside the run that "
        "called it"
    )


def _last_task(messages: list[Message]) -> str | None:
    for message in reversed(messages):
        if message["role"] != "user" or message.get("aimu_sent") or is_correction(message):
            continue
        if message["content"] != FINAL_TURN_PROMPT:
            return str(message["content"])
    return None


def _session_name(session: Session, call_id: str) -> str | None:
    """The called agent's session in the caller's store (None without one)."""
    if session.store is None or session.name is None:
        return None
    messages = session.messages
    turn = next(
        (i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "assistant"
         and any(c["id"] == call_id for c in cast(AssistantMessage, messages[i]).get(
             "tool_calls", ()))),
        len(messages),
    )
    return nested_session_name(session.name, turn, call_id)


def nested_session_name(caller: str, turn: int, call_id: str) -> str:
    """The session of the agent called by ``call_id`` in the turn at index ``turn`` of
    session ``caller``: ``caller--turn.call_id`` (hashed past 128 characters, or for a
    call id a session name cannot hold)."""
    name = f"{caller}--{turn}.{call_id}"
    if len(name) <= 128 and _SAFE.fullmatch(call_id):
        return name
    digest = hashlib.sha256(f"{caller}\0{turn}\0{call_id}".encode()).hexdigest()[:24]
    return f"{caller[:90]}--{turn}.{digest}"


def _answer(child: AnyAgent, final: RunFinished) -> str | ToolOutcome:
    """The call's result: the agent's answer, or how it stopped and what it produced."""
    if final.status in ANSWERED:
        output = child.last_run.output if child.last_run is not None else None
        if child.config.output is not None and output is not None:
            return to_text(_plain(output))
        return final.reply
    what = {
        "interrupted": "was interrupted before it finished",
        "limited": f"stopped at a limit ({(child.last_run and child.last_run.limit) or ''})",
    }.get(final.status, f"ended {final.status}")
    return ToolOutcome(f"[{final.status}: agent {child.name!r} {what}; {_produced(child)}]", True)


def _plain(output: object) -> object:
    dump = getattr(output, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    return output


def _produced(child: AnyAgent) -> str:
    """What the agent's last run produced, in a few words and its last text."""
    result = child.last_run
    messages = [] if result is None else result.messages
    calls = sum(len(m.get("tool_calls", ())) for m in messages if m["role"] == "assistant")
    texts = [m["content"] for m in messages if m["role"] == "assistant" and m["content"]]
    said = f"{calls} tool call{'s' if calls != 1 else ''} made"
    if not texts:
        return f"{said}, no text yet"
    last = texts[-1]
    if len(last) > _SHOWN:
        last = last[:_SHOWN] + " [...]"
    partial = " (cut short)" if messages and messages[-1].get("aimu_partial") else ""
    return f"{said}; its last text{partial}: {last}"


async def _record_stop(session: Session, run: RunState, ctx: ToolContext, child: AnyAgent
                       ) -> None:
    """A cancel reached the call: the caller's transcript records that the agent was
    cancelled and what it had produced (the cancel goes on)."""
    if run.phase is Phase.SETTLED:
        return
    result: ToolMessage = {
        "role": "tool",
        "content": f"[cancelled: agent {child.name!r} was stopped; {_produced(child)}]",
        "tool_call_id": ctx.call_id,
        "name": ctx.tool_name,
    }
    try:
        await session.record(result)
    except Exception:  # the settling answers it "cancelled" instead
        if session.messages and session.messages[-1] is result:
            session.messages.pop()


# -- the tree, from the top -------------------------------------------------------------


def _agent_tools(tools: tuple[Tool, ...]) -> Iterator[AgentTool]:
    return (tool for tool in tools if isinstance(tool, AgentTool))


def check_tree(agent: AnyAgent) -> None:
    """ValueError when ``agent``'s tools call agents in a cycle (``agent`` itself
    among them), or deeper than a tool's ``max_depth``."""

    def walk(tools: tuple[Tool, ...], path: tuple[AnyAgent, ...]) -> None:
        for tool in _agent_tools(tools):
            callee = tool.agent
            if any(callee is seen or callee.config is seen.config for seen in path):
                chain = " -> ".join(a.name for a in (*path, callee))
                raise ValueError(
                    f"agent {agent.name!r}: its tools call agents in a cycle ({chain}); an "
                    "agent cannot be its own tool, directly or through others"
                )
            if len(path) > tool.max_depth:
                raise ValueError(
                    f"agent {agent.name!r}: agent {callee.name!r} is called {len(path)} "
                    f"agents deep, past its tool's max_depth of {tool.max_depth}"
                )
            walk(callee.config.table.local, (*path, callee))

    walk(agent.config.table.local, (agent,))


def held_pending(session: Session) -> list[PendingApproval]:
    """The calls that agents called (and held open) wait on, with their path."""
    return [
        replace(pending, path=(call_id, *pending.path))
        for call_id, child in session.held.items()
        if child.loaded
        for pending in child.pending_approvals
    ]


def route_decision(
    session: Session, call: str | PendingApproval
) -> tuple[AnyAgent, str | PendingApproval] | None:
    """The held agent a decision on ``call`` goes to, and the call as it knows it; None
    when the call is the session's own (or nobody's: the session says so)."""
    if isinstance(call, PendingApproval):
        if not call.path:
            return None
        child = session.held.get(call.path[0])
        if child is None:
            raise ValueError(f"no agent called as tool call {call.path[0]!r:.80} waits")
        return child, replace(call, path=call.path[1:])
    if call in session.approvals.pending:
        return None
    for child in session.held.values():
        if child.loaded and any(p.call_id == call for p in child.pending_approvals):
            return child, call
    return None


async def open_held(session: Session) -> None:
    """With a store: open the sessions of the agents whose calls the session's last
    turn holds open, so their waiting calls are known at the top (once loaded)."""
    if session.store is None:
        return
    for _, call in dangling_calls(session.messages):
        tool = session.config.table.by_name.get(call["function"]["name"])
        if not isinstance(tool, AgentTool) or call["id"] in session.held:
            continue
        child = tool.agent.nested(session.store, _session_name(session, call["id"]))
        await child.open()
        if child.pending_approvals:
            session.held[call["id"]] = child
        else:
            await child.aclose()


async def stored_pending(store: Store, session: str) -> list[PendingApproval]:
    """The calls that agents called by ``session`` (their calls held open) wait on, read
    from ``store`` without opening any session (what serve lists for a paused run)."""
    found: list[PendingApproval] = []
    for turn, call in dangling_calls(await store.load(session)):
        name = nested_session_name(session, turn, call["id"])
        if await store.info(name) is None:
            continue
        approvals = Approvals.from_state(await store.load_state(name), name)
        below = [*approvals.waiting(), *await stored_pending(store, name)]
        found.extend(replace(p, path=(call["id"], *p.path)) for p in below)
    return found


async def close_held(session: Session) -> None:
    held, session.held = session.held, {}
    for child in held.values():
        await child.aclose()
