"""Refresh the web chat's screenshots in docs/images: ``python -m tests.serve.screenshots``.

The page in Debian's Chromium on the loopback model (see harness.py): a tool round, a
reply stopped midway, then a reply streaming; on a desktop window and on a phone.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from aimu.testing.server import LoopbackServer
from tests.serve.harness import ROOT, make_app, script, uvicorn_serving
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
        for task, stop_at in (("tool: look up the next high tide", None),
                              ("long: and the moon?", "w15 "), ("long: and the sun?", "w12 ")):
            replies = await page.locator(".msg.assistant").count()
            await page.locator("#input").fill(task)
            await page.locator("#send").click()
            if stop_at is None:
                await expect(page.locator("#status")).to_have_text("completed")
                continue
            await expect(page.locator(".msg.assistant").nth(replies)).to_contain_text(stop_at)
            if task.endswith("moon?"):
                await page.locator("#stop").click()
                await expect(page.locator("#status")).to_have_text("stopped")
        await page.locator("#input").focus()
        await page.screenshot(path=str(out))
        await page.locator("#stop").click()
        await expect(page.locator("#status")).to_have_text("stopped")
    finally:
        await context.close()


async def main() -> None:
    from playwright.async_api import async_playwright, expect

    expect.set_options(timeout=20_000)
    with tempfile.TemporaryDirectory() as tmp, LoopbackServer.in_thread(script) as model:
        application = make_app(model, Path(tmp) / "sessions.db")
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
