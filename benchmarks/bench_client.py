"""Model-client overhead over loopback, against bare httpx reading the same stream.

    python benchmarks/bench_client.py [--repeats 200] [--chunks 50]

The loopback server runs in its own thread (``LoopbackServer.in_thread``), so both
sides pay the same server cost. Prints, with medians over ``--repeats`` turns:

- one streamed ``--chunks``-chunk reply through ``ollama:`` and ``openai:``
  (``stream_turn`` drained), next to a bare ``httpx`` request that reads the same
  stream line by line and ``json.loads`` each line; the ratio, and the overhead per
  turn and per chunk.
- request cost against conversation length (10, 100, 1,000 messages, one-word reply):
  each client's turn against bare httpx posting the same wire messages, and the CPU
  time our edge spends preparing the request (wire conversion + JSON). Preparation
  per message must stay flat: linear growth, no re-validation of the history. (The
  ``ollama`` package validates every message with pydantic on each request: that is
  in its "extra", not in "prepare".)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx

from aimu.aio.client import ModelClient
from aimu.aio.providers._http import TurnInput
from aimu.aio.providers.ollama import OllamaClient
from aimu.aio.providers.ollama import to_wire as ollama_wire
from aimu.aio.providers.openai import OpenAIClient
from aimu.aio.providers.openai import to_wire as openai_wire
from aimu.aio.transcript import Message
from aimu.testing.script import Turn
from aimu.testing.server import LoopbackServer

Turns = Callable[[], Awaitable[None]]


def conversation(length: int) -> list[Message]:
    """A transcript of ``length`` messages: chat turns with a tool round every few turns."""
    messages: list[Message] = [{"role": "system", "content": "You are a helpful assistant."}]
    serial = 0
    while len(messages) < length:
        serial += 1
        messages.append({"role": "user", "content": f"Question {serial}: " + "lorem ipsum " * 16})
        if serial % 3 == 0 and len(messages) + 2 < length:
            call_id = f"call_{serial}"
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "search", "arguments": {"query": f"topic {serial}"}}},
            ]})
            messages.append({"role": "tool", "content": "result " * 20, "tool_call_id": call_id,
                             "name": "search"})
        messages.append({"role": "assistant", "content": "Answer: " + "dolor sit amet " * 12})
    return messages[:length]


async def interleaved(turns: Mapping[str, Turns], repeats: int, warmup: int) -> dict[str, float]:
    """Median µs per turn for each of ``turns``, run in turn so drift and noise hit all."""
    for _ in range(warmup):
        for turn in turns.values():
            await turn()
    samples: dict[str, list[float]] = {name: [] for name in turns}
    gc.collect()
    for _ in range(repeats):
        for name, turn in turns.items():
            start = time.perf_counter_ns()
            await turn()
            samples[name].append((time.perf_counter_ns() - start) / 1000)
    return {name: statistics.median(values) for name, values in samples.items()}


def bare_ndjson(http: httpx.AsyncClient, url: str, body: Mapping[str, Any]) -> Turns:
    async def turn() -> None:
        async with http.stream("POST", url, json=body) as response:
            async for line in response.aiter_lines():
                if line:
                    json.loads(line)

    return turn


def bare_sse(http: httpx.AsyncClient, url: str, body: Mapping[str, Any]) -> Turns:
    async def turn() -> None:
        async with http.stream("POST", url, json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    json.loads(line[6:])

    return turn


def through(model: ModelClient, messages: list[Message]) -> Turns:
    async def turn() -> None:
        async for _ in model.stream_turn(messages):
            pass

    return turn


#: Each client's bare-httpx twin, reading the same stream.
BARE = {"ollama:": "httpx NDJSON", "openai:": "httpx SSE"}
Models = dict[str, OllamaClient | OpenAIClient]


async def compare(
    server: LoopbackServer, http: httpx.AsyncClient, messages: list[Message],
    repeats: int, warmup: int,
) -> tuple[dict[str, float], dict[str, dict[str, Any]], Models]:
    """Median µs per turn of both clients and their bare twins; the bodies and clients."""
    ollama = OllamaClient("bench", host=server.url)
    openai = OpenAIClient("bench", base_url=server.openai_base_url, api_key="sk-bench")
    bodies = {
        "ollama:": {"model": "bench", "messages": [ollama_wire(m) for m in messages],
                    "stream": True},
        "openai:": {"model": "bench", "messages": [openai_wire(m) for m in messages],
                    "stream": True, "stream_options": {"include_usage": True}},
    }
    try:
        medians = await interleaved(
            {
                BARE["ollama:"]: bare_ndjson(http, server.url + "/api/chat", bodies["ollama:"]),
                "ollama:": through(ollama, messages),
                BARE["openai:"]: bare_sse(
                    http, server.openai_base_url + "/chat/completions", bodies["openai:"]
                ),
                "openai:": through(openai, messages),
            },
            repeats,
            warmup,
        )
    finally:
        await ollama.aclose()
        await openai.aclose()
    return medians, bodies, {"ollama:": ollama, "openai:": openai}


async def streamed_reply(server: LoopbackServer, repeats: int, chunks: int) -> None:
    server.script = lambda request: Turn(text=" ".join(f"w{n}" for n in range(chunks)))
    messages: list[Message] = [{"role": "user", "content": "Say fifty words."}]
    async with httpx.AsyncClient(timeout=30) as http:
        medians, _, _ = await compare(server, http, messages, repeats, warmup=10)
    print(f"\nStreamed {chunks}-chunk reply over loopback, median of {repeats} turns")
    print(f"{'client':<10} {'turn':>10} {'bare httpx':>12} {'ratio':>7} {'overhead':>10} "
          f"{'per chunk':>10}")
    for name, bare in BARE.items():
        ours, base = medians[name], medians[bare]
        extra = ours - base
        print(f"{name:<10} {ours:>8.0f}µs {base:>10.0f}µs {ours / base:>6.2f}x "
              f"{extra:>8.0f}µs {extra / chunks:>8.1f}µs")


def preparation_us(model: OllamaClient | OpenAIClient, messages: list[Message],
                   repeats: int) -> float:
    """CPU time to turn ``messages`` into the request bytes (each message's wire form is
    cached, so this is what a request costs once the transcript was sent before)."""
    sent = TurnInput(messages)

    def prepare() -> None:
        model.body(sent)

    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        prepare()
        samples.append((time.perf_counter_ns() - start) / 1000)
    return statistics.median(samples)


async def growth(server: LoopbackServer, repeats: int) -> None:
    server.script = lambda request: Turn(text="ok")
    print(f"\nRequest cost against conversation length (one-word reply), median of {repeats}")
    print(f"{'messages':>8} {'KB sent':>8} {'client':<8} {'turn':>10} {'bare httpx':>11} "
          f"{'extra':>9} {'prepare':>9} {'per msg':>9}")
    per_message: dict[str, list[float]] = {"ollama:": [], "openai:": []}
    async with httpx.AsyncClient(timeout=30) as http:
        for length in (10, 100, 1000):
            messages = conversation(length)
            medians, bodies, models = await compare(server, http, messages, repeats, warmup=3)
            for name, bare in BARE.items():
                size = len(json.dumps(bodies[name])) / 1024
                ours, base = medians[name], medians[bare]
                prepare = preparation_us(models[name], messages, repeats * 4)
                per_message[name].append(prepare / length)
                print(f"{length:>8} {size:>8.1f} {name:<8} {ours:>8.0f}µs {base:>9.0f}µs "
                      f"{ours - base:>7.0f}µs {prepare:>7.0f}µs {prepare / length:>7.2f}µs")
    for name, costs in per_message.items():
        # Linear: preparing each message costs the same however long the history is.
        ratio = costs[-1] / costs[-2]
        verdict = "linear" if ratio < 1.5 else "SUPERLINEAR"
        print(f"{name} preparation per message, 1000 vs 100 messages: {ratio:.2f}x ({verdict})")


async def main(repeats: int, chunks: int) -> None:
    with LoopbackServer.in_thread() as server:
        await streamed_reply(server, repeats, chunks)
        await growth(server, max(10, repeats // 4))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200, help="turns per figure (200)")
    parser.add_argument("--chunks", type=int, default=50, help="chunks per reply (50)")
    options = parser.parse_args()
    print(f"python {sys.version.split()[0]}, httpx {httpx.__version__}")
    asyncio.run(main(options.repeats, options.chunks))
