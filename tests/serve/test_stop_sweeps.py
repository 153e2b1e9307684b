"""Stops landing in the work a decision, a send or a resume started over HTTP.

Each case starts the work, waits for a provable point (the decision or resume was
accepted, a gated tool was entered, the model server recorded the request of a long
reply) and sends cancel, interrupt or stop?grace=0 there. Every case then checks the
run's status, one terminal event ending its stream, a valid transcript that resumes to
completion, nothing left behind (no run in progress, no model stream still open), and a
follow-up run on the session accepted at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from aimu.aio.transcript import validate
from aimu.testing.server import LoopbackServer
from tests.serve.harness import (
    GATE,
    Served,
    collect,
    make_app,
    start,
    store_of,
    uvicorn_serving,
)

pytestmark = pytest.mark.slow

ACTIONS = ["cancel", "interrupt", "stop?grace=0"]
ALLOWED = {
    "cancel": {"cancelled"},
    "interrupt": {"interrupted"},
    "stop?grace=0": {"cancelled", "interrupted"},
}
#: An interrupt lets the model turn in flight finish: during the final answer, the run
#: completes with it.
AT_THE_ANSWER = {**ALLOWED, "interrupt": {"completed"}}


def cases(points: list[str]) -> list[tuple[str, str, str]]:
    """(point, action, store): every action on SQLite; a cancel on PostgreSQL too, whose
    writes are awaited (shielded), so the cancel meets them in flight."""
    return [(p, a, "sqlite") for p in points for a in ACTIONS] + [
        (p, "cancel", "postgres") for p in points
    ]


@pytest.fixture
async def served(
    model_server: LoopbackServer, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Served]:
    """The app on the store the case names (``store`` parameter; SQLite by default)."""
    callspec = getattr(request.node, "callspec", None)
    kind = "sqlite" if callspec is None else callspec.params.get("store", "sqlite")
    async with store_of(kind, tmp_path) as store:
        application = make_app(model_server, store)
        with uvicorn_serving(application) as url:
            yield Served(url, application, model_server, store)


def words(action: str) -> int:
    """The long reply's length: an interrupt lets it finish, so keep that one shorter."""
    return 100 if action == "interrupt" else 400


async def reach(served: Served, point: str, *, tool_calls: int, requests: int) -> None:
    """Wait for ``point``: ``accepted`` (now), ``tool`` (the ``tool_calls``-th gated call
    entered) or ``model`` (the gate open, the model server read request ``requests``)."""
    if point == "tool":
        await GATE.entered(tool_calls)
    elif point == "model":
        GATE.open()
        await served.model.wait_requests(requests, timeout=30)


async def paused_run(http: httpx.AsyncClient, session: str, task: str) -> str:
    run_id = await start(http, session, task)
    assert (await collect(http, run_id))[-1].data["status"] == "paused"
    pending = (await http.get(f"/runs/{run_id}")).json()["pending"]
    decided = await http.post(
        f"/runs/{run_id}/approvals/{pending[0]['call_id']}", json={"approve": True}
    )
    assert decided.status_code == 202, decided.text
    return str(decided.json()["resumed_run_id"])


@pytest.mark.parametrize(("point", "action", "store"), cases(["accepted", "tool", "model"]))
async def test_a_stop_in_a_run_a_decision_resumed(
    http: httpx.AsyncClient, served: Served, point: str, action: str, store: str
) -> None:
    GATE.reset()
    session = f"decided-{point}-{action[:4]}"
    streams = len(served.model.streams)
    requests = len(served.model.requests)
    run_id = await paused_run(http, session, f"wire {words(action)}")
    await reach(served, point, tool_calls=1, requests=requests + 2)  # pausing turn, reply
    await stop_and_check(http, served, Case(session, run_id, action, point, streams))


@pytest.mark.parametrize(("point", "action", "store"), cases(["tool", "model"]))
async def test_a_stop_in_the_work_a_send_started(
    http: httpx.AsyncClient, served: Served, point: str, action: str, store: str
) -> None:
    GATE.reset()
    session = f"sent-{point}-{action[:4]}"
    streams = len(served.model.streams)
    run_id = await start(http, session, "gate 1 3")
    await GATE.entered(1)  # the run is provably alive: the send joins it
    requests = len(served.model.requests)
    text = f"gate {1 if point == 'tool' else 0} {words(action)}"
    sent = await http.post(f"/runs/{run_id}/send", json={"text": text})
    assert sent.status_code == 202, sent.text
    GATE.release()  # the held call returns; at the step boundary the text joins
    await reach(served, point, tool_calls=2, requests=requests + 1)  # the sent text's turn
    await stop_and_check(http, served, Case(session, run_id, action, point, streams))
    user = [m["content"] for m in await transcript(http, session) if m["role"] == "user"]
    assert user == ["gate 1 3", text, "short 2"]  # the sent text joined once


@pytest.mark.parametrize(("point", "action", "store"), cases(["accepted", "tool", "model"]))
async def test_a_stop_in_a_run_a_resume_started(
    http: httpx.AsyncClient, served: Served, point: str, action: str, store: str
) -> None:
    GATE.reset()
    session = f"resumed-{point}-{action[:4]}"
    streams = len(served.model.streams)
    first = await start(http, session, f"gate 2 {words(action)}")
    await GATE.entered(1)
    assert (await http.post(f"/runs/{first}/interrupt")).status_code == 202
    GATE.release()
    assert (await collect(http, first))[-1].data["status"] == "interrupted"
    requests = len(served.model.requests)
    resumed = await http.post(f"/sessions/{session}/resume")
    assert resumed.status_code == 202, resumed.text
    run_id = resumed.json()["run_id"]
    await reach(served, point, tool_calls=2, requests=requests + 2)  # second call, reply
    await stop_and_check(http, served, Case(session, run_id, action, point, streams))


@dataclass
class Case:
    session: str
    run_id: str
    action: str
    point: str
    streams: int
    """The model streams before the case began."""


async def stop_and_check(http: httpx.AsyncClient, served: Served, case: Case) -> None:
    """Stop the run with the case's action and check everything the module promises."""
    session, run_id, action = case.session, case.run_id, case.action
    response = await http.post(f"/runs/{run_id}/{action}")
    assert response.status_code == 202, response.text
    GATE.open()  # an interrupt lets the tool round in flight finish
    events = await collect(http, run_id)
    GATE.hurry = True
    assert [e.type for e in events].count("handle_finished") == 1
    assert events[-1].type == "handle_finished"
    status = events[-1].data["status"]
    assert status in (AT_THE_ANSWER if case.point == "model" else ALLOWED)[action], status
    assert (await http.get(f"/runs/{run_id}")).json()["status"] == status
    assert await served.app.runs.session_run(session) is None
    model = served.model
    await model.wait_until(
        lambda: all(s.completed or s.abandoned for s in model.streams[case.streams:]),
        30,
        lambda: "a model stream of the stopped run is still open",
    )
    if case.point == "model" and status == "cancelled":  # cut off mid-reply
        assert model.streams[-1].abandoned
    await transcript(http, session)
    resumed = await http.post(f"/sessions/{session}/resume")
    if status == "completed":  # the stop came too late: nothing to resume
        assert resumed.status_code == 409, resumed.text
    else:
        assert resumed.status_code == 202, resumed.text
        assert (await collect(http, resumed.json()["run_id"]))[-1].data["status"] == "completed"
    await transcript(http, session)
    follow_up = await start(http, session, "short 2")
    assert (await collect(http, follow_up))[-1].data["status"] == "completed"
    # The stop's background task (stop?grace) ended with the stopped run, long before.
    assert not served.app.runs.backend._launcher._background  # type: ignore[attr-defined]


async def transcript(http: httpx.AsyncClient, session: str) -> list[dict[str, object]]:
    messages: list[dict[str, object]] = (await http.get(f"/sessions/{session}")).json()[
        "messages"
    ]
    validate(messages)  # type: ignore[arg-type]
    return messages


async def test_a_stop_sent_to_a_run_waiting_for_approval_changes_nothing(
    http: httpx.AsyncClient, served: Served
) -> None:
    GATE.reset()
    GATE.open()
    run_id = await start(http, "waiting", "wire 3")
    assert (await collect(http, run_id))[-1].data["status"] == "paused"
    for action in ACTIONS:
        response = await http.post(f"/runs/{run_id}/{action}")
        assert response.status_code == 409 and "already ended" in response.json()["error"]
    pending = (await http.get(f"/runs/{run_id}")).json()["pending"]
    assert len(pending) == 1  # the call still waits; deciding it resumes the run
    decided = await http.post(
        f"/runs/{run_id}/approvals/{pending[0]['call_id']}", json={"approve": True}
    )
    assert decided.status_code == 202, decided.text
    resumed = decided.json()["resumed_run_id"]
    assert (await collect(http, resumed))[-1].data["status"] == "completed"
    await transcript(http, "waiting")
