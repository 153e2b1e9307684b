"""Transcript validation, settling of dangling tool calls, copies and the wire view."""

from __future__ import annotations

from typing import Any

import pytest

from aimu.aio.errors import TranscriptError
from aimu.aio.transcript import (
    CANCELLED_RESULT,
    copy_messages,
    dangling_calls,
    settle,
    validate,
    wire_view,
)


def assistant_calling(*ids: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
            for i in ids
        ],
    }


def result(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "content": "2", "tool_call_id": call_id, "name": "add"}


def test_settle_answers_dangling_calls_in_place_and_is_idempotent() -> None:
    messages: list[Any] = [
        {"role": "user", "content": "go"},
        assistant_calling("a", "b"),
        result("a"),
        {"role": "user", "content": "next"},
        assistant_calling("c"),
    ]
    validate(messages)
    assert [call["id"] for _, call in dangling_calls(messages)] == ["b", "c"]
    added = settle(messages)
    assert [m["tool_call_id"] for m in added] == ["b", "c"]
    assert [m["role"] for m in messages] == [
        "user", "assistant", "tool", "tool", "user", "assistant", "tool",
    ]
    assert messages[3]["content"] == CANCELLED_RESULT
    validate(messages)
    assert settle(messages) == []
    assert dangling_calls(messages) == []


def test_error_names_the_index() -> None:
    with pytest.raises(TranscriptError) as caught:
        validate([{"role": "user", "content": "ok"}, {"role": "robot", "content": "x"}])
    assert caught.value.index == 1
    assert str(caught.value).startswith("message 1:")
    assert isinstance(caught.value, ValueError)


def test_non_finite_numbers_are_not_json() -> None:
    bad = assistant_calling("a")
    bad["tool_calls"][0]["function"]["arguments"] = {"x": float("nan")}
    with pytest.raises(TranscriptError, match="non-finite"):
        validate([bad])


def test_copy_shares_nothing() -> None:
    original: list[Any] = [assistant_calling("a")]
    copied = copy_messages(original)
    assert copied == original
    copied[0]["tool_calls"][0]["function"]["arguments"]["a"] = 5
    assert original[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_wire_view_drops_our_markers_only() -> None:
    partial: Any = {"role": "assistant", "content": "half", "aimu_partial": True}
    assert wire_view(partial) == {"role": "assistant", "content": "half"}
    plain: Any = {"role": "user", "content": "x"}
    assert wire_view(plain) is plain
