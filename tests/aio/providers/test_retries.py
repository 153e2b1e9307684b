"""Retrying a model request that failed before any byte of its reply, over the loopback
server with injected faults: which failures are retried, Retry-After, the bound, the
run's deadline, a cancel or an interrupt during the backoff wait, and what is not retried."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from provider_support import assert_only_current_task, client_at

from aimu import aio
from aimu.aio.client import ModelClient
from aimu.aio.errors import ModelHTTPError, ModelProtocolError
from aimu.aio.events import Event, ModelRetry
from aimu.aio.scope import RunScope, current_scope
from aimu.aio.transcript import Message
from aimu.testing.script import Fault, Turn
from aimu.testing.server import LoopbackServer
from tests.services import free_port

KEY = "sk-retry-secret-987654321"


def make(provider: str, url: str, **options: Any) -> ModelClient:
    options.setdefault("retry_delay", 0.001)
    return client_at(provider, url, KEY, **options)


@contextlib.contextmanager
def scope(deadline: float | None = None) -> Iterator[tuple[RunScope, list[Event]]]:
    """A run scope for the code in this task, and the events emitted to it."""
    run_scope = RunScope("test", deadline=deadline)
    seen: list[Event] = []
    run_scope.add_listener(seen.append)
    token = current_scope.set(run_scope)
    try:
        yield run_scope, seen
    finally:
        current_scope.reset(token)


def retries_in(events: list[Event]) -> list[ModelRetry]:
    return [e for e in events if isinstance(e, ModelRetry)]


@pytest.mark.parametrize("fault", ["http_429", "http_502", "http_503", "http_504", "reset"])
@pytest.mark.parametrize("stream", [True, False])
async def test_a_failure_before_the_first_byte_is_retried(
    provider: str, fault: Fault, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    script = [Turn(fault=fault, retry_after="0"), Turn(text="made it")]
    async with LoopbackServer(script) as server:
        model, messages = make(provider, server.url), list[Message]()
        with scope() as (_, events), caplog.at_level(logging.INFO, "aimu.aio.providers"):
            if stream:
                reply = await aio.chat(model, "x", messages=messages, stream=True)
                assert [c async for c in reply]
            else:
                await aio.chat(model, "x", messages=messages)
        await model.aclose()
    assert messages[-1] == {"role": "assistant", "content": "made it"}
    assert len(server.requests) == 2
    (retry,) = retries_in(events)
    assert (retry.attempt, retry.host, retry.model) == (1, model.host, model.model)
    (record,) = [r for r in caplog.records if r.name == "aimu.aio.providers"]
    assert "retry 1 of 3" in record.getMessage()
    assert KEY not in record.getMessage() and KEY not in repr(retry)
    await assert_only_current_task()


async def test_retry_after_is_honoured(provider: str) -> None:
    script = [Turn(fault="http_429", retry_after="0.05"), Turn(text="ok")]
    async with LoopbackServer(script) as server:
        model = make(provider, server.url, retry_delay=10.0)  # backoff would wait 5-10 s
        with scope() as (_, events):
            await aio.chat(model, "x")
        await model.aclose()
    (retry,) = retries_in(events)
    assert retry.delay == 0.05
    first, second = server.requests
    assert second.time - first.time >= 0.05


async def test_backoff_grows_and_attempts_are_bounded(provider: str) -> None:
    script = [Turn(fault="http_503")] * 4
    async with LoopbackServer(script) as server:
        model = make(provider, server.url, retries=2, retry_delay=0.01)
        with scope() as (_, events), pytest.raises(ModelHTTPError, match="HTTP 503"):
            await aio.chat(model, "x")
        await model.aclose()
    assert len(server.requests) == 3
    first, second = retries_in(events)
    assert (first.attempt, second.attempt) == (1, 2)
    assert 0.005 <= first.delay <= 0.01 and 0.01 <= second.delay <= 0.02  # jitter: half to all


async def test_a_server_loading_its_model_is_waited_for_beyond_the_retries(
    provider: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 21 item 21: llama.cpp answers ``503 Loading model`` for seconds; a plain 503
    gets ``retries`` tries, a loading server is tried on (within the run's deadline)."""
    script = [Turn(fault="http_503_loading")] * 6 + [Turn(text="loaded")]
    async with LoopbackServer(script) as server:
        model = make(provider, server.url, retries=2)
        with scope() as (_, events), caplog.at_level(logging.INFO, "aimu.aio.providers"):
            assert (await aio.chat(model, "x"))["content"] == "loaded"
        await model.aclose()
    assert len(server.requests) == 7
    assert [r.attempt for r in retries_in(events)] == [1, 2, 3, 4, 5, 6]
    assert "loading its model" in caplog.records[-1].getMessage()


async def test_a_loading_server_is_waited_for_only_until_the_deadline(provider: str) -> None:
    async with LoopbackServer(lambda request: Turn(fault="http_503_loading")) as server:
        model = make(provider, server.url, retries=2)
        deadline = asyncio.get_running_loop().time() + 2.0
        with scope(deadline) as (_, events), pytest.raises(ModelHTTPError, match="Loading model"):
            await aio.chat(model, "x")
        await model.aclose()
    assert asyncio.get_running_loop().time() < deadline  # it gave up before the deadline
    assert len(server.requests) == len(retries_in(events)) + 1 > 3
    async with LoopbackServer([Turn(fault="http_503_loading"), Turn(text="ok")]) as server:
        model = make(provider, server.url, retries=0)  # retrying off: loading included
        with pytest.raises(ModelHTTPError, match="Loading model"):
            await aio.chat(model, "x")
        await model.aclose()


@pytest.mark.parametrize(
    ("turn", "error"),
    [
        (Turn(fault="http_500"), ModelHTTPError),
        (Turn(text="a b c d", fault="bad_json", fault_after=2), ModelProtocolError),
    ],
    ids=["http-500", "garbled-mid-reply"],
)
async def test_what_is_not_retried(
    provider: str, turn: Turn, error: type[Exception]
) -> None:
    async with LoopbackServer([turn, Turn(text="never")]) as server:
        model, messages = make(provider, server.url), list[Message]()
        with scope() as (_, events), pytest.raises(error):
            async for _ in await aio.chat(model, "x", messages=messages, stream=True):
                pass
        await model.aclose()
    assert len(server.requests) == 1 and not retries_in(events)
    if turn.fault == "bad_json":  # the partial text is kept, as for any stop
        assert messages[-1] == {"role": "assistant", "content": "a b ", "aimu_partial": True}


async def test_retries_0_disables_retrying(provider: str) -> None:
    async with LoopbackServer([Turn(fault="http_503"), Turn(text="ok")]) as server:
        model = make(provider, server.url, retries=0)
        with scope() as (_, events), pytest.raises(ModelHTTPError, match="HTTP 503"):
            await aio.chat(model, "x")
        await model.aclose()
    assert len(server.requests) == 1 and not retries_in(events)


async def test_a_refused_connection_is_retried_until_the_server_is_up(provider: str) -> None:
    port = free_port()  # released: a server starts on it before the retry
    with contextlib.ExitStack() as stack:
        started: list[LoopbackServer] = []

        def start_server(event: Event) -> None:
            # Called before the backoff wait: the server is listening when the retry goes.
            if isinstance(event, ModelRetry) and not started:
                started.append(
                    stack.enter_context(LoopbackServer.in_thread([Turn(text="up")], port=port))
                )

        model = make(provider, f"http://127.0.0.1:{port}")
        with scope() as (run_scope, events):
            run_scope.add_listener(start_server)
            reply = await aio.chat(model, "x")
        await model.aclose()
    assert reply["content"] == "up"
    (retry,) = retries_in(events)
    assert "Connection refused" in retry.error or "connect" in retry.error


async def test_no_retry_would_end_past_the_run_deadline(provider: str) -> None:
    script = [Turn(fault="http_503", retry_after="30"), Turn(text="too late")]
    async with LoopbackServer(script) as server:
        model = make(provider, server.url)
        deadline = asyncio.get_running_loop().time() + 10
        with scope(deadline) as (_, events), pytest.raises(ModelHTTPError, match="HTTP 503"):
            await aio.chat(model, "x")
        await model.aclose()
    assert len(server.requests) == 1 and not retries_in(events)


@pytest.mark.parametrize("stop", ["cancel", "interrupt"])
async def test_a_stop_during_the_backoff_wait_is_immediate(provider: str, stop: str) -> None:
    script = [Turn(fault="http_503", retry_after="30"), Turn(text="never")]
    async with LoopbackServer(script) as server:
        model, messages = make(provider, server.url), list[Message]()
        waiting = asyncio.Event()
        with scope() as (run_scope, _):
            run_scope.add_listener(lambda e: waiting.set() if isinstance(e, ModelRetry) else None)
            task = asyncio.create_task(aio.chat(model, "x", messages=messages))
        async with asyncio.timeout(10):  # a guard against a hang, not a timing bet
            await waiting.wait()  # the retry was announced: the wait is under way
            if stop == "cancel":
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                run_scope.request_interrupt()
                with pytest.raises(ModelHTTPError, match="HTTP 503"):
                    await task
        await model.aclose()
    assert len(server.requests) == 1
    assert messages == [{"role": "user", "content": "x"}]
    await assert_only_current_task()


@pytest.mark.parametrize("where", ["no scope", "a plain scope"])
async def test_agent_interrupt_cuts_a_backoff_wait_short_outside_a_handle(
    provider: str, where: str
) -> None:
    """Agent.interrupt() reached the retry wait only under a handle (the wait read the
    handle's scope); now the run's own scope is current while the provider runs."""
    script = [Turn(fault="http_503", retry_after="30"), Turn(text="after the resume")]
    async with LoopbackServer(script) as server:
        model = make(provider, server.url)
        agent = aio.Agent(model)
        waiting = asyncio.Event()
        with contextlib.ExitStack() as stack:
            if where == "a plain scope":  # a listener sees the retry: a provable point
                run_scope, _ = stack.enter_context(scope())
                run_scope.add_listener(
                    lambda e: waiting.set() if isinstance(e, ModelRetry) else None
                )
            task = asyncio.create_task(agent.run("x"))
        async with asyncio.timeout(10):  # a guard against a hang, not a timing bet
            if where == "a plain scope":
                await waiting.wait()
            else:
                await server.wait_requests(1)  # the 503 was asked for; the wait follows
            assert agent.interrupt()
            assert await task == "Run interrupted."
        assert agent.last_status == "interrupted"
        assert await agent.resume() == "after the resume"
        await model.aclose()
    assert len(server.requests) == 2


async def test_interrupted_within_wakes_at_once_and_cleans_up() -> None:
    outer = RunScope("outer")
    inner = RunScope("inner", parent=outer)
    assert await inner.interrupted_within(0.01) is False  # the time passed, nothing asked
    waiter = asyncio.ensure_future(inner.interrupted_within(None))
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, outer.request_interrupt)  # from another thread
    assert await waiter is True
    assert inner._interrupt_waiters == [] and outer._interrupt_waiters == []
    assert await inner.interrupted_within(30) is True  # already asked: no wait
    cancelled = asyncio.ensure_future(RunScope("x").interrupted_within(None))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled


async def test_an_agent_run_reports_each_retry_to_its_handle(provider: str) -> None:
    async with LoopbackServer([Turn(fault="http_502"), Turn(text="fine")]) as server:
        model = make(provider, server.url)
        agent = aio.Agent(model)
        handle = aio.RunHandle.start(agent.run("x"))
        events = [event async for event in handle.events()]
        assert await handle == "fine"
        await model.aclose()
    (retry,) = retries_in(events)
    assert retry.attempt == 1


async def test_an_interrupt_during_an_agent_s_backoff_wait_ends_the_run_interrupted(
    provider: str,
) -> None:
    script = [Turn(fault="http_503", retry_after="30"), Turn(text="after the resume")]
    async with LoopbackServer(script) as server:
        model = make(provider, server.url)
        agent = aio.Agent(model)
        handle = aio.RunHandle.start(agent.run("x"))
        events: list[Event] = []
        async for event in handle.events():
            events.append(event)
            if isinstance(event, ModelRetry):  # the backoff wait is under way
                handle.interrupt()
        assert await handle == "Run interrupted."
        assert handle.status == "interrupted"
        finished = [e for e in events if isinstance(e, aio.RunFinished)]
        assert finished[-1].status == "interrupted"
        assert finished[-1].error is not None and "503" in finished[-1].error
        assert model.messages == [{"role": "user", "content": "x"}]  # nothing half-made
        assert await agent.resume() == "after the resume"
        await model.aclose()
    assert len(server.requests) == 2
