"""A missing optional dependency says the exact command that installs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from aimu._extras import (
    DISTRIBUTION,
    EXTRAS,
    MissingExtra,
    has_extra,
    install_command,
    missing_extra,
    needs_extra,
)

ROOT = Path(__file__).resolve().parents[1]


def test_every_extra_of_pyproject_is_known_and_no_other() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"]) - {"test"}
    assert extras == set(EXTRAS)


def test_a_missing_module_of_the_extra_becomes_the_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` now fails
    with pytest.raises(MissingExtra) as caught, needs_extra("aimu serve", "serve"):
        import uvicorn  # noqa: F401
    assert str(caught.value) == (
        f"aimu serve needs the serve extra (uvicorn is not installed): {install_command('serve')}"
    )
    assert caught.value.name == "uvicorn"
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_a_missing_submodule_counts_as_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prompt_toolkit.history", None)
    wanted = re.escape(install_command("chat")) + "$"
    with pytest.raises(MissingExtra, match=wanted), needs_extra("line editing", "chat"):
        from prompt_toolkit.history import FileHistory  # noqa: F401


def test_another_import_error_passes_through_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "some_unrelated_module", None)
    with pytest.raises(ModuleNotFoundError) as caught, needs_extra("aimu serve", "serve"):
        import some_unrelated_module  # type: ignore[import-not-found]  # noqa: F401
    assert not isinstance(caught.value, MissingExtra)


def test_has_extra_looks_without_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert has_extra("chat")  # the test install has every extra
    monkeypatch.setitem(sys.modules, "prompt_toolkit", None)
    assert not has_extra("chat")


def test_an_unknown_extra_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="no extra 'web'; the extras are chat, mcp, otel"):
        install_command("web")


def test_without_an_import_error_the_missing_module_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert str(missing_extra("aimu serve", "serve")) == (
        f"aimu serve needs the serve extra (uvicorn is not installed): {install_command('serve')}"
    )


def _install_hint(cwd: Path, path: Path) -> str:
    code = "from aimu._extras import install_command; print(install_command('serve'))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60,
        check=True, env={**os.environ, "PYTHONPATH": str(path)},
    )
    return done.stdout.strip()


def test_the_hint_names_the_distribution_or_the_checkout_aimu_runs_from(tmp_path: Path) -> None:
    """``aimu`` on PyPI is another project: an installed copy is told the distribution's
    name, a checkout (editable, or on the path) to install from itself."""
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"] == (
        DISTRIBUTION
    )
    assert DISTRIBUTION == "aimu-agents"
    installed = tmp_path / "site-packages"
    installed.mkdir()
    (installed / "aimu").symlink_to(ROOT / "aimu")  # a copy with no checkout around it
    assert _install_hint(tmp_path, installed) == "pip install 'aimu-agents[serve]'"
    assert _install_hint(ROOT, ROOT) == "pip install -e '.[serve]'"
    assert _install_hint(tmp_path, ROOT) == f"pip install -e '{ROOT}[serve]'"


def test_no_page_or_hint_names_the_other_projects_distribution() -> None:
    """``pip install 'aimu[...]'`` or ``pip install aimu`` would install someone else's code."""
    wrong = re.compile(r"pip install (-\w+ )*'?aimu(\[|'|\s|$)|`aimu\[")
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md"),
             *(ROOT / "aimu").rglob("*.py"), *(ROOT / "examples").rglob("*.md")]
    found = [f"{page.relative_to(ROOT)}: {line.strip()}" for page in pages
             for line in page.read_text().splitlines() if wrong.search(line)]
    assert found == []


# Every extra's top-level modules, made unimportable in a child process: what a plain
# `pip install aimu-agents` has. (pydantic stays: the core's ollama package needs it.)
_NO_EXTRAS = """
import sys
for name in ("temporalio", "mcp", "fastapi", "fastapi_offline", "starlette", "uvicorn",
             "redis", "asyncpg", "prompt_toolkit", "opentelemetry"):
    sys.modules[name] = None  # `import name` now raises ImportError
from aimu.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _aimu_without_extras(
    *args: str, home: Path, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _NO_EXTRAS, *args], input=stdin, capture_output=True,
        text=True, timeout=120, check=False, env={**os.environ, "AIMU_HOME": str(home)},
    )


def test_aimu_chat_and_help_need_no_extra(tmp_path: Path) -> None:
    """The README's first command: a plain install answers on the embedded model (building
    the command line once imported aimu.temporal, which needs temporalio)."""
    chat = _aimu_without_extras("chat", "--model", "test", stdin="hello\n", home=tmp_path)
    assert chat.returncode == 0, chat.stderr
    assert "I called" in chat.stdout
    assert "Traceback" not in chat.stderr
    assert (tmp_path / "sessions.db").exists()  # the test's home, not the user's
    bare = _aimu_without_extras(home=tmp_path)
    assert bare.returncode == 0 and "worker" in bare.stdout, bare.stderr


@pytest.mark.parametrize(
    ("args", "extra"),
    [
        (("worker", "--temporal", "127.0.0.1:1", "--task-queue", "q"), "temporal"),
        (("serve",), "serve"),
        (("chat", "--mcp", "some-server"), "mcp"),
    ],
)
def test_a_command_whose_extra_is_missing_says_how_to_install_it(
    args: tuple[str, ...], extra: str, tmp_path: Path
) -> None:
    done = _aimu_without_extras(*args, home=tmp_path)
    assert done.returncode != 0
    assert install_command(extra) in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("serve", "--recover-every", "2"), "--recover-every goes with --recover"),
        (("serve", "--temporal", "127.0.0.1:1"), "give --temporal HOST:PORT and --task-queue"),
        (("serve", "--port", "70000"), "--port 70000 is not a TCP port"),
    ],
)
def test_a_usage_error_is_told_before_a_missing_extra(
    args: tuple[str, ...], said: str, tmp_path: Path
) -> None:
    """Options that do not go together are refused for what they are, without importing
    the serve extra first (its absence would hide the mistake behind an install hint)."""
    done = _aimu_without_extras(*args, home=tmp_path)
    assert done.returncode == 2
    assert said in done.stderr and "pip install" not in done.stderr
    assert "Traceback" not in done.stderr
