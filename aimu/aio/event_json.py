"""Events as JSON, and back: the one encoding ``aimu serve`` and Redis control share.

Every event of :mod:`aimu.aio.events` is a frozen dataclass with a ``type`` tag and is
encoded as its fields. A value JSON cannot hold (a typed run's result, say) is encoded
as plain data when it has a way to say it (a pydantic model's ``model_dump``, a
dataclass's fields), else as its ``repr``: a follower reads the same on every server.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Final, get_args

from aimu.aio.events import Event

__all__ = ["decode_event", "encode_event", "event_data", "event_json"]

_CLASSES: Final[dict[str, type[Any]]] = {
    str(cls.__dataclass_fields__["type"].default): cls for cls in get_args(Event)
}


def _plain(value: object) -> object:
    """``value`` as what JSON holds (the ``default`` of json.dumps)."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        try:
            return dump(mode="json")
        except Exception:  # any failure of a user's model: fall back to its repr
            return repr(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return repr(value)


def event_json(event: Event) -> str:
    """The event as compact JSON text, its ``type`` included."""
    data = {field.name: getattr(event, field.name) for field in dataclasses.fields(event)}
    if not data.get("path", True):
        del data["path"]  # a run's own event: as before agents called agents
    try:
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False, default=_plain)
    except (TypeError, ValueError):  # a cycle, or a value whose plain form is not plain
        safe = {k: v if _is_json(v) else repr(v) for k, v in data.items()}
        return json.dumps(safe, separators=(",", ":"), ensure_ascii=False)


def event_data(event: Event) -> dict[str, Any]:
    """The event as a JSON-ready dict (what :func:`event_json` encodes)."""
    data: dict[str, Any] = json.loads(event_json(event))
    return data


def encode_event(event: Event) -> tuple[str, str]:
    """``(type, JSON of the fields)``: a Redis stream entry's fields."""
    return event.type, event_json(event)


def decode_event(kind: str, text: str) -> Event:
    """The event :func:`encode_event` stored; ValueError naming the type if unknown."""
    cls = _CLASSES.get(kind)
    if cls is None:
        raise ValueError(f"unknown event type {kind!r} in a run's event stream")
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"a {kind!r} event's data is not a JSON object")
    data.pop("type", None)
    if "path" in data:
        data["path"] = tuple(data["path"])
    event: Event = cls(**data)
    return event


def _is_json(value: object) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
