"""Fixtures of the serve tests (see harness.py), and each test's outcome for screenshots."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from tests.serve.harness import http, model_server, served

__all__ = ["http", "model_server", "served"]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[
    None, Any, Any
]:
    """Keep the call phase's report on the item: the browser tests screenshot on failure."""
    report = yield
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
    return report
