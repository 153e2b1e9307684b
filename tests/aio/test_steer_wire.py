"""A Steer checks itself and travels as itself: one JSON form, read back unchanged, and
read from every older form a queued message or a run's history may still hold."""

from __future__ import annotations

import math
from typing import Any

import pytest

from aimu.aio import status
from aimu.aio._ids import is_run_id
from aimu.aio._numbers import finite
from aimu.aio.steering import Steer
from aimu.temporal._workflow import Control

URL = "data:image/png;base64,iVBORw0KGgo="
EVERY = [
    Steer("cancel"), Steer("cancel", reason="the user left"), Steer("interrupt"),
    Steer("stop"), Steer("stop", grace=0), Steer("stop", grace=2.5),
    Steer("send", text="look"), Steer("send", text="look", images=(URL,), input_id="k-1"),
]


@pytest.mark.parametrize("request_", EVERY, ids=repr)
def test_a_steer_reads_back_unchanged(request_: Steer) -> None:
    assert Steer.from_json(request_.to_json()) == request_
    assert Control.of(7, request_).steer() == request_


@pytest.mark.parametrize("grace", [-1, math.nan, math.inf, 10**400, "5", None, True])
def test_a_stop_checks_its_grace_when_made(grace: Any) -> None:
    with pytest.raises(ValueError, match="give a finite number of seconds, 0 or more"):
        Steer("stop", grace=grace)
    with pytest.raises(ValueError, match="grace"):
        Steer.from_json({"kind": "stop", "grace": grace if grace is not None else -1})


def test_a_steer_checks_itself_when_made() -> None:
    with pytest.raises(ValueError, match="unknown request 'pause'"):
        Steer("pause")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown request"):
        Steer.from_json({"kind": "pause"})  # a newer aimu's: the reader drops it
    with pytest.raises(TypeError, match="reason"):
        Steer("cancel", reason=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="text"):
        Steer("send", text=b"hi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="input_id"):
        Steer("send", text="hi", input_id="../x")
    with pytest.raises(TypeError, match="data: URLs"):
        Steer.from_json({"kind": "send", "text": "hi", "images": "data:x"})
    with pytest.raises(ValueError, match="image 0"):
        Steer("send", text="hi", images=("/etc/passwd",)).check()  # never read here


def _before(kind: str, data: dict[str, Any]) -> Steer | None:
    """How a Redis worker of the aimu before this one read a request (worker._steer)."""
    if kind == "cancel":
        reason = data.get("reason")
        return Steer("cancel", reason=reason if isinstance(reason, str) else None)
    if kind == "interrupt":
        return Steer("interrupt")
    if kind == "stop":
        grace = data.get("grace")
        return Steer("stop", grace=float(grace) if finite(grace) and grace >= 0 else 5.0)
    if kind == "send":
        text, images = data.get("content", data.get("text")), data.get("images", [])
        kept = data.get("aimu_sent")
        if isinstance(text, str) and isinstance(images, list):
            return Steer("send", text=text, images=tuple(images),
                         input_id=kept if is_run_id(kept) else None)
    return None


@pytest.mark.parametrize("request_", EVERY, ids=repr)
def test_an_older_redis_worker_reads_what_this_one_writes(request_: Steer) -> None:
    data = request_.to_json()
    assert _before(data.pop("kind"), data) == request_


@pytest.mark.parametrize(("kind", "data", "expected"), [
    ("cancel", {"reason": None}, Steer("cancel")),
    ("cancel", {"reason": "bye"}, Steer("cancel", reason="bye")),
    ("interrupt", {}, Steer("interrupt")),
    ("stop", {"grace": 5.0}, Steer("stop")),
    ("stop", {"grace": 0}, Steer("stop", grace=0)),
    # a send as the user message it adds, with "aimu_sent": true when no id was kept
    ("send", {"role": "user", "content": "hi", "aimu_sent": True}, Steer("send", text="hi")),
    ("send", {"role": "user", "content": "hi", "images": [URL], "aimu_sent": "k-2"},
     Steer("send", text="hi", images=(URL,), input_id="k-2")),
    ("send", {"text": "hi"}, Steer("send", text="hi")),  # before images could be sent
])
def test_a_request_an_older_aimu_queued_in_redis_is_read(
    kind: str, data: dict[str, Any], expected: Steer
) -> None:
    assert Steer.from_json({**data, "kind": kind}) == expected


@pytest.mark.parametrize(("control", "expected"), [
    (Control(0, "cancel", "the caller's reason"), Steer("cancel", reason="the caller's reason")),
    (Control(3, "interrupt"), Steer("interrupt")),
    (Control(4, "stop", None, 1.5), Steer("stop", grace=1.5)),
    (Control(5, "send", "hi", None, [URL]), Steer("send", text="hi", images=(URL,))),
])
def test_a_control_an_older_aimu_recorded_in_a_history_is_read(
    control: Control, expected: Steer
) -> None:
    assert control.steer() == expected


def test_an_older_temporal_turn_reads_what_this_workflow_records() -> None:
    """The turn before this aimu read a control's text (a cancel's reason, a send's
    text), grace (``or 0.0``) and images."""
    stop = Control.of(1, Steer("stop"))
    assert (stop.kind, stop.grace) == ("stop", 5.0)
    cancel = Control.of(0, Steer("cancel", reason="bye"))
    assert (cancel.kind, cancel.text) == ("cancel", "bye")
    send = Control.of(2, Steer("send", text="hi", images=(URL,)))
    assert (send.kind, send.text, send.images) == ("send", "hi", [URL])


def test_final_means_one_thing() -> None:
    """A run is over (FINAL) in every outcome but paused; the part a handle held has
    ended (ENDED) in every outcome. Redis' "final" held paused before, ends' did not."""
    assert "paused" not in status.FINAL
    assert status.ENDED == status.FINAL | {"paused"} == status.RUN_STATUSES
    assert status.LIVE.isdisjoint(status.ENDED)
    assert status.LIVE | status.RUN_STATUSES - {"max_rounds"} == status.HANDLE_STATUSES
    assert status.words(status.HandleStatus)[:3] == ("pending", "running", "completed")
    for grouping in (status.ANSWERED, status.STOPPED, status.HALTED, status.BLOCKED,
                     status.RECOVERABLE, status.BY_CANCEL, status.NAMED_HALTS):
        assert grouping <= status.RUN_STATUSES
    assert status.ANSWERED | status.STOPPED | status.HALTED | status.BLOCKED == (
        status.RUN_STATUSES
    )
