"""OpenTelemetry spans for runs, model turns and tool calls (extra ``aimu-agents[otel]``).

A span is made only when the process has set a tracer provider (the SDK's, or any
other): without one, or without ``opentelemetry-api`` installed, every helper here is
a dictionary look-up and nothing is imported. Attributes follow the GenAI semantic
conventions (``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.usage.*``,
``gen_ai.tool.name``, ``gen_ai.tool.call.id``); how a run ended is
``aimu.run.status`` (``completed``, ``incomplete`` for an answer cut off, ``cancelled``,
``interrupted``, ``timed_out``, ``paused``...) with ``aimu.stop.reason``; a run's span adds
its model requests and retries (``aimu.run.requests``, ``aimu.run.retries``: the GenAI
conventions name none). A cancel is recorded, not reported as an error,
and always propagates. No message contents and no secrets go on a span.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import sys
from collections.abc import Awaitable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from aimu.aio.transcript import Usage

if TYPE_CHECKING:
    from aimu.aio.events import RunFinished

__all__ = ["RunSpans", "SpanNotes", "enabled", "span"]

_T = TypeVar("_T")

_cache: tuple[object, Any] | None = None  # (provider, tracer) last made
# The span of the run a tool call belongs to: set by the agent around one call (in a
# coroutine of its own, RunSpans.within), read by invoke() to parent the call's span.
_run_span: contextvars.ContextVar[Any] = contextvars.ContextVar("aimu_run_span", default=None)


def _tracer() -> Any:
    """The tracer of the configured provider, or None when no one set one up."""
    global _cache
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:  # never imported: no provider can have been set
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider):  # the API's placeholder: no SDK
        return None
    if _cache is None or _cache[0] is not provider:
        from aimu import __version__

        _cache = (provider, provider.get_tracer("aimu", __version__))
    return _cache[1]


def enabled() -> bool:
    """True when spans are being made: a hot path checks this before building one."""
    return _tracer() is not None


class SpanNotes:
    """What the code inside a span adds to it: attributes, and how the work ended."""

    __slots__ = ("_span",)

    def __init__(self, span: Any) -> None:
        self._span = span

    def set(self, key: str, value: Any) -> None:
        if value is not None:
            self._span.set_attribute(key, value)

    def ended(self, status: str, reason: str | None = None, *, error: str | None = None) -> None:
        """Record how the work ended; ``error`` (an error type) marks the span failed."""
        self._span.set_attribute("aimu.run.status", status)
        if reason:
            self._span.set_attribute("aimu.stop.reason", reason)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self._span.set_attribute("error.type", error)
            self._span.set_status(Status(StatusCode.ERROR, error))


@contextlib.contextmanager
def span(
    name: str, attributes: Mapping[str, Any], *, client: bool = False
) -> Iterator[SpanNotes | None]:
    """A span named ``name`` around the block, current for the spans made inside it.

    Yields :class:`SpanNotes`, or None when tracing is off. A ``CancelledError`` is
    recorded as ``aimu.run.status = cancelled`` and re-raised; another exception marks
    the span failed with its type and is re-raised.
    """
    tracer = _tracer()
    if tracer is None:
        yield None
        return
    from opentelemetry.trace import SpanKind, set_span_in_context

    kind = SpanKind.CLIENT if client else SpanKind.INTERNAL
    parent = _run_span.get()
    with tracer.start_as_current_span(
        name,
        context=set_span_in_context(parent) if parent is not None else None,
        kind=kind,
        attributes=dict(attributes),
        record_exception=False,
        set_status_on_exception=False,
    ) as current:
        notes = SpanNotes(current)
        try:
            yield notes
        except asyncio.CancelledError as cancel:
            notes.ended("cancelled", str(cancel.args[0]) if cancel.args else None)
            raise
        except GeneratorExit:  # a stream its consumer closed early
            notes.ended("closed")
            raise
        except Exception as error:
            current.record_exception(error)
            notes.ended("failed", error=type(error).__qualname__)
            raise


class RunSpans:
    """The spans of one agent run: the run, each model turn, and the tool calls' parent.

    An agent run is an async generator, so its spans are started and ended explicitly
    (never made current: a context attached across a ``yield`` would leak into the
    consumer). Every method is a no-op when tracing is off.
    """

    __slots__ = ("_model", "_provider", "_run", "_tracer", "_turn")

    def __init__(self, agent: str, model: str, provider: str) -> None:
        self._tracer = _tracer()
        self._model = model
        self._provider = provider
        self._run: Any = None
        self._turn: Any = None
        if self._tracer is not None:
            self._run = self._tracer.start_span(
                f"invoke_agent {agent}",
                attributes={
                    "gen_ai.operation.name": "invoke_agent",
                    "gen_ai.agent.name": agent,
                    "gen_ai.request.model": model,
                    "gen_ai.provider.name": provider,
                },
            )

    def turn_started(self) -> None:
        if self._run is None:
            return
        from opentelemetry.trace import SpanKind, set_span_in_context

        self._turn = self._tracer.start_span(
            f"chat {self._model}",
            context=set_span_in_context(self._run),
            kind=SpanKind.CLIENT,
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.request.model": self._model,
                "gen_ai.provider.name": self._provider,
            },
        )

    def turn_ended(self, usage: Usage, stop_reason: str | None) -> None:
        """End the model turn's span once the reply is whole: its usage and finish reason."""
        turn, self._turn = self._turn, None
        if turn is None:
            return
        notes = SpanNotes(turn)
        notes.set("gen_ai.usage.input_tokens", usage["input_tokens"])
        notes.set("gen_ai.usage.output_tokens", usage["output_tokens"])
        if stop_reason is not None:
            notes.set("gen_ai.response.finish_reasons", [stop_reason])
        notes.ended("completed")
        turn.end()

    def within(self, work: Awaitable[_T]) -> Awaitable[_T]:
        """``work`` (a tool call), with the spans ``invoke()`` makes while it runs made
        this run's; ``work`` itself when tracing is off (the hot path: nothing added)."""
        if self._run is None:
            return work
        return _parented(self._run, work)

    def finished(self, final: RunFinished, status: str, reason: str | None = None) -> None:
        """End the run's span with ``final``'s numbers, ``status`` (``final.status``, or
        ``timed_out`` for a deadline's cancel) and why (``reason``: ``aimu.stop.reason``).

        A model turn the stop cut short ends here too, with the run's status.
        """
        run, self._run = self._run, None
        if run is None:
            return
        failed = final.error if status == "failed" else None
        for span_ in (self._turn, run):
            if span_ is None:
                continue
            notes = SpanNotes(span_)
            if span_ is run:
                notes.set("gen_ai.usage.input_tokens", final.usage["input_tokens"])
                notes.set("gen_ai.usage.output_tokens", final.usage["output_tokens"])
                if final.stop_reason is not None:
                    notes.set("gen_ai.response.finish_reasons", [final.stop_reason])
                notes.set("aimu.run.requests", final.requests)
                notes.set("aimu.run.retries", final.retries)
            notes.ended(status, reason, error=failed)
            span_.end()
        self._turn = None


async def _parented(run: Any, work: Awaitable[_T]) -> _T:
    token = _run_span.set(run)
    try:
        return await work
    finally:
        _run_span.reset(token)
