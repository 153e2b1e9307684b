"""A pause anywhere in the tree pauses the whole run: the waiting calls are listed at the
top with their path, decided there, and the resume continues inside the agent that
waits without asking any model above it again."""

from __future__ import annotations

from pathlib import Path

import pytest

from aimu import aio
from aimu.aio.approvals import PendingApproval
from aimu.aio.ends import PAUSED
from aimu.aio.transcript import CANCELLED_RESULT
from tests.aio.trees.tree_support import ANSWERS, Tree, check_valid, tool_results


class Charges:
    """The leaf's second tool: it waits for a person; counts its runs."""

    def __init__(self) -> None:
        self.runs = 0
        self.tool = aio.tool(self.charge, name="charge", approval=True)

    def charge(self) -> str:
        """Charge the card."""
        self.runs += 1
        return "charged"


def charging_tree(**options: object) -> tuple[Tree, Charges]:
    charges = Charges()

    async def fetch() -> str:
        """Fetch the page."""
        return "the page"

    tree = Tree(given_fetch=aio.tool(fetch, name="charge_first"), leaf_tools=[charges.tool],
                **options)  # type: ignore[arg-type]
    return tree, charges


def requests(tree: Tree) -> dict[str, int]:
    return {level: len(model.requests) for level, model in tree.models.items()}  # type: ignore[attr-defined]


def leaf_calls_charge(tree: Tree) -> None:
    """The leaf's model calls ``charge`` (not its first tool)."""
    from aimu.testing.scripted import ScriptedModel
    from tests.aio.trees.tree_support import level_script

    model = tree.models["leaf"]
    assert isinstance(model, ScriptedModel)
    model._shared.script = level_script("charge", "", ANSWERS["leaf"])


async def test_a_grandchilds_pause_pauses_the_tree_and_resumes_inside_it() -> None:
    tree, charges = charging_tree()
    leaf_calls_charge(tree)
    handle = aio.RunHandle.start(tree.root.run("go"))
    assert await handle == PAUSED
    assert handle.status == "paused" and tree.root.last_status == "paused"
    [pending] = tree.root.pending_approvals
    root_call = tree.root.messages[-1]["tool_calls"][0]["id"]  # type: ignore[typeddict-item]
    assert pending.tool == "charge" and len(pending.path) == 2
    assert pending.path[0] == root_call and pending.run_id == handle.run_id
    assert tool_results(tree.root.messages) == []  # the call is held open
    assert requests(tree) == {"root": 1, "mid": 1, "leaf": 1}
    with pytest.raises(ValueError, match=r"calls wait for a decision: .*charge"):
        await tree.root.resume()
    tree.root.approve(pending)
    assert tree.root.pending_approvals == []
    assert await tree.root.resume() == ANSWERS["root"]
    assert charges.runs == 1
    # Each level asked its model once more (its answer): none went back over its turn.
    assert requests(tree) == {"root": 2, "mid": 2, "leaf": 2}
    check_valid(tree.root.messages)
    assert tool_results(tree.root.messages) == [ANSWERS["mid"]]


async def test_a_denial_at_the_top_reaches_the_grandchilds_model() -> None:
    tree, charges = charging_tree()
    leaf_calls_charge(tree)
    await tree.root.run("go")
    [pending] = tree.root.pending_approvals
    tree.root.deny(pending.call_id, "not today")  # by id: it is found below
    assert await tree.root.resume() == ANSWERS["root"]
    assert charges.runs == 0
    leaf_saw = tree.models["leaf"].requests[-1]["messages"]  # type: ignore[attr-defined]
    assert leaf_saw[-1]["content"] == "[denied: not today]"
    with pytest.raises(ValueError, match="no longer waits"):
        tree.root.approve(PendingApproval("nope", "charge", {}, path=("nobody",)))


async def test_a_stored_pause_is_decided_and_resumed_by_new_objects(tmp_path: Path) -> None:
    store = aio.SQLiteStore(tmp_path / "tree.db")
    try:
        tree, charges = charging_tree(store=store, session="top")
        leaf_calls_charge(tree)
        await tree.root.run("go")
        await tree.root.aclose()
        # As another process would: new agents on the same store.
        second, _ = charging_tree(store=store, session="top")
        with pytest.raises(RuntimeError, match="not open"):
            second.root.pending_approvals  # noqa: B018
        await second.root.open()
        [pending] = second.root.pending_approvals
        assert pending.tool == "charge" and len(pending.path) == 2
        second.root.approve(pending.call_id)
        await second.root.aclose()  # the decision is stored in the leaf's session
        third, more = charging_tree(store=store, session="top")
        leaf_calls_charge(third)
        assert await third.root.resume() == ANSWERS["root"]
        assert charges.runs + more.runs == 1
        # Above the leaf nobody asked its model over again: each answered once.
        assert requests(third) == {"root": 1, "mid": 1, "leaf": 1}
        for info in await store.sessions():
            check_valid(await store.load(info.name))
        await third.root.aclose()
    finally:
        await store.aclose()


async def test_a_new_task_instead_of_the_resume_drops_the_held_call(tmp_path: Path) -> None:
    store = aio.SQLiteStore(tmp_path / "tree.db")
    tree, charges = charging_tree(store=store, session="top")
    try:
        leaf_calls_charge(tree)
        await tree.root.run("go")
        [pending] = tree.root.pending_approvals
        with pytest.raises(ValueError, match="wait for a decision"):
            await tree.root.run("something else")  # undecided: refused, nothing changed
        tree.root.approve(pending)
        # A new task: the held call is answered "cancelled", its agent's session closed;
        # the new task calls the agent again, in a new session, which asks again.
        assert await tree.root.run("something else") == PAUSED
        assert charges.runs == 0
        check_valid(tree.root.messages[:-1])
        assert tool_results(tree.root.messages)[0] == CANCELLED_RESULT
        [again] = tree.root.pending_approvals
        assert again.path[0] != pending.path[0] and again.pause_id != pending.pause_id
        # The sessions held for the dropped call were closed: another writer may open them.
        dropped = [i.name for i in await store.sessions() if i.name.startswith("top--1.")]
        assert len(dropped) == 2
        for name in dropped:
            await (await store.open_session(name)).aclose()
    finally:
        await tree.root.aclose()
        await store.aclose()
