"""Files and directories private to the user, whatever the umask.

Session data holds conversations: data files are created ``0o600`` and directories
``0o700`` (a umask can only take bits away, never add them). Directory fsync is POSIX
only; on Windows a rename is made durable by the file system itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Final

__all__ = ["FILE_MODE", "O_CLOEXEC", "fsync_dir", "make_private_dirs", "open_private"]

FILE_MODE: Final = 0o600
DIR_MODE: Final = 0o700
#: Not inherited by child processes (absent on Windows, where that is the default).
O_CLOEXEC: Final[int] = getattr(os, "O_CLOEXEC", 0)


def make_private_dirs(directory: Path) -> None:
    """Create ``directory`` and each missing parent with mode ``0o700``."""
    missing: list[Path] = []
    current = directory
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=DIR_MODE)
        except FileExistsError:
            if not path.is_dir():
                raise


def open_private(path: Path, flags: int) -> int:
    """``os.open`` with ``O_CREAT``: a new file gets mode ``0o600``."""
    return os.open(path, flags | os.O_CREAT | O_CLOEXEC, FILE_MODE)


def fsync_dir(directory: Path) -> None:
    """Make a file created or renamed in ``directory`` durable (a no-op on Windows)."""
    if sys.platform == "win32":
        return
    fd = os.open(directory, os.O_RDONLY | O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
