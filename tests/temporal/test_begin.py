"""Where a run's messages begin, with no ``aimu.begin`` before its first turn: the turn
counts them as it opens the session and keeps the count in the run's record before the
task is stored, so a retried turn finds its task once (the first attempt stopped after
storing the task, before the run's record; or after the count, before the task). A
history from before (with ``aimu.begin``) replays as it ran; one recorded now replays
too, in the sandbox and out of it."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner

from aimu.aio.store import SQLiteStore
from aimu.temporal import RunsClient
from aimu.temporal._worker import _RUNNER
from aimu.temporal._workflow import RunWorkflow
from aimu.testing.script import Turn
from aimu.testing.server import LoopbackServer
from tests.temporal.conftest import Workers
from tests.temporal.test_retry import block_until_retried
from tests.temporal.test_runs import HELD, PAY, approval_tool, paused, restorable

HISTORIES = Path(__file__).parent / "histories"
#: Histories recorded by the aimu before the first turn found where a run begins (its
#: workflow ran ``aimu.begin`` first): a one-turn run, and a run paused, approved, resumed.
BEFORE = ["one_turn_begin.json", "paused_approved_begin.json"]
RUNNERS = {"sandboxed": _RUNNER, "no sandbox": UnsandboxedWorkflowRunner()}


async def replay(history: WorkflowHistory, runner: str) -> None:
    """Replay ``history`` with this aimu's workflow (raises if it does not replay)."""
    replayer = Replayer(workflows=[RunWorkflow], workflow_runner=RUNNERS[runner])
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, result.replay_failure


def stored(name: str, *, begins_in_turn: bool | None = None) -> WorkflowHistory:
    """A stored history (``begins_in_turn``: its run request's flag set so)."""
    data = json.loads((HISTORIES / name).read_text())
    if begins_in_turn is not None:
        started = data["events"][0]["workflowExecutionStartedEventAttributes"]
        payload = started["input"]["payloads"][0]
        request = json.loads(base64.b64decode(payload["data"]))
        request["begins_in_turn"] = begins_in_turn
        payload["data"] = base64.b64encode(json.dumps(request).encode()).decode()
    workflow_id = data["events"][0]["workflowExecutionStartedEventAttributes"].get(
        "workflowId", "replayed"
    )
    return WorkflowHistory.from_json(workflow_id, data)


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("name", BEFORE)
async def test_a_history_from_before_replays_with_its_begin(name: str, runner: str) -> None:
    await replay(stored(name), runner)


async def test_the_replay_tells_a_begin_the_workflow_no_longer_runs() -> None:
    """The replays above prove something: the same history whose request says the turn
    begins the run (the workflow then schedules no ``aimu.begin``) does not replay."""
    replayer = Replayer(workflows=[RunWorkflow], workflow_runner=UnsandboxedWorkflowRunner())
    result = await replayer.replay_workflow(
        stored(BEFORE[0], begins_in_turn=True), raise_on_replay_failure=False
    )
    assert result.replay_failure is not None


def kinds(history: WorkflowHistory) -> list[str]:
    return [EventType.Name(e.event_type) for e in history.events]


@pytest.mark.parametrize("sandboxed", [True, False], ids=["sandboxed", "no sandbox"])
async def test_a_run_now_begins_in_its_turn_and_replays(
    sandboxed: bool,
    runs: RunsClient,
    workers: Workers,
    store: SQLiteStore,
    model_server: LoopbackServer,
) -> None:
    transfer, done = approval_tool()
    await workers.start(tools=[transfer], sandboxed=sandboxed)
    model_server.script = [Turn("hi"), PAY, Turn("done")]
    one = await runs.start("s1", "hello")
    state = await runs.wait(one, timeout=60)
    assert (state["status"], state["messages_from"]) == ("completed", 0)
    two = await runs.start("s1", "pay")
    state = await paused(runs, two)
    assert state["messages_from"] == 2  # where its task is: after the first run's two
    await runs.approve(two, state["pending"][0]["call_id"])
    state = await runs.wait(two, timeout=60)
    assert (state["status"], state["reply"], done) == ("completed", "done", ["transfer"])
    assert state["messages_from"] == 2
    record = await store.run(one)
    assert record is not None and record.messages_from == 0
    for run_id in (one, two):
        history = await runs.client.get_workflow_handle(run_id).fetch_history()
        assert kinds(history)[3:5] == [  # the turn is scheduled first: no aimu.begin
            "EVENT_TYPE_WORKFLOW_TASK_COMPLETED",
            "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED",
        ]
        for runner in RUNNERS:
            await replay(history, runner)


class StoppedStore(SQLiteStore):
    """A store whose writers hold the first attempt of a turn at ``where`` (just before
    the task is stored: ``task``; just after, before the run's record: ``stored``) until
    Temporal gives the turn to a second attempt, which takes it over (it cancels this
    one): as if the first attempt's worker had died there."""

    where = "task"
    temporal = ""
    armed = False
    held: list[int]

    async def open_session(self, session: str) -> Any:
        writer = await super().open_session(session)
        append, set_status = writer.append, writer.set_status

        async def hold() -> None:
            info = activity.info()
            if not self.armed or info.attempt != 1:
                return
            self.held.append(info.attempt)
            block_until_retried(self.temporal, info.workflow_id or "")
            await asyncio.Event().wait()  # until the retry takes the turn over

        async def appending(message: Any) -> None:
            if (
                self.where == "task"
                and activity.in_activity()
                and message["role"] == "user"
                and message.get("content") == "again"
            ):
                await hold()
            await append(message)

        async def setting(status: str) -> None:
            if self.where == "stored" and activity.in_activity() and status == "in_progress":
                await hold()
            await set_status(status)

        writer.append, writer.set_status = appending, setting
        return writer


@pytest.fixture
async def workers_on(
    temporal: str, queue: str, model_server: LoopbackServer
) -> AsyncIterator[Callable[[SQLiteStore], Workers]]:
    """Workers on a store the test makes (closed, with it, at the end)."""
    made: list[Workers] = []

    def on(store: SQLiteStore) -> Workers:
        made.append(Workers(temporal, queue, store, model_server))
        return made[-1]

    yield on
    for workers in made:
        await workers.aclose()
        await workers.store.aclose()


@pytest.mark.parametrize("where", ["task", "stored"])
async def test_a_retried_first_turn_finds_where_its_run_begins(
    where: str,
    temporal: str,
    runs: RunsClient,
    model_server: LoopbackServer,
    workers_on: Callable[[SQLiteStore], Workers],
    tmp_path: Path,
) -> None:
    """The session already holds the same task (an earlier run's): the retry must look
    for its own after where the run began, not find that one."""
    store = StoppedStore(tmp_path / "sessions.db")
    store.where, store.temporal, store.held = where, temporal, []
    workers = workers_on(store)
    model_server.script = [Turn("first"), Turn("second")]
    await workers.start()
    earlier = await runs.start("s1", "again")
    assert (await runs.wait(earlier, timeout=60))["status"] == "completed"
    store.armed = True
    run_id = await runs.start("s1", "again")
    state = await runs.wait(run_id, timeout=90)
    assert (state["status"], state["reply"]) == ("completed", "second")
    assert state["messages_from"] == 2
    assert store.held == [1]
    messages = await restorable(store, "s1")
    assert [(m["role"], m["content"]) for m in messages] == [
        ("user", "again"),
        ("assistant", "first"),
        ("user", "again"),
        ("assistant", "second"),
    ]
    history = await runs.client.get_workflow_handle(run_id).fetch_history()
    started = [
        e.activity_task_started_event_attributes
        for e in history.events
        if e.HasField("activity_task_started_event_attributes")
    ]
    assert started[-1].attempt == 2


async def test_a_session_name_that_does_not_check_out_fails_the_run_at_once(
    runs: RunsClient,
    workers: Workers,
) -> None:
    await workers.start()
    run_id = await runs.start("not/a/name", "hello")
    state = await runs.wait(run_id, timeout=30)
    assert state["status"] == "failed"
    history = await runs.client.get_workflow_handle(run_id).fetch_history()
    failed = [
        e.activity_task_failed_event_attributes.failure
        for e in history.events
        if e.HasField("activity_task_failed_event_attributes")
    ]
    assert len(failed) == 1, failed  # not retried
    assert failed[0].application_failure_info.type == "AimuBadInput"
    assert "invalid session name" in failed[0].message


async def test_a_server_that_adopts_a_run_in_its_first_turn_knows_where_it_begins(
    temporal: str,
    queue: str,
    runs: RunsClient,
    workers: Workers,
    store: SQLiteStore,
    model_server: LoopbackServer,
) -> None:
    """Before the first turn says where the run begins (its outcome), the workflow does
    not know: a serve process that did not start the run reads it in the run's record."""
    from aimu.serve.backends.temporal import TemporalBackend

    await workers.start()
    model_server.script = [Turn("first"), HELD]
    earlier = await runs.start("s1", "one")
    assert (await runs.wait(earlier, timeout=60))["status"] == "completed"
    run_id = await runs.start("s1", "two")
    async for _, event in runs.events(run_id):
        if event["type"] == "text":
            break  # provably in the first turn: the worker read a chunk of the reply
    assert (await runs.status(run_id))["messages_from"] is None
    backend = TemporalBackend(temporal, queue, store)
    try:
        await backend.connect()
        view = await backend.view(run_id)
        assert (view.session, view.messages_from) == ("s1", 2)
    finally:
        await backend.aclose()
    assert await runs.cancel(run_id, "done")
    assert (await runs.wait(run_id, timeout=60))["status"] == "cancelled"
    # A turn cancelled returns no outcome to say it in: the record says it still.
    record = await store.run(run_id)
    assert record is not None and record.messages_from == 2


class TaskHeldStore(SQLiteStore):
    """A store whose writers hold a task's append until the turn is cancelled."""

    reached: asyncio.Event

    async def open_session(self, session: str) -> Any:
        writer = await super().open_session(session)
        append = writer.append

        async def appending(message: Any) -> None:
            if message["role"] == "user":
                self.reached.set()
                await asyncio.Event().wait()  # until the cancel reaches the run
            await append(message)

        writer.append = appending
        return writer


async def test_a_run_cancelled_before_its_task_was_stored_is_recorded_so(
    runs: RunsClient, workers_on: Callable[[SQLiteStore], Workers], tmp_path: Path
) -> None:
    """The record the turn wrote before the task does not go on saying ``running``."""
    store = TaskHeldStore(tmp_path / "sessions.db")
    store.reached = asyncio.Event()
    workers = workers_on(store)
    await workers.start()
    run_id = await runs.start("s1", "hello")
    await asyncio.wait_for(store.reached.wait(), 60)  # the record is written: the task next
    record = await store.run(run_id)
    assert record is not None and (record.status, record.messages_from) == ("running", 0)
    assert await runs.cancel(run_id, "the user pressed Stop")
    assert (await runs.wait(run_id, timeout=60))["status"] == "cancelled"
    record = await store.run(run_id)
    assert record is not None and record.status == "cancelled", record
    assert record.messages_from == 0
    assert await store.load("s1") == []
