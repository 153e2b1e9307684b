"""Tools: plain functions offered to a model, their JSON schema, and how a call runs.

:func:`as_tool` turns a function (sync or async, a ``functools.partial``, a bound
method) into a :class:`Tool`: the schema comes from its type hints and docstring and
is compiled once, together with a validator that checks a model's arguments and
converts them to the declared Python types. :func:`invoke` runs one call and always
returns a :class:`ToolOutcome` the model can read -- except ``CancelledError``, which
always propagates.

Choices made here: a parameter without an annotation takes any JSON value; a ``None``
default also allows null; an integral float (``3.0``) is accepted for ``int``; a
return value of ``None`` becomes ``"null"``, like every non-str value turned into JSON;
a result over ``max_result`` bytes (1 MB by default) is cut with a marker saying how
much was dropped, so one call cannot fill the transcript, the store and the context.

Sync tools run in a worker thread. A thread cannot be killed: on a cancel or timeout
the caller moves on at once, the thread runs to its end, and its result goes nowhere.
A long sync tool should take a ``ctx: ToolContext`` parameter and watch
``ctx.cancelled`` (or call ``ctx.check()``) to stop early.

Modules: ``_context`` (ToolContext), ``_docstring`` (summary and ``Args:``), ``_schema``
(a type hint → JSON schema + converter), ``_parameters`` (a signature compiled, the
model's arguments bound), ``_json_values`` (defaults and results as JSON),
``_definition`` (Tool, ``tool()``, ``as_tool()``), ``_invocation`` (``invoke``),
``_toolset`` (:class:`Toolset`: tools from a server that must be opened first, like MCP).
"""

from aimu.aio.tools._context import ToolContext
from aimu.aio.tools._definition import DEFAULT_MAX_RESULT, Tool, as_tool, external_tool, tool
from aimu.aio.tools._invocation import ToolOutcome, invoke
from aimu.aio.tools._toolset import Toolset

__all__ = [
    "DEFAULT_MAX_RESULT",
    "Tool",
    "ToolContext",
    "ToolOutcome",
    "Toolset",
    "as_tool",
    "external_tool",
    "invoke",
    "tool",
]
