"""Budgets: :class:`UsageLimits` stop a run before it spends past them.

A limit that can be known in advance (requests, tool calls, a context window, tokens
or cost already spent, the wall clock) stops the run at the step boundary before it
would be crossed; a streamed reply that crosses a token or cost limit, or a reply or
tool call still going when the wall clock limit comes, is cut at once, its partial text
kept. The run then ends with status ``limited`` and a ``stop_reason``
of ``"limit:<name>"``. :class:`Spend` counts what a run or a session used; a session's
spend is kept in its store, so no process can spend past a session budget.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Final, Literal, TypeAlias

from aimu.aio._echo import echo
from aimu.aio._numbers import MAX_COUNT, finite
from aimu.aio.transcript import Message, Usage

__all__ = [
    "LimitHit",
    "LimitName",
    "ModelPrice",
    "SharedBudget",
    "Spend",
    "UsageLimits",
    "estimate_tokens",
    "transcript_chars",
]


LimitName: TypeAlias = Literal[
    "requests", "tool_calls", "input_tokens", "output_tokens", "total_tokens", "cost", "wall",
    "context_window",
]

_COUNTS = ("requests", "tool_calls", "input_tokens", "output_tokens", "total_tokens")
#: The most a price per million tokens may be: with counts up to MAX_COUNT, a cost stays
#: a finite float (a store refuses an infinite one).
MAX_PRICE: Final = 1e15


def estimate_tokens(chars: int) -> int:
    """Tokens in ``chars`` characters of text, estimated (4 characters a token, rounded up)."""
    return (chars + 3) // 4


def transcript_chars(messages: Sequence[Message], start: int) -> int:
    """The characters a model reads in ``messages[start:]``: text, thinking, tool calls."""
    chars = 0
    for message in messages[start:] if start else messages:
        chars += len(message["content"]) + 8  # the role and the template's markers
        if message["role"] == "assistant":
            chars += len(message.get("thinking", ""))
            for call in message.get("tool_calls", ()):
                function = call["function"]
                chars += len(function["name"]) + len(repr(function["arguments"]))
    return chars


def _check_amount(
    owner: str, name: str, value: object, *, whole: bool, most: float | None = None,
    optional: bool = True,
) -> None:
    """``value`` is a non-negative int (``whole``; at most MAX_COUNT) or finite number (at
    most ``most``), or None if ``optional``; else TypeError (not a number) or ValueError."""
    if value is None and optional:
        return
    kind = "int" if whole else "number"
    none = " or None" if optional else ""
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
        raise TypeError(f"{owner}: {name} must be a non-negative {kind}{none}, got {value!r}")
    most = MAX_COUNT if whole else most
    if finite(value) and value >= 0 and (most is None or value <= most):
        return
    wanted = (
        "int of at most 2**63-1" if whole
        else "finite number" + (f" of at most {most:g}" if most is not None else "")
    )
    raise ValueError(f"{owner}: {name} must be a non-negative {wanted}{none}, got {echo(value)}")


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """What a model costs, per million input and output tokens (in your currency; at most
    ``1e15`` each, so that no cost overflows)."""

    input: float
    output: float

    def __post_init__(self) -> None:
        for name in ("input", "output"):
            _check_amount("ModelPrice", name, getattr(self, name), whole=False, most=MAX_PRICE,
                          optional=False)

    def of(self, input_tokens: int, output_tokens: int) -> float:
        """The cost of that many tokens."""
        return (input_tokens * self.input + output_tokens * self.output) / 1_000_000


@dataclass(frozen=True, slots=True)
class UsageLimits:
    """The most a run (``Agent(limits=)``, ``run(limits=)``) or a session
    (``Agent(session_limits=)``) may use; None: no limit on that.

    ``cost`` is priced with ``prices`` (model name -> :class:`ModelPrice`; no price list
    ships with aimu). ``wall`` is seconds: reached mid-reply or mid-tool-call, it cuts the
    reply (kept, marked partial) or the calls (answered "cancelled") at once and the run
    ends ``limited``, resumable; ``RunHandle.start(..., timeout=)`` is the deadline that
    ends a run ``timed_out`` instead. Negative, NaN or infinite values, and counts past
    ``2**63-1``, raise ``ValueError`` at once.
    """

    requests: int | None = None
    tool_calls: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None
    cost: float | None = None
    wall: float | None = None
    prices: Mapping[str, ModelPrice] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in _COUNTS:
            _check_amount("UsageLimits", name, getattr(self, name), whole=True)
        _check_amount("UsageLimits", "cost", self.cost, whole=False)
        _check_amount("UsageLimits", "wall", self.wall, whole=False)
        if not isinstance(self.prices, Mapping):
            raise TypeError(
                f"UsageLimits: prices must map model names to ModelPrice, got "
                f"{type(self.prices).__name__}"
            )
        for model, price in self.prices.items():
            if not isinstance(model, str) or not isinstance(price, ModelPrice):
                raise TypeError(
                    f"UsageLimits: prices must map model names (str) to ModelPrice, got "
                    f"{model!r}: {type(price).__name__}"
                )
        object.__setattr__(self, "prices", dict(self.prices))

    @property
    def counts_tokens(self) -> bool:
        """True when a limit needs the server's token counts (or a cost made of them)."""
        return (
            self.input_tokens is not None or self.output_tokens is not None
            or self.total_tokens is not None or self.cost is not None
        )

    def price_of(self, model: str) -> ModelPrice | None:
        """The price of ``model``; ValueError when a cost limit has none for it."""
        price = self.prices.get(model)
        if price is None and self.cost is not None:
            known = ", ".join(repr(m) for m in self.prices) or "none"
            raise ValueError(
                f"a cost limit needs a price for model {model!r} "
                f"(UsageLimits(prices={{{model!r}: ModelPrice(...)}})); prices given for: {known}"
            )
        return price

    def __repr__(self) -> str:
        shown = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.name != "prices" and getattr(self, f.name) is not None
        ]
        if self.prices:
            shown.append(f"prices={self.prices!r}")
        return f"UsageLimits({', '.join(shown)})"


Per = Literal["run", "session", "workflow", "parent"]
"""Whose limit: the run's, the session's, the workflow run's the agent runs inside, or
that of the run of an agent that called it as a tool (``agent.as_tool()``)."""


@dataclass(slots=True)
class SharedBudget:
    """A workflow run's limits and what all the agent runs inside it spend together
    (side by side or one after another): each agent run checks them as its own.

    An agent called as a tool gets its caller's run limits and spend this way
    (``per="parent"``): what it spends counts in its caller's run, and in every budget
    the caller's run counts in (``outer``), so a budget holds across an agent tree."""

    limits: UsageLimits
    spend: Spend = field(default_factory=lambda: Spend())
    started: float = field(default_factory=time.monotonic)
    per: Per = "workflow"
    outer: SharedBudget | None = None

    def chain(self) -> list[SharedBudget]:
        """This budget and those around it, innermost first."""
        chain: list[SharedBudget] = []
        each: SharedBudget | None = self
        while each is not None:
            chain.append(each)
            each = each.outer
        return chain


@dataclass(frozen=True, slots=True)
class LimitHit:
    """A limit that stopped a run: which, its value, and what was used (or would be)."""

    name: LimitName
    limit: float
    used: float
    per: Per = "run"

    @property
    def stop_reason(self) -> str:
        return f"limit:{self.name}"

    @property
    def message(self) -> str:
        what = "the model's context window" if self.name == "context_window" else (
            f"the {self.per}'s {self.name} limit"
        )
        return f"{what} of {self.limit:g} would be crossed ({self.used:g})"


class Spend:
    """What a run or a session used: requests, tool calls, tokens, cost, seconds.

    ``estimated`` turns true once a count came from streamed text rather than the
    server (a stream that was cut reports no usage).
    """

    __slots__ = (
        "cost", "estimated", "input_tokens", "output_tokens", "requests", "tool_calls", "wall",
    )

    def __init__(self) -> None:
        self.requests = 0
        self.tool_calls = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.cost = 0.0
        self.wall = 0.0
        self.estimated = False

    def add(self, other: Spend) -> None:
        self.requests += other.requests
        self.tool_calls += other.tool_calls
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.cost += other.cost
        self.wall += other.wall
        self.estimated = self.estimated or other.estimated

    def dump(self) -> dict[str, Any]:
        """Plain JSON data (the form a store keeps)."""
        return {
            "requests": self.requests, "tool_calls": self.tool_calls,
            "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
            "cost": self.cost, "wall": self.wall, "estimated": self.estimated,
        }

    @classmethod
    def load(cls, data: object, where: str) -> Spend:
        """A spend read back from :meth:`dump`'s form (None: nothing spent); ValueError
        naming ``where`` when it is not that form."""
        spend = cls()
        if data is None:
            return spend
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: 'spend' must be an object, got {type(data).__name__}")
        for name in ("requests", "tool_calls", "input_tokens", "output_tokens"):
            value = data.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: spend {name!r} must be a non-negative int")
            setattr(spend, name, value)
        for name in ("cost", "wall"):
            value = data.get(name, 0.0)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{where}: spend {name!r} must be a non-negative number")
            setattr(spend, name, float(value))
        spend.estimated = data.get("estimated") is True
        return spend

    def __repr__(self) -> str:
        return f"Spend({', '.join(f'{k}={v!r}' for k, v in self.dump().items())})"


def _over(
    limits: UsageLimits, spent: Spend, usage: Usage, price: ModelPrice | None
) -> tuple[LimitName, float, float] | None:
    """The token or cost limit that ``spent`` and a reply's ``usage`` so far cross."""
    input_tokens = spent.input_tokens + usage["input_tokens"]
    output_tokens = spent.output_tokens + usage["output_tokens"]
    if limits.input_tokens is not None and input_tokens > limits.input_tokens:
        return "input_tokens", limits.input_tokens, input_tokens
    if limits.output_tokens is not None and output_tokens > limits.output_tokens:
        return "output_tokens", limits.output_tokens, output_tokens
    total = input_tokens + output_tokens
    if limits.total_tokens is not None and total > limits.total_tokens:
        return "total_tokens", limits.total_tokens, total
    if limits.cost is not None:
        cost = spent.cost + (
            0.0 if price is None else price.of(usage["input_tokens"], usage["output_tokens"])
        )
        if cost > limits.cost:
            return "cost", limits.cost, cost
    return None


_NO_LIMITS = UsageLimits()


class Budget:
    """The limits of one run and of its session, with what each has spent.

    ``run`` counts this run; ``session`` is what the session spent in all, this run
    included (loaded from the store when there is one); ``shared``, with a workflow's
    limits, what all the agent runs of that workflow run spent together. The checks return the
    :class:`LimitHit` that stops the run, or None; each costs a few comparisons.
    """

    __slots__ = (
        "_checks", "_limits", "_outer", "_priced", "_scopes", "_spends", "_started", "_wall",
        "limited",
        "model", "price", "run", "session", "session_limits_set", "shared", "wall_at", "watch",
    )

    def __init__(
        self,
        limits: UsageLimits | None,
        session_limits: UsageLimits | None,
        session: Spend,
        model: str,
        shared: SharedBudget | None = None,
    ) -> None:
        self.run = Spend()
        self.session = session
        self._limits, self._outer = limits, shared
        shared_chain = [] if shared is None else shared.chain()
        #: What the runs that share a budget with this one (a workflow run's agent runs,
        #: an agent tree's) spend together: each is counted what this run spends.
        self.shared = tuple(budget.spend for budget in shared_chain)
        #: Every spend this run counts into: its own, its session's, and the shared ones.
        self._spends = (self.run, session, *self.shared)
        self._priced = tuple(each for each in (limits, session_limits) if each is not None)
        self._priced += tuple(budget.limits for budget in shared_chain)
        #: The model whose price counts the tokens (:meth:`reprice` moves it).
        self.model = ""
        self.price: ModelPrice | None = None
        self.reprice(model)
        started = time.monotonic()
        # (whose, limits, spend, when its clock started); a workflow's clock is its own,
        # and what ran before this run is in the run's and the session's spend.wall.
        scopes: list[tuple[Per, UsageLimits, Spend, float]] = []
        if limits is not None:
            scopes.append(("run", limits, self.run, started))
        if session_limits is not None:
            scopes.append(("session", session_limits, session, started))
        for budget in shared_chain:
            scopes.append((budget.per, budget.limits, budget.spend, budget.started))
        self._scopes = tuple((per, each, spent) for per, each, spent, _ in scopes)
        self._checks = tuple(
            (per, each.requests, each.input_tokens, each.output_tokens, each.total_tokens,
             each.cost, each.wall, spent, since)
            for per, each, spent, since in scopes
        )
        self.session_limits_set = session_limits is not None
        #: When the first ``wall`` limit is reached (``time.monotonic()``), and that limit.
        self.wall_at: float | None = None
        self._wall: tuple[Per, float, Spend, float] | None = None
        for per, each, spent, since in scopes:
            if each.wall is not None:
                at = since + each.wall - spent.wall
                if self.wall_at is None or at < self.wall_at:
                    self.wall_at, self._wall = at, (per, each.wall, spent, since)
        #: True when there is any limit to check (read twice a round, so kept, not derived).
        self.limited = bool(self._scopes)
        #: True when a streamed reply must be watched as it comes (a token or cost limit).
        self.watch = any(each.counts_tokens for _, each, _ in self._scopes)
        self._started = started

    def for_callee(self) -> SharedBudget:
        """What an agent this run calls as a tool shares: this run's limits and spend
        (it spends in this run), and the budgets this run spends in."""
        return SharedBudget(
            self._limits or _NO_LIMITS, self.run, self._started, "parent", self._outer
        )

    def before_request(self) -> LimitHit | None:
        """The limit the next model request would cross (or one already reached).

        The hot path of every round: plain comparisons on locals (see bench_limits.py).
        """
        for (per, requests, input_tokens, output_tokens, total, cost, wall, spent,
             since) in self._checks:
            if requests is not None and spent.requests >= requests:
                return LimitHit("requests", requests, spent.requests + 1, per)
            if input_tokens is not None and spent.input_tokens >= input_tokens:
                return LimitHit("input_tokens", input_tokens, spent.input_tokens, per)
            if output_tokens is not None and spent.output_tokens >= output_tokens:
                return LimitHit("output_tokens", output_tokens, spent.output_tokens, per)
            if total is not None and spent.input_tokens + spent.output_tokens >= total:
                used_tokens = spent.input_tokens + spent.output_tokens
                return LimitHit("total_tokens", total, used_tokens, per)
            if cost is not None and spent.cost >= cost:
                return LimitHit("cost", cost, spent.cost, per)
            if wall is not None:
                used = spent.wall + time.monotonic() - since
                if used >= wall:
                    return LimitHit("wall", wall, used, per)
        return None

    def before_tools(self, calls: int) -> LimitHit | None:
        """The limit running ``calls`` tool calls would cross, if any."""
        for per, limits, spent in self._scopes:
            if limits.tool_calls is not None and spent.tool_calls + calls > limits.tool_calls:
                return LimitHit("tool_calls", limits.tool_calls, spent.tool_calls + calls, per)
        return None

    def streamed(self, usage: Usage) -> LimitHit | None:
        """The token or cost limit that the reply streaming now (``usage``, estimated)
        crosses, if any."""
        for per, limits, spent in self._scopes:
            crossed = _over(limits, spent, usage, self.price)
            if crossed is not None:
                return LimitHit(*crossed, per)
        return None

    def wall_hit(self) -> LimitHit:
        """The ``wall`` limit reached at :attr:`wall_at` (a reply or a tool call cut by it)."""
        assert self._wall is not None, "no wall limit"
        per, wall, spent, since = self._wall
        return LimitHit("wall", wall, spent.wall + time.monotonic() - since, per)

    def count_request(self) -> None:
        for spend in self._spends:
            spend.requests += 1

    def count_tools(self, calls: int) -> None:
        for spend in self._spends:
            spend.tool_calls += calls

    def reprice(self, model: str) -> None:
        """Count the next tokens at ``model``'s price (a fallback answered with another
        model than the one the run began with)."""
        if model == self.model:
            return
        price = None
        for each in self._priced:
            price = each.price_of(model) or price
        self.model, self.price = model, price

    def count_tokens(
        self, usage: Usage, *, estimated: bool, less: Usage | None = None
    ) -> None:
        """Count ``usage``; ``less``: what was counted for it up front (an estimate made
        before the request was sent), taken back now that the usage is known."""
        input_tokens, output_tokens = usage["input_tokens"], usage["output_tokens"]
        if less is not None:
            input_tokens -= less["input_tokens"]
            output_tokens -= less["output_tokens"]
        price = self.price
        cost = 0.0 if price is None else price.of(input_tokens, output_tokens)
        for spend in self._spends:
            spend.input_tokens += input_tokens
            spend.output_tokens += output_tokens
            spend.cost += cost
            spend.estimated = spend.estimated or estimated

    def finish(self) -> Spend:
        """This run's spend, its wall time added (to the session's too)."""
        wall = time.monotonic() - self._started
        self.run.wall = wall
        self.session.wall += wall
        return self.run
