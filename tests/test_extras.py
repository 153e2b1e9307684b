"""A missing optional dependency says the exact command that installs it."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from aimu._extras import (
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
        "aimu serve needs the serve extra (uvicorn is not installed): pip install 'aimu[serve]'"
    )
    assert caught.value.name == "uvicorn"
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_a_missing_submodule_counts_as_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prompt_toolkit.history", None)
    wanted = r"pip install 'aimu\[chat\]'$"
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
        "aimu serve needs the serve extra (uvicorn is not installed): pip install 'aimu[serve]'"
    )
