"""The soak, small (issue 34 item 6): two ``aimu serve --recover`` replicas on PostgreSQL,
a ``kill -9`` of a random one every few seconds and a restart, then SIGTERM of both.
``benchmarks/bench_soak.py`` checks, from the store and its table of side effects, that
every run completed, none was resumed twice, no side effect happened twice, every record
is right and the budgets held, and exits 1 naming what failed (the full 200-run version
and its figures: docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import services
from tests.serve.harness import ROOT

pytestmark = pytest.mark.slow


def test_replicas_killed_again_and_again_lose_no_run_and_repeat_no_effect() -> None:
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_soak.py"),
         "--postgres", services.postgres_dsn(), "--runs", "20", "--concurrency", "20",
         "--kill-every", "3", "--tool-seconds", "1", "--timeout", "120",
         "--recover-every", "0.5"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    report = completed.stdout + completed.stderr[-4000:]
    assert completed.returncode == 0, report
    table = completed.stdout.splitlines()
    assert table[1].split()[:3] == ["kills", "resumed", "reruns"], report
    kills = int(table[2].split()[0])
    assert kills >= 1, report  # the soak killed something: not a quiet run
