"""Messages as stored JSON text: encoding one, parsing many, reporting a torn record."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final, cast

from aimu.aio.errors import StoreFormatError, TranscriptError
from aimu.aio.transcript import Message

__all__ = [
    "decode_state",
    "encode",
    "encode_state",
    "encode_value",
    "first_bad",
    "parse_array",
]

# The compact form of transcript.dumps, built once; NaN is refused, as validate() would
# refuse it on load (a stored NaN would make the session unreadable).
_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def encode(message: Message, session: str, index: int) -> str:
    """``message`` as compact JSON; ``TranscriptError`` naming the session and index."""
    try:
        return _ENCODER.encode(message)
    except (TypeError, ValueError) as error:
        raise TranscriptError(
            f"session {session!r}: message {index} cannot be stored as JSON: {error}", index=index
        ) from error


def parse_array(items: Sequence[str | bytes]) -> list[Any] | None:
    """Parse many JSON texts in one C call; None if any of them is bad."""
    if not items:
        return []
    if isinstance(items[0], bytes):
        text: str | bytes = b"[" + b",".join(cast(Sequence[bytes], items)) + b"]"
    else:
        text = "[" + ",".join(cast(Sequence[str], items)) + "]"
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    # A corrupt record can still join into valid JSON (e.g. '1,2'): check the count.
    if not isinstance(parsed, list) or len(parsed) != len(items):
        return None
    return parsed


def first_bad(items: Sequence[str | bytes]) -> tuple[int, str] | None:
    """The first record that is not one JSON value, and why."""
    for position, item in enumerate(items):
        try:
            json.loads(item)
        except ValueError as error:
            return position, str(error)
    return None


def encode_value(value: Any, what: str, session: str) -> str:
    """Any JSON value as compact text; ``ValueError`` naming ``what`` and the session."""
    try:
        return _ENCODER.encode(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"session {session!r}: {what} cannot be stored as JSON: {error}") from None


def encode_state(state: Mapping[str, Any], session: str) -> str:
    """A session state (a JSON object) as text; ``ValueError`` if it is not one."""
    if not isinstance(state, Mapping):
        raise TypeError(f"session {session!r}: a state is a dict, got {type(state).__name__}")
    return encode_value(dict(state), "the state", session)


def decode_state(text: str | bytes, where: str) -> dict[str, Any]:
    """A stored state; ``StoreFormatError`` naming ``where`` if it is not a JSON object."""
    try:
        state = json.loads(text)
    except ValueError as error:
        raise StoreFormatError(f"{where}: the stored state is corrupt ({error})") from None
    if not isinstance(state, dict):
        raise StoreFormatError(f"{where}: the stored state is not a JSON object")
    return state
