"""Tools: schemas from signatures, argument validation and conversion, invoke, cancel."""

import asyncio
import contextvars
import dataclasses
import datetime
import enum
import functools
import json
import subprocess
import sys
import threading
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal, NotRequired, Optional, Required, TypedDict, Union

import pydantic
import pytest

from aimu import aio
from aimu.aio.errors import ToolDefinitionError
from aimu.aio.scope import RunScope, current_scope
from aimu.aio.tools import Tool, ToolContext, ToolOutcome, as_tool, invoke, tool
from aimu.aio.transcript import ToolCall
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer

# --------------------------------------------------------------------------- helpers


def props(fn: Any) -> dict[str, Any]:
    return as_tool(fn).parameters["properties"]  # type: ignore[no-any-return]


def call(name: str, arguments: Any = None, call_id: str = "c1") -> ToolCall:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": {} if arguments is None else arguments},
    }


def context(name: str = "t", probe: Any = None) -> ToolContext:
    return ToolContext(
        agent="agent", call_id="c1", tool_name=name, interrupt_probe=probe or (lambda: False)
    )


async def run(fn: Any, arguments: Any = None, ctx: ToolContext | None = None) -> ToolOutcome:
    t = as_tool(fn)
    return await invoke({t.name: t}, call(t.name, arguments), ctx or context(t.name))


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Opts(TypedDict):
    depth: int
    label: NotRequired[str]


class Loose(TypedDict, total=False):
    """Loose options.

    Args:
        must: always there
    """

    must: Required[int]
    maybe: str


@dataclasses.dataclass
class Point:
    """A point on the grid.

    Attributes:
        x: across
        y: down
    """

    x: int
    y: int = 0
    tags: list[str] = dataclasses.field(default_factory=list)
    hidden: int = dataclasses.field(default=0, init=False)


@dataclasses.dataclass
class Segment:
    start: Point
    end: Point
    color: Color = Color.RED


@dataclasses.dataclass
class Positive:
    n: int

    def __post_init__(self) -> None:
        if self.n <= 0:
            raise ValueError("n must be positive")


@dataclasses.dataclass
class Node:
    value: int
    children: "list[Node]"


class Opaque:
    pass


# --------------------------------------------------------------------------- schemas


def test_scalar_schemas_and_required_order() -> None:
    def f(s: str, i: int, x: float, b: bool, n: None) -> None: ...

    t = as_tool(f)
    assert t.parameters == {
        "type": "object",
        "properties": {
            "s": {"type": "string"},
            "i": {"type": "integer"},
            "x": {"type": "number"},
            "b": {"type": "boolean"},
            "n": {"type": "null"},
        },
        "required": ["s", "i", "x", "b", "n"],
        "additionalProperties": False,
    }
    assert t.spec == {
        "type": "function",
        "function": {"name": "f", "description": "", "parameters": t.parameters},
    }
    assert t.spec["function"]["parameters"] is t.parameters  # built once


def test_schemas_share_no_dicts_between_tools() -> None:
    def f(a: str, p: Point) -> None: ...

    def g(a: str, p: Point) -> None: ...

    first, second = as_tool(f), as_tool(g)
    first.parameters["properties"]["a"]["description"] = "mutated by a caller"
    first.parameters["properties"]["p"]["properties"]["x"]["type"] = "string"
    assert second.parameters["properties"]["a"] == {"type": "string"}
    assert second.parameters["properties"]["p"]["properties"]["x"]["type"] == "integer"
    assert as_tool(f).parameters["properties"]["a"] == {"type": "string"}


def test_container_schemas() -> None:
    def f(
        a: list[int],
        b: list,  # type: ignore[type-arg]
        c: dict[str, float],
        d: dict,  # type: ignore[type-arg]
        e: tuple[int, ...],
        g: tuple[int, str],
        h: Sequence[str],
        k: list[dict[str, list[bool]]],
    ) -> None: ...

    p = props(f)
    assert p["a"] == {"type": "array", "items": {"type": "integer"}}
    assert p["b"] == {"type": "array", "items": {}}
    assert p["c"] == {"type": "object", "additionalProperties": {"type": "number"}}
    assert p["d"] == {"type": "object"}
    assert p["e"] == {"type": "array", "items": {"type": "integer"}}
    assert p["g"] == {
        "type": "array",
        "prefixItems": [{"type": "integer"}, {"type": "string"}],
        "items": False,
        "minItems": 2,
        "maxItems": 2,
    }
    assert p["h"] == {"type": "array", "items": {"type": "string"}}
    assert p["k"] == {
        "type": "array",
        "items": {
            "type": "object",
            "additionalProperties": {"type": "array", "items": {"type": "boolean"}},
        },
    }


def test_optional_and_union_schemas() -> None:
    def f(
        a: Optional[str],  # noqa: UP045 - the typing spelling is supported too
        b: int | None,
        c: Union[int, str],  # noqa: UP007
        d: int | str | None,
        e: list[int] | None,
        g: Point | None,
        h: Literal["x", "y"] | None,
        k: Color | None,
    ) -> None: ...

    p = props(f)
    assert p["a"] == {"type": ["string", "null"]}
    assert p["b"] == {"type": ["integer", "null"]}
    assert p["c"] == {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    assert p["d"] == {
        "anyOf": [{"anyOf": [{"type": "integer"}, {"type": "string"}]}, {"type": "null"}]
    }
    assert p["e"] == {"type": ["array", "null"], "items": {"type": "integer"}}
    assert p["g"]["type"] == ["object", "null"]
    assert p["g"]["required"] == ["x"]
    assert p["h"] == {"type": ["string", "null"], "enum": ["x", "y", None]}
    assert p["k"] == {"type": ["string", "null"], "enum": ["red", "green", None]}
    assert as_tool(f).parameters["required"] == list("abcdeghk")  # nullable is not optional


def test_literal_and_enum_schemas() -> None:
    def f(
        a: Literal["fast", "slow"],
        b: Literal[1, 2, 3],
        c: Literal["x", 1, True],
        d: Literal["on", None],
        e: Color,
        g: Level,
        h: Literal[Color.RED],
    ) -> None: ...

    p = props(f)
    assert p["a"] == {"type": "string", "enum": ["fast", "slow"]}
    assert p["b"] == {"type": "integer", "enum": [1, 2, 3]}
    assert p["c"] == {"enum": ["x", 1, True]}
    assert p["d"] == {"enum": ["on", None]}
    assert p["e"] == {"type": "string", "enum": ["red", "green"]}
    assert p["g"] == {"type": "integer", "enum": [1, 2]}
    assert p["h"] == {"type": "string", "enum": ["red"]}


def test_typeddict_schema() -> None:
    def f(o: Opts, loose: Loose) -> None: ...

    p = props(f)
    assert p["o"] == {
        "type": "object",
        "properties": {"depth": {"type": "integer"}, "label": {"type": "string"}},
        "required": ["depth"],
        "additionalProperties": False,
    }
    assert p["loose"]["required"] == ["must"]
    assert p["loose"]["properties"]["must"] == {"type": "integer", "description": "always there"}


def test_dataclass_schema_with_defaults_factories_and_nesting() -> None:
    def f(seg: Segment) -> None: ...

    seg = props(f)["seg"]
    point = {
        "type": "object",
        "properties": {
            "x": {"type": "integer", "description": "across"},
            "y": {"type": "integer", "description": "down", "default": 0},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["x"],  # a default_factory makes a field optional; init=False hides it
        "additionalProperties": False,
        "description": "A point on the grid.",
    }
    assert seg == {
        "type": "object",
        "properties": {
            "start": point,
            "end": point,
            "color": {"type": "string", "enum": ["red", "green"], "default": "red"},
        },
        "required": ["start", "end"],
        "additionalProperties": False,
    }


def test_defaults_and_missing_annotations() -> None:
    def f(  # type: ignore[no-untyped-def]
        a: int = 3,
        b: str = "x",
        c: Color = Color.GREEN,
        d: tuple[int, int] = (1, 2),
        e: str = None,  # type: ignore[assignment]  # noqa: RUF013 - None default allows null
        g=None,
        h=5,
        *,
        k: list[int] | None = None,
    ) -> None: ...

    t = as_tool(f)
    p = t.parameters["properties"]
    assert t.parameters["required"] == []
    assert p["a"] == {"type": "integer", "default": 3}
    assert p["b"] == {"type": "string", "default": "x"}
    assert p["c"] == {"type": "string", "enum": ["red", "green"], "default": "green"}
    assert p["d"]["default"] == [1, 2]
    assert p["e"] == {"type": ["string", "null"], "default": None}
    assert p["g"] == {"default": None}  # no annotation: any JSON value
    assert p["h"] == {"default": 5}
    assert p["k"] == {"type": ["array", "null"], "items": {"type": "integer"}, "default": None}


def test_annotated_descriptions_win_over_docstring() -> None:
    def f(
        a: Annotated[int, "from Annotated", 42],
        b: int,
        c: Annotated[list[Annotated[str, "one tag"]], "the tags"],
        d: Annotated[int | None, "maybe"] = None,
    ) -> None:
        """Summary line.

        Args:
            a: from the docstring
            b (int): the b, from the docstring,
                over two lines.
            c: ignored
        """

    p = props(f)
    assert p["a"] == {"type": "integer", "description": "from Annotated"}
    assert p["b"] == {
        "type": "integer",
        "description": "the b, from the docstring, over two lines.",
    }
    assert p["c"] == {
        "type": "array",
        "items": {"type": "string", "description": "one tag"},
        "description": "the tags",
    }
    assert p["d"] == {"type": ["integer", "null"], "description": "maybe", "default": None}


def test_docstring_summary_and_sections() -> None:
    def multi(a: int, b: int) -> None:
        """Add two numbers
        and report the sum.

        The sum is computed exactly.

        Args:
            a: first
            b: second

        Returns:
            b: not a parameter description
        Raises:
            ValueError: never
        """

    t = as_tool(multi)
    assert t.description == "Add two numbers and report the sum."
    assert t.parameters["properties"]["b"] == {"type": "integer", "description": "second"}

    def only_args(x: str) -> None:
        """Args:
        x: the x
        """

    assert as_tool(only_args).description == ""

    def none(x: str) -> None: ...

    assert as_tool(none).description == ""
    assert as_tool(none).parameters["properties"]["x"] == {"type": "string"}


def test_context_parameter_is_left_out_of_the_schema() -> None:
    def f(query: str, ctx: ToolContext) -> str:
        return query

    def g(ctx: Annotated[ToolContext, "run state"], n: int = 1) -> None: ...

    t = as_tool(f)
    assert t.context_param == "ctx"
    assert list(t.parameters["properties"]) == ["query"]
    assert t.parameters["required"] == ["query"]
    assert as_tool(g).context_param == "ctx"
    assert list(as_tool(g).parameters["properties"]) == ["n"]
    assert as_tool(lambda_free).context_param is None


def lambda_free(x: int) -> int:
    return x


# --------------------------------------------------------------------------- definitions


def test_decorator_bare_and_with_overrides() -> None:
    @tool
    def plain(x: int) -> int:
        """Plain summary."""
        return x * 2

    @tool(name="renamed", description="Told, not inferred.", timeout=2)
    async def fancy(x: int) -> int:
        """Inferred summary."""
        return x

    assert isinstance(plain, Tool)
    assert (plain.name, plain.description, plain.timeout, plain.is_async) == (
        "plain",
        "Plain summary.",
        None,
        False,
    )
    assert plain(4) == 8  # a Tool is still the function
    assert plain.__wrapped__ is plain.fn
    assert (fancy.name, fancy.description, fancy.timeout, fancy.is_async) == (
        "renamed",
        "Told, not inferred.",
        2.0,
        True,
    )
    assert fancy.spec["function"]["name"] == "renamed"
    assert fancy.spec["function"]["description"] == "Told, not inferred."

    again = tool(plain, timeout=0.5)
    assert again is not plain
    assert (again.name, again.description, again.timeout) == ("plain", "Plain summary.", 0.5)
    assert as_tool(plain) is plain
    assert "plain(x: integer)" in repr(plain)


def test_partial_bound_method_and_callable_object() -> None:
    def search(db: Opaque, query: str, limit: int = 10) -> str:
        """Search the database."""
        return query

    bound = functools.partial(search, db=Opaque())  # a non-JSON default bound by partial
    t = as_tool(bound)
    assert t.name == "search"
    assert t.description == "Search the database."
    assert list(t.parameters["properties"]) == ["query", "limit"]

    positional = as_tool(functools.partial(search, Opaque()))
    assert list(positional.parameters["properties"]) == ["query", "limit"]

    class Counter:
        """Counts."""

        def __init__(self) -> None:
            self.n = 0

        def bump(self, by: int = 1) -> int:
            """Bump the counter."""
            self.n += by
            return self.n

        async def __call__(self, text: str) -> str:
            return text.upper()

    counter = Counter()
    method = as_tool(counter.bump)
    assert (method.name, method.description) == ("bump", "Bump the counter.")
    assert list(method.parameters["properties"]) == ["by"]
    obj = as_tool(counter)
    assert obj.name == "Counter"
    assert obj.is_async
    assert obj.description == "Counts."
    assert list(obj.parameters["properties"]) == ["text"]


def test_definition_errors_name_tool_and_parameter() -> None:
    def bad_default(when: Any = datetime.timedelta(1)) -> None: ...

    with pytest.raises(
        ToolDefinitionError,
        match=r"tool 'bad_default', parameter 'when'.*"
        r"timedelta.*not JSON-serialisable",
    ):
        as_tool(bad_default)

    def bad_type(raw: bytes) -> None: ...

    with pytest.raises(ToolDefinitionError, match=r"tool 'bad_type', parameter 'raw'.*bytes"):
        as_tool(bad_type)

    def custom(o: Opaque) -> None: ...

    with pytest.raises(ToolDefinitionError, match=r"parameter 'o'.*Opaque.*has no JSON schema"):
        as_tool(custom)

    def nested_bad(items: list[Opaque]) -> None: ...

    with pytest.raises(ToolDefinitionError, match=r"tool 'nested_bad', parameter 'items'"):
        as_tool(nested_bad)

    def int_keys(m: dict[int, str]) -> None: ...

    with pytest.raises(ToolDefinitionError, match=r"parameter 'm': dict keys must be str"):
        as_tool(int_keys)

    def star(*values: int) -> None: ...

    with pytest.raises(ToolDefinitionError, match=r"tool 'star', parameter 'values': \*values"):
        as_tool(star)

    def stars(**options: int) -> None: ...

    with pytest.raises(ToolDefinitionError, match=r"\*\*options cannot be offered"):
        as_tool(stars)

    def recursive(tree: Node) -> None: ...

    with pytest.raises(ToolDefinitionError, match=r"Node refers to itself"):
        as_tool(recursive)

    class Weird(enum.Enum):
        A = (1, 2)

    def weird(w: Weird) -> None: ...

    with pytest.raises(ToolDefinitionError, match=r"Weird.A has value \(1, 2\)"):
        as_tool(weird)

    with pytest.raises(ToolDefinitionError, match=r"tool name '<lambda>' is not allowed"):
        as_tool(lambda x: x)
    assert as_tool(tool(lambda x: x, name="identity")).name == "identity"

    with pytest.raises(ToolDefinitionError, match=r"timeout must be a positive number"):
        tool(lambda_free, timeout=0)
    with pytest.raises(ToolDefinitionError, match=r"timeout must be a positive number"):
        tool(lambda_free, timeout=10**400)

    def gen(x: int) -> Any:
        yield x

    with pytest.raises(ToolDefinitionError, match=r"tool 'gen' is a generator function"):
        as_tool(gen)

    def unresolved(x: "Missing") -> None: ...  # type: ignore[name-defined]  # noqa: F821

    with pytest.raises(ToolDefinitionError, match=r"tool 'unresolved': cannot resolve"):
        as_tool(unresolved)

    def two(a: ToolContext, b: ToolContext) -> None: ...

    with pytest.raises(ToolDefinitionError, match=r"parameter 'b': a second ToolContext"):
        as_tool(two)

    with pytest.raises(ToolDefinitionError, match=r"must be callable"):
        as_tool(42)  # type: ignore[arg-type]

    assert issubclass(ToolDefinitionError, TypeError)


# --------------------------------------------------------------------------- validation


def kinds(
    count: int,
    ratio: float,
    flag: bool,
    mode: Literal["fast", "slow"],
    color: Color,
    names: list[str],
    scores: dict[str, int],
    opts: Opts,
    point: Point,
    note: str | None,
    pair: tuple[int, str] = (0, ""),
    level: Level = Level.LOW,
) -> str:
    KINDS_CALLS.append(
        {
            "count": count,
            "ratio": ratio,
            "flag": flag,
            "mode": mode,
            "color": color,
            "names": names,
            "scores": scores,
            "opts": opts,
            "point": point,
            "note": note,
            "pair": pair,
            "level": level,
        }
    )
    return "ok"


KINDS_CALLS: list[dict[str, Any]] = []

GOOD: dict[str, Any] = {
    "count": 3,
    "ratio": 0.5,
    "flag": True,
    "mode": "fast",
    "color": "red",
    "names": ["a"],
    "scores": {"a": 1},
    "opts": {"depth": 2},
    "point": {"x": 1},
    "note": None,
}


async def test_valid_arguments_are_converted_to_declared_types() -> None:
    KINDS_CALLS.clear()
    arguments = {**GOOD, "ratio": 2, "count": 4.0, "pair": [7, "z"], "level": 2}
    assert await run(kinds, arguments) == ToolOutcome("ok", False)
    [seen] = KINDS_CALLS
    assert seen["count"] == 4 and type(seen["count"]) is int  # 4.0 is an integer in JSON
    assert seen["ratio"] == 2.0 and type(seen["ratio"]) is float
    assert seen["color"] is Color.RED
    assert seen["level"] is Level.HIGH
    assert seen["point"] == Point(x=1) and isinstance(seen["point"], Point)
    assert seen["opts"] == {"depth": 2} and type(seen["opts"]) is dict
    assert seen["pair"] == (7, "z")
    assert seen["note"] is None
    assert "flag" in seen and "names" in seen and "scores" in seen


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"count": True}, "argument 'count': expected integer, got true (boolean)"),
        ({"count": 2.5}, "argument 'count': expected integer, got 2.5 (number)"),
        ({"count": "3"}, "argument 'count': expected integer, got \"3\" (string)"),
        ({"ratio": False}, "argument 'ratio': expected number, got false (boolean)"),
        ({"flag": 1}, "argument 'flag': expected boolean, got 1 (integer)"),
        (
            {"mode": "medium"},
            'argument \'mode\': expected one of "fast" | "slow", got "medium" (string)',
        ),
        ({"color": "RED"}, 'argument \'color\': expected one of "red" | "green", got "RED"'),
        ({"level": True}, "argument 'level': expected one of 1 | 2, got true (boolean)"),
        ({"names": "a"}, "argument 'names': expected array of string, got \"a\" (string)"),
        ({"names": ["a", 2]}, "argument 'names[1]': expected string, got 2 (integer)"),
        ({"scores": {"a": "x"}}, 'argument \'scores["a"]\': expected integer, got "x"'),
        ({"scores": []}, "argument 'scores': expected object of integer, got [] (array)"),
        ({"opts": {}}, "argument 'opts': missing required field 'depth'"),
        (
            {"opts": {"depth": 1, "extra": 1}},
            "argument 'opts.extra': unknown field; known fields: 'depth', 'label'",
        ),
        (
            {"opts": {"depth": 1, "label": 5}},
            "argument 'opts.label': expected string, got 5 (integer)",
        ),
        ({"point": {"x": "1"}}, "argument 'point.x': expected integer, got \"1\" (string)"),
        ({"point": {"x": 1, "hidden": 3}}, "argument 'point.hidden': unknown field"),
        (
            {"point": {"x": 1, "tags": [None]}},
            "argument 'point.tags[0]': expected string, got null (null)",
        ),
        ({"point": None}, "argument 'point': expected object Point {x: integer"),
        ({"note": 3}, "argument 'note': expected string or null, got 3 (integer)"),
        ({"pair": [1]}, "argument 'pair': expected array of 2 items [integer, string]"),
        ({"pair": [1, 2]}, "argument 'pair[1]': expected string, got 2 (integer)"),
        ({"bogus": 1}, "unknown argument 'bogus'"),
    ],
)
async def test_each_kind_of_invalid_argument_is_explained(
    change: dict[str, Any], message: str
) -> None:
    KINDS_CALLS.clear()
    outcome = await run(kinds, {**GOOD, **change})
    assert outcome.is_error
    assert outcome.content.startswith("invalid arguments for tool 'kinds': ")
    assert message in outcome.content
    assert "Expected kinds(count: integer, ratio: number" in outcome.content
    assert KINDS_CALLS == []  # validated before the call: the function never ran


async def test_missing_and_several_problems_are_reported_together() -> None:
    arguments = {k: v for k, v in GOOD.items() if k not in ("count", "note")}
    arguments["flag"] = "yes"
    outcome = await run(kinds, arguments)
    assert outcome.is_error
    assert "argument 'flag': expected boolean" in outcome.content
    assert "missing required argument 'count', 'note'" in outcome.content


async def test_arguments_as_json_text_or_not_an_object() -> None:
    def add(a: int, b: int) -> int:
        return a + b

    assert await run(add, json.dumps({"a": 1, "b": 2})) == ToolOutcome("3", False)
    bad = await run(add, "{not json")
    assert bad.is_error and "the arguments are not valid JSON" in bad.content
    listed = await run(add, [1, 2])
    assert listed.is_error and "must be a JSON object, got [1, 2] (array)" in listed.content
    empty = await run(add, "")
    assert empty.is_error and "missing required argument 'a', 'b'" in empty.content


async def test_dataclass_own_checks_become_argument_errors() -> None:
    def take(p: Positive) -> int:
        return p.n

    assert await run(take, {"p": {"n": 2}}) == ToolOutcome("2", False)
    outcome = await run(take, {"p": {"n": -1}})
    assert outcome.is_error
    assert "argument 'p': Positive rejected it: ValueError: n must be positive" in outcome.content


async def test_null_only_where_allowed_and_unions_in_order() -> None:
    def f(a: int | str, b: float | int, c: Literal["on", None], d: Any = None) -> list[Any]:
        return [a, b, c, d]

    assert (await run(f, {"a": "x", "b": 1, "c": None})).content == '["x", 1.0, null, null]'
    assert (await run(f, {"a": 2, "b": 1.5, "c": "on", "d": {"k": [1]}})).content == (
        '[2, 1.5, "on", {"k": [1]}]'
    )
    outcome = await run(f, {"a": None, "b": True, "c": "off"})
    assert "argument 'a': expected integer or string, got null (null)" in outcome.content
    assert "argument 'b': expected number or integer, got true (boolean)" in outcome.content
    assert 'argument \'c\': expected one of "on" | null, got "off"' in outcome.content


async def test_positional_only_parameters_are_passed_positionally() -> None:
    def f(a: int, b: int = 10, /, c: int = 100) -> int:
        return a + b + c

    assert await run(f, {"a": 1}) == ToolOutcome("111", False)
    assert await run(f, {"a": 1, "c": 0}) == ToolOutcome("11", False)
    assert await run(f, {"a": 1, "b": 2, "c": 3}) == ToolOutcome("6", False)


# --------------------------------------------------------------------------- invoke


async def test_unknown_tool_names_the_available_tools() -> None:
    a, b = as_tool(lambda_free), tool(lambda_free, name="other")
    outcome = await invoke({"lambda_free": a, "other": b}, call("nope"), context())
    assert outcome == ToolOutcome(
        "unknown tool 'nope'; available tools: 'lambda_free', 'other'", True
    )
    assert (await invoke({}, call("nope"), context())).content == (
        "unknown tool 'nope'; available tools: none"
    )


async def test_a_raising_tool_becomes_an_error_outcome() -> None:
    def boom(x: int) -> None:
        raise ValueError(f"bad x {x}")

    async def aboom() -> None:
        raise KeyError("k")

    def silent() -> None:
        raise RuntimeError

    def own_timeout() -> None:
        raise TimeoutError("socket timed out")

    assert await run(boom, {"x": 1}) == ToolOutcome("tool 'boom' failed: ValueError: bad x 1", True)
    assert await run(aboom) == ToolOutcome("tool 'aboom' failed: KeyError: 'k'", True)
    assert await run(silent) == ToolOutcome("tool 'silent' failed: RuntimeError", True)
    # The tool's own TimeoutError is a failure, not the tool's timeout, with or without one.
    assert await run(own_timeout) == ToolOutcome(
        "tool 'own_timeout' failed: TimeoutError: socket timed out", True
    )
    assert await run(tool(own_timeout, timeout=30)) == ToolOutcome(
        "tool 'own_timeout' failed: TimeoutError: socket timed out", True
    )


class Mood(enum.Enum):
    GOOD = "good"


@dataclasses.dataclass
class Report:
    mood: Mood
    points: list[Point]


async def test_return_values_become_text() -> None:
    async def echo(value: Any) -> Any:
        return value

    assert (await run(echo, {"value": "plain text"})).content == "plain text"
    assert (await run(echo, {"value": None})).content == "null"
    assert (await run(echo, {"value": 3})).content == "3"
    assert (await run(echo, {"value": {"é": [1, True]}})).content == '{"é": [1, true]}'

    def rich() -> Any:
        return {
            "report": Report(Mood.GOOD, [Point(1, 2)]),
            "when": datetime.date(2024, 5, 1),
            "ids": frozenset({7}),
            "pair": (1, 2),
        }

    assert json.loads((await run(rich)).content) == {
        "report": {"mood": "good", "points": [{"x": 1, "y": 2, "tags": [], "hidden": 0}]},
        "when": "2024-05-01",
        "ids": [7],
        "pair": [1, 2],
    }

    def opaque() -> Opaque:
        return Opaque()

    outcome = await run(opaque)
    assert outcome.is_error
    assert outcome.content.startswith("tool 'opaque' returned a Opaque")
    assert "return a str or JSON data" in outcome.content


async def test_a_result_over_the_cap_is_cut_with_a_marker_saying_how_much() -> None:
    def huge() -> str:
        return "é" + "x" * 1_999_998  # 2,000,000 bytes of UTF-8

    outcome = await run(huge)
    body, marker = outcome.content.rsplit("\n", 1)
    assert body == "é" + "x" * 999_998 and not outcome.is_error  # 1 MB by default
    assert marker == (
        "[cut: 1,000,000 of 2,000,000 bytes dropped; tool 'huge' results are capped at "
        "1,000,000 bytes]"
    )
    assert (await run(tool(huge, max_result=2_000_000))).content == huge()
    assert (await run(tool(huge, max_result=None))).content == huge()
    # A character is never cut in two: 1 byte of "é" is nothing, counted as dropped.
    assert (await run(tool(huge, max_result=1))).content.startswith("\n[cut: 2,000,000 of")
    assert tool(tool(huge, max_result=5)).max_result == 5  # kept when not given again

    async def failing() -> str:
        raise ValueError("y" * 50)

    failed = await run(tool(failing, max_result=20))
    assert failed.is_error and failed.content.startswith("tool 'failing' faile\n[cut: 65 of 85 ")
    for bad in (0, -1, 1.5, True, "10"):
        with pytest.raises(ToolDefinitionError, match="max_result must be a positive number"):
            tool(huge, max_result=bad)  # type: ignore[arg-type]


async def test_the_cut_result_is_what_the_transcript_and_the_store_keep(tmp_path: Any) -> None:
    from aimu.testing.scripted import ScriptedModel, tool_turn

    def huge() -> str:
        return "x" * 1_500_000

    store = aio.SQLiteStore(tmp_path / "s.db")
    agent = aio.Agent(ScriptedModel([tool_turn(("huge", {})), Turn("done")]), tools=[huge],
                      store=store, session="s")
    assert await agent.run("go") == "done"
    (result,) = [m["content"] for m in agent.model_client.messages if m["role"] == "tool"]
    assert result.endswith("[cut: 500,000 of 1,500,000 bytes dropped; tool 'huge' results are "
                           "capped at 1,000,000 bytes]")
    assert len(result) < 1_000_100
    stored = await store.load("s")
    assert [m["content"] for m in stored if m["role"] == "tool"] == [result]
    await agent.aclose()
    await store.aclose()


async def test_sync_function_returning_a_coroutine_is_an_error_without_warning(
    recwarn: pytest.WarningsRecorder,
) -> None:
    async def inner() -> str:
        return "never"

    def wrapper() -> Any:
        return inner()

    outcome = await run(wrapper)
    assert outcome.is_error
    assert "returned a coroutine; declare the tool `async def`" in outcome.content
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


async def test_sync_tools_run_in_a_thread_that_sees_contextvars() -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("test_var")
    var.set("from the caller")
    scope = RunScope("outer")
    token = current_scope.set(scope)
    loop_thread = threading.get_ident()
    try:

        def look(ctx: ToolContext) -> dict[str, Any]:
            return {
                "var": var.get(),
                "scope": getattr(current_scope.get(), "name", None),
                "other_thread": threading.get_ident() != loop_thread,
                "agent": ctx.agent,
                "tool": ctx.tool_name,
                "call": ctx.call_id,
            }

        outcome = await run(look)
    finally:
        current_scope.reset(token)
    assert json.loads(outcome.content) == {
        "var": "from the caller",
        "scope": "outer",
        "other_thread": True,
        "agent": "agent",
        "tool": "look",
        "call": "c1",
    }


async def test_async_tools_run_on_the_loop_and_get_the_context() -> None:
    loop_thread = threading.get_ident()

    async def look(x: int, ctx: ToolContext) -> list[Any]:
        return [x, threading.get_ident() == loop_thread, ctx.interrupt_requested]

    flag = [False]
    ctx = context("look", probe=lambda: flag[0])
    assert (await run(look, {"x": 1}, ctx)).content == "[1, true, false]"
    flag[0] = True
    assert (await run(look, {"x": 2}, context("look", probe=lambda: flag[0]))).content == (
        "[2, true, true]"
    )


# --------------------------------------------------------------------------- timeouts


async def test_async_tool_timeout_is_an_outcome_and_marks_the_context() -> None:
    finished = asyncio.Event()

    @tool(timeout=0.05)
    async def slow() -> str:
        try:
            await asyncio.sleep(30)
        finally:
            finished.set()
        return "late"

    ctx = context("slow")
    outcome = await invoke({"slow": slow}, call("slow"), ctx)
    assert outcome == ToolOutcome("tool 'slow' timed out after 0.05 s", True)
    assert ctx.cancelled
    assert finished.is_set()  # the coroutine was cancelled and cleaned up before invoke returned


async def test_sync_tool_timeout_lets_the_thread_notice() -> None:
    noticed = threading.Event()
    done = threading.Event()

    @tool(timeout=0.05)
    def slow(ctx: ToolContext) -> str:
        try:
            if ctx.wait_cancelled(30):
                noticed.set()
                ctx.check()  # raises CancelledError into a future nobody awaits any more
            return "late"
        finally:
            done.set()

    ctx = context("slow")
    outcome = await invoke({"slow": slow}, call("slow"), ctx)
    assert outcome == ToolOutcome("tool 'slow' timed out after 0.05 s", True)
    assert ctx.cancelled
    assert await asyncio.to_thread(done.wait, 10)
    assert noticed.is_set()


async def test_an_outside_cancel_during_a_timed_call_is_not_a_timeout() -> None:
    started = asyncio.Event()

    @tool(timeout=30)
    async def slow() -> str:
        started.set()
        await asyncio.sleep(30)
        return "late"

    ctx = context("slow")
    task = asyncio.create_task(invoke({"slow": slow}, call("slow"), ctx))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ctx.cancelled


# --------------------------------------------------------------------------- cancellation


async def test_cancel_during_an_async_tool_propagates() -> None:
    started = asyncio.Event()
    cleaned = asyncio.Event()
    delivered: list[ToolOutcome] = []

    async def slow() -> str:
        started.set()
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.set()
        return "late"

    t = as_tool(slow)
    ctx = context("slow")

    async def agent_side() -> None:
        delivered.append(await invoke({"slow": t}, call("slow"), ctx))

    task = asyncio.create_task(agent_side())
    await started.wait()
    assert task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert cleaned.is_set()
    assert ctx.cancelled
    assert delivered == []


async def test_cancel_during_a_sync_tool_propagates_and_the_thread_result_goes_nowhere(
    recwarn: pytest.WarningsRecorder,
) -> None:
    loop = asyncio.get_running_loop()
    loop_errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: loop_errors.append(context))
    started = threading.Event()
    thread_saw_cancel = threading.Event()
    thread_done = threading.Event()
    delivered: list[ToolOutcome] = []

    def slow(ctx: ToolContext) -> str:
        started.set()
        try:
            if ctx.wait_cancelled(30):
                thread_saw_cancel.set()
            return "the thread's late result"
        finally:
            thread_done.set()

    t = as_tool(slow)
    ctx = context("slow")

    async def agent_side() -> None:
        delivered.append(await invoke({"slow": t}, call("slow"), ctx))

    task = asyncio.create_task(agent_side())
    assert await asyncio.to_thread(started.wait, 10)
    assert not ctx.cancelled
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert ctx.cancelled
    assert await asyncio.to_thread(thread_done.wait, 10)
    assert thread_saw_cancel.is_set()
    for _ in range(5):  # let any callback the thread scheduled run
        await asyncio.sleep(0)
    assert delivered == []
    assert loop_errors == []
    assert list(recwarn) == []


async def test_cancel_at_each_await_of_invoke_always_propagates() -> None:
    """Cancel after 1, 2, ... loop yields until the call finishes on its own."""

    async def hops(n: int) -> str:
        for _ in range(n):
            await asyncio.sleep(0)
        return "done"

    t = tool(hops, timeout=30)
    for timed in (t, as_tool(hops)):
        for yields in range(8):
            ctx = context("hops")
            task = asyncio.create_task(invoke({"hops": timed}, call("hops", {"n": 4}), ctx))
            for _ in range(yields):
                await asyncio.sleep(0)
            if task.done():
                assert task.result() == ToolOutcome("done", False)
                assert not ctx.cancelled
                continue
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # Cancelled before its first step, invoke never ran: there was nothing to mark.
            assert ctx.cancelled is (yields > 0)


# --------------------------------------------------------------------------- context


def test_tool_context_flags_from_threads() -> None:
    ctx = context()
    assert not ctx.cancelled
    ctx.check()  # does nothing yet
    assert ctx.wait_cancelled(0) is False
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(ctx.wait_cancelled(30)))
    waiter.start()
    ctx.mark_cancelled()
    waiter.join(10)
    assert woke == [True]
    assert ctx.cancelled
    assert ctx.wait_cancelled() is True
    ctx.mark_cancelled()  # idempotent
    with pytest.raises(asyncio.CancelledError, match=r"tool 't' \(call 'c1'\) was cancelled"):
        ctx.check()
    assert "cancelled=True" in repr(ctx)
    assert ToolContext(agent="a", call_id="x", tool_name="t").interrupt_requested is False


# --------------------------------------------------------------------------- pydantic types


class City(pydantic.BaseModel):
    name: str = pydantic.Field(description="the city's name")
    country: str | None = None


class Weather(pydantic.BaseModel):
    """The weather at a place."""

    city: City
    celsius: Annotated[float, pydantic.Field(ge=-90, le=60)]
    tags: list[str] = []


class Loop(pydantic.BaseModel):
    next: "Loop | None" = None


def report(weather: Weather, days: Annotated[int, pydantic.Field(ge=1, le=7)] = 1) -> str:
    """Report the weather."""
    return f"{weather.city.name}: {weather.celsius} for {days} day(s), {type(weather).__name__}"


def test_a_pydantic_model_parameter_is_one_inlined_schema() -> None:
    schema = as_tool(report).parameters
    assert schema["required"] == ["weather"]
    weather = schema["properties"]["weather"]
    assert weather == {
        "type": "object",
        "description": "The weather at a place.",
        "properties": {
            "city": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "description": "the city's name"},
                    "country": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
                },
                "required": ["name"],
            },
            "celsius": {"type": "number", "minimum": -90, "maximum": 60},
            "tags": {"type": "array", "items": {"type": "string"}, "default": []},
        },
        "required": ["city", "celsius"],
    }
    assert schema["properties"]["days"] == {
        "type": "integer", "minimum": 1, "maximum": 7, "default": 1
    }
    assert "$ref" not in json.dumps(schema) and "title" not in json.dumps(schema)


async def test_pydantic_arguments_are_validated_and_errors_read_as_places() -> None:
    good = {"weather": {"city": {"name": "Oslo"}, "celsius": -3}, "days": 2}
    assert await run(report, good) == ToolOutcome("Oslo: -3.0 for 2 day(s), Weather", False)
    bad = await run(report, {"weather": {"city": {"name": 3}, "celsius": 99}, "days": 9})
    assert bad.is_error
    assert bad.content == (
        "invalid arguments for tool 'report': argument 'weather': "
        "weather.city.name: Input should be a valid string, got 3 (integer); "
        "weather.celsius: Input should be less than or equal to 60, got 99 (integer); "
        "argument 'days': Input should be less than or equal to 7, got 9 (integer). "
        "Expected report(weather: Weather {city: object {name: string, country?: string or "
        "null}, celsius: number (>= -90, <= 60), tags?: array of string}, "
        "days?: integer (>= 1, <= 7)); fix the arguments and call it again."
    )


async def test_field_constraints_on_plain_types_and_optional_ones() -> None:
    def pick(
        n: Annotated[int, pydantic.Field(gt=0, description="how many")],
        code: Annotated[str, pydantic.Field(pattern=r"^[A-Z]{3}$")] | None = None,
    ) -> str:
        """Pick."""
        return f"{n} {code}"

    params = props(pick)
    assert params["n"] == {"type": "integer", "exclusiveMinimum": 0, "description": "how many"}
    assert params["code"] == {"type": ["string", "null"], "pattern": "^[A-Z]{3}$", "default": None}
    assert await run(pick, {"n": 2, "code": "EUR"}) == ToolOutcome("2 EUR", False)
    assert await run(pick, {"n": 2, "code": None}) == ToolOutcome("2 None", False)
    refused = await run(pick, {"n": 0, "code": "euro"})
    assert "argument 'n': Input should be greater than 0, got 0 (integer)" in refused.content
    assert (
        "argument 'code': expected string (matching ^[A-Z]{3}$) or null, got \"euro\" (string)"
        in refused.content
    )


async def test_types_the_compiler_has_no_rule_for_come_from_pydantic() -> None:
    def when(day: datetime.date, ids: set[int], key: uuid.UUID) -> str:
        """When."""
        return f"{day!r} {sorted(ids)} {key.version}"

    params = props(when)
    assert params["day"] == {"type": "string", "format": "date"}
    assert params["ids"] == {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    outcome = await run(
        when, {"day": "2026-12-02", "ids": [3, 1], "key": "12345678-1234-4234-8234-123456789012"}
    )
    assert outcome == ToolOutcome("datetime.date(2026, 12, 2) [1, 3] 4", False)
    refused = await run(when, {"day": "soon", "ids": [], "key": "x"})
    assert "argument 'day': Input should be a valid date" in refused.content


def test_pydantic_definition_errors_name_tool_and_parameter() -> None:
    def looped(loop: Loop) -> None: ...

    with pytest.raises(ToolDefinitionError, match=r"parameter 'loop'.*Loop refers to itself"):
        as_tool(looped)

    def field_default(n: int = pydantic.Field(default=3, ge=1)) -> None: ...

    with pytest.raises(
        ToolDefinitionError, match=r"parameter 'n': a pydantic Field\(...\) as the default"
    ):
        as_tool(field_default)


PLAIN_TOOL_SCRIPT = """
import sys
from aimu import aio

def add(a: int, b: list[dict[str, float]] | None = None) -> int:
    "Add."
    return a

aio.Agent(aio.client("test"), tools=[add])
assert "pydantic" not in sys.modules, "pydantic was imported"
"""


def test_plain_tools_never_import_pydantic() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PLAIN_TOOL_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


async def test_a_model_over_the_wire_gets_the_schema_and_the_validation_error() -> None:
    bad = {"weather": {"city": {"name": "Oslo"}, "celsius": 99}}
    good = {"weather": {"city": {"name": "Oslo"}, "celsius": 9}}
    turns = [
        Turn(tool_calls=(ScriptedCall("report", bad),)),
        Turn(tool_calls=(ScriptedCall("report", good),)),
        Turn(text="done"),
    ]
    async with LoopbackServer(turns) as server:
        model = aio.client("openai:m", base_url=server.openai_base_url, api_key="x")
        try:
            agent = aio.Agent(model, tools=[report])
            assert await agent.run("the weather?") == "done"
        finally:
            await model.aclose()
    results = [m["content"] for m in agent.model_client.messages if m["role"] == "tool"]
    assert results[0].startswith(
        "invalid arguments for tool 'report': argument 'weather.celsius': "
        "Input should be less than or equal to 60, got 99 (integer)."
    )
    assert results[1] == "Oslo: 9.0 for 1 day(s), Weather"
    sent = server.requests[0].body["tools"][0]["function"]["parameters"]
    assert sent == as_tool(report).parameters  # the inlined schema, as built
