"""Types the schema compiler hands to pydantic: models, ``Field`` constraints, and more.

A pydantic ``BaseModel``, an ``Annotated[T, Field(...)]`` (or ``annotated_types``)
constraint, and any type the compiler has no rule for (``datetime.date``, ``UUID``,
``Decimal``...) become one :class:`~aimu.aio.tools._nodes.TypeNode` built from one
``pydantic.TypeAdapter``: its JSON schema and its validation, so the two cannot
disagree. Validation is pydantic's own (lax unless the model says ``strict``).
pydantic, installed with ``ollama``, is imported only when a tool names such a type.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Annotated, Any, cast, get_origin

from aimu.aio.tools._nodes import InvalidValue, TypeNode, shown_value

__all__ = ["is_pydantic_field", "pydantic_node", "wants_pydantic"]

_CONSTRAINTS = (
    ("minimum", ">="),
    ("exclusiveMinimum", ">"),
    ("maximum", "<="),
    ("exclusiveMaximum", "<"),
    ("multipleOf", "multiple of"),
    ("minLength", "length >="),
    ("maxLength", "length <="),
    ("pattern", "matching"),
    ("minItems", "items >="),
    ("maxItems", "items <="),
    ("format", "format"),
)


def _from_pydantic(value: object) -> bool:
    module = type(value).__module__
    return module.startswith(("pydantic.", "annotated_types"))


def is_pydantic_field(value: object) -> bool:
    """True for a ``pydantic.Field(...)`` (a ``FieldInfo``), without importing pydantic."""
    return type(value).__name__ == "FieldInfo" and _from_pydantic(value)


def wants_pydantic(hint: object) -> bool:
    """True for a pydantic model, or ``Annotated`` with pydantic or annotated_types metadata."""
    if get_origin(hint) is Annotated:
        return any(_from_pydantic(m) for m in hint.__metadata__)  # type: ignore[attr-defined]
    pydantic = sys.modules.get("pydantic")  # a model's module imported pydantic already
    return (
        pydantic is not None
        and isinstance(hint, type)
        and issubclass(hint, pydantic.BaseModel)
    )


def pydantic_node(hint: object, fail: Callable[[str], Exception]) -> TypeNode:
    """The node of ``hint`` from a ``TypeAdapter``; ``fail(problem)`` if pydantic refuses it."""
    import pydantic  # here, not at the top: ~150 ms, paid only by tools that need it

    try:
        adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(cast(Any, hint))
        schema = adapter.json_schema()
    except (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError) as exc:
        raise fail(f"type {hint!r} has no JSON schema: {_first_line(exc)}") from None
    definitions = schema.pop("$defs", {})
    schema = _inline(schema, definitions, fail, ())
    name = getattr(hint, "__name__", None) if isinstance(hint, type) else None
    text = _text(schema, name)
    validate = adapter.validate_python
    validation_error = pydantic.ValidationError

    def convert(value: object, path: str) -> object:
        try:
            return validate(value)
        except validation_error as exc:
            raise _invalid(exc.errors(include_url=False), path) from None

    return TypeNode(schema, text, convert, nullable=_allows_null(schema))


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _invalid(errors: list[Any], path: str) -> InvalidValue:
    """One :class:`InvalidValue` for pydantic's errors, each at its place under ``path``."""
    problems = []
    for error in errors:
        where = path + "".join(
            f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]
        )
        problems.append((where, f"{error['msg']}, got {shown_value(error.get('input'))}"))
    if len(problems) == 1:
        return InvalidValue(*problems[0])
    return InvalidValue(path, "; ".join(f"{where}: {problem}" for where, problem in problems))


def _inline(
    schema: Any,
    definitions: Mapping[str, Any],
    fail: Callable[[str], Exception],
    seen: tuple[str, ...],
) -> Any:
    """``schema`` with every ``$ref`` replaced by its definition and titles dropped.

    Inlined because providers differ in what they read (Ollama's client drops
    ``$defs``); a model that refers to itself cannot be inlined and is refused.
    """
    if isinstance(schema, list):
        return [_inline(item, definitions, fail, seen) for item in schema]
    if not isinstance(schema, dict):
        return schema
    reference = schema.get("$ref")
    if isinstance(reference, str) and reference.startswith("#/$defs/"):
        name = reference.removeprefix("#/$defs/")
        if name in seen:
            raise fail(f"{name} refers to itself; recursive types are not supported")
        target = _inline(definitions[name], definitions, fail, (*seen, name))
        extra = {k: v for k, v in schema.items() if k != "$ref"}
        return {**target, **_inline(extra, definitions, fail, seen)}
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title":
            continue
        if key == "properties" and isinstance(value, dict):
            out[key] = {n: _inline(v, definitions, fail, seen) for n, v in value.items()}
        else:
            out[key] = _inline(value, definitions, fail, seen)
    return out


def _allows_null(schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return True
    return any(_allows_null(member) for member in schema.get("anyOf", ()))


def _text(schema: Mapping[str, Any], name: str | None = None) -> str:
    """A short description of a schema for error messages: ``integer (>= 1)``."""
    if "enum" in schema:
        text = " | ".join(repr(v) for v in schema["enum"])
    elif "anyOf" in schema:
        text = " or ".join(_text(member) for member in schema["anyOf"])
    elif schema.get("type") == "object" and "properties" in schema:
        required = set(schema.get("required", ()))
        fields = ", ".join(
            f"{field}{'' if field in required else '?'}: {_text(sub)}"
            for field, sub in schema["properties"].items()
        )
        text = f"{name or 'object'} {{{fields}}}"
    elif schema.get("type") == "array":
        text = f"array of {_text(schema.get('items', {}))}"
    else:
        text = str(schema.get("type", "any JSON value"))
    limits = [f"{word} {schema[key]}" for key, word in _CONSTRAINTS if key in schema]
    return f"{text} ({', '.join(limits)})" if limits else text
