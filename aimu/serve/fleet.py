"""``aimu serve --workers N``: N server processes on one port, so one host uses every core.

The parent reserves the port (bound with ``SO_REUSEPORT``, never listening) and starts N
children; each is a whole ``aimu serve`` that binds the same port with ``SO_REUSEPORT``,
so the kernel spreads connections over them. They share Redis (or Temporal) and the
store, which is how any of them answers for a run another one holds. The parent holds
no run and imports no extra: it forwards SIGINT and SIGTERM (a drain) to the children,
starts a new child for one that died, and exits once every child has.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Final

__all__ = ["MAX_WORKERS", "OPTIONS_VARIABLE", "exit_with_parent", "run_fleet", "worker_options"]

#: The environment variable that carries a child's options (JSON): never on its command
#: line, where ``ps`` would show a Redis or database password.
OPTIONS_VARIABLE: Final = "AIMU_SERVE_WORKER"
MAX_WORKERS: Final = 64
#: A child that exits this soon after it started, this many times in a row, stops the
#: fleet: it cannot start (a bad option, a store it cannot open), and would loop.
_QUICK_EXIT: Final = 5.0
_QUICK_EXITS: Final = 3


def worker_options() -> argparse.Namespace | None:
    """The options this process was given as a fleet's child, else None."""
    carried = os.environ.get(OPTIONS_VARIABLE)
    return None if carried is None else argparse.Namespace(**json.loads(carried))


class _Child:
    def __init__(self, member: int, options: dict[str, object]) -> None:
        self.member = member
        env = {**os.environ, OPTIONS_VARIABLE: json.dumps({**options, "fleet_member": member})}
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "aimu.serve._fleet_child"], env=env, stdin=subprocess.DEVNULL,
            process_group=0,
        )


def run_fleet(options: argparse.Namespace, listen: Callable[..., socket.socket]) -> int:
    """Run ``options.workers`` children on one port until SIGINT or SIGTERM; their exit
    status (0 when every child stopped cleanly)."""
    reserved = listen(options.host, options.port, reuse_port=True)
    try:
        carried = {**vars(options), "port": reserved.getsockname()[1], "workers": 1,
                   "fleet_size": options.workers}
        return _Fleet(carried, options.workers).run()
    finally:
        reserved.close()


class _Fleet:
    def __init__(self, options: dict[str, object], size: int) -> None:
        self.options, self.size = options, size
        self.children: list[_Child] = []
        self.stopping: int | None = None  # the signal the fleet was stopped with
        self.quick_exits = 0

    def _stop(self, signum: int, _frame: object) -> None:
        # The children are in a process group of their own (a terminal's Ctrl+C reaches
        # the parent only): each signal is forwarded once, so a second Ctrl+C is a second.
        self.stopping = signum
        for child in self.children:
            if child.process.poll() is None:
                child.process.send_signal(signum)

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.children = [_Child(member, self.options) for member in range(1, self.size + 1)]
            return self._watch()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for child in self.children:  # an error in the parent: no child outlives it
                if child.process.poll() is None:
                    child.process.kill()
                    child.process.wait()

    def _watch(self) -> int:
        statuses: dict[int, int] = {}
        while True:
            for index, child in enumerate(self.children):
                status = child.process.poll()
                if status is None or child.member in statuses:
                    continue
                if self.stopping is not None:
                    statuses[child.member] = status
                    continue
                if time.monotonic() - child.started < _QUICK_EXIT:
                    self.quick_exits += 1
                else:
                    self.quick_exits = 0
                if self.quick_exits >= _QUICK_EXITS:
                    print(f"aimu serve: worker {child.member} exited {_said(status)} "
                          f"{_QUICK_EXITS} times at start; stopping", file=sys.stderr, flush=True)
                    self._stop(signal.SIGTERM, None)
                    statuses[child.member] = status
                    continue
                print(f"aimu serve: worker {child.member} exited {_said(status)}; starting "
                      "another", file=sys.stderr, flush=True)
                self.children[index] = _Child(child.member, self.options)
            if self.stopping is not None and len(statuses) == len(self.children):
                # A child still starting when the signal came ends by it: stopped as asked.
                failed = [status for status in statuses.values()
                          if status not in (0, -self.stopping)]
                return 0 if not failed else (128 - failed[0] if failed[0] < 0 else failed[0])
            time.sleep(0.1)


def _said(status: int) -> str:
    return f"on signal {-status}" if status < 0 else f"with status {status}"


def exit_with_parent(parent: int) -> None:
    """A child whose parent died (kill -9) drains and exits as on SIGTERM: no orphan
    keeps serving a port nobody supervises."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)
