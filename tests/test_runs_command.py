"""``aimu runs list|show`` on a SQLite file and a JSONL directory (the same store API as
GET /runs, so PostgreSQL is the store tests' business): tables, JSON, pages, filters, and
bad input answered with one line and nothing changed."""

from __future__ import annotations

import asyncio
import json
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
