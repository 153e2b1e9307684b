"""A cut answer continued vs re-asked: tokens re-sent, tokens generated again, and time.

An answer of ``--words`` words (one token each, ``--delay`` s apart: a model's generation
speed) is cut half-way by closing its stream; then ``resume(continue_partial=True)``
sends the half as the assistant's prefix (re-sent: prompt tokens, cheap) and the model
generates only the rest, while ``resume()`` re-asks and the model generates it all
again. Over the loopback server (Ollama wire); medians of interleaved repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from collections.abc import Mapping
from typing import Any

from aimu import aio
from aimu.aio.events import TextChunk
from aimu.aio.providers.ollama import OllamaClient
from aimu.testing.script import Turn
from aimu.testing.server import LoopbackServer


def script(words: int, delay: float) -> Any:
    answer = [f"w{i}" for i in range(words)]

    def turn(request: Mapping[str, Any]) -> Turn:
        last = request["messages"][-1]
        said = len(last["content"].split()) if last["role"] == "assistant" else 0
        rest = answer[said:]
        return Turn(text=" ".join(rest), delay=delay, input_tokens=sum(
            len(str(m.get("content", "")).split()) for m in request["messages"]
        ), output_tokens=len(rest))

    return turn


async def once(server: LoopbackServer, words: int, continued: bool) -> tuple[float, int, int]:
    """(seconds to finish after the cut, prompt tokens re-sent, tokens generated)."""
    async with OllamaClient("m", host=server.url) as client:
        agent = aio.Agent(client)
        stream = agent.run("count", stream=True)
        seen = 0
        async with contextlib.aclosing(stream):
            async for event in stream:
                if isinstance(event, TextChunk):
                    seen += 1
                    if seen == words // 2:
                        break
        start = time.perf_counter()
        await agent.resume(continue_partial=continued)
        elapsed = time.perf_counter() - start
        usage = agent.last_run.usage if agent.last_run else {"input_tokens": 0,
                                                             "output_tokens": 0}
        return elapsed, usage["input_tokens"], usage["output_tokens"]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--words", type=int, default=200)
    parser.add_argument("--delay", type=float, default=0.005)
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    results: dict[bool, list[tuple[float, int, int]]] = {True: [], False: []}
    async with LoopbackServer(script(options.words, options.delay)) as server:
        for repeat in range(options.repeats):
            for continued in (True, False) if repeat % 2 else (False, True):
                results[continued].append(await once(server, options.words, continued))
    print(f"answer of {options.words} tokens, cut after {options.words // 2}, "
          f"{options.delay * 1000:g} ms a token")
    print(f"{'resume':28} {'seconds':>8} {'prompt tokens':>14} {'generated':>10}")
    for continued, label in ((False, "resume() (re-asks)"),
                             (True, "resume(continue_partial=True)")):
        runs = results[continued]
        seconds = statistics.median(r[0] for r in runs)
        print(f"{label:28} {seconds:8.3f} {runs[0][1]:14d} {runs[0][2]:10d}")


if __name__ == "__main__":
    asyncio.run(main())
