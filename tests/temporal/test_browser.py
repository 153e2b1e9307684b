"""The web page over ``aimu serve --temporal`` in a real Chromium (issue 34 item 5): a run
handed to an ``aimu worker`` streams its text to the page; Stop keeps the partial reply,
marked, in the page and in the store."""

from __future__ import annotations

import pytest

from aimu.aio.transcript import validate
from tests.serve.conftest import browser, page
from tests.serve.test_browser import type_and_stop
from tests.temporal.test_processes import Processes, _restorable, model, processes

__all__ = ["browser", "model", "page", "processes"]

pytestmark = pytest.mark.slow


async def test_the_page_streams_a_run_on_a_worker_and_stop_keeps_the_partial(
    page: object, processes: Processes
) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    await processes.worker()
    url = await processes.serve()
    await page.goto(f"{url}/?session=web")
    await expect(page.locator("#session-title")).to_have_text("web")
    # Streams from the worker through Temporal; Stop keeps the partial, marked.
    partial = await type_and_stop(page, "w199")
    messages = await _restorable(processes.tmp / "sessions.db", "web")
    validate(messages)
    assert messages[-1]["aimu_partial"] is True
    assert messages[-1]["content"] == partial  # every word the worker had, on the page

    await page.reload()  # the stopped run's mark is kept, read back from the server
    await expect(page.locator(".msg.assistant").last.locator(".mark")).to_have_text(
        "(stopped)")
