"""A follower of a run whose ``aimu serve`` was killed (kill -9) reconnects with its last
event id and is carried to the run that continues it after ``--recover`` (issue 44 item
7): a ``run_continued`` event, then every event of the continuing run exactly once, ids
increasing, so its next reconnect works too; no GET starts or revives a run.

The run calls ``held`` (an idempotent tool that waits for the file ``open``): the
follower sees its ``tool_call`` (the provable point), the server is killed; a
server without ``--recover`` shows the run, answers the reconnect 404 (it died, nobody
went on with it yet) and starts nothing; a recovering server resumes the session
(``held`` runs again and waits), and the reconnected follower gets the bridge and the
continuing run's events as they happen. The AI SDK and AG-UI cases run with ``--redis``
too (the restarted server goes on once Redis finds the run lost); the Redis follower
over SSE, carried across replicas, is tests/serve/test_follow_recovered_redis.py.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aimu.aio.store import RunRecord
from aimu.serve.backends.local import GENERATION
from aimu.serve.recovery import resumed_here
from aimu.testing.server import LoopbackServer
from tests.serve import recover_tools
from tests.serve.harness import SSE, Served, aimu_serve, sse_events, start
from tests.serve.protocols import node_client
from tests.serve.test_drain_recover import runs_of, until

TOOLS = ("--tool", "tests.serve.recover_tools:held")


@pytest.fixture(scope="module")
def model() -> Iterator[LoopbackServer]:
    with LoopbackServer.in_thread(recover_tools.script) as server:
        yield server


@pytest.fixture
def held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    where = tmp_path / "held"
    where.mkdir()
    monkeypatch.setenv("AIMU_TEST_HELD", str(where))  # the servers inherit it
    return where


async def follow_until(
    http: httpx.AsyncClient, run_id: str, last: str | None, stop_at: str | None
) -> list[SSE]:
    """The events of ``run_id``'s stream after ``last`` until one of type ``stop_at``
    (then the stream is left) or its end."""
    seen: list[SSE] = []
    headers = {"Last-Event-ID": last} if last else None
    events = sse_events(http, f"/runs/{run_id}/events", headers)
    async with contextlib.aclosing(events):
        async for event in events:
            seen.append(event)
            if event.type == stop_at:
                break
    return seen


def numbers(events: list[SSE]) -> list[int]:
    return [int(event.id) for event in events]


async def test_a_follower_is_carried_to_the_recovered_run_exactly_once(
    tmp_path: Path, model: LoopbackServer, held: Path
) -> None:
    store = tmp_path / "sessions.db"
    common = ("--store", str(store), *TOOLS)
    async with (aimu_serve(model, tmp_path, *common, name="dies") as dies,
                httpx.AsyncClient(base_url=dies.url, timeout=30) as http):
        run_id = await start(http, "s", "hold q")
        before = await follow_until(http, run_id, None, "tool_call")
        dies.process.kill()  # the follower saw the call start: the tool waits on
        await dies.process.wait()
    assert numbers(before) == list(range(1, len(before) + 1))
    last = before[-1].id
    (record,) = await runs_of(store, "s")
    assert (record.id, record.status) == (run_id, "running")

    # A GET only reads: a server without --recover shows the run, starts nothing.
    async with (aimu_serve(model, tmp_path, *common, name="reads") as reads,
                httpx.AsyncClient(base_url=reads.url, timeout=30) as http):
        shown = (await http.get(f"/runs/{run_id}")).json()
        assert (shown["run_id"], shown["status"]) == (run_id, "running")
        answer = await http.get(f"/runs/{run_id}/events", headers={"Last-Event-ID": last})
        assert answer.status_code == 404 and "no server has gone on" in answer.text
        refused = await http.post(f"/runs/{run_id}/cancel", json={})
        assert refused.status_code == 409 and "not run by this server" in refused.text
        assert [r.status for r in await runs_of(store, "s")] == ["running"]
    assert (held / "entries-q").read_text() == "entered\n"  # ran in the dead server only

    async with (aimu_serve(model, tmp_path, *common, "--recover", "--recover-every", "0.1",
                           name="recovers") as recovers,
                httpx.AsyncClient(base_url=recovers.url, timeout=30) as http):
        await recovered(tmp_path, model, store, "s", run_id)
        after = await follow_until(http, run_id, last, "tool_call")
        bridge = after[0]
        assert bridge.type == "run_continued" and int(bridge.id) == GENERATION
        continued = bridge.data["continued_as"]
        assert (bridge.data["run_id"], continued != run_id) == (run_id, True)
        await until("held runs again", lambda: (held / "entries-q").read_text().count(
            "entered") == 2)
        (held / "open").touch()
        # Reconnect again from the last id seen: the rest, once.
        rest = await follow_until(http, run_id, after[-1].id, None)
        records: list[RunRecord] = await runs_of(store, "s")
        whole = await follow_until(http, continued, None, None)  # its own stream, from 1
        # A reconnect with the final id: nothing more.
        assert await follow_until(http, run_id, whole and f"{GENERATION + int(whole[-1].id)}",
                                  None) == []

    # The continuing run's events, each exactly once, in order, ids increasing.
    got = after[1:] + rest
    assert [(e.type, e.data) for e in got] == [(e.type, e.data) for e in whole]
    assert numbers(got) == [GENERATION + n for n in numbers(whole)]
    ids = numbers(before) + numbers(after) + numbers(rest)
    assert ids == sorted(set(ids))
    assert [e.type for e in got].count("handle_finished") == 1
    assert got[-1].type == "handle_finished" and got[-1].data["status"] == "completed"
    assert [e.type for e in before + after + rest].count("run_continued") == 1
    # The store: the dead run left failed, continued once by the recovered run.
    assert [r.id for r in records] == [continued, run_id]
    assert records[0].status == "completed"
    assert resumed_here(records[1].status, records[1].reason)


async def recovered(
    tmp_path: Path, model: LoopbackServer, store: Path, session: str, run_id: str
) -> list[RunRecord]:
    """Until a recovering server went on with the session's run ``run_id`` (its record
    left failed-and-resumed, the continuing run recorded): the records then."""
    async def went_on() -> list[RunRecord] | None:
        records = await runs_of(store, session)
        ended = [r for r in records if r.id == run_id and resumed_here(r.status, r.reason)]
        return records if ended and records[0].id != run_id else None

    await until("a recovering server goes on with the run", went_on)
    return await runs_of(store, session)


def options(store: Path, shared: str, request: pytest.FixtureRequest) -> tuple[str, ...]:
    """The servers' options: the store, the held tool and, for ``shared`` "redis", a
    Redis prefix of the test's own (the restarted server goes on with the run once Redis
    finds it lost)."""
    common = ("--store", str(store), *TOOLS)
    if shared == "redis":
        common += ("--redis", request.getfixturevalue("redis_url"),
                   "--redis-prefix", f"aimu_test_follow_{secrets.token_hex(4)}")
    return common


@pytest.mark.parametrize("shared", ["local", "redis"])
async def test_an_ai_sdk_reconnect_is_carried_to_the_recovered_run(
    tmp_path: Path, model: LoopbackServer, held: Path, shared: str,
    request: pytest.FixtureRequest,
) -> None:
    """The AI SDK's own client (``reconnectToStream``, a GET) after a kill -9 and
    ``--recover``: the run that continues the chat's run, from its start, every chunk once
    (the tool's part and the answer once), and no GET revived anything."""
    from tests.serve.test_ai_sdk import CLIENT, chat_body, chunks, user

    store = tmp_path / "sessions.db"
    common = options(store, shared, request)
    async with (aimu_serve(model, tmp_path, *common, name="dies") as dies,
                httpx.AsyncClient(base_url=dies.url, timeout=30) as http):
        body = chat_body("chat", user("hold q"), resumable=True)
        first = await chunks(http, "POST", "/api/chat", body, until="tool-input-available")
        dies.process.kill()
        await dies.process.wait()
    (dead,) = await runs_of(store, "chat")
    async with (aimu_serve(model, tmp_path, *common, "--recover", "--recover-every", "0.1",
                           name="recovers") as recovers):
        records = await recovered(tmp_path, model, store, "chat", dead.id)
        served = Served(recovers.url, None, model, store)  # type: ignore[arg-type]
        lines = await node_client(CLIENT, served, "reconnect", "chat",
                                  on_first_chunk=(held / "open").touch)
    end = lines[-1]["end"]
    assert end["error"] is None, end
    parts = end["message"]["parts"]
    tools = [p for p in parts if p["type"] == "dynamic-tool"]
    (output,) = [p["output"] for p in tools]  # an idempotent call in doubt, run again
    assert output.startswith("[in doubt") and output.endswith("\nheld q")
    assert [(p["toolCallId"], p["state"]) for p in tools] == [
        (first[-1]["toolCallId"], "output-available")]
    assert [p["text"] for p in parts if p["type"] == "text"] == [f"done: {output}"]
    assert end["message"]["metadata"]["aimuRunId"] == records[0].id
    assert [r.id for r in await runs_of(store, "chat")] == [records[0].id, dead.id]
    assert (held / "entries-q").read_text() == "entered\nentered\n"  # once a life


@pytest.mark.parametrize("shared", ["local", "redis"])
async def test_an_ag_ui_page_that_comes_back_is_carried_to_the_recovered_run(
    tmp_path: Path, model: LoopbackServer, held: Path, shared: str,
    request: pytest.FixtureRequest,
) -> None:
    """AG-UI has no GET: a page that comes back POSTs its thread (no new message) under
    the request guard. After a kill -9 and ``--recover``: a MESSAGES_SNAPSHOT of what the
    dead run stored, then the continuing run's events; the call asked again in the
    continuing run is in the snapshot, so it is not started twice, and its result and the
    answer come once."""
    from tests.serve.test_ag_ui import _stream, ag_ui_events, run_input, user

    store = tmp_path / "sessions.db"
    common = options(store, shared, request)
    async with (aimu_serve(model, tmp_path, *common, name="dies") as dies,
                httpx.AsyncClient(base_url=dies.url, timeout=30) as http):
        first = await ag_ui_events(http, run_input("page", "r1", user("hold q")),
                                   until="TOOL_CALL_END")
        dies.process.kill()
        await dies.process.wait()
    (dead,) = await runs_of(store, "page")
    call_id = first[-1]["toolCallId"]
    async with (aimu_serve(model, tmp_path, *common, "--recover", "--recover-every", "0.1",
                           name="recovers") as recovers,
                httpx.AsyncClient(base_url=recovers.url, timeout=30) as http):
        records = await recovered(tmp_path, model, store, "page", dead.id)
        page = [user("hold q"), {"id": "a1", "role": "assistant", "content": "calling ",
                                 "toolCalls": [{"id": call_id, "type": "function", "function": {
                                     "name": "held", "arguments": '{"query": "q"}'}}]}]
        back = []
        async for event in _stream(http, run_input("page", "r2", *page)):
            back.append(event)
            if event["type"] == "MESSAGES_SNAPSHOT":
                # The held call goes on only once the page has its snapshot: the
                # recovered run cannot have finished before the page came back.
                (held / "open").touch()
        stored = (await http.get("/sessions/page")).json()["messages"]
    kinds = [e["type"] for e in back]
    assert kinds[:2] == ["RUN_STARTED", "MESSAGES_SNAPSHOT"] and kinds[-1] == "RUN_FINISHED"
    snapshot = back[1]["messages"]
    assert [m["role"] for m in snapshot] == ["user", "assistant"]
    assert [c["id"] for c in snapshot[1]["toolCalls"]] == [call_id]
    assert kinds.count("TOOL_CALL_START") == 0
    (result,) = [e for e in back if e["type"] == "TOOL_CALL_RESULT"]
    assert result["toolCallId"] == call_id and result["content"].endswith("\nheld q")
    text = "".join(e["delta"] for e in back if e["type"] == "TEXT_MESSAGE_CONTENT")
    assert text == f"done: {result['content']}"
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert [r.id for r in await runs_of(store, "page")] == [records[0].id, dead.id]
