"""Tool: a function offered to a model, inspected once; ``tool()`` and ``as_tool()``.

Building a :class:`Tool` reads the function's signature, type hints and docstring,
compiles the parameters' schema and validator, and fails with a
:class:`~aimu.aio.errors.ToolDefinitionError` naming the tool and parameter.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Awaitable, Callable
from types import EllipsisType
from typing import TYPE_CHECKING, Any, ClassVar, overload

from aimu.aio._echo import echo
from aimu.aio._frozen import quick_init
from aimu.aio._numbers import finite
from aimu.aio.errors import ToolDefinitionError
from aimu.aio.tools._docstring import parse_docstring
from aimu.aio.tools._parameters import Parameters
from aimu.aio.transcript import ToolSpec

if TYPE_CHECKING:
    from aimu.aio.tools._context import ToolContext

#: A tool described by a JSON schema from elsewhere: it gets the arguments object and
#: the call's context, and returns text or a whole outcome (an error the model reads).
@quick_init
@dataclasses.dataclass(frozen=True, slots=True)
class ToolOutcome:
    """What a tool call gives the model: the result text, and whether it is an error."""

    content: str
    is_error: bool


SchemaCall = Callable[[dict[str, Any], "ToolContext"], Awaitable["str | ToolOutcome"]]

__all__ = ["DEFAULT_MAX_RESULT", "Tool", "as_tool", "external_tool", "tool"]

#: Bytes (UTF-8) of a tool's result kept in the transcript, in memory and in the store;
#: the rest is cut, with a marker saying how much was dropped. ``max_result=`` changes it.
DEFAULT_MAX_RESULT = 1_000_000

# Names OpenAI-compatible servers accept for a function.
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def unwrap_partials(fn: Callable[..., Any]) -> tuple[Callable[..., Any], set[str]]:
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

    #: A call a crash left in doubt continues where it stopped on resume (an agent
    #: called as a tool: its own session knows), neither re-run nor answered unknown.
    resumes: ClassVar[bool] = False

    __slots__ = (
        "__wrapped__",
        "_params",
        "approval",
        "context_param",
        "description",
        "external",
        "fn",
        "idempotent",
        "is_async",
        "max_result",
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
        approval: bool = False,
        idempotent: bool = False,
        max_result: int | None = DEFAULT_MAX_RESULT,
    ) -> None:
        if not callable(fn):
            raise ToolDefinitionError(f"a tool must be callable, got {type(fn).__name__}")
        target, bound = unwrap_partials(fn)
        if name is None:
            name = getattr(target, "__name__", None) or type(target).__name__
        if not (inspect.isfunction(target) or inspect.ismethod(target)):
            target = type(target).__call__  # a callable object: its __call__ has the hints
        _check_definition(name, target, timeout)
        #: Bytes of a result kept (the rest cut with a marker); None keeps it whole.
        self.max_result = _check_max_result(name, max_result)
        self.name = name
        self.fn = fn
        self.timeout = float(timeout) if timeout is not None else None
        #: Each call waits for a person's approve()/deny() (the run pauses for it).
        self.approval = bool(approval)
        #: Safe to run twice: a call in doubt after a crash is run again.
        self.idempotent = bool(idempotent)
        #: Its calls are answered from outside (see :func:`external_tool`), never run here.
        self.external = False
        # A callable object counts as async when its __call__ is.
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            type(fn).__call__
        )
        self.__wrapped__ = fn
        doc = inspect.getdoc(target)
        if doc is None and target is not fn and not isinstance(fn, functools.partial):
            doc = inspect.getdoc(type(fn))  # a callable object documented on its class
        summary, described = parse_docstring(doc)
        self.description = description if description is not None else summary
        self._params = Parameters.of(name, fn, target, bound, described)
        self.context_param = self._params.context_param
        self.parameters: dict[str, Any] = self._params.schema
        self.spec: ToolSpec = {
            "type": "function",
            "function": {
                "name": name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    @classmethod
    def from_schema(
        cls,
        name: str,
        description: str,
        parameters: dict[str, Any],
        call: SchemaCall,
        *,
        timeout: float | None = None,
        approval: bool = False,
        idempotent: bool = False,
        max_result: int | None = DEFAULT_MAX_RESULT,
    ) -> Tool:
        """A tool whose JSON schema ``parameters`` is given (an MCP server's), sent to the
        model as is; ``call(arguments, ctx)`` runs it with the model's arguments object."""
        _check_definition(name, call, timeout)
        if not isinstance(parameters, dict) or parameters.get("type") != "object":
            raise ToolDefinitionError(
                f"tool {name!r}: its input schema must be a JSON schema of type 'object', "
                f"got {_schema_kind(parameters)}"
            )
        made = cls.__new__(cls)
        made.max_result = _check_max_result(name, max_result)
        made.name = name
        made.fn = made.__wrapped__ = call
        made.timeout = float(timeout) if timeout is not None else None
        made.approval = bool(approval)
        made.idempotent = bool(idempotent)
        made.external = False
        made.is_async = True
        made.description = description
        made._params = Parameters.from_schema(name, parameters)
        made.context_param = made._params.context_param
        made.parameters = parameters
        made.spec = {
            "type": "function",
            "function": {"name": name, "description": description, "parameters": parameters},
        }
        return made

    @property
    def from_schema_given(self) -> bool:
        """True for a tool made by :meth:`from_schema` (its schema given, not inferred)."""
        return self._params.raw

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def _as_external(self, external: bool) -> Tool:
        self.external = external
        return self

    def __repr__(self) -> str:
        return f"<Tool {self._params.signature_text}{' async' if self.is_async else ''}>"


def _schema_kind(schema: object) -> str:
    if isinstance(schema, dict):
        return f"type {schema.get('type')!r}"
    return type(schema).__name__


def _check_definition(name: str, target: Callable[..., Any], timeout: object) -> None:
    """Refuse a name servers reject, a bad timeout and a generator function."""
    if not TOOL_NAME.match(name):
        raise ToolDefinitionError(
            f"tool name {name!r} is not allowed: use 1-64 letters, digits, '_' or '-' "
            "(pass name=... to tool())"
        )
    if timeout is not None and (not finite(timeout) or timeout <= 0):
        raise ToolDefinitionError(
            f"tool {name!r}: timeout must be a positive number of "
            f"seconds or None, got {echo(timeout)}"
        )
    if inspect.isasyncgenfunction(target) or inspect.isgeneratorfunction(target):
        raise ToolDefinitionError(
            f"tool {name!r} is a generator function; a tool returns one value"
        )


def _check_max_result(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ToolDefinitionError(
            f"tool {name!r}: max_result must be a positive number of bytes or None, "
            f"got {value!r}"
        )
    return value


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
    approval: bool | None = None,
    idempotent: bool | None = None,
    max_result: int | EllipsisType | None = ...,
) -> Tool: ...


@overload
def tool(
    fn: None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
    approval: bool | None = None,
    idempotent: bool | None = None,
    max_result: int | EllipsisType | None = ...,
) -> Callable[[Callable[..., Any] | Tool], Tool]: ...


def tool(
    fn: Callable[..., Any] | Tool | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
    approval: bool | None = None,
    idempotent: bool | None = None,
    max_result: int | EllipsisType | None = ...,
) -> Tool | Callable[[Callable[..., Any] | Tool], Tool]:
    """Make a :class:`Tool`, overriding the inferred name, description or timeout.

    Usable bare (``@tool``) or with arguments (``@tool(timeout=2)``); given a Tool it
    returns a new Tool with the overrides applied. ``approval=True``: every call waits
    for a person (the run pauses); ``idempotent=True``: a call in doubt after a crash
    is run again (the default gives it an "outcome unknown" result instead);
    ``max_result``: bytes of a result kept, the rest cut with a marker saying how much
    was dropped (default :data:`DEFAULT_MAX_RESULT`, 1 MB; None keeps results whole).
    """

    def make(obj: Callable[..., Any] | Tool) -> Tool:
        # max_result not given (...): what the tool had; None is "no cap".
        kept = obj.max_result if isinstance(obj, Tool) else DEFAULT_MAX_RESULT
        cap = kept if isinstance(max_result, EllipsisType) else max_result
        if isinstance(obj, Tool) and obj.from_schema_given:
            return Tool.from_schema(
                obj.name if name is None else name,
                obj.description if description is None else description,
                obj.parameters,
                obj.fn,
                timeout=obj.timeout if timeout is None else timeout,
                approval=obj.approval if approval is None else approval,
                idempotent=obj.idempotent if idempotent is None else idempotent,
                max_result=cap,
            )._as_external(obj.external)
        if isinstance(obj, Tool):
            return Tool(
                obj.fn,
                name=obj.name if name is None else name,
                description=obj.description if description is None else description,
                timeout=obj.timeout if timeout is None else timeout,
                approval=obj.approval if approval is None else approval,
                idempotent=obj.idempotent if idempotent is None else idempotent,
                max_result=cap,
            )
        return Tool(
            obj, name=name, description=description, timeout=timeout,
            approval=bool(approval), idempotent=bool(idempotent), max_result=cap,
        )

    return make if fn is None else make(fn)



def external_tool(
    name: str, description: str = "", parameters: dict[str, Any] | None = None
) -> Tool:
    """A tool the model may call whose calls are answered from outside, never run here
    (a tool of the browser's, of a person's, of another service's).

    A call of it pauses the run, as a call waiting for approval does: it is listed in
    ``agent.pending_approvals`` with ``external=True``, and ``agent.answer(call, result)``
    gives the text the model reads as its result (``deny()`` refuses it); ``resume()``
    then goes on with that result, without asking the model again. ``parameters`` is
    the JSON schema of its arguments object (None: no arguments); it is sent as given.
    """
    schema = {"type": "object", "properties": {}} if parameters is None else parameters

    async def never_run(arguments: dict[str, Any], ctx: ToolContext) -> str:
        raise RuntimeError(
            f"tool {name!r} is external: its calls are answered from outside "
            "(agent.answer()), not run"
        )

    return Tool.from_schema(name, description, schema, never_run)._as_external(True)


def external_tools(data: object, where: str) -> list[Tool]:
    """The external tools stored as ``[{"name", "description", "parameters"}, ...]``
    (None: none); ValueError naming ``where`` when unreadable."""
    if data is None:
        return []
    try:
        if not isinstance(data, list):
            raise TypeError(f"a list, not {type(data).__name__}")
        return [
            external_tool(str(item["name"]), str(item.get("description") or ""),
                          item.get("parameters"))
            for item in data
        ]
    except (KeyError, TypeError, ValueError, AttributeError, ToolDefinitionError) as error:
        raise ValueError(f"{where}: unreadable external tools ({error!r:.100})") from error
