"""Start an MCP server tied to this launcher's parent: when the parent dies, the server goes.

Run as ``python -I _launcher.py PARENT_PID COMMAND [ARGS...]`` by :class:`MCPServer`.
It starts COMMAND as its child in its own process group (the SDK gives the launcher a
new session), with stdin, stdout and stderr inherited, and exits with its status. When
its parent dies -- even by ``kill -9`` -- it hears of it (Linux: ``PR_SET_PDEATHSIG``;
elsewhere: ``getppid()`` watched) and stops the whole group, the server's own children
too. A SIGTERM to it does the same. The standard library only: it starts in ~20 ms.
"""

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

_GRACE_SECONDS = 2.0
_PR_SET_PDEATHSIG = 1


def _stop_group(child: "subprocess.Popen[bytes]") -> None:
    """SIGTERM to the group (or the child alone), SIGKILL after a grace period; exit."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    own_group = os.getpgrp() == os.getpid()
    try:
        if own_group:
            os.killpg(os.getpid(), signal.SIGTERM)
        else:
            child.terminate()
        child.wait(_GRACE_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        if own_group:
            os.killpg(os.getpid(), signal.SIGKILL)  # the launcher goes with its group
        else:
            child.kill()
    except OSError:
        pass
    os._exit(143)


def _watch_parent(parent: int, child: "subprocess.Popen[bytes]") -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    _stop_group(child)


def main() -> int:
    parent, command = int(sys.argv[1]), sys.argv[2:]
    tied = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            tied = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
        except (OSError, AttributeError):
            tied = False
    if os.getppid() != parent:
        return 1  # the parent died before the tie was made
    try:
        child = subprocess.Popen(command)
    except OSError as error:
        sys.stderr.write(f"cannot start {command[0]!r}: {error.strerror or error}\n")
        return 127
    signal.signal(signal.SIGTERM, lambda _signum, _frame: _stop_group(child))
    signal.signal(signal.SIGHUP, lambda _signum, _frame: _stop_group(child))
    if not tied:
        threading.Thread(target=_watch_parent, args=(parent, child), daemon=True).start()
    if os.getppid() != parent:  # it died between the tie and the child's start
        _stop_group(child)
    status = child.wait()
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main())
