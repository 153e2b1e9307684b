"""Compiled types: a JSON schema, a short text and a converter, and the scalar ones.

A :class:`TypeNode`'s converter checks a value a model sent and returns it as the
declared Python type, or raises :class:`InvalidValue` saying what was wrong and where.
An integral float (``3.0``) is accepted for ``int``: JSON has one number type.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any, TypeAlias

__all__ = [
    "JSON_KIND",
    "SCALARS",
    "Convert",
    "InvalidValue",
    "TypeNode",
    "any_node",
    "expected",
    "nullable",
    "shown_value",
]


class InvalidValue(Exception):
    """An argument does not match its schema; ``problem`` says how."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


Convert: TypeAlias = Callable[[object, str], object]


@dataclasses.dataclass(slots=True)
class TypeNode:
    """One compiled type: its JSON schema, a short text for messages, and its converter."""

    schema: dict[str, Any]
    text: str
    convert: Convert
    nullable: bool = False


JSON_KIND = {
    str: "string",
    bool: "boolean",
    int: "integer",
    float: "number",
    list: "array",
    dict: "object",
    type(None): "null",
}


def shown_value(value: object) -> str:
    """A value as the model sent it, short, with its JSON kind."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = JSON_KIND.get(type(value), type(value).__name__)
    return f"{text} ({kind})"


def expected(text: str, value: object) -> str:
    return f"expected {text}, got {shown_value(value)}"


def any_node() -> TypeNode:
    return TypeNode({}, "any JSON value", lambda value, path: value, nullable=True)


def _str(value: object, path: str) -> object:
    if type(value) is str:
        return value
    raise InvalidValue(path, expected("string", value))


def _int(value: object, path: str) -> object:
    if type(value) is int:
        return value
    # JSON has one number type: 3.0 is an integer there, and some models send it.
    if type(value) is float and value.is_integer():
        return int(value)
    raise InvalidValue(path, expected("integer", value))


def _float(value: object, path: str) -> object:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise InvalidValue(path, expected("number", value))


def _bool(value: object, path: str) -> object:
    if type(value) is bool:
        return value
    raise InvalidValue(path, expected("boolean", value))


def _none(value: object, path: str) -> object:
    if value is None:
        return None
    raise InvalidValue(path, expected("null", value))


SCALARS: dict[object, TypeNode] = {
    str: TypeNode({"type": "string"}, "string", _str),
    int: TypeNode({"type": "integer"}, "integer", _int),
    float: TypeNode({"type": "number"}, "number", _float),
    bool: TypeNode({"type": "boolean"}, "boolean", _bool),
    type(None): TypeNode({"type": "null"}, "null", _none, nullable=True),
    None: TypeNode({"type": "null"}, "null", _none, nullable=True),
}


def nullable(node: TypeNode) -> TypeNode:
    """``node`` that also accepts null, as a type list where it can (Ollama reads those)."""
    if node.nullable:
        return node
    schema = dict(node.schema)
    kind = schema.get("type")
    if isinstance(kind, str):
        schema["type"] = [kind, "null"]
        if "enum" in schema:
            schema["enum"] = [*schema["enum"], None]
    elif "enum" in schema and "type" not in schema:
        schema["enum"] = [*schema["enum"], None]
    else:
        description = schema.pop("description", None)
        schema = {"anyOf": [schema, {"type": "null"}]}
        if description is not None:
            schema["description"] = description
    inner = node.convert
    text = f"{node.text} or null"

    def convert(value: object, path: str) -> object:
        if value is None:
            return None
        try:
            return inner(value, path)
        except InvalidValue as exc:
            if exc.path != path:  # a deeper problem already says what was wrong
                raise
            raise InvalidValue(path, expected(text, value)) from None

    return TypeNode(schema, text, convert, nullable=True)


