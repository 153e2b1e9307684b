"""MCP servers' tools in an agent, against a server on the official Python SDK (stdio and
Streamable HTTP): calls, filters and names, stops that reach the server, crashes,
annotations as policies, approvals across a restart, progress events, bad input."""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from aimu import aio
from aimu.aio.approvals import PAUSED
from aimu.aio.event_json import decode_event, encode_event
from aimu.aio.transcript import CANCELLED_RESULT, dangling_calls, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel, tool_turn
from tests.aio.mcp.helpers import (
    RAW_SERVER,
    ServerLog,
    alive,
    http_server_process,
    stdio_server,
    wait_gone,
)
from tests.services import free_port

# Each test starts a server on the SDK (~1 s of imports each on a busy machine).
pytestmark = pytest.mark.slow


@pytest.fixture
def log(tmp_path: Path) -> ServerLog:
    return ServerLog(tmp_path / "server.log")


@pytest.fixture
async def server(log: ServerLog) -> AsyncIterator[aio.MCPServer]:
    async with stdio_server(log) as opened:
        yield opened


@pytest.fixture
def http_url(log: ServerLog) -> Iterator[str]:
    with http_server_process(log) as url:
        yield url


def tool_results(agent: aio.Agent) -> list[str]:
    return [m["content"] for m in agent.model_client.messages if m["role"] == "tool"]


async def server_pid(server: aio.MCPServer) -> int:
    tools = {t.name: t for t in await server.list_tools()}
    outcome = await tools["pid"].fn({}, aio.ToolContext(agent="t", call_id="c", tool_name="pid"))
    return int(outcome.content)


# -- tools in an agent -------------------------------------------------------------------------


async def test_an_agent_calls_a_stdio_servers_tool_beside_a_plain_function(
    server: aio.MCPServer,
) -> None:
    def double(n: int) -> int:
        """Double a number."""
        return 2 * n

    model = ScriptedModel([tool_turn(("add", {"a": 2, "b": 3}), ("double", {"n": 4})), Turn("ok")])
    agent = aio.Agent(model, tools=[double, server])
    assert await agent.run("sum") == "ok"
    assert tool_results(agent) == ["5", "8"]
    by_name = {t.name: t for t in agent.tools}
    # The server's schema goes to the model unchanged (the SDK's titles and all).
    assert by_name["add"].parameters["title"] == "addArguments"
    assert by_name["add"].parameters["properties"]["b"]["description"] == "the second number"
    assert model.requests[0]["tools"] == [t.name for t in agent.tools]
    assert server.is_open  # opened by `async with`: the agent leaves it open
    await agent.aclose()
    assert server.is_open


async def test_the_agent_opens_a_server_it_needs_and_closes_it(log: ServerLog) -> None:
    server = stdio_server(log)
    agent = aio.Agent(ScriptedModel([tool_turn(("pid", {})), Turn("ok")]), tools=[server])
    await agent.run("pid?")
    pid = int(tool_results(agent)[0])
    assert alive(pid)
    await agent.aclose()
    assert not server.is_open
    wait_gone(pid)


async def test_tools_are_filtered_by_name_and_glob(log: ServerLog) -> None:
    async with stdio_server(log, tools=["a*", "pid"]) as server:
        assert sorted(t.name for t in await server.list_tools()) == ["add", "pid"]
    with pytest.raises(aio.MCPServerError, match=r"has no tool 'nope'; it has: add, crash"):
        await stdio_server(log, name="math", tools=["add", "nope"]).open()


async def test_clashing_names_get_the_servers_name_as_prefix(log: ServerLog) -> None:
    def add(a: int, b: int) -> int:
        """A local add."""
        return a + b

    one = stdio_server(log, name="one", tools=["add", "pid"])
    two = stdio_server(log, name="two", tools=["add"])
    script = [tool_turn(("add", {"a": 1, "b": 1}), ("one_add", {"a": 2, "b": 2}),
                        ("two_add", {"a": 3, "b": 3}), ("pid", {})), Turn("ok")]
    agent = aio.Agent(ScriptedModel(script), tools=[add, one, two])
    async with agent:
        await agent.run("adds")
        assert [t.name for t in agent.tools] == ["add", "one_add", "pid", "two_add"]
        results = tool_results(agent)
        assert results[:3] == ["2", "4", "6"] and results[3].isdigit()
    assert not one.is_open and not two.is_open


# -- stopping ----------------------------------------------------------------------------------


def wait_turn(tag: str, seconds: float) -> Turn:
    return tool_turn(("wait", {"tag": tag, "seconds": seconds}))


async def start_waiting(agent: aio.Agent, tag: str, **options: float) -> aio.RunHandle[str]:
    """Start a run that calls the server's ``wait``; return once the call reported progress
    (so the server is inside the tool)."""
    seen: list[aio.Event] = []
    news = asyncio.Event()

    def hear(event: aio.Event) -> None:
        if isinstance(event, aio.ToolProgress | aio.RunFinished):
            seen.append(event)
            news.set()

    handle = aio.RunHandle.start(agent.run(f"wait {tag}"), **options)
    handle.add_listener(hear)
    await news.wait()
    assert isinstance(seen[0], aio.ToolProgress), f"the run ended before the call: {seen}"
    return handle


async def test_a_cancel_reaches_the_servers_tool_and_the_connection_stays_usable(
    server: aio.MCPServer, log: ServerLog
) -> None:
    model = ScriptedModel([wait_turn("w1", 60), tool_turn(("add", {"a": 1, "b": 2})), Turn("3")])
    agent = aio.Agent(model, tools=[server])
    handle = await start_waiting(agent, "w1")
    handle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handle
    await log.wait_for("cancelled w1")
    assert "finished w1" not in log.lines()
    messages = agent.model_client.messages
    validate(messages)
    assert messages[-1]["role"] == "tool" and messages[-1]["content"] == CANCELLED_RESULT
    assert dangling_calls(messages) == []
    assert await agent.run("now add") == "3"
    assert tool_results(agent)[-1] == "3"


async def test_a_deadline_cancels_the_call_on_the_server(
    server: aio.MCPServer, log: ServerLog
) -> None:
    agent = aio.Agent(ScriptedModel([wait_turn("d1", 60)]), tools=[server])
    # Generous: the call must reach the server first, on a machine that may be busy.
    handle = await start_waiting(agent, "d1", timeout=8.0)
    with pytest.raises(TimeoutError):
        await handle
    assert handle.status == "timed_out"
    await log.wait_for("cancelled d1")
    validate(agent.model_client.messages)


async def test_a_tool_timeout_cancels_the_call_and_the_run_goes_on(log: ServerLog) -> None:
    async with stdio_server(log, tool_timeout=0.5) as server:
        script = [wait_turn("t1", 60), tool_turn(("add", {"a": 2, "b": 2})), Turn("ok")]
        model = ScriptedModel(script)
        agent = aio.Agent(model, tools=[server])
        assert await agent.run("wait") == "ok"
        await log.wait_for("cancelled t1")
        assert tool_results(agent) == ["tool 'wait' timed out after 0.5 s", "4"]


async def test_an_interrupt_lets_the_call_finish(server: aio.MCPServer, log: ServerLog) -> None:
    agent = aio.Agent(ScriptedModel([wait_turn("i1", 0.2), Turn("never")]), tools=[server])
    handle = await start_waiting(agent, "i1")
    handle.interrupt()
    assert await handle == "Run interrupted."
    assert "finished i1" in log.lines() and "cancelled i1" not in log.lines()
    assert tool_results(agent) == ["waited i1"]
    validate(agent.model_client.messages)


async def test_a_server_that_crashes_mid_call_is_a_tool_error_and_is_restarted(
    server: aio.MCPServer, log: ServerLog
) -> None:
    first = await server_pid(server)
    script = [tool_turn(("crash", {"tag": "c1"})), tool_turn(("add", {"a": 1, "b": 1})), Turn("ok")]
    agent = aio.Agent(ScriptedModel(script), tools=[server])
    assert await agent.run("crash") == "ok"
    crashed, added = tool_results(agent)
    assert "closed the connection during the call to 'crash'" in crashed and added == "2"
    wait_gone(first)
    assert await server_pid(server) != first


async def test_a_hanging_server_is_a_tool_error_after_the_tool_timeout(log: ServerLog) -> None:
    # A server that stops answering: its tool never returns, so only the timeout ends it.
    async with stdio_server(log, tool_timeout=0.3) as server:
        agent = aio.Agent(ScriptedModel([wait_turn("h1", 3600), Turn("went on")]), tools=[server])
        assert await agent.run("hang") == "went on"
        assert "timed out" in tool_results(agent)[0]


async def test_closing_reaps_the_server_even_when_the_closer_is_cancelled(log: ServerLog) -> None:
    server = stdio_server(log)
    await server.open()
    pid = await server_pid(server)
    closing = asyncio.ensure_future(server.aclose())
    await asyncio.sleep(0)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    wait_gone(pid)


# -- annotations, approvals, the journal -------------------------------------------------------


async def test_annotations_become_policies(server: aio.MCPServer) -> None:
    tools = {t.name: t for t in await server.list_tools()}
    assert tools["remove"].approval and not tools["remove"].idempotent  # destructiveHint
    assert tools["add"].idempotent and not tools["add"].approval  # idempotentHint, readOnly
    assert not tools["pid"].approval and not tools["pid"].idempotent


def raw_annotated(**options: object) -> aio.MCPServer:
    return aio.MCPServer.stdio(sys.executable, [RAW_SERVER, "annotations"], name="raw",
                               **options)  # type: ignore[arg-type]


async def test_annotations_follow_the_mcp_specifications_defaults() -> None:
    """Unset hints read as the specification's defaults: readOnlyHint false,
    destructiveHint true, idempotentHint false. So a tool with no annotations asks."""
    async with raw_annotated() as server:
        policies = {t.name: (t.approval, t.idempotent) for t in await server.list_tools()}
    assert policies == {  # (asks for approval, idempotent)
        "none": (True, False),
        "empty": (True, False),
        "read_only": (False, True),
        "read_only_destructive": (False, True),  # destructiveHint means nothing when read-only
        "additive": (False, False),
        "additive_idempotent": (False, True),
        "destructive_idempotent": (True, True),
        "idempotent": (True, True),
        "big": (False, True),
        "picture": (False, True),
    }
    for approval in (False, True):  # the server's own setting decides for all its tools
        async with raw_annotated(approval=approval) as server:
            assert {t.approval for t in await server.list_tools()} == {approval}


async def test_an_image_result_is_named_not_given_as_base64() -> None:
    async with raw_annotated() as server:
        agent = aio.Agent(ScriptedModel([tool_turn(("picture", {})), Turn("done")]),
                          tools=[server])
        assert await agent.run("draw") == "done"
    assert tool_results(agent) == [
        "a red dot:\n[image: image/png, 70 bytes]\n[audio: audio/wav, 4 bytes]\n"
        "[resource file:///tmp/a.bin: application/zip, 3 bytes]"
    ]


async def test_a_tool_with_no_annotations_pauses_the_run_for_approval() -> None:
    async with raw_annotated() as server:
        agent = aio.Agent(ScriptedModel([tool_turn(("none", {})), Turn("done")]), tools=[server])
        assert await agent.run("go") == PAUSED
        assert [p.tool for p in agent.pending_approvals] == ["none"]
        trusted = aio.Agent(ScriptedModel([tool_turn(("none", {})), Turn("done")]),
                            tools=[raw_annotated(approval=False)])
        async with trusted:
            assert await trusted.run("go") == "done"


async def test_a_result_over_the_cap_is_cut_with_a_marker_in_memory_and_in_the_store(
    tmp_path: Path,
) -> None:
    store = aio.SQLiteStore(tmp_path / "s.db")
    for cap, kept in [(None, 1_000_000), (1000, 1000), (1, 0)]:  # 1: "é" (2 bytes) not cut
        options = {} if cap is None else {"max_result": cap}
        agent = aio.Agent(ScriptedModel([tool_turn(("big", {})), Turn("done")]),
                          tools=[raw_annotated(**options)], store=store, session=f"s{cap}")
        async with agent:
            assert await agent.run("go") == "done"
        (result,) = tool_results(agent)
        body, marker = result.rsplit("\n", 1)
        assert len(body.encode()) == kept
        assert marker == (
            f"[cut: {1_500_000 - kept:,} of 1,500,000 bytes dropped; tool 'big' results are "
            f"capped at {cap or 1_000_000:,} bytes]"
        )
        stored = await store.load(f"s{cap}")
        assert [m["content"] for m in stored if m["role"] == "tool"] == [result]
    whole = aio.Agent(ScriptedModel([tool_turn(("big", {})), Turn("done")]),
                      tools=[raw_annotated(max_result=None)])
    async with whole:
        await whole.run("go")
    assert len(tool_results(whole)[0].encode()) == 1_500_000
    await store.aclose()


async def test_the_agents_policy_overrides_the_destructive_hint(
    server: aio.MCPServer, log: ServerLog
) -> None:
    script = [tool_turn(("remove", {"path": "/tmp/x"})), Turn("removed")]
    agent = aio.Agent(ScriptedModel(script), tools=[server], approve=lambda name, args: True)
    assert await agent.run("remove it") == "removed"
    assert "removed /tmp/x" in log.lines()


async def test_a_destructive_tool_pauses_and_resumes_across_a_restart(
    log: ServerLog, tmp_path: Path
) -> None:
    store = aio.SQLiteStore(tmp_path / "s.db")
    script = [tool_turn(("remove", {"path": "/tmp/y"})), Turn("gone")]
    first = aio.Agent(ScriptedModel(script), tools=[stdio_server(log)], store=store, session="s")
    assert await first.run("remove y") == PAUSED
    (pending,) = first.pending_approvals
    assert pending.tool == "remove"
    await first.aclose()  # the server it opened is closed: nothing of it is kept
    assert not any(line.startswith("removed") for line in log.lines())

    # "A new process": a new agent, a new server object, the same store and session.
    again = stdio_server(log)
    second = aio.Agent(ScriptedModel(script[1:]), tools=[again], store=store, session="s")
    await second.open()
    second.approve(pending.call_id)
    assert await second.resume() == "gone"
    assert "removed /tmp/y" in log.lines()
    validate(second.model_client.messages)
    await second.aclose()
    assert not again.is_open
    await store.aclose()


async def test_an_idempotent_call_in_doubt_runs_again_on_resume(
    log: ServerLog, tmp_path: Path
) -> None:
    store = aio.SQLiteStore(tmp_path / "j.db")
    call = ScriptedCall("add", {"a": 4, "b": 5}, id="call-1")
    agent = aio.Agent(ScriptedModel([Turn(tool_calls=[call])]), tools=[stdio_server(log)],
                      store=store, session="j")
    await agent.open()
    writer = agent._session.durable.writer
    assert writer is not None
    # The state a crash leaves: the call recorded and journalled as started, no result.
    await writer.append({"role": "user", "content": "add"})
    function = {"name": "add", "arguments": {"a": 4, "b": 5}}
    await writer.append({"role": "assistant", "content": "", "tool_calls": [
        {"id": "call-1", "type": "function", "function": function}  # type: ignore[typeddict-item]
    ]})
    await writer.record_tool_start("call-1", "add", {"a": 4, "b": 5})
    await agent.aclose()

    again = aio.Agent(ScriptedModel([Turn("9")]), tools=[stdio_server(log)], store=store,
                      session="j")
    assert await again.resume() == "9"
    assert tool_results(again)[-1].endswith("9")  # run again (idempotentHint), noted as such
    await again.aclose()
    await store.aclose()


# -- progress ----------------------------------------------------------------------------------


async def test_progress_reaches_the_stream_and_the_handles_followers(
    server: aio.MCPServer,
) -> None:
    agent = aio.Agent(ScriptedModel([wait_turn("p1", 0), Turn("ok")]), tools=[server])

    async def drain() -> list[aio.Event]:
        return [event async for event in agent.run("wait", stream=True)]

    heard: list[aio.Event] = []
    handle = aio.RunHandle.start(drain())
    handle.add_listener(heard.append)  # what serve's SSE and Redis control follow
    streamed = await handle
    kinds = [event.type for event in streamed]
    assert kinds.index("tool_call") < kinds.index("tool_progress") < kinds.index("tool_result")
    progress = [e for e in streamed if isinstance(e, aio.ToolProgress)]
    assert [(p.progress, p.total, p.message) for p in progress] == [
        (0, 1, "waiting p1"), (1, 1, "done p1")
    ]
    assert progress[0].name == "wait" and progress[0].source == agent.name
    assert [e for e in heard if isinstance(e, aio.ToolProgress)] == progress
    assert decode_event(*encode_event(progress[0])) == progress[0]  # Redis followers


async def test_progress_with_concurrent_tools(server: aio.MCPServer) -> None:
    script = [tool_turn(("wait", {"tag": "a", "seconds": 0}), ("wait", {"tag": "b", "seconds": 0})),
              Turn("ok")]
    agent = aio.Agent(ScriptedModel(script), tools=[server], concurrent_tools=True)
    streamed = [event async for event in agent.run("both", stream=True)]
    assert sum(isinstance(e, aio.ToolProgress) for e in streamed) == 4
    assert sorted(tool_results(agent)) == ["waited a", "waited b"]


# -- Streamable HTTP ---------------------------------------------------------------------------


async def test_http_calls_progress_and_a_cancel_that_reaches_the_server(
    http_url: str, log: ServerLog
) -> None:
    async with aio.MCPServer.http(http_url, headers={"Authorization": "Bearer s3cret"}) as server:
        assert server.name == "127_0_0_1"
        model = ScriptedModel([wait_turn("h1", 60), tool_turn(("add", {"a": 20, "b": 22})),
                               Turn("42")])
        agent = aio.Agent(model, tools=[server])
        handle = await start_waiting(agent, "h1")
        handle.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handle
        await log.wait_for("cancelled h1")
        validate(agent.model_client.messages)
        assert await agent.run("add") == "42"
        assert tool_results(agent)[-1] == "42"


# -- bad input ---------------------------------------------------------------------------------


async def test_bad_servers_are_clear_errors_naming_the_server() -> None:
    cases = [
        (aio.MCPServer.stdio("no-such-mcp-server-command", name="ghost"),
         r"'ghost': command 'no-such-mcp-server-command' not found"),
        (aio.MCPServer.stdio(sys.executable, ["-c", "import sys; sys.stderr.write('no config"
                                              " file\\n'); sys.exit(2)"], name="quits"),
         r"'quits' .* exited or closed the connection during start-up; it wrote: no config file"),
        (aio.MCPServer.stdio(sys.executable, ["-c", "import time; time.sleep(60)"], name="mute",
                             timeout=1),
         r"'mute' .* did not start and list its tools within 1 s"),
        (aio.MCPServer.stdio(sys.executable, [RAW_SERVER, "string-schema"], name="odd"),
         r"'odd' .* inputSchema must be a JSON schema of type 'object'"),
        (aio.MCPServer.stdio(sys.executable, [RAW_SERVER, "deep-schema"], name="deep",
                             timeout=20),
         r"'deep' .* sent a message that cannot be read: it nests deeper than a JSON parser "
         r"allows \(a tool's inputSchema is nested too deeply"),
        (aio.MCPServer.stdio(sys.executable, [RAW_SERVER, "list-fails"], name="broken"),
         r"'broken' .* with an error: the tool list is broken"),
        (aio.MCPServer.http(f"http://127.0.0.1:{free_port()}/mcp", name="away",
                            headers={"Authorization": "Bearer s3cret"}),
         r"'away' \(http://127.0.0.1:\d+/mcp\) could not be started or reached"),
    ]
    for server, message in cases:
        with pytest.raises(aio.MCPServerError, match=message) as caught:
            await server.open()
        assert caught.value.server == server.name
        assert "s3cret" not in str(caught.value)
        assert not server.is_open
    del caught
    gc.collect()  # a socket or pipe left open by a failed start would warn here


async def test_a_run_whose_server_cannot_start_fails_naming_it() -> None:
    agent = aio.Agent(ScriptedModel([Turn("never")]),
                      tools=[aio.MCPServer.stdio("no-such-mcp-server-command", name="ghost")])
    with pytest.raises(aio.MCPServerError, match="ghost"):
        await agent.run("hi")
    assert agent.last_status == "failed"
    validate(agent.model_client.messages)


def test_bad_arguments_are_refused_at_once() -> None:
    with pytest.raises(ValueError, match="command must be a non-empty string"):
        aio.MCPServer.stdio("")
    with pytest.raises(TypeError, match="args must be a list of strings"):
        aio.MCPServer.stdio("x", "--flag")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="url must be an http"):
        aio.MCPServer.http("ftp://example.com")
    with pytest.raises(ValueError, match="tools= must be tool names or globs"):
        aio.MCPServer.stdio("x", tools=[])
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        aio.MCPServer.stdio("x", timeout=0)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        aio.MCPServer.stdio("x", timeout=10**400)
    with pytest.raises(ValueError, match="name must be 1-40 letters"):
        aio.MCPServer.stdio("x", name="has space")
    server = aio.MCPServer.stdio("x", name="same")
    with pytest.raises(ValueError, match="toolset 'same' is given twice"):
        aio.Agent(ScriptedModel([]), tools=[server, server])


def test_default_names() -> None:
    assert aio.MCPServer.stdio("npx", ["-y", "@modelcontextprotocol/server-everything"]).name == (
        "server-everything"
    )
    assert aio.MCPServer.stdio("/usr/bin/mcp-git").name == "mcp-git"
    assert aio.MCPServer.stdio("python3", ["-m", "weather.server"]).name == "weather_server"
    assert aio.MCPServer.http("https://mcp.example.com/mcp").name == "mcp_example_com"
