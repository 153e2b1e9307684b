"""A tool's parameters: read from its signature once, then the model's arguments bound to them.

:meth:`Parameters.of` compiles every parameter's hint (see ``_schema``) into the JSON
schema object a provider sends and one converter per parameter; :meth:`Parameters.bind`
checks a model's arguments against them and raises :class:`BadArguments` listing every
problem, in words the model can act on.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, get_origin

from aimu.aio.errors import ToolDefinitionError
from aimu.aio.tools._context import ToolContext
from aimu.aio.tools._nodes import Convert, InvalidValue, nullable, shown_value
from aimu.aio.tools._pydantic import is_pydantic_field
from aimu.aio.tools._schema import SchemaCompiler

__all__ = ["BadArguments", "Parameters"]


class BadArguments(Exception):
    """A model's arguments do not fit the tool; the message says what to fix."""

    def __init__(self, tool_name: str, signature_text: str, problems: list[str]) -> None:
        super().__init__(
            f"invalid arguments for tool {tool_name!r}: {'; '.join(problems)}. "
            f"Expected {signature_text}; fix the arguments and call it again."
        )


def is_context(hint: object) -> bool:
    if get_origin(hint) is Annotated:
        hint = hint.__origin__  # type: ignore[attr-defined]
    return hint is ToolContext or get_origin(hint) is ToolContext  # ToolContext[MyDeps]


@dataclasses.dataclass(slots=True)
class _Collected:
    """What reading the signature gathers, parameter by parameter."""

    properties: dict[str, Any] = dataclasses.field(default_factory=dict)
    converters: dict[str, Convert] = dataclasses.field(default_factory=dict)
    required: list[str] = dataclasses.field(default_factory=list)
    positional: list[tuple[str, object]] = dataclasses.field(default_factory=list)
    shown: list[str] = dataclasses.field(default_factory=list)
    context_param: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Parameters:
    """The compiled parameters of one tool."""

    tool_name: str
    schema: dict[str, Any]
    """The JSON schema object of the arguments (shares nothing with other tools)."""
    converters: Mapping[str, Convert]
    required: tuple[str, ...]
    required_set: frozenset[str]
    positional: tuple[tuple[str, object], ...]
    """Positional-only parameters in order, with their defaults (``Parameter.empty``)."""
    context_param: str | None
    signature_text: str
    """``name(a: integer, b?: string)``, for ``repr`` and error messages."""
    raw: bool = False
    """The schema came from elsewhere (an MCP server): the arguments object is passed
    whole, as ``arguments``, and checked by whoever runs the tool."""

    @classmethod
    def from_schema(cls, tool_name: str, schema: dict[str, Any]) -> Parameters:
        """Parameters that take the model's arguments object as is (``raw``): the tool
        gets it as ``arguments`` and its context as ``ctx``."""
        return cls(
            tool_name=tool_name,
            schema=schema,
            converters={},
            required=(),
            required_set=frozenset(),
            positional=(),
            context_param="ctx",
            signature_text=f"{tool_name}(arguments: object)",
            raw=True,
        )

    @classmethod
    def of(
        cls,
        tool_name: str,
        fn: Callable[..., Any],
        target: Callable[..., Any],
        bound: set[str],
        described: Mapping[str, str],
    ) -> Parameters:
        """Compile ``fn``'s parameters (hints read from ``target``), minus ``bound`` ones."""
        try:
            hints = typing.get_type_hints(target, include_extras=True)
        except Exception as exc:
            raise ToolDefinitionError(
                f"tool {tool_name!r}: cannot resolve its type hints "
                f"({type(exc).__name__}: {exc}); define the types it names at module level"
            ) from None
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError) as exc:
            raise ToolDefinitionError(
                f"tool {tool_name!r}: cannot read its signature: {exc}"
            ) from None
        compiler = SchemaCompiler(tool_name)
        collected = _Collected()
        for param in signature.parameters.values():
            if param.name not in bound:  # a partial's keyword is not the model's to choose
                compiler.param = param.name
                _collect(compiler, collected, param, hints, described)
        required = tuple(collected.required)
        schema = {
            "type": "object",
            "properties": collected.properties,
            "required": list(required),
            "additionalProperties": False,
        }
        return cls(
            tool_name=tool_name,
            # A deep copy: compiled nodes share schema dicts, a tool's schema must share none.
            schema=copy.deepcopy(schema),
            converters=collected.converters,
            required=required,
            required_set=frozenset(required),
            positional=tuple(collected.positional),
            context_param=collected.context_param,
            signature_text=f"{tool_name}({', '.join(collected.shown)})",
        )

    def bind(self, arguments: object) -> dict[str, object]:
        """The model's arguments checked and converted, or :class:`BadArguments`."""
        if type(arguments) is str:  # some servers send the JSON text itself
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as exc:
                raise self._bad([f"the arguments are not valid JSON ({exc})"]) from None
        if type(arguments) is not dict:
            raise self._bad([f"the arguments must be a JSON object, got {shown_value(arguments)}"])
        if self.raw:
            return {"arguments": arguments}
        converters = self.converters
        out: dict[str, object] = {}
        problems: list[str] = []
        for key, value in arguments.items():
            convert = converters.get(key)
            if convert is None:
                problems.append(f"unknown argument {key!r}")
                continue
            try:
                out[key] = convert(value, key)
            except InvalidValue as exc:
                problems.append(f"argument '{exc.path}': {exc.problem}")
        if self.required and not self.required_set.issubset(arguments):
            missing = [name for name in self.required if name not in arguments]
            problems.append(f"missing required argument {', '.join(map(repr, missing))}")
        if problems:
            raise self._bad(problems)
        return out

    def _bad(self, problems: list[str]) -> BadArguments:
        return BadArguments(self.tool_name, self.signature_text, problems)


def _collect(
    compiler: SchemaCompiler,
    collected: _Collected,
    param: inspect.Parameter,
    hints: Mapping[str, Any],
    described: Mapping[str, str],
) -> None:
    """Add one parameter: the context slot, or its schema, converter and place."""
    if param.kind is param.VAR_POSITIONAL or param.kind is param.VAR_KEYWORD:
        star = "*" if param.kind is param.VAR_POSITIONAL else "**"
        raise compiler.fail(
            f"{star}{param.name} cannot be offered to a model; declare each argument"
        )
    if param.kind is param.POSITIONAL_ONLY:
        collected.positional.append((param.name, param.default))
    hint = hints.get(param.name, inspect.Parameter.empty)
    if is_context(hint):
        if collected.context_param is not None:
            raise compiler.fail(
                f"a second ToolContext parameter (the first is {collected.context_param!r})"
            )
        collected.context_param = param.name
        return
    if is_pydantic_field(param.default):  # we call the function itself, which sees the Field
        raise compiler.fail(
            "a pydantic Field(...) as the default is not applied when the tool is called; "
            f"write `{param.name}: Annotated[T, Field(...)] = default` instead"
        )
    node = compiler.compile(hint)
    if param.default is None:
        node = nullable(node)
    node = SchemaCompiler.field(node, described.get(param.name))
    schema = node.schema
    if param.default is param.empty:
        collected.required.append(param.name)
    else:
        schema = {**schema, "default": compiler.json_default(param.default, "default")}
    collected.properties[param.name] = schema
    collected.converters[param.name] = node.convert
    optional = "" if param.default is param.empty else "?"
    collected.shown.append(f"{param.name}{optional}: {node.text}")
