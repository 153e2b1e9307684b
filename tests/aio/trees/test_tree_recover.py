"""A served agent tree killed with ``kill -9`` while the called agent's tool runs, then
``aimu serve --recover``: the tree goes on once, from its top-level run.

Each child run's record names its parent run, so recovery resumes only the top-level
run; the called agent's session goes on inside it, with its own agent (its name, system
prompt and tools), never as a top-level run of the server's agent. Every side effect
runs once, every model turn after the kill is asked once, and no record is left
``running``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from aimu.aio.store import RunRecord
from aimu.serve.agents import open_store
from aimu.serve.recovery import CRASHED
from aimu.testing.server import LoopbackServer
from tests.serve import test_drain_recover
from tests.serve.harness import aimu_serve, last_user, start
from tests.serve.recover_tools import STEPS
from tests.serve.test_drain_recover import ran, until
from tests.serve.tree_tools import HELPER_SYSTEM

TREE = ("--tool", "tests.serve.tree_tools:helper")
#: The drain and recovery tests' fixtures: the loopback model on their script, and the
#: directory the held tools report into.
model, held = test_drain_recover.model, test_drain_recover.held


async def every_record(store_path: Path) -> dict[str, list[RunRecord]]:
    """Each session's run records, the latest first."""
    store, close = open_store(store_path)
    try:
        return {info.name: await store.runs(session=info.name)
                for info in await store.sessions()}
    finally:
        if close is not None:
            await close()


async def top_completed(store_path: Path, session: str) -> bool:
    records = (await every_record(store_path)).get(session, [])
    return bool(records) and records[0].status == "completed"


def tool_names(body: dict[str, Any]) -> list[str]:
    return sorted(t["function"]["name"] for t in body.get("tools") or [])


@pytest.mark.slow
async def test_a_served_tree_killed_in_the_childs_tool_recovers_once_through_its_top(
    tmp_path: Path, model: LoopbackServer, held: Path
) -> None:
    store = tmp_path / "sessions.db"
    async with aimu_serve(model, tmp_path, "--store", str(store), *TREE) as one:
        async with httpx.AsyncClient(base_url=one.url, timeout=30) as http:
            top_run = await start(http, "t", "tree q")
        await until("the helper's tool runs", (held / "entered-q").exists)
        one.process.kill()
        await one.process.wait()
    before = await every_record(store)
    [child_session] = [name for name in before if name != "t"]
    [dead_top] = before["t"]
    [dead_child] = before[child_session]
    assert (dead_top.id, dead_top.status, dead_top.parent) == (top_run, "running", None)
    assert (dead_child.agent, dead_child.status) == ("helper", "running")
    assert dead_child.parent == top_run  # the child's record names the run it ran inside
    asked_before = len(model.requests)

    (held / "open").touch()  # a call run again would finish now (and be counted)
    async with aimu_serve(model, tmp_path, "--store", str(store), *TREE, "--recover",
                          name="recovering") as two:
        await until("the tree goes on", lambda: top_completed(store, "t"))
    # Both dead records were there at the first look: one run went on, the top's.
    assert two.log.read_text().count(" goes on as run ") == 1, two.log.read_text()
    after = await every_record(store)
    assert sorted(after) == sorted(before)  # no session made by the recovery
    new_top, old_top = after["t"]
    assert old_top.id == top_run and old_top.status == "failed"
    assert (old_top.reason or "").startswith(CRASHED)
    assert (new_top.status, new_top.parent, new_top.agent) == ("completed", None, "agent")
    # The child went on once, inside the top's new run, as itself.
    new_child, old_child = after[child_session]
    assert old_child.id == dead_child.id and old_child.status == "failed", old_child
    assert (old_child.reason or "").startswith(CRASHED), old_child.reason
    assert (new_child.status, new_child.agent, new_child.parent) == (
        "completed", "helper", new_top.id)
    assert not any(r.status == "running" for records in after.values() for r in records)
    # The side effect ran once: the call cut by the kill is in doubt, not run again.
    assert (held / "entries-q").read_text() == "entered\n"
    assert ran(held) == []
    # After the kill: the helper's conversation was asked once, by the helper (its
    # prompt and tools), and the top's once.
    later = model.requests[asked_before:]
    helper_turns = [r.body for r in later if last_user(r.body) == "once q"]
    assert len(helper_turns) == 1, [tool_names(b) for b in helper_turns]
    assert tool_names(helper_turns[0]) == ["held", "held_once", "step"]
    assert helper_turns[0]["messages"][0] == {"role": "system", "content": HELPER_SYSTEM}
    assert "outcome unknown" in str(helper_turns[0]["messages"][-1]["content"])
    top_turns = [r.body for r in later if last_user(r.body) == "tree q"]
    assert len(top_turns) == 1 and tool_names(top_turns[0]) == ["helper"]



@pytest.mark.slow
async def test_a_tree_that_dies_while_its_child_goes_on_is_not_a_crash_loop(
    tmp_path: Path, model: LoopbackServer, held: Path
) -> None:
    """Killed three times in a row, each time one step further inside the agent it
    called: the tree made progress (below its top, whose transcript waits on the call),
    so recovery goes on with it rather than leaving it failed as a crash loop."""
    store = tmp_path / "sessions.db"
    for n in range(STEPS):
        first = n == 0
        options = () if first else ("--recover",)
        if not first:
            (held / f"gate-{n - 1}").touch()  # the step the kill cut is taken again, now
        async with aimu_serve(model, tmp_path, "--store", str(store), *TREE, *options,
                              name=f"serve-{n}") as server:
            if first:
                async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                    await start(http, "s", "steps q")
            await until(f"step {n} is taken", (held / f"entered-step-{n}").exists)
            server.process.kill()
            await server.process.wait()
    (held / f"gate-{STEPS - 1}").touch()
    async with aimu_serve(model, tmp_path, "--store", str(store), *TREE, "--recover",
                          name="serve-last"):
        await until("the tree goes on, or is given up", lambda: _settled(store, "s"))
    records = await every_record(store)
    top = records["s"]
    assert [r.status for r in top] == ["completed", "failed", "failed", "failed"], top
    assert all((r.reason or "").startswith(f"{CRASHED} (1 in a row") for r in top[1:]), top
    [child] = [name for name in records if name != "s"]
    assert [r.status for r in records[child]] == ["completed", "failed", "failed", "failed"]
    assert [r.parent for r in records[child]] == [r.id for r in top]


async def _settled(store_path: Path, session: str) -> bool:
    """The session's latest run completed, or was left failed as a crash loop."""
    latest = (await every_record(store_path)).get(session, [])[:1]
    return any(r.status == "completed" or "times in a row" in (r.reason or "") for r in latest)


async def test_a_child_record_without_its_parent_is_not_resumed_on_its_own(
    tmp_path: Path, model: LoopbackServer, held: Path
) -> None:
    """Records an older aimu wrote name no parent: a dead child's session, named from its
    caller's and the call its transcript holds, still goes on only through its top."""
    import time

    from aimu import aio
    from aimu.serve import app
    from aimu.serve.recovery import Recovery
    from tests.serve.recover_tools import held as held_tool
    from tests.serve.recover_tools import held_once

    (held / "open").touch()
    client = aio.client("openai:loop", base_url=model.openai_base_url, api_key="sk-test")
    helper = aio.Agent(client.fork(), [held_tool, held_once], name="helper")
    application = app(client, store=tmp_path / "s.db", tools=[helper.as_tool(name="helper")])
    store = application.runs.store
    call = {"id": "c1", "type": "function",
            "function": {"name": "helper", "arguments": {"task": "once q"}}}
    sessions = {
        "t": [{"role": "user", "content": "tree q"},
              {"role": "assistant", "content": "asking ", "tool_calls": [call]}],
        "t--1.c1": [{"role": "user", "content": "once q"},
                    {"role": "assistant", "content": "calling ", "tool_calls": [
                        {"id": "c2", "type": "function",
                         "function": {"name": "held_once", "arguments": {"query": "q"}}}]}],
        "lone--1.c9": [{"role": "user", "content": "plain"}],  # named so, but no caller
    }
    try:
        for n, (name, messages) in enumerate(sessions.items()):
            writer = await store.open_session(name)
            try:
                for message in messages:  # as a kill -9 in the calls leaves them
                    await writer.append(message)  # type: ignore[arg-type]
                    for started in message.get("tool_calls", ()):
                        function = started["function"]
                        await writer.record_tool_start(
                            started["id"], function["name"], function["arguments"])
                await writer.set_status("in_progress")
                await writer.record_run(RunRecord(
                    id=f"dead-{n}", session=name, agent="agent", started=time.time() - 60 + n,
                    status="running", messages_from=0,
                ))
            finally:
                await writer.aclose()
        resumed = await Recovery(application.runs).look()
        assert len(resumed) == 2  # the top, and the session named so with no caller

        async def both_completed() -> bool:
            latest = [(await store.runs(session=name, limit=1))[0] for name in ("t", "lone--1.c9")]
            return all(record.status == "completed" for record in latest)

        await until("both go on", both_completed)
        top_new, _ = await store.runs(session="t")
        assert top_new.id in resumed
        child = await store.runs(session="t--1.c1")
        assert [(r.agent, r.parent, r.status) for r in child] == [
            ("helper", top_new.id, "completed"), ("agent", None, "failed")]
    finally:
        await application.aclose()
        await client.aclose()
