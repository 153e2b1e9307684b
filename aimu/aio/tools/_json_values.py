"""Python values as JSON: parameter defaults in a schema, and a tool's result as text.

A return value of ``None`` becomes ``"null"``; a ``str`` is sent as is; enums,
dataclasses, sets, dates and pydantic models become their JSON form.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import inspect
import json
from typing import Any

__all__ = ["JSON_ENCODER", "NotText", "to_json", "to_text"]


def to_json(value: object) -> Any:
    """``json.dumps`` fallback for the Python values tools commonly return."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, set | frozenset):
        return list(value)
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    dump = getattr(value, "model_dump", None)  # pydantic models, without depending on pydantic
    if callable(dump):
        return dump(mode="json")
    raise TypeError(type(value).__name__)



class NotText(Exception):
    """A tool's return value cannot be turned into text."""


# Made once: json.dumps with options builds a new encoder on every call.
JSON_ENCODER = json.JSONEncoder(ensure_ascii=False, default=to_json)


def to_text(result: object) -> str:
    """A return value as the model reads it: str as is, None as "null", the rest as JSON."""
    if isinstance(result, str):
        return result
    kind = type(result)
    if result is None:
        return "null"
    if kind is int or kind is bool:
        return JSON_ENCODER.encode(result) if kind is bool else str(result)
    if inspect.iscoroutine(result):
        result.close()  # never awaited: close it so Python does not warn
        raise NotText("a coroutine; declare the tool `async def` so it is awaited")
    try:
        return JSON_ENCODER.encode(result)
    except (TypeError, ValueError) as exc:
        raise NotText(f"a {type(result).__name__} ({exc}); return a str or JSON data") from None

