"""``aimu serve`` as a person starts it: what it says when it serves, when it cannot, and
what reaches its log. Each server is a child process (``python -m aimu serve``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

from aimu._logs import LOG_LEVELS
from aimu.aio.control.keys import redact
from aimu.aio.providers.test import WHAT_IT_DOES
from aimu.assistant import DEMO_TOOLS
from aimu.cli import build_parser
from aimu.testing.server import LoopbackServer
from aimu.testing.server.bedrock import CREDENTIALS, REGION, SESSION_TOKEN, TEMPORARY_KEY_ID
from tests.serve.harness import ROOT, clean_env, collect, postgres_database, start
from tests.services import redis_url

SECRET = "sekrit-pw"


def broken(item: str) -> str:
    """Look an item up (always fails: its warning must reach the server's log)."""
    raise RuntimeError(f"the lookup of {item} broke")


def serve_env(home: Path, **extra: str) -> dict[str, str]:
    """No AIMU_HOME: the default store is under the (temporary) home directory."""
    env = clean_env(HOME=str(home), **extra)
    env.pop("AIMU_HOME", None)
    return env


async def refused(tmp_path: Path, *args: str, code: str = "") -> tuple[int, str]:
    """Run ``aimu serve ARGS`` (after ``code``) that must exit at start; (status, stderr)."""
    command = [sys.executable, "-c", f"{code}\nimport sys\nfrom aimu.cli import main\n"
               "sys.exit(main(sys.argv[1:]))", "serve", *args]
    process = await asyncio.create_subprocess_exec(
        *command, cwd=ROOT, env=serve_env(tmp_path), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert out == b""
    assert process.returncode is not None
    return process.returncode, err.decode()


def one_clear_line(stderr: str) -> str:
    """The one line a failed start prints: no traceback, no secret."""
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr and SECRET not in stderr
    assert lines[0].startswith("aimu serve: ")
    return lines[0]


async def test_an_unreachable_store_or_redis_ends_the_start_with_one_line(
    tmp_path: Path,
) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    port = closed.getsockname()[1]
    try:
        status, err = await refused(
            tmp_path, "--store", f"postgresql://postgres:{SECRET}@127.0.0.1:{port}/test"
        )
        assert status == 1
        line = one_clear_line(err)
        assert f"PostgreSQL at 127.0.0.1:{port}" in line and "database 'test'" in line

        status, err = await refused(tmp_path, "--redis", f"redis://:{SECRET}@127.0.0.1:{port}/0")
        assert status == 1
        assert f"cannot reach Redis at redis://***@127.0.0.1:{port}/0" in one_clear_line(err)
    finally:
        closed.close()

    (tmp_path / "a-file").write_text("not a directory")
    status, err = await refused(tmp_path, "--store", str(tmp_path / "a-file" / "sessions.db"))
    assert status == 1
    assert f"{tmp_path / 'a-file'} is a file, not a directory" in one_clear_line(err)

    (tmp_path / "junk.db").write_bytes(b"not SQLite at all " * 20)
    status, err = await refused(tmp_path, "--store", str(tmp_path / "junk.db"))
    assert status == 1
    assert "file is not a database" in one_clear_line(err)

    status, err = await refused(tmp_path, "--model", "nosuch:model")
    assert status == 1
    assert "unknown model provider in 'nosuch:model'" in one_clear_line(err)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, err = await refused(tmp_path, "--port", str(port))
    assert status == 1
    assert f"cannot listen on 127.0.0.1:{port}" in one_clear_line(err)


async def test_a_missing_extra_names_the_install_command(tmp_path: Path) -> None:
    for module in ("uvicorn", "starlette"):
        status, err = await refused(tmp_path, code=f"import sys; sys.modules[{module!r}] = None")
        assert status == 2
        line = one_clear_line(err)
        assert line.startswith("aimu serve: needs the serve extra")
        assert f"({module} is not installed)" in line
        assert line.endswith("pip install -e '.[serve]'")  # run from this checkout


async def test_an_engine_not_installed_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    for option, module in (("--http", "httptools"), ("--loop", "uvloop")):
        status, err = await refused(tmp_path, option, module,
                                    code=f"import sys; sys.modules[{module!r}] = None")
        assert status == 2
        assert one_clear_line(err) == (f"aimu serve: {option} {module} needs the serve extra "
                                       f"({module} is not installed): pip install -e '.[serve]'")
    assert not (tmp_path / ".aimu").exists()  # no store was opened


def test_help_names_the_environment_and_the_log_levels_agree_with_chat(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    commands = next(
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    levels = {}
    for name in ("chat", "serve"):
        option = next(a for a in commands[name]._actions if "--log-level" in a.option_strings)
        levels[name] = (tuple(option.choices or ()), option.help)
        assert option.help is not None and "at this level and above to stderr" in option.help
    assert levels["chat"][0] == levels["serve"][0] == LOG_LEVELS
    assert "(default: none (silent))" in str(levels["chat"][1])
    assert "(default: info)" in str(levels["serve"][1])

    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    shown = capsys.readouterr().out
    for variable in ("AIMU_API_TOKEN", "AIMU_MODEL", "AIMU_HOME", "OPENAI_BASE_URL",
                     "OPENAI_API_KEY", "OLLAMA_HOST", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY",
                     "GEMINI_BASE_URL", "GEMINI_API_KEY", "AZURE_OPENAI_BASE_URL",
                     "AZURE_OPENAI_API_KEY", "GOOGLE_CLOUD_PROJECT", "GOOGLE_CLOUD_LOCATION"):
        assert variable in shown


@dataclass
class Running:
    url: str
    said: list[str]
    """What the server wrote on stderr so far (its start lines, its log)."""
    process: asyncio.subprocess.Process


@contextlib.asynccontextmanager
async def aimu_serve(home: Path, *args: str, **env: str) -> AsyncIterator[Running]:
    """``aimu serve --port 0 ARGS`` in a child process (``env`` added to its
    environment); its URL read from what it prints."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aimu", "serve", "--port", "0", *args,
        cwd=ROOT, env=serve_env(home, **env), stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    assert process.stderr is not None
    said: list[str] = []
    urls: list[str] = []
    serving = asyncio.Event()

    async def read() -> None:
        assert process.stderr is not None
        async for line in process.stderr:
            said.append(line.decode().rstrip("\n"))
            if said[-1].startswith("aimu serve: serving "):
                urls.append(said[-1].split()[3].rstrip("/"))
                serving.set()
        serving.set()  # it exited

    reader = asyncio.create_task(read())
    try:
        await asyncio.wait_for(serving.wait(), 60)
        assert urls, "\n".join(said)
        yield Running(urls[0], said, process)
    finally:
        if process.returncode is None:
            process.terminate()
        await asyncio.wait_for(process.wait(), 30)
        await asyncio.wait_for(reader, 30)


async def test_plain_serve_says_what_it_serves_and_offers_the_demo_tools(
    tmp_path: Path,
) -> None:
    async with aimu_serve(tmp_path, "--log-level", "warning") as server:
        end = next(i for i, line in enumerate(server.said) if "serving" in line)
        block = server.said[end - 7 : end + 1]
        store = tmp_path / ".aimu" / "sessions.db"
        names = ", ".join(tool.__name__ for tool in DEMO_TOOLS)
        assert block[-1] == f"aimu serve: serving {server.url}/ (the web chat; Ctrl+C stops)"
        assert block[:-1] == [
            f"  model  test (embedded and offline: {WHAT_IT_DOES})",
            f"  store  {store}",
            "  redis  none",
            "  runs   in this process",
            f"  tools  {names}",
            "  token  none (loopback only)",
            "  server uvicorn, httptools on uvloop",  # both installed (the serve extra)
        ]
        assert store.exists()
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            run_id = await start(http, "demo", "What time is it?")
            events = await collect(http, run_id)
        called = [e.data["name"] for e in events if e.type == "tool_call"]
        assert sorted(called) == sorted(tool.__name__ for tool in DEMO_TOOLS)
        assert events[-1].data["status"] == "completed"
    # SIGTERM: the runs stopped, a clean exit (issue 29 item 20; Uvicorn alone gives -15).
    assert server.process.returncode == 0


@pytest.mark.parametrize(
    ("spec", "variable", "path", "header"),
    [("anthropic:claude-test", "ANTHROPIC", "/v1/messages", "x-api-key"),
     ("gemini:gemini-test", "GEMINI", "/v1beta/models/gemini-test:streamGenerateContent",
      "x-goog-api-key")],
)
async def test_serve_runs_on_a_vendor_wire_and_never_shows_the_key(
    tmp_path: Path, spec: str, variable: str, path: str, header: str
) -> None:
    key = "sk-serve-secret-42"
    env = {f"{variable}_BASE_URL": "", f"{variable}_API_KEY": key}
    async with LoopbackServer() as model:
        env[f"{variable}_BASE_URL"] = model.url
        async with (
            aimu_serve(tmp_path, "--model", spec, "--log-level", "debug", **env) as server,
            httpx.AsyncClient(base_url=server.url, timeout=30) as http,
        ):
            events = await collect(http, await start(http, "vendor", "What time is it?"))
            assert events[-1].data["status"] == "completed"
            assert [e.data["name"] for e in events if e.type == "tool_call"]  # answered
            assert model.requests and {r.path for r in model.requests} == {path}
            assert model.requests[0].headers[header] == "***"
    assert f"  model  {spec}" in "\n".join(server.said)
    assert key not in "\n".join(server.said)


async def answered(url: str) -> None:
    """A run through the server at ``url`` completes, its tools called."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        events = await collect(http, await start(http, "cloud", "What time is it?"))
    assert events[-1].data["status"] == "completed"
    assert [e.data["name"] for e in events if e.type == "tool_call"]


@pytest.mark.parametrize("spec", ["azure:my-deployment", "vertex:gemini-test"])
async def test_serve_runs_on_a_cloud_and_never_shows_the_credential(
    tmp_path: Path, spec: str
) -> None:
    """``aimu serve --model azure:D`` / ``vertex:M``, configured by the environment alone,
    at the debug log level: no key or token in anything it says."""
    import json

    from aimu.testing.server.clouds import AZURE_KEY, service_account_info

    async with LoopbackServer() as model:
        adc = tmp_path / "adc.json"
        adc.write_text(json.dumps(service_account_info(model.url + "/token")))
        env = {"AZURE_OPENAI_BASE_URL": model.azure_base_url, "AZURE_OPENAI_API_KEY": AZURE_KEY,
               "GOOGLE_CLOUD_PROJECT": "proj-s", "GOOGLE_CLOUD_LOCATION": "europe-west1",
               "GOOGLE_VERTEX_BASE_URL": model.url, "GOOGLE_APPLICATION_CREDENTIALS": str(adc)}
        async with aimu_serve(tmp_path, "--model", spec, "--log-level", "debug",
                              **env) as server:
            await answered(server.url)
        chats = {r.path for r in model.requests} - {"/token"}
        if spec.startswith("vertex"):
            assert chats == {"/v1/projects/proj-s/locations/europe-west1/publishers/google/"
                             "models/gemini-test:streamGenerateContent"}
            assert model.clouds.issued
        else:
            assert chats == {"/openai/v1/chat/completions"}
    said = "\n".join(server.said)
    assert f"  model  {spec}" in said
    assert AZURE_KEY not in said
    assert not any(token in said for token in model.clouds.issued)


async def test_serve_runs_on_bedrock_signed_and_never_shows_a_secret(tmp_path: Path) -> None:
    """``--model bedrock:...`` with credentials from the environment (botocore's chain):
    every request is signed (the loopback server checks each signature), and neither the
    secret key nor the session token reaches a line serve prints, at debug level."""
    secret = CREDENTIALS[TEMPORARY_KEY_ID]
    env = {"AWS_REGION": REGION, "AWS_ACCESS_KEY_ID": TEMPORARY_KEY_ID,
           "AWS_SECRET_ACCESS_KEY": secret, "AWS_SESSION_TOKEN": SESSION_TOKEN,
           "AWS_EC2_METADATA_DISABLED": "true"}
    async with LoopbackServer() as model:
        env["AWS_ENDPOINT_URL_BEDROCK_RUNTIME"] = model.url
        async with (
            aimu_serve(tmp_path, "--model", "bedrock:anthropic.claude-test-v1:0",
                       "--log-level", "debug", **env) as server,
            httpx.AsyncClient(base_url=server.url, timeout=30) as http,
        ):
            events = await collect(http, await start(http, "cloud", "What time is it?"))
            assert events[-1].data["status"] == "completed"
            assert [e.data["name"] for e in events if e.type == "tool_call"]  # answered
            assert {r.path for r in model.requests} == {
                "/model/anthropic.claude-test-v1%3A0/converse-stream"
            }
            assert all(r.headers["authorization"] == "***" for r in model.requests)
    said = "\n".join(server.said)
    assert "  model  bedrock:anthropic.claude-test-v1:0" in said
    assert secret not in said and SESSION_TOKEN not in said


async def test_at_the_default_log_level_the_banner_comes_before_any_other_line(
    tmp_path: Path,
) -> None:
    """Uvicorn's own start-up lines ("Started server process", "Uvicorn running on" an
    address it does not listen on) no longer come first: the banner says it all."""
    async with aimu_serve(tmp_path) as server:
        assert server.said[0].startswith("  model  test (embedded and offline: ")
        assert server.said[7].startswith("aimu serve: serving http://127.0.0.1:")
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            await collect(http, await start(http, "s", "hi"))
    assert not [line for line in server.said if "Uvicorn running" in line or
                "Started server process" in line or "startup" in line], server.said


def test_building_the_app_leaves_the_root_logger_alone(tmp_path: Path) -> None:
    """The mcp SDK's server (mounted at /mcp) set up the root logger itself (basicConfig,
    INFO): every library's INFO record then reached stderr, before the banner too."""
    code = (  # a fresh process: pytest's own handlers on the root would hide it
        "import asyncio, logging, sys\n"
        "from aimu.serve import app\n"
        "application = app('test', store=sys.argv[1])\n"
        "root = logging.getLogger()\n"
        "print(len(root.handlers), logging.getLevelName(root.level))\n"
        "asyncio.run(application.aclose())\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s.db")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["0", "WARNING"], done.stdout


async def test_aimu_warnings_reach_the_server_log(tmp_path: Path) -> None:
    """Issue 21 item 19: the tool's failure is a WARNING on aimu.aio.tools, on stderr."""
    tool = "tests.serve.test_command:broken"
    async with aimu_serve(tmp_path, "--tool", tool, "--log-level", "warning") as server:
        assert "  tools  broken" in server.said
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            events = await collect(http, await start(http, "warn", "look it up"))
        assert events[-1].data["status"] == "completed"
        results = [e.data["content"] for e in events if e.type == "tool_result"]
        assert len(results) == 1 and "RuntimeError" in results[0]
    warnings = [line for line in server.said if line.startswith("WARNING aimu.aio.tools")]
    assert len(warnings) == 1, server.said
    assert "tool 'broken' raised RuntimeError" in warnings[0]
    assert not [line for line in server.said if line.startswith("INFO ")]  # the level holds


async def test_with_redis_it_says_where_the_runs_are_shared(tmp_path: Path) -> None:
    url = redis_url()
    async with aimu_serve(tmp_path, "--redis", url, "--redis-prefix", "aimu_test_cmd") as server:
        assert f"  redis  {redact(url)}" in server.said
        assert "  runs   in this process, reachable from every server on Redis" in server.said


async def test_a_database_password_is_never_shown(tmp_path: Path) -> None:
    async with postgres_database() as url:
        parts = urlsplit(url)
        netloc = f"{parts.username or 'postgres'}:{SECRET}@{parts.hostname}:{parts.port or 5432}"
        with_password = urlunsplit(parts._replace(netloc=netloc))
        async with aimu_serve(tmp_path, "--store", with_password) as server:
            shown = urlunsplit(parts._replace(netloc=netloc.replace(f":{SECRET}", "")))
            assert f"  store  {shown}" in server.said
        assert not [line for line in server.said if SECRET in line]
