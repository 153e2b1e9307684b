"""The matrix's own parts: cells parse and name themselves, every row of the tables names
real capabilities, endings and places, and docs/crossings.md shows the table as it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from aimu.aio.transcript import Message
from tests.crossings.invariants import strict_accepts
from tests.crossings.matrix import (
    CAPABILITIES,
    ENDINGS,
    KNOWN_DEFECTS,
    NOT_APPLICABLE,
    PLACES,
    Cell,
    cells,
    render_table,
    why_not,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "crossings.md"


def test_the_docs_page_shows_the_table_as_it_is() -> None:
    assert render_table() in DOC.read_text()


def test_every_row_names_what_exists() -> None:
    names = ({c.name for c in CAPABILITIES}, {e.name for e in ENDINGS}, {p.name for p in PLACES})
    for row in (*NOT_APPLICABLE, *KNOWN_DEFECTS):
        for pattern, known in zip(row[:3], names, strict=True):
            assert pattern == "*" or pattern in known, row


def test_a_cell_parses_from_its_env_form_and_names_itself() -> None:
    cell = Cell.parse("tools:cancel:library:3")
    assert cell == Cell("tools", "cancel", "library", 3)
    assert cell.id == "tools-cancel-library-3"
    assert cell.rng().random() == Cell.parse("tools:cancel:library:3").rng().random()
    with pytest.raises(ValueError, match="unknown ending 'nap'"):
        Cell.parse("tools:nap:library:3")


def test_every_cell_applies_or_says_why_not() -> None:
    every = len(CAPABILITIES) * len(ENDINGS) * len(PLACES)
    applying = list(cells([p.name for p in PLACES], [0]))
    assert 0 < len(applying) < every
    for cell in applying:
        assert why_not(cell.capability, cell.ending, cell.place) is None
    assert why_not("tree", "cancel", "serve") is not None


def test_the_strict_provider_refuses_a_dangling_call(strict: str) -> None:
    """The transcript check is not vacuous: a call with no result is a 400 there."""
    dangling: list[Message] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}]},
    ]
    with pytest.raises(AssertionError, match="no response: c1"):
        strict_accepts(strict, {"top": dangling})
    strict_accepts(strict, {"top": [*dangling, {"role": "tool", "content": "ok",
                                                "tool_call_id": "c1", "name": "f"}]})
