"""Fixtures of the crossing matrix: the strict provider every case's transcripts go to."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from aimu.testing.server import LoopbackServer
from tests.crossings.invariants import strict_script


@pytest.fixture(scope="module")
def strict() -> Iterator[str]:
    """The strict provider's base URL (one loopback server for a module's cells)."""
    with LoopbackServer.in_thread(strict_script) as server:
        server.keep_records = False
        yield server.url
