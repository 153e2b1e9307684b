"""The clouds' doors: ``azure:``, ``azure-responses:`` and ``vertex:`` whole tool rounds
against bare httpx on the same wire and door, and how soon the server sees a cancelled
stream closed.

    python benchmarks/bench_clouds.py              # 50 rounds, 15 repeats; 105 cancels
    python benchmarks/bench_clouds.py --callgrind  # + instructions per round (valgrind)
    python benchmarks/bench_clouds.py --quick      # a smoke run (CI)

As benchmarks/bench_wire.py (whose server process, bare clients, cancel and callgrind
measurements this reuses):
each sample is a whole run built as a user builds it (a client made, an agent with one
no-op tool, ``rounds`` tool rounds, the answer, the client closed); the baseline is a bare
``httpx.AsyncClient`` with the door's credential header doing the same requests in the
same run, keeping the transcript as wire dicts. The server checks every credential.
Rows with a changing credential: ``azure: (provider)`` asks an async Entra ID token
provider before each request, ``azure: (sync provider)`` a plain function (in a worker
thread), ``vertex: (credentials)`` checks google-auth credentials (valid: no refresh).

Prints µs per round at ``--rounds`` rounds, ours / bare (target ≤ 1.1x), wall and client
CPU; then cancel to closed (target: median < 1 ms), with ``openai:`` and ``gemini:``
measured beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import httpx
from bench_wire import (
    Run,
    bare,
    cancel_to_closed,
    instructions,
    interleaved,
    server_process,
)
from bench_wire import client as wire_client
from bench_wire import ours as wire_ours

from aimu import aio
from aimu.testing.server.clouds import AZURE_KEY, TOKEN

PROJECT, LOCATION = "bench-project", "us-central1"
VERTEX_PATH = (f"/v1/projects/{PROJECT}/locations/{LOCATION}/publishers/google/models/"
               "bench:streamGenerateContent?alt=sse")
#: The rows: a door, and how its credential is given when not the plain way.
ROWS = ("azure", "azure (provider)", "azure (sync provider)", "azure-responses", "vertex",
        "vertex (credentials)")
#: cancel_to_closed()'s rows: the doors, and public wires beside them (same server, load).
CANCELLED = ("openai", "azure", "azure-responses", "vertex", "gemini")


async def _async_token() -> str:
    return TOKEN


def _sync_token() -> str:
    return TOKEN


def client(name: str, url: str) -> aio.ModelClient:
    """Our client for the row ``name`` at the loopback server's root ``url``; ``openai``
    and ``gemini``: bench_wire.py's client of that public wire."""
    if name in ("openai", "gemini"):
        return wire_client(name, url)
    if name.startswith("vertex"):
        auth: dict[str, Any] = {"token": TOKEN}
        if "credentials" in name:
            from google.oauth2.credentials import Credentials

            auth = {"credentials": Credentials(TOKEN)}
        return aio.client("vertex:bench", project=PROJECT, location=LOCATION, base_url=url,
                          **auth)
    auth = {"api_key": AZURE_KEY}
    if "sync provider" in name:
        auth = {"azure_ad_token_provider": _sync_token}
    elif "provider" in name:
        auth = {"azure_ad_token_provider": _async_token}
    return aio.client(f"{name.split()[0]}:bench", base_url=url + "/openai/v1", **auth)


def ours(name: str, url: str, rounds: int) -> Run:
    return wire_ours(name, url, rounds, client)


def bare_twin(name: str, url: str, rounds: int) -> Run:
    """bench_wire.py's bare client of the wire behind the door, with its credential."""
    if name.startswith("vertex"):
        return bare("gemini", url, rounds, {"Authorization": f"Bearer {TOKEN}"},
                    url + VERTEX_PATH)
    wire = "openai-responses" if name.startswith("azure-responses") else "openai"
    return bare(wire, url + "/openai", rounds, {"api-key": AZURE_KEY})


async def rounds_table(url: str, repeats: int, rounds: int) -> None:
    runs: dict[str, Run] = {}
    for name in ROWS:
        runs[f"bare {name}"] = bare_twin(name, url, rounds)
        runs[name] = ours(name, url, rounds)
    medians = await interleaved(runs, repeats)
    per = {name: (w * 1000 / rounds, c * 1000 / rounds) for name, (w, c) in medians.items()}
    print(f"\nWhole tool rounds, {rounds} rounds, median of {repeats} interleaved runs, "
          "µs/round: ours, bare, ratio; wall, then client CPU")
    for name in ROWS:
        (wall, cpu), (bare_wall, bare_cpu) = per[name], per[f"bare {name}"]
        print(f"{name:<22} wall {wall:>7.0f} {bare_wall:>7.0f} {wall / bare_wall:>5.2f}x   "
              f"CPU {cpu:>7.0f} {bare_cpu:>7.0f} {cpu / bare_cpu:>5.2f}x")


def play(name: str, url: str, runs: int, rounds: int) -> None:
    """``--instructions`` (``bare azure`` or ``azure:``...): ``runs`` runs."""
    row = name.removeprefix("bare ").rstrip(":")
    run = bare_twin(row, url, rounds) if name.startswith("bare ") else ours(row, url, rounds)

    async def main() -> None:
        for _ in range(runs):
            await run()

    asyncio.run(main())


async def main(options: argparse.Namespace) -> None:
    with server_process() as url:
        if options.quick:
            await rounds_table(url, 1, 5)
            await cancel_to_closed(3, CANCELLED, client)
            return
        await rounds_table(url, options.repeats, options.rounds)
        if options.callgrind:
            instructions(url, options.rounds, ("azure", "azure-responses", "vertex"), __file__)
        await cancel_to_closed(options.repeats * 7, CANCELLED, client)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--callgrind", action="store_true", help="also count instructions")
    parser.add_argument("--instructions", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=1, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.instructions:
        play(options.instructions, options.url, options.runs, options.rounds)
    else:
        print(f"python {sys.version.split()[0]}, httpx {httpx.__version__}")
        asyncio.run(main(options))
