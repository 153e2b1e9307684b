"""The public async surface of aimu: ``from aimu import aio``.

Names are imported lazily on first use, so ``from aimu import aio`` stays fast and no
provider SDK is loaded until a client for it is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aimu.aio._lazy import lazy_names

if TYPE_CHECKING:
    from aimu.aio.agent import Agent
    from aimu.aio.agent.transfer import Handoff
    from aimu.aio.approvals import PendingApproval
    from aimu.aio.context import ContextPolicy, KeepLastTurns, SummarizeOlderTurns
    from aimu.aio.control import RedisControl, RunEvent, RunInfo
    from aimu.aio.errors import (
        AimuError,
        ControlConnectionError,
        ControlError,
        MCPServerError,
        ModelConnectionError,
        ModelError,
        ModelHTTPError,
        ModelProtocolError,
        NoOutputError,
        OutputError,
        OutputValidationError,
        RunLostError,
        SessionLockedError,
        StaleDecisionError,
        StoreCapacityError,
        StoreError,
        StoreFormatError,
        ToolDefinitionError,
        TranscriptError,
        UnknownRunError,
    )
    from aimu.aio.events import (
        Event,
        HandleFinished,
        ModelRetry,
        RunFinished,
        RunResult,
        RunStarted,
        StepFinished,
        TextChunk,
        ThinkingChunk,
        ToolCallStarted,
        ToolProgress,
        ToolResult,
        TurnRetried,
    )
    from aimu.aio.guardrails import GuardrailError, ToolGuardrail, Tripwire
    from aimu.aio.instructions import RunContext
    from aimu.aio.limits import ModelPrice, Spend, UsageLimits
    from aimu.aio.mcp import MCPServer
    from aimu.aio.providers.fallback import FallbackModel
    from aimu.aio.run_handle import RunHandle, on_sigint
    from aimu.aio.runnable import Runnable
    from aimu.aio.scope import RunScope, current_scope
    from aimu.aio.store import (
        JSONLStore,
        PostgresStore,
        SessionInfo,
        SessionWriter,
        SQLiteStore,
        Store,
        ToolStart,
    )
    from aimu.aio.tools import Tool, ToolContext, Toolset, external_tool, tool
    from aimu.aio.transcript import Message, ToolCall
    from aimu.aio.workflows import Chain, EvaluatorOptimizer, Parallel, Router

__all__ = [
    "Agent",
    "AimuError",
    "Chain",
    "ContextPolicy",
    "ControlConnectionError",
    "ControlError",
    "EvaluatorOptimizer",
    "Event",
    "FallbackModel",
    "GuardrailError",
    "HandleFinished",
    "Handoff",
    "JSONLStore",
    "KeepLastTurns",
    "MCPServer",
    "MCPServerError",
    "Message",
    "ModelClient",
    "ModelConnectionError",
    "ModelError",
    "ModelHTTPError",
    "ModelPrice",
    "ModelProtocolError",
    "ModelRetry",
    "NoOutputError",
    "OutputError",
    "OutputValidationError",
    "Parallel",
    "PendingApproval",
    "PostgresStore",
    "RedisControl",
    "Router",
    "RunContext",
    "RunEvent",
    "RunFinished",
    "RunHandle",
    "RunInfo",
    "RunLostError",
    "RunResult",
    "RunScope",
    "RunStarted",
    "Runnable",
    "SQLiteStore",
    "SessionInfo",
    "SessionLockedError",
    "SessionWriter",
    "Spend",
    "StaleDecisionError",
    "StepFinished",
    "Store",
    "StoreCapacityError",
    "StoreError",
    "StoreFormatError",
    "SummarizeOlderTurns",
    "TextChunk",
    "ThinkingChunk",
    "Tool",
    "ToolCall",
    "ToolCallStarted",
    "ToolContext",
    "ToolDefinitionError",
    "ToolGuardrail",
    "ToolProgress",
    "ToolResult",
    "ToolStart",
    "Toolset",
    "TranscriptError",
    "Tripwire",
    "TurnRetried",
    "UnknownRunError",
    "UsageLimits",
    "chat",
    "client",
    "current_scope",
    "external_tool",
    "on_sigint",
    "tool",
]

_WHERE = {
    "Agent": "agent",
    "ModelClient": "client",
    "client": "client",
    "FallbackModel": "providers.fallback",
    "RedisControl": "control",
    "RunEvent": "control",
    "RunInfo": "control",
    "RunHandle": "run_handle",
    "on_sigint": "run_handle",
    "RunScope": "scope",
    "current_scope": "scope",
    "JSONLStore": "store",
    "SQLiteStore": "store",
    "Store": "store",
    "PostgresStore": "store",
    "SessionInfo": "store",
    "SessionWriter": "store",
    "ToolStart": "store",
    "Tool": "tools",
    "ToolContext": "tools",
    "Toolset": "tools",
    "MCPServer": "mcp",
    "tool": "tools",
    "external_tool": "tools",
    "Message": "transcript",
    "ToolCall": "transcript",
    "Chain": "workflows",
    "EvaluatorOptimizer": "workflows",
    "Parallel": "workflows",
    "PendingApproval": "approvals",
    "Runnable": "runnable",
    "Router": "workflows",
    "RunContext": "instructions",
    "ContextPolicy": "context",
    "KeepLastTurns": "context",
    "SummarizeOlderTurns": "context",
    "ModelPrice": "limits",
    "Spend": "limits",
    "UsageLimits": "limits",
    "GuardrailError": "guardrails",
    "Handoff": "agent.transfer",
    "ToolGuardrail": "guardrails",
    "Tripwire": "guardrails",
}
_ERRORS = (
    "AimuError", "ControlConnectionError", "ControlError", "MCPServerError",
    "ModelConnectionError",
    "ModelError", "ModelHTTPError", "ModelProtocolError", "NoOutputError", "OutputError",
    "OutputValidationError",
    "RunLostError", "SessionLockedError", "StaleDecisionError", "StoreCapacityError",
    "StoreError", "StoreFormatError",
    "ToolDefinitionError", "TranscriptError", "UnknownRunError",
)
_EVENTS = (
    "Event", "HandleFinished", "RunFinished", "RunStarted", "StepFinished", "TextChunk",
    "ThinkingChunk", "ToolCallStarted", "ToolProgress", "ToolResult", "ModelRetry", "RunResult",
    "TurnRetried",
)
_WHERE.update(dict.fromkeys(_ERRORS, "errors"))
_WHERE.update(dict.fromkeys(_EVENTS, "events"))

# Eager, and light: importing the submodules `aimu.aio.client` and `aimu.aio.chat` would
# otherwise shadow the `client()` and `chat()` functions with the modules of their names.
from aimu.aio.chat import chat  # noqa: E402
from aimu.aio.client import ModelClient, client  # noqa: E402

__getattr__ = lazy_names(__name__, _WHERE)


def __dir__() -> list[str]:
    return sorted(__all__)
