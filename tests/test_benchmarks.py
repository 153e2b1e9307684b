"""The benchmark scripts still run (a smoke run with few samples; no timing is asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SMOKE = {
    "bench_agent.py": ["--repeats", "1"],
    "bench_run_handle.py": ["--quick"],
    "bench_store.py": ["--rounds", "20", "--repeats", "1"],
    "bench_client.py": ["--repeats", "5"],
    "bench_tools.py": ["--repeats", "1", "--calls", "100"],
    "bench_wire.py": ["--quick"],
    "bench_serve.py": ["--quick"],
    "bench_control.py": ["--quick"],
    "bench_journal.py": ["--rounds", "10", "--repeats", "1"],
}


def test_every_benchmark_has_a_smoke_run() -> None:
    assert sorted(SMOKE) == sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py"))


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_runs(script: str) -> None:
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *SMOKE[script]],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip(), "the benchmark printed no figures"
