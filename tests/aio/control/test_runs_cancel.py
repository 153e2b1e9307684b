"""``aimu runs cancel RUN_ID --redis URL``: a terminal cancels a live run through Redis,
and the run's stored record says so, with the reason given."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from aimu import aio
from aimu.cli import main
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel


async def test_a_terminal_cancels_a_live_run_through_redis(
    redis_url: str, prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entered = asyncio.Event()

    async def hang() -> str:
        """Wait forever."""
        entered.set()
        await asyncio.Event().wait()
        return "never"

    store = aio.SQLiteStore(tmp_path / "s.db")
    model = ScriptedModel([Turn(tool_calls=(ScriptedCall("hang", {}, id="c1"),))])
    agent = aio.Agent(model, tools=[hang], store=store, session="s")
    cancel = ["runs", "cancel", "--redis", redis_url, "--redis-prefix", prefix]
    try:
        async with aio.RedisControl(redis_url, prefix) as worker:
            handle = aio.RunHandle.start(agent.run("go"), control=worker)
            run_id = await worker.registered(handle)
            await entered.wait()
            assert await asyncio.to_thread(main, [*cancel, run_id, "--reason", "from a shell"]) == 0
            assert capsys.readouterr().out == f"run {run_id} cancelled\n"
            with pytest.raises(asyncio.CancelledError):
                await handle
            # Redis learns the end from the worker's outbox, after the handle ended: a
            # second cancel sent before that is still "accepted" (it was, 1 run in ~30 at
            # load 15). Wait for the end Redis records, then the run has ended everywhere.
            await worker.wait(run_id, timeout=30)
            assert await asyncio.to_thread(main, [*cancel, run_id]) == 1
            assert "had already ended" in capsys.readouterr().err
            assert await asyncio.to_thread(main, [*cancel, "no-such-run"]) == 1
            assert "no-such-run" in capsys.readouterr().err
        record = await store.run(run_id)
        assert record is not None
        assert (record.status, record.reason) == ("cancelled", "from a shell")
    finally:
        await agent.aclose()
        await store.aclose()


def test_a_run_id_is_never_taken_for_an_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """One token in 64 starts with ``-``: ``aimu runs cancel -AC...`` read it as an option
    (seen in CI). Every new run id and pause id is drawn again until it does not."""
    import secrets

    from aimu.aio import _ids

    draws = iter(["-ACnoxc8qlYp4IcmYzbjxmzC", "-x", "ACnoxc8qlYp4IcmYzbjxmzC"])
    monkeypatch.setattr(secrets, "token_urlsafe", lambda nbytes: next(draws))
    assert _ids.new_run_id() == "ACnoxc8qlYp4IcmYzbjxmzC"
    monkeypatch.undo()
    assert not any(_ids.new_run_id().startswith("-") for _ in range(2000))
    assert not any(_ids.new_token(12).startswith("-") for _ in range(2000))
