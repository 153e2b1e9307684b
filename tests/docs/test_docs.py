"""Every code block in docs/ and README.md runs, so the docs never drift from the code.

Each page runs in its own process with a loopback model server (the embedded test
model's behaviour) behind ``OLLAMA_HOST`` and ``OPENAI_BASE_URL``, so examples written
for ``ollama:`` or ``openai:`` models run as written.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aimu.testing.server import LoopbackServer
from aimu.testing.server.bedrock import CREDENTIALS as BEDROCK_CREDENTIALS
from aimu.testing.server.bedrock import REGION as BEDROCK_REGION
from aimu.testing.server.bedrock import TEST_KEY_ID as BEDROCK_KEY_ID
from aimu.testing.server.clouds import AZURE_KEY, service_account_info
from tests import services
from tests.docs.runner import blocks, fenced

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md"))


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer.in_thread() as running:
        yield running


def test_there_are_pages_with_code() -> None:
    assert PAGES, "docs/ has no pages"
    assert sum(len(blocks(page)) for page in PAGES) >= 5


def test_the_index_links_every_page_once() -> None:
    """A page the index does not link is a page nobody finds; one linked twice is noise."""
    index = ROOT / "docs" / "index.md"
    targets = re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", index.read_text())
    linked = [(index.parent / target).resolve() for target in targets]
    assert sorted(set(linked)) == [p for p in PAGES if p != index]
    assert len(linked) == len(set(linked)), "a page is listed twice"


def test_each_how_to_says_at_the_top_how_to_run_it_offline() -> None:
    for page in sorted((ROOT / "docs" / "how-to").glob("*.md")):
        text = page.read_text()
        first_code = text.find("```") if "```" in text else len(text)
        assert 0 <= text.find("**Offline:**") < first_code, f"{page.name} does not say it"


def test_research_py_fails_with_the_error_without_a_model_server(tmp_path: Path) -> None:
    """interrupt-a-run's research.py hung without Ollama: the run task died with
    ModelConnectionError and the example waited for its tool forever."""
    page = ROOT / "docs" / "how-to" / "interrupt-a-run.md"
    (code,) = [code for _, code, _, name in fenced(page) if name == "research.py"]
    (tmp_path / "research.py").write_text(code)
    done = subprocess.run(
        [sys.executable, "research.py"], cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "OLLAMA_HOST": f"http://127.0.0.1:{services.free_port()}"},
        timeout=120,  # a safety net: it used to hang here
    )
    assert done.returncode == 1
    assert "ModelConnectionError" in done.stderr, done.stderr


def test_only_benchmark_commands_are_left_out() -> None:
    # Benchmarks take minutes and the README's fresh-machine commands are what CI runs;
    # every other block must run.
    for page in PAGES:
        if page.name != "benchmarks.md":
            assert "no-run" not in page.read_text(), f"{page} has a block that is not run"


# The tutorial's demo waits on purpose (a person watching a reply stream): `slow`.
SLOW_PAGES = {ROOT / "docs" / "tutorial.md"}
# Pages run twice in the same directory: a reader runs a tutorial again.
TWICE_PAGES = {ROOT / "docs" / "tutorial.md"}


@pytest.fixture
def exit_stack() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as stack:
        yield stack


@pytest.mark.parametrize("page", [
    pytest.param(
        p, id=str(p.relative_to(ROOT)), marks=pytest.mark.slow if p in SLOW_PAGES else ()
    )
    for p in [*PAGES, ROOT / "README.md"]
])
def test_page_runs(
    page: Path, server: LoopbackServer, tmp_path: Path, exit_stack: contextlib.ExitStack
) -> None:
    # The README's shell commands are the fresh-machine commands CI itself runs; its
    # Python runs as plain scripts, the way a reader saves and runs the quick start.
    extra = ["--python-only"] if page.name == "README.md" else []
    if not blocks(page):
        return
    env = {
        **os.environ,
        "OLLAMA_HOST": server.url,
        "OPENAI_BASE_URL": server.openai_base_url,
        "OPENAI_API_KEY": "sk-docs-test",
        "ANTHROPIC_BASE_URL": server.url,
        "ANTHROPIC_API_KEY": "sk-ant-docs-test",
        "GEMINI_BASE_URL": server.url,
        "GEMINI_API_KEY": "AIza-docs-test",
        # bedrock: signed with the test key the loopback server knows
        "AWS_REGION": BEDROCK_REGION,
        "AWS_ENDPOINT_URL_BEDROCK_RUNTIME": server.url,
        "AWS_ACCESS_KEY_ID": BEDROCK_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": BEDROCK_CREDENTIALS[BEDROCK_KEY_ID],
        "AIMU_HOME": str(tmp_path / "aimu-home"),
        "PYTHONPATH": str(ROOT),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    # The clouds' doors of the loopback server: Azure's key; Vertex AI's project, host and
    # application default credentials (a service account whose tokens the server issues).
    env.update(AZURE_OPENAI_BASE_URL=server.azure_base_url, AZURE_OPENAI_API_KEY=AZURE_KEY,
               GOOGLE_CLOUD_PROJECT="docs-project", GOOGLE_CLOUD_LOCATION="us-central1",
               GOOGLE_VERTEX_BASE_URL=server.url)
    if page.name == "vertex.md":
        adc = tmp_path / "adc.json"
        adc.write_text(json.dumps(service_account_info(server.url + "/token")))
        env["GOOGLE_APPLICATION_CREDENTIALS"] = str(adc)
    if page.name == "persist-and-resume.md":  # its PostgreSQL section needs a server
        env["DATABASE_URL"] = exit_stack.enter_context(services.postgres_database())
    if page.name == "scale-out.md":  # its Redis, found (or skipped) as every Redis test's
        env["REDIS_URL"] = services.redis_url()
    if page.name == "temporal.md":  # its Temporal dev server, as the Temporal tests'
        env["TEMPORAL_ADDRESS"] = services.temporal_address()
    directory = tmp_path / "reader"  # a fresh directory, the page's blocks run in it
    directory.mkdir()
    for _ in range(2 if page in TWICE_PAGES else 1):
        completed = subprocess.run(
            [sys.executable, "-W", "error::ResourceWarning",
             str(ROOT / "tests/docs/runner.py"), str(page), *extra],
            cwd=directory, env=env, capture_output=True, text=True, timeout=180,
        )
        assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]

