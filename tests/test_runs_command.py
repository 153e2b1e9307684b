"""``aimu runs list|show`` on a SQLite file and a JSONL directory (the same store API as
GET /runs, so PostgreSQL is the store tests' business): tables, JSON, pages, filters, and
bad input answered with one line and nothing changed."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path

import pytest

from aimu import aio
from aimu.aio.store import RunRecord, Store
from aimu.cli import main


async def _fill(store: Store) -> None:
    async with store:
        writer = await store.open_session("alpha")
        try:
            await writer.record_run(RunRecord("r1", "alpha", "agent", 100.0, "running"))
            await writer.record_run(RunRecord(
                "r1", "alpha", "agent", 100.0, "cancelled", ended=102.5,
                reason="user pressed Stop", models=("openai:m",),
            ))
            await writer.record_run(RunRecord("r2", "alpha", "agent", 200.0, "running"))
        finally:
            await writer.aclose()


@pytest.mark.parametrize("kind", ["sqlite", "jsonl"])
def test_list_and_show(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if kind == "sqlite":
        url = str(tmp_path / "s.db")
        asyncio.run(_fill(aio.SQLiteStore(url)))
    else:
        url = f"jsonl:{tmp_path / 'sessions'}"
        asyncio.run(_fill(aio.JSONLStore(tmp_path / "sessions")))

    assert main(["runs", "list", "--store", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "SESSION", "STATUS", "STARTED", "TOOK", "REASON"]
    assert lines[1].split()[:3] == ["r2", "alpha", "running"]
    assert lines[2].split()[:3] == ["r1", "alpha", "cancelled"]
    assert "2.5s" in lines[2] and lines[2].endswith("user pressed Stop")

    assert main(["runs", "list", "--store", url, "--limit", "1", "--json"]) == 0
    page = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in page["runs"]] == ["r2"] and page["next_before"] == "r2"
    assert main(["runs", "list", "--store", url, "--json", "--before", "r2"]) == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)["runs"]] == ["r1"]
    assert main(["runs", "list", "--store", url, "--status", "completed"]) == 0
    assert capsys.readouterr().out == "no runs\n"

    assert main(["runs", "show", "--store", url, "r1"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["status"] == "cancelled" and shown["models"] == ["openai:m"]

    for argv, code, says in [
        (["list", "--status", "done"], 2, "unknown run status 'done'"),
        (["list", "--before", "r9"], 2, "unknown run id 'r9'"),
        (["list", "--limit", "0"], 2, "limit must be an int from 1 to 1000"),
        (["show", "a/b"], 2, "invalid run id"),
        (["show", "r9"], 1, "no run 'r9' in the store"),
    ]:
        assert main(["runs", *argv[:1], "--store", url, *argv[1:]]) == code
        err = capsys.readouterr().err
        assert err.startswith("aimu runs: ") and says in err and err.count("\n") == 1
    assert main(["runs", "list", "--store", url, "--json"]) == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)["runs"]] == ["r2", "r1"]


def test_a_store_that_is_not_there_is_not_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "none.db"
    assert main(["runs", "list", "--store", str(missing)]) == 2
    assert f"no store at {missing}" in capsys.readouterr().err
    assert not missing.exists()


async def _sessions(store: Store) -> None:
    """Runs in every state ``resume`` must tell apart: an interrupted latest run, an
    older run whose session went on, an answered one, a paused one, a child run."""
    async with store:
        for session, runs in {
            "beta": [("b1", "cancelled", None), ("b2", "interrupted", None)],
            "gamma": [("g1", "completed", None)],
            "delta": [("d1", "paused", None)],
            "eps": [("e1", "failed", "p0")],
        }.items():
            writer = await store.open_session(session)
            try:
                for n, (run_id, status, parent) in enumerate(runs):
                    await writer.record_run(RunRecord(
                        run_id, session, "agent", 100.0 + n, status, ended=101.0 + n,
                        parent=parent,
                    ))
            finally:
                await writer.aclose()


def _marks(url: str) -> dict[str, bool]:
    async def read() -> dict[str, bool]:
        async with aio.SQLiteStore(url) as store:
            return {r.id: r.recover for r in await store.runs(limit=100)}

    return asyncio.run(read())


def test_resume_marks_a_stopped_run_for_recovering_servers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --temporal, ``resume`` marks the run in the store (as a drain does) under
    its session's lock; a run that cannot go on is refused with one line, nothing marked."""
    url = str(tmp_path / "s.db")
    asyncio.run(_sessions(aio.SQLiteStore(url)))
    for run_id, says in [
        ("b1", "its session went on with run b2: resume that one"),
        ("g1", "it ended with an answer (completed)"),
        ("d1", "its tool calls wait for a decision"),
        ("e1", "it ran for an agent called as a tool: resume its parent run p0"),
        ("zz", "no run 'zz' in the store"),
    ]:
        assert main(["runs", "resume", run_id, "--store", url]) == 1
        err = capsys.readouterr().err
        assert err.startswith("aimu runs: ") and says in err and err.count("\n") == 1, err
    assert not any(_marks(url).values())
    assert main(["runs", "resume", "b2", "--store", url]) == 0
    assert "run b2 marked to be resumed" in capsys.readouterr().out
    assert [run_id for run_id, marked in _marks(url).items() if marked] == ["b2"]


def test_resume_refuses_a_session_in_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = str(tmp_path / "s.db")
    asyncio.run(_sessions(aio.SQLiteStore(url)))

    async def held() -> int:
        async with aio.SQLiteStore(url) as store:
            writer = await store.open_session("beta")  # a live process holds the session
            try:
                return await asyncio.to_thread(main, ["runs", "resume", "b2", "--store", url])
            finally:
                await writer.aclose()

    assert asyncio.run(held()) == 1
    assert "session 'beta' is in use by a live process" in capsys.readouterr().err
    assert not any(_marks(url).values())


def test_list_and_show_with_live_state_from_redis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--redis puts each run's state in Redis beside its record ("-": Redis does not know it)."""
    from aimu.aio.control import RedisControl
    from tests.services import redis_url

    url, redis, prefix = str(tmp_path / "s.db"), redis_url(), f"aimu_test_{secrets.token_hex(4)}"
    asyncio.run(_fill(aio.SQLiteStore(url)))

    async def reserve() -> None:
        async with RedisControl(redis, prefix) as control:
            await control.reserve("r2", session="alpha")

    asyncio.run(reserve())
    live = ["--redis", redis, "--redis-prefix", prefix]
    assert main(["runs", "list", "--store", url, *live]) == 0
    heads, second, first = capsys.readouterr().out.splitlines()
    assert heads.split()[:4] == ["ID", "SESSION", "STATUS", "LIVE"]
    assert second.split()[:4] == ["r2", "alpha", "running", "pending"]
    assert first.split()[:4] == ["r1", "alpha", "cancelled", "-"]
    assert main(["runs", "list", "--store", url, "--json", *live]) == 0
    assert [r["live"] for r in json.loads(capsys.readouterr().out)["runs"]] == ["pending", None]
    assert main(["runs", "show", "r2", "--store", url, *live]) == 0
    assert json.loads(capsys.readouterr().out)["live"] == "pending"
    assert main(["runs", "show", "r2", "--store", url]) == 0
    assert "live" not in json.loads(capsys.readouterr().out)  # no live state asked for
