"""One writer per data directory: an exclusive ``flock`` on ``<data>/lock``.

The files store keeps its state in memory and assumes it is the only process writing the logs
(issue #9: two servers on one directory handed out the same sequence numbers twice). The lock is
taken before anything in the directory is read and held for the life of the store; the kernel
drops it when the process ends, however it ends (kill -9 included), so a stale lock file never
blocks a restart. The file holds the holder's pid and start time, for the error a second
process prints. Other files in the data directory are none of this module's business.

A holder that stops cleanly may leave a note in the file instead of emptying it
(``release(note=...)``; the files store leaves its clean-shutdown seal, ``_seal``). The next holder
reads it (``previous``) before writing its own pid over it, and makes that overwrite durable when
there was a note, so a note never outlives the start that read it, even across a power loss.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
from datetime import UTC, datetime
from pathlib import Path

LOCK_NAME = "lock"


class DataDirLocked(OSError):
    """Another process holds the data directory (its pid and start time in the message)."""


class DataDirLock:
    """An exclusive, non-blocking ``flock`` on ``root/lock``; ``release()`` (or process exit) frees it."""

    __slots__ = ("_fd", "path", "previous")

    def __init__(self, root: Path) -> None:
        self.path = root / LOCK_NAME
        self._fd: int | None = None
        #: what the file held when the lock was taken (a clean-shutdown note, or nothing).
        self.previous = b""

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, *, purpose: str = "serve") -> None:
        """Take the lock or raise ``DataDirLocked`` naming the holder (never waits)."""
        if self._fd is not None:
            return
        fd = _open(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _describe(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DataDirLocked(
                    f"data directory {self.path.parent} is in use by {holder}; one process per directory"
                ) from None
            raise
        try:
            self.previous = os.pread(fd, 4096, 0)
        except OSError:
            self.previous = b""
        try:
            # Only the holder writes the file: truncate after the lock is ours.
            info = {"pid": os.getpid(), "started": datetime.now(UTC).isoformat(), "purpose": purpose}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
            if self.previous:
                os.fdatasync(fd)  # a note read must not come back after a crash of this holder
        except OSError:
            # A read-only directory can still be locked (fsck reads it): the holder note is a courtesy.
            pass
        self._fd = fd

    def release(self, note: bytes = b"") -> None:
        """Free the lock, leaving ``note`` in the file (durably) or the file empty."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            if note:
                os.pwrite(fd, note, 0)
                os.fdatasync(fd)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
    # A read-only directory: lock the existing file read-only (flock does not need write
    # access), or the directory itself when there is no lock file and none can be made.
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return os.open(path.parent, os.O_RDONLY | os.O_CLOEXEC)


def _describe(fd: int) -> str:
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw)
        what = f"pid {int(info['pid'])} (started {info['started']}"
        purpose = info.get("purpose")
        return f"{what}, {purpose})" if purpose else f"{what})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"
