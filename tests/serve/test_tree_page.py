"""The web chat with an agent tree (agent.as_tool()): the words of each agent called are
labelled with who is working, and Stop stops every level."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from tests.aio.trees.test_tree_serve import endless_fetch, every_level_cancelled, served_tree
from tests.serve.harness import uvicorn_serving

pytestmark = pytest.mark.slow


async def test_the_page_shows_who_works_and_stop_stops_the_tree(
    page: object, tmp_path: Path
) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    started = threading.Event()
    application, _ = served_tree(tmp_path, endless_fetch(started))
    with uvicorn_serving(application) as url:  # type: ignore[arg-type]
        await page.goto(f"{url}/?session=tree")
        await page.locator("#input").fill("go")
        await page.locator("#input").press("Enter")
        await asyncio.to_thread(started.wait, 20)
        call = page.locator(".msg.tool").last
        await expect(call.locator(".who")).to_have_text("agent › mid › leaf")
        await expect(call).to_contain_text("fetch")
        mid_words = page.locator(".msg.assistant", has_text="asking leaf")
        await expect(mid_words.locator(".who")).to_have_text("agent › mid")
        await page.locator("#stop").click()
        await expect(page.locator("#status")).to_have_text("stopped")
    await every_level_cancelled(tmp_path / "sessions.db")
