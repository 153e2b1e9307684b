"""A three-level agent tree for the tree tests: root -> mid -> leaf -> a tool.

Each model is a function of its transcript (a tool result last: answer; else call the
next level), so a resume or a rerun picks up where it stopped, and each level's
transcript can be checked on its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aimu import aio
from aimu.aio.client import ModelClient
from aimu.aio.store import Store
from aimu.aio.transcript import Message, dangling_calls, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel

ANSWERS = {"root": "root: all done", "mid": "mid: researched", "leaf": "leaf: fetched"}
TASKS = {"mid": "research the question", "leaf": "fetch the page"}


def level_script(callee: str, task: str, answer: str, **turn: Any) -> Callable[..., Turn]:
    """The model of one level: call ``callee`` with ``task`` until a result is in."""

    def script(request: Mapping[str, Any]) -> Turn:
        messages = request["messages"]
        if messages[-1]["role"] == "tool":
            return Turn(text=answer, chunks=3, **turn)
        return Turn(
            text=f"asking {callee}", chunks=2,
            tool_calls=[ScriptedCall(callee, {"task": task} if task else {})], **turn,
        )

    return script


class Tree:
    """root -> mid -> leaf -> fetch, each agent on its own scripted model."""

    def __init__(
        self,
        *,
        given_fetch: Callable[..., Any] | None = None,
        store: Store | None = None,
        session: str | None = None,
        models: Mapping[str, ModelClient] | None = None,
        leaf_tools: Sequence[Any] = (),
        **root_options: Any,
    ) -> None:
        self.fetched = 0

        async def fetch() -> str:
            """Fetch the page."""
            self.fetched += 1
            await asyncio.sleep(0)
            return "the page"

        made = dict(models or {})
        self.models: dict[str, ModelClient] = {
            "leaf": made.get("leaf") or ScriptedModel(level_script("fetch", "", ANSWERS["leaf"])),
            "mid": made.get("mid") or ScriptedModel(
                level_script("leaf", TASKS["leaf"], ANSWERS["mid"])
            ),
            "root": made.get("root") or ScriptedModel(
                level_script("mid", TASKS["mid"], ANSWERS["root"])
            ),
        }
        self.leaf = aio.Agent(
            self.models["leaf"], [given_fetch or fetch, *leaf_tools], name="leaf"
        )
        self.mid = aio.Agent(self.models["mid"], [self.leaf.as_tool()], name="mid")
        self.root = aio.Agent(
            self.models["root"], [self.mid.as_tool()], name="root", store=store,
            session=session, **root_options,
        )


def check_valid(messages: Sequence[Message]) -> None:
    """A transcript a model API accepts: it validates, and no call is left open."""
    validate(messages)
    assert dangling_calls(messages) == [], messages


def tool_results(messages: Sequence[Message]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "tool"]
