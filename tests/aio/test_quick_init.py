"""aimu.aio._frozen.quick_init: the same class as @dataclass makes, set up faster."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from aimu.aio._frozen import quick_init
from aimu.aio.events import StepFinished, TextChunk, ToolResult


@dataclasses.dataclass(frozen=True, slots=True)
class _Plain:
    a: int
    b: str = "b"
    c: list[int] = dataclasses.field(default_factory=list)
    d: str = dataclasses.field(default="d", init=False)
    e: int = dataclasses.field(default=5, kw_only=True)


@quick_init
@dataclasses.dataclass(frozen=True, slots=True)
class _Quick:
    a: int
    b: str = "b"
    c: list[int] = dataclasses.field(default_factory=list)
    d: str = dataclasses.field(default="d", init=False)
    e: int = dataclasses.field(default=5, kw_only=True)


def test_same_signature_defaults_and_values_as_the_dataclass() -> None:
    assert str(inspect.signature(_Quick)) == str(inspect.signature(_Plain))
    cases: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((1,), {}), ((1, "x", [2]), {"e": 7}), ((), {"a": 3, "c": [4]}),
    ]
    for args, kwargs in cases:
        quick, plain = _Quick(*args, **kwargs), _Plain(*args, **kwargs)
        assert dataclasses.astuple(quick) == dataclasses.astuple(plain)
    assert _Quick(1).c is not _Quick(1).c  # a fresh default from the factory each time
    with pytest.raises(TypeError):
        _Quick()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _Quick(1, "b", [], 6)  # type: ignore[call-arg]


def test_still_frozen_compared_and_hashed() -> None:
    chunk = TextChunk("agent", "hi")
    with pytest.raises(dataclasses.FrozenInstanceError):
        chunk.text = "no"  # type: ignore[misc]
    assert chunk == TextChunk("agent", "hi") and hash(chunk) == hash(TextChunk("agent", "hi"))
    assert dataclasses.replace(chunk, path=("top",)).path == ("top",)
    assert ToolResult("a", "id", "t", "ok", False).type == "tool_result"
    assert StepFinished("a", 2) == StepFinished(source="a", step=2, path=())


def test_refuses_a_class_it_cannot_speed_up() -> None:
    @dataclasses.dataclass(slots=True)
    class Mutable:
        a: int

    with pytest.raises(TypeError, match="not a frozen, slotted dataclass"):
        quick_init(Mutable)
