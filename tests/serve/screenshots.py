"""Refresh the web chat's screenshots in docs/images: ``python -m tests.serve.screenshots``.

What a newcomer sees after ``aimu serve`` with no options, in Debian's Chromium: the
embedded ``test`` model with the three demo tools, one question answered (a tool round,
then the results quoted), one stopped while its slow ``research`` call ran; on a
desktop window and on a phone.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from aimu import aio
from aimu.assistant import DEMO_TOOLS
from aimu.serve import app
from tests.serve.harness import ROOT, uvicorn_serving
from tests.services import chromium_path

IMAGES = ROOT / "docs" / "images"
DESKTOP: dict[str, Any] = {"viewport": {"width": 1000, "height": 820}}
PHONE: dict[str, Any] = {
    "viewport": {"width": 390, "height": 760}, "is_mobile": True, "has_touch": True,
    "device_scale_factor": 2,
}


async def shoot(browser: Any, url: str, session: str, options: dict[str, Any], out: Path) -> None:
    from playwright.async_api import expect

    context = await browser.new_context(**options)
    page = await context.new_page()
    try:
        await page.goto(f"{url}/?session={session}")
        await page.locator("#input").fill("What time is it in Lisbon?")
        await page.locator("#send").click()
        await expect(page.locator("#status")).to_have_text("completed")
        await page.locator("#input").fill("When is the next high tide?")
        await page.locator("#send").click()
        await expect(page.locator(".msg.tool").last).to_contain_text("→ research(")
        await page.locator("#stop").click()  # during research, which takes 1.5 s
        await expect(page.locator("#status")).to_have_text("stopped")
        await page.locator("#input").focus()
        await page.screenshot(path=str(out))
    finally:
        await context.close()


async def main() -> None:
    from playwright.async_api import async_playwright, expect

    expect.set_options(timeout=20_000)
    with tempfile.TemporaryDirectory() as tmp:
        application = app(aio.client("test"), store=Path(tmp) / "sessions.db", tools=DEMO_TOOLS)
        with uvicorn_serving(application) as url:
            async with async_playwright() as playwright:
                browser = await playwright.chromium.launch(
                    executable_path=chromium_path(), args=["--no-sandbox"]
                )
                try:
                    await shoot(browser, url, "tides", DESKTOP, IMAGES / "serve-chat.png")
                    await shoot(browser, url, "phone", PHONE, IMAGES / "serve-chat-phone.png")
                finally:
                    await browser.close()
    print(f"wrote {IMAGES / 'serve-chat.png'} and {IMAGES / 'serve-chat-phone.png'}")


if __name__ == "__main__":
    asyncio.run(main())
