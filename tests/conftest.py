"""Fixtures shared by the whole suite: the real services some tests need."""

from __future__ import annotations

import compileall
import gc
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import services

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl+C reaches the programs the tests start. A shell runs a background job (``.ci/run
    &``, nohup) with SIGINT ignored, every child inherits that, and Python then never turns
    SIGINT into KeyboardInterrupt: the tests that press Ctrl+C in ``aimu pull`` or an MCP
    client waited 60 s for a child that ignored it. A handler, unlike SIG_IGN, is not
    inherited across exec, so the children start with the default again."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not hasattr(config, "workerinput"):  # once, before any xdist worker starts
        compile_the_sources()


def compile_the_sources() -> None:
    """Bytecode for aimu and the tests' own modules, written once up front. The tests start
    hundreds of Python processes (``aimu serve``, the docs' blocks, MCP servers, workers);
    with ``PYTHONDONTWRITEBYTECODE=1`` (set in many containers, and inherited) each of them
    compiled every aimu module it imported from source again: about 0.35 s of CPU per
    ``aimu serve`` start. A ``.pyc`` is still checked against its source's mtime, so an edit
    is never hidden; reading one is allowed whatever that variable says."""
    for part in ("aimu", "tests", "benchmarks", "examples"):
        if (ROOT / part).is_dir():
            compileall.compile_dir(ROOT / part, quiet=2)


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[object]:
    """Collection imports the world (FastAPI, Temporal, Hypothesis, schemathesis: about
    600,000 objects that live as long as the process), so the collector's automatic full
    passes while it grows were wasted: about a third of a worker's collection CPU. After
    it, all of that goes to the permanent generation: a full collection no longer walks it
    (each ``gc.collect()`` took ~0.35 s of CPU in a worker, five of them in each provider
    test's leak check, and the automatic passes as much). What the tests create is
    collected as before."""
    gc.disable()
    try:
        return (yield)
    finally:
        gc.enable()
        gc.collect()
        gc.freeze()


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
