"""Relay stdio to a command and write every line both ways to a log: ``python tee.py LOG
COMMAND [ARGS...]``. Lines to the command start with ``> ``, lines from it with ``< ``, so
a test reads what an MCP server it did not write was sent and answered."""

from __future__ import annotations

import subprocess
import sys
import threading

log_path, command = sys.argv[1], sys.argv[2:]
log = open(log_path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - for the process
lock = threading.Lock()
child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
assert child.stdin is not None and child.stdout is not None


def note(tag: str, line: bytes) -> None:
    with lock:
        log.write(tag + line.decode("utf-8", "replace").rstrip("\n") + "\n")


def to_child() -> None:
    assert child.stdin is not None
    for line in sys.stdin.buffer:
        note("> ", line)
        child.stdin.write(line)
        child.stdin.flush()
    child.stdin.close()  # our stdin closed: so does the server's, and it exits


threading.Thread(target=to_child, daemon=True).start()
for line in child.stdout:
    note("< ", line)
    sys.stdout.buffer.write(line)
    sys.stdout.buffer.flush()
sys.exit(child.wait())
