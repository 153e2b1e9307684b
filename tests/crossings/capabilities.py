"""Each capability as an agent built for one case of the library place: a scripted model
(a function of the transcript, so a resume picks up where a stop left it), its tools
counting their side effects by call id, and what a person feeds the run.
"""

from __future__ import annotations

import asyncio
import random
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from aimu import aio
from aimu.aio.client import ModelClient
from aimu.aio.instructions import RunContext
from aimu.aio.store import Store
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from tests.aio.trees.tree_support import level_script

TASK = "crossing task"
SEND = "also mention the tides"
CLIENT_RESULT = "Bergen, Norway"
ANSWER = "the final answer is here"
MCP_SERVER = str(Path(__file__).resolve().parents[1] / "aio" / "mcp" / "mcp_server.py")


class Verdict(BaseModel):
    score: int
    why: str


@dataclass
class Effects:
    """Side effects by tool and call id: a non-idempotent one must never run twice."""

    runs: Counter[tuple[str, str]] = field(default_factory=Counter)
    order: list[str] = field(default_factory=list)

    def ran(self, tool: str, call_id: str) -> None:
        self.runs[(tool, call_id)] += 1
        self.order.append(f"tool:{tool}")

    def twice(self, idempotent: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
        return [key for key, count in self.runs.items() if count > 1 and key[0] not in idempotent]


@dataclass
class Built:
    agent: aio.Agent[Any]
    models: list[ScriptedModel]
    effects: Effects
    send: str | None = None
    """Text to send into the running run (the ``send`` capability)."""
    decide: bool = False
    """Approve every pending call (and answer every external one) when the run pauses."""
    continue_partial: bool = False
    output_type: type[BaseModel] | None = None
    idempotent: frozenset[str] = frozenset()
    closers: list[Callable[[], Any]] = field(default_factory=list)


@dataclass
class Kit:
    store: Store
    session: str
    rng: random.Random
    extra: Mapping[str, Any] = field(default_factory=dict)
    """What the cases of one cell share (an MCP server opened once)."""
    effects: Effects = field(default_factory=Effects)

    def chunks(self) -> int:
        return self.rng.randint(2, 4)


def last_is_tool(request: Mapping[str, Any]) -> bool:
    messages = request["messages"]
    return bool(messages) and messages[-1]["role"] == "tool"


def call_then_answer(
    kit: Kit, calls: Callable[[], Sequence[ScriptedCall]], answer: str = ANSWER
) -> Callable[[Mapping[str, Any]], Turn]:
    """Call ``calls()`` until a tool result is last, then answer; a send is echoed."""
    chunks = kit.chunks()

    def script(request: Mapping[str, Any]) -> Turn:
        sent = any(m["role"] == "user" and m["content"] == SEND for m in request["messages"])
        if last_is_tool(request) or not calls():
            return Turn(text=answer + (" and tides" if sent else ""), chunks=chunks)
        return Turn(text="let me see", chunks=2, tool_calls=list(calls()))

    return script


def charging(kit: Kit, name: str = "charge") -> aio.Tool:
    async def charge(amount: int, ctx: aio.ToolContext) -> str:
        """Charge a card (not idempotent)."""
        kit.effects.ran(name, ctx.call_id)
        await asyncio.sleep(0)
        return f"charged {amount}"

    return aio.tool(charge, name=name)


def agent(kit: Kit, model: ModelClient, tools: Sequence[Any] = (), **options: Any) -> Any:
    return aio.Agent(model, list(tools), name="top", store=kit.store, session=kit.session,
                     **options)


def plain(kit: Kit) -> Built:
    model = ScriptedModel(call_then_answer(kit, lambda: ()))
    return Built(agent(kit, model), [model], kit.effects)


def tools(kit: Kit) -> Built:
    def look(query: str) -> str:
        """Look a query up (idempotent)."""
        kit.effects.order.append("tool:look")
        return f"found {query}"

    calls = [ScriptedCall("charge", {"amount": 5}), ScriptedCall("look", {"query": "q"})]
    model = ScriptedModel(call_then_answer(kit, lambda: calls))
    idempotent = aio.tool(look, idempotent=True)
    return Built(agent(kit, model, [charging(kit), idempotent]), [model], kit.effects,
                 idempotent=frozenset({"look"}))


def approvals(kit: Kit) -> Built:
    async def wire(to: str, ctx: aio.ToolContext) -> str:
        """Wire money (a person approves it first)."""
        kit.effects.ran("wire", ctx.call_id)
        return f"wired {to}"

    model = ScriptedModel(call_then_answer(kit, lambda: [ScriptedCall("wire", {"to": "x"})]))
    built = agent(kit, model, [aio.tool(wire, approval=True)])
    return Built(built, [model], kit.effects, decide=True)


def external(kit: Kit) -> Built:
    locate = aio.external_tool("locate", "Where the user is")
    model = ScriptedModel(call_then_answer(kit, lambda: [ScriptedCall("locate", {})]))
    return Built(agent(kit, model, [locate]), [model], kit.effects, decide=True)


def send(kit: Kit) -> Built:
    built = tools(kit)
    built.send = SEND
    return built


def tree(kit: Kit) -> Built:
    async def fetch(ctx: aio.ToolContext) -> str:
        """Fetch the page (not idempotent)."""
        kit.effects.ran("fetch", ctx.call_id)
        await asyncio.sleep(0)
        return "the page"

    models = [
        ScriptedModel(level_script("fetch", "", "leaf: fetched")),
        ScriptedModel(level_script("leaf", "fetch the page", "mid: researched")),
        ScriptedModel(level_script("mid", "research the question", ANSWER)),
    ]
    leaf = aio.Agent(models[0], [fetch], name="leaf")
    mid = aio.Agent(models[1], [leaf.as_tool()], name="mid")
    return Built(agent(kit, models[2], [mid.as_tool()]), models, kit.effects)


def handoff(kit: Kit) -> Built:
    chunks = kit.chunks()

    def script(request: Mapping[str, Any]) -> Turn:
        if "transfer_to_billing" in request["tools"] and not last_is_tool(request):
            return Turn(text="passing you on", chunks=2,
                        tool_calls=[ScriptedCall("transfer_to_billing", {})])
        return Turn(text=ANSWER, chunks=chunks)

    model = ScriptedModel(script, model="triage-model")
    billing_model = ScriptedModel(script, model="billing-model")
    billing = aio.Agent(billing_model, name="billing", system="You are billing.")
    built = agent(kit, model, system="You are triage.", handoffs=[billing])
    return Built(built, [model, billing_model], kit.effects)


def _check(kit: Kit, what: str) -> Callable[[RunContext[Any], object], Any]:
    """A guardrail that passes after a few awaits (a stop can land inside it), noting
    ``what`` in the order of effects when it passed."""

    async def check(ctx: RunContext[Any], value: object) -> None:
        for _ in range(3):
            await asyncio.sleep(0)
        kit.effects.order.append(what)

    return check


def _guarded(kit: Kit, **guardrails: Any) -> Built:
    """The tools capability with ``guardrails`` (the Agent's options) on its agent."""
    built = tools(kit)
    built.agent = agent(kit, built.models[0], built.agent.tools, **guardrails)
    return built


def input_guardrail(kit: Kit) -> Built:
    return _guarded(kit, input_guardrails=[_check(kit, "guardrail:input")])


def output_guardrail(kit: Kit) -> Built:
    return _guarded(kit, output_guardrails=[_check(kit, "guardrail:output")])


def tool_guardrail(kit: Kit) -> Built:
    guard = aio.ToolGuardrail(before=_check(kit, "guardrail:before"),
                              after=_check(kit, "guardrail:after"))
    return _guarded(kit, tool_guardrails=[guard])


def fallback(kit: Kit) -> Built:
    failing = ScriptedModel(lambda request: Turn(fault="http_500"), model="down")
    second = ScriptedModel(
        call_then_answer(kit, lambda: [ScriptedCall("charge", {"amount": 1})]), model="up"
    )
    model = aio.FallbackModel(failing, second)
    return Built(agent(kit, model, [charging(kit)]), [failing, second], kit.effects)


def mcp_server() -> aio.MCPServer:
    """The MCP test server (tests/aio/mcp) as a stdio child, offering its ``add``."""
    return aio.MCPServer.stdio(sys.executable, [MCP_SERVER, "stdio"], name="calc",
                               tools=["add"])


async def shared_mcp() -> dict[str, Any]:
    """One MCP server for every case of a cell (opened here: agents leave it open)."""
    server = mcp_server()
    await server.open()
    return {"mcp": server, "closers": [server.aclose]}


def mcp(kit: Kit) -> Built:
    server = kit.extra.get("mcp") or mcp_server()
    model = ScriptedModel(call_then_answer(kit, lambda: [ScriptedCall("add", {"a": 2, "b": 3})]))
    built = Built(agent(kit, model, [server]), [model], kit.effects,
                  idempotent=frozenset({"add"}))
    if "mcp" not in kit.extra:
        built.closers.append(server.aclose)
    return built


def continue_partial(kit: Kit) -> Built:
    model = ScriptedModel(call_then_answer(kit, lambda: ()), continues_partial=True)
    return Built(agent(kit, model), [model], kit.effects, continue_partial=True)


def typed_output(kit: Kit) -> Built:
    text = '{"score": 7, "why": "' + ANSWER + '"}'
    model = ScriptedModel(
        call_then_answer(kit, lambda: [ScriptedCall("charge", {"amount": 2})], answer=text)
    )
    built = agent(kit, model, [charging(kit)], output_type=Verdict)
    return Built(built, [model], kit.effects, output_type=Verdict)


BUILDERS: dict[str, Callable[[Kit], Built]] = {
    "plain": plain, "tools": tools, "approvals": approvals, "external": external,
    "send": send, "tree": tree, "handoff": handoff, "input_guardrail": input_guardrail,
    "output_guardrail": output_guardrail, "tool_guardrail": tool_guardrail,
    "fallback": fallback, "mcp": mcp, "continue_partial": continue_partial,
    "typed_output": typed_output,
}
