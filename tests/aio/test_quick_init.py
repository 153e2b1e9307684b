"""aimu.aio._frozen.quick_init: the same class as @dataclass makes, set up faster."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
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


def test_builds_exactly_its_class_through_the_twin() -> None:
    quick = _Quick(1, "x", [2], e=3)
    assert type(quick) is _Quick and quick.__class__ is _Quick
    assert not hasattr(quick, "__dict__")
    assert _Quick.__init__ is object.__init__  # __new__ did the work, once
    with pytest.raises(dataclasses.FrozenInstanceError):
        quick.a = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del quick.b  # type: ignore[misc]


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickled_and_copied_by_its_fields(protocol: int) -> None:
    quick = _Quick(1, "x", [2], e=3)
    for twin in (pickle.loads(pickle.dumps(quick, protocol)), copy.copy(quick),
                 copy.deepcopy(quick)):
        assert type(twin) is _Quick and twin == quick
        assert dataclasses.astuple(twin) == dataclasses.astuple(quick)
    assert copy.deepcopy(quick).c is not quick.c


@dataclasses.dataclass(frozen=True, slots=True)
class _Same(_Quick):
    """A dataclass subclass with no field of its own (as aimu.aio.tree.Held)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _More(_Quick):
    f: int = 9


class _Plainly(_Quick):
    """A subclass without an __init__: made as its base is."""

    __slots__ = ()


@pytest.mark.parametrize("kind", [_Same, _More, _Plainly])
def test_a_subclass_is_made_as_dataclass_would(kind: type[_Quick]) -> None:
    made = kind(1, "x", [2], e=3)
    assert type(made) is kind
    assert (made.a, made.b, made.c, made.d, made.e) == (1, "x", [2], "d", 3)
    assert made != _Quick(1, "x", [2], e=3)  # compared as dataclasses do: class too
    assert kind(1).c is not kind(1).c
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.a = 2  # type: ignore[misc]
    for twin in (pickle.loads(pickle.dumps(made)), copy.copy(made), copy.deepcopy(made)):
        assert type(twin) is kind and twin == made
    assert _More(1, f=4).f == 4 and _More(1).f == 9


def test_refuses_a_class_it_cannot_speed_up() -> None:
    @dataclasses.dataclass(slots=True)
    class Mutable:
        a: int

    with pytest.raises(TypeError, match="not a frozen, slotted dataclass"):
        quick_init(Mutable)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Private:
        _a: int

    with pytest.raises(TypeError, match="has a field named '_a'"):
        quick_init(Private)

    with pytest.raises(TypeError, match="has a base class"):
        quick_init(_More)
