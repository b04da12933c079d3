"""Making what the files store wrote durable: one fsync per file, or one ``syncfs`` for many.

An fsync pays for a journal commit of its own; ``syncfs(2)`` writes back every file of a
filesystem with one. When many logs wait for the disk at once (the batch flusher's pass over
every session written in the last ``fsync_batch_ms``; appends of many agents waiting in fsync
durability), one ``syncfs`` of the data directory's filesystem costs a small part of an fsync of
each: 50 logs of one record each take ~0.2 ms of CPU against ~3.7 ms (bench/store/disk_sync.py).

``syncfs`` is used only where it reports write-back errors (Linux 5.8 and later: before, it
returned 0 whatever happened) and only when ``files.sync_whole_filesystem`` allows it: it also
writes back other programs' unsynced data on that filesystem, which a data directory sharing a
disk with heavy writers may not want to wait for. Elsewhere, and for a single file, each file is
fsynced on its own, as before.

``GroupCommit`` lets callers that must not return before their writes are on disk share one such
pass (group commit): each writes, then waits for a pass that began after its write. When writers
came while a pass ran, the next one waits ``gather_seconds`` (``files.group_commit_wait_ms``) for
more before it syncs: under load each pass then serves several times as many writers.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from contextsvc.core.arrivals import Arrivals

#: the first Linux release whose ``syncfs`` reports write-back errors (per-filesystem errseq).
SYNCFS_ERRORS_SINCE = (5, 8)
#: fewer files than this are fsynced one by one (a single file's fsync writes only that file).
SYNCFS_MIN_FILES = 2
#: how far back ``GroupCommit`` looks to count the files being written (whether to gather).
RECENT_SECONDS = 0.1


def kernel_release_at_least(release: str, wanted: tuple[int, int]) -> bool:
    """Whether a ``uname -r`` string (``6.1.0-18-amd64``) is ``wanted`` (major, minor) or later."""
    found = re.match(r"(\d+)\.(\d+)", release)
    return found is not None and (int(found[1]), int(found[2])) >= wanted


def _load_syncfs() -> Callable[[int], int] | None:
    """libc's ``syncfs`` where it reports write-back errors, else None."""
    if not sys.platform.startswith("linux") or not kernel_release_at_least(os.uname().release, SYNCFS_ERRORS_SINCE):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):  # a libc without it (very old, or not glibc/musl)
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def fsync_paths(paths: Sequence[Path]) -> None:
    """fsync each file through a fresh descriptor (it flushes the file's dirty pages whichever
    descriptor wrote them); a file deleted since it was written is skipped."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class DiskSync:
    """How a files store makes written files durable (blocking calls: run them in a worker thread).

    With ``whole_filesystem`` and a kernel whose ``syncfs`` reports errors, ``open`` keeps a
    descriptor of the data directory for the store's life: ``syncfs`` reports the write-back
    errors of its filesystem seen since that descriptor was opened, so one opened per call could
    miss an error of a write made before it."""

    def __init__(self, root: Path, *, whole_filesystem: bool) -> None:
        self._root = root
        self._syncfs = _load_syncfs() if whole_filesystem else None
        self._fd: int | None = None
        #: ``syncfs`` calls made (each in place of an fsync of two or more files).
        self.filesystem_syncs = 0

    @property
    def whole_filesystem(self) -> bool:
        """Whether passes of several files use one ``syncfs``."""
        return self._fd is not None

    def open(self) -> None:
        if self._syncfs is not None and self._fd is None:
            self._fd = os.open(self._root, os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def sync(self, paths: Sequence[Path]) -> None:
        """Make ``paths`` (written, distinct) durable; raises ``OSError`` if the disk refused."""
        fd, syncfs = self._fd, self._syncfs
        if fd is None or syncfs is None or len(paths) < SYNCFS_MIN_FILES:
            fsync_paths(paths)
            return
        if syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs of {self._root}: {os.strerror(err)}")
        self.filesystem_syncs += 1


class GroupCommit:
    """Writers that return only once their writes are durable share sync passes.

    A writer writes first, then ``await durable(path)``. A pass takes every writer waiting when it
    begins and makes their files durable with one ``sync`` call in a worker thread (one thread hop
    and, with ``DiskSync``, one ``syncfs`` for all of them); writers that come while it runs wait
    for the next one (their writes may have missed it). A failed pass fails each of its writers
    with the error; the next pass tries again for those who come after.

    With ``gather_seconds``, a pass after one that writers came during first waits that long for
    more of them, but only while ``gather_files`` distinct files were written within
    ``RECENT_SECONDS`` of the newest writer (many sessions at once, not a few taking turns)."""

    def __init__(
        self, sync: Callable[[Sequence[Path]], None], *, gather_seconds: float = 0.0, gather_files: int = 1
    ) -> None:
        self._sync = sync
        self._gather = gather_seconds
        self._gather_files = gather_files
        #: the files that waited for a pass lately, and how many did within ``RECENT_SECONDS``
        #: of the newest writer: how many logs (sessions) are being written now.
        self._arrivals = Arrivals()
        self._writing = 0
        self._waiting: list[tuple[Path, asyncio.Future[None]]] = []
        self._runner: asyncio.Task[None] | None = None
        #: passes made, and writers they made durable (``writers / passes``: the group's size).
        self.passes = 0
        self.writers = 0

    async def durable(self, path: Path) -> None:
        """Return once a pass that began after this call made ``path`` durable."""
        if self._gather > 0:
            self._writing = 1 + self._arrivals.note(None, path, time.monotonic(), RECENT_SECONDS)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((path, done))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run(), name="contextsvc-files-group-commit")
        # A writer that goes away cancels only its own future: the pass goes on for the others.
        await done

    async def _run(self) -> None:
        first = True
        while self._waiting:
            if not first and self._gather > 0 and self._writing >= self._gather_files:
                # Writers came while the last pass ran and many files are being written: give more
                # writers a moment to join this pass (fewer passes, each one commit for more of
                # them). The first pass after an idle spell starts at once (a lone writer never
                # waits here); so does every pass while few files are written (a few agents
                # taking turns back to back would only wait longer for each of their turns).
                try:
                    await asyncio.sleep(self._gather)
                except BaseException:  # stopped while gathering: no writer is left waiting
                    stopped, self._waiting = self._waiting, []
                    _settle_all(stopped, OSError("the sync pass was stopped"))
                    raise
            first = False
            batch, self._waiting = self._waiting, []
            paths = list(dict.fromkeys(path for path, _ in batch))
            try:
                await asyncio.to_thread(self._sync, paths)
            except Exception as exc:
                _settle_all(batch, exc)  # every writer of the pass hears of it: none waits forever
                continue
            except BaseException:  # the runner itself is stopped: so is every pass still to come
                batch += self._waiting
                self._waiting = []
                _settle_all(batch, OSError("the sync pass was stopped"))
                raise
            self.passes += 1
            self.writers += len(batch)
            _settle_all(batch, None)

    async def drain(self) -> None:
        """Wait for the passes under way and those already asked for."""
        while self._runner is not None and not self._runner.done():
            await asyncio.shield(self._runner)


def _settle_all(batch: list[tuple[Path, asyncio.Future[None]]], failure: Exception | None) -> None:
    """Tell each writer still waiting (a writer that went away cancelled its own future)."""
    for _, done in batch:
        if done.done():
            continue
        if failure is None:
            done.set_result(None)
        else:
            done.set_exception(failure)
