"""Structured output: ``Agent(client, output_type=Weather)`` and the tool-only request options.

An :class:`OutputSpec` holds what an agent with ``output_type=`` needs: the type's JSON
schema (sent to the model: Ollama ``format``, OpenAI ``response_format``), a parser
that validates the answer's text into the type (pydantic's ``TypeAdapter``, imported
here on first use so ``import aimu`` stays light), and the correction the model reads
when an answer fails. :func:`turn_request` decides what one turn asks for.
"""

from __future__ import annotations

import json
import re
import sys
import types
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import typing_extensions as te

from aimu.aio.ends import ANSWERED
from aimu.aio.errors import NoOutputError, OutputValidationError
from aimu.aio.events import RunFinished
from aimu.aio.providers.base import TurnRequest
from aimu.aio.transcript import (
    CORRECTION_PREFIX,
    Message,
    ToolSpec,
    UserMessage,
    is_correction,
)

if TYPE_CHECKING:
    from pydantic import TypeAdapter

__all__ = [
    "CORRECTION_PREFIX",
    "TOOL_CHOICES",
    "OutputSpec",
    "check_tool_choice",
    "is_correction",
    "turn_request",
]

T = TypeVar("T")

#: The ``tool_choice`` words; any other value names a tool.
TOOL_CHOICES = ("auto", "required", "none")

_ECHO_LIMIT = 300
_PROBLEM_LIMIT = 1000
_FENCE = re.compile(r"^```[\w-]*\s*\n(.*?)\n?```$", re.DOTALL)
_NAME = re.compile(r"[^a-zA-Z0-9_-]+")


class OutputSpec(Generic[T]):
    """An agent's ``output_type``: its schema, its parser, and how many corrections
    (``retries``) the model gets per run before :class:`OutputValidationError`."""

    __slots__ = ("_adapter", "name", "output_type", "retries", "schema")

    def __init__(self, output_type: Any, retries: int) -> None:
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"output_retries must be an int >= 0, got {retries!r}")
        from pydantic import PydanticUserError, TypeAdapter

        try:
            self._adapter: TypeAdapter[T] = TypeAdapter(pydantic_ready(output_type))
            self.schema: dict[str, Any] = self._adapter.json_schema()
        except (PydanticUserError, TypeError) as error:
            raise TypeError(
                f"output_type {output_type!r} is not a type pydantic can validate: {error}"
            ) from None
        self.output_type = output_type
        self.retries = retries
        #: The schema's name on the wire (OpenAI wants ``[a-zA-Z0-9_-]{1,64}``).
        self.name = _NAME.sub("_", getattr(output_type, "__name__", "") or "output")[:64]

    def parse(self, text: str) -> T:
        """The answer ``text`` as the output type; ValueError saying what is wrong."""
        from pydantic import ValidationError

        try:
            return self._adapter.validate_json(_unfenced(text))
        except ValidationError as error:
            raise ValueError(_problems(error)) from None

    def correction(self, problem: str) -> UserMessage:
        """The user message that sends an invalid answer's problem back to the model."""
        return {
            "role": "user",
            "content": (
                f"{CORRECTION_PREFIX} {problem}\nAnswer again with only JSON that matches "
                f"this schema:\n{json.dumps(self.schema)}"
            ),
        }

    def failed(self, agent: str, text: str, problem: str, answers: int) -> OutputValidationError:
        """The error for an answer still invalid once the corrections are used up."""
        shown = text if len(text) <= _ECHO_LIMIT else text[: _ECHO_LIMIT - 1] + "…"
        return OutputValidationError(
            f"agent {agent!r}: the model's answer is not a valid {self.name} after {answers} "
            f"answer(s): {problem}; last answer: {shown!r}",
            text=shown,
            problem=problem,
        )

    def result(self, final: RunFinished) -> T:
        """What ``run()`` returns for the run that ended in ``final``."""
        if final.status not in ANSWERED:
            raise NoOutputError(
                f"agent {final.source!r}: the run ended {final.status} before its answer; "
                "resume() to get its output",
                status=final.status,
            )
        try:
            return self.parse(final.reply)
        except ValueError as error:
            raise self.failed(final.source, final.reply, str(error), 1) from None


# Called, not subclassed: to mypy a TypedDict's functional form needs a literal name.
_TYPING_TYPED_DICT: Any = typing.TypedDict
_PORTABLE_TYPED_DICT: Any = te.TypedDict
#: The metaclass of ``typing.TypedDict`` classes (typing_extensions' differs).
_TYPING_TYPEDDICT = type(_TYPING_TYPED_DICT("_Probe", {}))
_REQUIRED = (typing.Required, te.Required)
_NOT_REQUIRED = (typing.NotRequired, te.NotRequired)


def pydantic_ready(output_type: Any) -> Any:
    """``output_type`` with every ``typing.TypedDict`` in it (nested in ``list[...]``,
    a union, another TypedDict...) rebuilt as a ``typing_extensions.TypedDict``, which
    pydantic wants before Python 3.12; the same type from 3.12 on."""
    if sys.version_info >= (3, 12):
        return output_type
    return _rebuilt(output_type, set())


def _rebuilt(tp: Any, building: set[int]) -> Any:
    if isinstance(tp, _TYPING_TYPEDDICT):
        if id(tp) in building:  # a recursive TypedDict: left as it is (pydantic says why)
            return tp
        building.add(id(tp))
        try:
            fields = {}
            for name, hint in typing.get_type_hints(tp, include_extras=True).items():
                # The field's own Required / NotRequired wins: under postponed annotations
                # Python 3.11 leaves them out of __required_keys__.
                wrapper = typing.get_origin(hint)
                if wrapper in _NOT_REQUIRED:
                    required, hint = False, typing.get_args(hint)[0]
                elif wrapper in _REQUIRED:
                    required, hint = True, typing.get_args(hint)[0]
                else:
                    required = name in tp.__required_keys__
                wrapped = te.Required if required else te.NotRequired
                fields[name] = wrapped[_rebuilt(hint, building)]
        finally:
            building.discard(id(tp))
        portable = _PORTABLE_TYPED_DICT(tp.__name__, fields)
        portable.__module__, portable.__doc__ = tp.__module__, tp.__doc__
        return portable
    args = typing.get_args(tp)
    if not args:
        return tp
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return typing.Annotated[(_rebuilt(args[0], building), *tp.__metadata__)]
    rebuilt = tuple(_rebuilt(arg, building) for arg in args)
    if all(new is old for new, old in zip(rebuilt, args, strict=True)):
        return tp
    if origin is typing.Union or origin is types.UnionType:
        return typing.Union[rebuilt]  # noqa: UP007 - built from a tuple
    if isinstance(tp, types.GenericAlias):
        return types.GenericAlias(origin, rebuilt)
    copy_with = getattr(tp, "copy_with", None)
    return tp if copy_with is None else copy_with(rebuilt)


def check_tool_choice(tool_choice: str | None, tools: Sequence[str]) -> None:
    """ValueError unless ``tool_choice`` is None, a :data:`TOOL_CHOICES` word or a tool's name."""
    if tool_choice is None or tool_choice in TOOL_CHOICES or tool_choice in tools:
        return
    raise ValueError(
        f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or the name of a tool "
        f"({', '.join(tools) or 'the agent has none'}), got {tool_choice!r}"
    )


def turn_request(
    output: OutputSpec[Any] | None,
    tool_choice: str | None,
    parallel_tool_calls: bool | None,
    tools: Sequence[ToolSpec] | None,
    messages: Sequence[Message],
) -> TurnRequest | None:
    """What a turn asks beyond its messages and tools; None when nothing.

    The output schema goes only on a turn that must answer (no tools, or
    ``tool_choice="none"``): a server given both may build only the answer's grammar
    and drop tool calls (llama.cpp does). The tool options go only with tools. A
    ``"required"`` or named ``tool_choice`` holds for the first turn after new input
    only: once a tool round has answered it, the model may answer (so it can end).
    """
    if not tools:
        tool_choice = parallel_tool_calls = None
    else:
        if tool_choice != "none":
            output = None
        after_round = bool(messages) and messages[-1]["role"] == "tool"
        if tool_choice not in (None, "auto", "none") and after_round:
            tool_choice = None
    if output is None and tool_choice is None and parallel_tool_calls is None:
        return None
    return TurnRequest(
        output_schema=None if output is None else output.schema,
        output_name="output" if output is None else output.name,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
    )


def _unfenced(text: str) -> str:
    """The text without a Markdown code fence around it (models add one unasked)."""
    stripped = text.strip()
    match = _FENCE.match(stripped)
    return match.group(1) if match else stripped


def _problems(error: Any) -> str:
    """A validation error as the model should read it: each problem at its place."""
    parts: list[str] = []
    for problem in error.errors(include_url=False):
        place = ".".join(str(part) for part in problem["loc"])
        parts.append(f"{place}: {problem['msg']}" if place else problem["msg"])
    joined = "; ".join(parts) or str(error)
    return joined if len(joined) <= _PROBLEM_LIMIT else joined[: _PROBLEM_LIMIT - 1] + "…"
