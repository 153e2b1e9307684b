"""The two user seeds, as tests.

"Cancel a run" (seed 004) describes our own API: its code blocks run here verbatim, against
the loopback server behind ``OLLAMA_HOST``, and what the seed promises is asserted.
"Interruption" (seed 000) describes a sibling library: each behaviour it names is tested
under our names (the table at the end of DESIGN.md).
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import types
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.agent import FINAL_TURN_PROMPT, INTERRUPTED
from aimu.aio.events import HandleFinished, RunFinished, TextChunk, ToolCallStarted
from aimu.aio.transcript import CANCELLED_RESULT, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer, default_script

ROOT = Path(__file__).resolve().parents[2]

# -- seed 004, "Cancel a run": the code lines exactly as the seed has them -----------------

SEED_START = """\
from aimu import aio

agent = aio.Agent(aio.client("ollama:qwen3:8b"), tools=[...])
handle = aio.RunHandle.start(agent.run("a big task"))
"""

SEED_CANCEL = """\
# ...later, from a /stop command, a timeout, another task...
handle.cancel()

try:
    reply = await handle.result()
except asyncio.CancelledError:
    ...  # the run was stopped
"""

SEED_RESUME_START = """\
handle = aio.RunHandle.start(agent.run(task))
"""

SEED_RESUME_STOP = """\
handle.cancel()
try:
    await handle.result()
except asyncio.CancelledError:
    partial = list(agent.model_client.messages)   # capture the partial turn
"""

SEED_RESUME_CONTINUE = """\
# later, on a fresh agent (or the same one):
agent.restore(partial)
await agent.run("continue where we left off")
"""

TASK = "a big task"
CONTINUE = "continue where we left off"


async def execute(code: str, namespace: dict[str, Any]) -> None:
    """Run ``code`` in ``namespace`` as the docs runner does: top-level ``await`` allowed."""
    compiled = compile(code, "<seed 004>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(compiled, namespace)
    if isinstance(result, types.CoroutineType):
        await result


@pytest.fixture
async def ollama_server(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[LoopbackServer]:
    """A loopback server answering like the test model, 20 ms between chunks."""
    async with LoopbackServer(default_script(delay=0.02)) as server:
        monkeypatch.setenv("OLLAMA_HOST", server.url)
        yield server


def seed_namespace() -> dict[str, Any]:
    return {"__name__": "__seed__", "asyncio": asyncio, "task": TASK}


async def close_agents(namespace: Mapping[str, Any], *more: aio.Agent) -> None:
    for agent in {id(a): a for a in (namespace.get("agent"), *more) if a is not None}.values():
        await agent.aclose()


async def first_text(handle: aio.RunHandle[Any]) -> None:
    """Wait until the run inside ``handle`` has streamed its first text chunk."""
    events = handle.events()
    try:
        async for event in events:
            if isinstance(event, TextChunk) or event.type == "handle_finished":
                return
    finally:
        await events.aclose()


def wire_messages(server: LoopbackServer) -> list[dict[str, Any]]:
    """The messages of the last chat request the server received."""
    chats = [r for r in server.requests if r.path in ("/api/chat", "/v1/chat/completions")]
    return list(chats[-1].body["messages"])


async def test_cancel_seed_runs_as_written(ollama_server: LoopbackServer) -> None:
    ns = seed_namespace()
    try:
        await execute(SEED_START, ns)
        await execute(SEED_CANCEL, ns)
        handle = ns["handle"]
        # The CancelledError reached the caller: the except branch ran, no reply was bound.
        assert "reply" not in ns
        assert handle.done and handle.cancelled and handle.status == "cancelled"
        with pytest.raises(asyncio.CancelledError):
            await handle  # "you can also await handle directly"
        assert handle.cancel() is False  # "cancel() returns False if ... already finished"

        await execute(SEED_RESUME_START, ns)
        await execute(SEED_RESUME_STOP, ns)
        assert ns["handle"].status == "cancelled"
        validate(ns["partial"])

        await execute(SEED_RESUME_CONTINUE, ns)
        messages = ns["agent"].model_client.messages
        validate(messages)
        assert messages[-2] == {"role": "user", "content": CONTINUE}
        assert messages[-1]["role"] == "assistant" and "aimu_partial" not in messages[-1]
        # The user turns left adjacent by the stops reach the model merged into one.
        start = len(messages) - 1
        while messages[start - 1]["role"] == "user":
            start -= 1
        said = " ".join(m["content"] for m in messages[start:-1])
        assert messages[-1]["content"] == "You said: " + " ".join(said.split())
        assert not ns["agent"].running
    finally:
        await close_agents(ns)


async def test_cancel_seed_as_written_keeps_the_task_for_continue(
    ollama_server: LoopbackServer,
) -> None:
    # Written exactly as the seed, each cancel comes right after RunHandle.start(). The
    # seed then restores the capture and asks to "continue where we left off": for that
    # to mean anything the capture must hold the task the run was started with.
    ns = seed_namespace()
    try:
        await execute(SEED_START, ns)
        await execute(SEED_CANCEL, ns)
        first_capture = list(ns["agent"].model_client.messages)
        await execute(SEED_RESUME_START, ns)
        await execute(SEED_RESUME_STOP, ns)
        assert {"role": "user", "content": TASK} in first_capture
        assert {"role": "user", "content": TASK} in ns["partial"]
    finally:
        await close_agents(ns)


async def test_cancel_seed_mid_run_keeps_the_partial_turn(ollama_server: LoopbackServer) -> None:
    # The seed's "...later": the same lines, with the cancel landing while text streams.
    ns = seed_namespace()
    fresh: aio.Agent | None = None
    try:
        await execute(SEED_START, ns)
        await first_text(ns["handle"])
        await execute(SEED_CANCEL, ns)
        assert "reply" not in ns and ns["handle"].status == "cancelled"
        # The server saw the connection go: it stopped generating.
        assert await ollama_server.wait_abandoned(1)

        await execute(SEED_RESUME_START, ns)
        await first_text(ns["handle"])
        await execute(SEED_RESUME_STOP, ns)
        partial = ns["partial"]
        validate(partial)
        last = partial[-1]
        assert last["role"] == "assistant" and last["aimu_partial"] is True
        assert last["content"] and f"You said: {TASK}".startswith(last["content"])
        assert partial[-2] == {"role": "user", "content": TASK}
        # The capture is a copy: nothing the agent does later changes it.
        assert partial is not ns["agent"].model_client.messages

        # "later, on a fresh agent (or the same one)": a fresh one here.
        fresh = ns["agent"] = aio.Agent(aio.client("ollama:qwen3:8b"), tools=[...])
        await execute(SEED_RESUME_CONTINUE, ns)
        sent = wire_messages(ollama_server)
        assert {"role": "user", "content": TASK} in sent
        assert sent[-1] == {"role": "user", "content": CONTINUE}
        assert any(m["role"] == "assistant" and m["content"] == last["content"] for m in sent)
        assert all("aimu_partial" not in m for m in sent)
        assert fresh.model_client.messages[-1]["content"] == f"You said: {CONTINUE}"
    finally:
        await close_agents(ns, *(a for a in (fresh,) if a is not None))


async def test_cancel_during_a_tool_round_settles_the_calls(
    ollama_server: LoopbackServer,
) -> None:
    # "an in-flight model request or tool round is interrupted cleanly"
    started = asyncio.Event()

    async def search(query: str) -> str:
        """Search the web."""
        started.set()
        await asyncio.sleep(30)
        return "never"

    agent = aio.Agent(aio.client("ollama:qwen3:8b"), tools=[search])
    try:
        handle = aio.RunHandle.start(agent.run(TASK))
        await started.wait()
        assert handle.cancel() is True
        with pytest.raises(asyncio.CancelledError):
            await handle.result()
        messages = agent.model_client.messages
        validate(messages)
        call = messages[-2]["tool_calls"][0]  # type: ignore[typeddict-item]
        assert messages[-1] == {
            "role": "tool", "content": CANCELLED_RESULT,
            "tool_call_id": call["id"], "name": "search",
        }
        async with aio.Agent(aio.client("ollama:qwen3:8b")) as fresh:
            fresh.restore(messages)
            assert await fresh.run(CONTINUE) == f"You said: {CONTINUE}"
        sent = wire_messages(ollama_server)
        assert any(m["role"] == "tool" and m["content"] == CANCELLED_RESULT for m in sent)
    finally:
        await agent.aclose()


async def test_run_handle_wraps_any_coroutine() -> None:
    async def plain() -> str:
        await asyncio.sleep(0)
        return "done"

    handle = aio.RunHandle.start(plain())
    assert await handle == "done"
    assert handle.status == "completed" and handle.cancel() is False


async def test_run_handle_works_for_a_workflow_run(ollama_server: LoopbackServer) -> None:
    # "It wraps any run coroutine, so it works for a workflow run too."
    writer = aio.Agent(aio.client("ollama:qwen3:8b"), name="writer")
    editor = aio.Agent(aio.client("ollama:qwen3:8b"), name="editor")
    try:
        chain = aio.Chain([writer, editor])
        handle = aio.RunHandle.start(chain.run(TASK))
        await first_text(handle)
        assert handle.cancel() is True
        with pytest.raises(asyncio.CancelledError):
            await handle.result()
        assert handle.status == "cancelled" and chain.last_status == "cancelled"
        first = chain.state["steps"][0]
        validate(first["messages"])
        assert first["messages"][0] == {"role": "user", "content": TASK}
        assert first["messages"][-1]["aimu_partial"] is True
    finally:
        await writer.aclose()
        await editor.aclose()


# -- seed 000, "Interruption", in our names --------------------------------------------------


def one_tool_then_answer(request: Mapping[str, Any]) -> Turn:
    """Call ``search`` while tools are offered and no result came yet; else answer."""
    messages = request["messages"]
    if request.get("tools") and messages[-1]["role"] == "user":
        return Turn(tool_calls=[ScriptedCall("search", {"query": "topic"})])
    results = [m for m in messages if m["role"] == "tool"]
    return Turn(text=f"answer from {len(results)} results", delay=0.01)


def always_a_tool(request: Mapping[str, Any]) -> Turn:
    """Call ``search`` whenever tools are offered: only the round budget ends the run."""
    if request.get("tools"):
        return Turn(tool_calls=[ScriptedCall("search", {"query": "topic"})])
    return Turn(text="best answer now")


@pytest.fixture
async def openai_server(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[LoopbackServer]:
    async with LoopbackServer(one_tool_then_answer) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.openai_base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-seed-test")
        yield server


def chat_requests(server: LoopbackServer) -> list[dict[str, Any]]:
    return [r.body for r in server.requests if r.path == "/v1/chat/completions"]


class SlowSearch:
    """A ``search`` tool that tells the test when it runs; the run can be stopped then."""

    def __init__(self) -> None:
        self.running = asyncio.Event()
        self.calls = 0

    async def __call__(self, query: str) -> str:
        """Search the web for a query."""
        self.calls += 1
        self.running.set()
        await asyncio.sleep(0.05)
        return f"found {query}"


def make_agent(search: SlowSearch, **options: Any) -> aio.Agent:
    tool = aio.tool(search, name="search")
    return aio.Agent(aio.client("openai:gpt-4o-mini"), tools=[tool], **options)


async def test_interrupt_stops_at_the_next_step_boundary(openai_server: LoopbackServer) -> None:
    search = SlowSearch()
    agent = make_agent(search)
    try:
        session = agent.start()
        run = asyncio.ensure_future(session.run("Research this topic thoroughly."))
        await search.running.wait()
        assert session.interrupt() is True
        # The step in flight (the model turn and its tool round) finishes, then it stops.
        assert await run == INTERRUPTED
        assert session.last_status == "interrupted"
        assert len(chat_requests(openai_server)) == 1  # no model call after the boundary
        memory = session.model_client.messages
        assert [m["role"] for m in memory] == ["user", "assistant", "tool"]
        assert memory[-1]["content"] == "found topic"
        validate(memory)
        # The agent it came from is untouched: sessions have their own memory.
        assert agent.model_client.messages == []
    finally:
        await agent.aclose()


async def test_interrupt_from_another_thread(openai_server: LoopbackServer) -> None:
    # "Call session.interrupt() from anywhere": a UI button often runs on its own thread.
    search = SlowSearch()
    agent = make_agent(search)
    try:
        session = agent.start()
        run = asyncio.ensure_future(session.run("Research this topic thoroughly."))
        await search.running.wait()
        pressed: list[bool] = []
        button = threading.Thread(target=lambda: pressed.append(session.interrupt()))
        button.start()
        await asyncio.to_thread(button.join)
        assert pressed == [True]
        assert await run == INTERRUPTED
        assert len(chat_requests(openai_server)) == 1
    finally:
        await agent.aclose()


async def test_resume_picks_up_without_repeating_the_task(openai_server: LoopbackServer) -> None:
    search = SlowSearch()
    agent = make_agent(search)
    try:
        session = agent.start()
        task = "Research this topic thoroughly."
        run = asyncio.ensure_future(session.run(task))
        await search.running.wait()
        session.interrupt()
        assert await run == INTERRUPTED

        assert await session.resume() == "answer from 1 results"
        memory = session.model_client.messages
        assert [m["content"] for m in memory if m["role"] == "user"] == [task]
        assert search.calls == 1  # the finished tool round was not run again
        # The resumed model turn read the recorded tool result.
        assert chat_requests(openai_server)[-1]["messages"][-1]["role"] == "tool"
        validate(memory)
    finally:
        await agent.aclose()


async def test_resume_continues_the_round_budget(openai_server: LoopbackServer) -> None:
    openai_server.script = always_a_tool
    search = SlowSearch()
    agent = make_agent(search, max_rounds=2)
    try:
        session = agent.start()
        run = asyncio.ensure_future(session.run("Research this topic thoroughly."))
        await search.running.wait()
        session.interrupt()
        assert await run == INTERRUPTED
        assert await session.resume() == "best answer now"
        # Two tool rounds in all, then the final turn without tools: the budget of two
        # rounds went on from the interrupted run instead of starting again.
        requests = chat_requests(openai_server)
        assert [bool(r.get("tools")) for r in requests] == [True, True, False]
        assert requests[-1]["messages"][-1] == {"role": "user", "content": FINAL_TURN_PROMPT}
        assert search.calls == 2
    finally:
        await agent.aclose()


async def test_run_again_without_reset_continues_and_reset_starts_clean(
    openai_server: LoopbackServer,
) -> None:
    search = SlowSearch()
    agent = make_agent(search, system="You are a researcher.")
    try:
        session = agent.start()
        run = asyncio.ensure_future(session.run("first task"))
        await search.running.wait()
        session.interrupt()
        assert await run == INTERRUPTED
        before = len(session.model_client.messages)

        await session.run("go on")  # reset=False: the memory is kept and sent
        sent = chat_requests(openai_server)[-1]["messages"]
        assert [m["content"] for m in sent if m["role"] == "user"] == ["first task", "go on"]
        assert len(session.model_client.messages) > before

        await session.run("something else", reset=True)
        memory = session.model_client.messages
        assert memory[0] == {"role": "system", "content": "You are a researcher."}
        assert [m["content"] for m in memory if m["role"] == "user"] == ["something else"]
        sent = chat_requests(openai_server)[-1]["messages"]
        assert "first task" not in json.dumps(sent)
    finally:
        await agent.aclose()


async def test_interrupt_with_no_run_in_progress_does_nothing(
    openai_server: LoopbackServer,
) -> None:
    # The sibling library's flag stays set and poisons the next run; ours is a no-op.
    agent = make_agent(SlowSearch())
    try:
        session = agent.start()
        assert session.interrupt() is False
        assert await session.run("Research this topic thoroughly.") == "answer from 1 results"
        assert session.last_status == "completed"
    finally:
        await agent.aclose()


async def test_streamed_interrupted_run_ends_with_one_final_event(
    openai_server: LoopbackServer,
) -> None:
    search = SlowSearch()
    agent = make_agent(search)
    try:
        session = agent.start()
        events = []
        async for event in session.run("Research this topic thoroughly.", stream=True):
            events.append(event)
            if isinstance(event, ToolCallStarted):
                session.interrupt()
        finals = [e for e in events if isinstance(e, RunFinished)]
        assert finals == [events[-1]]
        assert finals[0].status == "interrupted" and finals[0].reply == INTERRUPTED
    finally:
        await agent.aclose()


async def test_handle_events_end_with_the_handle_status(openai_server: LoopbackServer) -> None:
    search = SlowSearch()
    agent = make_agent(search)
    try:
        handle = aio.RunHandle.start(agent.start().run("Research this topic thoroughly."))
        events = handle.events()
        seen = []
        async for event in events:
            seen.append(event)
            if isinstance(event, ToolCallStarted):
                assert handle.interrupt() is True
        assert await handle == INTERRUPTED
        assert handle.status == "interrupted"
        assert isinstance(seen[-1], HandleFinished) and seen[-1].status == "interrupted"
        assert [e.status for e in seen if isinstance(e, RunFinished)] == ["interrupted"]
    finally:
        await agent.aclose()


# -- Ctrl+C and restarts, in child processes ------------------------------------------------

CHILD = textwrap.dedent(
    """
    import asyncio
    import json
    import signal
    import sys

    from aimu import aio

    MODE, STORE, SECONDS = sys.argv[1], sys.argv[2], float(sys.argv[3])
    KEEP_ON = sys.argv[4] == "keep-on"


    async def search(query: str, ctx: aio.ToolContext) -> str:
        '''Search the web for a query.'''
        print("searching", flush=True)
        # Runs until an interrupt is seen (then says so), or SECONDS with KEEP_ON.
        for _ in range(int(SECONDS * 100)):
            if ctx.interrupt_requested:
                print("interrupt seen", flush=True)
                if not KEEP_ON:
                    break
                await asyncio.sleep(SECONDS)
            await asyncio.sleep(0.01)
        return f"found {query}"


    store = aio.SQLiteStore(STORE) if STORE != "-" else None
    agent = aio.Agent(
        aio.client("openai:gpt-4o-mini"), tools=[search],
        store=store, session="research" if store else None,
    )


    async def main() -> None:
        loop = asyncio.get_running_loop()
        if MODE == "seed":
            session = agent.start()
            loop.add_signal_handler(signal.SIGINT, session.interrupt)
            answer = await session.run("Research this topic thoroughly.")
        elif MODE == "on_sigint":
            handle = aio.RunHandle.start(agent.run("Research this topic thoroughly."))
            aio.on_sigint(handle)
            try:
                answer = await handle
            except asyncio.CancelledError:
                answer = "(cancelled)"
            print(handle.status, flush=True)
        elif MODE == "resume":
            answer = await agent.resume()
            print(json.dumps(agent.model_client.messages), flush=True)
        else:
            loop.add_signal_handler(signal.SIGINT, agent.interrupt)
            answer = await agent.run("Research this topic thoroughly.")
        print(answer, flush=True)
        await agent.aclose()
        if store is not None:
            store.close()


    asyncio.run(main())
    """
)


@pytest.fixture(scope="module")
def thread_server() -> Iterator[LoopbackServer]:
    with LoopbackServer.in_thread(one_tool_then_answer) as server:
        yield server


def start_child(
    server: LoopbackServer, mode: str, store: str = "-", *, keep_on: bool = False
) -> subprocess.Popen[str]:
    """A child running the seed; its tool runs until an interrupt reaches it (or, with
    ``keep_on``, 30 s whatever happens)."""
    env = {
        **os.environ,
        "OPENAI_BASE_URL": server.openai_base_url,
        "OPENAI_API_KEY": "sk-seed-test",
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
    }
    return subprocess.Popen(
        [sys.executable, "-W", "error::ResourceWarning", "-c", CHILD, mode, store,
         "30", "keep-on" if keep_on else "-"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        text=True, env=env,
    )


def press_ctrl_c(child: subprocess.Popen[str], times: int = 1) -> tuple[list[str], str]:
    """Send SIGINT ``times`` once the child's tool is running; return its output lines
    (without the tool's "interrupt seen")."""
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "searching"
    child.send_signal(signal.SIGINT)
    if times == 2:
        # The first press provably reached the run: now the second cannot merge with it.
        assert child.stdout.readline().strip() == "interrupt seen"
        child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    return [line for line in out.splitlines() if line != "interrupt seen"], err


def test_sigint_wired_to_interrupt_winds_the_run_down(thread_server: LoopbackServer) -> None:
    # The seed's main() in our names: loop.add_signal_handler(SIGINT, session.interrupt).
    lines, _ = press_ctrl_c(start_child(thread_server, "seed"))
    assert lines == [INTERRUPTED]


def test_on_sigint_first_press_interrupts(thread_server: LoopbackServer) -> None:
    lines, _ = press_ctrl_c(start_child(thread_server, "on_sigint"))
    assert lines == ["interrupted", INTERRUPTED]


def test_on_sigint_second_press_cancels(thread_server: LoopbackServer) -> None:
    # The tool would run 30 s: only the cancel of the second press ends the run early.
    child = start_child(thread_server, "on_sigint", keep_on=True)
    lines, _ = press_ctrl_c(child, times=2)
    assert lines == ["cancelled", "(cancelled)"]


def test_an_interrupted_run_resumes_in_a_new_process(
    thread_server: LoopbackServer, tmp_path: Path
) -> None:
    store = str(tmp_path / "sessions.db")
    lines, _ = press_ctrl_c(start_child(thread_server, "stored", store))
    assert lines == [INTERRUPTED]

    child = start_child(thread_server, "resume", store)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    transcript_line, answer = out.splitlines()
    assert answer == "answer from 1 results"
    transcript = json.loads(transcript_line)
    validate(transcript)
    assert [m["role"] for m in transcript] == ["user", "assistant", "tool", "assistant"]
    assert [m["content"] for m in transcript if m["role"] == "user"] == [
        "Research this topic thoroughly."
    ]
    async def stored() -> tuple[list[aio.Message], Any]:
        async with aio.SQLiteStore(store) as reopened:
            return await reopened.load("research"), await reopened.info("research")

    loaded, info = asyncio.run(stored())
    assert loaded == transcript
    assert info is not None and info.status == "completed"
