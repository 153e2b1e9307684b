"""What mypy infers for users' code: ``tests/typing/*.py`` must pass ``mypy --strict``."""

from __future__ import annotations

from pathlib import Path

import pytest
from mypy import api

TYPING = Path(__file__).parent / "typing"


@pytest.mark.slow  # runs mypy: up to 25 s on a busy host
def test_run_returns_the_output_type_for_mypy() -> None:
    out, err, status = api.run(["--strict", str(TYPING / "output_types.py")])
    assert status == 0, out + err


@pytest.mark.slow  # runs mypy
def test_deps_and_instructions_are_typed_for_mypy() -> None:
    out, err, status = api.run(["--strict", "--warn-unused-ignores", str(TYPING / "deps.py")])
    assert status == 0, out + err
