"""The agent loop's overhead a round, two checkouts side by side (issue 43's goal).

    python benchmarks/bench_agent_compare.py BASE_CHECKOUT [--pairs 9]

Runs this checkout's ``benchmarks/bench_agent.py`` (``--repeats 3``) once on each checkout
(its ``PYTHONPATH``) per pair, alternating which goes first from pair to pair (on a shared
host the second of two back-to-back runs was seen faster by up to 30 %, whichever it
was), and prints the medians over all pairs of the agent's µs a round, its overhead over
the bare loop, and its round over the bare loop's in the same process (the figure a
drifting host speed moves least), at 200 and 1,000 rounds, with this checkout / base.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\s+(200|1000)\s+([\d.]+)\s+[\d.]+\s+([\d.]+)\s+([\d.]+)", re.M)


def one(checkout: Path, repeats: int) -> dict[tuple[str, str], float]:
    """(rounds, measure) -> µs a round (``agent``, ``overhead``) or the agent's round over
    the bare loop's in the same process (``/ bare``), from one bench_agent run."""
    done = subprocess.run(
        [sys.executable, str(HERE / "benchmarks" / "bench_agent.py"), "--repeats", str(repeats)],
        capture_output=True, text=True, check=True, env={"PYTHONPATH": str(checkout)},
        cwd=checkout,
    )
    found = {}
    for rounds, bare, agent, overhead in ROW.findall(done.stdout):
        found[(rounds, "agent")] = float(agent)
        found[(rounds, "overhead")] = float(overhead)
        # The same process's bare loop: a host whose speed drifts between runs (seen:
        # the bare loop, the same code on both checkouts, at 36-78 µs a round) drifts both.
        found[(rounds, "/ bare")] = float(agent) / float(bare)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base", type=Path, help="the other checkout (e.g. a git worktree)")
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=3, help="bench_agent.py's (default 3)")
    options = parser.parse_args()
    runs: dict[str, list[dict[tuple[str, str], float]]] = {"base": [], "this": []}
    for pair in range(options.pairs):
        order = [("base", options.base), ("this", HERE)]
        for name, checkout in order if pair % 2 == 0 else reversed(order):
            runs[name].append(one(checkout.resolve(), options.repeats))
    print(f"medians of {options.pairs} interleaved pairs (the first of a pair alternating)")
    print(" rounds  measure   base µs  this µs  this / base")
    for rounds in ("200", "1000"):
        for measure in ("agent", "overhead", "/ bare"):
            base = statistics.median(r[(rounds, measure)] for r in runs["base"])
            this = statistics.median(r[(rounds, measure)] for r in runs["this"])
            print(f" {rounds:>6}  {measure:<8} {base:8.2f} {this:8.2f}  {this / base:10.3f}")


if __name__ == "__main__":
    main()
