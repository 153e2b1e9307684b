"""The wire form of a transcript: encoded once per message, re-encoded when a message
changes, adjacent same-role messages merged (or not), whatever the cache holds."""

from __future__ import annotations

import json
from typing import Any

import pytest

from aimu.aio.providers._wire import WireEncoder
from aimu.aio.providers.ollama import to_wire as ollama_wire
from aimu.aio.providers.openai import to_wire as openai_wire
from aimu.aio.transcript import Message, answer_open_calls

WIRES = [ollama_wire, openai_wire]


def fresh(messages: list[Message], to_wire: Any, merge: bool = True) -> list[Any]:
    return json.loads(WireEncoder(to_wire, merge).messages(messages))


def calling(call_id: str) -> Message:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "f", "arguments": {"x": "é"}}}
    ]}


@pytest.mark.parametrize("to_wire", WIRES)
def test_each_request_equals_a_fresh_encoding_as_the_transcript_changes(to_wire: Any) -> None:
    encoder = WireEncoder(to_wire, merge_roles=True)
    messages: list[Message] = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]

    def check() -> None:
        assert json.loads(encoder.messages(messages)) == fresh(messages, to_wire)

    check()
    messages.append({"role": "assistant", "content": "partial"})
    check()
    messages.append({"role": "assistant", "content": "resumed"})  # merged across the cache
    check()
    messages.append({"role": "user", "content": "b"})
    messages.append({"role": "user", "content": "c"})
    check()
    messages[1]["content"] = "edited in place"  # content replaced: noticed
    check()
    messages[2] = {"role": "assistant", "content": "replaced"}  # message replaced: noticed
    check()
    messages.append(calling("c1"))
    check()
    answer_open_calls(messages)  # a result inserted: noticed
    check()
    del messages[3:5]  # shorter than what was sent: noticed
    check()
    messages[:] = [{"role": "user", "content": "restored"}]
    check()


def test_merging_joins_adjacent_turns_with_a_blank_line() -> None:
    messages: list[Message] = [
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "cut", "aimu_partial": True},
        {"role": "assistant", "content": "", "tool_calls": calling("c")["tool_calls"]},  # type: ignore[typeddict-item]
    ]
    assert fresh(messages, openai_wire) == [
        {"role": "user", "content": "one\n\ntwo"},
        {"role": "assistant", "content": "cut", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x":"é"}'}}
        ]},
    ]
    assert [m["content"] for m in fresh(messages, openai_wire, merge=False)] == [
        "one", "two", "cut", ""
    ]
