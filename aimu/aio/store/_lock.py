"""The write lock of one session in a local store: an OS lock on ``<session>.lock``.

The OS drops the lock when the holder dies (even ``kill -9``), so the next process can
always take over. POSIX uses ``flock`` (which belongs to an open file, so a second lock
in the same process conflicts too); Windows uses ``msvcrt.locking`` on the first byte.
Each is imported only where it is used, so the package imports on every platform.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from pathlib import Path

from aimu.aio.errors import SessionLockedError, StoreError
from aimu.aio.store._files import open_private
from aimu.aio.store._report import note_locked

__all__ = ["SessionLock"]

_BUSY = frozenset({errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES, errno.EDEADLK})


def _try_lock(fd: int) -> None:
    """Lock ``fd`` exclusively without waiting; ``OSError`` if another holder has it."""
    if sys.platform == "win32":
        import msvcrt

        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    else:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


class SessionLock:
    """An exclusive OS lock on ``<directory>/<session>.lock``, taken on construction.

    The holder's pid is written into the file (after the locked first byte), only to
    name it in the error a second writer gets.
    """

    __slots__ = ("_fd", "path", "session")

    def __init__(self, directory: Path, session: str) -> None:
        self.session = session
        self.path = directory / f"{session}.lock"
        self._fd: int | None = None
        while True:
            fd = open_private(self.path, os.O_RDWR)
            try:
                _try_lock(fd)
            except OSError as error:
                holder = _read_holder(fd)
                os.close(fd)
                if error.errno not in _BUSY:
                    raise StoreError(
                        f"session {session!r}: cannot lock {self.path}: {error}"
                    ) from error
                note_locked(session, holder)
                raise SessionLockedError(
                    f"session {session!r} is already open for writing by {holder} "
                    f"(lock file {self.path}); close that writer first. Reading the session "
                    "with store.load() is always allowed."
                ) from None
            # delete() unlinks lock files while holding them: make sure we locked the
            # file that is at the path now, not one that was just removed.
            try:
                current = os.stat(self.path)
            except FileNotFoundError:
                os.close(fd)
                continue
            mine = os.fstat(fd)
            if (mine.st_dev, mine.st_ino) != (current.st_dev, current.st_ino):
                os.close(fd)
                continue
            _write_holder(fd)
            self._fd = fd
            return

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, *, unlink: bool = False) -> None:
        """Give the lock up (closing the file releases it); ``unlink`` removes the file."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if unlink:
                with contextlib.suppress(FileNotFoundError, PermissionError):
                    os.unlink(self.path)
            else:
                os.ftruncate(fd, 1)
        finally:
            os.close(fd)


def _write_holder(fd: int) -> None:
    os.ftruncate(fd, 1)
    os.lseek(fd, 1, os.SEEK_SET)
    os.write(fd, f"{os.getpid()}\n".encode())


def _read_holder(fd: int) -> str:
    try:
        os.lseek(fd, 1, os.SEEK_SET)
        pid = int(os.read(fd, 32).decode().strip() or "0")
    except (OSError, ValueError):
        pid = 0
    if pid == os.getpid():
        return "another writer in this process"
    return f"process {pid}" if pid else "another process"
