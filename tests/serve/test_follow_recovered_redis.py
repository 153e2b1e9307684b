"""A follower of a run shared through Redis (``aimu serve --redis``) whose server was
killed (kill -9) is carried to the run another replica goes on with (``--recover``):
the dead run's events, a ``run_continued`` event (id ``1:0-0``), then the continuing
run's events under ids ``1:MS-SEQ``, each exactly once, whether it stayed connected to
the other replica or reconnects to it with its last id (issue 44 item 7).

Two ``aimu serve --redis`` processes share one store and one Redis prefix; the run calls
``held`` (an idempotent tool that waits for the file ``open``): both followers see its
``tool_call`` (the provable point), the server running it is killed; the other, with
``--recover``, resumes the session once Redis says the run is lost (``held`` runs
again and waits), and both followers get the bridge and the continuing run's events.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from pathlib import Path

import httpx
import pytest

from aimu.serve.errors import BadRequest
from aimu.serve.ids import chained_stream_id
from aimu.serve.recovery import resumed_here
from aimu.testing.server import LoopbackServer
from tests.serve.harness import SSE, aimu_serve, sse_events, start
from tests.serve.test_drain_recover import runs_of, until
from tests.serve.test_follow_recovered import TOOLS, follow_until, held, model, recovered

__all__ = ["held", "model"]  # the fixtures, shared with the local backend's tests

#: Ids no stream sends, each a 400 (ASCII: they travel in a header too).
BAD_IDS = (
    "0:1-0", "01:1-0", ":1-0", "1:", "1:1-0-0", "1:x-0", "1000000000:1-0", "-1:1-0",
    "1;1-0", "12", "1.5", "1:18446744073709551616-0", "1:1-", "a:1-0",
)


def test_chained_ids_parse_by_one_rule() -> None:
    assert chained_stream_id(None) == chained_stream_id("") == (0, None)
    assert chained_stream_id("1712345678901-3") == (0, "1712345678901-3")
    assert chained_stream_id("1:0-0") == (1, "0-0")
    assert chained_stream_id("999999999:5-1") == (999_999_999, "5-1")
    for bad in (*BAD_IDS, "²:1-0", "1:²-0"):
        with pytest.raises(BadRequest, match="is not an event id of this run"):
            chained_stream_id(bad)


def order(event_id: str) -> tuple[int, int, int]:
    """Where an event id stands in a chain: (run of the chain, Redis ms, seq)."""
    generation, _, stream = event_id.rpartition(":")
    ms, _, seq = stream.partition("-")
    return int(generation or 0), int(ms), int(seq)


async def stay(http: httpx.AsyncClient, run_id: str, seen: list[SSE]) -> None:
    """Follow ``run_id`` from its start to its stream's end, adding each event to ``seen``."""
    events = sse_events(http, f"/runs/{run_id}/events")
    async with contextlib.aclosing(events):
        async for event in events:
            seen.append(event)


@pytest.mark.slow
async def test_a_redis_follower_is_carried_to_the_run_another_replica_goes_on_with(
    tmp_path: Path, model: LoopbackServer, held: Path, redis_url: str
) -> None:
    store = tmp_path / "sessions.db"
    common = ("--store", str(store), "--redis", redis_url,
              "--redis-prefix", f"aimu_test_follow_{secrets.token_hex(4)}", *TOOLS)
    async with (aimu_serve(model, tmp_path, *common, name="dies") as dies,
                aimu_serve(model, tmp_path, *common, "--recover", "--recover-every", "0.1",
                           name="goes_on") as goes_on,
                httpx.AsyncClient(base_url=dies.url, timeout=30) as on_dies,
                httpx.AsyncClient(base_url=goes_on.url, timeout=60) as http):
        run_id = await start(on_dies, "s", "hold q")
        stayed: list[SSE] = []  # a follower on the replica that lives, never reconnecting
        staying = asyncio.ensure_future(stay(http, run_id, stayed))
        before = await follow_until(on_dies, run_id, None, "tool_call")
        await until("the other replica's follower saw the call",
                    lambda: any(e.type == "tool_call" for e in stayed))
        dies.process.kill()  # both followers saw the call start: the tool waits on
        await dies.process.wait()
        last = before[-1].id

        records = await recovered(tmp_path, model, store, "s", run_id)
        continued = records[0].id
        # The reconnect, to the replica that went on: the dead run's events it had not
        # seen (those sent before the kill), the bridge, the continuing run.
        after = await follow_until(http, run_id, last, "tool_call")
        (bridge,) = [e for e in after if e.type == "run_continued"]
        assert bridge.id == "1:0-0"
        assert (bridge.data["run_id"], bridge.data["continued_as"]) == (run_id, continued)
        assert resumed_here("failed", bridge.data["reason"])
        await until("held runs again", lambda: (held / "entries-q").read_text().count(
            "entered") == 2)
        (held / "open").touch()
        rest = await follow_until(http, run_id, after[-1].id, None)  # the rest, once
        await asyncio.wait_for(staying, 60)
        whole = await follow_until(http, continued, None, None)  # its own stream
        from_start = await follow_until(http, run_id, None, None)  # the chain, from 1
        assert await follow_until(http, run_id, rest[-1].id, None) == []  # nothing more
        await bad_ids_change_nothing(http, store, run_id, continued)

    def shown(events: list[SSE]) -> list[tuple[str, str, object]]:
        return [(e.id, e.type, e.data) for e in events]

    # Every event once, in order, whether the follower stayed or reconnected.
    reconnected = before + after + rest
    assert shown(reconnected) == shown(stayed) == shown(from_start)
    ids = [order(e.id) for e in stayed]
    assert ids == sorted(set(ids))
    cut = stayed.index(bridge)
    assert all(":" not in e.id for e in stayed[:cut])  # the dead run's own ids
    assert shown(stayed[cut + 1:]) == [(f"1:{e.id}", e.type, e.data) for e in whole]
    assert [e.type for e in stayed].count("run_continued") == 1
    assert [e.type for e in stayed].count("handle_finished") == 1
    assert stayed[-1].type == "handle_finished" and stayed[-1].data["status"] == "completed"
    assert (held / "entries-q").read_text() == "entered\nentered\n"  # once a life
    latest, dead = await runs_of(store, "s")
    assert (latest.id, latest.status, dead.id) == (continued, "completed", run_id)
    assert resumed_here(dead.status, dead.reason)


async def bad_ids_change_nothing(
    http: httpx.AsyncClient, store: Path, run_id: str, continued: str
) -> None:
    """Malformed ids, and ids the chain never sent (a link more than it has, past the end
    of a stream that grows no more), answer 400 and change nothing."""
    runs = {r: (await http.get(f"/runs/{r}")).json() for r in (run_id, continued)}
    records = await runs_of(store, "s")
    never_sent = ("2:0-0", "1:99999999999999-0", "99999999999999-0")
    for bad in (*BAD_IDS, *never_sent):
        for asked in ({"headers": {"Last-Event-ID": bad}}, {"params": {"after": bad}}):
            answer = await http.get(f"/runs/{run_id}/events", **asked)  # type: ignore[arg-type]
            assert answer.status_code == 400, (bad, answer.text)
            assert "Last-Event-ID" in answer.json()["error"]
    assert {r: (await http.get(f"/runs/{r}")).json() for r in runs} == runs
    assert await runs_of(store, "s") == records
