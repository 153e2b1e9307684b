"""The service finder: skips become failures when CI requires the services."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import services

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


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
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", ".",
         "-c", str(PYPROJECT), path],  # the project's settings, as the README's command has
        capture_output=True, text=True, env=env, check=False,
    )
    return done.stdout


def test_a_missing_service_skips_with_its_reason(tmp_path: object) -> None:
    out = _outcome(tmp_path, "0")
    assert "1 skipped" in out
    assert "no such service here" in out  # said in the summary, not only counted


def test_missing_npm_clients_skip_with_the_command_that_installs_them(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIMU_NPM_CLIENTS", str(tmp_path))
    monkeypatch.delenv("AIMU_REQUIRE_SERVICES", raising=False)
    monkeypatch.setattr(services.shutil, "which", lambda name: f"/usr/bin/{name}")
    with pytest.raises(pytest.skip.Exception) as skipped:
        services.npm_clients()
    every = " ".join(f"{name}@{version}" for name, version in services.NPM_CLIENTS.items())
    assert f"npm install --prefix {tmp_path} {every}" in str(skipped.value)


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


def test_what_tests_make_on_a_shared_server_is_named_aimu_test() -> None:
    """Every Redis key prefix, PostgreSQL schema and database a test names on the shared
    servers starts with ``aimu_test_``: a name no user's data would have (the README says
    so). Read from the tests' sources: the literal each one builds."""
    import re

    named = re.compile(
        r"""(?:\bprefix\s*=\s*|"redis_prefix":\s*|redis_prefix=|"--redis-prefix",\s*|"""
        r"""RedisControl\([^,()]*(?:\([^()]*\))?,\s*|\bschema\s*=\s*|\bdatabase\s*=\s*)"""
        r"""f?"([^"{]*)(?:\{|")"""
    )
    tests = Path(__file__).resolve().parent
    wrong = []
    for path in sorted(tests.rglob("*.py")):
        source = path.read_text()
        if "redis" not in source.lower() and "postgres" not in source.lower():
            continue
        for match in named.finditer(source):
            literal = match.group(1)
            line = source.count("\n", 0, match.start()) + 1
            context = source[max(0, match.start() - 200):match.end()]
            shared = ("redis" in context.lower() or "schema" in match.group(0)
                      or "database" in match.group(0)) and "mkdtemp(" not in context[-80:]
            if shared and literal and not literal.startswith("aimu_test_"):
                wrong.append(f"{path.relative_to(tests)}:{line}: {match.group(0)}")
    assert wrong == [], "\n".join(wrong)
    assert not services.LOCAL_POSTGRES.endswith("/test")  # a database users name theirs
