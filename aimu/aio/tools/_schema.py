"""The schema compiler: a type hint becomes a JSON schema and a converter, built together.

:class:`SchemaCompiler` turns each parameter's hint into a :class:`TypeNode`: the JSON
schema a provider sends, a short text for error messages, and a converter that checks
a model's value and turns it into the declared Python type (raising
:class:`InvalidValue`). Schema and check come from one place, so they cannot disagree.

Choices: a hint-less parameter takes any JSON value; an integral float (``3.0``) is
accepted for ``int``; a ``None`` default also allows null.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import types
import typing
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from typing import (
    Annotated,
    Any,
    Literal,
    NotRequired,
    Required,
    Union,
    cast,
    get_args,
    get_origin,
)

from typing_extensions import is_typeddict

from aimu.aio.errors import ToolDefinitionError
from aimu.aio.tools._docstring import own_doc, parse_docstring
from aimu.aio.tools._json_values import to_json
from aimu.aio.tools._nodes import (
    JSON_KIND,
    SCALARS,
    InvalidValue,
    TypeNode,
    any_node,
    expected,
    nullable,
)
from aimu.aio.tools._pydantic import pydantic_node, wants_pydantic

__all__ = ["SchemaCompiler"]


class SchemaCompiler:
    """Builds :class:`TypeNode` trees for one tool; errors name the tool and parameter."""

    def __init__(self, tool_name: str) -> None:
        self.tool_name = tool_name
        self.param = ""
        self._building: list[type] = []

    def fail(self, problem: str) -> ToolDefinitionError:
        where = f"tool {self.tool_name!r}"
        if self.param:
            where += f", parameter {self.param!r}"
        return ToolDefinitionError(f"{where}: {problem}")

    def json_default(self, value: object, what: str) -> Any:
        try:
            return json.loads(json.dumps(value, default=to_json, allow_nan=False))
        except (TypeError, ValueError):
            raise self.fail(
                f"{what} {value!r:.60} is a {type(value).__name__}, which is not "
                "JSON-serialisable; use None (or a JSON value) and build it inside the tool"
            ) from None

    def compile(self, hint: object) -> TypeNode:
        origin = get_origin(hint)
        if wants_pydantic(hint):  # a pydantic model, or Annotated[T, Field(...)]
            return _described(pydantic_node(hint, self.refuse(hint)), hint)
        if origin is Annotated:
            return _described(self.compile(hint.__origin__), hint)  # type: ignore[attr-defined]
        if origin is Required or origin is NotRequired:
            return self.compile(get_args(hint)[0])
        if hint is Any or hint is object or hint is inspect.Parameter.empty:
            return any_node()
        scalar = SCALARS.get(hint) if isinstance(hint, type) or hint is None else None
        if scalar is not None:
            return scalar
        if origin is Union or origin is types.UnionType:
            return self.union_of(get_args(hint))
        if origin is Literal:
            return self.literal_of(get_args(hint))
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return self.enum_of(hint)
        if hint in (list, tuple, dict, Sequence, MutableSequence, Mapping, MutableMapping):
            origin, hint = hint, hint  # bare containers: items of any type
        if origin in (list, Sequence, MutableSequence):
            return self.array_of(get_args(hint))
        if origin is tuple:
            return self.tuple_of(get_args(hint))
        if origin in (dict, Mapping, MutableMapping):
            return self.mapping_of(get_args(hint))
        if is_typeddict(hint):
            return self.typeddict_of(cast(type, hint))
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            return self.dataclass_of(hint)
        if hint in (bytes, bytearray):  # a model sends text: say so rather than encode it
            raise self.refuse(hint)("a model sends text, not bytes")
        # The rest, if pydantic knows it: dates and times, UUID, Decimal, sets...
        return pydantic_node(hint, self.refuse(hint))

    def refuse(self, hint: object) -> Callable[[str], ToolDefinitionError]:
        """What a hint without a JSON schema raises, given why."""

        def refusal(why: str) -> ToolDefinitionError:
            return self.fail(
                f"type {hint!r} has no JSON schema ({why}); use str, int, float, bool, None, "
                "list, tuple, dict[str, T], Optional, Literal, an Enum, a TypedDict, a "
                "dataclass, a pydantic model or Annotated[T, Field(...)]"
            )

        return refusal

    def union_of(self, members: tuple[object, ...]) -> TypeNode:
        allows_null = any(m is None or m is type(None) for m in members)
        nodes = [self.compile(m) for m in members if m is not None and m is not type(None)]
        if len(nodes) == 1:
            node = nodes[0]
        else:
            converts = [n.convert for n in nodes]
            text = " or ".join(n.text for n in nodes)

            def convert(value: object, path: str) -> object:
                # The first member that accepts the value wins, as in the declared order.
                for member in converts:
                    try:
                        return member(value, path)
                    except InvalidValue:
                        continue
                raise InvalidValue(path, expected(text, value))

            node = TypeNode(
                {"anyOf": [n.schema for n in nodes]},
                text,
                convert,
                nullable=any(n.nullable for n in nodes),
            )
        return nullable(node) if allows_null else node

    def literal_of(self, values: tuple[object, ...]) -> TypeNode:
        pairs: list[tuple[object, object]] = []  # (JSON value, Python value)
        for value in values:
            wire = value.value if isinstance(value, enum.Enum) else value
            if wire is not None and type(wire) not in (str, int, bool, float):
                raise self.fail(f"Literal value {value!r} is not a JSON scalar")
            pairs.append((wire, value))
        return self.choice_of(pairs)

    def enum_of(self, cls: type[enum.Enum]) -> TypeNode:
        pairs: list[tuple[object, object]] = []
        for member in cls:
            if member.value is not None and type(member.value) not in (str, int, bool, float):
                raise self.fail(
                    f"{cls.__name__}.{member.name} has value {member.value!r}; an Enum offered "
                    "to a model needs str or int values"
                )
            pairs.append((member.value, member))
        node = self.choice_of(pairs)
        return dataclasses.replace(node, text=f"{cls.__name__} ({node.text})")

    def choice_of(self, pairs: list[tuple[object, object]]) -> TypeNode:
        # Keyed by (type, value) so that True never matches 1, nor 1 match 1.0.
        table = {(type(wire), wire): value for wire, value in pairs}
        wires = [wire for wire, _ in pairs]
        kinds = {JSON_KIND[type(w)] for w in wires}
        allows_null = None in wires
        schema: dict[str, Any] = {"enum": wires}
        if len(kinds) == 1 and not allows_null:
            schema = {"type": kinds.pop(), "enum": wires}
        text = " | ".join(json.dumps(w) for w in wires)

        def convert(value: object, path: str) -> object:
            try:
                return table[(type(value), value)]
            except (KeyError, TypeError):  # TypeError: an unhashable list or dict
                raise InvalidValue(path, expected(f"one of {text}", value)) from None

        return TypeNode(schema, text, convert, nullable=allows_null)

    def array_of(self, args: tuple[object, ...]) -> TypeNode:
        item = self.compile(args[0]) if args else any_node()
        item_convert = item.convert

        def convert(value: object, path: str) -> object:
            if type(value) is not list:
                raise InvalidValue(path, expected(f"array of {item.text}", value))
            return [item_convert(v, f"{path}[{i}]") for i, v in enumerate(value)]

        return TypeNode({"type": "array", "items": item.schema}, f"array of {item.text}", convert)

    def tuple_of(self, args: tuple[object, ...]) -> TypeNode:
        if not args or (len(args) == 2 and args[1] is Ellipsis):
            item = self.compile(args[0]) if args else any_node()
            listed = self.array_of((args[0],) if args else ()).convert

            def convert_varying(value: object, path: str) -> object:
                return tuple(cast(list[object], listed(value, path)))

            text = f"array of {item.text}"
            return TypeNode({"type": "array", "items": item.schema}, text, convert_varying)
        if args == ((),):  # tuple[()]: the empty tuple
            args = ()
        items = [self.compile(a) for a in args]
        text = "[" + ", ".join(n.text for n in items) + "]"
        count = len(items)

        def convert(value: object, path: str) -> object:
            if type(value) is not list or len(value) != count:
                raise InvalidValue(path, expected(f"array of {count} items {text}", value))
            return tuple(
                n.convert(v, f"{path}[{i}]")
                for i, (n, v) in enumerate(zip(items, value, strict=True))
            )

        schema = {
            "type": "array",
            "prefixItems": [n.schema for n in items],
            "items": False,
            "minItems": count,
            "maxItems": count,
        }
        return TypeNode(schema, text, convert)

    def mapping_of(self, args: tuple[object, ...]) -> TypeNode:
        if args and args[0] is not str:
            raise self.fail(f"dict keys must be str (JSON object keys), not {args[0]!r}")
        item = self.compile(args[1]) if args else any_node()
        item_convert = item.convert
        text = f"object of {item.text}"

        def convert(value: object, path: str) -> object:
            if type(value) is not dict:
                raise InvalidValue(path, expected(text, value))
            return {k: item_convert(v, f"{path}[{json.dumps(k)}]") for k, v in value.items()}

        schema: dict[str, Any] = {"type": "object"}
        if args:
            schema["additionalProperties"] = item.schema
        return TypeNode(schema, text, convert)

    def enter(self, cls: type) -> None:
        if cls in self._building:
            raise self.fail(f"{cls.__name__} refers to itself; recursive types are not supported")
        self._building.append(cls)

    def hints_of(self, cls: type) -> dict[str, Any]:
        try:
            return typing.get_type_hints(cls, include_extras=True)
        except Exception as exc:
            raise self.fail(f"cannot resolve the type hints of {cls.__name__}: {exc}") from None

    def typeddict_of(self, cls: type) -> TypeNode:
        self.enter(cls)
        _, described = parse_docstring(cls.__doc__)
        hints = self.hints_of(cls)
        required = cast(frozenset[str], getattr(cls, "__required_keys__", frozenset(hints)))
        fields = {
            name: self.field(self.compile(hint), described.get(name))
            for name, hint in hints.items()
        }
        self._building.pop()
        return self.record(cls, fields, [n for n in hints if n in required], {}, dict)

    def dataclass_of(self, cls: type) -> TypeNode:
        self.enter(cls)
        summary, described = parse_docstring(own_doc(cls))
        hints = self.hints_of(cls)
        fields: dict[str, TypeNode] = {}
        required: list[str] = []
        defaults: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            node = self.field(self.compile(hints.get(f.name, Any)), described.get(f.name))
            if f.default is not dataclasses.MISSING:
                defaults[f.name] = self.json_default(f.default, f"default of field {f.name!r}")
                if f.default is None:
                    node = nullable(node)
            elif f.default_factory is dataclasses.MISSING:
                required.append(f.name)
            fields[f.name] = node
        self._building.pop()
        node = self.record(cls, fields, required, defaults, cls)
        if summary:
            node.schema["description"] = summary
        return node

    @staticmethod
    def field(node: TypeNode, description: str | None) -> TypeNode:
        if description and "description" not in node.schema:
            return dataclasses.replace(node, schema={**node.schema, "description": description})
        return node

    def record(
        self,
        cls: type,
        fields: dict[str, TypeNode],
        required: list[str],
        defaults: dict[str, Any],
        build: Callable[..., object],
    ) -> TypeNode:
        properties: dict[str, Any] = {}
        for name, node in fields.items():
            properties[name] = node.schema
            if name in defaults:
                properties[name] = {**node.schema, "default": defaults[name]}
        shown = ", ".join(
            f"{name}{'' if name in required else '?'}: {node.text}" for name, node in fields.items()
        )
        text = f"{cls.__name__} {{{shown}}}"
        checker = object_checker(fields, required, text)
        name = cls.__name__

        def convert(value: object, path: str) -> object:
            converted = checker(value, path)
            if build is dict:
                return converted
            try:
                return build(**converted)
            except Exception as exc:  # the type's own checks (__post_init__) refused it
                problem = f"{name} rejected it: {type(exc).__name__}: {exc}"
                raise InvalidValue(path, problem) from None

        schema = {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }
        return TypeNode(schema, text, convert)


def _described(node: TypeNode, hint: object) -> TypeNode:
    """``node`` with the first ``str`` of an ``Annotated`` hint's metadata as description."""
    metadata = getattr(hint, "__metadata__", ())
    described = [m for m in metadata if isinstance(m, str)]
    if not described:
        return node
    return dataclasses.replace(node, schema={**node.schema, "description": described[0]})


def object_checker(
    fields: Mapping[str, TypeNode], required: Sequence[str], text: str
) -> Callable[[object, str], dict[str, object]]:
    """Checks a JSON object field by field: unknown keys, missing keys, each value."""
    converts = {name: node.convert for name, node in fields.items()}
    required_set = frozenset(required)

    def check(value: object, path: str) -> dict[str, object]:
        if type(value) is not dict:
            raise InvalidValue(path, expected(f"object {text}", value))
        out: dict[str, object] = {}
        for key, item in value.items():
            convert = converts.get(key)
            if convert is None:
                known = ", ".join(repr(k) for k in fields) or "none"
                raise InvalidValue(f"{path}.{key}", f"unknown field; known fields: {known}")
            out[key] = convert(item, f"{path}.{key}")
        if len(out) < len(required_set) or not required_set.issubset(out):
            missing = [k for k in required if k not in out]
            raise InvalidValue(path, f"missing required field {', '.join(map(repr, missing))}")
        return out

    return check

