"""``--max-requests`` and kin on ``aimu chat`` and ``aimu serve``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aimu import aio, cli
from aimu._limit_options import add_limit_options, limits_from
from aimu.serve.agents import agent_factory

ROOT = Path(__file__).resolve().parents[1]


def test_the_options_give_limits_and_none_without_them() -> None:
    parser = cli.build_parser()
    options = parser.parse_args(["chat", "--max-requests", "3", "--max-tokens", "900",
                                 "--max-tool-calls", "0", "--max-seconds", "1.5"])
    assert limits_from(options) == aio.UsageLimits(requests=3, total_tokens=900,
                                                   tool_calls=0, wall=1.5)
    assert limits_from(parser.parse_args(["serve"])) is None


def test_max_seconds_help_says_it_cuts_at_once() -> None:
    """The wall limit cuts a streaming reply or a running tool call: not "between steps"."""
    parser = argparse.ArgumentParser()
    add_limit_options(parser)
    shown = " ".join(parser.format_help().split())
    assert "between steps" not in shown
    assert "reached mid-reply or mid-tool" in shown and "it stops the run at once" in shown


@pytest.mark.parametrize("bad", [["--max-requests", "-1"], ["--max-seconds", "nan"],
                                 ["--max-tokens", "many"], ["--max-requests", "1" + "0" * 400],
                                 ["--max-tool-calls", str(2**63)],
                                 ["--max-seconds", "1" + "0" * 400],
                                 ["--max-requests", "\u0663"], ["--max-tokens", "\u00b2"],
                                 ["--max-requests", " 3"]])
def test_bad_limits_are_usage_errors(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("chat", "serve"):
        assert cli.main([command, *bad]) == 2
        errors = capsys.readouterr().err
        assert "Traceback" not in errors
        (line,) = [line for line in errors.splitlines() if "error:" in line]
        assert bad[0] in line and len(line) < 200


async def test_serve_builds_its_agents_with_the_limits(tmp_path: Path) -> None:
    store = aio.SQLiteStore(tmp_path / "s.db")
    limits = aio.UsageLimits(requests=2)
    agents, close = agent_factory("test", store, limits=limits)
    assert agents("s1").limits == limits
    await close()
    await store.aclose()


def test_a_chat_turn_that_reaches_a_limit_says_so(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "aimu", "chat", "--max-requests", "1"],
        input="What is the weather in Oslo?\n", capture_output=True, text=True, cwd=ROOT,
        env={**os.environ, "AIMU_HOME": str(tmp_path), "AIMU_MODEL": "test"}, timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    assert "(stopped: limit:requests; /resume goes on)" in completed.stdout
