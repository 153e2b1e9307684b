"""The model turn: plan the request, stream it, assemble and record the reply, decide
what comes next (``run.next``); a due summary first, a cut answer continued."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextvars import Token

from aimu.aio.client import (
    Chunk,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    TurnAssembler,
    TurnDone,
    TurnRetry,
)
from aimu.aio.context import ContextPolicy, SummarizeOlderTurns, Summary
from aimu.aio.ends import error_text
from aimu.aio.errors import ModelError, ModelProtocolError
from aimu.aio.events import CUT_OFF_REASONS, Event, TextChunk, ThinkingChunk, TurnRetried
from aimu.aio.guardrails import GuardCut, InputGuard, Tripped, guarded, run_guardrails
from aimu.aio.limits import LimitHit, estimate_tokens, transcript_chars
from aimu.aio.output import is_correction, turn_request
from aimu.aio.scope import RunScope, current_scope
from aimu.aio.tools import ToolOutcome
from aimu.aio.transcript import AssistantMessage, Message, Usage, add_usage, zero_usage

from .session import Session, tool_message
from .state import FINAL_TURN_PROMPT, NEEDS_MODEL, NeedsTools, RunState, TurnInFlight
from .wall import WallReached, walled

__all__ = ["answer_passes", "context_hit", "model_turn", "output_checked"]

#: Requests smaller than this (estimated tokens) fit every model: no need to ask the
#: server for the model's context window until one grows past it.
_ASK_WINDOW_FROM = 1024

_NO_ROUNDS_LEFT = "[not run: no tool rounds were left]"


async def model_turn(session: Session, run: RunState) -> AsyncGenerator[Event, None]:
    """One model turn, streamed; it ends recorded, with ``run.next`` set.

    The provider's stream is stepped here, not through a wrapper (a generator frame per
    chunk) unless a ``wall`` limit cuts each step. Its first step opens the request and
    waits out its retries: the run's scope is current until the first chunk comes (so
    the retry wait sees the run's interrupt and deadline even outside any handle), and
    never while an event is with the consumer."""
    final_turn = run.rounds >= session.config.max_rounds
    if (final_turn or session.config.context is not None) and not await _before_request(
        session, run, final_turn
    ):
        return
    inflight, stream = _request(session, run, final_turn)
    budget, name = run.budget, session.config.name
    assert budget is not None
    chunks, guard = _cuts(stream, run)
    watch, streamed, hit, tripped = budget.watch, 0, None, False
    token: Token[RunScope | None] | None = current_scope.set(run.scope)
    try:
        if budget.limited:  # with no limit to keep, the usage is counted as it comes
            _count_before_sending(session, run, inflight)
            await session.keep_spend(budget)  # kept before the request is sent (see below)
        async for chunk in chunks:
            if token is not None:  # the first chunk: the request is open, retries over
                current_scope.reset(token)
                token = None
            if type(chunk) is TurnRetry:  # the stream broke; the request goes again
                hit, streamed = await _count_retry(session, run, chunk), 0
                if hit is not None:
                    break  # before the retry: the partial is kept, as any cut
            inflight.assembler.add(chunk)
            event = (
                TextChunk(name, chunk.text) if type(chunk) is TextDelta  # the most of them
                else _chunk_event(chunk, run, inflight, name)
            )
            if event is not None:
                yield event
                if watch and type(event) is not TurnRetried:  # a limit crossed yet?
                    streamed += len(event.text)  # type: ignore[union-attr]
                    hit = budget.streamed(
                        {"input_tokens": 0, "output_tokens": estimate_tokens(streamed)}
                    )
                    if hit is not None:
                        break
        if guard is not None and hit is None:
            await guard.decision()  # nothing of the turn counts before they decide
    except WallReached:
        hit = budget.wall_hit()
    except GuardCut:
        tripped = True
    except ModelError as error:
        await _interrupted_by(session, run, inflight, error)  # else raised
        return
    finally:
        if token is not None:
            current_scope.reset(token)
        await chunks.aclose()
    await _turn_over(session, run, inflight, hit, guard.tripped if tripped and guard else None)


async def _interrupted_by(
    session: Session, run: RunState, inflight: TurnInFlight, error: ModelError
) -> None:
    """The turn's request failed while an interrupt was asked: the interrupt is honoured
    (its retry wait was cut short), the partial reply, if any, kept and marked. Without
    an interrupt, ``error`` is raised: the run fails."""
    if not run.interrupt_asked():
        raise error
    if inflight.assembler.started:  # the stream broke and was to be asked again
        run.error = error_text(error)
        await _cut_short(session, run, inflight)
        run.interrupted()
    else:
        _interrupted_before_reply(run, inflight, error)


def _interrupted_before_reply(run: RunState, inflight: TurnInFlight, error: ModelError) -> None:
    """No byte of a reply came (an interrupt cut a retry's backoff short): nothing of
    this turn exists, so the interrupt is honoured as at a step boundary."""
    run.error = error_text(error)
    run.count_unanswered(inflight)
    run.turn = None
    run.interrupted()


def _cuts(
    stream: AsyncGenerator[Chunk, None], run: RunState
) -> tuple[AsyncGenerator[Chunk, None], InputGuard | None]:
    """The turn's stream, cut by a ``wall`` limit and by input guardrails that have not
    passed the task yet (each wrapper a frame: only runs that need one pay for it)."""
    chunks = stream if run.wall is None else walled(stream, run.wall)
    guard = run.guard if run.guard is not None and not run.guard.passed else None
    return (chunks, None) if guard is None else (guarded(chunks, guard), guard)


async def _turn_over(
    session: Session, run: RunState, inflight: TurnInFlight, hit: LimitHit | None,
    tripped: Tripped | None,
) -> None:
    """The stream is over: a tripwire or a limit cut the turn short, or it is recorded."""
    if tripped is not None:
        await _cut_short(session, run, inflight)
        run.blocked(tripped)
        run.spans.turn_ended(run.usage, tripped.stop_reason)
    elif hit is not None:
        await _cut_short(session, run, inflight)
        run.limited(hit)
        run.spans.turn_ended(run.usage, hit.stop_reason)
    else:
        await _record_turn(session, run, inflight)


async def _before_request(session: Session, run: RunState, final_turn: bool) -> bool:
    """What comes before the turn's request: the final-turn prompt once ``max_rounds``
    turns were made, and a summary if one is due (a request of its own). False when a
    wall limit cut the summary (the run ends limited)."""
    if final_turn and not run.final_prompted:
        await session.record({"role": "user", "content": FINAL_TURN_PROMPT})
        run.final_prompted = True
    context = session.config.context
    if isinstance(context, SummarizeOlderTurns):
        try:
            await _summarize(session, run, context)
        except WallReached:
            assert run.budget is not None
            run.limited(run.budget.wall_hit())
            return False
    return True


def _count_before_sending(session: Session, run: RunState, inflight: TurnInFlight) -> None:
    """Count the request's tokens up front (an estimate, replaced when the usage comes),
    when a limit could read them (without one, nothing reads the spend mid-stream).
    The caller then keeps the run's spend (and with ``session_limits`` the session's: a
    store's session saves them; one without a store has nothing to save) before the
    request is sent: a crash can lose the answer, never the count, so no kill loop
    escapes a run's or a session's budget (a resume of a run that died goes on with
    its spend, see ``Session.continued_spend``)."""
    budget = run.budget
    assert budget is not None
    inflight.counted = {"input_tokens": _prompt_tokens(session), "output_tokens": 0}
    budget.count_tokens(inflight.counted, estimated=False)


def _request(
    session: Session, run: RunState, final_turn: bool
) -> tuple[TurnInFlight, AsyncGenerator[Chunk, None]]:
    """Plan the turn's request (counted as one) and open its stream (not started)."""
    config, client, budget = session.config, session.client, run.budget
    assert budget is not None
    inflight = run.turn = TurnInFlight(TurnAssembler(client), len(session.messages), final_turn)
    run.requests += 1
    budget.count_request()
    run.spans.turn_started()
    # After a correction the model must answer: the schema goes, the tools wait.
    must_answer = final_turn or (config.output is not None and _after_correction(session))
    specs = None if must_answer else session.tool_specs()
    sent = _taken_up(session, run, inflight)
    if isinstance(config.context, SummarizeOlderTurns):
        sent = config.context.view_with(sent, session.durable.summary)
    elif config.context is not None:
        sent = list(config.context.view(sent))
    request = turn_request(
        config.output, config.tool_choice, config.parallel_tool_calls, specs, sent
    )
    inflight.schema_asked = request is not None and request.output_schema is not None
    if request is None:  # a client of our own without request= keeps working
        return inflight, client.stream_turn(sent, specs)
    return inflight, client.stream_turn(sent, specs, request=request)


async def _record_turn(session: Session, run: RunState, inflight: TurnInFlight) -> None:
    """The stream ended: record the whole reply and decide what comes next."""
    client, assembler = session.client, inflight.assembler
    if not assembler.done:
        raise ModelProtocolError(
            f"the model at {client.host} ended its turn without finishing it",
            host=client.host,
        )
    run.turn = None
    run.spans.turn_ended(assembler.usage, assembler.stop_reason)
    message = session.mark_speaker(assembler.message())
    if run.stop_reason in CUT_OFF_REASONS and not message.get("tool_calls"):
        # Kept with the answer: a resumed run must not take it as complete.
        message["aimu_stop_reason"] = run.stop_reason
    if inflight.prefix is None:
        await session.record(message)
    else:
        message = await session.keep_continued(inflight.prefix, message)
    await _end_turn(session, run, message, inflight)
    if not assembler.usage_reported and run.budget is not None and run.budget.watch:
        raise ModelProtocolError(
            f"the model at {client.host} reported no token usage, so the token or cost "
            "limit cannot be checked (aimu does not guess); remove that limit, or use a "
            "server that reports usage",
            host=client.host,
        )


def _taken_up(session: Session, run: RunState, inflight: TurnInFlight) -> list[Message]:
    """The messages this turn sends: with an answer a stop cut short last, either all
    of them (``resume(continue_partial=True)`` on a server that continues a trailing
    assistant message: the model goes on from the cut) or all but that answer (the
    model answers anew). Sets the turn's prefix and ``run.continuation``."""
    messages = session.messages
    cut, run.cut_answer = run.cut_answer, None
    if cut is None or not messages or messages[-1] is not cut:
        return messages
    if run.options.continue_partial and session.client.continues_partial:
        inflight.prefix, run.continuation = cut, "continued"
        return messages
    run.continuation = "re-asked"
    return messages[:-1]


async def context_hit(session: Session) -> LimitHit | None:
    """The model's context window, if the next request would not fit it. A server
    that can say the window is asked once a request grows past _ASK_WINDOW_FROM."""
    client = session.client
    policy = session.config.context
    needed = (
        _prompt_tokens(session) if policy is None
        else estimate_tokens(transcript_chars(_policy_view(session, policy), 0))
    )
    window = client.context_window
    if window is None and needed > _ASK_WINDOW_FROM:
        window = await client.discover_context_window()
    if window is None:
        return None
    return LimitHit("context_window", window, needed) if needed > window else None


def _policy_view(session: Session, policy: ContextPolicy) -> Sequence[Message]:
    """What the context policy will send next (a summary due counted as the old one)."""
    messages = session.messages
    if not isinstance(policy, SummarizeOlderTurns):
        return policy.view(messages)
    summary, due = session.durable.summary, policy.due(messages, session.durable.summary)
    if due is not None:
        summary = Summary(due[0], "" if summary is None else summary.text)
    return policy.view_with(messages, summary)


def _prompt_tokens(session: Session) -> int:
    """The next request's size in tokens: what the server counted for the last turn,
    and an estimate of what was added since. The estimate is kept as the new starting
    point (until the server counts again), so each call reads only the messages added
    since the last: with a server that reports no usage, every turn would otherwise
    read the whole transcript (quadratic in a run's rounds)."""
    messages = session.messages
    count, tokens = session.known
    if count > len(messages):
        count, tokens = 0, 0
    tokens += estimate_tokens(transcript_chars(messages, count))
    session.known = (len(messages), tokens)
    return tokens


async def _summarize(session: Session, run: RunState, policy: SummarizeOlderTurns) -> None:
    """Ask the model for a new summary of the older turns if the policy says one is
    due; a request of the run's (counted in its usage and limits), stored in the
    session's state. A stop cuts it like any model turn: nothing is kept of it."""
    durable = session.durable
    due = policy.due(session.messages, durable.summary)
    if due is None:
        return
    cut, older = due
    budget = run.budget
    assert budget is not None
    run.requests += 1
    budget.count_request()
    request = policy.request(durable.summary, older)
    # Counted (its tokens estimated) and kept before it is sent, as a turn's request;
    # a summary cut short keeps the estimate.
    counted: Usage = {"input_tokens": estimate_tokens(transcript_chars(request, 0)),
                      "output_tokens": 0}
    budget.count_tokens(counted, estimated=False)
    if budget.limited:
        await session.keep_spend(budget)
    assembler = TurnAssembler()
    stream = session.client.stream_turn(request, None)
    chunks = stream if run.wall is None else walled(stream, run.wall)
    token = current_scope.set(run.scope)  # no event goes out: current throughout
    try:
        async for chunk in chunks:
            assembler.add(chunk)
    finally:
        current_scope.reset(token)
        await chunks.aclose()
    add_usage(run.usage, assembler.usage)
    budget.count_tokens(assembler.usage, estimated=False, less=counted)
    text = assembler.text.strip()
    if not text:  # kept, it would drop the older turns from every later request
        raise _unusable_summary(session, policy, assembler)
    durable.summary = Summary(cut, text)
    await session.save_state()


def _unusable_summary(
    session: Session, policy: SummarizeOlderTurns, assembler: TurnAssembler
) -> ModelError:
    """The run's error for a summary with no text: the older turns stay in view."""
    host = session.client.host
    said = (
        "only a tool call" if assembler.tool_calls
        else "only whitespace" if assembler.text else "nothing"
    )
    return ModelError(
        f"SummarizeOlderTurns(keep={policy.keep}): the model at {host} answered the "
        f"request to summarise the older turns with {said}, so nothing was summarised and "
        "the older turns stay as they are (the run stops rather than drop them); resume "
        "to ask for the summary again, or use another context policy",
        host=host,
    )


async def _cut_short(session: Session, run: RunState, inflight: TurnInFlight) -> None:
    """A streamed reply crossed a token, cost or wall limit, or the input guardrails
    tripped: keep what came (marked partial, its usage estimated, any complete tool call
    answered as not run); the caller ends the run."""
    run.turn = None
    message = session.mark_speaker(inflight.assembler.message())
    message["aimu_partial"] = True  # a whole reply the guardrails refused is not kept whole
    if inflight.prefix is None:
        await session.record(message)
    else:
        message = await session.keep_continued(inflight.prefix, message)
    await session.answer_cut_calls()
    run.count_estimated(session.messages, inflight)
    run.reply = message["content"]


def _chunk_event(
    chunk: Chunk, run: RunState, inflight: TurnInFlight, name: str
) -> Event | None:
    """The event for a streamed chunk, if the consumer sees one; notes the rest."""
    if isinstance(chunk, TextDelta):
        return TextChunk(name, chunk.text)
    if isinstance(chunk, ThinkingDelta):
        return ThinkingChunk(name, chunk.text)
    if isinstance(chunk, ToolCallDelta):
        if chunk.error is not None:
            inflight.argument_errors[chunk.call["id"]] = chunk.error
    elif isinstance(chunk, TurnDone):
        run.stop_reason = chunk.done_reason
    elif isinstance(chunk, TurnRetry):
        return TurnRetried(name, "continued" if chunk.continued else "restarted", chunk.kept,
                           chunk.error, chunk.attempt)
    return None


async def _count_retry(session: Session, run: RunState, chunk: TurnRetry) -> LimitHit | None:
    """Count what a broken attempt of the turn spent (estimated where its server never
    said), kept before the request goes again as any request's is; the token or cost
    limit that spend crosses, if any (the turn then ends limited, its partial kept)."""
    add_usage(run.usage, chunk.spent)
    run.usage_estimated = True
    budget = run.budget
    assert budget is not None
    budget.count_tokens(chunk.spent, estimated=True)
    await session.keep_spend(budget)
    return budget.streamed(zero_usage()) if budget.watch else None


async def _end_turn(
    session: Session, run: RunState, message: AssistantMessage, inflight: TurnInFlight
) -> None:
    """Decide the outcome of a finished turn (recorded): answered, tools, or out of
    rounds."""
    usage = inflight.assembler.usage
    add_usage(run.usage, usage)
    budget = run.budget
    if budget is not None:
        # The estimate counted up front goes (at the price it was counted at); the usage
        # comes in, priced as the model that answered (a FallbackModel may have handed
        # the turn on): one count when the price stays.
        counted, answered = inflight.counted, session.client.answered_model
        if counted is not None and budget.model != answered:
            budget.count_tokens(zero_usage(), estimated=False, less=counted)
            counted = None
        budget.reprice(answered)
        budget.count_tokens(usage, estimated=False, less=counted)
    if usage["input_tokens"]:  # the server counted: later estimates start from here
        session.known = (
            len(session.messages), usage["input_tokens"] + usage["output_tokens"]
        )
    run.rounds += 1
    calls = message.get("tool_calls")
    final_turn = inflight.final_turn
    typed = session.config.output is not None
    if not calls and typed and not await output_checked(
        session, run, message["content"], inflight.schema_asked
    ):
        run.next = NEEDS_MODEL  # a correction was sent: the model answers again
    elif not calls:
        if await answer_passes(session, run, message):  # else blocked: the run ends
            run.end("max_rounds" if final_turn else "completed", message["content"])
    elif final_turn:
        for call in calls:
            await session.record(tool_message(call, ToolOutcome(_NO_ROUNDS_LEFT, True)))
        run.end("max_rounds", message["content"])
    else:
        run.next = NeedsTools(calls, argument_errors=inflight.argument_errors)


async def output_checked(
    session: Session, run: RunState, text: str, schema_asked: bool = True
) -> bool:
    """True if ``text`` is a valid answer (always, without ``output_type``); else the
    model is sent a correction, or, its corrections used up, OutputValidationError.
    An answer on a turn that was not sent the schema (one offering tools) costs no
    correction: the model had not been told the format."""
    output = session.config.output
    if output is None:
        return True
    try:
        run.output = output.parse(text)
    except ValueError as error:
        await session.record(output.correction(str(error)))
        run.output_failures += schema_asked
        if run.output_failures > output.retries:
            raise output.failed(
                session.config.name, text, str(error), run.output_failures
            ) from None
        return False
    return True


async def answer_passes(session: Session, run: RunState, message: AssistantMessage) -> bool:
    """True if the final answer ``message`` passes the output guardrails (always without
    any); else the run ends ``blocked`` and the answer, recorded already, is marked
    partial (in memory and the store): never taken as the session's answer."""
    guardrails = session.config.output_guardrails
    if not guardrails:
        return True
    value = message["content"] if session.config.output is None else run.output
    context = session.run_context(session.task_text(), run.deps)
    tripped = await run_guardrails("output", guardrails, context, value)
    if tripped is None:
        return True
    message["aimu_partial"] = True
    session.durable.transcript_stale = True
    await session.durable.sync(session.messages)
    run.blocked(tripped)
    return False


def _after_correction(session: Session) -> bool:
    """True when the transcript ends with a correction of an invalid typed answer."""
    messages = session.messages
    return bool(messages) and is_correction(messages[-1])
