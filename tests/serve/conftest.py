"""Fixtures of the serve tests (see harness.py): servers, and a Chromium page that saves a
screenshot under ``$AIMU_TEST_ARTIFACTS`` (default ``test-artifacts/``) when its test fails."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Generator
from typing import Any

import pytest

from tests import services
from tests.serve.harness import ARTIFACTS, WAIT_MS, http, model_server, served

__all__ = ["browser", "http", "model_server", "page", "served"]



@pytest.fixture
async def browser(chromium_path: str) -> AsyncIterator[object]:
    """This test's connection to the test process's one Chromium (services.BrowserServer);
    closing it closes every context the test opened."""
    from playwright.async_api import async_playwright, expect

    expect.set_options(timeout=WAIT_MS)  # a loaded machine, not a slow page
    endpoint = services.browser_endpoint()
    async with async_playwright() as playwright:
        connected = await playwright.chromium.connect(endpoint)
        try:
            yield connected
        finally:
            await connected.close()


@pytest.fixture
async def page(browser: object, request: pytest.FixtureRequest) -> AsyncIterator[object]:
    from playwright.async_api import Browser

    assert isinstance(browser, Browser)
    # @pytest.mark.browser_context(viewport=..., is_mobile=...) sets up a phone, a small window.
    marker = request.node.get_closest_marker("browser_context")
    options = marker.kwargs if marker else {"viewport": {"width": 1100, "height": 800}}
    context = await browser.new_context(**options)
    opened = await context.new_page()
    opened.set_default_timeout(WAIT_MS)
    try:
        yield opened
    finally:
        report = getattr(request.node, "rep_call", None)
        if report is None or report.failed:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            name = re.sub(r"[^\w.-]", "_", request.node.name)
            await opened.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
        await context.close()




@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[
    None, Any, Any
]:
    """Keep the call phase's report on the item: the browser tests screenshot on failure."""
    report = yield
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
    return report
