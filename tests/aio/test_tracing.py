"""OpenTelemetry spans with the SDK's in-memory exporter: names, GenAI attributes, stops.

Agents run over the loopback server's OpenAI endpoint; each test reads the finished
spans. A cancel lands while a tool provably runs (the tool set an event).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Coroutine, Iterator, Mapping
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from aimu import aio
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer

SECRET_WORD = "pelican-7781"  # message contents: never on a span


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """The process's tracer provider (set once, as an application would)."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()  # later tests make spans that go nowhere


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> Iterator[InMemorySpanExporter]:
    exporter.clear()
    yield exporter


def named(spans: InMemorySpanExporter, prefix: str) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.name.startswith(prefix)]


def lookup(word: str) -> str:
    """Look a word up."""
    return f"{word} is a bird"


def broken(word: str) -> str:
    """Fail."""
    raise KeyError(word)


def calls(*names: str) -> Any:
    def script(request: Mapping[str, Any]) -> Turn:
        if request["messages"][-1]["role"] == "tool":
            return Turn(text="done")
        return Turn(tool_calls=tuple(ScriptedCall(n, {"word": SECRET_WORD}) for n in names))

    return script


async def run_agent(script: Any, tools: list[Any]) -> str:
    async with LoopbackServer(script) as server:
        model = aio.client("openai:m", base_url=server.openai_base_url, api_key="k")
        try:
            return await aio.Agent(model, tools=tools).run(f"what is a {SECRET_WORD}?")
        finally:
            await model.aclose()


async def cancel_once(run: Coroutine[Any, Any, object], seen: asyncio.Event) -> None:
    """Start ``run`` in a handle, cancel it once ``seen`` is set; the cancel propagates."""
    handle = aio.RunHandle.start(run)
    await seen.wait()
    handle.cancel("the user pressed Stop")
    with pytest.raises(asyncio.CancelledError):
        await handle


def no_contents(spans: InMemorySpanExporter) -> None:
    for finished in spans.get_finished_spans():
        assert SECRET_WORD not in str(dict(finished.attributes or {})), finished.name


async def test_a_tool_call_is_a_span_with_genai_attributes(spans: InMemorySpanExporter) -> None:
    assert await run_agent(calls("lookup", "broken"), [lookup, broken]) == "done"
    (ok,) = named(spans, "execute_tool lookup")
    attributes = dict(ok.attributes or {})
    assert attributes["gen_ai.operation.name"] == "execute_tool"
    assert attributes["gen_ai.tool.name"] == "lookup"
    assert attributes["gen_ai.tool.type"] == "function"
    assert str(attributes["gen_ai.tool.call.id"]).startswith("call_")
    assert attributes["aimu.run.status"] == "completed"
    assert ok.status.status_code is StatusCode.UNSET
    (failed,) = named(spans, "execute_tool broken")
    assert dict(failed.attributes or {})["error.type"] == "tool_error"
    assert failed.status.status_code is StatusCode.ERROR
    no_contents(spans)


async def test_a_cancel_during_a_tool_is_recorded_on_its_span_and_propagates(
    spans: InMemorySpanExporter,
) -> None:
    started = asyncio.Event()

    async def wait(word: str) -> str:
        """Wait for ever."""
        started.set()
        await asyncio.Event().wait()
        return word

    async with LoopbackServer(calls("wait")) as server:
        model = aio.client("openai:m", base_url=server.openai_base_url, api_key="k")
        try:  # the tool runs: its span is open
            await cancel_once(aio.Agent(model, tools=[wait]).run("go"), started)
        finally:
            await model.aclose()
    (stopped,) = named(spans, "execute_tool wait")
    attributes = dict(stopped.attributes or {})
    assert attributes["aimu.run.status"] == "cancelled"
    assert stopped.status.status_code is StatusCode.UNSET  # a stop, not an error
    assert stopped.end_time is not None


NO_PROVIDER = """
import asyncio, sys
from aimu import aio

def add(a: int) -> int:
    "Add."
    return a

asyncio.run(aio.Agent(aio.client("test"), tools=[add]).run("add"))
assert not any(m.startswith("opentelemetry") for m in sys.modules), "opentelemetry imported"
"""


def test_without_a_tracer_provider_nothing_is_imported_or_made() -> None:
    done = subprocess.run(
        [sys.executable, "-c", NO_PROVIDER], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


async def test_a_run_is_a_span_with_its_model_turns_and_tool_calls_inside(
    spans: InMemorySpanExporter,
) -> None:
    assert await run_agent(calls("lookup"), [lookup]) == "done"
    (run,) = named(spans, "invoke_agent ")
    turns = named(spans, "chat m")
    (tool,) = named(spans, "execute_tool lookup")
    assert len(turns) == 2
    for child in [*turns, tool]:
        assert child.parent is not None and child.parent.span_id == run.context.span_id
    attributes = dict(run.attributes or {})
    assert attributes["gen_ai.operation.name"] == "invoke_agent"
    assert attributes["gen_ai.request.model"] == "m"
    assert attributes["gen_ai.provider.name"] == "openai"
    assert attributes["aimu.run.status"] == "completed"
    assert isinstance(attributes["gen_ai.usage.output_tokens"], int)
    turn = dict(turns[-1].attributes or {})
    assert turn["gen_ai.operation.name"] == "chat"
    assert turn["gen_ai.response.finish_reasons"] == ("stop",)
    assert turn["gen_ai.usage.output_tokens"] >= 1
    assert turns[-1].kind is trace.SpanKind.CLIENT
    no_contents(spans)


async def test_a_cancel_mid_reply_ends_the_turn_and_the_run_spans_as_cancelled(
    spans: InMemorySpanExporter,
) -> None:
    long_reply = " ".join(f"w{i}" for i in range(2000))
    streaming = asyncio.Event()

    async with LoopbackServer([Turn(text=long_reply, delay=0.02)]) as server:
        model = aio.client("openai:m", base_url=server.openai_base_url, api_key="k")
        agent = aio.Agent(model)

        async def consume() -> None:
            async for event in agent.run("talk", stream=True):
                if isinstance(event, aio.TextChunk):
                    streaming.set()

        try:  # the reply provably streams: the turn's span is open
            await cancel_once(consume(), streaming)
        finally:
            await model.aclose()
    (turn,) = named(spans, "chat m")
    (run,) = named(spans, "invoke_agent ")
    assert dict(turn.attributes or {})["aimu.run.status"] == "cancelled"
    assert dict(run.attributes or {})["aimu.run.status"] == "cancelled"
    assert run.status.status_code is StatusCode.UNSET


@aio.tool(approval=True)
def launch(word: str) -> str:
    """Launch, once a person approves."""
    return word


async def test_every_stop_is_on_the_run_span_with_its_reason(
    spans: InMemorySpanExporter,
) -> None:
    """A cancel with its reason, a deadline (timed_out), an interrupt and a pause."""
    entered, opened = asyncio.Event(), asyncio.Event()

    async def held(word: str) -> str:
        """Wait until let go."""
        entered.set()
        await opened.wait()
        return word

    ended: dict[str, dict[str, Any]] = {}
    async with LoopbackServer(calls("held")) as server:
        model = aio.client("openai:m", base_url=server.openai_base_url, api_key="k")
        for stop in ("cancel", "deadline", "interrupt"):
            entered.clear()
            spans.clear()
            agent = aio.Agent(model, tools=[held], name=stop)
            timeout = 0.05 if stop == "deadline" else None
            handle = aio.RunHandle.start(agent.run("go"), timeout=timeout)
            if stop == "cancel":
                await entered.wait()
                handle.cancel("the user pressed Stop")
            elif stop == "interrupt":
                await entered.wait()
                handle.interrupt()
                opened.set()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await handle
            (run,) = named(spans, f"invoke_agent {stop}")
            ended[stop] = dict(run.attributes or {})
            assert run.status.status_code is StatusCode.UNSET
        await model.aclose()
    async with LoopbackServer(calls("launch")) as server:
        model = aio.client("openai:m", base_url=server.openai_base_url, api_key="k")
        spans.clear()
        agent = aio.Agent(model, tools=[launch], name="pause")
        await agent.run("go")
        assert agent.pending_approvals
        (run,) = named(spans, "invoke_agent pause")
        ended["pause"] = dict(run.attributes or {})
        await model.aclose()
    said = {stop: (a["aimu.run.status"], a.get("aimu.stop.reason")) for stop, a in ended.items()}
    assert said["cancel"] == ("cancelled", "the user pressed Stop")
    assert said["deadline"] == ("timed_out", "deadline passed")
    assert said["interrupt"][0] == "interrupted"
    assert said["pause"][0] == "paused"
    assert str(said["pause"][1]).startswith("tool calls wait for approval: launch (call_")
    no_contents(spans)


async def test_an_answer_cut_off_is_incomplete_on_the_run_span_with_its_requests(
    spans: InMemorySpanExporter,
) -> None:
    script = [Turn(fault="http_503", retry_after="0"), Turn(text="half an", stop_reason="length")]
    assert await run_agent(script, []) == "half an"
    (run,) = named(spans, "invoke_agent ")
    attributes = dict(run.attributes or {})
    assert attributes["aimu.run.status"] == "incomplete"
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert (attributes["aimu.run.requests"], attributes["aimu.run.retries"]) == (1, 1)
    assert run.status.status_code is StatusCode.UNSET  # cut off is not an error


async def test_an_answer_cut_off_is_incomplete_on_the_run_span_with_the_models_reason(
    spans: InMemorySpanExporter,
) -> None:
    async with LoopbackServer([Turn(text="cut", stop_reason="length")]) as server:
        model = aio.client("openai:m", base_url=server.openai_base_url, api_key="k")
        await aio.Agent(model, name="cut").run("go")
        await model.aclose()
    (run,) = named(spans, "invoke_agent cut")
    attributes = dict(run.attributes or {})
    assert attributes["aimu.run.status"] == "incomplete"
    assert attributes["aimu.stop.reason"] == "the model stopped with 'length'"
    assert run.status.status_code is StatusCode.UNSET
