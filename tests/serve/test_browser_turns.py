"""The web chat in Chromium: a turn keeps its order when it ends (each call, then its
result), a running call shows how far it is, and the session just used is listed first.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.tools import Tool, ToolContext
from aimu.serve import app
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from tests.serve.harness import GATE, Served, last_user, lookup, script, uvicorn_serving
from tests.serve.test_browser import shown

pytestmark = pytest.mark.slow


async def _slow_lookup(arguments: dict[str, Any], ctx: ToolContext) -> str:
    ctx.report_progress(1, 3, "page 1 of 3")
    await GATE.hold()
    return f"found {arguments['query']}"


# A tool from a schema, as an MCP server's are: its progress streams while it runs.
slow_lookup = Tool.from_schema(
    "slow_lookup", "Look something up, saying how far it is (held by the test's gate).",
    {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    _slow_lookup,
)


def two_calls(request: Mapping[str, Any]) -> Turn:
    """``two ...``: one turn calling lookup, then slow_lookup; then the harness's script."""
    messages = request.get("messages") or []
    if last_user(request).startswith("two") and messages[-1].get("role") == "user":
        return Turn(tool_calls=(ScriptedCall("lookup", {"query": "a"}),
                                ScriptedCall("slow_lookup", {"query": "b"})))
    return script(request)


@pytest.fixture
def served_here(tmp_path: Path) -> Iterator[Served]:
    with LoopbackServer.in_thread(two_calls) as model:
        client = aio.client("openai:loop", base_url=model.openai_base_url, api_key="sk-test")
        store = tmp_path / "sessions.db"
        application = app(client, store=store, tools=[lookup, slow_lookup])
        with uvicorn_serving(application) as url:
            yield Served(url, application, model, store)


async def test_a_turn_keeps_its_order_when_it_ends_and_progress_shows_while_a_call_runs(
    page: object, served_here: Served
) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    GATE.reset()
    try:
        await page.goto(f"{served_here.url}/?session=order")
        await page.locator("#input").fill("two calls")
        await page.locator("#input").press("Enter")
        await GATE.entered(1)  # slow_lookup runs: the live view, mid-turn
        running = page.locator(".msg.tool").last
        await expect(running.locator(".progress")).to_have_text("1/3 page 1 of 3")
        live = [t.strip() for t in await page.locator(".msg").all_inner_texts()]
        assert live == ["two calls", '→ lookup({"query":"a"})', "lookup: found a",
                        '→ slow_lookup({"query":"b"})\n1/3 page 1 of 3']
    finally:
        GATE.open()
    await expect(page.locator("#status")).to_have_text("completed")
    await expect(page.locator(".progress")).to_have_count(0)  # the call is done
    await expect(page.locator("#session-list [aria-current=true] small")).to_have_text(
        "5 messages · completed"
    )
    ended = await shown(page)
    # Each call followed by its result, as live; not both calls, then both results.
    assert ended[0] == ["two calls", '→ lookup({"query":"a"})', "lookup: found a",
                        '→ slow_lookup({"query":"b"})', "slow_lookup: found b",
                        "answer to two calls"]
    await page.reload()
    await expect(page.locator(".msg")).to_have_count(len(ended[0]))
    assert await shown(page) == ended


async def test_the_session_just_used_is_listed_first(page: object, served_here: Served) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    for session in ("apple", "zebra", "mango"):  # used in this order: not by name
        await page.goto(f"{served_here.url}/?session={session}")
        await page.locator("#input").fill("hello")
        await page.locator("#input").press("Enter")
        await expect(page.locator("#status")).to_have_text("completed")
    await page.reload()
    listed = page.locator("#session-list button")
    await expect(listed).to_have_count(3)
    names = [await b.get_attribute("data-session") for b in await listed.all()]
    assert names == ["mango", "zebra", "apple"]
