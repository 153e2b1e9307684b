"""A tree run on Temporal (``aimu worker``'s AgentWorker, a real dev server): the events
carry each level's path, a pause deep in the tree is listed on the run and decided
there, and a cancel through Temporal stops every level."""

from __future__ import annotations

from aimu import aio
from aimu.aio.store import SQLiteStore
from aimu.temporal import RunsClient
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer
from tests.aio.trees.test_tree_stops import Blocking
from tests.aio.trees.tree_support import ANSWERS, TASKS, check_valid, level_script, tool_results
from tests.temporal.conftest import Workers


def mid_tool(leaf_tool: aio.Tool) -> aio.Tool:
    """mid -> leaf -> ``leaf_tool``, on in-process models; the worker's agent calls mid."""
    leaf = aio.Agent(ScriptedModel(level_script(leaf_tool.name, "", ANSWERS["leaf"])),
                     [leaf_tool], name="leaf")
    mid = aio.Agent(ScriptedModel(level_script("leaf", TASKS["leaf"], ANSWERS["mid"])),
                    [leaf.as_tool()], name="mid")
    return mid.as_tool()


async def every_level(store: SQLiteStore) -> dict[str, str | None]:
    """Each stored level's status, its transcript checked valid."""
    found = {}
    for info in await store.sessions():
        check_valid(await store.load(info.name))
        found[info.name] = info.status
    return found


async def test_a_deep_pause_is_decided_on_the_run_and_a_cancel_stops_every_level(
    runs: RunsClient, workers: Workers, store: SQLiteStore, model_server: LoopbackServer
) -> None:
    model_server.script = level_script("mid", TASKS["mid"], ANSWERS["root"])
    charged: list[str] = []

    @aio.tool(approval=True)
    def charge() -> str:
        """Charge the card."""
        charged.append("once")
        return "charged"

    paying = await workers.start(tools=[mid_tool(charge)])
    run_id = await runs.start("p", "go")
    paths = []
    async for _, event in runs.events(run_id):
        if event["type"] == "run_started":
            paths.append(tuple(event.get("path", ())))
        if event["type"] == "run_finished" and not event.get("path"):
            assert event["status"] == "paused"
            break
    assert paths == [(), ("agent",), ("agent", "mid")]
    [pending] = (await runs.status(run_id))["pending"]
    assert pending["name"] == "charge" and len(pending["path"]) == 2
    await runs.approve(run_id, pending["call_id"])
    state = await runs.wait(run_id, timeout=60)
    assert state["status"] == "completed" and charged == ["once"]
    assert tool_results(await store.load("p")) == [ANSWERS["mid"]]
    assert set((await every_level(store)).values()) == {"completed"}

    await workers.stop(paying)  # the next run goes to a worker whose leaf fetches
    fetch = Blocking()
    await workers.start(tools=[mid_tool(aio.tool(fetch, name="fetch"))])
    cancelled_run = await runs.start("c", "go")
    async for _, event in runs.events(cancelled_run):
        if event["type"] == "tool_call" and len(event.get("path", ())) == 2:
            break  # the leaf's tool runs, two levels down
    assert await runs.cancel(cancelled_run, "stop all")
    assert (await runs.wait(cancelled_run, timeout=60))["status"] == "cancelled"
    statuses = {name: status for name, status in (await every_level(store)).items()
                if name.startswith("c")}
    assert sorted(statuses.values()) == ["cancelled"] * 3, statuses
    assert tool_results(await store.load("c"))[0].startswith("[cancelled: agent 'mid'")
