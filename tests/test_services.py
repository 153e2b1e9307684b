"""The service finder: skips become failures when CI requires the services."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

from tests import services


def _outcome(tmp_path: object, require: str) -> str:
    script = textwrap.dedent(
        """
        from tests import services
        def test_missing():
            services.unavailable("no such service here")
        """
    )
    path = f"{tmp_path}/test_missing_service.py"
    with open(path, "w") as file:
        file.write(script)
    env = {"AIMU_REQUIRE_SERVICES": require, "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", ".", path],
        capture_output=True, text=True, env=env, check=False,
    )
    return done.stdout


def test_a_missing_service_skips_with_its_reason(tmp_path: object) -> None:
    out = _outcome(tmp_path, "0")
    assert "1 skipped" in out


def test_a_missing_service_fails_when_ci_requires_it(tmp_path: object) -> None:
    out = _outcome(tmp_path, "1")
    assert "1 failed" in out
    assert "no such service here" in out


def test_nothing_answers_on_a_free_port() -> None:
    port = services.free_port()
    assert not services._redis_answers(f"redis://127.0.0.1:{port}/0")
    assert not services._postgres_answers(f"postgresql://x@127.0.0.1:{port}/db")


def test_local_services_answer(redis_url: str, postgres_dsn: str) -> None:
    assert services._redis_answers(redis_url)
    assert services._postgres_answers(postgres_dsn)


def test_a_private_redis_stops_and_starts_on_the_same_port(
    private_redis: services.PrivateRedis,
) -> None:
    assert services._redis_answers(private_redis.url)
    private_redis.stop()
    assert not services._redis_answers(private_redis.url)
    private_redis.start()
    assert services._redis_answers(private_redis.url)
    with socket.create_connection(("127.0.0.1", private_redis.port), timeout=2):
        pass


@pytest.mark.parametrize("name", ["redis_url", "postgres_dsn"])
def test_the_env_variable_wins(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    variable = {"redis_url": "AIMU_TEST_REDIS_URL", "postgres_dsn": "AIMU_TEST_POSTGRES_DSN"}
    monkeypatch.setenv(variable[name], "scheme://given")
    assert getattr(services, name)() == "scheme://given"
