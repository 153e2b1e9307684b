"""kill -9 mid-grandchild, then resume() at the top in a new process: the tree goes on
where it stopped, three levels deep, on SQLite and PostgreSQL.

A child process runs root -> mid -> leaf -> fetch on a stored session and prints a line
when the leaf's tool starts and for each text chunk; the test SIGKILLs it at one of
them (in the leaf's tool, mid-way through the leaf's answer, mid-way through mid's
answer), then a new process resumes at the root. No tool at any level runs twice (the
leaf's tool cut by the kill is in doubt and answered so, not run again), no model above
the cut is asked its turn again, and every level's stored transcript is valid.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aimu.aio.journal import IN_DOUBT_RESULT
from tests.aio.agent.test_crash_resume import Child
from tests.aio.store.store_backends import backend
from tests.aio.trees.tree_support import ANSWERS, check_valid, tool_results

PROGRAM = """
import asyncio, json, sys
from aimu import aio
from aimu.aio.events import RunFinished, TextChunk
from aimu.testing.scripted import ScriptedModel
from tests.aio.trees.tree_support import ANSWERS, TASKS, Tree, level_script

SPEC, COUNT, MODE, HOLD = sys.argv[1], sys.argv[4], sys.argv[5], float(sys.argv[6])


def ack(*fields):
    print(json.dumps(fields), flush=True)


async def fetch() -> str:
    "Fetch the page."
    with open(COUNT, "a") as counted:
        counted.write("ran\\n")
    ack("tool")
    await asyncio.sleep(HOLD)
    return "the page"


async def main():
    store = eval(SPEC, {"aio": aio})
    slow = {"delay": 0.05}
    models = {
        "leaf": ScriptedModel(level_script("fetch", "", ANSWERS["leaf"], **slow)),
        "mid": ScriptedModel(level_script("leaf", TASKS["leaf"], ANSWERS["mid"], **slow)),
    }
    tree = Tree(given_fetch=aio.tool(fetch, name="fetch"), store=store, session="top",
                models=models)
    try:
        run = tree.root.run("go", stream=True) if MODE == "fresh" else tree.root.resume(
            stream=True)
        async for event in run:
            if isinstance(event, TextChunk):
                ack("text", event.source, event.text)
            elif isinstance(event, RunFinished):
                ack("finished", event.source, event.status, event.reply)
        ack("requests", {level: len(m.requests) for level, m in tree.models.items()})
    finally:
        await tree.root.aclose()
        await store.aclose()


asyncio.run(main())
"""

#: Where the kill lands: (kind of line, source, text it starts with), and how many
#: model requests each level makes after it (in the resuming process).
LANDINGS = {
    "in the leaf's tool": (("tool", None, None), {"root": 1, "mid": 1, "leaf": 1}),
    "in the leaf's answer": (("text", "leaf", "leaf:"), {"root": 1, "mid": 1, "leaf": 1}),
    "in mid's answer": (("text", "mid", "mid:"), {"root": 1, "mid": 1, "leaf": 0}),
}


def landed(line: list[object], where: tuple[str, str | None, str | None]) -> bool:
    kind, source, text = where
    if line[0] != kind:
        return False
    return source is None or (line[1] == source and str(line[2]).startswith(str(text)))


@pytest.mark.slow
@pytest.mark.parametrize(("landing", "kind"), [
    ("in the leaf's tool", "sqlite"), ("in the leaf's tool", "postgres"),
    ("in the leaf's answer", "sqlite"), ("in mid's answer", "postgres"),
])
async def test_a_kill_mid_grandchild_resumes_at_the_top_in_a_new_process(
    tmp_path: Path, kind: str, landing: str
) -> None:
    where, after = LANDINGS[landing]
    count = tmp_path / "fetch-ran.txt"
    async with backend(kind, tmp_path) as store_at:
        first = Child(store_at, tmp_path, "-", "-", program=PROGRAM,
                      args=(str(count), "fresh", "30" if where[0] == "tool" else "0"))
        try:
            for seen in range(1, 200):
                first.wait_for_lines(seen)
                if landed(first.lines[-1], where):
                    break
            else:
                raise AssertionError(f"the kill's landing never came: {first.lines}")
        finally:
            first.kill()
        assert not any(line[0] == "finished" and line[1] == "root" for line in first.lines)
        second = Child(store_at, tmp_path, "-", "-", program=PROGRAM,
                       args=(str(count), "resume", "0"))
        second.finish()
        assert second.process.returncode == 0, second.stderr
        finished = [line for line in second.lines if line[0] == "finished"]
        assert finished[-1] == ["finished", "root", "completed", ANSWERS["root"]], second.lines
        assert second.lines[-1] == ["requests", after], second.lines
        assert count.read_text() == "ran\n"  # the leaf's tool ran once in all
        store = store_at.make()
        try:
            infos = await store.sessions()
            assert len(infos) == 3
            levels = {info.name.count("--"): await store.load(info.name) for info in infos}
            for messages in levels.values():
                check_valid(messages)
            assert tool_results(levels[0]) == [ANSWERS["mid"]]
            assert tool_results(levels[1]) == [ANSWERS["leaf"]]
            leaf_result = IN_DOUBT_RESULT if landing == "in the leaf's tool" else "the page"
            assert tool_results(levels[2]) == [leaf_result]
        finally:
            await store.aclose()
