"""Background fsync for append-only files: the event loop never waits for the disk.

``append`` writes a line and returns (it is in the OS page cache: safe from ``kill
-9``); one thread per store then fsyncs, coalescing the lines of a few milliseconds
into one fsync. A file handed over for closing is fsynced one last time and closed here.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Final

from aimu.aio.errors import StoreError
from aimu.aio.store._files import fsync_dir

__all__ = ["DataFile", "FileSyncer"]

#: Seconds the fsync thread lets lines gather before syncing them together.
_SYNC_GATHER: Final = 0.002


class FileSyncer:
    """One background thread per store that fsyncs appended files, in order.

    ``append`` writes and returns (the line is in the OS page cache: safe from
    ``kill -9``); this thread then fsyncs, coalescing the lines of a few milliseconds
    into one fsync, so the event loop never waits for the disk. A file handed over for
    closing is fsynced one last time and closed here.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._pending: dict[DataFile, None] = {}  # an ordered set
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._idle = False

    def request(self, file: DataFile) -> None:
        with self._cond:
            if self._stopping:
                raise StoreError(f"{self._name} is closed")
            self._pending[file] = None
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"aimu-fsync {self._name}", daemon=True
                )
                self._thread.start()
            elif self._idle:
                self._cond.notify()

    def wait(self, file: DataFile) -> None:
        with self._cond:
            while file.synced < file.written and file.error is None:
                if file not in self._pending and self._thread is None:
                    break
                self._cond.wait()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._idle = True
                    self._cond.wait()
                    self._idle = False
                if not self._pending:
                    return
            # Let lines gather: one wake-up (and GIL hand-off) per batch, not per line.
            if not self._stopping:
                time.sleep(_SYNC_GATHER)
            with self._cond:
                batch = list(self._pending)
                self._pending.clear()
            for file in batch:
                target = file.written  # lines written before this fsync starts
                error: OSError | None = None
                if target > file.synced or file.dir_dirty:
                    try:
                        if file.dir_dirty:
                            file.dir_dirty = False
                            fsync_dir(file.path.parent)
                        os.fsync(file.fd)
                    except OSError as failure:
                        error = failure
                with self._cond:
                    file.synced = max(file.synced, target)
                    if error is not None and file.error is None:
                        file.error = error
                    if file.closing and not file.closed and file.synced >= file.written:
                        file.closed = True
                        with contextlib.suppress(OSError):
                            os.close(file.fd)
                    self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None:
            thread.join()



class DataFile:
    """An append-only file descriptor and how much of it is known to be on disk."""

    __slots__ = ("closed", "closing", "dir_dirty", "error", "fd", "path", "synced", "written")

    def __init__(self, path: Path, fd: int, *, dir_dirty: bool) -> None:
        self.path = path
        self.fd = fd
        self.written = 0  # lines written, counted after each write() returned
        self.synced = 0  # lines known fsynced
        self.error: OSError | None = None
        self.closing = False
        self.closed = False
        self.dir_dirty = dir_dirty


