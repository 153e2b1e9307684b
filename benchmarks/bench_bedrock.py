"""``bedrock:`` over the loopback fake: whole tool rounds against a bare httpx client that
signs with botocore, and how soon the server sees a cancelled stream closed.

    python benchmarks/bench_bedrock.py              # 50 rounds x 15 repeats, 105 cancels
    python benchmarks/bench_bedrock.py --callgrind  # + instructions per round (valgrind)
    python benchmarks/bench_bedrock.py --quick      # a smoke run (CI)

The loopback server (bench_wire.py's, in a process of its own) checks every request's
SigV4 signature. Each sample is one whole run: a client made, an agent with one no-op
tool, ``rounds`` tool rounds, the answer, the client closed. The baseline is a bare
``httpx.AsyncClient`` doing the same requests in the same run: Converse messages kept as
dicts, each request signed by botocore's ``SigV4Auth`` (static credentials, as aimu's
here), the event stream read with botocore's ``EventStreamBuffer`` (which checks the
CRCs too), the tool input's fragments joined. Prints medians of interleaved repeats:

- µs per round at 50 rounds, wall and client CPU, ours / bare (target <= 1.1x);
- with ``--callgrind``: instructions per round (2 runs - 1 run, so start-up cancels);
- cancel to closed: a streamed turn closed after its first chunk, ms until the loopback
  server (in a thread of this process, one clock) sees the connection go (goal: median
  under 1 ms), beside ``anthropic:`` tried in turn with it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
from bench_wire import interleaved, noop, server_process
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import ReadOnlyCredentials
from botocore.eventstream import EventStreamBuffer

from aimu import aio
from aimu.aio.providers._pool import ssl_context
from aimu.testing.server.bedrock import CREDENTIALS, REGION, TEST_KEY_ID

Run = Any
MODEL = "anthropic.bench-v1:0"
KEYS = ReadOnlyCredentials(TEST_KEY_ID, CREDENTIALS[TEST_KEY_ID], None)
TOOLS = {"tools": [{"toolSpec": {
    "name": "noop", "description": "Does nothing; returns its argument.",
    "inputSchema": {"json": {"type": "object", "properties": {"n": {"type": "integer"}},
                             "required": ["n"]}}}}]}


def client(url: str) -> aio.ModelClient:
    return aio.client(f"bedrock:{MODEL}", region=REGION, base_url=url,
                      aws_access_key_id=TEST_KEY_ID, aws_secret_access_key=KEYS.secret_key)


def ours(url: str, rounds: int) -> Run:
    async def run() -> None:
        model = client(url)
        agent = aio.Agent(model, tools=[noop], max_rounds=rounds + 1)
        await agent.run(f"rounds={rounds}")
        await model.aclose()

    return run


async def _bare_turn(
    http: httpx.AsyncClient, url: str, messages: list[dict[str, Any]]
) -> tuple[str, list[dict[str, Any]]]:
    """One signed converse-stream request: text deltas, toolUse blocks and their input."""
    body = json.dumps({"messages": messages, "toolConfig": TOOLS}).encode()
    signed = AWSRequest(method="POST", url=url, data=body,
                        headers={"Content-Type": "application/json",
                                 "Host": http.base_url.netloc.decode()})
    SigV4Auth(KEYS, "bedrock", REGION).add_auth(signed)
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    parser = EventStreamBuffer()
    async with http.stream("POST", url, content=body, headers=dict(signed.headers)) as response:
        async for piece in response.aiter_bytes():
            parser.add_data(piece)
            for message in parser:
                event = json.loads(message.payload)
                kind = message.headers[":event-type"]
                if kind == "contentBlockDelta":
                    delta = event["delta"]
                    if "text" in delta:
                        text.append(delta["text"])
                    elif "toolUse" in delta:
                        calls[event["contentBlockIndex"]]["input"] += delta["toolUse"]["input"]
                elif kind == "contentBlockStart":
                    use = event["start"]["toolUse"]
                    calls[event["contentBlockIndex"]] = {
                        "toolUseId": use["toolUseId"], "name": use["name"], "input": ""}
    return "".join(text), list(calls.values())


def bare(url: str, rounds: int) -> Run:
    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, verify=ssl_context(), timeout=30) as http:
            endpoint = f"{url}/model/{MODEL.replace(':', '%3A')}/converse-stream"
            messages: list[dict[str, Any]] = [
                {"role": "user", "content": [{"text": f"rounds={rounds}"}]}]
            while True:
                text, calls = await _bare_turn(http, endpoint, messages)
                uses = [{"toolUse": {"toolUseId": c["toolUseId"], "name": c["name"],
                                     "input": json.loads(c["input"] or "{}")}} for c in calls]
                messages.append({"role": "assistant",
                                 "content": ([{"text": text}] if text else []) + uses})
                if not calls:
                    return
                messages.append({"role": "user", "content": [
                    {"toolResult": {"toolUseId": use["toolUse"]["toolUseId"],
                                    "content": [{"text": await noop(**use["toolUse"]["input"])}]}}
                    for use in uses]})

    return run


async def rounds_table(url: str, repeats: int, rounds: int) -> None:
    medians = await interleaved({"bare": bare(url, rounds), "bedrock:": ours(url, rounds)},
                                repeats)
    (wall, cpu), (bare_wall, bare_cpu) = medians["bedrock:"], medians["bare"]
    per = 1000 / rounds
    print(f"\nWhole tool rounds, {rounds} rounds, median of {repeats} interleaved runs, "
          "µs/round (bare: httpx + botocore's SigV4Auth and EventStreamBuffer)")
    print(f"{'client':<11} {'wall ours':>10} {'bare':>8} {'ratio':>6}   "
          f"{'client CPU ours':>15} {'bare':>8} {'ratio':>6}")
    print(f"{'bedrock:':<11} {wall * per:>10.0f} {bare_wall * per:>8.0f} "
          f"{wall / bare_wall:>5.2f}x   {cpu * per:>15.0f} {bare_cpu * per:>8.0f} "
          f"{cpu / bare_cpu:>5.2f}x")


async def cancel_to_closed(repeats: int) -> None:
    """A streamed turn closed after its first chunk: ms until the server sees it go, for
    ``bedrock:`` and, tried in turn with it for the same machine's load, ``anthropic:``."""
    from aimu.testing.script import Turn
    from aimu.testing.server import LoopbackServer

    words = " ".join(f"w{i}" for i in range(200))
    with LoopbackServer.in_thread(lambda request: Turn(text=words, delay=0.005)) as server:
        models = {"bedrock:": client(server.url),
                  "anthropic:": aio.client("anthropic:bench", base_url=server.url, api_key="k")}
        times: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(repeats + 1):
            for name, model in models.items():
                before = len([s for s in server.streams if s.abandoned])
                turn = model.stream_turn([{"role": "user", "content": "go"}])
                await anext(turn)
                closing = time.monotonic()
                await turn.aclose()
                records = await server.wait_abandoned(before + 1)
                times[name].append((max(r.abandoned_at or 0.0 for r in records) - closing) * 1000)
        for model in models.values():
            await model.aclose()
    print(f"\nCancel to closed, {repeats} tries each, in turn: a streamed turn closed after its "
          "first chunk, until the server sees the connection go")
    for name, taken in times.items():
        taken = sorted(taken[1:])  # the first opened the connection pool: left out
        p90 = taken[min(len(taken) - 1, int(len(taken) * 0.9))]
        print(f"{name:<11} median {statistics.median(taken):.2f} ms, p90 {p90:.2f} ms")


def count(url: str, name: str, runs: int, rounds: int) -> int:
    """Instructions of this script doing ``runs`` runs of ``name`` under callgrind."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "callgrind.out")
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
             __file__, "--instructions", name, "--url", url, "--runs", str(runs),
             "--rounds", str(rounds)],
            check=True, capture_output=True,
        )
        with open(out) as file:
            for line in file:
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
    raise RuntimeError("callgrind wrote no summary")


def instructions(url: str, rounds: int) -> None:
    """Instructions per round: (2 runs - 1 run) / rounds, so start-up and the first run's
    one-time costs cancel; steady whatever else the machine runs."""
    per = {name: (count(url, name, 2, rounds) - count(url, name, 1, rounds)) / rounds
           for name in ("bare", "bedrock:")}
    print(f"\nInstructions per round (callgrind), {rounds} rounds: (2 runs - 1 run)")
    print(f"{'client':<11} {'ours':>12} {'bare httpx':>12} {'ratio':>7}")
    print(f"{'bedrock:':<11} {per['bedrock:']:>12,.0f} {per['bare']:>12,.0f} "
          f"{per['bedrock:'] / per['bare']:>6.2f}x")


def play(name: str, url: str, runs: int, rounds: int) -> None:
    """``--instructions``: ``runs`` runs of ``name`` (the callgrind child)."""
    run = bare(url, rounds) if name == "bare" else ours(url, rounds)

    async def main() -> None:
        for _ in range(runs):
            await run()

    asyncio.run(main())


async def main(options: argparse.Namespace) -> None:
    with server_process() as url:
        await rounds_table(url, options.repeats, options.rounds)
        if options.callgrind:
            instructions(url, options.rounds)
    await cancel_to_closed(options.cancels)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--cancels", type=int, default=105)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--callgrind", action="store_true", help="also count instructions")
    parser.add_argument("--instructions", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=1, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.instructions:
        play(options.instructions, options.url, options.runs, options.rounds)
        sys.exit()
    if options.quick:
        options.repeats, options.rounds, options.cancels = 1, 5, 3
    print(f"python {sys.version.split()[0]}, httpx {httpx.__version__}")
    asyncio.run(main(options))
