"""The web page over ``aimu serve --temporal`` in a real Chromium (issue 34 item 5): a run
handed to an ``aimu worker`` streams its text to the page; Stop keeps the partial reply,
marked, in the page and in the store."""

from __future__ import annotations

import pytest

from aimu.aio.transcript import validate
from tests.serve.conftest import browser, page
from tests.temporal.test_processes import Processes, _restorable, model, processes

__all__ = ["browser", "model", "page", "processes"]

pytestmark = pytest.mark.slow


async def test_the_page_streams_a_run_on_a_worker_and_stop_keeps_the_partial(
    page: object, processes: Processes, tmp_path: object
) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    await processes.worker()
    url = await processes.serve()
    await page.goto(f"{url}/?session=web")
    await expect(page.locator("#session-title")).to_have_text("web")
    await page.locator("#input").fill("long story please")
    await page.locator("#input").press("Enter")
    reply = page.locator(".msg.assistant").last
    # Streaming from the worker through Temporal: the first words, not yet the last.
    await expect(reply).to_contain_text("w3 ")
    assert "w199" not in await reply.inner_text()
    await expect(page.locator("#stop")).to_be_enabled()

    await page.locator("#stop").click()
    await expect(reply.locator(".mark")).to_have_text("(stopped)")
    await expect(page.locator("#status")).to_have_text("stopped")
    await expect(page.locator("#stop")).to_be_disabled()
    await expect(page.locator("#resume")).to_be_enabled()
    partial = await reply.locator(".text").inner_text()
    assert partial.startswith("w0 w1") and "w199" not in partial
    messages = await _restorable(processes.tmp / "sessions.db", "web")
    validate(messages)
    assert messages[-1]["aimu_partial"] is True
    assert messages[-1]["content"] == partial  # every word the worker had, on the page

    await page.reload()  # the stopped run's mark is kept, read back from the server
    await expect(page.locator(".msg.assistant").last.locator(".mark")).to_have_text(
        "(stopped)")
