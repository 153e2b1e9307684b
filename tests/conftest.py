"""Fixtures shared by the whole suite: the real services some tests need."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests import services


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl+C reaches the programs the tests start. A shell runs a background job (``.ci/run
    &``, nohup) with SIGINT ignored, every child inherits that, and Python then never turns
    SIGINT into KeyboardInterrupt: the tests that press Ctrl+C in ``aimu pull`` or an MCP
    client waited 60 s for a child that ignored it. A handler, unlike SIG_IGN, is not
    inherited across exec, so the children start with the default again."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The ``slow`` tests first (stable otherwise): with ``-n 2`` the long ones start at
    once on both workers and the short ones fill in, instead of one long test finishing
    alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def redis_url() -> str:
    """A Redis URL that answers (skips, or fails under AIMU_REQUIRE_SERVICES=1, if none)."""
    return services.redis_url()


@pytest.fixture(scope="session")
def postgres_dsn() -> str:
    """A PostgreSQL DSN that answers (skips, or fails under AIMU_REQUIRE_SERVICES=1)."""
    return services.postgres_dsn()


@pytest.fixture
def private_redis() -> Iterator[services.PrivateRedis]:
    """A redis-server this test owns and may stop and start again."""
    server = services.PrivateRedis()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def chromium_path() -> str:
    """Debian's Chromium, for the browser tests."""
    return services.chromium_path()
