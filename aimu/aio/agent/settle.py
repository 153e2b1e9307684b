"""Settling a run: the one place its record and result are made.

However the run ended (answer, error, cancel, interrupt, a consumer that stopped
iterating), :func:`settle` leaves a valid transcript, stores what it added, and makes
the run's :class:`RunResult` and :class:`RunFinished`.
"""

from __future__ import annotations

from typing import Any

from aimu.aio._stops import Stop, stop_of
from aimu.aio.ends import ANSWERED, STOPPED, error_text, run_finished
from aimu.aio.errors import StoreError
from aimu.aio.events import RunFinished, RunResult
from aimu.aio.scope import RunSeat
from aimu.aio.transcript import Message, add_usage

from .session import Session, joined
from .state import Phase, RunState

__all__ = ["settle"]


async def settle(
    session: Session,
    run: RunState,
    seat: RunSeat,
    stopped_by: BaseException | None,
) -> RunFinished:
    """Leave a valid transcript however the run ended (``stopped_by`` the error that
    ended it, if one did), release the session's ``seat``, publish the run's
    RunFinished (returned for the consumer), end its span and log how it stopped.

    Memory is settled first; a store that fails now is kept in ``run.store_error``
    (the run ends ``failed``, its transcript in memory and restorable).
    """
    phase, run.phase = run.phase, Phase.SETTLED
    if run.wall is not None:
        run.wall.close()
    if run.guard is not None:  # input guardrails still running: cancelled now...
        run.guard.cancel()
    for context in run.calls_in_flight:
        context.mark_cancelled()
    messages = session.messages
    unstored = _kept_partial(session, run)
    if run.status in STOPPED and (phase is Phase.RUNNING or phase is Phase.CLOSING):
        unstored.extend(session.cancel_last_calls())
        session.approvals.clear()
    sent = run.scope.take_sent(close=True)
    if run.status == "paused":
        # Joins the resumed run at its first boundary; stored in the session's state.
        session.durable.carried.add(sent, len(messages))
    else:
        unstored.extend(sent)
        messages.extend(sent)
    if run.budget is not None:
        run.budget.finish()
    try:
        untouched = phase is Phase.INSTRUCTING  # its instructions raised: nothing changed
        await session.store_settled(unstored, None if untouched else run.status)
    except StoreError as error:
        run.store_error = error
        run.status, run.error = "failed", error_text(error)
    finally:
        add_usage(session.usage, run.usage)
        result = _result_of(session, run)
        seat.release(result)
    final = run_finished(result)
    stop = _stop_of(session, run, final, stopped_by or run.store_error)
    await session.end_run(run, stop)  # the run's record, before anyone sees it end
    run.scope.emit(final)
    run.spans.finished(final, stop.status, stop.reason)
    stop.log(session.agent_name)
    if run.guard is not None:  # ... and awaited last (memory and store settled first)
        await run.guard.close()
    return final


def _kept_partial(session: Session, run: RunState) -> list[Message]:
    """Keep what a turn cut short streamed (marked partial, its usage estimated): in
    memory, and returned to be stored (nothing: none streamed, or it replaced the answer
    it continued, so the stored transcript is rewritten)."""
    messages = session.messages
    inflight = run.turn
    if inflight is None or not inflight.assembler.started:
        if inflight is not None:
            run.count_unanswered(inflight)  # no byte answered: its estimate goes
        return []
    unstored: list[Message] = []
    partial = session.mark_speaker(inflight.assembler.message())
    if inflight.prefix is not None:  # a continuation cut short: one answer, partial
        partial = joined(inflight.prefix, partial)
        messages[-1] = partial
        session.durable.transcript_stale = True
    else:
        unstored.append(partial)
        messages.append(partial)
    run.reply = run.reply or partial["content"]
    run.count_estimated(messages, inflight)
    return unstored


def _stop_of(
    session: Session, run: RunState, final: RunFinished, error: BaseException | None
) -> Stop:
    """How the run ended, for its span and the log (a deadline's cancel: timed_out)."""
    waiting = [f"{p.tool} ({p.call_id})" for p in session.approvals.pending.values()]
    limit = None if run.limit is None else run.limit.message
    return stop_of(final, error, run.scope, waiting, session.config.max_rounds, limit)


def _result_of(session: Session, run: RunState) -> RunResult[Any]:
    """The run's result, once settled: what it returned and added, and its numbers."""
    duration, started_at, ended_at = run.clock.span()
    return RunResult(
        source=session.agent_name,
        status=run.status,
        output=_output_of(session, run),
        reply=run.reply,
        stop_reason=run.stop_reason,
        usage=run.usage,
        requests=run.requests,
        retries=run.scope.retries,
        duration=duration,
        started_at=started_at,
        ended_at=ended_at,
        messages=session.messages[run.first:],  # no copy: ~6 us a message, per run
        error=run.error,
        run_id=run.scope.run_id,
        spend=None if run.budget is None else run.budget.run,
        continuation=run.continuation,
        usage_estimated=run.usage_estimated,
        limit=None if run.limit is None else run.limit.message,
    )


def _output_of(session: Session, run: RunState) -> object:
    """What ``run()`` returns for ``run``: its text, or its ``output_type`` value (None
    when it raises, or ended without a valid answer)."""
    if run.status in STOPPED:
        return None
    if session.config.output is None:
        return run.reply
    return run.output if run.status in ANSWERED else None
