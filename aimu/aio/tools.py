"""Tools: plain functions offered to a model, their JSON schema, and how a call runs.

:func:`as_tool` turns a function (sync or async, a ``functools.partial``, a bound
method) into a :class:`Tool`: the schema comes from its type hints and docstring and
is compiled once, together with a validator that checks a model's arguments and
converts them to the declared Python types. :func:`invoke` runs one call and always
returns a :class:`ToolOutcome` the model can read -- except ``CancelledError``, which
always propagates.

Choices made here: a parameter without an annotation takes any JSON value; a ``None``
default also allows null; an integral float (``3.0``) is accepted for ``int``; a
return value of ``None`` becomes ``"null"``, like every non-str value turned into JSON.

Sync tools run in a worker thread. A thread cannot be killed: on a cancel or timeout
the caller moves on at once, the thread runs to its end, and its result goes nowhere.
A long sync tool should take a ``ctx: ToolContext`` parameter and watch
``ctx.cancelled`` (or call ``ctx.check()``) to stop early.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
import enum
import functools
import inspect
import json
import math
import re
import threading
import types
import typing
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from typing import (
    Annotated,
    Any,
    Literal,
    NotRequired,
    Required,
    TypeAlias,
    Union,
    cast,
    get_args,
    get_origin,
    overload,
)

from typing_extensions import is_typeddict

from aimu.aio.errors import ToolDefinitionError
from aimu.aio.transcript import ToolCall, ToolSpec

__all__ = ["Tool", "ToolContext", "ToolOutcome", "as_tool", "invoke", "tool"]

# Names OpenAI-compatible servers accept for a function.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


# --------------------------------------------------------------------------- context


def _never() -> bool:
    return False


# One lock for all contexts: it guards only the lazy creation of an Event, which
# most calls never need (creating one per call would cost more than the call).
_EVENT_LOCK = threading.Lock()


class ToolContext:
    """What a running tool may know about its run; safe to read from a worker thread.

    ``cancelled`` turns true when the run is cancelled or this call times out; a sync
    tool should then stop (``check()`` raises ``CancelledError`` for it).
    """

    __slots__ = ("_cancelled", "_event", "_interrupt_probe", "agent", "call_id", "tool_name")

    def __init__(
        self,
        *,
        agent: str,
        call_id: str,
        tool_name: str,
        interrupt_probe: Callable[[], bool] = _never,
    ) -> None:
        self.agent = agent
        self.call_id = call_id
        self.tool_name = tool_name
        self._interrupt_probe = interrupt_probe
        self._cancelled = False
        self._event: threading.Event | None = None

    @property
    def cancelled(self) -> bool:
        """True once the run was cancelled, or this call timed out."""
        return self._cancelled

    @property
    def interrupt_requested(self) -> bool:
        """True once a graceful stop was asked for: finish this call, the run stops after."""
        return self._interrupt_probe()

    def check(self) -> None:
        """Raise ``asyncio.CancelledError`` if the call was cancelled; else do nothing."""
        if self._cancelled:
            raise asyncio.CancelledError(
                f"tool {self.tool_name!r} (call {self.call_id!r}) was cancelled"
            )

    def wait_cancelled(self, timeout: float | None = None) -> bool:
        """Block the calling thread until cancelled or ``timeout`` s passed; True if cancelled.

        For sync tools only: it blocks, so never call it on the event loop.
        """
        with _EVENT_LOCK:
            if self._cancelled:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def mark_cancelled(self) -> None:
        """Record that the call was cancelled (idempotent); wakes ``wait_cancelled``."""
        with _EVENT_LOCK:
            self._cancelled = True
            event = self._event
        if event is not None:
            event.set()

    def __repr__(self) -> str:
        return (
            f"ToolContext(agent={self.agent!r}, call_id={self.call_id!r}, "
            f"tool_name={self.tool_name!r}, cancelled={self._cancelled})"
        )


# --------------------------------------------------------------------------- docstrings

_ARGS_HEADERS = frozenset(
    {
        "args",
        "arguments",
        "parameters",
        "params",
        "keyword args",
        "keyword arguments",
        "attributes",
        "fields",
    }
)
_HEADER = re.compile(r"^([A-Za-z][A-Za-z ]*):\s*$")
_ENTRY = re.compile(r"^\**(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """The summary (first paragraph, one line) and the Google-style ``Args:`` entries."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _HEADER.match(line):
            break
        summary.append(line.strip())
    described: dict[str, str] = {}
    index = 0
    while index < len(lines):
        header = _HEADER.match(lines[index])
        index += 1
        if header is None or header.group(1).strip().lower() not in _ARGS_HEADERS:
            continue
        name: str | None = None
        entry_indent = -1
        while index < len(lines):
            line = lines[index]
            if not line.strip():
                index += 1
                continue
            indent = len(line) - len(line.lstrip())
            if indent == 0:  # the next section (or prose) starts
                break
            index += 1
            match = _ENTRY.match(line.strip())
            if match and (entry_indent < 0 or indent <= entry_indent):
                entry_indent = indent
                name = match.group(1)
                described[name] = match.group(2).strip()
            elif name is not None:
                described[name] = f"{described[name]} {line.strip()}".strip()
    return " ".join(summary), described


# --------------------------------------------------------------------------- schema nodes


class _Invalid(Exception):
    """An argument does not match its schema; ``problem`` says how."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


Convert: TypeAlias = Callable[[object, str], object]


@dataclasses.dataclass(slots=True)
class _Node:
    """One compiled type: its JSON schema, a short text for messages, and its converter."""

    schema: dict[str, Any]
    text: str
    convert: Convert
    nullable: bool = False


_JSON_KIND = {
    str: "string",
    bool: "boolean",
    int: "integer",
    float: "number",
    list: "array",
    dict: "object",
    type(None): "null",
}


def _shown(value: object) -> str:
    """A value as the model sent it, short, with its JSON kind."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = _JSON_KIND.get(type(value), type(value).__name__)
    return f"{text} ({kind})"


def _expected(text: str, value: object) -> str:
    return f"expected {text}, got {_shown(value)}"


def _any_node() -> _Node:
    return _Node({}, "any JSON value", lambda value, path: value, nullable=True)


def _str(value: object, path: str) -> object:
    if type(value) is str:
        return value
    raise _Invalid(path, _expected("string", value))


def _int(value: object, path: str) -> object:
    if type(value) is int:
        return value
    # JSON has one number type: 3.0 is an integer there, and some models send it.
    if type(value) is float and value.is_integer():
        return int(value)
    raise _Invalid(path, _expected("integer", value))


def _float(value: object, path: str) -> object:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise _Invalid(path, _expected("number", value))


def _bool(value: object, path: str) -> object:
    if type(value) is bool:
        return value
    raise _Invalid(path, _expected("boolean", value))


def _none(value: object, path: str) -> object:
    if value is None:
        return None
    raise _Invalid(path, _expected("null", value))


_SCALARS: dict[object, _Node] = {
    str: _Node({"type": "string"}, "string", _str),
    int: _Node({"type": "integer"}, "integer", _int),
    float: _Node({"type": "number"}, "number", _float),
    bool: _Node({"type": "boolean"}, "boolean", _bool),
    type(None): _Node({"type": "null"}, "null", _none, nullable=True),
    None: _Node({"type": "null"}, "null", _none, nullable=True),
}


def _nullable(node: _Node) -> _Node:
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
        except _Invalid as exc:
            if exc.path != path:  # a deeper problem already says what was wrong
                raise
            raise _Invalid(path, _expected(text, value)) from None

    return _Node(schema, text, convert, nullable=True)


def _to_json(value: object) -> Any:
    """``json.dumps`` fallback for the Python values tools commonly return."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, set | frozenset):
        return list(value)
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    dump = getattr(value, "model_dump", None)  # pydantic models, without depending on pydantic
    if callable(dump):
        return dump(mode="json")
    raise TypeError(type(value).__name__)


class _Compiler:
    """Builds :class:`_Node` trees for one tool; errors name the tool and parameter."""

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
            return json.loads(json.dumps(value, default=_to_json, allow_nan=False))
        except (TypeError, ValueError):
            raise self.fail(
                f"{what} {value!r:.60} is a {type(value).__name__}, which is not "
                "JSON-serialisable; use None (or a JSON value) and build it inside the tool"
            ) from None

    def compile(self, hint: object) -> _Node:
        origin = get_origin(hint)
        if origin is Annotated:
            node = self.compile(hint.__origin__)  # type: ignore[attr-defined]
            described = [m for m in hint.__metadata__ if isinstance(m, str)]  # type: ignore[attr-defined]
            if described:
                node = dataclasses.replace(
                    node, schema={**node.schema, "description": described[0]}
                )
            return node
        if origin is Required or origin is NotRequired:
            return self.compile(get_args(hint)[0])
        if hint is Any or hint is object or hint is inspect.Parameter.empty:
            return _any_node()
        scalar = _SCALARS.get(hint) if isinstance(hint, type) or hint is None else None
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
        raise self.fail(
            f"type {hint!r} has no JSON schema; use str, int, float, bool, None, list, tuple, "
            "dict[str, T], Optional, Literal, an Enum, a TypedDict or a dataclass"
        )

    def union_of(self, members: tuple[object, ...]) -> _Node:
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
                    except _Invalid:
                        continue
                raise _Invalid(path, _expected(text, value))

            node = _Node(
                {"anyOf": [n.schema for n in nodes]},
                text,
                convert,
                nullable=any(n.nullable for n in nodes),
            )
        return _nullable(node) if allows_null else node

    def literal_of(self, values: tuple[object, ...]) -> _Node:
        pairs: list[tuple[object, object]] = []  # (JSON value, Python value)
        for value in values:
            wire = value.value if isinstance(value, enum.Enum) else value
            if wire is not None and type(wire) not in (str, int, bool, float):
                raise self.fail(f"Literal value {value!r} is not a JSON scalar")
            pairs.append((wire, value))
        return self.choice_of(pairs)

    def enum_of(self, cls: type[enum.Enum]) -> _Node:
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

    def choice_of(self, pairs: list[tuple[object, object]]) -> _Node:
        # Keyed by (type, value) so that True never matches 1, nor 1 match 1.0.
        table = {(type(wire), wire): value for wire, value in pairs}
        wires = [wire for wire, _ in pairs]
        kinds = {_JSON_KIND[type(w)] for w in wires}
        allows_null = None in wires
        schema: dict[str, Any] = {"enum": wires}
        if len(kinds) == 1 and not allows_null:
            schema = {"type": kinds.pop(), "enum": wires}
        text = " | ".join(json.dumps(w) for w in wires)

        def convert(value: object, path: str) -> object:
            try:
                return table[(type(value), value)]
            except (KeyError, TypeError):  # TypeError: an unhashable list or dict
                raise _Invalid(path, _expected(f"one of {text}", value)) from None

        return _Node(schema, text, convert, nullable=allows_null)

    def array_of(self, args: tuple[object, ...]) -> _Node:
        item = self.compile(args[0]) if args else _any_node()
        item_convert = item.convert

        def convert(value: object, path: str) -> object:
            if type(value) is not list:
                raise _Invalid(path, _expected(f"array of {item.text}", value))
            return [item_convert(v, f"{path}[{i}]") for i, v in enumerate(value)]

        return _Node({"type": "array", "items": item.schema}, f"array of {item.text}", convert)

    def tuple_of(self, args: tuple[object, ...]) -> _Node:
        if not args or (len(args) == 2 and args[1] is Ellipsis):
            item = self.compile(args[0]) if args else _any_node()
            listed = self.array_of((args[0],) if args else ()).convert

            def convert_varying(value: object, path: str) -> object:
                return tuple(cast(list[object], listed(value, path)))

            text = f"array of {item.text}"
            return _Node({"type": "array", "items": item.schema}, text, convert_varying)
        if args == ((),):  # tuple[()]: the empty tuple
            args = ()
        items = [self.compile(a) for a in args]
        text = "[" + ", ".join(n.text for n in items) + "]"
        count = len(items)

        def convert(value: object, path: str) -> object:
            if type(value) is not list or len(value) != count:
                raise _Invalid(path, _expected(f"array of {count} items {text}", value))
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
        return _Node(schema, text, convert)

    def mapping_of(self, args: tuple[object, ...]) -> _Node:
        if args and args[0] is not str:
            raise self.fail(f"dict keys must be str (JSON object keys), not {args[0]!r}")
        item = self.compile(args[1]) if args else _any_node()
        item_convert = item.convert
        text = f"object of {item.text}"

        def convert(value: object, path: str) -> object:
            if type(value) is not dict:
                raise _Invalid(path, _expected(text, value))
            return {k: item_convert(v, f"{path}[{json.dumps(k)}]") for k, v in value.items()}

        schema: dict[str, Any] = {"type": "object"}
        if args:
            schema["additionalProperties"] = item.schema
        return _Node(schema, text, convert)

    def enter(self, cls: type) -> None:
        if cls in self._building:
            raise self.fail(f"{cls.__name__} refers to itself; recursive types are not supported")
        self._building.append(cls)

    def hints_of(self, cls: type) -> dict[str, Any]:
        try:
            return typing.get_type_hints(cls, include_extras=True)
        except Exception as exc:
            raise self.fail(f"cannot resolve the type hints of {cls.__name__}: {exc}") from None

    def typeddict_of(self, cls: type) -> _Node:
        self.enter(cls)
        _, described = _parse_docstring(cls.__doc__)
        hints = self.hints_of(cls)
        required = cast(frozenset[str], getattr(cls, "__required_keys__", frozenset(hints)))
        fields = {
            name: self.field(self.compile(hint), described.get(name))
            for name, hint in hints.items()
        }
        self._building.pop()
        return self.record(cls, fields, [n for n in hints if n in required], {}, dict)

    def dataclass_of(self, cls: type) -> _Node:
        self.enter(cls)
        summary, described = _parse_docstring(_own_doc(cls))
        hints = self.hints_of(cls)
        fields: dict[str, _Node] = {}
        required: list[str] = []
        defaults: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            node = self.field(self.compile(hints.get(f.name, Any)), described.get(f.name))
            if f.default is not dataclasses.MISSING:
                defaults[f.name] = self.json_default(f.default, f"default of field {f.name!r}")
                if f.default is None:
                    node = _nullable(node)
            elif f.default_factory is dataclasses.MISSING:
                required.append(f.name)
            fields[f.name] = node
        self._building.pop()
        node = self.record(cls, fields, required, defaults, cls)
        if summary:
            node.schema["description"] = summary
        return node

    @staticmethod
    def field(node: _Node, description: str | None) -> _Node:
        if description and "description" not in node.schema:
            return dataclasses.replace(node, schema={**node.schema, "description": description})
        return node

    def record(
        self,
        cls: type,
        fields: dict[str, _Node],
        required: list[str],
        defaults: dict[str, Any],
        build: Callable[..., object],
    ) -> _Node:
        properties: dict[str, Any] = {}
        for name, node in fields.items():
            properties[name] = node.schema
            if name in defaults:
                properties[name] = {**node.schema, "default": defaults[name]}
        shown = ", ".join(
            f"{name}{'' if name in required else '?'}: {node.text}" for name, node in fields.items()
        )
        text = f"{cls.__name__} {{{shown}}}"
        checker = _object_checker(fields, required, text)
        name = cls.__name__

        def convert(value: object, path: str) -> object:
            converted = checker(value, path)
            if build is dict:
                return converted
            try:
                return build(**converted)
            except Exception as exc:  # the type's own checks (__post_init__) refused it
                raise _Invalid(path, f"{name} rejected it: {type(exc).__name__}: {exc}") from None

        schema = {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }
        return _Node(schema, text, convert)


def _own_doc(cls: type) -> str | None:
    """A class's docstring, unless it is the signature ``@dataclass`` writes in its place."""
    doc = cls.__doc__
    if doc and doc.startswith(f"{cls.__name__}("):
        return None
    return doc


def _object_checker(
    fields: Mapping[str, _Node], required: Sequence[str], text: str
) -> Callable[[object, str], dict[str, object]]:
    """Checks a JSON object field by field: unknown keys, missing keys, each value."""
    converts = {name: node.convert for name, node in fields.items()}
    required_set = frozenset(required)

    def check(value: object, path: str) -> dict[str, object]:
        if type(value) is not dict:
            raise _Invalid(path, _expected(f"object {text}", value))
        out: dict[str, object] = {}
        for key, item in value.items():
            convert = converts.get(key)
            if convert is None:
                known = ", ".join(repr(k) for k in fields) or "none"
                raise _Invalid(f"{path}.{key}", f"unknown field; known fields: {known}")
            out[key] = convert(item, f"{path}.{key}")
        if len(out) < len(required_set) or not required_set.issubset(out):
            missing = [k for k in required if k not in out]
            raise _Invalid(path, f"missing required field {', '.join(map(repr, missing))}")
        return out

    return check


# --------------------------------------------------------------------------- tools


def _unwrap(fn: Callable[..., Any]) -> tuple[Callable[..., Any], set[str]]:
    """The function under partials, and the keyword names the partials bind."""
    bound: set[str] = set()
    while isinstance(fn, functools.partial):
        bound.update(fn.keywords)
        fn = fn.func
    return fn, bound


class Tool:
    """A function offered to a model. Callable: calling it calls the function.

    Built once from the function's signature: ``parameters`` (a JSON schema object),
    ``spec`` (what a provider sends) and the compiled validator :func:`invoke` uses.
    """

    __slots__ = (
        "__wrapped__",
        "_fields",
        "_positional",
        "_required",
        "_required_set",
        "_signature_text",
        "context_param",
        "description",
        "fn",
        "is_async",
        "name",
        "parameters",
        "spec",
        "timeout",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout: float | None = None,
    ) -> None:
        if not callable(fn):
            raise ToolDefinitionError(f"a tool must be callable, got {type(fn).__name__}")
        target, bound = _unwrap(fn)
        if name is None:
            name = getattr(target, "__name__", None) or type(target).__name__
        if not (inspect.isfunction(target) or inspect.ismethod(target)):
            target = type(target).__call__  # a callable object: its __call__ has the hints
        if not _NAME.match(name):
            raise ToolDefinitionError(
                f"tool name {name!r} is not allowed: use 1-64 letters, digits, '_' or '-' "
                "(pass name=... to tool())"
            )
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ToolDefinitionError(
                f"tool {name!r}: timeout must be a positive number of "
                f"seconds or None, got {timeout!r}"
            )
        if inspect.isasyncgenfunction(target) or inspect.isgeneratorfunction(target):
            raise ToolDefinitionError(
                f"tool {name!r} is a generator function; a tool returns one value"
            )
        self.name = name
        self.fn = fn
        self.timeout = float(timeout) if timeout is not None else None
        # A callable object counts as async when its __call__ is.
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            type(fn).__call__
        )
        self.__wrapped__ = fn
        doc = inspect.getdoc(target)
        if doc is None and target is not fn and not isinstance(fn, functools.partial):
            doc = inspect.getdoc(type(fn))  # a callable object documented on its class
        summary, described = _parse_docstring(doc)
        self.description = description if description is not None else summary

        compiler = _Compiler(name)
        try:
            hints = typing.get_type_hints(target, include_extras=True)
        except Exception as exc:
            raise ToolDefinitionError(
                f"tool {name!r}: cannot resolve its type hints ({type(exc).__name__}: {exc}); "
                "define the types it names at module level"
            ) from None
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError) as exc:
            raise ToolDefinitionError(f"tool {name!r}: cannot read its signature: {exc}") from None

        properties: dict[str, Any] = {}
        fields: dict[str, _Node] = {}
        required: list[str] = []
        positional: list[tuple[str, object]] = []  # positional-only params, with defaults
        context_param: str | None = None
        shown: list[str] = []
        for param in signature.parameters.values():
            if param.name in bound:
                continue  # fixed by functools.partial: not the model's to choose
            compiler.param = param.name
            if param.kind is param.VAR_POSITIONAL or param.kind is param.VAR_KEYWORD:
                star = "*" if param.kind is param.VAR_POSITIONAL else "**"
                raise compiler.fail(
                    f"{star}{param.name} cannot be offered to a model; declare each argument"
                )
            hint = hints.get(param.name, inspect.Parameter.empty)
            if _is_context(hint):
                if context_param is not None:
                    raise compiler.fail(
                        f"a second ToolContext parameter (the first is {context_param!r})"
                    )
                context_param = param.name
                if param.kind is param.POSITIONAL_ONLY:
                    positional.append((param.name, param.default))
                continue
            node = compiler.compile(hint)
            if param.default is None:
                node = _nullable(node)
            node = _Compiler.field(node, described.get(param.name))
            schema = node.schema
            if param.default is param.empty:
                required.append(param.name)
            else:
                default = compiler.json_default(param.default, "default")
                schema = {**schema, "default": default}
            properties[param.name] = schema
            fields[param.name] = node
            if param.kind is param.POSITIONAL_ONLY:
                positional.append((param.name, param.default))
            optional = "" if param.default is param.empty else "?"
            shown.append(f"{param.name}{optional}: {node.text}")

        self.context_param = context_param
        # A deep copy: compiled nodes share schema dicts, a tool's schema must share none.
        self.parameters: dict[str, Any] = copy.deepcopy(
            {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            }
        )
        self.spec: ToolSpec = {
            "type": "function",
            "function": {
                "name": name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }
        self._fields = {n: node.convert for n, node in fields.items()}
        self._required = tuple(required)
        self._required_set = frozenset(required)
        self._positional = tuple(positional)
        self._signature_text = f"{name}({', '.join(shown)})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Tool {self._signature_text}{' async' if self.is_async else ''}>"

    def _bind(self, arguments: object) -> dict[str, object]:
        """The model's arguments checked and converted, or :class:`_BadArguments`."""
        if type(arguments) is str:  # some servers send the JSON text itself
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as exc:
                raise _BadArguments(self, [f"the arguments are not valid JSON ({exc})"]) from None
        if type(arguments) is not dict:
            raise _BadArguments(
                self, [f"the arguments must be a JSON object, got {_shown(arguments)}"]
            )
        fields = self._fields
        out: dict[str, object] = {}
        problems: list[str] = []
        for key, value in arguments.items():
            convert = fields.get(key)
            if convert is None:
                problems.append(f"unknown argument {key!r}")
                continue
            try:
                out[key] = convert(value, key)
            except _Invalid as exc:
                problems.append(f"argument '{exc.path}': {exc.problem}")
        if self._required and not self._required_set.issubset(arguments):
            missing = [name for name in self._required if name not in arguments]
            problems.append(f"missing required argument {', '.join(map(repr, missing))}")
        if problems:
            raise _BadArguments(self, problems)
        return out


class _BadArguments(Exception):
    def __init__(self, tool: Tool, problems: list[str]) -> None:
        super().__init__(
            f"invalid arguments for tool {tool.name!r}: {'; '.join(problems)}. "
            f"Expected {tool._signature_text}; fix the arguments and call it again."
        )


def _is_context(hint: object) -> bool:
    if get_origin(hint) is Annotated:
        hint = hint.__origin__  # type: ignore[attr-defined]
    return hint is ToolContext


def as_tool(obj: Callable[..., Any] | Tool) -> Tool:
    """``obj`` as a :class:`Tool`: a Tool is returned as is, a callable is inspected.

    Raises :class:`~aimu.aio.errors.ToolDefinitionError` naming the tool and parameter.
    """
    return obj if isinstance(obj, Tool) else Tool(obj)


@overload
def tool(
    fn: Callable[..., Any] | Tool,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
) -> Tool: ...


@overload
def tool(
    fn: None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
) -> Callable[[Callable[..., Any] | Tool], Tool]: ...


def tool(
    fn: Callable[..., Any] | Tool | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
) -> Tool | Callable[[Callable[..., Any] | Tool], Tool]:
    """Make a :class:`Tool`, overriding the inferred name, description or timeout.

    Usable bare (``@tool``) or with arguments (``@tool(timeout=2)``); given a Tool it
    returns a new Tool with the overrides applied.
    """

    def make(obj: Callable[..., Any] | Tool) -> Tool:
        if isinstance(obj, Tool):
            return Tool(
                obj.fn,
                name=obj.name if name is None else name,
                description=obj.description if description is None else description,
                timeout=obj.timeout if timeout is None else timeout,
            )
        return Tool(obj, name=name, description=description, timeout=timeout)

    return make if fn is None else make(fn)


# --------------------------------------------------------------------------- invocation


@dataclasses.dataclass(frozen=True, slots=True)
class ToolOutcome:
    """What a tool call gives the model: the result text, and whether it is an error."""

    content: str
    is_error: bool


class _NotText(Exception):
    """A tool's return value cannot be turned into text."""


# Made once: json.dumps with options builds a new encoder on every call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, default=_to_json)


def _to_text(result: object) -> str:
    """A return value as the model reads it: str as is, None as "null", the rest as JSON."""
    if isinstance(result, str):
        return result
    kind = type(result)
    if result is None:
        return "null"
    if kind is int or kind is bool:
        return _ENCODER.encode(result) if kind is bool else str(result)
    if inspect.iscoroutine(result):
        result.close()  # never awaited: close it so Python does not warn
        raise _NotText("a coroutine; declare the tool `async def` so it is awaited")
    try:
        return _ENCODER.encode(result)
    except (TypeError, ValueError) as exc:
        raise _NotText(f"a {type(result).__name__} ({exc}); return a str or JSON data") from None


def _run_sync(fn: Callable[..., Any], args: Sequence[object], kwargs: dict[str, object]) -> str:
    # Runs in the worker thread, so a large result is serialised off the event loop.
    return _to_text(fn(*args, **kwargs))


async def invoke(tools: Mapping[str, Tool], call: ToolCall, ctx: ToolContext) -> ToolOutcome:
    """Run one tool call; every failure becomes an error outcome the model can read.

    Unknown tool, invalid arguments, a raising tool, a timeout (which also marks ``ctx``
    cancelled) and an unserialisable result are outcomes; ``CancelledError`` marks
    ``ctx`` cancelled and propagates.
    """
    function = call["function"]
    name = function["name"]
    tool = tools.get(name)
    if tool is None:
        available = ", ".join(repr(n) for n in tools) or "none"
        return ToolOutcome(f"unknown tool {name!r}; available tools: {available}", True)
    try:
        kwargs = tool._bind(function.get("arguments", {}))
    except _BadArguments as exc:
        return ToolOutcome(str(exc), True)
    if tool.context_param is not None:
        kwargs[tool.context_param] = ctx
    args: list[object] = []
    if tool._positional:
        for param, default in tool._positional:
            if param in kwargs:
                args.append(kwargs.pop(param))
            elif default is not inspect.Parameter.empty:
                args.append(default)
            else:  # a required positional-only argument was missing: _bind reported it
                break
    try:
        if tool.timeout is None:
            if tool.is_async:
                return ToolOutcome(_to_text(await tool.fn(*args, **kwargs)), False)
            return ToolOutcome(await asyncio.to_thread(_run_sync, tool.fn, args, kwargs), False)
        deadline = asyncio.timeout(tool.timeout)
        try:
            async with deadline:
                if tool.is_async:
                    text = _to_text(await tool.fn(*args, **kwargs))
                else:
                    text = await asyncio.to_thread(_run_sync, tool.fn, args, kwargs)
        except TimeoutError:
            if not deadline.expired():
                raise  # the tool's own TimeoutError: a failure like any other
            ctx.mark_cancelled()
            return ToolOutcome(f"tool {name!r} timed out after {tool.timeout:g} s", True)
        return ToolOutcome(text, False)
    except asyncio.CancelledError:
        ctx.mark_cancelled()
        raise
    except _NotText as exc:
        return ToolOutcome(f"tool {name!r} returned {exc}", True)
    except Exception as exc:
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return ToolOutcome(f"tool {name!r} failed: {detail}", True)
