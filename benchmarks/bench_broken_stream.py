"""A reply cut once by the network: continued vs restarted vs failed-and-resumed-by-hand.

A reply of ``--tokens`` words (one token each, ``--delay`` s apart: a model's generation
speed) to a prompt of ``--prompt`` words is cut once half-way (the connection closed
mid-body), on each wire of the loopback server. The wall time is from the run's start to
its finished answer; the tokens are what the server was asked to read (input) and made
(output) over every request: what a vendor bills. Modes: ``uncut`` (the baseline),
``continued`` (the client sends the text so far for the server to go on from;
``openai-responses`` re-attaches to its background response), ``restarted`` (the turn
asked again from the start), ``by hand`` (``retries=0``: the run fails, then
``agent.resume()`` on the caller's side, continuing where the client can). Retries wait
``--retry-delay`` (0 here: the mechanism, not the backoff; the default 0.5 s adds 0.25 to
0.5 s). Medians of interleaved repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aimu import aio
from aimu.aio.client import ModelClient
from aimu.aio.errors import ModelError
from aimu.testing.script import Turn
from aimu.testing.server import LoopbackServer

WIRES = ("ollama", "openai", "openai-responses", "anthropic", "gemini")
MODES = ("uncut", "continued", "restarted", "by hand")


@dataclass
class Ledger:
    """What the server was asked to read and made, over a run's requests."""

    input: int = 0
    output: int = 0
    requests: int = 0
    cut: list[bool] = field(default_factory=list)


def words_of(request: Mapping[str, Any]) -> int:
    return sum(len(str(m.get("content") or "").split()) for m in request.get("messages", ()))


def script(
    tokens: int, delay: float, cut: bool, ledger: Ledger, goes_on: bool
) -> Callable[..., Turn]:
    """The reply, its first request cut half-way (``goes_on``: a background response,
    which the server finishes whatever the connection does)."""
    answer = [f"w{i}" for i in range(tokens)]

    def turn(request: Mapping[str, Any]) -> Turn:
        messages = request.get("messages") or []
        last = messages[-1] if messages else {}
        said = len(str(last.get("content") or "").split()) if last.get("role") == "assistant" else 0
        rest = answer[said:]
        first = ledger.requests == 0
        ledger.requests += 1
        ledger.input += words_of(request)
        fault = "drop" if cut and first else None
        made = tokens // 2 if fault and not goes_on else len(rest)
        ledger.output += made
        return Turn(text=" ".join(rest), delay=delay, input_tokens=words_of(request),
                    output_tokens=len(rest), fault=fault, fault_after=tokens // 2)

    return turn


def client(wire: str, server: LoopbackServer, mode: str, retry_delay: float) -> ModelClient:
    options: dict[str, Any] = {"retry_delay": retry_delay, "timeout": 60.0}
    if mode == "by hand":
        options["retries"] = 0
    continues = mode in ("continued", "by hand")
    if wire == "ollama":
        return aio.client("ollama:m", host=server.url, continues_partial=continues, **options)
    if wire == "openai":
        return aio.client("openai:m", base_url=server.openai_base_url, api_key="k",
                          continues_partial=continues, **options)
    if wire == "anthropic":
        return aio.client("anthropic:m", base_url=server.url, api_key="k",
                          continues_partial=continues, **options)
    if wire == "gemini":
        return aio.client("gemini:m", base_url=server.gemini_base_url, api_key="k", **options)
    return aio.client("openai-responses:m", base_url=server.openai_base_url, api_key="k",
                      background=mode == "continued", **options)


def applies(wire: str, mode: str) -> bool:
    """Gemini (and OpenAI Responses without background mode) cannot continue."""
    return not (mode == "continued" and wire == "gemini")


async def once(wire: str, mode: str, options: argparse.Namespace) -> tuple[float, Ledger]:
    ledger = Ledger()
    background = wire == "openai-responses" and mode == "continued"
    turn = script(options.tokens, options.delay, mode != "uncut", ledger, background)
    task = " ".join(["read"] * options.prompt)
    async with (
        LoopbackServer(turn) as server,
        client(wire, server, mode, options.retry_delay) as model,
    ):
        agent = aio.Agent(model)
        start = time.perf_counter()
        try:
            answer = await agent.run(task)
        except ModelError:
            answer = await agent.resume(continue_partial=model.continues_partial)
        elapsed = time.perf_counter() - start
    expected = " ".join(f"w{i}" for i in range(options.tokens))
    if answer.replace("\n\n", " ").split() != expected.split():
        raise SystemExit(f"{wire} {mode}: the answer is not the reply ({answer[:80]!r}...)")
    return elapsed, ledger


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--prompt", type=int, default=500)
    parser.add_argument("--delay", type=float, default=0.001)
    parser.add_argument("--retry-delay", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--wires", default=",".join(WIRES))
    options = parser.parse_args()
    wires = options.wires.split(",")
    results: dict[tuple[str, str], list[tuple[float, Ledger]]] = {}
    for repeat in range(options.repeats):
        for wire in wires:
            modes = MODES if repeat % 2 == 0 else tuple(reversed(MODES))
            for mode in modes:
                if applies(wire, mode):
                    results.setdefault((wire, mode), []).append(await once(wire, mode, options))
    print(f"a reply of {options.tokens} tokens ({options.delay * 1000:g} ms a token) to a "
          f"prompt of {options.prompt}, cut once after {options.tokens // 2}; "
          f"retry delay {options.retry_delay:g} s; medians of {options.repeats}")
    print(f"{'wire':18} {'mode':10} {'seconds':>8} {'vs uncut':>9} {'requests':>9} "
          f"{'input paid':>11} {'output paid':>12}")
    for wire in wires:
        base = statistics.median(r[0] for r in results[(wire, "uncut")])
        for mode in MODES:
            runs = results.get((wire, mode))
            if runs is None:
                print(f"{wire:18} {mode:10} {'(cannot continue)':>30}")
                continue
            seconds = statistics.median(r[0] for r in runs)
            ledger = runs[0][1]
            print(f"{wire:18} {mode:10} {seconds:8.3f} {seconds - base:+9.3f} "
                  f"{ledger.requests:9d} {ledger.input:11d} {ledger.output:12d}")


if __name__ == "__main__":
    asyncio.run(main())
