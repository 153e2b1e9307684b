"""An agent's configuration: its options, checked once, frozen in :class:`Config`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import EllipsisType
from typing import TYPE_CHECKING, Any, TypedDict

from aimu.aio._tool_table import ToolTable
from aimu.aio.approvals import ApprovalPolicy
from aimu.aio.client import ModelClient
from aimu.aio.context import ContextPolicy
from aimu.aio.guardrails import Guardrail, ToolGuardrail, check_guardrails
from aimu.aio.instructions import Instructions, check_instructions
from aimu.aio.limits import UsageLimits
from aimu.aio.output import OutputSpec, check_tool_choice
from aimu.aio.tools import Tool, Toolset

from .transfer import Handoff, check_handoffs, handoff_tools

if TYPE_CHECKING:
    from aimu.aio.store import Store

__all__ = ["AgentOptions", "Config", "ToolsArg", "make_config"]

#: What ``Agent(client, tools)`` takes as tools.
ToolsArg = Sequence[Callable[..., Any] | Tool | Toolset | EllipsisType]


class AgentOptions(TypedDict, total=False):
    """The keyword arguments of :class:`Agent` besides ``output_type`` (for its overloads)."""

    system: Instructions | None
    max_rounds: int
    name: str | None
    store: Store | None
    session: str | None
    concurrent_tools: bool
    approve: ApprovalPolicy | None
    output_retries: int
    tool_choice: str | None
    parallel_tool_calls: bool | None
    limits: UsageLimits | None
    session_limits: UsageLimits | None
    deps: object
    context: ContextPolicy | None
    input_guardrails: Sequence[Guardrail] | None
    output_guardrails: Sequence[Guardrail] | None
    tool_guardrails: Sequence[ToolGuardrail] | None
    handoffs: Sequence[Any] | None


@dataclass(frozen=True, slots=True)
class Config:
    """What every session of one agent shares; never changes after construction."""

    name: str
    #: The system prompt, or a function of the run's context giving it at each run start.
    system: Instructions | None
    max_rounds: int
    concurrent_tools: bool
    #: The tools by name and their specs; a toolset's once it is open (shared by sessions).
    table: ToolTable
    approve: ApprovalPolicy | None
    #: ``output_type=`` (None: the answer is text) and the tool-only request options.
    output: OutputSpec[Any] | None = None
    tool_choice: str | None = None
    parallel_tool_calls: bool | None = None
    #: The budget of each run, and of the session (kept in the store).
    limits: UsageLimits | None = None
    session_limits: UsageLimits | None = None
    #: The app state a run hands its tools as ``ctx.deps`` (never stored or sent).
    deps: object = None
    #: What of the transcript each request sends (None: all of it).
    context: ContextPolicy | None = None
    #: Guardrails (see aimu.aio.guardrails): the task's, the answer's, tool calls'.
    input_guardrails: tuple[Guardrail, ...] = ()
    output_guardrails: tuple[Guardrail, ...] = ()
    tool_guardrails: tuple[ToolGuardrail, ...] = ()
    #: The agents this one may hand the conversation to (see aimu.aio.agent.handoffs).
    handoffs: tuple[Handoff, ...] = ()


def make_config(
    client: ModelClient,
    tools: ToolsArg,
    *,
    system: Instructions | None,
    max_rounds: int,
    name: str | None,
    store: Store | None,
    session: str | None,
    concurrent_tools: bool,
    approve: ApprovalPolicy | None,
    output_type: object,
    output_retries: int,
    tool_choice: str | None,
    parallel_tool_calls: bool | None,
    limits: UsageLimits | None,
    session_limits: UsageLimits | None,
    deps: object,
    context: ContextPolicy | None,
    input_guardrails: Sequence[Guardrail] | None = None,
    output_guardrails: Sequence[Guardrail] | None = None,
    tool_guardrails: Sequence[ToolGuardrail] | None = None,
    handoffs: Sequence[Any] | None = None,
) -> Config:
    """The agent's configuration, its arguments checked (TypeError / ValueError saying
    which is wrong)."""
    _check_arguments(client, max_rounds, system, limits, session_limits, context)
    if (store is None) != (session is None):
        raise ValueError("store and session go together: give both, or neither")
    transfers = check_handoffs(handoffs)
    table = ToolTable([*tools, *handoff_tools(transfers)] if transfers else tools)
    if not table.toolsets:  # a toolset's names are known once it is open
        check_tool_choice(tool_choice, list(table.by_name))
    return Config(
        name=name or "agent",
        system=system,
        max_rounds=max_rounds,
        concurrent_tools=concurrent_tools,
        table=table,
        approve=approve,
        output=None if output_type is None else OutputSpec(output_type, output_retries),
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        limits=limits,
        session_limits=session_limits,
        deps=deps,
        context=context,
        input_guardrails=check_guardrails("input_guardrails", input_guardrails),
        output_guardrails=check_guardrails("output_guardrails", output_guardrails),
        tool_guardrails=check_guardrails("tool_guardrails", tool_guardrails, ToolGuardrail),
        handoffs=transfers,
    )


def _check_arguments(
    client: ModelClient,
    max_rounds: int,
    system: Instructions | None,
    limits: UsageLimits | None,
    session_limits: UsageLimits | None,
    context: ContextPolicy | None,
) -> None:
    """TypeError / ValueError saying which of these arguments of Agent() is wrong."""
    if not isinstance(client, ModelClient):
        raise TypeError(
            "Agent needs a model client such as aio.client('test'), "
            f"got {type(client).__name__}"
        )
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
        raise ValueError(f"max_rounds must be a positive int, got {max_rounds!r}")
    check_instructions(system)
    for label, given in (("limits", limits), ("session_limits", session_limits)):
        if given is not None and not isinstance(given, UsageLimits):
            raise TypeError(
                f"{label} must be aio.UsageLimits or None, got {type(given).__name__}"
            )
        if given is not None:
            for model in client.priced_models:
                given.price_of(model)  # a cost limit needs the price of each model
    if context is not None and not isinstance(context, ContextPolicy):
        raise TypeError(
            "context must be a context policy (aio.KeepLastTurns(n), or an object with "
            f"view(messages)), got {type(context).__name__}"
        )
