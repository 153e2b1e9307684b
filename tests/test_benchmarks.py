"""The benchmark scripts still run and print their tables (a smoke run at the smallest
sizes: it proves the script works, its figures mean nothing; no timing is asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import services

ROOT = Path(__file__).resolve().parents[1]

SMOKE = {
    "bench_agent.py": ["--repeats", "1"],
    "bench_agent_compare.py": [str(ROOT), "--pairs", "1"],  # this checkout against itself
    "bench_run_handle.py": ["--quick"],
    "bench_store.py": ["--rounds", "20", "--repeats", "1", "--appends", "20", "--load", "200"],
    "bench_client.py": ["--repeats", "5"],
    "bench_tools.py": ["--repeats", "1", "--calls", "100"],
    "bench_wire.py": ["--quick"],
    "bench_clouds.py": ["--quick"],
    "bench_bedrock.py": ["--quick"],
    "bench_serve.py": ["--quick"],
    "bench_protocols.py": ["--repeats", "1"],
    "bench_protocol_stream.py": ["--quick"],
    "bench_control.py": ["--quick", "--workers", "2"],
    "bench_journal.py": ["--rounds", "10", "--repeats", "1"],
    "bench_output.py": ["--repeats", "1", "--count", "20"],
    "bench_limits.py": ["--repeats", "1", "--count", "100", "--runs", "2"],
    "bench_continue.py": ["--repeats", "1", "--words", "10", "--delay", "0"],
    "bench_cancel_burst.py": ["--quick"],
    "bench_broken_stream.py": ["--repeats", "1", "--tokens", "20", "--prompt", "5",
                               "--delay", "0"],
    "bench_temporal.py": ["--quick"],
    "bench_temporal_stream.py": ["--quick"],
    "bench_temporal_throughput.py": ["--quick"],
    "bench_mcp.py": ["--quick"],
    "bench_scale.py": ["--n", "1,20", "--contenders", "aimu,floor", "--repeats", "1"],
    "bench_serve_scale.py": ["--quick", "--scenarios", "local,rest-sqlite"],
    # The peers need a venv of their own: aimu, its fleet of two on Redis, the floor.
    "bench_served.py": ["--servers", "aimu,aimu-fleet,floor", "--n", "1", "--stops", "1"],
    "bench_tree.py": ["--quick"],
    "bench_guardrails.py": ["--repeats", "1", "--runs", "20"],
}
#: Benchmarks whose small run is a test of its own (it checks what the benchmark checks).
RUN_BY_A_TEST = {"bench_soak.py": "tests/serve/test_soak.py"}


def test_every_benchmark_has_a_smoke_run() -> None:
    assert sorted([*SMOKE, *RUN_BY_A_TEST]) == sorted(
        p.name for p in (ROOT / "benchmarks").glob("bench_*.py")
    )


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_runs(script: str) -> None:
    options = SMOKE[script]
    if script in ("bench_control.py", "bench_temporal.py", "bench_temporal_stream.py",
                  "bench_served.py"):
        options = [*options, "--redis", services.redis_url()]  # found (or skipped) as in tests
    if script in ("bench_temporal.py", "bench_temporal_stream.py",
                  "bench_temporal_throughput.py"):
        options = [*options, "--temporal", services.temporal_address()]
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *options],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = [line for line in completed.stdout.splitlines() if line.strip()]
    assert len(lines) >= 2, f"the benchmark printed no table: {completed.stdout!r}"
    assert any(re.search(r"\d", line) for line in lines[1:]), "no figures"
    assert not re.search(r"\b(nan|inf)\b", completed.stdout), completed.stdout
