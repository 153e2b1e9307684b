"""The run driver: open the session for a run, then ``match run.next`` for the step to
run (a model turn, a tool round) until the run has its outcome; one ``finally`` settles.

Every message is recorded the moment it exists, so whatever ends the run (answer,
error, cancel, interrupt, a consumer that stops iterating) the transcript is valid to
send to a model again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from aimu.aio._run_options import NO_DEPS, RunOptions, options_in
from aimu.aio._tracing import RunSpans
from aimu.aio.events import Event, RunStarted
from aimu.aio.guardrails import InputGuard, run_guardrails
from aimu.aio.instructions import instructions_text
from aimu.aio.limits import Budget
from aimu.aio.scope import RunSeat
from aimu.aio.transcript import UserMessage, dangling_calls

from .handoffs import follow_speaker
from .session import NO_RERUNS, Session
from .settle import settle
from .state import NEEDS_MODEL, Ended, NeedsModel, NeedsTools, Phase, RunState
from .tool_round import tool_round
from .tree import close_held
from .turn import answer_passes, context_hit, model_turn, output_checked
from .wall import WallTimer

__all__ = ["run_events"]


async def run_events(
    session: Session,
    task: str | None,
    reset: bool,
    options: RunOptions,
    seat: RunSeat,
) -> AsyncGenerator[Event, None]:
    """The run as events, ending with one RunFinished (``task`` None: resume). The run
    claims the session's ``seat`` as it starts; settling releases it."""
    client = session.client
    name = session.agent_name  # the run's agent, whoever has the conversation (handoffs)
    scope = seat.claim(options)
    run = RunState(scope, RunSpans(name, client.model, client.provider), session.messages, options)
    failure: BaseException | None = None
    stopped_by: BaseException | None = None
    try:
        await _open(session, run, task, reset)
        run.phase = Phase.RUNNING
        try:
            yield run.publish(RunStarted(name, task))
        except BaseException:
            run.phase = Phase.CLOSING  # thrown in at a yield: the consumer is done reading
            raise
        await _pick_up(session, run, task)
        emit = run.scope.emit  # each event to the scope's listeners, then the consumer
        while (step := await _next_step(session, run)) is not None:
            try:
                async for event in step:
                    emit(event)
                    try:
                        yield event
                    except BaseException:
                        # Thrown in at a yield (aclose, athrow): the consumer is done
                        # reading. Closing the step awaits: a cancel may come.
                        run.phase = Phase.CLOSING
                        raise
            except BaseException:
                # Left at a yield (the consumer closed or threw): the step is closed here
                # (a step that raised has ended; aclosing() would close it too: ~4k a round).
                await step.aclose()
                raise
    except BaseException as error:
        run.stopped_by(error)
        stopped_by = error
        if isinstance(error, GeneratorExit) or run.phase is Phase.CLOSING:
            raise  # the consumer stopped iterating: settle below, never yield again
        failure = error
    finally:
        final = await settle(session, run, seat, stopped_by)
    failure = failure or run.store_error
    if failure is None:
        yield final
        return
    # Deliver the terminal event, then the exception, whatever the consumer does next.
    try:
        yield final
    except GeneratorExit:
        raise failure from None
    raise failure


async def _open(session: Session, run: RunState, task: str | None, reset: bool) -> None:
    """Put the session in order for a run: the store opened, the instructions
    evaluated (a raising ``system=`` function fails the run here, nothing stored),
    reset, system prompt, the task recorded (the first of the run's messages)."""
    config, options = session.config, run.options
    run.deps = config.deps if options.deps is NO_DEPS else options.deps
    await config.table.ready()
    await session.open()
    if config.handoffs or session.handoff is not None:  # who has the conversation
        await follow_speaker(session, reset)
        config = session.config
    if config.system is not None and not isinstance(config.system, str):
        context = session.run_context(task, run.deps)
        run.phase = Phase.INSTRUCTING
        session.system_text = await instructions_text(config.system, context, config.name)
        run.phase = Phase.OPENING
    # A workflow's limits bound all its agent runs together (shared), not each one.
    shared = options_in(run.scope.parent).shared
    own = options.limits if options.shared is None else None
    run.budget = budget = Budget(
        config.limits if own is None else own, config.session_limits, session.durable.spend,
        session.client.model, shared,
    )
    if task is None and budget.limited:  # a run that died goes on with its budget
        spent = await session.continued_spend()
        if spent is not None:
            spent.wall = 0.0  # the run's clock is its own
            budget.run.add(spent)
    if budget.wall_at is not None:  # one timer for the run, armed now
        loop = asyncio.get_running_loop()
        run.wall = WallTimer(loop.time() + budget.wall_at - time.monotonic())
    messages = session.messages
    if reset:
        messages.clear()
        session.reruns = NO_RERUNS
        session.approvals.clear()
        session.durable.forget()
        await session.drop_inputs()
    session.place_system()
    await session.before_run()
    run.first = len(messages)
    if task is None:
        session.require_task()
    else:
        if session.held:  # agents called that paused: a new task drops their calls
            await close_held(session)
        await session.drop_undone_calls()
        message: UserMessage = {"role": "user", "content": task}
        if run.options.images:
            message["images"] = list(run.options.images)
        await session.record(message)
        if config.input_guardrails:  # beside the first turn, from now on
            run.guard = InputGuard(config.input_guardrails, session.run_context(task, run.deps),
                                   task)
    await session.set_status("in_progress")
    await session.start_run(run)


async def _pick_up(session: Session, run: RunState, task: str | None) -> None:
    """Where the run starts: the rounds the task has used, the calls a pause or a
    crash left open (resume runs them), or a resumed answer: cut off if it was, and
    corrected first if it is not a valid typed answer."""
    run.rounds, run.final_prompted = session.rounds_used()
    if task is None and session.config.input_guardrails and await _resumed_blocked(session, run):
        return
    if task is None:
        messages = session.messages
        open_calls = [call for _, call in dangling_calls(messages)]
        if open_calls:
            run.next = NeedsTools(open_calls, session.reruns)
            session.reruns = NO_RERUNS
            return
        answer = session.finished_answer()
        if answer is not None:
            run.stop_reason = answer.get("aimu_stop_reason")
            # A fresh run: a correction here costs none of its output retries.
            if await output_checked(session, run, answer["content"], schema_asked=False) \
                    and await answer_passes(session, run, answer):
                run.end("completed", answer["content"])
            return
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("aimu_partial"):
            run.cut_answer = last


async def _resumed_blocked(session: Session, run: RunState) -> bool:
    """A resume goes on with the task the input guardrails may have blocked: they check
    it again, first (nothing runs before they pass); True when it is blocked."""
    text = session.task_text()
    if text is None:
        return False
    context = session.run_context(text, run.deps)
    tripped = await run_guardrails("input", session.config.input_guardrails, context, text)
    if tripped is not None:
        run.blocked(tripped)
    return tripped is not None


async def _next_step(session: Session, run: RunState) -> AsyncGenerator[Event, None] | None:
    """The step to run next, or None once the run has its outcome. Text sent to the
    run joins it here, at the boundary, even after an answer; a usage limit the
    step would cross stops the run here."""
    budget = run.budget
    assert budget is not None
    match run.next:
        case NeedsModel():
            pass  # a model turn, below: sent text joins first, a limit may stop it
        case NeedsTools(calls) as tools:
            hit = budget.before_tools(len(calls)) if budget.limited else None
            if hit is not None:
                run.limited(hit)  # the calls stay open: resume() runs them
                return None
            return tool_round(session, run, tools)
        case Ended("completed" | "incomplete") if await session.join_sent(run.scope):
            run.next = NEEDS_MODEL  # text sent as the answer came: the run goes on with it
        case Ended():
            return None
    if session.durable.carried.messages or run.scope.has_sent():
        await session.join_sent(run.scope)
    if run.interrupt_asked():  # the step boundary
        run.interrupted()
        return None
    hit = budget.before_request() if budget.limited else None
    client = session.client
    if hit is None and (client.context_window is not None
                        or client.discovers_context_window):
        hit = await context_hit(session)
    if hit is not None:
        run.limited(hit)
        return None
    if session.handoff is not None:
        await follow_speaker(session)  # a transfer taken in the last round
    return model_turn(session, run)
