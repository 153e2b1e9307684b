"""The web chat in a real Chromium (Debian's, driven by Playwright): type, watch it stream,
Stop, keep the partial reply, send again, reload, and use it from the keyboard and a phone.

On failure each test saves a screenshot under ``$AIMU_TEST_ARTIFACTS`` (default
``test-artifacts/`` in the repository).
"""

from __future__ import annotations

import httpx
import pytest

from aimu.aio.transcript import validate
from tests.serve.harness import ARTIFACTS, MAILED, WAIT_MS, Served

pytestmark = pytest.mark.slow


async def stored(served: Served, session: str) -> list[dict[str, object]]:
    async with httpx.AsyncClient(base_url=served.url) as http:
        messages: list[dict[str, object]] = (await http.get(f"/sessions/{session}")).json()[
            "messages"
        ]
    return messages


async def test_type_stream_stop_send_again_reload(page: object, served: Served) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    abandoned = len([s for s in served.model.streams if s.abandoned])
    await page.goto(f"{served.url}/?session=web")
    await expect(page.locator("#session-title")).to_have_text("web")
    await expect(page.locator("#stop")).to_be_disabled()

    await page.locator("#input").fill("long story please")
    await page.locator("#input").press("Enter")
    reply = page.locator(".msg.assistant").last
    # Streaming: the first words are there while the last one is not yet.
    await expect(reply).to_contain_text("w3 ")
    assert "w399" not in await reply.inner_text()
    await expect(page.locator("#stop")).to_be_enabled()

    await page.locator("#stop").click()
    await expect(reply.locator(".mark")).to_have_text("(stopped)")
    await expect(page.locator("#status")).to_have_text("stopped")
    await expect(page.locator("#stop")).to_be_disabled()
    await expect(page.locator("#resume")).to_be_enabled()
    partial = await reply.locator(".text").inner_text()
    assert partial.startswith("w0 w1") and "w399" not in partial
    await served.model.wait_abandoned(abandoned + 1)
    messages = await stored(served, "web")
    validate(messages)  # type: ignore[arg-type]
    assert messages[-1]["aimu_partial"] is True and messages[-1]["content"] == partial

    await page.locator("#input").fill("hello")
    await page.locator("#send").click()
    await expect(page.locator(".msg.assistant").last).to_have_text("answer to hello")
    await expect(page.locator("#status")).to_have_text("completed")

    await page.reload()
    bubbles = page.locator(".msg")
    await expect(bubbles).to_have_count(4)
    texts = [t.strip() for t in await bubbles.all_inner_texts()]
    assert texts[0] == "long story please"
    assert texts[1].startswith(partial.strip()) and texts[1].endswith("(stopped)")
    assert texts[2:] == ["hello", "answer to hello"]
    await expect(page.locator("#session-list [aria-current=true]")).to_contain_text("web")


async def test_keyboard_only(page: object, served: Served) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    await page.goto(f"{served.url}/?session=keys")
    await expect(page.locator("#input")).to_be_focused()  # ready to type at once
    await page.keyboard.type("long keys")
    await page.keyboard.press("Enter")
    reply = page.locator(".msg.assistant").last
    await expect(reply).to_contain_text("w2 ")
    await page.keyboard.press("Escape")  # Esc is Stop
    await expect(reply.locator(".mark")).to_have_text("(stopped)")

    # Tab reaches Resume, and Enter on it continues the stopped turn.
    await page.locator("#resume").focus()
    await page.keyboard.press("Enter")
    await expect(page.locator("#status")).to_have_text("completed")
    messages = await stored(served, "keys")
    validate(messages)  # type: ignore[arg-type]
    assert messages[-1]["role"] == "assistant" and not messages[-1].get("aimu_partial")


async def test_interrupt_button_and_a_new_session(page: object, served: Served) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    await page.goto(f"{served.url}/")
    await page.locator("#new-session-name").fill("fresh")
    await page.locator("#new-session-name").press("Enter")
    await expect(page.locator("#session-title")).to_have_text("fresh")
    await page.locator("#input").fill("tool time")
    await page.locator("#input").press("Enter")
    await expect(page.locator(".msg.assistant").last).to_contain_text("let me look")
    await page.locator("#interrupt").click()
    await expect(page.locator(".msg .mark").last).to_have_text("(interrupted)")
    await expect(page.locator(".msg.tool").last).to_contain_text("found tool time")
    await expect(page.locator("#status")).to_have_text("interrupted")


async def test_a_run_in_progress_is_followed_after_a_reload(page: object, served: Served) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    await page.goto(f"{served.url}/?session=again")
    await page.locator("#input").fill("long reload")
    await page.locator("#input").press("Enter")
    await expect(page.locator(".msg.assistant").last).to_contain_text("w1 ")
    await page.reload()  # the run goes on; the page finds it and follows it
    await expect(page.locator("#stop")).to_be_enabled()
    bubbles = page.locator(".msg")
    await expect(bubbles.first).to_have_text("long reload")
    await expect(page.locator(".msg.assistant").last).to_contain_text("w5 ")
    await page.locator("#stop").click()
    await expect(page.locator(".msg.assistant .mark")).to_have_text("(stopped)")
    await expect(bubbles).to_have_count(2)


async def test_readable_on_a_phone(browser: object, served: Served) -> None:
    from playwright.async_api import Browser, expect

    assert isinstance(browser, Browser)
    context = await browser.new_context(
        viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True,
        device_scale_factor=2,
    )
    page = await context.new_page()
    page.set_default_timeout(WAIT_MS)
    try:
        await page.goto(f"{served.url}/?session=phone")
        await page.locator("#input").fill("hello phone")
        await page.locator("#send").tap()
        await expect(page.locator(".msg.assistant").last).to_have_text("answer to hello phone")
        width = await page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390  # nothing wider than the screen
        for control in ("#stop", "#interrupt", "#resume", "#send"):
            box = await page.locator(control).bounding_box()
            assert box is not None and box["height"] >= 44 and box["x"] + box["width"] <= 390
        await expect(page.locator("#sessions")).to_be_hidden()
        await page.locator("#toggle-sessions").tap()
        await expect(page.locator("#session-list")).to_contain_text("phone")
    except BaseException:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "test_readable_on_a_phone.png"))
        raise
    finally:
        await context.close()


async def test_input_typed_during_a_run_joins_it(page: object, served: Served) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    await page.goto(f"{served.url}/?session=during")
    await page.locator("#input").fill("long first")
    await page.locator("#input").press("Enter")
    # The model's first turn is streaming (for seconds): the run is in progress.
    await expect(page.locator(".msg.assistant").last).to_contain_text("w2 ")
    await page.locator("#input").fill("hello during")
    await page.locator("#input").press("Enter")
    await expect(page.locator(".msg.assistant").last).to_contain_text("answer to hello during")
    await expect(page.locator("#status")).to_have_text("completed")
    assert await page.locator(".msg.user .mark").count() == 0  # sent, not queued
    messages = await stored(served, "during")
    validate(messages)  # type: ignore[arg-type]
    assert [m["content"] for m in messages if m["role"] == "user"] == [
        "long first", "hello during",
    ]


async def test_approve_a_paused_tool_call(page: object, served: Served) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    MAILED.clear()
    await page.goto(f"{served.url}/?session=approve")
    await page.locator("#input").fill("mail erin")
    await page.locator("#input").press("Enter")
    await expect(page.locator("#status")).to_have_text("paused")
    prompt = page.locator("#approvals .approval")
    await expect(prompt).to_contain_text("send_email")
    await expect(prompt).to_contain_text("mail erin")
    assert MAILED == []
    await page.reload()  # the prompt comes back with the paused session
    await expect(page.locator("#status")).to_have_text("paused")
    await expect(prompt).to_contain_text("mail erin")
    await prompt.get_by_role("button", name="Approve").click()
    await expect(page.locator(".msg.assistant").last).to_contain_text(
        "mail result: sent to mail erin"
    )
    await expect(page.locator("#status")).to_have_text("completed")
    await expect(page.locator("#approvals")).to_be_hidden()
    assert MAILED == ["mail erin"]
