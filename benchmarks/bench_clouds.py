"""The clouds' doors: ``azure:``, ``azure-responses:`` and ``vertex:`` whole tool rounds
against bare httpx on the same wire and door, and how soon the server sees a cancelled
stream closed.

    python benchmarks/bench_clouds.py              # 50 rounds, 15 repeats; 105 cancels
    python benchmarks/bench_clouds.py --callgrind  # + instructions per round (valgrind)
    python benchmarks/bench_clouds.py --quick      # a smoke run (CI)
    python benchmarks/bench_clouds.py --fin        # what a cancel runs before its FIN

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

``--fin``: on every wire, what the client runs from a cancel until its FIN leaves, two
ways: the turn closed between two chunks (``aclose``, what cancel to closed measures) and
the task reading it cancelled while it waits for bytes (``task``, a Stop). Per way: the
Python calls until the socket is shut or closed (counted once, deterministic), the
client thread's CPU until then, and the ms until the server, a process of its own on the
same clock, sees the connection go (medians over ``--repeats`` x 7 tries, the wires
interleaved).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import statistics
import sys
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, cast

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
#: --fin's rows: every wire and door.
EVERY = ("openai", "azure", "openai-responses", "azure-responses", "gemini", "vertex",
         "anthropic", "bedrock", "ollama")


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


def any_client(name: str, url: str) -> aio.ModelClient:
    """A client of any row of :data:`EVERY`."""
    if name == "bedrock":
        from bench_bedrock import client as bedrock_client

        return bedrock_client(url)
    if name in ("anthropic", "ollama", "openai-responses"):
        return wire_client(name, url)
    return client(name, url)


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


class _Fin:
    """When the first TCP socket was shut or closed (thread CPU ns), and the Python calls
    made before it while counting."""

    def __init__(self) -> None:
        self.at: int | None = None
        self.calls = 0
        close, shutdown = socket.socket.close, socket.socket.shutdown

        def seen(method: Callable[..., Any]) -> Callable[..., Any]:
            def call(sock: socket.socket, *args: Any) -> Any:
                if self.at is None and sock.type == socket.SOCK_STREAM:
                    self.at = time.thread_time_ns()
                return method(sock, *args)

            return call

        socket.socket.close = seen(close)  # type: ignore[method-assign]
        socket.socket.shutdown = seen(shutdown)  # type: ignore[method-assign]

    def profile(self, frame: object, event: str, arg: object) -> None:
        if event == "call" and self.at is None:
            self.calls += 1


async def _cancel_once(
    model: aio.ModelClient, way: str, fin: _Fin, lines: asyncio.StreamReader, count: bool
) -> tuple[int, float, float]:
    """One streamed turn cancelled after its first chunk ``way``: the calls made until the
    FIN (if ``count``), the thread's CPU µs until then and the ms until the server saw it."""
    turn = cast(AsyncGenerator[Any, None], model.stream_turn([{"role": "user", "content": "go"}]))
    await anext(turn)
    reading = asyncio.ensure_future(anext(turn)) if way == "task" else None
    await asyncio.sleep(0)  # the task waits in its read: the server holds the next chunk
    fin.at, fin.calls = None, 0
    if count:
        sys.setprofile(fin.profile)
    closing, cpu = time.monotonic(), time.thread_time_ns()
    if reading is None:
        await turn.aclose()
    else:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading
    while fin.at is None:  # noqa: ASYNC110 - a few passes at most: the close is under way
        await asyncio.sleep(0)
    sys.setprofile(None)
    await turn.aclose()
    while True:
        kind, _, when = (await lines.readline()).decode().partition(" ")
        if kind == "closed":
            return fin.calls, (fin.at - cpu) / 1000, (float(when) - closing) * 1000


def serve_held() -> None:
    """``--serve-held``: a loopback server whose replies send their first chunk and then
    hold (a model thinking), printing when it saw each stream closed, on its clock
    (``time.monotonic()``, one system-wide clock on Linux): ``closed T`` lines."""
    from aimu.testing.script import Turn
    from aimu.testing.server import LoopbackServer

    async def main() -> None:
        async with LoopbackServer(
            lambda request: Turn(text="one two three", fault="hang", fault_after=1)
        ) as server:
            print(server.url, flush=True)
            closed = 0
            while True:
                await server.wait_until(
                    lambda c=closed: sum(s.abandoned for s in server.streams) > c,  # type: ignore[misc]
                    timeout=3600,
                )
                for record in [s for s in server.streams if s.abandoned][closed:]:
                    print(f"closed {record.abandoned_at}", flush=True)
                    closed += 1

    asyncio.run(main())


async def fin_costs(repeats: int) -> None:
    """``--fin``: see the module's docstring."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--serve-held", stdout=asyncio.subprocess.PIPE
    )
    assert process.stdout is not None
    lines = process.stdout
    url = (await lines.readline()).decode().strip()
    fin = _Fin()
    models = {name: any_client(name, url) for name in EVERY}
    taken: dict[tuple[str, str], list[tuple[int, float, float]]] = {
        (name, way): [] for name in EVERY for way in ("aclose", "task")}
    try:
        for attempt in range(repeats + 1):  # the first opens each pool: left out
            for (name, way), samples in taken.items():
                sample = await _cancel_once(models[name], way, fin, lines, attempt == 1)
                if attempt:
                    samples.append(sample)
    finally:
        for model in models.values():
            await model.aclose()
        process.terminate()
        await process.wait()
    print(f"\nFrom a cancel to its FIN, {repeats} tries each, interleaved (server: a process "
          "of its own): Python calls, client thread CPU µs (median), ms until the server saw "
          "the connection go (median, p90)")
    for (name, way), samples in taken.items():
        seen = sorted(sample[2] for sample in samples)
        p90 = seen[min(len(seen) - 1, int(len(seen) * 0.9))]
        print(f"{name + ':':<18} {way:<7} {samples[0][0]:>5} calls "
              f"{statistics.median(sample[1] for sample in samples):>7.1f} µs "
              f"{statistics.median(seen):>6.2f} ms ({p90:.2f})")


def cancel_runs(row: str, url: str, runs: int) -> None:
    """``--cancels WIRE:WAY --url URL --runs N`` (under callgrind, against ``--serve-held``):
    ``runs`` turns of WIRE, each cancelled after its first chunk WAY (``aclose``, ``task``)."""
    wire, _, way = row.partition(":")

    async def main() -> None:
        model = any_client(wire, url)
        for _ in range(runs):
            turn = cast(AsyncGenerator[Any, None],
                        model.stream_turn([{"role": "user", "content": "go"}]))
            await anext(turn)
            if way == "task":
                reading = asyncio.ensure_future(anext(turn))
                await asyncio.sleep(0)
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reading
            await turn.aclose()
        await model.aclose()

    asyncio.run(main())


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
    parser.add_argument("--fin", action="store_true", help="what a cancel runs before its FIN")
    parser.add_argument("--serve-held", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cancels", help=argparse.SUPPRESS)
    parser.add_argument("--instructions", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=1, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.instructions:
        play(options.instructions, options.url, options.runs, options.rounds)
    elif options.cancels:
        cancel_runs(options.cancels, options.url, options.runs)
    elif options.serve_held:
        serve_held()
    elif options.fin:
        print(f"python {sys.version.split()[0]}, httpx {httpx.__version__}")
        asyncio.run(fin_costs(options.repeats * 7))
    else:
        print(f"python {sys.version.split()[0]}, httpx {httpx.__version__}")
        asyncio.run(main(options))
