"""The one Server-Sent Events module: what it frames, a reader parses back the same."""

from __future__ import annotations

import pytest

from aimu.aio._sse import KEEP_ALIVE, ServerSentEvent, SSEParser, comment, frame


def parse(stream: bytes) -> list[ServerSentEvent]:
    parser = SSEParser()
    events = [parser.feed(line) for line in stream.decode().splitlines()]
    events.append(parser.flush())
    return [event for event in events if event is not None]


def test_parser_fields_comments_and_multiline_data() -> None:
    parser = SSEParser()
    fed = [parser.feed(line) for line in [
        ": keep-alive", "event: message", "id: 7", 'data: {"a":', "data:1}", "", "",
        "retry: 5", "data: [DONE]", "",
    ]]
    assert [item for item in fed if item is not None] == [
        ServerSentEvent('{"a":\n1}', "message", "7"),
        ServerSentEvent("[DONE]", "message", "7"),  # the last id stays until another comes
    ]
    parser.feed("data: tail")
    assert parser.flush() == ServerSentEvent("tail", "message", "7")
    assert parser.flush() is None


def test_an_event_without_data_is_not_dispatched_and_its_type_does_not_leak() -> None:
    parser = SSEParser()
    assert parser.feed("event: lonely") is None and parser.feed("") is None
    parser.feed("data: x")
    assert parser.feed("") == ServerSentEvent("x")


def test_a_nul_in_an_id_is_ignored_as_the_format_says() -> None:
    parser = SSEParser()
    for line in ["id: 1", "data: a", "", "id: 2\0", "data: b", ""]:
        parser.feed(line)
    assert parser.last_id == "1"


def test_frame_round_trips_through_the_parser() -> None:
    stream = (
        frame(b'{"type":"text"}', event="text", id="17-0")
        + KEEP_ALIVE
        + frame(b"two\nlines\r\nand\rthree")
        + frame("café".encode())
    )
    assert parse(stream) == [
        ServerSentEvent('{"type":"text"}', "text", "17-0"),
        ServerSentEvent("two\nlines\nand\nthree", "message", "17-0"),
        ServerSentEvent("café", "message", "17-0"),
    ]
    assert frame(b"[DONE]") == b"data: [DONE]\n\n"
    assert comment() == b":\n\n" and KEEP_ALIVE == b": keep-alive\n\n"


@pytest.mark.parametrize("field", ["event", "id"])
def test_a_line_break_in_a_field_is_refused_naming_it(field: str) -> None:
    with pytest.raises(ValueError, match=f"an SSE {field} cannot hold a line break"):
        frame(b"x", **{field: "a\nb"})
