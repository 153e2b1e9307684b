"""Logging under "aimu": nothing at INFO on the happy path, no secret ever, contents only at DEBUG.

Runs go over the loopback server's OpenAI endpoint with an API key, a password in the
base URL, a SQLite store and tools; every record of the "aimu" loggers is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from tests.aio.store.store_backends import KINDS, backend

SECRET = "sk-secret-key-4242"
PASSWORD = "hunter2-password"
CODE = "7781"  # message contents: the task, a tool's arguments and result carry it
TASK = f"check the launch code {CODE}"


def lookup(code: str) -> str:
    """Look a code up."""
    return f"code {code} is valid"


def broken(code: str) -> str:
    """Fail, naming the code."""
    raise ValueError(f"code {code} is wrong")


def happy(request: Mapping[str, Any]) -> Turn:
    if request["messages"][-1]["role"] == "tool":
        return Turn(text=f"all good with {CODE}")
    return Turn(tool_calls=(ScriptedCall("lookup", {"code": CODE}),))


def troubled() -> Any:
    """A 429 first (retried), then a failing tool and bad arguments, then the answer."""
    served = 0

    def script(request: Mapping[str, Any]) -> Turn:
        nonlocal served
        served += 1
        if served == 1:
            return Turn(fault="http_429")
        if request["messages"][-1]["role"] == "tool":
            return Turn(text=f"sorry about {CODE}")
        return Turn(
            tool_calls=(
                ScriptedCall("broken", {"code": CODE}),
                ScriptedCall("lookup", {"code": int(CODE)}),
            )
        )

    return script


async def run_logged(
    script: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, level: int
) -> list[logging.LogRecord]:
    caplog.set_level(level, logger="aimu")
    async with LoopbackServer(script) as server:
        base_url = server.openai_base_url.replace("://", f"://user:{PASSWORD}@", 1)
        model = aio.client("openai:m", base_url=base_url, api_key=SECRET, retry_delay=0.01)
        store = aio.SQLiteStore(tmp_path / "runs.db")
        agent = aio.Agent(model, tools=[lookup, broken], store=store, session="s")
        try:
            await aio.RunHandle.start(agent.run(TASK))
        finally:
            await agent.aclose()
            await store.aclose()
            await model.aclose()
    return aimu_records(caplog)


def no_secret_in(records: list[logging.LogRecord]) -> None:
    for record in records:
        text = record.getMessage() + str(record.exc_info or "")
        assert SECRET not in text and PASSWORD not in text, (record.name, text)


def keeps_the_rules(records: list[logging.LogRecord]) -> None:
    """No secret in any record; no message contents above DEBUG."""
    no_secret_in(records)
    for record in records:
        if record.levelno > logging.DEBUG:
            assert CODE not in record.getMessage(), (record.name, record.getMessage())


def said(records: list[logging.LogRecord]) -> list[tuple[str, str, str]]:
    return [(r.name, r.levelname, r.getMessage()) for r in records]


def aimu_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "aimu" or r.name.startswith("aimu.")]


async def test_a_happy_run_logs_nothing_at_info_or_above(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    records = await run_logged(happy, tmp_path, caplog, logging.DEBUG)
    loud = [(r.name, r.levelname, r.getMessage()) for r in records if r.levelno >= logging.INFO]
    assert loud == []
    no_secret_in(records)


async def test_contents_are_logged_only_at_debug(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    records = await run_logged(troubled(), tmp_path, caplog, logging.DEBUG)
    with_contents = [r for r in records if CODE in r.getMessage()]
    assert with_contents, "DEBUG shows the tools' arguments and results"
    assert {r.levelno for r in with_contents} == {logging.DEBUG}
    no_secret_in(records)


async def test_retries_and_tool_failures_are_logged_by_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    records = await run_logged(troubled(), tmp_path, caplog, logging.INFO)
    said = [(r.name, r.levelname, r.getMessage()) for r in records]
    assert any(name == "aimu.aio.providers" and "retry 1 of" in text for name, _, text in said)
    assert any(
        name == "aimu.aio.tools" and level == "WARNING"
        and text.startswith("tool 'broken' raised ValueError (call ")
        for name, level, text in said
    )
    assert any(
        name == "aimu.aio.tools" and level == "INFO" and "'lookup': the model sent invalid" in text
        for name, level, text in said
    )
    assert all(CODE not in text for _, _, text in said), said
    no_secret_in(records)


def test_the_aimu_logger_leaves_output_to_the_application() -> None:
    handlers = logging.getLogger("aimu").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


# --------------------------------------------------------------------------- stores


async def store_a_run(store: aio.Store) -> None:
    agent = aio.Agent(aio.client("test"), store=store, session="s")
    async with agent:
        await agent.run(TASK)


@pytest.fixture(params=["jsonl", "sqlite"])
def store(
    request: pytest.FixtureRequest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> aio.Store:
    """A local store, every "aimu" record captured."""
    caplog.set_level(logging.DEBUG, logger="aimu")
    if request.param == "jsonl":
        return aio.JSONLStore(tmp_path)
    return aio.SQLiteStore(tmp_path / "runs.db")


async def test_a_torn_record_is_logged_when_ignored_and_when_removed(
    store: aio.Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await store_a_run(store)
    if isinstance(store, aio.JSONLStore):
        path = tmp_path / "s.jsonl"
        path.write_bytes(path.read_bytes() + f'{{"role":"user","content":"{CODE}'.encode())
    else:
        with sqlite3.connect(tmp_path / "runs.db") as db:
            db.execute(
                "UPDATE messages SET body = substr(body, 1, 20) WHERE seq = "
                "(SELECT max(seq) FROM messages)"
            )
    caplog.clear()
    with pytest.warns(RuntimeWarning, match="torn"):
        await store.load("s")
    with pytest.warns(RuntimeWarning, match="torn"):
        writer = await store.open_session("s")
    await writer.aclose()
    await store.aclose()
    records = aimu_records(caplog)
    torn = [(level, text) for name, level, text in said(records) if name == "aimu.aio.store"]
    assert [level for level, _ in torn] == ["WARNING", "WARNING"], torn
    assert "torn last record" in torn[0][1] and "was ignored" in torn[0][1]
    assert "was removed" in torn[1][1]
    keeps_the_rules(records)


@pytest.mark.parametrize("kind", KINDS)
async def test_an_unfinished_run_and_its_calls_in_doubt_are_logged_on_load(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="aimu")
    async with backend(kind, tmp_path) as where:
        await crash_and_load(where.make(), caplog)


async def crash_and_load(store: aio.Store, caplog: pytest.LogCaptureFixture) -> None:
    """Leave what a process killed mid-tool leaves; load it; check what was logged."""
    call = {
        "id": "call_9",
        "type": "function",
        "function": {"name": "lookup", "arguments": {"code": CODE}},
    }
    writer = await store.open_session("s")  # what a process killed mid-tool left behind
    await writer.set_status("in_progress")
    await writer.append({"role": "user", "content": TASK})
    await writer.append({"role": "assistant", "content": "", "tool_calls": [call]})  # type: ignore[typeddict-item]
    await writer.record_tool_start("call_9", "lookup", {"code": CODE})
    await writer.aclose()
    caplog.clear()
    agent = aio.Agent(aio.client("test"), tools=[lookup], store=store, session="s")
    await agent.open()
    await agent.aclose()
    await store.aclose()
    records = aimu_records(caplog)
    loud = [(name, level, text) for name, level, text in said(records) if level != "DEBUG"]
    assert [(name, level) for name, level, _ in loud] == [
        ("aimu.aio.store", "WARNING"),
        ("aimu.aio.journal", "WARNING"),
    ], loud
    assert "session 's'" in loud[0][2] and "its last run did not finish" in loud[0][2]
    assert loud[1][2].endswith("answered outcome unknown: lookup (call_9)"), loud[1][2]
    keeps_the_rules(records)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_refused_session_lock_is_logged(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="aimu")
    async with backend(kind, tmp_path) as where, where.make() as store:
        first = aio.Agent(aio.client("test"), store=store, session="s")
        second = aio.Agent(aio.client("test"), store=store, session="s")
        async with first:
            with pytest.raises(aio.SessionLockedError):
                await second.run(TASK)
    records = aimu_records(caplog)
    refused = [text for name, level, text in said(records) if name == "aimu.aio.store"]
    assert len(refused) == 1, said(records)
    ended = "agent 'agent': the run ended failed: SessionLockedError"
    assert ("aimu.aio.agent", "INFO", ended) in said(records)
    assert refused[0].startswith("session 's': refused the write lock, held by "), refused
    keeps_the_rules(records)


# --------------------------------------------------------------------------- streams and stops


async def test_a_reply_that_breaks_off_mid_stream_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reply = Turn(text=f"the code {CODE} is fine and more", fault="drop", fault_after=3)
    with pytest.raises(aio.ModelConnectionError):  # asked 4 times: its 3 retries used up
        await run_logged([reply] * 4, tmp_path, caplog, logging.DEBUG)
    records = aimu_records(caplog)
    loud = [(name, level, text) for name, level, text in said(records) if level != "DEBUG"]
    assert [(name, level) for name, level, _ in loud] == [
        *[("aimu.aio.providers", "INFO")] * 3,
        ("aimu.aio.providers", "WARNING"),
        ("aimu.aio.agent", "INFO"),
    ], loud
    assert "retry 3 of 3" in loud[2][2]
    assert "the reply broke off mid-stream (ModelConnectionError); no retry was left" in (
        loud[3][2]
    )
    assert loud[4][2] == "agent 'agent': the run ended failed: ModelConnectionError"
    keeps_the_rules(records)


class Gate:
    """Where a held tool is: ``entered`` once it runs; it returns once ``opened``."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.opened = asyncio.Event()


gate = Gate()


async def held(code: str) -> str:
    """Wait until the gate opens."""
    gate.entered.set()
    await gate.opened.wait()
    return code


@aio.tool(approval=True)
def launch(code: str) -> str:
    """Launch, once a person approves."""
    return code


def calls(name: str) -> Any:
    def script(request: Mapping[str, Any]) -> Turn:
        return Turn(tool_calls=(ScriptedCall(name, {"code": CODE}),))

    return script


async def stop_logged(
    name: str, stop: str, caplog: pytest.LogCaptureFixture
) -> list[tuple[str, str, str]]:
    """Run an agent whose model calls tool ``name``; ``stop`` it once the tool runs."""
    global gate
    gate = Gate()
    caplog.set_level(logging.DEBUG, logger="aimu")
    async with LoopbackServer(calls(name)) as server:
        model = aio.client("openai:m", base_url=server.openai_base_url, api_key=SECRET)
        agent = aio.Agent(model, tools=[held, launch, lookup], max_rounds=2)
        handle = aio.RunHandle.start(agent.run(TASK), timeout=0.05 if stop == "deadline" else None)
        if stop == "cancel":
            await gate.entered.wait()
            handle.cancel("the user pressed Stop")
        elif stop == "interrupt":
            await gate.entered.wait()
            handle.interrupt()
            gate.opened.set()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await handle
        await model.aclose()
    records = aimu_records(caplog)
    keeps_the_rules(records)
    return [(n, level, text) for n, level, text in said(records) if n == "aimu.aio.agent"]


@pytest.mark.parametrize(
    ("tool", "stop", "logged"),
    [
        ("held", "cancel", "cancelled: the user pressed Stop"),
        ("held", "deadline", "timed_out: deadline passed"),
        ("held", "interrupt", "interrupted: interrupt requested; stopped at a step boundary"),
        ("launch", None, "paused: tool calls wait for approval: launch (call_"),
        ("lookup", None, "max_rounds: the limit of 2 tool rounds was reached"),
    ],
)
async def test_a_stop_is_logged_once_at_info_with_why(
    tool: str, stop: str | None, logged: str, caplog: pytest.LogCaptureFixture
) -> None:
    records = await stop_logged(tool, str(stop), caplog)
    assert len(records) == 1, records
    _, level, text = records[0]
    assert level == "INFO" and text.startswith(f"agent 'agent': the run ended {logged}"), text


async def test_an_answer_cut_off_is_logged_incomplete_with_the_models_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    records = await run_logged(
        [Turn(text=f"the code {CODE} is", stop_reason="length")], tmp_path, caplog, logging.DEBUG
    )
    loud = [(name, level, text) for name, level, text in said(records) if level != "DEBUG"]
    assert loud == [
        ("aimu.aio.agent", "INFO", "agent 'agent': the run ended incomplete: the model "
         "stopped with 'length'")
    ]
    keeps_the_rules(records)
