"""The tool round: the calls of the last turn sorted (run, refused, waiting for a
person), run one by one or side by side, each result recorded the moment it exists."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing

from aimu.aio._stops import CLOSED
from aimu.aio.approvals import Decision, denied_result
from aimu.aio.ends import PAUSED, Halt
from aimu.aio.events import Event, StepFinished, ToolCallStarted, ToolProgress, ToolResult
from aimu.aio.guardrails import guarded_call
from aimu.aio.journal import RERUN_NOTE
from aimu.aio.tools import Tool, ToolContext, ToolOutcome, invoke
from aimu.aio.transcript import ToolCall

from .session import Session, tool_message
from .state import NEEDS_MODEL, Held, NeedsTools, Phase, RunState
from .wall import WallReached

__all__ = ["tool_round"]

_PAUSED = Halt("paused")
_APPROVED = Decision(True)
_REFUSED = Decision(False, "refused by the policy")


async def tool_round(
    session: Session, run: RunState, step: NeedsTools
) -> AsyncGenerator[Event, None]:
    """Run the last turn's calls, recording each result as it exists; ends the step
    (a model turn comes next), or pauses the run when calls wait for a person."""
    config = session.config
    name = config.name
    calls, answered, asked = _sort_calls(session, step.calls)
    if run.budget is not None:
        run.budget.count_tools(len(calls))
    for call, given in answered:
        # Recorded before its start is told: a result given from outside (or a denial)
        # is accepted input, so a consumer leaving at the start event must not lose it.
        answer = await _call_tool(session, call, run, given, False)
        yield _call_started(name, call)
        if answer is not None:
            yield answer
    try:
        if config.concurrent_tools and len(calls) > 1:
            for call, _ in calls:
                yield _call_started(name, call)
            together = [call for call, _ in calls]
            async with aclosing(_calls_as_tasks(session, together, run, step)) as events:
                async for event in events:
                    yield event
        else:
            for call, tool in calls:
                yield _call_started(name, call)
                if tool is None or not tool.from_schema_given:
                    called = _call_tool(session, call, run, *_as_in(step, call))
                    result = await (called if run.wall is None else run.wall.guard(called))
                    if result is not None:
                        yield result
                    continue
                # A server's tool may report progress while it runs: its events come
                # first (a task runs the call; a wall limit cuts the wait for it).
                async with aclosing(_calls_as_tasks(session, [call], run, step)) as events:
                    async for event in events:
                        yield event
    except WallReached:
        assert run.budget is not None
        await session.answer_cut_calls()
        run.limited(run.budget.wall_hit())
        return
    run.next = NEEDS_MODEL
    if asked or run.held:  # calls wait for a person (here, or in an agent called)
        for call in asked:
            tool = session.tool_named(call["function"]["name"])
            session.approvals.ask(
                call, run_id=run.scope.run_id, external=tool is not None and tool.external
            )
        await session.save_state()
        run.end("paused", PAUSED)
        run.scope.note_halt(_PAUSED)
        return
    yield StepFinished(name, run.rounds)


def _sort_calls(
    session: Session, calls: list[ToolCall]
) -> tuple[list[tuple[ToolCall, Tool | None]], list[tuple[ToolCall, ToolOutcome]],
           list[ToolCall]]:
    """The calls to run now (each with its tool, None if the model named no tool there
    is), those answered without running (refused, or an external tool's result given),
    and those that wait: by the decision given, else the policy or tool."""
    run_now: list[tuple[ToolCall, Tool | None]] = []
    answered: list[tuple[ToolCall, ToolOutcome]] = []
    asked: list[ToolCall] = []
    for call in calls:
        tool = session.tool_named(call["function"]["name"])
        decision = session.approvals.take(call["id"]) or _policy(session, call, tool)
        if decision is None:
            asked.append(call)
        elif decision.result is not None:
            answered.append((call, ToolOutcome(decision.result, False)))
        elif decision.approved:
            run_now.append((call, tool))
        else:
            answered.append((call, ToolOutcome(denied_result(decision.reason), True)))
    return run_now, answered, asked


def _policy(session: Session, call: ToolCall, tool: Tool | None) -> Decision | None:
    """What the agent's ``approve=`` policy, or the tool's ``approval`` flag, says
    of a call no person decided on; None: ask a person (always, for an external
    tool's call: its result comes from outside)."""
    function = call["function"]
    if tool is not None and tool.external:
        return None
    policy = session.config.approve
    if policy is not None:
        verdict = policy(function["name"], function["arguments"])
        if verdict == "ask":
            return None
        return _APPROVED if verdict else _REFUSED
    return None if tool is not None and tool.approval else _APPROVED


async def _calls_as_tasks(
    session: Session, calls: list[ToolCall], run: RunState, step: NeedsTools
) -> AsyncGenerator[Event, None]:
    """Run ``calls`` side by side; yield their progress and results (and the events of
    the agents they run) as they come. Leaving early (a cancel, a close) cancels the
    calls still running and waits."""
    queue: asyncio.Queue[Event | asyncio.Task[ToolResult | None]] = asyncio.Queue()
    tasks = [
        asyncio.ensure_future(
            _call_tool(session, call, run, *_as_in(step, call), queue.put_nowait)
        )
        for call in calls
    ]
    for task in tasks:
        task.add_done_callback(queue.put_nowait)
    why: str | None = None  # a cancel's reason goes on to the calls (an agent's record)
    try:
        left = len(tasks)
        while left:
            item = await (queue.get() if run.wall is None else run.wall.guard(queue.get()))
            if isinstance(item, asyncio.Task):
                left -= 1
                result = item.result()
                if result is not None:  # None: held open (see _call_tool)
                    yield result
            else:
                yield item
    except asyncio.CancelledError as error:
        why = error.args[0] if error.args and isinstance(error.args[0], str) else None
        raise
    except GeneratorExit:
        why = CLOSED
        raise
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel(why)
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        while not queue.empty():  # left early: what the calls told is still told
            item = queue.get_nowait()
            if not isinstance(item, asyncio.Task):
                run.publish(item)


async def _call_tool(
    session: Session,
    call: ToolCall,
    run: RunState,
    given: ToolOutcome | None,
    rerun: bool,
    progress: Callable[[Event], None] | None = None,
) -> ToolResult | None:
    """Run one call (its start journaled first, with a store) and record its result
    the moment it exists; a call answered without running gets ``given``. A call whose
    agent paused (``agent.as_tool()``) is held open: None, and the run pauses."""
    config = session.config
    if given is not None:
        outcome = given
    else:
        await session.journal_start(call)
        context = ToolContext(
            agent=config.name,
            call_id=call["id"],
            tool_name=call["function"]["name"],
            interrupt_probe=run.interrupt_asked,
            deps=run.deps,
            shared_state=session.durable.shared,
            progress=None if progress is None else _progress_sink(config.name, call, progress),
            caller=(session, run, progress),
        )
        run.calls_in_flight.add(context)
        if config.tool_guardrails:  # arguments checked first, the result after
            calling = guarded_call(
                config.tool_guardrails, session.run_context(session.task_text(), run.deps),
                call, lambda: invoke(config.table.by_name, call, context),
            )
        else:
            calling = invoke(config.table.by_name, call, context)
        outcome = await run.spans.within(calling)
        context.mark_finished()
        run.calls_in_flight.discard(context)
        if isinstance(outcome, Held):
            run.held.append(call)
            return None
        if rerun:  # a call a crash left in doubt, run again
            outcome = ToolOutcome(f"{RERUN_NOTE}\n{outcome.content}", outcome.is_error)
    result = tool_message(call, outcome)
    if run.phase is not Phase.SETTLED:
        await session.record(result)
    return ToolResult(config.name, call["id"], result["name"], result["content"], outcome.is_error)


def _as_in(step: NeedsTools, call: ToolCall) -> tuple[ToolOutcome | None, bool]:
    """How ``step`` runs ``call`` (``given``, ``rerun``): answered with its argument
    error, if its arguments did not parse; run again with a note, if a crash left it in
    doubt."""
    error = step.argument_errors.get(call["id"])
    return None if error is None else ToolOutcome(error, True), call["id"] in step.reruns


def _progress_sink(
    source: str, call: ToolCall, emit: Callable[[ToolProgress], None]
) -> Callable[[float, float | None, str | None], None]:
    call_id, name = call["id"], call["function"]["name"]

    def report(progress: float, total: float | None, message: str | None) -> None:
        emit(ToolProgress(source, call_id, name, progress, total, message))

    return report


def _call_started(name: str, call: ToolCall) -> ToolCallStarted:
    function = call["function"]
    return ToolCallStarted(name, call["id"], function["name"], function["arguments"])
