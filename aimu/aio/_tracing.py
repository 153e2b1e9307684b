"""OpenTelemetry spans for runs, model turns and tool calls (extra ``aimu[otel]``).

A span is made only when the process has set a tracer provider (the SDK's, or any
other): without one, or without ``opentelemetry-api`` installed, every helper here is
a dictionary look-up and nothing is imported. Attributes follow the GenAI semantic
conventions (``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.usage.*``,
``gen_ai.tool.name``, ``gen_ai.tool.call.id``); how a run ended is
``aimu.run.status`` (``completed``, ``cancelled``, ``interrupted``, ``timed_out``,
``paused``...) with ``aimu.stop.reason``. A cancel is recorded, not reported as an error,
and always propagates. No message contents and no secrets go on a span.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["SpanNotes", "enabled", "span"]

_cache: tuple[object, Any] | None = None  # (provider, tracer) last made


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
    from opentelemetry.trace import SpanKind

    kind = SpanKind.CLIENT if client else SpanKind.INTERNAL
    with tracer.start_as_current_span(
        name,
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
