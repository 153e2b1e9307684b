"""The assistant's serve loop, in process: /stop, queued input, commands, Ctrl+C, sessions.

Each test drives an :class:`Assistant` as a person would, one line at a time, and
reads what it prints; the model is a :class:`ScriptedModel` and the store a real
SQLite file. The process-level behaviour (stdin, a pty, restarts) is in test_cli.py.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.store import SQLiteStore
from aimu.aio.tools import ToolContext
from aimu.aio.transcript import Message, validate
from aimu.assistant import (
    DEMO_TOOLS,
    Assistant,
    ChatSettings,
    Mode,
    current_time,
    research,
    run_chat,
    word_count,
)
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer

# Streams for a minute: a stop after its first words lands provably mid-stream.
LONG = " ".join(f"w{i}" for i in range(3000))
MEDIUM = " ".join(f"m{i}" for i in range(30))
FLAKY = "One two three four five six seven eight nine."


def last_user(request: Mapping[str, Any]) -> str:
    users = [m["content"] for m in request["messages"] if m["role"] == "user"]
    return users[-1] if users else ""


def chat_script(request: Mapping[str, Any]) -> Turn:
    """"long ..." streams for seconds, "medium ..." for a moment; the rest is answered at once."""
    said = last_user(request)
    if said.startswith("long"):
        return Turn(text=LONG, delay=0.02)
    if said.startswith("medium"):
        return Turn(text=MEDIUM, delay=0.01)
    return Turn(text=f"answer to {said}")


class Gate:
    """A tool that waits until the test opens it, so a step boundary is in reach."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()
        self.calls = 0

    async def wait_for_gate(self) -> str:
        """Wait until the gate opens."""
        self.calls += 1
        await self.opened.wait()
        return "the gate opened"


def tool_then_answer(request: Mapping[str, Any]) -> Turn:
    if request["messages"][-1]["role"] == "tool":
        return Turn(text="all done now")
    return Turn(tool_calls=(ScriptedCall("wait_for_gate"),))


def gated_script(request: Mapping[str, Any]) -> Turn:
    """"gated ..." waits in ``wait_for_gate``, then says "gate passed"; the rest is answered."""
    if request["messages"][-1]["role"] == "tool":
        return Turn(text="gate passed")
    said = last_user(request)
    if said.startswith("gated"):
        return Turn(tool_calls=(ScriptedCall("wait_for_gate"),))
    return Turn(text=f"answer to {said}")


class Screen:
    """An assistant serving in a task, its output, and a cursor through that output."""

    def __init__(self, assistant: Assistant, out: io.StringIO, *, sigint: bool = False):
        self.assistant = assistant
        self.out = out
        self.cursor = 0
        self.task = asyncio.create_task(assistant.serve(sigint=sigint))

    @classmethod
    def of(
        cls, model: ScriptedModel, store: SQLiteStore, *, sigint: bool = False, **options: Any
    ) -> Screen:
        """Serve ``model`` with errors on the same screen as the output, as on a terminal."""
        out = io.StringIO()
        return cls(Assistant(model, store, out=out, err=out, **options), out, sigint=sigint)

    def send(self, *lines: str) -> None:
        for line in lines:
            self.assistant.submit(line)

    async def expect(self, text: str) -> str:
        """Wait until ``text`` is printed after the cursor; return the output up to it."""
        try:
            async with asyncio.timeout(10):
                while (at := self.out.getvalue().find(text, self.cursor)) < 0:
                    if self.task.done():
                        break
                    await asyncio.sleep(0.005)
        except TimeoutError:
            at = -1
        if at < 0:
            raise AssertionError(f"{text!r} never printed; after the cursor: {self.rest()!r}")
        seen = self.out.getvalue()[self.cursor : at + len(text)]
        self.cursor = at + len(text)
        return seen

    def rest(self) -> str:
        return self.out.getvalue()[self.cursor :]

    async def until(self, condition: Callable[[], bool]) -> None:
        """Wait until ``condition()`` holds (what it checks was printed or set)."""
        async with asyncio.timeout(10):
            while True:  # polled: a StringIO has nothing to wait on
                if condition():
                    return
                await asyncio.sleep(0.005)

    async def finish(self) -> int:
        self.assistant.end_input()
        code = await self.task
        await self.assistant.aclose()
        return code


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteStore]:
    opened = SQLiteStore(tmp_path / "sessions.db")
    yield opened
    opened.close()


@pytest.fixture
async def screen(store: SQLiteStore) -> AsyncIterator[Screen]:
    shown = Screen.of(ScriptedModel(chat_script), store, session="s", tools=())
    yield shown
    if not shown.task.done():
        await shown.finish()


def messages(screen: Screen) -> list[Message]:
    return screen.assistant.agent.model_client.messages


def requests(screen: Screen) -> list[dict[str, Any]]:
    model = screen.assistant.agent.model_client
    assert isinstance(model, ScriptedModel)
    return model.requests


# --------------------------------------------------------------------------- /stop


async def test_stop_cancels_the_running_turn_keeps_queued_input_and_the_partial_text(
    screen: Screen, store: SQLiteStore
) -> None:
    await screen.expect("/help lists the commands.\n")
    screen.send("long story")
    shown = await screen.expect("w5 ")
    screen.send("queued one", "queued two", "/stop")
    shown += await screen.expect("(stopped)\n")
    partial = shown.removesuffix("\n(stopped)\n")
    assert partial.startswith("w0 w1 w2 w3 w4 w5") and not partial.endswith("w399")
    # The queued input was not dropped: it runs after the stopped turn, in order.
    await screen.expect("answer to queued one\n")
    await screen.expect("answer to queued two\n")
    transcript = messages(screen)
    assert [m["role"] for m in transcript] == ["user", "assistant"] * 3
    stopped = transcript[1]
    assert stopped["role"] == "assistant" and stopped.get("aimu_partial") is True
    assert stopped["content"] == partial  # what the user saw is what was kept
    # The next turn's request carries the stopped turn, as the model will see it.
    sent = requests(screen)[1]["messages"]
    assert sent[:2] == [
        {"role": "user", "content": "long story"},
        {"role": "assistant", "content": stopped["content"]},
    ]
    assert await store.load("s") == transcript
    model = screen.assistant.agent.model_client
    assert isinstance(model, ScriptedModel) and model.open_streams == 0
    assert await screen.finish() == 0


async def test_stop_with_nothing_running_says_so_and_interrupt_too(screen: Screen) -> None:
    screen.send("/stop")
    await screen.expect("(nothing to stop: no turn is running)\n")
    screen.send("/interrupt")
    await screen.expect("(nothing to interrupt: no turn is running)\n")
    screen.send("hello")
    await screen.expect("answer to hello\n")
    assert await screen.finish() == 0
    assert "(stopped)" not in screen.out.getvalue()


async def test_stop_right_after_a_message_stops_that_message(screen: Screen) -> None:
    # Both lines arrive together (a paste, a pipe): the message is running when /stop comes.
    await screen.expect("(new)")
    screen.send("long", "/stop", "next")
    await screen.expect("(stopped)\n")
    await screen.expect("answer to next\n")
    assert await screen.finish() == 0


async def test_input_typed_during_a_turn_is_answered_in_order(store: SQLiteStore) -> None:
    gate = Gate()
    screen = Screen.of(ScriptedModel(gated_script), store, tools=[gate.wait_for_gate])
    screen.send("gated one")
    await screen.expect("[calling wait_for_gate()]\n")
    screen.send("first", "second", "/history", "third")  # the turn waits at the gate
    gate.opened.set()
    order = [
        "gate passed\n",
        "answer to first\n",
        "answer to second\n",
        "session 'default': 8 messages\n",
        "answer to third\n",
    ]
    for text in order:
        await screen.expect(text)
    said = [last_user(r) for r in requests(screen)]
    assert said == ["gated one", "gated one", "first", "second", "third"]
    assert await screen.finish() == 0


async def test_eof_waits_for_the_running_turn_and_the_queue(store: SQLiteStore) -> None:
    gate = Gate()
    screen = Screen.of(ScriptedModel(gated_script), store, tools=[gate.wait_for_gate])
    screen.send("gated", "after")
    await screen.expect("[calling wait_for_gate()]\n")
    screen.assistant.end_input()  # while the turn waits at the gate
    gate.opened.set()
    assert await screen.task == 0
    out = screen.out.getvalue()
    assert out.index("gate passed\n") < out.index("answer to after\n")
    await screen.assistant.aclose()


async def test_thinking_is_announced_once_then_the_answer_streams(store: SQLiteStore) -> None:
    model = ScriptedModel([Turn(thinking="let me think about this at length", text="42")])
    out = io.StringIO()
    screen = Screen(Assistant(model, store, tools=(), out=out), out)
    await screen.expect(".\n")
    screen.send("the answer?")
    assert await screen.expect("42\n") == "(thinking…)\n42\n"
    assert await screen.finish() == 0


# --------------------------------------------------------------------------- commands


async def test_unknown_command_gets_a_one_line_hint_and_slash_slash_sends_text(
    screen: Screen,
) -> None:
    await screen.expect("/help lists the commands.\n")
    screen.send("/frobnicate now")
    hint = await screen.expect("\n")
    assert hint.startswith("unknown command /frobnicate: /help lists the commands")
    screen.send("//etc is a path")
    await screen.expect("answer to /etc is a path\n")
    assert await screen.finish() == 0


async def test_help_lists_every_command(screen: Screen) -> None:
    screen.send("/help")
    shown = await screen.expect("Ctrl+D exits.\n")
    for command in ("/stop", "/interrupt", "/resume", "/history", "/sessions", "/new", "/quit"):
        assert f"  {command}" in shown
    assert await screen.finish() == 0


async def test_new_session_sessions_and_switching_back(
    screen: Screen, store: SQLiteStore
) -> None:
    screen.send("hello")
    await screen.expect("answer to hello\n")
    screen.send("/new other")
    await screen.expect("(new session 'other')\n")
    assert screen.assistant.session == "other" and messages(screen) == []
    screen.send("hi other")
    await screen.expect("answer to hi other\n")
    # The request of the new session carries none of the old one.
    assert [m["content"] for m in requests(screen)[-1]["messages"]] == ["hi other"]
    screen.send("/sessions")
    listed = await screen.expect("  s: 2 messages, completed")
    assert "* other: 2 messages, completed" in listed
    screen.send("/new s")
    await screen.expect("(switched to session 's': 2 messages)\n")
    screen.send("/new")
    await screen.expect("(new session 'chat-")
    assert screen.assistant.session.startswith("chat-")
    screen.send("/new bad/name")
    await screen.expect("error: invalid session name 'bad/name'")
    assert await screen.finish() == 0
    assert {info.name for info in await store.sessions()} == {"s", "other"}


async def test_quit_ends_after_the_running_turn(screen: Screen) -> None:
    screen.send("medium", "/quit", "never")
    assert await screen.task == 0
    assert "answer to never" not in screen.out.getvalue()
    await screen.assistant.aclose()


# --------------------------------------------------------------------------- interrupt, resume


async def test_interrupt_finishes_the_step_then_resume_continues_without_repeating(
    store: SQLiteStore,
) -> None:
    gate = Gate()
    model = ScriptedModel(tool_then_answer)
    out = io.StringIO()
    screen = Screen(Assistant(model, store, tools=[gate.wait_for_gate], out=out), out)
    screen.send("do it")
    await screen.expect("[calling wait_for_gate()]\n")
    screen.send("/interrupt")
    await screen.expect("(interrupting: this step finishes")
    gate.opened.set()
    shown = await screen.expect("(interrupted)\n")
    assert "[wait_for_gate → the gate opened]" in shown
    assert model.turns_served == 1  # stopped at the step boundary, before the answer
    screen.send("/resume")
    await screen.expect("(resuming)\n")
    await screen.expect("all done now\n")
    transcript = screen.assistant.agent.model_client.messages
    assert [m["role"] for m in transcript] == ["user", "assistant", "tool", "assistant"]
    assert [m["content"] for m in transcript if m["role"] == "user"] == ["do it"]
    screen.send("/resume")
    await screen.expect("(nothing to resume: the last turn finished")
    assert await screen.finish() == 0


async def test_resume_after_stop_mid_tool_continues_the_run(store: SQLiteStore) -> None:
    gate = Gate()
    model = ScriptedModel(tool_then_answer)
    out = io.StringIO()
    screen = Screen(Assistant(model, store, tools=[gate.wait_for_gate], out=out), out)
    screen.send("/resume")
    await screen.expect("(nothing to resume: this session has no conversation yet)\n")
    screen.send("do it")
    await screen.expect("[calling wait_for_gate()]\n")
    screen.send("/stop")
    await screen.expect("(stopped)\n")
    transcript = screen.assistant.agent.model_client.messages
    validate(transcript)
    assert transcript[-1]["role"] == "tool" and "cancelled" in transcript[-1]["content"]
    gate.opened.set()
    screen.send("/resume")
    await screen.expect("all done now\n")
    assert [m["role"] for m in transcript] == ["user", "assistant", "tool", "assistant"]
    assert await screen.finish() == 0


# --------------------------------------------------------------------------- errors


async def test_a_model_error_prints_one_line_and_the_loop_keeps_serving(
    store: SQLiteStore,
) -> None:
    def flaky(request: Mapping[str, Any]) -> Turn:
        if last_user(request) == "break":
            return Turn(text="half a reply and then", fault="drop", fault_after=2)
        return Turn(text=f"answer to {last_user(request)}")

    out, err = io.StringIO(), io.StringIO()
    screen = Screen(Assistant(ScriptedModel(flaky), store, tools=(), out=out, err=err), out)
    await screen.expect("/help lists the commands.\n")
    screen.send("break")
    failed = "error: in-process model dropped the connection mid-stream\n"
    await screen.until(lambda: err.getvalue() == failed)
    assert screen.rest() == "half a \n"  # the partial reply, its line ended
    screen.send("again")
    await screen.expect("answer to again\n")
    assert "Traceback" not in out.getvalue() + err.getvalue()
    validate(screen.assistant.agent.model_client.messages)
    assert await screen.finish() == 0  # the last turn answered


@pytest.mark.parametrize("second", [FLAKY, "Ten eleven twelve."], ids=["same", "other"])
async def test_a_reply_the_network_cut_and_restarted_is_not_printed_twice(
    store: SQLiteStore, second: str
) -> None:
    """Issue 44: the model's stream is cut after a few words and the turn restarted. The
    words printed before the cut are not printed again: a restarted reply that repeats
    them goes on after them; one that says something else comes after a note."""
    first = Turn(text=FLAKY, fault="cut", fault_after=4)
    async with LoopbackServer([first, Turn(text=second)]) as server:
        model = aio.client("openai:m", base_url=server.openai_base_url, api_key="k",
                           retry_delay=0.001)
        out, err = io.StringIO(), io.StringIO()
        screen = Screen(Assistant(model, store, tools=(), out=out, err=err), out)
        await screen.expect("/help lists the commands.\n")
        screen.send("count")
        shown = await screen.expect(second[-8:] + "\n")
        assert await screen.finish() == 0
        await model.aclose()
    # The retry's note (on err, the same terminal) ended the streamed line.
    if second == FLAKY:
        assert shown.replace("\n", "") == FLAKY and shown.count("One") == 1, shown
    else:
        cut = shown.split("\n")[0]
        assert cut and FLAKY.startswith(cut) and cut != FLAKY
        assert shown.endswith("(the reply broke off and was asked again; it now says:)\n"
                              + second + "\n")
    assert "(retry 1 in" in err.getvalue()


async def test_serve_returns_1_when_the_last_turn_failed(store: SQLiteStore) -> None:
    def failing(request: Mapping[str, Any]) -> Turn:
        return Turn(fault="http_500")

    out, err = io.StringIO(), io.StringIO()
    screen = Screen(Assistant(ScriptedModel(failing), store, tools=(), out=out, err=err), out)
    screen.send("hello")
    screen.assistant.end_input()
    assert await screen.task == 1
    await screen.assistant.aclose()
    assert err.getvalue().startswith("error: ") and err.getvalue().count("\n") == 1
    assert "error" not in out.getvalue()


async def test_a_locked_session_cannot_be_served_twice(store: SQLiteStore) -> None:
    model = ScriptedModel(chat_script)
    first = Assistant(model, store, session="shared", tools=())
    second = Assistant(model, store, session="shared", tools=())
    try:
        await first.open()
        with pytest.raises(Exception, match="already open for writing"):
            await second.open()
    finally:
        await first.aclose()
        await second.aclose()


async def test_a_store_error_in_a_command_prints_one_line_and_the_loop_keeps_serving(
    screen: Screen, store: SQLiteStore
) -> None:
    screen.send("hello")
    await screen.expect("answer to hello\n")
    store.close()  # every later store read fails with a StoreError
    for command in ("/sessions", "/new"):
        screen.send(command)
        shown = await screen.expect("\n")
        assert shown.startswith("error: ") and "is closed; cannot list" in shown, shown
    screen.send("/help")
    await screen.expect("Ctrl+D exits.\n")
    assert not screen.task.done()
    assert await screen.finish() == 0


# --------------------------------------------------------------------------- cancel sweep


async def test_stop_landing_at_every_await_leaves_a_valid_session_that_keeps_serving(
    store: SQLiteStore,
) -> None:
    async def step() -> str:
        """One step of work."""
        for _ in range(3):
            await asyncio.sleep(0)
        return "stepped"

    def script(request: Mapping[str, Any]) -> Turn:
        said = last_user(request)
        if said == "after":
            return Turn(text="after answered")
        if request["messages"][-1]["role"] == "tool":
            return Turn(text="a b c d e")
        return Turn(text="calling", tool_calls=(ScriptedCall("step"),))

    outcomes: set[str] = set()
    for ticks in range(45):
        model = ScriptedModel(script)
        out = io.StringIO()
        session = f"k{ticks}"
        screen = Screen(Assistant(model, store, session=session, tools=[step], out=out), out)
        await screen.expect("(new)")
        screen.send("go")
        for _ in range(ticks):
            await asyncio.sleep(0)
        screen.send("/stop", "after")
        await screen.expect("after answered\n")
        assert await screen.finish() == 0
        transcript = await store.load(session)
        validate(transcript)
        assert transcript[-2:] == [
            {"role": "user", "content": "after"},
            {"role": "assistant", "content": "after answered", "aimu_model": "scripted:scripted"},
        ]
        # A stop that lands even before the run's first step still keeps the task.
        assert [m["content"] for m in transcript if m["role"] == "user"].count("go") == 1
        assert model.open_streams == 0
        text = out.getvalue()
        if "(stopped)" not in text:
            outcomes.add("finished")
            assert "a b c d e" in text
        elif any(m.get("aimu_partial") for m in transcript):
            outcomes.add("mid-stream")
        elif any(m["role"] == "tool" and "cancelled" in m["content"] for m in transcript):
            outcomes.add("mid-tool")
        else:
            outcomes.add("between steps")
    assert {"between steps", "mid-stream", "mid-tool", "finished"} <= outcomes, outcomes


# --------------------------------------------------------------------------- Ctrl+C


async def test_ctrl_c_interrupts_then_cancels_and_never_outlives_its_turn(
    store: SQLiteStore,
) -> None:
    before = signal.getsignal(signal.SIGINT)
    gate = Gate()
    model = ScriptedModel(tool_then_answer)
    out = io.StringIO()
    screen = Screen(
        Assistant(model, store, tools=[gate.wait_for_gate], out=out), out, sigint=True
    )
    screen.send("first")
    await screen.expect("[calling wait_for_gate()]\n")
    press_ctrl_c()
    await screen.expect("press Ctrl+C again to stop now)\n")
    gate.opened.set()
    await screen.expect("(interrupted)\n")
    # The next turn starts with no press counted: it runs to its answer.
    gate.opened.clear()
    screen.send("second")
    await screen.expect("[calling wait_for_gate()]\n")
    gate.opened.set()
    await screen.expect("all done now\n")
    # Twice within one turn: cancelled.
    gate.opened.clear()
    screen.send("third")
    await screen.expect("[calling wait_for_gate()]\n")
    press_ctrl_c()
    await screen.expect("press Ctrl+C again to stop now)\n")
    os.kill(os.getpid(), signal.SIGINT)
    await screen.expect("(stopped)\n")
    validate(screen.assistant.agent.model_client.messages)
    # Idle: Ctrl+C exits.
    os.kill(os.getpid(), signal.SIGINT)
    assert await screen.task == 0
    await screen.assistant.aclose()
    assert "(bye)" in out.getvalue()
    assert signal.getsignal(signal.SIGINT) == before


ALREADY_ENDED = "(the turn has already ended; press Ctrl+C again to exit)\n"


def press_ctrl_c() -> None:
    """Ctrl+C as the terminal sends it: SIGINT to this process, handled before returning."""
    os.kill(os.getpid(), signal.SIGINT)


async def a_gated_turn(store: SQLiteStore, *, pressed: bool) -> tuple[Screen, Gate]:
    """A chat with Ctrl+C wired whose turn waits at the gate; Ctrl+C pressed once if asked."""
    gate = Gate()
    screen = Screen.of(
        ScriptedModel(gated_script), store, sigint=True, tools=[gate.wait_for_gate]
    )
    screen.send("gated")
    await screen.expect("[calling wait_for_gate()]\n")
    if pressed:
        press_ctrl_c()
        await screen.expect("press Ctrl+C again to stop now)\n")
    return screen, gate


async def test_two_quick_ctrl_c_presses_cancel_the_turn_and_never_exit(
    store: SQLiteStore,
) -> None:
    before = signal.getsignal(signal.SIGINT)
    screen, _ = await a_gated_turn(store, pressed=False)
    press_ctrl_c()
    press_ctrl_c()  # before the loop has even handled the first one
    await screen.expect("(stopped)\n")
    validate(screen.assistant.agent.model_client.messages)
    screen.send("hello")
    await screen.expect("answer to hello\n")
    assert not screen.task.done()
    assert await screen.finish() == 0
    assert "(bye)" not in screen.out.getvalue()
    assert signal.getsignal(signal.SIGINT) == before


async def test_a_second_ctrl_c_while_the_turn_settles_never_exits(store: SQLiteStore) -> None:
    screen, gate = await a_gated_turn(store, pressed=True)
    turn = screen.assistant.turn
    assert turn is not None
    # The second press lands the moment the turn has ended, before the chat reported it
    # (a done callback runs before the serve loop wakes); the handler itself, since a
    # signal's handler would be queued behind the serve loop's wake-up.
    turn.add_done_callback(lambda _: screen.assistant.press_ctrl_c())
    gate.opened.set()
    await screen.until(lambda: ALREADY_ENDED in screen.out.getvalue())
    await screen.expect("(interrupted)\n")
    assert not screen.task.done()
    screen.send("hello")  # new input: the count is gone
    await screen.expect("answer to hello\n")
    press_ctrl_c()
    await screen.expect("(bye)\n")
    assert await screen.task == 0
    await screen.assistant.aclose()


async def test_a_second_ctrl_c_after_the_pressed_turn_ended_asks_once_more_before_exiting(
    store: SQLiteStore,
) -> None:
    screen, gate = await a_gated_turn(store, pressed=True)
    gate.opened.set()
    await screen.expect("(interrupted)\n")
    press_ctrl_c()  # meant to stop the turn, which had just ended: not an exit
    await screen.expect(ALREADY_ENDED)
    assert not screen.task.done()
    press_ctrl_c()
    await screen.expect("(bye)\n")
    assert await screen.task == 0
    await screen.assistant.aclose()


# --------------------------------------------------------------------------- demo tools


async def test_demo_tools_work_and_research_stops_when_cancelled() -> None:
    assert current_time()[:2] == "20"
    assert word_count("one two  three") == 3
    ctx = ToolContext(agent="a", call_id="c", tool_name="research")
    ctx.mark_cancelled()
    assert research("Paris", ctx) == "research on 'Paris' was cancelled"
    assert len(DEMO_TOOLS) == 3


async def test_run_chat_reports_bad_settings_in_one_line_on_stderr(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = await run_chat(ChatSettings(model="nope:x", home=tmp_path), out=out, err=err)
    assert code == 2 and out.getvalue() == ""
    assert err.getvalue().startswith("error: unknown model provider in 'nope:x'")
    out, err = io.StringIO(), io.StringIO()
    assert await run_chat(ChatSettings(session="../x", home=tmp_path), out=out, err=err) == 2
    assert out.getvalue() == ""
    assert err.getvalue().count("\n") == 1 and "invalid session name" in err.getvalue()


async def test_ctrl_c_goes_back_to_a_loop_handler_that_was_there_before(
    store: SQLiteStore,
) -> None:
    before = signal.getsignal(signal.SIGINT)
    loop = asyncio.get_running_loop()
    pressed = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, pressed.set)
    try:
        out = io.StringIO()
        screen = Screen(Assistant(ScriptedModel(chat_script), store, out=out), out, sigint=True)
        await screen.expect("(new)")
        os.kill(os.getpid(), signal.SIGINT)  # idle: the assistant's handler exits
        assert await screen.task == 0
        await screen.assistant.aclose()
        assert "(bye)" in out.getvalue()
        # The handler the loop had before serving gets Ctrl+C again.
        pressed.clear()
        os.kill(os.getpid(), signal.SIGINT)
        async with asyncio.timeout(5):
            await pressed.wait()
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        signal.signal(signal.SIGINT, before)


async def test_cancelling_serve_mid_turn_stops_the_turn_keeps_it_and_propagates(
    screen: Screen, store: SQLiteStore
) -> None:
    screen.send("long story")
    await screen.expect("w3 ")
    screen.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await screen.task
    assert not screen.assistant.running
    stored = await store.load("s")
    validate(stored)
    assert stored[-1]["role"] == "assistant" and stored[-1].get("aimu_partial") is True
    model = screen.assistant.agent.model_client
    assert isinstance(model, ScriptedModel) and model.open_streams == 0
    await screen.assistant.aclose()


async def test_control_characters_a_model_sends_are_shown_escaped(store: SQLiteStore) -> None:
    model = ScriptedModel([Turn(text="clear\x1b[2J me\x07\n"), Turn(text="plain")])
    screen = Screen.of(model, store, tools=(), colour=True)
    await screen.expect("/help lists the commands.")
    screen.send("hi")
    # On a terminal the reply's line is printed once it ends; escapes cannot act on it.
    await screen.expect("clear\\x1b[2J me\\x07\n")
    assert "\x1b[2J" not in screen.out.getvalue() and "\x07" not in screen.out.getvalue()
    screen.send("/history")
    await screen.expect("assistant: clear\\x1b[2J me\\x07")
    assert await screen.finish() == 0


# --------------------------------------------------------------------------- approvals, join


class Files:
    """A tool that needs a person's approval, counting its calls."""

    def __init__(self) -> None:
        self.deleted: list[str] = []

    def delete_file(self, path: str) -> str:
        """Delete a file."""
        self.deleted.append(path)
        return f"deleted {path}"


def deleting(*paths: str) -> Any:
    def script(request: Mapping[str, Any]) -> Turn:
        last = request["messages"][-1]
        if last["role"] == "tool":
            results = [m["content"] for m in request["messages"] if m["role"] == "tool"]
            return Turn(text="done: " + "; ".join(results))
        return Turn(tool_calls=tuple(ScriptedCall("delete_file", {"path": p}) for p in paths))

    return script


def approving_screen(store: SQLiteStore, files: Files, *paths: str, **options: Any) -> Screen:
    tool = aio.tool(files.delete_file, approval=True)
    return Screen.of(ScriptedModel(deleting(*paths)), store, tools=[tool], **options)


async def test_a_paused_turn_shows_the_call_and_y_approves_it(store: SQLiteStore) -> None:
    files = Files()
    screen = approving_screen(store, files, "/tmp/a")
    screen.send("clean up")
    await screen.expect("(paused: a tool call waits for your approval)\n")
    asked = await screen.expect("approve? [y/N]\n")
    assert asked.startswith('[delete_file(path="/tmp/a") call ')
    assert files.deleted == []  # nothing runs before the decision
    screen.send("y")
    await screen.expect("(resuming)\n")
    await screen.expect("done: deleted /tmp/a\n")
    assert files.deleted == ["/tmp/a"]
    validate(screen.assistant.agent.model_client.messages)
    assert await screen.finish() == 0


async def test_the_mode_says_what_a_line_typed_now_does(store: SQLiteStore) -> None:
    """One mode at a time, for each state of the loop: idle, a turn running, a call
    waiting for "approve?" (a command meanwhile leaves it asking), and closed again."""
    files = Files()
    screen = approving_screen(store, files, "/tmp/a", "/tmp/b")
    assistant = screen.assistant
    await screen.expect("/help lists the commands.\n")
    assert assistant.mode is Mode.IDLE
    screen.send("clean up")
    assert assistant.mode is Mode.RUNNING  # at once: a /stop now finds the turn
    await screen.expect("approve? [y/N]\n")
    assert assistant.mode is Mode.ASKING and assistant.turn is None
    screen.send("/history")  # a command while asking: queued, handled, asking again
    await screen.expect("user: clean up")
    await screen.until(lambda: assistant.mode is Mode.ASKING)
    screen.send("y")  # the answer: asked about the next call
    await screen.expect("approve? [y/N]\n")
    assert assistant.mode is Mode.ASKING
    screen.send("y")  # the last answer: the turn resumes
    assert assistant.mode is Mode.RUNNING
    await screen.expect("done: deleted /tmp/a; deleted /tmp/b\n")
    await screen.until(lambda: assistant.mode is Mode.IDLE)
    assert await screen.finish() == 0
    assert assistant.mode is Mode.CLOSED


async def test_anything_but_yes_denies_and_the_model_reads_why(store: SQLiteStore) -> None:
    files = Files()
    screen = approving_screen(store, files, "/tmp/a", "/tmp/b")
    screen.send("clean up")
    await screen.expect("approve? [y/N]\n")
    screen.send("no")
    await screen.expect("(denied call ")
    await screen.expect("approve? [y/N]\n")  # the second call is asked about next
    screen.send("/deny too risky")
    await screen.expect("done: ")
    assert files.deleted == []
    results = [m["content"] for m in messages(screen) if m["role"] == "tool"]
    assert len(results) == 2 and "too risky" in results[1] and results[0] != results[1]
    assert await screen.finish() == 0


async def test_a_decision_survives_a_restart_of_the_chat(store: SQLiteStore) -> None:
    files = Files()
    first = approving_screen(store, files, "/tmp/a", "/tmp/b", session="p")
    first.send("clean up")
    await first.expect("approve? [y/N]\n")
    first.send("/approve")
    await first.expect("(approved call ")
    await first.expect("approve? [y/N]\n")  # the second waits: the chat stops here
    assert await first.finish() == 0

    again = approving_screen(store, files, "/tmp/a", "/tmp/b", session="p")
    await again.expect("(this session is paused: a tool call waits for your approval)\n")
    asked = await again.expect("approve? [y/N]\n")
    assert '"/tmp/b"' in asked and '"/tmp/a"' not in asked  # only the undecided one
    again.send("yes")
    await again.expect("done: deleted /tmp/a; deleted /tmp/b\n")
    assert files.deleted == ["/tmp/a", "/tmp/b"]
    assert await again.finish() == 0


async def test_in_join_mode_a_line_typed_during_a_turn_joins_it(store: SQLiteStore) -> None:
    gate = Gate()
    screen = Screen.of(
        ScriptedModel(gated_script), store, tools=[gate.wait_for_gate], join=True
    )
    screen.send("gated")
    await screen.expect("[calling wait_for_gate()]\n")
    screen.send("and mind the step")  # the turn waits at the gate: it is running
    await screen.expect("(joins the running turn at its next step)\n")
    gate.opened.set()
    await screen.expect("answer to and mind the step\n")
    users = [m["content"] for m in messages(screen) if m["role"] == "user"]
    assert users == ["gated", "and mind the step"]  # joined once, no new turn
    screen.send("/join")
    await screen.expect("(lines typed during a turn now queue after it)\n")
    assert await screen.finish() == 0


async def test_a_tool_name_a_model_makes_up_is_shown_escaped(store: SQLiteStore) -> None:
    model = ScriptedModel([Turn(tool_calls=(ScriptedCall("wipe\x1b[2J"),)), Turn(text="ok")])
    screen = Screen.of(model, store, tools=(), colour=True)
    screen.send("hi")
    await screen.expect("[calling wipe\\x1b[2J()]")
    await screen.expect("[wipe\\x1b[2J failed ")
    assert "\x1b[2J" not in screen.out.getvalue()
    assert await screen.finish() == 0


async def test_the_stdin_reader_ends_with_serve_and_leaves_later_input_unread(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    read_end, write_end = os.pipe()
    monkeypatch.setattr(sys, "stdin", os.fdopen(read_end, "rb", buffering=0))
    out = io.StringIO()
    assistant = Assistant(ScriptedModel(chat_script), store, out=out, err=out, tools=())
    os.write(write_end, b"hello\n/quit\n")  # stdin stays open: a terminal, or a pipe
    try:
        assert await assistant.serve(stdin=True) == 0
        await assistant.aclose()
        assert "answer to hello" in out.getvalue()
        readers = [t for t in threading.enumerate() if t.name == "aimu-chat-stdin"]
        for reader in readers:
            reader.join(10)  # a bound, not a measure: it ends as serve() returns
        assert not any(reader.is_alive() for reader in readers)
        os.write(write_end, b"for the next reader\n")
        assert os.read(read_end, 100) == b"for the next reader\n"  # not taken by the chat
    finally:
        os.close(write_end)
        sys.stdin.close()


async def test_an_answer_cut_off_by_the_length_limit_is_shown_cut_off(
    store: SQLiteStore,
) -> None:
    model = ScriptedModel([Turn(text="the start of a", stop_reason="length")])
    screen = Screen.of(model, store, tools=())
    await screen.expect("/help lists the commands.\n")
    screen.send("tell me all")
    assert await screen.expect("\n(cut off: the model stopped with 'length')\n") == (
        "the start of a\n(cut off: the model stopped with 'length')\n"
    )
    assert await screen.finish() == 0


async def test_in_the_editor_a_line_wider_than_the_terminal_goes_above_broken_at_spaces(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt that shows the streaming line does not wrap: a wide line would stop
    showing new words at the right edge until its newline came."""
    monkeypatch.setenv("COLUMNS", "41")  # what shutil.get_terminal_size() reads first
    wide = " ".join(["界界界"] * 10)  # two columns a character
    model = ScriptedModel([Turn(text=f"{MEDIUM} {wide}\n")])  # streamed word by word
    screen = Screen.of(model, store, tools=(), colour=True)
    await screen.expect("/help lists the commands.\n")
    screen.send("hi")
    assert await screen.finish() == 0  # the input ended: the turn runs to its end first
    shown = screen.rest().splitlines()
    assert len(shown) > 4, shown
    for line in shown:  # one column kept free
        assert sum(2 if "界" in c else 1 for c in line) <= 40, shown
    assert " ".join(shown).split() == f"{MEDIUM} {wide}".split()  # broken only at spaces
