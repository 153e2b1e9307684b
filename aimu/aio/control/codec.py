"""Events as JSON for a Redis stream entry, and back.

Every event of :mod:`aimu.aio.events` is a frozen dataclass with a ``type`` tag; it is
stored as its fields in JSON, the tag beside it. A run result that JSON cannot hold
(``HandleFinished.result``) is stored as its ``repr``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from aimu.aio import events
from aimu.aio.events import Event

__all__ = ["decode_event", "encode_event", "event_data"]

_CLASSES: dict[str, type[Any]] = {
    str(cls.__dataclass_fields__["type"].default): cls
    for cls in (
        events.RunStarted,
        events.TextChunk,
        events.ThinkingChunk,
        events.ToolCallStarted,
        events.ToolResult,
        events.StepFinished,
        events.RunFinished,
        events.HandleFinished,
    )
}


def event_data(event: Event) -> dict[str, Any]:
    """The event's fields as a JSON-ready dict, ``type`` included."""
    return {field.name: getattr(event, field.name) for field in dataclasses.fields(event)}


def encode_event(event: Event) -> tuple[str, str]:
    """``(type, JSON of the fields)``."""
    data = event_data(event)
    try:
        text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        data = {k: (v if _plain(v) else repr(v)) for k, v in data.items()}
        text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, default=repr)
    return event.type, text


def _plain(value: object) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def decode_event(kind: str, text: str) -> Event:
    """The event stored by :func:`encode_event`; ValueError naming the type if unknown."""
    cls = _CLASSES.get(kind)
    if cls is None:
        raise ValueError(f"unknown event type {kind!r} in a run's event stream")
    data = json.loads(text)
    data.pop("type", None)
    event: Event = cls(**data)
    return event
