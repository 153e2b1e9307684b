"""The web chat in a real Chromium (Debian's, driven by Playwright): type, watch it stream,
Stop, keep the partial reply, send again, reload, and use it from the keyboard and a phone.

On failure each test saves a screenshot under ``$AIMU_TEST_ARTIFACTS`` (default
``test-artifacts/`` in the repository).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from aimu.aio.store import SQLiteStore
from aimu.aio.transcript import CANCELLED_RESULT, validate
from tests.serve.harness import FLAKY, GATE, MAILED, WAIT_MS, Served, hurried

pytestmark = pytest.mark.slow
WAIT_S = WAIT_MS / 1000


async def stored(served: Served, session: str) -> list[dict[str, object]]:
    async with httpx.AsyncClient(base_url=served.url) as http:
        messages: list[dict[str, object]] = (await http.get(f"/sessions/{session}")).json()[
            "messages"
        ]
    return messages


async def type_and_stop(page: object, last: str) -> str:
    """Ask for a long story (words ``w0`` to ``last``), see it stream, press Stop: the
    partial reply shown, marked (stopped)."""
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    await page.locator("#input").fill("long story please")
    await page.locator("#input").press("Enter")
    reply = page.locator(".msg.assistant").last
    # Streaming: the first words are there while the last one is not yet.
    await expect(reply).to_contain_text("w3 ")
    assert last not in await reply.inner_text()
    await expect(page.locator("#stop")).to_be_enabled()

    await page.locator("#stop").click()
    await expect(reply.locator(".mark")).to_have_text("(stopped)")
    await expect(page.locator("#status")).to_have_text("stopped")
    await expect(page.locator("#stop")).to_be_disabled()
    await expect(page.locator("#resume")).to_be_enabled()
    partial = await reply.locator(".text").inner_text()
    assert partial.startswith("w0 w1") and last not in partial
    return partial


async def test_type_stream_stop_send_again_reload(page: object, served: Served) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    abandoned = len([s for s in served.model.streams if s.abandoned])
    await page.goto(f"{served.url}/?session=web")
    await expect(page.locator("#session-title")).to_have_text("web")
    await expect(page.locator("#stop")).to_be_disabled()

    partial = await type_and_stop(page, "w399")
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
    """Interrupt, then a new run: the earlier run's end stays marked where it was, live
    and after a reload (the page reads the run records)."""
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

    # A later run ends: the earlier one's end is still marked, from its run record.
    await page.locator("#input").fill("hello")
    await page.locator("#input").press("Enter")
    await expect(page.locator("#status")).to_have_text("completed")
    for shown in ("live", "reloaded"):
        if shown == "reloaded":
            await page.reload()
        await expect(page.locator(".msg.assistant").last).to_have_text("answer to hello")
        texts = [t.strip() for t in await page.locator(".msg").all_inner_texts()]
        at = texts.index("(interrupted)")
        assert texts[at - 1] == "lookup: found tool time" and texts[at + 1] == "hello", texts


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


@pytest.mark.browser_context(
    viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True, device_scale_factor=2
)
async def test_readable_on_a_phone(page: object, served: Served) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    await page.goto(f"{served.url}/?session=phone")
    # A phone's keyboard has no Shift+Enter: Enter is a new line there, Send sends.
    assert await page.locator("#input").get_attribute("placeholder") == "Message"
    await page.locator("#input").fill("hello")
    await page.locator("#input").press("Enter")
    await page.locator("#input").press_sequentially("phone")
    await expect(page.locator("#input")).to_have_value("hello\nphone")
    await expect(page.locator(".msg")).to_have_count(0)
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


async def test_input_typed_during_a_run_joins_it(page: object, served: Served) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    await page.goto(f"{served.url}/?session=during")
    await page.locator("#input").fill("long first")
    await page.locator("#input").press("Enter")
    # The model's first turn is streaming (for seconds): the run is in progress.
    await expect(page.locator(".msg.assistant").last).to_contain_text("w2 ")
    await page.locator("#input").fill("hello during")
    async with page.expect_response(lambda answer: answer.url.endswith("/send")) as sent:
        await page.locator("#input").press("Enter")
    assert (await sent.value).status == 202
    with hurried(served.model):  # the send landed: the rest of the turn need not crawl
        await expect(page.locator(".msg.assistant").last).to_contain_text(
            "answer to hello during"
        )
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

    # A call of a page's own tool (declared over AG-UI) waits for its result: typed here.
    locate = {"name": "locate", "description": "Where the user is"}
    async with httpx.AsyncClient(base_url=served.url) as http:
        asked = {"threadId": "located", "runId": "r1", "tools": [locate],
                 "messages": [{"id": "u1", "role": "user", "content": "locate"}]}
        async with http.stream("POST", "/ag-ui", json=asked) as response:
            assert b"pendingToolCallIds" in await response.aread()
    await page.goto(f"{served.url}/?session=located")
    await expect(page.locator("#status")).to_have_text("paused")
    await expect(prompt).to_contain_text("locate")
    await prompt.get_by_role("textbox", name="Result of locate").fill("Lima")
    await prompt.get_by_role("button", name="Send result").click()
    await expect(page.locator(".msg.assistant").last).to_contain_text("you are in Lima")
    await expect(page.locator("#approvals")).to_be_hidden()


async def shown(page: object) -> tuple[list[str], str, str]:
    """What the page shows: the bubbles' texts, the header's status, the session's entry."""
    from playwright.async_api import Page

    assert isinstance(page, Page)
    texts = [t.strip() for t in await page.locator(".msg").all_inner_texts()]
    status = await page.locator("#status").inner_text()
    entry = await page.locator("#session-list [aria-current=true] small").inner_text()
    return texts, status, entry


async def test_a_stop_during_a_tool_call_shows_and_a_reload_shows_the_same(
    page: object, served: Served
) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    GATE.reset()
    try:
        await page.goto(f"{served.url}/?session=toolstop")
        await page.locator("#input").fill("gate 1 5")
        await page.locator("#input").press("Enter")
        await GATE.entered(1)  # the tool call is in progress
        await expect(page.locator(".msg.tool")).to_have_text('→ gated_lookup({"query":"gate 1 5"})')
        await page.locator("#stop").click()
        await expect(page.locator("#status")).to_have_text("stopped")
        await expect(page.locator(".msg").last).to_have_text("(stopped)")
        await expect(page.locator(".msg.tool").last).to_have_text(
            f"gated_lookup: {CANCELLED_RESULT}"
        )
        await expect(page.locator("#session-list [aria-current=true] small")).to_have_text(
            "3 messages · stopped"
        )
    finally:
        GATE.open()
    live = await shown(page)
    assert live == (
        ["gate 1 5", "calling", '→ gated_lookup({"query":"gate 1 5"})',
         f"gated_lookup: {CANCELLED_RESULT}", "(stopped)"],
        "stopped",
        "3 messages · stopped",
    )
    await page.reload()
    await expect(page.locator(".msg")).to_have_count(len(live[0]))
    await expect(page.locator("#session-list [aria-current=true]")).to_be_visible()
    assert await shown(page) == live


async def test_the_live_view_is_the_reloaded_view(page: object, served: Served) -> None:
    """Tool calls in order, one status word, a marked end: the same before and after a
    reload, after a completed, an interrupted and a stopped run in one session."""
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"{m.location['url']}: {m.text}")
            if m.type == "error" else None)
    page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    await page.goto(f"{served.url}/?session=same")
    await expect(page.locator("#status")).to_have_text("idle")
    for task, status in (("tool one", "completed"), ("tool two", "interrupted"),
                         ("long three", "stopped")):
        await page.locator("#input").fill(task)
        await page.locator("#input").press("Enter")
        if status == "interrupted":
            await expect(page.locator(".msg.assistant").last).to_contain_text("let me look")
            await page.locator("#interrupt").click()
        if status == "stopped":
            await expect(page.locator(".msg.assistant").last).to_contain_text("w3 ")
            await expect(page.locator("#status")).to_have_text("running")
            await expect(
                page.locator("#session-list [aria-current=true] small")
            ).to_contain_text("· running")
            await page.locator("#stop").click()
        await expect(page.locator("#status")).to_have_text(status)
        await expect(page.locator("#session-list [aria-current=true] small")).to_contain_text(
            f"· {status}"
        )
        live = await shown(page)
        await page.reload()
        await expect(page.locator(".msg")).to_have_count(len(live[0]))
        await expect(page.locator("#status")).to_have_text(status)
        assert await shown(page) == live
    # Tool calls and results in the order they happened; each run's end marked where it
    # ended (from the run records): the interrupted one's before the next task.
    looked = ("let me look that up " * 10).strip()
    assert live[0][:11] == [
        "tool one", looked, '→ lookup({"query":"tool one"})', "lookup: found tool one",
        "answer to tool one",
        "tool two", looked, '→ lookup({"query":"tool two"})', "lookup: found tool two",
        "(interrupted)", "long three",
    ]
    assert live[0][11].startswith("w0 w1 w2") and live[0][11].endswith("(stopped)")
    assert len(live[0]) == 12
    # The new session was not there yet (404, and Chromium's log of it); no other error:
    # no favicon 404, nothing the page's security policy refused.
    missing = f"{served.url}/sessions/same"
    assert [e for e in errors if not e.startswith(missing) and missing not in e] == []
    assert errors.count(f"404 {missing}") == 1


async def test_a_reply_cut_by_the_network_and_asked_again_shows_once(
    page: object, served: Served
) -> None:
    """Issue 44: the model's stream is cut after a dozen words and the turn restarted;
    the bubble replaces the cut words (turn_retried) instead of showing them twice."""
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    await page.goto(f"{served.url}/?session=flaky")
    await page.locator("#input").fill("flaky story")
    await page.locator("#input").press("Enter")
    reply = page.locator(".msg.assistant .text")
    # Streaming again after the cut (which came after f10): the bubble holds the words
    # once, not the cut ones and then the new ones (the stored view comes only at the end).
    await expect(reply).to_contain_text("f30 ")
    streaming = await reply.inner_text()
    assert "f199" not in streaming and streaming.startswith("f0 f1 ")
    assert streaming.split().count("f0") == 1, streaming
    await expect(page.locator("#status")).to_have_text("completed")
    await expect(page.locator(".msg.assistant")).to_have_count(1)
    assert (await reply.inner_text()).strip() == FLAKY
    messages = await stored(served, "flaky")
    assert [m["content"] for m in messages if m["role"] == "assistant"] == [FLAKY]


async def test_one_message_is_one_message(page: object, served: Served) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    store = SQLiteStore(served.store)
    try:
        writer = await store.open_session("single")
        await writer.append({"role": "user", "content": "only this"})
        await writer.set_status("in_progress")  # as a server that crashed mid-run leaves it
        await writer.aclose()
    finally:
        await store.aclose()
    await page.goto(f"{served.url}/?session=single")
    await expect(page.locator("#session-list [aria-current=true] small")).to_have_text(
        "1 message · unfinished"
    )
    await expect(page.locator("#status")).to_have_text("unfinished")
    await expect(page.locator("#resume")).to_be_enabled()


@pytest.mark.browser_context(viewport={"width": 900, "height": 520})
async def test_the_stopped_mark_scrolls_into_view(page: object, served: Served) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    await page.goto(f"{served.url}/?session=scroll")
    await page.locator("#input").fill("short 300")  # more than the view holds
    await page.locator("#input").press("Enter")
    await expect(page.locator("#status")).to_have_text("completed")
    await page.locator("#input").fill("long scroll")
    await page.locator("#input").press("Enter")
    reply = page.locator(".msg.assistant").last
    await expect(reply).to_contain_text("w20 ")
    await page.locator("#stop").click()
    mark = reply.locator(".mark")
    await expect(mark).to_have_text("(stopped)")
    await expect(page.locator("#status")).to_have_text("stopped")
    await expect(mark).to_be_in_viewport(ratio=1)
    scrolled = await page.evaluate("document.getElementById('messages').scrollTop")
    assert scrolled > 0  # the view did overflow: the mark was scrolled to


async def test_the_desktop_placeholder_names_the_keys(page: object, served: Served) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    await page.goto(f"{served.url}/?session=keys2")
    await expect(page.locator("#input")).to_have_attribute(
        "placeholder", "Message (Enter sends, Shift+Enter for a new line)"
    )
    icon = await page.locator("link[rel=icon]").get_attribute("href")
    assert icon is not None
    async with httpx.AsyncClient(base_url=served.url) as http:
        answer = await http.get(f"/{icon}")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("image/svg+xml")


async def hold_requests(
    page: object, url: str, *which: tuple[str, int]
) -> dict[str, asyncio.Queue[Any]]:
    """Route ``url``: the requests ``which`` names (a method and its count, 1 for the
    first) wait, each put in its method's queue for the test to continue; the rest go on."""
    from playwright.async_api import Page, Route

    assert isinstance(page, Page)
    held: dict[str, asyncio.Queue[Any]] = {"GET": asyncio.Queue(), "POST": asyncio.Queue()}
    seen = {"GET": 0, "POST": 0}

    async def hold(route: Route) -> None:
        method = route.request.method
        seen[method] = seen.get(method, 0) + 1
        if (method, seen[method]) in which:
            await held[method].put(route)
        else:
            await route.continue_()

    await page.route(url, hold)
    return held


async def both_answers_kept(page: object, starting: Any) -> None:
    """The held start of the second run goes on: both runs are shown, as after a reload."""
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    await starting.continue_()
    await expect(page.locator(".msg.assistant").last).to_have_text("answer to hello second")
    await expect(page.locator("#status")).to_have_text("completed")
    entry = page.locator("#session-list [aria-current=true] small")
    await expect(entry).to_have_text("4 messages · completed")
    live = await shown(page)
    assert live[0] == ["hello first", "answer to hello first", "hello second",
                       "answer to hello second"]
    await page.reload()
    await expect(page.locator(".msg")).to_have_count(4)
    assert await shown(page) == live


async def test_a_message_sent_as_a_run_ends_stays_on_screen(page: object, served: Served) -> None:
    """The page shows the stored session when a run ends; a message sent while it fetches
    that session is not wiped by it."""
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    await page.goto(f"{served.url}/?session=race")
    # Loaded (the status reads "idle" before the session's fetch is answered): the fetch
    # held below is the one at the run's end.
    await page.locator("body[data-ready]").wait_for(state="attached")
    # The session's fetch at the first run's end, and the start of the second run, wait.
    held = await hold_requests(page, f"{served.url}/sessions/race**", ("GET", 1), ("POST", 2))
    await page.locator("#input").fill("hello first")
    await page.locator("#input").press("Enter")
    fetch = await asyncio.wait_for(held["GET"].get(), WAIT_S)
    await expect(page.locator("#status")).to_have_text("completed")
    await page.locator("#input").fill("hello second")
    await page.locator("#input").press("Enter")
    starting = await asyncio.wait_for(held["POST"].get(), WAIT_S)
    await expect(page.locator(".msg.user").last).to_have_text("hello second")
    async with page.expect_request(f"{served.url}/sessions"):  # after the fetch's answer
        await fetch.continue_()
    await expect(page.locator(".msg.user").last).to_have_text("hello second")
    await both_answers_kept(page, starting)


async def test_a_message_sent_while_the_page_loads_stays_on_screen(
    page: object, served: Served
) -> None:
    """A message typed before the session's fetch is answered: the stored conversation
    is drawn above it, not over it (it vanished until the run ended)."""
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    async with httpx.AsyncClient(base_url=served.url) as http:
        started = (await http.post("/sessions/early/runs", json={"task": "hello first"})).json()
        await http.get(f"/runs/{started['run_id']}/events")  # to its end
    # The page's load of the session, and the start of the run typed meanwhile, wait.
    held = await hold_requests(page, f"{served.url}/sessions/early**", ("GET", 1), ("POST", 1))
    await page.goto(f"{served.url}/?session=early")
    load = await asyncio.wait_for(held["GET"].get(), WAIT_S)
    await page.locator("#input").fill("hello second")
    await page.locator("#input").press("Enter")
    starting = await asyncio.wait_for(held["POST"].get(), WAIT_S)
    async with page.expect_request(f"{served.url}/sessions"):  # after the load's answer
        await load.continue_()
    await expect(page.locator(".msg.user")).to_have_text(["hello first", "hello second"])
    await both_answers_kept(page, starting)


async def opened_with_the_list_held(page: object, url: str, path: str) -> Any:
    """Go to ``url`` + ``path`` with the page's first read of the session list held: the
    held request, once the page has made it (the test lets it go on)."""
    from playwright.async_api import Page

    assert isinstance(page, Page)
    held = await hold_requests(page, f"{url}/sessions", ("GET", 1))
    await page.goto(url + path)
    return await asyncio.wait_for(held["GET"].get(), WAIT_S)


async def test_a_message_sent_before_the_page_chose_its_session_goes_to_that_session(
    page: object, served: Served
) -> None:
    """The page reads the session list before it opens the session its address names: a
    message sent meanwhile ran in "default" and was then wiped by the opened session."""
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    listing = await opened_with_the_list_held(page, served.url, "/?session=chosen")
    await page.locator("#input").fill("hello chosen")
    await page.locator("#input").press("Enter")
    await expect(page.locator(".msg.user")).to_have_text(["hello chosen"])
    await listing.continue_()
    await expect(page.locator(".msg.assistant").last).to_have_text("answer to hello chosen")
    await expect(page.locator("#status")).to_have_text("completed")
    await expect(page.locator("#session-title")).to_have_text("chosen")
    assert [m["content"] for m in await stored(served, "chosen") if m["role"] == "user"] == [
        "hello chosen"
    ]
    async with httpx.AsyncClient(base_url=served.url) as http:
        assert (await http.get("/sessions/default")).status_code == 404


async def test_a_session_opened_while_the_page_loads_stays_open(
    page: object, served: Served
) -> None:
    """With no session in its address, the page reads the session list to choose one: a
    session the person opened meanwhile (the new-session box) was taken back to the
    chosen one when the list came."""
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    listing = await opened_with_the_list_held(page, served.url, "/")
    await page.locator("#new-session-name").fill("fresh")
    await page.locator("#new-session-name").press("Enter")
    await expect(page.locator("#session-title")).to_have_text("fresh")
    await listing.continue_()
    await page.locator("body[data-ready]").wait_for(state="attached")
    await expect(page.locator("#session-title")).to_have_text("fresh")
    assert "session=fresh" in page.url
    await page.locator("#input").fill("hello fresh")
    await page.locator("#input").press("Enter")
    await expect(page.locator(".msg.assistant").last).to_have_text("answer to hello fresh")
    assert [m["content"] for m in await stored(served, "fresh") if m["role"] == "user"] == [
        "hello fresh"
    ]


async def test_typing_in_the_new_session_box_while_the_page_loads_keeps_the_keys_there(
    page: object, served: Served
) -> None:
    import asyncio

    from playwright.async_api import Page, Route, expect

    assert isinstance(page, Page)
    held, release = asyncio.Event(), asyncio.Event()

    async def hold(route: Route) -> None:
        held.set()
        await release.wait()
        await route.continue_()

    await page.route("**/sessions/default", hold)
    await page.goto(f"{served.url}/")
    await held.wait()  # the page is loading its session: it has not focused anything yet
    await page.locator("#new-session-name").focus()
    await page.keyboard.type("fre")
    release.set()
    await page.locator("body[data-ready]").wait_for(state="attached")  # done loading
    await expect(page.locator("#new-session-name")).to_be_focused()  # the focus stayed
    await page.keyboard.type("sh")
    await page.keyboard.press("Enter")
    await expect(page.locator("#session-title")).to_have_text("fresh")
    await expect(page.locator("#input")).to_have_value("")
