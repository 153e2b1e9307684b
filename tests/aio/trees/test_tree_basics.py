"""Agents as tools: a task in, the answer out, each call in a session of its own nested
under the caller's; events with their path; deps; typed output; cycles and depth."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from aimu import aio
from aimu.aio.events import RunFinished, RunStarted, TextChunk, ToolResult
from aimu.aio.tools import ToolContext
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from tests.aio.trees.tree_support import ANSWERS, TASKS, Tree, check_valid, tool_results


async def test_a_three_level_tree_answers_and_keeps_every_transcript(tmp_path: Path) -> None:
    store = aio.SQLiteStore(tmp_path / "tree.db")
    tree = Tree(store=store, session="top")
    try:
        assert await tree.root.run("answer the question") == ANSWERS["root"]
        assert tree.fetched == 1
        assert tool_results(tree.root.messages) == [ANSWERS["mid"]]
        names = sorted(info.name for info in await store.sessions())
        # Beside the caller's, named from it, the turn that called and the call id.
        call = tree.root.messages[1]["tool_calls"][0]["id"]  # type: ignore[typeddict-item]
        mid_session = f"top--1.{call}"
        assert mid_session in names and len(names) == 3
        leaf_session = next(n for n in names if n.startswith(mid_session + "--"))
        mid = await store.load(mid_session)
        leaf = await store.load(leaf_session)
        for transcript in (await store.load("top"), mid, leaf):
            check_valid(transcript)
        assert mid[0] == {"role": "user", "content": TASKS["mid"]}
        assert tool_results(mid) == [ANSWERS["leaf"]]
        assert tool_results(leaf) == ["the page"]
        # Each level's run record names the run it ran inside.
        [top_run] = await store.runs(session="top")
        [mid_run] = await store.runs(session=mid_session)
        [leaf_run] = await store.runs(session=leaf_session)
        assert (top_run.agent, top_run.parent) == ("root", None)
        assert (mid_run.agent, mid_run.parent) == ("mid", top_run.id)
        assert (leaf_run.agent, leaf_run.parent) == ("leaf", mid_run.id)
        assert {r.status for r in (top_run, mid_run, leaf_run)} == {"completed"}
        assert mid_run.models == leaf_run.models == ("scripted:scripted",)
    finally:
        await tree.root.aclose()
        await store.aclose()


async def test_child_events_reach_the_stream_and_the_handle_with_their_path() -> None:
    tree = Tree()
    streamed = [event async for event in tree.root.run("go", stream=True)]
    handle = aio.RunHandle.start(tree.root.start().run("go"))
    heard = [event async for event in handle.events()]
    await handle
    for events in (streamed, [e for e in heard if not isinstance(e, aio.HandleFinished)]):
        starts = [(e.source, e.path) for e in events if isinstance(e, RunStarted)]
        assert starts == [("root", ()), ("mid", ("root",)), ("leaf", ("root", "mid"))]
        finals = [(e.source, e.path) for e in events if isinstance(e, RunFinished)]
        assert finals == [("leaf", ("root", "mid")), ("mid", ("root",)), ("root", ())]
        assert isinstance(events[-1], RunFinished) and events[-1].path == ()
        leaf_text = "".join(e.text for e in events if isinstance(e, TextChunk)
                            and e.source == "leaf")
        assert ANSWERS["leaf"] in leaf_text
    # Once each: the handle heard no event twice.
    assert len(heard) == len(streamed) + 1
    # The JSON form carries the path of a nested event, and none for a run's own.
    from aimu.aio.event_json import decode_event, encode_event, event_json

    nested = next(e for e in streamed if isinstance(e, ToolResult) and e.path)
    assert decode_event(*encode_event(nested)) == nested
    assert "path" not in json.loads(event_json(streamed[0]))


class Verdict(BaseModel):
    score: int
    why: str


async def test_typed_output_comes_back_as_json_and_deps_flow_down() -> None:
    seen: list[object] = []

    def look(ctx: ToolContext[Any]) -> str:
        """Look at the deps."""
        seen.append(ctx.deps)
        return "looked"

    judge_model = ScriptedModel([
        Turn(tool_calls=[ScriptedCall("look")]),
        Turn(text='{"score": 7, "why": "fine"}'),
        Turn(tool_calls=[ScriptedCall("look")]),
        Turn(text='{"score": 3, "why": "own deps"}'),
    ])
    judge = aio.Agent(judge_model, [look], name="judge", output_type=Verdict)
    boss_model = ScriptedModel([
        Turn(tool_calls=[ScriptedCall("judge", {"task": "rate it"})]),
        Turn(text="rated"),
        Turn(tool_calls=[ScriptedCall("judge2", {"task": "rate again"})]),
        Turn(text="rated again"),
    ])
    boss = aio.Agent(
        boss_model, [judge.as_tool(), judge.as_tool("judge2", deps="given")], name="boss",
        deps="boss deps",
    )
    assert await boss.run("rate") == "rated"
    assert json.loads(tool_results(boss.messages)[0]) == {"score": 7, "why": "fine"}
    assert await boss.run("again") == "rated again"
    assert seen == ["boss deps", "given"]


async def test_a_cycle_and_a_tree_too_deep_are_refused_when_built() -> None:
    a = aio.Agent(aio.client("test"), name="a")
    tool = a.as_tool()
    with pytest.raises(ValueError, match=r"cycle .*a -> a"):
        a.__init__(aio.client("test"), [tool], name="a")  # type: ignore[misc]
    b = aio.Agent(aio.client("test"), [aio.Agent(aio.client("test"), name="c").as_tool(
        max_depth=1)], name="b")
    with pytest.raises(ValueError, match="'c' is called 2 agents deep, past its tool's max_depth"):
        aio.Agent(aio.client("test"), [b.as_tool()], name="top")
    with pytest.raises(ValueError, match="max_depth"):
        a.as_tool(max_depth=0)


async def test_a_call_past_the_depth_limit_is_a_limit_the_model_reads() -> None:
    leaf = aio.Agent(ScriptedModel([Turn(text="never")]), name="leaf")

    class Dynamic:
        """Tools known only at run time: the depth check is the run's."""

        name = "dyn"
        is_open = False

        async def open(self) -> None:
            self.is_open = True

        async def list_tools(self) -> list[aio.Tool]:
            return [leaf.as_tool(max_depth=1)]

        async def aclose(self) -> None:
            self.is_open = False

    mid = aio.Agent(ScriptedModel([
        Turn(tool_calls=[ScriptedCall("leaf", {"task": "deep"})]), Turn(text="mid saw it"),
    ]), [Dynamic()], name="mid")
    root = aio.Agent(ScriptedModel([
        Turn(tool_calls=[ScriptedCall("mid", {"task": "go"})]), Turn(text="root done"),
    ]), [mid.as_tool()], name="root")
    events = [e async for e in root.run("go", stream=True)]
    assert root.last_run is not None and root.last_run.reply == "root done"
    mid_saw = [e for e in events if isinstance(e, ToolResult) and e.source == "mid"]
    assert len(mid_saw) == 1 and mid_saw[0].is_error and mid_saw[0].path == ("root",)
    assert mid_saw[0].content.startswith(
        "[limit:depth: agent 'leaf' not run: the agent tree's depth limit of 1 would be "
        "crossed (2)]"
    )
    assert leaf.model_client.requests == []  # type: ignore[attr-defined]


async def test_the_agent_answers_when_its_tool_is_called_by_hand() -> None:
    echo = aio.Agent(ScriptedModel([Turn(text="by hand")]), name="echo")
    tool = echo.as_tool(description="Echo.")
    assert tool.description == "Echo." and tool.name == "echo"
    assert await tool.fn({"task": "x"}, ToolContext(agent="me", call_id="c", tool_name="echo")) \
        == "by hand"


async def test_bad_arguments_are_a_tool_error_and_nothing_runs() -> None:
    leaf = aio.Agent(ScriptedModel([]), name="leaf")
    root = aio.Agent(ScriptedModel([
        Turn(tool_calls=[ScriptedCall("leaf", {"task": "  "})]), Turn(text="ok"),
    ]), [leaf.as_tool()], name="root")
    assert await root.run("go") == "ok"
    assert "'task' must be a non-empty string" in tool_results(root.messages)[0]
    await asyncio.sleep(0)


async def test_the_chat_names_the_agent_that_works_when_it_changes() -> None:
    import io

    from aimu.assistant.screen import Screen

    out = io.StringIO()
    screen = Screen(out, out, editor=False, colour=False)
    tree = Tree()
    async for event in tree.root.run("go", stream=True):
        screen.show(event)
    assert out.getvalue().splitlines() == [
        "asking mid", '[calling mid(task="research the question")]',
        "(root › mid)", "asking leaf", '[calling leaf(task="fetch the page")]',
        "(root › mid › leaf)", "asking fetch", "[calling fetch()]", "[fetch → the page]",
        ANSWERS["leaf"],
        "(root › mid)", f"[leaf → {ANSWERS['leaf']}]", ANSWERS["mid"],
        "(root)", f"[mid → {ANSWERS['mid']}]", ANSWERS["root"],
    ]
    plain = io.StringIO()
    solo = Screen(plain, plain, editor=False, colour=False)
    async for event in aio.Agent(ScriptedModel([Turn(text="hi")])).run("go", stream=True):
        solo.show(event)
    assert plain.getvalue() == "hi"
