"""Reading the chat's input lines from standard input in a thread (the plain mode)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import sys
import threading
from collections.abc import Callable

__all__ = ["StdinReader"]


class StdinReader:
    """Reads stdin lines in a daemon thread (pipes, ttys, files, /dev/null) and posts them
    to the loop; :meth:`stop` ends the thread once serving ends, so that it neither stays
    blocked on stdin nor takes lines meant for whatever reads stdin next (POSIX: the
    thread waits in ``select`` on stdin and a wake-up pipe; elsewhere it stays blocked
    in its read until a line or EOF comes, and then ends without taking it)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        submit: Callable[[str], None],
        end_input: Callable[[], None],
    ) -> None:
        self._loop = loop
        self._submit = submit
        self._end_input = end_input
        self._stopped = False
        self._wake: tuple[int, int] | None = None
        self.thread = threading.Thread(target=self._run, name="aimu-chat-stdin", daemon=True)

    def start(self) -> None:
        if sys.platform != "win32":
            self._wake = os.pipe()
        self.thread.start()

    def stop(self) -> None:
        """Serving ended: the thread reads no more (call on the loop's thread)."""
        self._stopped = True
        wake, self._wake = self._wake, None
        if wake is not None:
            with contextlib.suppress(OSError):
                os.write(wake[1], b"x")
            os.close(wake[1])  # the thread closes the read end as it ends

    def _post(self, callback: Callable[..., None], *args: object) -> bool:
        if self._stopped:
            return False
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            return False
        return True

    def _readable(self, fd: int) -> bool:
        """Wait until ``fd`` has input (True) or :meth:`stop` was called (False)."""
        wake = self._wake
        if wake is None:
            return not self._stopped
        ready, _, _ = select.select([fd, wake[0]], [], [])
        return wake[0] not in ready and not self._stopped

    def _run(self) -> None:
        wake = self._wake
        try:
            self._read()
        finally:
            if wake is not None:
                os.close(wake[0])

    def _read(self) -> None:
        try:
            fd = sys.stdin.fileno() if sys.stdin is not None else -1
        except (OSError, ValueError):
            fd = -1
        pending = b""
        try:
            while fd >= 0 and self._readable(fd):
                # os.read, not sys.stdin: it holds no lock that interpreter exit would need.
                data = os.read(fd, 65536)
                if not data:
                    break
                pending += data
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    if not self._post(self._submit, raw.decode(errors="replace")):
                        return
            if pending:
                self._post(self._submit, pending.decode(errors="replace"))
        except OSError:
            pass
        self._post(self._end_input)
