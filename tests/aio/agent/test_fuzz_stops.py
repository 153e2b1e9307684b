"""A seeded fuzz of stopping across the whole stack: handle, agent, tools, store, workflows.

Each trial builds a random scenario from its seed (provider, tool rounds, tool kinds,
store, workflow, deadline), stops it with a random stop at a random moment, and then
checks every invariant of DESIGN.md that can be seen from outside. A failing trial
prints its scenario; ``run_trial(make_scenario(seed), ...)`` replays it exactly
(only the timing of the wire can differ).
"""

from __future__ import annotations

import asyncio
import copy
import gc
import random
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.agent import INTERRUPTED
from aimu.aio.events import Event, HandleFinished
from aimu.aio.transcript import dangling_calls, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer
from aimu.testing.server.bedrock import CREDENTIALS as BEDROCK_CREDENTIALS
from aimu.testing.server.bedrock import REGION as BEDROCK_REGION
from aimu.testing.server.bedrock import TEST_KEY_ID as BEDROCK_KEY_ID

FINAL = "all done here"
FOLLOW_UP = "follow-up done"
INNER_BREAK = "the consumer stopped reading"

PROVIDERS = (
    "openai", "ollama", "scripted", "openai-responses", "gemini", "anthropic", "bedrock"
)
TOOL_KINDS = (
    "sync_fast", "sync_slow", "sync_ctx", "sync_check",
    "async_fast", "async_slow", "async_ctx", "async_cleanup", "boom",
)
STOPS = (
    "none", "cancel", "interrupt", "stop", "thread_cancel", "thread_interrupt", "thread_stop",
    "direct_interrupt", "waiter_cancel", "events_break",
)
#: Stops that may cancel the run, and stops that may interrupt it.
CANCELS = frozenset({"cancel", "thread_cancel", "stop", "thread_stop"})
INTERRUPTS = frozenset(
    {"interrupt", "thread_interrupt", "direct_interrupt", "stop", "thread_stop"}
)
REASONS = {"cancel": "fuzz", "thread_cancel": "thread", "stop": "stop()", "thread_stop": "stop()"}
EVENT_KINDS = ("TextChunk", "ToolCallStarted", "ToolResult", "StepFinished", "RunStarted")


# -- scenarios ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    tool: str
    ms: int


@dataclass(frozen=True)
class Scenario:
    seed: int
    provider: str
    tools: tuple[tuple[str, str, float | None], ...]  # (name, kind, timeout)
    rounds: tuple[tuple[Call, ...], ...]
    chunks: int
    delay: float
    first_byte: float
    thinking: bool
    concurrent: bool
    system: bool
    store: str | None
    workflow: str | None
    timeout: float | None
    stops: tuple[tuple[str, tuple[Any, ...]], ...]  # (stop, moment)
    stream: str | None  # None: run(); "full": read run(stream=True) to its end; "break"
    fault: tuple[int, str] | None  # (round, fault) the model fails at
    grace: float
    break_after: int

    def kinds(self) -> set[str]:
        return {stop for stop, _ in self.stops}


def make_scenario(seed: int) -> Scenario:
    """The scenario of ``seed``: the same seed always gives the same scenario."""
    r = random.Random(seed)
    kinds = r.sample(TOOL_KINDS, r.randint(2, 4))
    tools = tuple(
        (f"{kind}_{i}", kind, r.choice((None, None, round(r.uniform(0.005, 0.05), 3))))
        for i, kind in enumerate(kinds)
    )
    rounds = tuple(
        tuple(Call(r.choice(tools)[0], r.choice((0, 0, r.randint(1, 40))))
              for _ in range(r.randint(1, 3)))
        for _ in range(r.randint(1, 3))
    )
    workflow = r.choice((None, None, None, "chain", "parallel"))
    store = None if workflow is not None else r.choice((None, "sqlite", "jsonl"))
    timeout = None if r.random() < 0.6 else round(r.uniform(0.01, 0.25), 3)
    stops = tuple(
        (stop, random_moment(r, stop))
        for stop in r.sample(STOPS, 1 if r.random() < 0.7 else 2)
    )
    return Scenario(
        seed=seed,
        provider=r.choice(PROVIDERS),
        tools=tools,
        rounds=rounds,
        chunks=r.randint(1, 4),
        delay=r.choice((0.0, round(r.uniform(0, 0.008), 4))),
        first_byte=r.choice((0.0, 0.0, round(r.uniform(0, 0.01), 4))),
        thinking=r.random() < 0.3,
        concurrent=r.random() < 0.5,
        system=r.random() < 0.5,
        store=store,
        workflow=workflow,
        timeout=timeout,
        stops=stops,
        stream=r.choice((None, None, None, None, "full", "break")),
        fault=None if r.random() < 0.85 else (
            r.randint(0, len(rounds)),
            r.choice(("http_500", "drop", "bad_json", "no_done")
                     + (("hang",) if timeout is not None else ())),
        ),
        grace=round(r.choice((0.0, r.uniform(0, 0.05))), 3),
        break_after=r.randint(0, 8),
    )


def random_moment(r: random.Random, stop: str) -> tuple[Any, ...]:
    kind = r.choice(("now", "turns", "sleep", "event", "event", "listener"))
    if kind == "listener" and stop not in ("cancel", "interrupt", "direct_interrupt"):
        kind = "event"
    if kind == "turns":
        return ("turns", r.randint(0, 60))
    if kind == "sleep":
        return ("sleep", round(r.uniform(0, 0.12), 3))
    if kind in ("event", "listener"):
        return (kind, r.choice(EVENT_KINDS), r.randint(1, 4))
    return ("now",)


def script_for(sc: Scenario) -> Callable[[Mapping[str, Any]], Turn]:
    """The model of a scenario: which round it is follows from the request itself."""

    def answer(request: Mapping[str, Any]) -> Turn:
        if not request.get("tools"):
            return Turn(text=FOLLOW_UP)
        messages = request.get("messages") or []
        since_user = 0
        for message in reversed(messages):
            if message.get("role") == "user":
                break
            if message.get("role") == "assistant":
                since_user += 1
        timing: dict[str, Any] = {
            "chunks": sc.chunks, "delay": sc.delay, "first_byte_delay": sc.first_byte
        }
        if sc.fault is not None and sc.fault[0] == since_user:
            timing.update(fault=sc.fault[1], fault_after=1)
        if since_user >= len(sc.rounds):
            return Turn(text=FINAL, **timing)
        calls = tuple(ScriptedCall(c.tool, {"ms": c.ms}) for c in sc.rounds[since_user])
        return Turn(
            text=f"round {since_user} looks at the notes", tool_calls=calls,
            thinking="hmm" if sc.thinking and since_user == 0 else "", **timing,
        )

    return answer


# -- tools -------------------------------------------------------------------------------


class Threads:
    """Counts tool bodies running in worker threads, so a trial can wait for them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active = 0

    def __enter__(self) -> None:
        with self._lock:
            self.active += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self.active -= 1


def make_tool(name: str, kind: str, timeout: float | None, threads: Threads) -> aio.Tool:
    fn: Callable[..., Any]
    if kind == "sync_fast":
        def fn(ms: int) -> str:
            """Answer at once."""
            with threads:
                return f"{name} ok"
    elif kind == "sync_slow":
        def fn(ms: int) -> str:
            """Block the worker thread for ms milliseconds, deaf to any cancel."""
            with threads:
                time.sleep(ms / 1000)
                return f"{name} slept {ms}"
    elif kind == "sync_ctx":
        def fn(ms: int, ctx: aio.ToolContext) -> str:
            """Wait ms milliseconds unless cancelled."""
            with threads:
                if ctx.wait_cancelled(ms / 1000):
                    return f"{name} cancelled early"
                return f"{name} waited {ms}"
    elif kind == "sync_check":
        def fn(ms: int, ctx: aio.ToolContext) -> str:
            """Poll ctx.check() for ms milliseconds."""
            with threads:
                end = time.monotonic() + ms / 1000
                while time.monotonic() < end:
                    ctx.check()
                    time.sleep(0.002)
                return f"{name} polled {ms}"
    elif kind == "async_fast":
        async def fn(ms: int) -> str:
            """Answer at once."""
            return f"{name} ok"
    elif kind == "async_slow":
        async def fn(ms: int) -> str:
            """Sleep ms milliseconds."""
            await asyncio.sleep(ms / 1000)
            return f"{name} slept {ms}"
    elif kind == "async_ctx":
        async def fn(ms: int, ctx: aio.ToolContext) -> str:
            """Work in small steps for ms milliseconds; stop early on a stop request."""
            end = time.monotonic() + ms / 1000
            while time.monotonic() < end:
                if ctx.cancelled or ctx.interrupt_requested:
                    return f"{name} stopped early"
                await asyncio.sleep(0.002)
            return f"{name} worked {ms}"
    elif kind == "async_cleanup":
        async def fn(ms: int) -> str:
            """Sleep ms milliseconds; cleaning up takes a few awaits."""
            try:
                await asyncio.sleep(ms / 1000)
            finally:
                for _ in range(3):
                    await asyncio.sleep(0)
            return f"{name} slept {ms}"
    elif kind == "boom":
        def fn(ms: int) -> str:
            """Fail."""
            with threads:
                raise ValueError(f"{name} exploded")
    else:  # pragma: no cover - TOOL_KINDS lists every kind
        raise AssertionError(kind)
    return aio.tool(fn, name=name, timeout=timeout)


# -- one trial ---------------------------------------------------------------------------


@dataclass
class Record:
    """What the stoppers did, for the verdict."""

    cancels: list[bool] = field(default_factory=list)
    """What each cancel() from another task on the loop's thread answered."""
    inner_cancels: list[bool] = field(default_factory=list)
    """The same, for cancels made inside the run (an event listener)."""
    interrupts: list[bool] = field(default_factory=list)
    stops: list[str] = field(default_factory=list)
    """What each stop() returned."""
    waiter: str | None = None


@dataclass
class Trial:
    sc: Scenario
    server: LoopbackServer
    tmp: Path
    threads: Threads = field(default_factory=Threads)
    failures: list[dict[str, Any]] = field(default_factory=list)


def openai_client(server: LoopbackServer) -> aio.ModelClient:
    return aio.client("openai:m", base_url=server.openai_base_url, api_key="sk-test")


def make_client(sc: Scenario, server: LoopbackServer) -> aio.ModelClient:
    if sc.provider == "openai":
        return openai_client(server)
    if sc.provider == "ollama":
        return aio.client("ollama:m", host=server.url)
    if sc.provider == "gemini":
        return aio.client("gemini:m", base_url=server.gemini_base_url, api_key="AIza-test")
    if sc.provider == "anthropic":
        return aio.client("anthropic:m", base_url=server.url, api_key="sk-ant-test")
    if sc.provider == "openai-responses":
        return aio.client(
            "openai-responses:m", base_url=server.openai_base_url, api_key="sk-test"
        )
    if sc.provider == "bedrock":  # signed with the key the loopback server checks against
        return aio.client("bedrock:m", region=BEDROCK_REGION, base_url=server.url,
                          aws_access_key_id=BEDROCK_KEY_ID,
                          aws_secret_access_key=BEDROCK_CREDENTIALS[BEDROCK_KEY_ID])
    return ScriptedModel(script_for(sc))


def make_store(sc: Scenario, tmp: Path) -> aio.Store | None:
    if sc.store == "sqlite":
        return aio.SQLiteStore(tmp / f"s{sc.seed}.db")
    if sc.store == "jsonl":
        return aio.JSONLStore(tmp / f"j{sc.seed}", fsync=sc.seed % 2 == 0)
    return None


async def drain_stream(events: AsyncIterator[Event], break_after: int | None) -> str:
    """A run coroutine that reads its own event stream, to its end or stopping early."""
    seen = 0
    final = ""
    async with aclosing(events):  # type: ignore[type-var]
        async for event in events:
            seen += 1
            if isinstance(event, aio.RunFinished):
                final = event.reply
            if break_after is not None and seen > break_after:
                return INNER_BREAK
    return final


async def reach(moment: tuple[Any, ...], handle: aio.RunHandle[Any]) -> None:
    """Wait for the scenario's moment (or for the run to end, whichever comes first)."""
    kind = moment[0]
    if kind == "now":
        return
    if kind == "turns":
        for _ in range(moment[1]):
            await asyncio.sleep(0)
        return
    if kind == "sleep":
        await asyncio.sleep(moment[1])
        return
    assert kind == "event"
    wanted, count = moment[1], moment[2]
    stream = handle.events()
    try:
        async for event in stream:
            if type(event).__name__ == wanted:
                count -= 1
                if count == 0:
                    return
    finally:
        await stream.aclose()


async def run_trial(t: Trial) -> None:
    sc = t.sc
    loop = asyncio.get_running_loop()
    t.server.script = script_for(sc)
    first_stream = len(t.server.streams)
    model = make_client(sc, t.server)
    store = make_store(sc, t.tmp)
    tools = [make_tool(name, kind, timeout, t.threads) for name, kind, timeout in sc.tools]
    options: dict[str, Any] = {
        "concurrent_tools": sc.concurrent,
        "system": "be brief" if sc.system else None,
    }
    agent = aio.Agent(
        model, tools, store=store, session="fuzz" if store else None, **options
    )
    workflow: aio.Chain | aio.Parallel | None = None
    if sc.workflow == "chain":
        workflow = aio.Chain([agent, aio.Agent(model, tools, name="second", **options)])
    elif sc.workflow == "parallel":
        workflow = aio.Parallel([agent, aio.Agent(model, tools, name="second", **options)])
    runner: aio.Agent | aio.Chain | aio.Parallel = workflow or agent
    try:
        if sc.stream is not None:
            coro: Awaitable[str] = drain_stream(
                runner.run("go", stream=True), sc.break_after if sc.stream == "break" else None
            )
        else:
            coro = runner.run("go")
        record = Record()
        started_at = loop.time()
        handle = aio.RunHandle.start(coro, timeout=sc.timeout)
        ended = asyncio.Event()
        ended_at: list[float] = []

        def on_done(_: object) -> None:
            ended_at.append(loop.time())
            ended.set()

        handle.add_done_callback(on_done)
        collected: list[Event] = []

        async def collect() -> None:
            async for event in handle.events():
                collected.append(event)

        helpers = [asyncio.create_task(collect())]
        helpers += [
            asyncio.create_task(stopper(sc, stop, moment, handle, runner, record))
            for stop, moment in sc.stops
        ]
        async with asyncio.timeout(10):
            await ended.wait()
            await asyncio.gather(*helpers)
        outcome: str
        result: object = None
        try:
            result = await handle
            outcome = "result"
        except asyncio.CancelledError:
            outcome = "cancelled"
        except TimeoutError:
            outcome = "timeout"
        except Exception:
            outcome = "error"
        current = asyncio.current_task()
        assert current is not None and current.cancelling() == 0, "a handle cancelled its awaiter"
        check_status(sc, handle, record, outcome, result, started_at, ended_at[0])
        finals = [e for e in collected if isinstance(e, HandleFinished)]
        assert len(finals) == 1 and collected[-1] is finals[0], "not exactly one terminal event"
        assert finals[0].status == handle.status

        # Nothing writes into a transcript after the run: not even a tool thread still going.
        snapshot = copy.deepcopy(transcripts(agent, workflow))
        deadline = time.monotonic() + 3
        while t.threads.active and time.monotonic() < deadline:  # noqa: ASYNC110 - a thread count
            await asyncio.sleep(0.005)
        assert t.threads.active == 0, "a tool thread is still running after 3 s"
        for _ in range(5):
            await asyncio.sleep(0)
        assert transcripts(agent, workflow) == snapshot, "a transcript changed after the run"

        assert not agent.running
        for messages in snapshot:
            validate(messages)
            assert dangling_calls(messages) == [], f"dangling tool calls in {messages}"
        if workflow is None and sc.stream != "break":
            expected = {"completed": "completed", "interrupted": "interrupted",
                        "cancelled": "cancelled", "timed_out": "timed_out", "failed": "failed"}
            assert agent.last_status == expected[handle.status]
        if store is not None:
            assert await store.load("fuzz") == agent.model_client.messages
            info = await store.info("fuzz")
            assert info is not None and info.status == agent.last_status

        # The server saw every stream end: finished, or abandoned by the client.
        await wait_streams_closed(t.server, first_stream)
        if isinstance(model, ScriptedModel):
            assert model.open_streams == 0

        # Each transcript goes to a fresh agent and on to a model: no 400.
        async with openai_client(t.server) as follow_model:
            for messages in snapshot:
                if not messages:
                    continue
                fresh = aio.Agent(follow_model.fork())
                fresh.restore(messages)
                assert await fresh.run("and then?") == FOLLOW_UP
        await wait_streams_closed(t.server, first_stream)

        if store is not None:
            # A new process with the same store and session continues from the same place.
            await agent.aclose()
            again = aio.Agent(ScriptedModel([]), store=store, session="fuzz", **options)
            await again.open()
            assert again.model_client.messages == snapshot[0]
            await again.aclose()
    finally:
        await agent.aclose()
        await model.aclose()
        if store is not None:
            store.close()
    for _ in range(5):
        await asyncio.sleep(0)
    left = asyncio.all_tasks() - {asyncio.current_task()}
    assert not left, f"tasks left running: {left}"


async def stopper(
    sc: Scenario,
    stop: str,
    moment: tuple[Any, ...],
    handle: aio.RunHandle[Any],
    runner: aio.Agent | aio.Chain | aio.Parallel,
    record: Record,
) -> None:
    """Apply one of the scenario's stops at its moment."""
    if stop == "none":
        return
    if stop == "events_break":
        seen = 0
        stream = handle.events()
        async for _ in stream:
            seen += 1
            if seen > sc.break_after:
                break
        if sc.seed % 2:
            await stream.aclose()
        return
    waiter: asyncio.Task[Any] | None = None
    if stop == "waiter_cancel":
        waiter = asyncio.create_task(_await(handle))
    if moment[0] == "listener":
        await listen(stop, moment, handle, runner, record)
        return
    await reach(moment, handle)
    if stop == "cancel":
        record.cancels.append(handle.cancel("fuzz"))
    elif stop == "interrupt":
        record.interrupts.append(handle.interrupt())
    elif stop == "direct_interrupt":
        record.interrupts.append(runner.interrupt())
    elif stop == "stop":
        record.stops.append(await handle.stop(grace=sc.grace))
    elif stop in ("thread_cancel", "thread_interrupt", "thread_stop"):
        loop = asyncio.get_running_loop()
        answered: asyncio.Future[Any] = loop.create_future()
        if stop == "thread_cancel":
            work: Callable[[], Any] = lambda: handle.cancel("thread")  # noqa: E731
        elif stop == "thread_interrupt":
            work = handle.interrupt
        else:
            work = lambda: asyncio.run(handle.stop(grace=sc.grace))  # noqa: E731

        def in_thread() -> None:
            outcome = work()
            loop.call_soon_threadsafe(answered.set_result, outcome)

        thread = threading.Thread(target=in_thread)
        thread.start()
        answer = await answered
        thread.join()
        if stop == "thread_stop":
            record.stops.append(answer)
    elif stop == "waiter_cancel":
        assert waiter is not None
        await asyncio.sleep(0)  # the waiter is awaiting the handle now
        waiter.cancel()
        try:
            await waiter
            record.waiter = "finished"
        except asyncio.CancelledError:
            record.waiter = "cancelled"
        except Exception as error:  # the run ended (deadline, failure) before the cancel
            record.waiter = type(error).__name__


async def listen(
    stop: str,
    moment: tuple[Any, ...],
    handle: aio.RunHandle[Any],
    runner: aio.Agent | aio.Chain | aio.Parallel,
    record: Record,
) -> None:
    """Apply a cancel or interrupt inside the run, right as the n-th such event is emitted."""
    wanted, count = moment[1], moment[2]
    remaining = [count]

    def on_event(event: Event) -> None:
        if type(event).__name__ != wanted or remaining[0] <= 0:
            return
        remaining[0] -= 1
        if remaining[0] == 0:
            if stop == "cancel":
                # Inside the run's own task: it lands at the run's next await, and a run
                # that returns without one keeps its result (the handle's state diagram).
                record.inner_cancels.append(handle.cancel("fuzz"))
            elif stop == "interrupt":
                record.interrupts.append(handle.interrupt())
            else:
                record.interrupts.append(runner.interrupt())

    remove = handle.scope.add_listener(on_event)
    try:
        done = asyncio.Event()
        handle.add_done_callback(lambda _: done.set())
        await done.wait()
    finally:
        remove()


async def _await(handle: aio.RunHandle[Any]) -> Any:
    return await handle


def check_status(
    sc: Scenario,
    handle: aio.RunHandle[Any],
    record: Record,
    outcome: str,
    result: object,
    started_at: float,
    ended_at: float,
) -> None:
    """The handle's status agrees with what happened to it."""
    status = handle.status
    kinds = sc.kinds()
    if sc.fault is None:
        assert status != "failed", f"the run failed: {handle._error!r}"
    assert handle.done
    expected_outcome = {"completed": "result", "interrupted": "result",
                        "cancelled": "cancelled", "timed_out": "timeout", "failed": "error"}
    assert outcome == expected_outcome[status]
    if status == "timed_out":
        assert sc.timeout is not None, "timed out with no deadline"
        assert ended_at >= started_at + sc.timeout - 0.01, "timed out before the deadline"
        assert True not in record.cancels, "a cancel that was accepted read as a timeout"
        assert handle.reason == "deadline passed"
    if True in record.cancels:
        assert status == "cancelled", f"an accepted cancel ended {status}"
    if status == "cancelled":
        assert kinds & CANCELS, "cancelled by nobody"
        reasons = {REASONS[k] for k in kinds & CANCELS}
        assert handle.reason is not None
        assert any(handle.reason.startswith(r) for r in reasons), handle.reason
    if status == "interrupted":
        assert kinds & INTERRUPTS, "interrupted by nobody"
    for stopped in record.stops:
        assert stopped == status, f"stop() returned {stopped}, the handle is {status}"
    if "waiter_cancel" in kinds and record.waiter not in ("cancelled", "finished"):
        assert status in ("timed_out", "failed"), record.waiter
    if sc.stream == "break" and result == INNER_BREAK:
        # The run coroutine stopped reading its stream and returned: the handle completed,
        # or is interrupted when a loop inside had honoured an interrupt before that.
        assert status in ("completed", "interrupted")
        return
    if status == "interrupted":
        assert result == INTERRUPTED
    if status == "completed":
        if sc.workflow == "parallel":
            assert isinstance(result, str) and result.count(FINAL) == 2, result
        else:
            assert result == FINAL, result
    if not kinds & (CANCELS | INTERRUPTS):
        natural = "completed" if sc.fault is None else "failed"
        assert status in (natural, "timed_out"), f"{kinds} ended the run {status}"
        if sc.timeout is None:
            assert status == natural


def transcripts(agent: aio.Agent, workflow: aio.Chain | aio.Parallel | None) -> list[Any]:
    """Every transcript of the trial (the workflow's whole state for a workflow)."""
    if workflow is None:
        return [agent.model_client.messages]
    state = workflow.state
    records = state.get("steps") or state.get("branches") or []
    return [record["messages"] for record in records]


async def wait_streams_closed(server: LoopbackServer, first: int) -> None:
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        records = server.streams[first:]
        if all(r.finished_at is not None for r in records):
            break
        await asyncio.sleep(0.005)
    for index, stream in enumerate(server.streams[first:]):
        assert stream.finished_at is not None, f"stream {first + index} is still open after 3 s"
        assert stream.completed or stream.abandoned or stream.fault is not None, (
            f"stream {first + index}: {stream}"
        )


# -- the tests ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer.in_thread() as running:
        yield running


def loop_failures(loop: asyncio.AbstractEventLoop, failures: list[dict[str, Any]]) -> None:
    loop.set_exception_handler(lambda _, context: failures.append(context))


TRIALS_PER_TEST = 12
BATCHES = 8


@pytest.mark.slow
@pytest.mark.parametrize("batch", range(BATCHES))
async def test_random_stops_keep_every_invariant(
    batch: int, server: LoopbackServer, tmp_path: Path
) -> None:
    loop = asyncio.get_running_loop()
    failures: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop_failures(loop, failures)
    try:
        for seed in range(batch * TRIALS_PER_TEST, (batch + 1) * TRIALS_PER_TEST):
            sc = make_scenario(seed)
            try:
                await run_trial(Trial(sc, server, tmp_path))
                gc.collect()
                assert not failures, f"loop exception: {failures}"
            except BaseException as error:
                raise AssertionError(f"trial failed: {sc}") from error
    finally:
        loop.set_exception_handler(previous)


# -- regressions found by the fuzz -------------------------------------------------------


async def _cancel_then_stop_reading(
    agent: aio.Agent, stop_at: type[Event]
) -> aio.RunHandle[str]:
    """Read ``agent.run(stream=True)`` in a handle; at the first ``stop_at`` event cancel
    the handle and stop reading at once (the cancel is still pending when the stream closes)."""

    async def read() -> str:
        events = agent.run("go", stream=True)
        async with aclosing(events):
            async for event in events:
                if isinstance(event, stop_at):
                    assert handle.cancel("stop reading")
                    break
        return INNER_BREAK

    handle = aio.RunHandle.start(read())
    with pytest.raises(asyncio.CancelledError):
        await handle
    return handle


async def test_closing_a_stream_while_a_cancel_is_pending_mid_turn(
    server: LoopbackServer,
) -> None:
    # Seed 219: closing the stream awaits the HTTP response's close, where the pending
    # cancel lands; the loop then yielded its RunFinished during aclose() ("async
    # generator ignored GeneratorExit") and the handle read "failed", not "cancelled".
    server.script = [Turn(text="one two three four", delay=0.01), Turn(text=FOLLOW_UP)]
    async with openai_client(server) as model:
        agent = aio.Agent(model)
        handle = await _cancel_then_stop_reading(agent, aio.TextChunk)
        assert handle.status == "cancelled" and handle.reason == "stop reading"
        assert agent.last_status == "cancelled" and not agent.running
        validate(agent.model_client.messages)
        assert await agent.run("again") == FOLLOW_UP


async def test_closing_a_stream_while_a_cancel_is_pending_mid_tool_round() -> None:
    # The same, in a concurrent tool round: closing it awaits the cancelled tool tasks.
    async def fast() -> str:
        """Answer at once."""
        return "fast"

    async def slow() -> str:
        """Take ten seconds."""
        await asyncio.sleep(10)
        return "slow"

    script = [Turn(tool_calls=[ScriptedCall("fast"), ScriptedCall("slow")]), Turn(text=FINAL)]
    agent = aio.Agent(ScriptedModel(script), [fast, slow], concurrent_tools=True)
    handle = await _cancel_then_stop_reading(agent, aio.ToolResult)
    assert handle.status == "cancelled"
    assert agent.last_status == "cancelled" and not agent.running
    messages = agent.model_client.messages
    validate(messages)
    assert dangling_calls(messages) == []
    assert next(m["content"] for m in messages if m["role"] == "tool") == "fast"
