"""Logging under "aimu": nothing at INFO on the happy path, no secret ever, contents only at DEBUG.

Runs go over the loopback server's OpenAI endpoint with an API key, a password in the
base URL, a SQLite store and tools; every record of the "aimu" loggers is read.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer

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
    return [r for r in caplog.records if r.name == "aimu" or r.name.startswith("aimu.")]


def no_secret_in(records: list[logging.LogRecord]) -> None:
    for record in records:
        text = record.getMessage() + str(record.exc_info or "")
        assert SECRET not in text and PASSWORD not in text, (record.name, text)


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
