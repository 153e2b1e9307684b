"""``python -m aimu chat`` driven as a person would: piped stdin, a pseudo-terminal, restarts.

Piped tests run ``--model ollama:test`` against a loopback Ollama server whose
"long ..." turn streams for a minute, so a stop after its first words lands mid-stream;
the pty tests press Ctrl+C (``\\x03``) on the embedded test model, whose turns call a
``research`` tool that waits until the test opens its gate (creates a file).
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pyte
import pytest

from aimu.cli import main
from aimu.testing.script import Turn
from aimu.testing.server import LoopbackServer
from aimu.testing.server.bedrock import CREDENTIALS as BEDROCK_CREDENTIALS
from aimu.testing.server.bedrock import REGION as BEDROCK_REGION
from aimu.testing.server.bedrock import TEST_KEY_ID as BEDROCK_KEY_ID
from tests.http_stub import stub_server
from tests.services import refused_port

BEDROCK_SECRET = BEDROCK_CREDENTIALS[BEDROCK_KEY_ID]

ROOT = Path(__file__).resolve().parents[1]
LONG = " ".join(f"w{i}" for i in range(2000))
LAST_WORD = "w1999"
BANNER_END = "/help lists the commands.\n"
WAIT = 15.0


def last_user(request: Mapping[str, Any]) -> str:
    users = [m.get("content", "") for m in request.get("messages", []) if m.get("role") == "user"]
    # Adjacent user turns (after a failed one) reach the server merged, one paragraph each.
    return str(users[-1]).rpartition("\n\n")[2] if users else ""


def script(request: Mapping[str, Any]) -> Turn:
    said = last_user(request)
    if said.startswith("long"):
        return Turn(text=LONG, delay=0.03)
    if said == "fail":
        return Turn(fault="http_500")
    if said == "slow":  # no byte for a minute: only a stop ends the wait
        return Turn(text="late", first_byte_delay=60)
    return Turn(text=f"answer to {said}")


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer.in_thread(script) as running:
        yield running


def environment(home: Path, ollama: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AIMU_MODEL", "OLLAMA_HOST")}
    env.update(AIMU_HOME=str(home), OLLAMA_HOST=ollama, PYTHONPATH=str(ROOT))
    return env


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


# A child that takes the pty as its controlling terminal, so ^C there sends it SIGINT.
_ON_TTY = (
    "import os, sys; os.login_tty(os.dup(0)); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)

# `aimu chat` whose research tool says how far it is, then waits until the file
# $AIMU_TEST_GATE exists, so a Ctrl+C provably lands while the tool runs (the demo tool
# would finish on its own).
# A tool from a schema, as an MCP server's are: its progress is streamed as it runs.
_GATED_CHAT = """
import asyncio, os, sys
from aimu.aio.tools import Tool, ToolContext
from aimu.cli import main

async def look(arguments: dict, ctx: ToolContext) -> str:
    ctx.report_progress(1, 3, "reading sources")
    while not os.path.exists(os.environ["AIMU_TEST_GATE"]):
        await asyncio.sleep(0.01)
    return f"notes on {arguments['topic']!r}"

schema = {"type": "object", "properties": {"topic": {"type": "string"}}, "required": ["topic"]}
research = Tool.from_schema("research", "Look into a topic.", schema, look)
sys.exit(main(sys.argv[1:], tools=[research]))
"""


_COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # SGR: the colours a terminal gets


class Chat:
    """One ``python -m aimu chat`` process: send lines, wait for what it prints."""

    def __init__(
        self, *args: str, env: dict[str, str], tty: bool = False, gated: bool = False
    ) -> None:
        program = ["-c", _GATED_CHAT] if gated else ["-m", "aimu"]
        command = [sys.executable, *program, "chat", *args]
        self.tty = tty
        self._output = bytearray()
        self._errors = bytearray()
        self._changed = threading.Condition()
        self.cursor = 0
        self.error_cursor = 0
        self._closed = False
        if tty:
            master, slave = os.openpty()
            # 24 rows of 100 columns: a pty starts at 0x0, where an editor draws no bar.
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
            self.process = subprocess.Popen(
                [sys.executable, "-c", _ON_TTY, *command[1:]],
                stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT,
            )
            os.close(slave)
            self._input = master
            readers = [(master, self._output)]
        else:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=env, cwd=ROOT,
            )
            assert self.process.stdin and self.process.stdout and self.process.stderr
            self._input = self.process.stdin.fileno()
            readers = [
                (self.process.stdout.fileno(), self._output),
                (self.process.stderr.fileno(), self._errors),
            ]
        self._threads = [
            threading.Thread(target=self._pump, args=reader, daemon=True) for reader in readers
        ]
        for thread in self._threads:
            thread.start()

    def _pump(self, fd: int, into: bytearray) -> None:
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:  # a pty whose other side closed reads as EIO
                data = b""
            if self.tty and b"\x1b[6n" in data:
                # Answer "where is the cursor?" as a terminal would (row 1, column 1); an
                # editor that gets no answer draws no bottom bar.
                os.write(fd, b"\x1b[1;1R")
            with self._changed:
                into += data
                self._changed.notify_all()
            if not data:
                return

    @property
    def output(self) -> str:
        """What the chat printed; on a terminal, without its colours (see ``raw``)."""
        text = self._output.decode(errors="replace")
        return _COLOUR.sub("", text.replace("\r\n", "\n")) if self.tty else text

    @property
    def raw(self) -> str:
        return self._output.decode(errors="replace")

    def screen(self) -> list[str]:
        """The lines a person sees on the terminal (and above it, scrolled away), as a
        VT100 terminal of the pty's size draws what the chat wrote."""
        terminal = pyte.HistoryScreen(100, 24, history=100_000)
        pyte.ByteStream(terminal).feed(bytes(self._output))
        rows = [*terminal.history.top, *(terminal.buffer[y] for y in range(terminal.lines))]
        return [
            "".join(row[x].data for x in range(terminal.columns)).rstrip() for row in rows
        ]

    @property
    def errors(self) -> str:
        return self._errors.decode(errors="replace")

    def send(self, *lines: str) -> None:
        for line in lines:
            self.press(line + "\n")

    def press(self, keys: str) -> None:
        os.write(self._input, keys.encode())

    def expect(self, text: str) -> str:
        """Wait until ``text`` is printed after the cursor; return the output up to it."""
        at = self._wait_for(text, lambda: self.output, self.cursor)
        seen = self.output[self.cursor : at + len(text)]
        self.cursor = at + len(text)
        return seen

    def expect_error(self, text: str) -> str:
        """Wait until ``text`` is on stderr after its cursor; return stderr up to it."""
        at = self._wait_for(text, lambda: self.errors, self.error_cursor)
        seen = self.errors[self.error_cursor : at + len(text)]
        self.error_cursor = at + len(text)
        return seen

    def _wait_for(self, text: str, stream: Callable[[], str], cursor: int) -> int:
        deadline = time.monotonic() + WAIT
        with self._changed:
            while (at := stream().find(text, cursor)) < 0:
                left = deadline - time.monotonic()
                if left <= 0 or (self.process.poll() is not None and not self._alive()):
                    raise AssertionError(
                        f"{text!r} never printed; stdout after the cursor: "
                        f"{self.output[self.cursor:]!r}; stderr: {self.errors[-2000:]!r}"
                    )
                self._changed.wait(min(left, 0.1))
        return at

    def _alive(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def close_input(self) -> None:
        if self.tty:
            self.press("\x04")  # Ctrl+D on an empty line: EOF
        elif self.process.stdin is not None:
            self.process.stdin.close()

    def wait(self) -> int:
        code = self.process.wait(WAIT)
        self.close()
        return code

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(WAIT)
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for thread in self._threads:
            thread.join(WAIT)
        if self.tty:
            os.close(self._input)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def chats() -> Iterator[list[Chat]]:
    """Chats a test started; any still running at the end is killed."""
    started: list[Chat] = []
    yield started
    for chat in started:
        chat.close()


def start(
    chats: list[Chat], *args: str, env: dict[str, str], tty: bool = False, gated: bool = False
) -> Chat:
    chat = Chat(*args, env=env, tty=tty, gated=gated)
    chats.append(chat)
    chat.expect(BANNER_END)
    return chat


def roles_and_contents(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(m["role"], m.get("content", "")) for m in messages]


# --------------------------------------------------------------------------- piped stdin


@pytest.mark.parametrize(
    "model", ["ollama:test", "anthropic:claude-test", "gemini:gemini-test", "bedrock:claude-test"]
)
def test_stop_mid_stream_abandons_the_stream_and_the_next_request_carries_the_partial(
    server: LoopbackServer, tmp_path: Path, chats: list[Chat], model: str
) -> None:
    env = environment(tmp_path, server.url)
    env.update(ANTHROPIC_BASE_URL=server.url, ANTHROPIC_API_KEY="sk-ant-cli-secret")
    env.update(GEMINI_BASE_URL=server.url, GEMINI_API_KEY="AIza-cli-secret")
    env.update(AWS_REGION=BEDROCK_REGION, AWS_ENDPOINT_URL_BEDROCK_RUNTIME=server.url,
               AWS_ACCESS_KEY_ID=BEDROCK_KEY_ID, AWS_SECRET_ACCESS_KEY=BEDROCK_SECRET)
    streams_before = len(server.streams)
    chat = start(chats, "--model", model, env=env)
    chat.send("long story")
    shown = chat.expect("w5 ")
    chat.send("/stop")
    shown += chat.expect("(stopped)\n")
    partial = shown.removesuffix("\n(stopped)\n")
    assert partial.startswith("w0 w1 w2 w3 w4 w5") and LAST_WORD not in partial
    stream = server.streams[streams_before]
    wait_for(lambda: stream.abandoned, "the server to see the stream abandoned")
    assert not stream.completed
    chat.send("next")
    chat.expect("answer to next\n")
    sent = server.requests[-1].messages  # in the chat shape, whatever the wire
    assert roles_and_contents(sent) == [
        ("user", "long story"),
        ("assistant", partial),  # exactly what the user saw
        ("user", "next"),
    ]
    chat.close_input()
    assert chat.wait() == 0
    assert "Traceback" not in chat.errors
    for key in ("sk-ant-cli-secret", "AIza-cli-secret", BEDROCK_SECRET):
        assert key not in chat.errors + shown  # the key is never shown


def test_input_typed_during_a_turn_is_queued_and_answered_in_order(
    server: LoopbackServer, tmp_path: Path, chats: list[Chat]
) -> None:
    chat = start(chats, "--model", "ollama:test", env=environment(tmp_path, server.url))
    chat.send("long one")
    chat.expect("w2 ")
    chat.send("first", "second", "/stop")  # /stop stops the running turn, not a queued one
    chat.expect("(stopped)\n")
    assert chat.expect("answer to first\n") == "answer to first\n"
    assert chat.expect("answer to second\n") == "answer to second\n"
    chat.close_input()
    assert chat.wait() == 0


def test_idle_stop_unknown_commands_http_errors_and_eof(
    server: LoopbackServer, tmp_path: Path, chats: list[Chat]
) -> None:
    chat = start(chats, "--model", "ollama:test", env=environment(tmp_path, server.url))
    chat.send("/stop")
    assert chat.expect("\n") == "(nothing to stop: no turn is running)\n"
    chat.send("/frobnicate")
    line = chat.expect("\n")
    assert line.startswith("unknown command /frobnicate: /help lists the commands")
    chat.send("fail")
    assert chat.expect_error("\n") == (
        f"error: Ollama at {server.url} answered HTTP 500 for model 'test': "
        "internal server error (scripted http_500 fault)\n"
    )
    chat.send("hello")
    assert chat.expect("\n") == "answer to hello\n"
    chat.close_input()
    assert chat.wait() == 0  # the last turn answered
    assert chat.errors.count("\n") == 1 and "error" not in chat.output


def test_a_piped_chat_whose_last_turn_failed_exits_1(
    server: LoopbackServer, tmp_path: Path
) -> None:
    for said in ("fail\n", "hello\nfail\n"):
        done = subprocess.run(
            [sys.executable, "-m", "aimu", "chat", "--model", "ollama:test"],
            input=said, capture_output=True, text=True, timeout=WAIT,
            env=environment(tmp_path, server.url), cwd=ROOT,
        )
        assert done.returncode == 1, done
        assert done.stderr.startswith("error: Ollama at ") and done.stderr.count("\n") == 1
        assert "error" not in done.stdout


def test_usage_errors_go_to_stderr_and_exit_2(tmp_path: Path) -> None:
    for options in (["--model", "nope:x"], ["--session", "../x"], ["--frobnicate"]):
        done = subprocess.run(
            [sys.executable, "-m", "aimu", "chat", *options],
            input="", capture_output=True, text=True, timeout=WAIT,
            env=environment(tmp_path, "127.0.0.1:9"), cwd=ROOT,
        )
        assert done.returncode == 2, done
        assert done.stdout == "" and done.stderr.strip(), done
        assert "Traceback" not in done.stderr


def error_after_retries(chat: Chat) -> tuple[list[str], str]:
    """The chat's stderr lines up to its next ``error:`` line: the retry notes, the error."""
    retries: list[str] = []
    while not (line := chat.expect_error("\n")).startswith("error: "):
        retries.append(line)
    return retries, line


def test_unreachable_server_says_it_retries_prints_one_line_and_keeps_serving(
    tmp_path: Path, chats: list[Chat]
) -> None:
    port = refused_port()
    chat = start(chats, "--model", "ollama:llama3", env=environment(tmp_path, f"127.0.0.1:{port}"))
    chat.send("hello")
    # A server coming up is waited for, and the chat says so, in one line per retry.
    retries, line = error_after_retries(chat)
    assert len(retries) == 3, retries
    for attempt, retry in enumerate(retries, 1):
        assert re.fullmatch(
            rf"\(retry {attempt} in [0-9.]+s: cannot connect to Ollama at "
            rf"http://127\.0\.0\.1:{port} \(.+\)\)\n",
            retry,
        ), retry
    assert re.fullmatch(
        rf"error: cannot connect to Ollama at http://127\.0\.0\.1:{port} \(.+\); "
        r"is Ollama running there\? set OLLAMA_HOST, or chat offline with --model test\n",
        line,
    ), line
    chat.send("/history")
    assert chat.expect("1 user: hello\n").startswith("session 'default': 1 messages\n")
    chat.send("again")
    assert error_after_retries(chat)[1].startswith(
        f"error: cannot connect to Ollama at http://127.0.0.1:{port}"
    )
    chat.close_input()
    assert chat.wait() == 1  # the last turn failed
    assert "Traceback" not in chat.output + chat.errors


def test_a_session_served_elsewhere_is_refused_in_one_line(
    server: LoopbackServer, tmp_path: Path, chats: list[Chat]
) -> None:
    env = environment(tmp_path, server.url)
    first = start(chats, "--model", "ollama:test", "--session", "busy", env=env)
    second = subprocess.run(
        [sys.executable, "-m", "aimu", "chat", "--model", "ollama:test", "--session", "busy"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=WAIT, env=env,
        cwd=ROOT,
    )
    assert second.returncode == 1 and second.stdout == ""
    assert re.fullmatch(
        rf"error: session 'busy' is already open for writing by .*{first.process.pid}.*\n",
        second.stderr,
    ), second.stderr
    first.close_input()
    assert first.wait() == 0


# --------------------------------------------------------------------------- restarts


def test_restart_after_stop_continues_the_session(
    server: LoopbackServer, tmp_path: Path, chats: list[Chat]
) -> None:
    env = environment(tmp_path, server.url)
    options = ("--model", "ollama:test", "--session", "trip", "--system", "Be brief.")
    chat = start(chats, *options, env=env)
    chat.send("long way")
    shown = chat.expect("w3 ")
    chat.send("/stop")
    partial = (shown + chat.expect("(stopped)\n")).removesuffix("\n(stopped)\n")
    chat.close_input()
    assert chat.wait() == 0

    again = start(chats, *options, env=env)
    assert "session 'trip' (2 messages; /history shows them)" in again.output
    again.send("/history")
    history = again.expect("(stopped)\n")
    assert history == (
        "session 'trip': 3 messages\n"
        "  1 system: Be brief.\n"
        "  2 user: long way\n"
        f"  3 assistant: {partial.strip()} (stopped)\n"
    )
    again.send("next")
    again.expect("answer to next\n")
    assert roles_and_contents(server.requests[-1].body["messages"]) == [
        ("system", "Be brief."),
        ("user", "long way"),
        ("assistant", partial),
        ("user", "next"),
    ]
    again.close_input()
    assert again.wait() == 0


def test_restart_after_kill_9_mid_turn_loses_nothing_and_duplicates_nothing(
    server: LoopbackServer, tmp_path: Path, chats: list[Chat]
) -> None:
    env = environment(tmp_path, server.url)
    options = ("--model", "ollama:test", "--session", "crash", "--system", "Be brief.")
    chat = start(chats, *options, env=env)
    chat.send("first")
    chat.expect("answer to first\n")
    chat.send("long run")
    chat.expect("w3 ")
    chat.kill()  # SIGKILL mid-stream: no finally runs in the child

    again = start(chats, *options, env=env)
    again.send("/history")
    history = again.expect("  4 user: long run\n")
    assert history == (
        "session 'crash': 4 messages\n"
        "  1 system: Be brief.\n"
        "  2 user: first\n"
        "  3 assistant: answer to first\n"
        "  4 user: long run\n"
    )
    again.send("next")
    again.expect("answer to next\n")
    assert roles_and_contents(server.requests[-1].body["messages"]) == [
        ("system", "Be brief."),
        ("user", "first"),
        ("assistant", "answer to first"),
        ("user", "long run\n\nnext"),  # adjacent user turns go out merged (strict templates)
    ]
    again.close_input()
    assert again.wait() == 0


# --------------------------------------------------------------------------- Ctrl+C on a pty


def gated_environment(home: Path) -> tuple[dict[str, str], Path]:
    """The environment of a gated chat on the test model, and its gate (not yet open)."""
    gate = home / "gate"
    return {**environment(home, "127.0.0.1:9"), "AIMU_TEST_GATE": str(gate)}, gate


def test_ctrl_c_once_interrupts_at_the_step_boundary(tmp_path: Path, chats: list[Chat]) -> None:
    env, gate = gated_environment(tmp_path)
    chat = start(chats, "--model", "test", "--plain", env=env, tty=True, gated=True)
    chat.send("look into Paris")
    chat.expect("[calling research(topic=\"Paris\")]\n")
    chat.press("\x03")
    chat.expect("press Ctrl+C again to stop now)\n")
    gate.touch()  # the research step finishes only after the press was handled
    shown = chat.expect("(interrupted)\n")
    # The research step finished and was recorded; the answer step never started.
    assert "[research → notes on 'Paris'" in shown and "I called" not in shown
    chat.send("/history")
    history = chat.expect("tool research: notes on 'Paris'")
    assert "user: look into Paris" in history
    chat.close_input()
    assert chat.wait() == 0


def test_ctrl_c_twice_cancels_the_turn(tmp_path: Path, chats: list[Chat]) -> None:
    env, _ = gated_environment(tmp_path)  # the gate never opens: only a cancel ends research
    chat = start(chats, "--model", "test", "--plain", env=env, tty=True, gated=True)
    chat.send("look into Rome")
    chat.expect("[calling research(topic=\"Rome\")]\n")
    chat.press("\x03")
    chat.expect("press Ctrl+C again to stop now)\n")
    chat.press("\x03")
    shown = chat.expect("(stopped)\n")
    assert "[research →" not in shown
    chat.send("/history")
    chat.expect("tool research: ")
    assert "cancel" in chat.expect("\n")
    chat.close_input()
    assert chat.wait() == 0


def test_ctrl_c_when_idle_exits(tmp_path: Path, chats: list[Chat]) -> None:
    env = environment(tmp_path, "127.0.0.1:9")
    chat = start(chats, "--model", "test", "--plain", env=env, tty=True)
    chat.expect("> ")
    chat.press("\x03")
    chat.expect("(bye)\n")
    assert chat.wait() == 0


# --------------------------------------------------------------------------- the command


def test_command_line_help_version_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("aimu ")
    assert main(["chat", "--help"]) == 0
    shown = capsys.readouterr().out
    assert "--model SPEC" in shown and "--session NAME" in shown and "--system TEXT" in shown
    assert main(["chat", "--no-such-option"]) == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_bare_aimu_prints_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("usage: aimu") and "chat " in shown and "serve " in shown


def test_python_dash_m_aimu_chat_exits_0_at_eof(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "aimu", "chat", "--model", "test", "--no-tools"],
        input="hi there\n", capture_output=True, text=True, timeout=WAIT,
        env=environment(tmp_path, "127.0.0.1:9"), cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1:] == ["You said: hi there"]
    assert (tmp_path / "sessions.db").exists()
    # A newcomer's first chat is on the embedded model: the banner says what it does.
    assert done.stdout.startswith(
        "aimu chat: model test (embedded and offline: a stand-in for a real model, it calls "
        "each tool it is offered once, then quotes what they returned), session 'default'"
    )


def test_the_example_assistant_runs_with_its_own_tool(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "examples/personal-assistant/assistant.py", "--session", "ex"],
        input="roll a die\n/sessions\n", capture_output=True, text=True, timeout=WAIT,
        env=environment(tmp_path, "127.0.0.1:9"), cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"^\[roll_dice → [1-6]\]$", done.stdout, re.M), done.stdout
    assert re.search(r"I called roll_dice: [1-6]\.$", done.stdout, re.M), done.stdout
    assert "* ex: 7 messages, completed" in done.stdout


@pytest.mark.parametrize(
    "command", [["-m", "aimu", "chat"], ["examples/personal-assistant/assistant.py"]]
)
def test_an_unusable_home_is_one_error_line_not_a_traceback(
    tmp_path: Path, command: list[str]
) -> None:
    home = tmp_path / "home"
    home.write_text("a file where the state directory should be")
    done = subprocess.run(
        [sys.executable, *command], input="", capture_output=True, text=True, timeout=WAIT,
        env=environment(home, "127.0.0.1:9"), cwd=ROOT,
    )
    assert done.returncode == 1
    said = done.stdout + done.stderr
    assert "Traceback" not in said, said
    assert said.startswith("error: ") and said.count("\n") == 1 and str(home) in said, said


def test_the_command_imports_where_posix_only_modules_do_not_exist() -> None:
    # As on Windows: importing a module set to None in sys.modules raises ImportError.
    blocked = ("fcntl", "termios", "tty", "pty", "resource", "grp", "pwd")
    code = (
        f"import sys; sys.modules.update(dict.fromkeys({blocked!r}));"
        "import aimu.cli, aimu.assistant; sys.exit(aimu.cli.main(['--version']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("aimu ")


def test_log_level_sends_aimu_records_to_stderr(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "aimu", "chat", "--model", "test", "--session", "logs"]
    quiet = subprocess.run(
        command, input="count the words in hello world\n", capture_output=True, text=True,
        timeout=WAIT, env=environment(tmp_path, "127.0.0.1:9"), cwd=ROOT,
    )
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    logged = subprocess.run(
        [*command, "--log-level", "debug"], input="count the words in hello world\n",
        capture_output=True, text=True, timeout=WAIT,
        env=environment(tmp_path, "127.0.0.1:9"), cwd=ROOT,
    )
    assert logged.returncode == 0, logged.stderr
    assert "DEBUG aimu.aio.tools: tool 'word_count'" in logged.stderr, logged.stderr


# --------------------------------------------------------------------------- a terminal


def terminal_environment(home: Path) -> tuple[dict[str, str], Path]:
    env, gate = gated_environment(home)
    # A terminal that answers no cursor-position request, as a pty here does not.
    env.update(TERM="xterm-256color")
    return env, gate


def start_on_terminal(chats: list[Chat], *args: str, env: dict[str, str], gated: bool) -> Chat:
    chat = start(chats, "--model", "test", *args, env=env, tty=True, gated=gated)
    chat.expect(" Enter sends")  # the editor's bottom bar: keys now reach the editor
    return chat


def test_on_a_terminal_lines_are_edited_recalled_and_kept_in_a_private_history(
    tmp_path: Path, chats: list[Chat]
) -> None:
    env, _ = terminal_environment(tmp_path)
    chat = start_on_terminal(chats, "--no-tools", env=env, gated=False)
    chat.press("hello therx\x7fe\r")  # a typo, Backspace, the rest, Enter
    chat.expect("You said: hello there")
    # The editor redraws its bar once it has the terminal back after printing above it:
    # a key pressed before that would meet the terminal in line mode.
    chat.expect(" Enter sends")
    chat.press("\x1b[A\r")  # Up recalls the line; Enter sends it again
    chat.expect("You said: hello there")
    chat.expect(" Enter sends")
    chat.press("\x04")  # Ctrl+D on an empty line
    assert chat.wait() == 0
    history = tmp_path / "history"
    assert history.read_text().count("+hello there\n") == 1  # a repeated line is kept once
    assert history.stat().st_mode & 0o777 == 0o600


def test_on_a_terminal_ctrl_c_is_a_key_with_the_same_meaning(
    tmp_path: Path, chats: list[Chat]
) -> None:
    env, gate = terminal_environment(tmp_path)
    chat = start_on_terminal(chats, env=env, gated=True)
    chat.press("look into Paris\r")
    chat.expect("[calling research(topic=\"Paris\")]")
    # The spinner in the bottom bar, drawn by the editor, with how far the tool said it is.
    chat.expect("running research (1/3 reading sources)…")
    chat.press("\x03")
    chat.expect("press Ctrl+C again to stop now)")
    gate.touch()
    chat.expect("(interrupted)")
    chat.expect(" Enter sends")
    gate.unlink()  # closed again: the next research waits
    chat.press("look into Rome\r")
    chat.expect("[calling research(topic=\"Rome\")]")
    chat.expect("running research (1/3 reading sources)…")
    chat.press("\x03")
    chat.expect("press Ctrl+C again to stop now)")
    chat.expect("running research (1/3 reading sources)…")
    chat.press("\x03")
    chat.expect("(stopped)")
    chat.expect(" Enter sends")
    chat.press("\x03")  # a third press: exit
    chat.expect("(bye)")
    assert chat.wait() == 0


def test_plain_on_a_terminal_a_reply_cannot_drive_it_and_ctrl_d_ends_the_line(
    tmp_path: Path, chats: list[Chat]
) -> None:
    env = environment(tmp_path, "127.0.0.1:9")
    chat = start(chats, "--model", "test", "--plain", "--no-tools", env=env, tty=True)
    chat.send("clear \x1b[2J and retitle \x1b]0;owned\x07 this")  # the test model says it back
    chat.expect("You said: clear \\x1b[2J and retitle \\x1b]0;owned\\x07 this\n")
    chat.send("/history")
    chat.expect("assistant: You said: clear \\x1b[2J and retitle \\x1b]0;owned\\x07 this\n")
    chat.send("/stop")
    chat.expect("(nothing to stop: no turn is running)\n")
    chat.close_input()  # Ctrl+D at the "> " prompt
    assert chat.wait() == 0
    # The terminal echoes what was typed as ^[ (ECHOCTL); what the chat printed is escaped.
    assert "\x1b[2J" not in chat.raw and "\x1b]0;" not in chat.raw
    # The terminal echoes no Enter for Ctrl+D: the chat ends the prompt's line itself,
    # so the shell's prompt starts on a line of its own.
    assert chat.raw.endswith("(nothing to stop: no turn is running)\r\n> \r\n")


@pytest.mark.parametrize("plain", [True, False], ids=["--plain", "TERM=dumb"])
def test_on_a_terminal_without_the_editor_only_plain_turns_colour_off(
    tmp_path: Path, chats: list[Chat], plain: bool
) -> None:
    env = {**environment(tmp_path, "127.0.0.1:9"), "TERM": "dumb"}  # no editor, still a tty
    chat = start(chats, "--model", "test", *["--plain"] * plain, env=env, tty=True)
    chat.send("count the words in hello world")
    chat.expect("[word_count → ")
    chat.expect("worth a closer look.\n> ")  # the turn's end, and the prompt
    chat.send("/stop")
    chat.expect("(nothing to stop: no turn is running)")
    chat.close_input()
    assert chat.wait() == 0
    if plain:
        assert "\x1b[" not in chat.raw  # notes and tool lines alike
    else:
        assert "\x1b[2m(nothing to stop" in chat.raw  # a note, dimmed
        assert "\x1b[36m[word_count → " in chat.raw  # a tool line, coloured


def test_on_a_terminal_without_the_chat_extra_the_plain_mode_says_how_to_get_editing(
    tmp_path: Path, chats: list[Chat]
) -> None:
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\nsys.modules['prompt_toolkit'] = None  # as if not installed\n"
    )
    env = environment(tmp_path, "127.0.0.1:9")
    env.update(TERM="xterm-256color", PYTHONPATH=f"{blocker}{os.pathsep}{ROOT}")
    chat = start(chats, "--model", "test", "--no-tools", env=env, tty=True)
    assert chat.output.startswith(
        "(line editing needs the chat extra (prompt_toolkit is not installed): "
        "pip install -e '.[chat]')\naimu chat: model test"  # then the plain mode, as before
    )
    chat.close_input()
    assert chat.wait() == 0
    plain = start(chats, "--model", "test", "--no-tools", "--plain", env=env, tty=True)
    plain.close_input()
    assert plain.wait() == 0
    assert "pip install" not in plain.output  # asked for plain: no hint


def editor_chat(chats: list[Chat], tmp_path: Path, ollama: str) -> Chat:
    """``aimu chat`` with the editor on a colour terminal, talking to Ollama at ``ollama``."""
    env = {**environment(tmp_path, ollama), "TERM": "xterm-256color"}
    return start(chats, "--model", "ollama:m", "--no-tools", env=env, tty=True)


def test_on_a_terminal_a_spinner_shows_while_the_first_token_is_awaited(
    server: LoopbackServer, tmp_path: Path, chats: list[Chat]
) -> None:
    chat = editor_chat(chats, tmp_path, server.url.removeprefix("http://"))
    chat.expect(" Enter sends")
    chat.press("slow\r")  # the server sends no byte for a minute
    chat.expect("waiting for the model…")
    chat.press("\x03")
    chat.expect("press Ctrl+C again to stop now)")
    chat.press("\x03")
    chat.expect("(stopped)")
    chat.expect(" Enter sends")
    chat.press("\x04")
    assert chat.wait() == 0


def test_on_a_terminal_a_line_typed_while_a_reply_streams_stays_whole(
    server: LoopbackServer, tmp_path: Path, chats: list[Chat]
) -> None:
    chat = editor_chat(chats, tmp_path, server.url.removeprefix("http://"))
    chat.expect(" Enter sends")
    chat.press("long\r")
    chat.expect("w3")  # the reply streams (for a minute)
    chat.press("hel")
    chat.expect("w9")  # more of the reply came while the line was half typed
    chat.press("lo there\r")  # queued: answered once the long turn ends
    chat.expect("w40")  # wider than the terminal by now: still streaming, broken at spaces
    chat.press("/stop\r")
    chat.expect("(stopped)")
    chat.expect("answer to hello there")
    chat.expect(" Enter sends")
    chat.press("\x04")
    assert chat.wait() == 0
    assert last_user(server.requests[-1].body) == "hello there"


def test_on_a_terminal_a_stop_leaves_the_streaming_line_on_the_screen_once(
    server: LoopbackServer, tmp_path: Path, chats: list[Chat]
) -> None:
    chat = editor_chat(chats, tmp_path, server.url.removeprefix("http://"))
    chat.expect(" Enter sends")
    chat.press("long\r")
    chat.expect("w5 ")  # the reply streams; its line is drawn by the prompt, not yet printed
    chat.press("/stop\r")
    chat.expect("(stopped)")
    chat.expect(" Enter sends")
    chat.press("\x04")
    assert chat.wait() == 0
    lines = chat.screen()
    words = [word for line in lines for word in line.split() if re.fullmatch(r"w\d+", word)]
    assert words == [f"w{n}" for n in range(len(words))]  # each word once, in order
    last = max(i for i, line in enumerate(lines) if re.search(r"\bw\d+\b", line))
    assert lines[last + 1] == "(stopped)" and "> /stop" in lines


def test_on_a_terminal_the_bar_and_a_line_say_a_request_is_retried(
    tmp_path: Path, chats: list[Chat]
) -> None:
    port = refused_port()
    chat = editor_chat(chats, tmp_path, f"127.0.0.1:{port}")
    chat.expect(" Enter sends")
    chat.press("hello\r")
    chat.expect("(retry 1 in ")  # printed above the input line
    chat.expect("retrying the model (attempt ")  # the spinner's words in the bar
    chat.expect("error: cannot connect to Ollama")
    chat.expect(" Enter sends")
    chat.press("\x04")
    assert chat.wait() == 1  # the last turn failed


# -- a model the Ollama server does not have -------------------------------------------


def chat_requests_for(server: LoopbackServer, model: str) -> list[Any]:
    return [r for r in server.requests if r.path == "/api/chat" and r.body.get("model") == model]


def test_a_missing_model_without_a_terminal_names_the_pull_command_and_exits_1(
    tmp_path: Path, chats: list[Chat], server: LoopbackServer
) -> None:
    server.not_pulled.add("absent-piped")
    chat = Chat("--model", "ollama:absent-piped", env=environment(tmp_path, server.url))
    chats.append(chat)
    chat.close_input()
    assert chat.wait() == 1
    assert chat.errors == (
        f"error: the model 'absent-piped' is not on the Ollama server at {server.url}; "
        "fetch it with: aimu pull absent-piped\n"
    )
    assert not chat_requests_for(server, "absent-piped")
    assert "absent-piped" in server.not_pulled  # nothing pulled behind the user's back


def test_a_proxys_404_for_api_show_is_not_a_missing_model(
    tmp_path: Path, chats: list[Chat], server: LoopbackServer
) -> None:
    """A proxy that passes only /api/chat answers /api/show with its own 404 ("404 page
    not found", not Ollama's "model 'x' not found"): the model is not missing, the chat
    goes on and the answer comes through."""

    async def proxy(method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        if path != "/api/chat":
            return 404, "text/plain; charset=utf-8", b"404 page not found"
        async with httpx.AsyncClient() as client:
            answer = await client.post(server.url + path, content=body)
        return answer.status_code, answer.headers["content-type"], answer.content

    with stub_server(proxy) as stub:
        chat = Chat("--model", "ollama:test", "--no-tools", env=environment(tmp_path, stub.url))
        chats.append(chat)
        chat.send("hello")
        chat.expect("answer to hello")
        chat.close_input()
        assert chat.wait() == 0
        assert ("POST", "/api/show") in stub.requests  # asked, and the 404 read as "cannot say"
    assert "pull" not in chat.errors


@pytest.mark.parametrize("mode", ["--plain", "editor"])
def test_on_a_terminal_a_missing_model_is_offered_pulled_and_the_chat_goes_on(
    tmp_path: Path, chats: list[Chat], server: LoopbackServer, mode: str
) -> None:
    model = f"absent-yes-{mode.strip('-')}"
    server.not_pulled.add(model)
    env = environment(tmp_path, server.url)
    plain = ["--plain"] if mode == "--plain" else []
    chat = Chat("--model", f"ollama:{model}", *plain, "--no-tools", env=env, tty=True)
    chats.append(chat)
    chat.expect(f"The model '{model}' is not on the Ollama server at {server.url}. "
                "Pull it now? [Y/n] ")
    chat.send("")  # Enter: yes
    chat.expect("pulling manifest")
    chat.expect(f"pulled {model}")
    chat.expect(BANNER_END)
    assert model not in server.not_pulled
    chat.send("hello")
    chat.expect("answer to hello")  # the chat went on with the pulled model
    wait_for(lambda: bool(chat_requests_for(server, model)), "a chat request")
    if mode != "--plain":
        # The editor is prompting again, idle (in raw mode; its toolbar says so): a Ctrl+D
        # typed while it printed the answer is taken by the terminal and never reaches it.
        chat.expect("Ctrl+D exits")
    chat.close_input()
    assert chat.wait() == 0


@pytest.mark.parametrize(
    ("model", "answer", "said"),
    [
        ("absent-no", "n", "not pulled; aimu pull absent-no fetches it"),
        ("absent-nowhere", "y", "error: cannot pull 'absent-nowhere'"),  # not in a registry
    ],
)
def test_on_a_terminal_a_pull_declined_or_failed_exits_1_with_one_line(
    tmp_path: Path, chats: list[Chat], server: LoopbackServer, model: str, answer: str,
    said: str,
) -> None:
    server.not_pulled.add(model)
    if model == "absent-nowhere":
        server.missing_models.add(model)
    chat = Chat("--model", f"ollama:{model}", "--plain", env=environment(tmp_path, server.url),
                tty=True)
    chats.append(chat)
    chat.expect("Pull it now? [Y/n] ")
    chat.send(answer)
    chat.expect(said)
    assert chat.wait() == 1
    assert model in server.not_pulled and not chat_requests_for(server, model)


def test_a_piped_chat_on_the_responses_wire(server: LoopbackServer, tmp_path: Path) -> None:
    """``--model openai-responses:NAME`` speaks the Responses API, the key kept secret."""
    env = environment(tmp_path, "127.0.0.1:9")
    env.update(OPENAI_BASE_URL=server.openai_base_url, OPENAI_API_KEY="sk-cli-secret-1234")
    done = subprocess.run(
        [sys.executable, "-m", "aimu", "chat", "--model", "openai-responses:gpt-test"],
        input="hello\n", capture_output=True, text=True, timeout=WAIT, env=env, cwd=ROOT,
    )
    assert done.returncode == 0, done
    assert "answer to hello" in done.stdout
    assert "sk-cli-secret-1234" not in done.stdout + done.stderr
    assert any(r.path == "/v1/responses" and r.body["model"] == "gpt-test"
               for r in server.requests)


@pytest.mark.parametrize("spec", ["azure:my-deployment", "azure-responses:my-deployment",
                                  "vertex:gemini-test"])
def test_a_piped_chat_on_a_cloud(server: LoopbackServer, tmp_path: Path, spec: str) -> None:
    """``--model azure:D`` / ``vertex:M`` reach the cloud's door from the environment alone
    (Vertex: the application default credentials' token, issued by the server)."""
    import json

    from aimu.testing.server.clouds import AZURE_KEY, service_account_info

    env = environment(tmp_path, "127.0.0.1:9")
    adc = tmp_path / "adc.json"
    adc.write_text(json.dumps(service_account_info(server.url + "/token")))
    env.update(AZURE_OPENAI_BASE_URL=server.azure_base_url, AZURE_OPENAI_API_KEY=AZURE_KEY,
               GOOGLE_CLOUD_PROJECT="proj-9", GOOGLE_CLOUD_LOCATION="us-east5",
               GOOGLE_VERTEX_BASE_URL=server.url, GOOGLE_APPLICATION_CREDENTIALS=str(adc))
    issued = len(server.clouds.issued)
    done = subprocess.run(
        [sys.executable, "-m", "aimu", "chat", "--model", spec],
        input="hello\n", capture_output=True, text=True, timeout=WAIT, env=env, cwd=ROOT,
    )
    assert done.returncode == 0, done
    assert "answer to hello" in done.stdout
    shown = done.stdout + done.stderr
    assert AZURE_KEY not in shown
    assert not any(token in shown for token in server.clouds.issued)
    last = server.requests[-1]
    if spec.startswith("vertex"):
        assert last.path == ("/v1/projects/proj-9/locations/us-east5/publishers/google/models/"
                             "gemini-test:streamGenerateContent")
        assert len(server.clouds.issued) == issued + 1
    else:
        assert last.path.startswith("/openai/v1/") and last.body["model"] == "my-deployment"


@pytest.mark.parametrize(
    ("spec", "variable"),
    [("openai-responses:m", "OPENAI_BASE_URL"), ("anthropic:m", "ANTHROPIC_BASE_URL"),
     ("gemini:m", "GEMINI_BASE_URL"), ("azure:d", "AZURE_OPENAI_BASE_URL"),
     ("azure-responses:d", "AZURE_OPENAI_BASE_URL"),
     ("vertex:m", "GOOGLE_CLOUD_LOCATION (or GOOGLE_VERTEX_BASE_URL)")],
)
async def test_an_unreachable_responses_server_gets_the_chats_hint(
    spec: str, variable: str
) -> None:
    from aimu import aio
    from aimu.assistant.client import error_line

    # The clouds' own settings besides the URL: a credential, Vertex AI's project.
    clouds = {"azure": {"api_key": "k"}, "azure-responses": {"token": "t"},
              "vertex": {"project": "p", "token": "t"}}
    options = clouds.get(spec.partition(":")[0], {})
    model = aio.client(spec, base_url="http://127.0.0.1:9/v1", retries=0, **options)
    try:
        with pytest.raises(aio.ModelConnectionError) as caught:
            await aio.chat(model, "hi")
    finally:
        await model.aclose()
    line = error_line(caught.value, model)
    assert f"set {variable}, or chat offline with --model test" in line
    assert "base_url=" not in line


async def test_an_unreachable_bedrock_endpoint_gets_the_chats_hint() -> None:
    from aimu import aio
    from aimu.assistant.client import error_line

    model = aio.client("bedrock:m", region=BEDROCK_REGION, base_url="http://127.0.0.1:9",
                       aws_access_key_id=BEDROCK_KEY_ID, aws_secret_access_key=BEDROCK_SECRET,
                       retries=0)
    try:
        with pytest.raises(aio.ModelConnectionError) as caught:
            await aio.chat(model, "hi")
    finally:
        await model.aclose()
    line = error_line(caught.value, model)
    assert "set AWS_REGION (or AWS_ENDPOINT_URL_BEDROCK_RUNTIME), or chat offline" in line
    assert "base_url=" not in line and BEDROCK_SECRET not in line
