"""Checked by ``mypy --strict`` (tests/test_typing.py), never run: ``ctx.deps`` is typed
by the tool's annotation, ``system=`` functions take a typed RunContext."""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_type

from aimu import aio


@dataclass
class Bank:
    balance: int


def balance(ctx: aio.ToolContext[Bank]) -> int:
    """The balance."""
    assert_type(ctx.deps, Bank)
    assert_type(ctx.deps.balance, int)
    return ctx.deps.balance


def untyped(ctx: aio.ToolContext) -> str:  # a bare ToolContext: deps of any type
    """Deps of any type."""
    return str(ctx.deps)


def instructions(context: aio.RunContext[Bank]) -> str:
    assert_type(context.deps, Bank)
    return f"The customer has {context.deps.balance}."


async def instructions_async(context: aio.RunContext[Bank]) -> str:
    return str(context.task)


async def given() -> None:
    model = aio.client("test")
    agent = aio.Agent(model, tools=[balance, untyped], deps=Bank(3), system=instructions)
    assert_type(await agent.run("hi", deps=Bank(4)), str)
    again = aio.Agent(model, system=instructions_async, limits=aio.UsageLimits(requests=3))
    assert_type(await again.resume(limits=aio.UsageLimits(requests=5)), str)


def wrong(ctx: aio.ToolContext[Bank]) -> object:
    return ctx.deps.name  # type: ignore[attr-defined]  # mypy catches a wrong field
