"""A tree served by ``aimu serve``'s app: its SSE carries each level's events with their
path, a cancel through the API stops every level, and a pause deep in the tree is
listed on the run with its path, decided there, and resumed inside the agent."""

from __future__ import annotations

import asyncio
import secrets
import threading
from pathlib import Path

import httpx
import pytest

from aimu import aio
from aimu.serve import app
from aimu.testing.scripted import ScriptedModel
from tests import services
from tests.aio.trees.tree_support import ANSWERS, TASKS, check_valid, level_script
from tests.serve.harness import collect, start, uvicorn_serving

ROOT_SCRIPT = level_script("mid", TASKS["mid"], ANSWERS["root"])


def served_tree(
    tmp_path: Path, leaf_tool: aio.Tool, **options: object
) -> tuple[object, aio.Agent]:
    leaf = aio.Agent(ScriptedModel(level_script(leaf_tool.name, "", ANSWERS["leaf"])),
                     [leaf_tool], name="leaf")
    mid = aio.Agent(ScriptedModel(level_script("leaf", TASKS["leaf"], ANSWERS["mid"])),
                    [leaf.as_tool()], name="mid")
    return app(ScriptedModel(ROOT_SCRIPT), store=tmp_path / "sessions.db",
               tools=[mid.as_tool()], token=None, **options), mid  # type: ignore[arg-type]


def endless_fetch(started: threading.Event) -> aio.Tool:
    """The leaf's tool: it says it started, then runs until stopped."""

    async def fetch() -> str:
        """Fetch the page (until stopped)."""
        started.set()
        await asyncio.sleep(60)
        return "never"

    return aio.tool(fetch)


async def every_level_cancelled(store_path: Path) -> None:
    """Each level's stored session ended cancelled, its transcript valid."""
    store = aio.SQLiteStore(store_path)
    try:
        infos = await store.sessions()
        assert sorted(info.status or "" for info in infos) == ["cancelled"] * 3
        for info in infos:
            check_valid(await store.load(info.name))
    finally:
        await store.aclose()


async def test_sse_carries_the_path_and_a_cancel_stops_every_level(tmp_path: Path) -> None:
    started = threading.Event()
    application, _ = served_tree(tmp_path, endless_fetch(started))
    with uvicorn_serving(application) as url:  # type: ignore[arg-type]
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            run_id = await start(http, "s", "go")
            await asyncio.to_thread(started.wait, 20)
            cancelled = await http.post(f"/runs/{run_id}/cancel", json={"reason": "no more"})
            assert cancelled.status_code == 202
            events = await collect(http, run_id)
            assert events[-1].type == "handle_finished"
            assert events[-1].data["status"] == "cancelled"
            paths = {(e.data["source"], tuple(e.data.get("path", ()))) for e in events
                     if e.type == "run_started"}
            assert paths == {("agent", ()), ("mid", ("agent",)), ("leaf", ("agent", "mid"))}
            finished = [e.data for e in events if e.type == "run_finished"]
            assert [f["status"] for f in finished] == ["cancelled"] * 3
            await every_level_cancelled(tmp_path / "sessions.db")
            # Each level's record: cancelled, why, and inside which run (the API lists them).
            records = {r["session"].count("--"): r
                       for r in (await http.get("/runs")).json()["runs"]}
            assert [(records[n]["status"], records[n]["reason"]) for n in range(3)] == [
                ("cancelled", "no more")] * 3
            assert [records[n]["parent"] for n in range(3)] == [
                None, run_id, records[1]["id"]]
            assert [records[n]["agent"] for n in range(3)] == ["agent", "mid", "leaf"]
            top = (await http.get("/sessions/s")).json()["messages"]
            assert top[-1]["content"].startswith("[cancelled: agent 'mid' was stopped")


@pytest.mark.parametrize("backend", ["local", "redis"])
async def test_a_deep_pause_is_listed_decided_and_resumed_through_the_api(
    tmp_path: Path, backend: str
) -> None:
    charged: list[str] = []

    def charge() -> str:
        """Charge the card."""
        charged.append("once")
        return "charged"

    options = {} if backend == "local" else {
        "redis": services.redis_url(), "redis_prefix": f"aimu_test_tree-{secrets.token_hex(4)}"
    }
    application, _ = served_tree(tmp_path, aio.tool(charge, approval=True), **options)
    with uvicorn_serving(application) as url:  # type: ignore[arg-type]
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            run_id = await start(http, "p", "go")
            assert (await collect(http, run_id))[-1].data["status"] == "paused"
            [pending] = (await http.get(f"/runs/{run_id}")).json()["pending"]
            assert pending["name"] == "charge" and len(pending["path"]) == 2
            decided = await http.post(
                f"/runs/{run_id}/approvals/{pending['call_id']}",
                json={"approve": True, "pause_id": pending["pause_id"]},
            )
            assert decided.status_code in (200, 202), decided.text
            resumed = decided.json()["resumed_run_id"]
            events = await collect(http, resumed)
            assert events[-1].data["status"] == "completed", [(e.type, e.data) for e in events]
            assert charged == ["once"]
            top = (await http.get("/sessions/p")).json()["messages"]
            check_valid(top)
            assert top[-1]["content"] == ANSWERS["root"]


async def test_the_protocols_follow_the_top_agents_own_events() -> None:
    """AG-UI, the AI SDK, A2A and MCP follow a run through RunFollower: an agent called
    as a tool shows as the top agent's tool call and result, not its words."""
    from types import SimpleNamespace
    from typing import Any

    from aimu.serve.stream_runs import RunFollower

    batch = [
        (1, {"type": "run_started", "source": "agent", "task": "go"}),
        (2, {"type": "tool_call", "source": "agent", "call_id": "c", "name": "mid",
             "arguments": {"task": "t"}}),
        (3, {"type": "text", "source": "mid", "text": "inner words", "path": ["agent"]}),
        (4, {"type": "run_finished", "source": "mid", "reply": "inner", "path": ["agent"],
             "usage": {"input_tokens": 1, "output_tokens": 1}}),
        (5, {"type": "tool_result", "source": "agent", "call_id": "c", "name": "mid",
             "content": "inner", "is_error": False}),
        (6, {"type": "run_finished", "source": "agent", "reply": "outer",
             "usage": {"input_tokens": 2, "output_tokens": 2}}),
        (7, {"type": "handle_finished", "status": "completed"}),
    ]

    class Runs:
        def follow(self, run_id: str, after: object) -> Any:
            async def batches() -> Any:
                yield batch

            return batches()

    follower = RunFollower(Runs(), SimpleNamespace(run_id="r"), owned=False)  # type: ignore[arg-type]
    seen = [event async for event in follower.events()]
    assert [e["type"] for e in seen] == ["run_started", "tool_call", "tool_result",
                                         "run_finished"]
    assert follower.end is not None and follower.end.reply == "outer"
