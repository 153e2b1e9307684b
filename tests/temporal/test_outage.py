"""Temporal going away mid-run and coming back (issue 34 item 5): the dev server (its
history in a file) is killed while a non-idempotent tool runs, a Stop is asked for while
it is down, and it is started again on the same port. Its own server: the others' stays up."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

import pytest

from aimu import aio
from aimu.aio.errors import ControlError
from aimu.aio.store import SQLiteStore
from aimu.temporal import RunsClient
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from tests.services import PrivateTemporal
from tests.temporal.conftest import HEARTBEAT_TIMEOUT, Workers
from tests.temporal.test_runs import restorable

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[PrivateTemporal]:
    made = PrivateTemporal()
    try:
        yield made
    finally:
        made.stop()


@pytest.fixture
async def own_workers(
    server: PrivateTemporal, queue: str, store: SQLiteStore, model_server: LoopbackServer
) -> AsyncIterator[Workers]:
    made = Workers(server.address, queue, store, model_server)
    yield made
    await made.aclose()


async def test_the_run_survives_temporal_going_away_and_coming_back(
    server: PrivateTemporal, queue: str, own_workers: Workers, store: SQLiteStore,
    model_server: LoopbackServer,
) -> None:
    charged: list[int] = []
    began, go = threading.Event(), threading.Event()

    @aio.tool
    async def charge(amount: int) -> str:
        """Charge the card (not idempotent)."""
        charged.append(amount)
        began.set()
        while not go.is_set():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        return f"charged {amount}"

    model_server.script = [Turn("paying ", tool_calls=(ScriptedCall("charge", {"amount": 5}),)),
                           Turn("paid")]
    runs = await RunsClient.connect(server.address, queue,
                                    heartbeat_timeout=HEARTBEAT_TIMEOUT)
    await own_workers.start(tools=[charge])
    run_id = await runs.start("s1", "pay")
    await asyncio.to_thread(began.wait, 60)  # the tool is running on the worker
    await asyncio.to_thread(server.halt)
    go.set()  # the run goes on without Temporal: the tool ends, the model answers
    await model_server.wait_requests(2, timeout=60)
    # A Stop while Temporal is down is refused, clearly, once the client's retries run
    # out: it is not delivered later.
    with pytest.raises(ControlError, match=f"Temporal at {server.address}"):
        await runs.request_stop(run_id, grace=0)
    await asyncio.to_thread(server.start)
    state = await runs.wait(run_id, timeout=120)
    assert state["status"] == "completed", state
    assert state["reply"] == "paid"
    assert charged == [5], "the tool ran once"
    # Nor was the model asked again: a turn retried after the heartbeat timeout fired
    # meanwhile finds the run completed in the store (its followers then see a second
    # run_started and run_finished, as after any retried turn).
    assert len(model_server.requests) == 2
    messages = await restorable(store, "s1")
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[-1]["content"] == "paid"
    assert (await store.info("s1")).status == "completed"  # type: ignore[union-attr]
    events = [event async for _, event in runs.events(run_id)]
    assert [e["type"] for e in events].count("tool_result") == 1
    assert events[-1]["type"] == "handle_finished" and events[-1]["status"] == "completed"
