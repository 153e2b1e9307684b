"""Transcript validation, settling of dangling tool calls, copies and the wire view."""

from __future__ import annotations

import re
from typing import Any

import pytest

from aimu.aio.errors import TranscriptError
from aimu.aio.transcript import (
    CANCELLED_RESULT,
    answer_open_calls,
    copy_messages,
    dangling_calls,
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


def test_answer_open_calls_answers_dangling_calls_in_place_and_is_idempotent() -> None:
    messages: list[Any] = [
        {"role": "user", "content": "go"},
        assistant_calling("a", "b"),
        result("a"),
        {"role": "user", "content": "next"},
        assistant_calling("c"),
    ]
    validate(messages)
    assert [call["id"] for _, call in dangling_calls(messages)] == ["b", "c"]
    added = answer_open_calls(messages)
    assert [m["tool_call_id"] for m in added] == ["b", "c"]
    assert [m["role"] for m in messages] == [
        "user", "assistant", "tool", "tool", "user", "assistant", "tool",
    ]
    assert messages[3]["content"] == CANCELLED_RESULT
    validate(messages)
    assert answer_open_calls(messages) == []
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


# -- hardening: everything validated before anything changes, bounded echoes ----------


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"v": value}
    return value


def calling(arguments: Any, call_id: str = "c1", name: str = "f") -> list[Any]:
    return [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        ]},
    ]


@pytest.mark.parametrize(
    ("messages", "where"),
    [
        ([{"role": "user", "content": "bad \ud800"}], "'content'"),
        ([{"role": "user", "content": "half \ud83d\ude00 pair"}], "'content'"),
        (calling({"q": "x\udfff"}), "arguments"),
        (calling({"k\ud800": 1}), "arguments"),
        (calling({}, call_id="id\ud800"), "tool_calls[0].id"),
        (calling({}, name="f\ud800"), "function.name"),
        ([{"role": "assistant", "content": "", "thinking": "\ud800"}], "'thinking'"),
    ],
)
def test_text_no_utf8_store_can_hold_is_refused_naming_the_message(
    messages: list[Any], where: str
) -> None:
    pattern = rf"message \d+: .*{re.escape(where)}.*surrogate"
    with pytest.raises(TranscriptError, match=pattern) as caught:
        validate(messages)
    assert isinstance(caught.value, ValueError)


def test_cyclic_arguments_are_a_value_error_not_a_recursion_error() -> None:
    cycle: dict[str, Any] = {"a": []}
    cycle["a"].append(cycle)
    with pytest.raises(TranscriptError, match=r"message 1: .*cycle"):
        validate(calling(cycle))
    shared = {"x": 1}
    validate(calling({"a": shared, "b": [shared, shared]}))  # shared, not cyclic: fine


def test_arguments_50000_deep_are_a_value_error_not_a_recursion_error() -> None:
    with pytest.raises(TranscriptError, match=r"message 1: .*deeper than 200"):
        validate(calling(nested(50_000)))
    validate(calling(nested(150)))


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "x" * 10_000_000, "content": ""}],
        [{"role": "user", "content": "", "k" * 10_000_000: 1}],
        [{"role": "user", "content": ["x" * 10_000_000]}],
        [*calling({}), {"role": "tool", "content": "", "tool_call_id": "i" * 10_000_000,
                        "name": "f"}],
        [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "t" * 10_000_000, "function": {"name": "f", "arguments": {}}}
        ]}],
        [*calling({}), {"role": "tool", "content": "", "tool_call_id": "c1",
                        "name": "n" * 10_000_000}],
    ],
)
def test_a_10_mb_bad_value_gives_a_short_error_with_its_length(messages: list[Any]) -> None:
    with pytest.raises(TranscriptError) as caught:
        validate(messages)
    text = str(caught.value)
    assert len(text) < 400, text[:400]
    assert re.search(r"\(10000000 characters\)|<list of 1 items>", text), text
