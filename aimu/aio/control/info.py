"""A run as Redis holds it: :class:`RunInfo` (the live view of a run, whatever process
holds it) and :class:`RunEvent` (one of its events as a follower reads it), read from
the run's hash with care: a field that is not what aimu writes reads as unknown."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from aimu.aio.events import Event
from aimu.aio.status import CONTROL_STATUSES, ENDED, ControlStatus

__all__ = ["RunEvent", "RunInfo", "control_status", "run_info"]


@dataclass(frozen=True, slots=True)
class RunInfo:
    """A run as Redis knows it: the live view of a run, whatever process holds it (see
    :mod:`aimu.aio.status`). ``lost``: registered, but its worker's lease expired."""

    run_id: str
    status: ControlStatus
    name: str | None
    worker: str | None
    """The worker that holds (or last held) the run."""
    attempt: int
    """1 for the first start, 2 after one claim and resume, and so on (0: reserved)."""
    reason: str | None
    error: str | None
    created_at: float | None
    started_at: float | None
    ended_at: float | None
    events: int
    """Events published so far."""
    info: dict[str, str] = field(default_factory=dict)
    """What the worker attached with ``control.with_info(...)``, e.g. the session."""
    result: object = None
    """What the run returned, as JSON data, once it ended (None before)."""
    usage: dict[str, int] | None = None
    """The tokens its model calls used, once it ended (None if it reported none)."""

    @property
    def done(self) -> bool:
        """True once the run ended, whatever ended it (a lost run is not done)."""
        return self.status in ENDED


@dataclass(frozen=True, slots=True)
class RunEvent:
    """One event of a run as a follower sees it: ``id`` resumes following after it."""

    id: str
    seq: int
    """1 for the run's first event, counting on across a claim and resume."""
    event: Event
    data: str
    """The event as JSON (what ``id`` names), ready to forward."""


def run_info(run_id: str, fields: dict[str, str], leased: bool) -> RunInfo:
    """A run's hash as a RunInfo; a field that is not what aimu writes reads as unknown
    (None, 0, {}), so one damaged record never breaks a listing."""
    return RunInfo(
        run_id=run_id,
        status=control_status(fields.get("status", "pending"), leased),
        name=fields.get("name") or None,
        worker=fields.get("worker") or None,
        attempt=_int(fields.get("attempt")),
        reason=fields.get("reason") or None,
        error=fields.get("error") or None,
        created_at=_float(fields.get("created_at")),
        started_at=_float(fields.get("started_at")),
        ended_at=_float(fields.get("ended_at")),
        events=_int(fields.get("seq")),
        info={str(k): str(v) for k, v in _json(fields.get("info"), dict, {}).items()},
        result=_json(fields.get("result"), object, None),
        usage=_json(fields.get("usage"), dict, None),
    )


def control_status(status: str, leased: bool) -> ControlStatus:
    """A run's status field as a status (``lost``: running without its lease)."""
    if status not in CONTROL_STATUSES:
        return "failed"
    if status == "running" and not leased:
        return "lost"
    return status


def _json(text: str | None, kind: type[Any], default: Any) -> Any:
    if not text:
        return default
    try:
        value = json.loads(text)
    except ValueError:
        return default
    return value if isinstance(value, kind) else default


def _float(text: str | None) -> float | None:
    try:
        value = float(text) if text else None
    except ValueError:
        return None
    return value if value is None or math.isfinite(value) else None


def _int(text: str | None) -> int:
    try:
        return int(text) if text else 0
    except ValueError:
        return 0
