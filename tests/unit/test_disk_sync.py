"""Making the files store's writes durable: one syncfs for many logs, and fsync durability's
writers sharing sync passes (group commit)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from contextsvc.config import Durability, FilesSettings, Settings
from contextsvc.core.messages import Message, Role
from contextsvc.core.session import Principal
from contextsvc.errors import Unavailable
from contextsvc.stores._disk_sync import (
    SYNCFS_ERRORS_SINCE,
    DiskSync,
    GroupCommit,
    kernel_release_at_least,
)
from contextsvc.stores._frames import read_mark
from contextsvc.stores.files import FilesStore
from tests.support.stores import TickingClock

ALICE = Principal(user_id="alice")
#: this machine's kernel lets syncfs report write errors (else every pass fsyncs file by file)
SYNCFS_HERE = sys.platform.startswith("linux") and kernel_release_at_least(os.uname().release, SYNCFS_ERRORS_SINCE)


@pytest.mark.parametrize(
    ("release", "expected"),
    [
        ("6.18.44-fc-v1147", True),
        ("5.8.0", True),
        ("5.10.0-28-amd64", True),
        ("5.7.19", False),
        ("4.19.0-26-cloud-amd64", False),
        ("10.0", True),
        ("5", False),
        ("x.y", False),
        ("", False),
    ],
)
def test_kernel_release_parsing(release: str, expected: bool) -> None:
    assert kernel_release_at_least(release, (5, 8)) is expected


def _written(folder: Path, n: int) -> list[Path]:
    paths = []
    for i in range(n):
        path = folder / f"log{i}.jsonl"
        path.write_bytes(b"line\n")
        paths.append(path)
    return paths


@pytest.mark.skipif(not SYNCFS_HERE, reason="syncfs reports errors only on Linux 5.8 or later")
def test_two_or_more_files_take_one_filesystem_sync(tmp_path: Path, fsynced: list[str]) -> None:
    disk = DiskSync(tmp_path, whole_filesystem=True)
    disk.open()
    try:
        assert disk.whole_filesystem
        disk.sync(_written(tmp_path, 3))
        assert fsynced == [] and disk.filesystem_syncs == 1
        (one,) = _written(tmp_path / "..", 1)  # a single file: its own fsync writes only it
        disk.sync([one])
        assert fsynced == [str(one.resolve())] and disk.filesystem_syncs == 1
    finally:
        disk.close()
    assert not disk.whole_filesystem


def test_without_the_setting_each_file_is_fsynced(tmp_path: Path, fsynced: list[str]) -> None:
    disk = DiskSync(tmp_path, whole_filesystem=False)
    disk.open()
    paths = _written(tmp_path, 3)
    disk.sync([*paths, tmp_path / "deleted-since"])  # a file deleted since it was written is skipped
    disk.close()
    assert fsynced == [str(p.resolve()) for p in paths] and disk.filesystem_syncs == 0


@pytest.mark.skipif(not SYNCFS_HERE, reason="syncfs reports errors only on Linux 5.8 or later")
def test_a_failed_filesystem_sync_is_an_os_error(tmp_path: Path) -> None:
    disk = DiskSync(tmp_path, whole_filesystem=True)
    disk.open()

    def refusing(fd: int) -> int:
        ctypes.set_errno(5)
        return -1

    disk._syncfs = refusing
    try:
        with pytest.raises(OSError, match="syncfs") as caught:
            disk.sync(_written(tmp_path, 2))
        assert caught.value.errno == 5
    finally:
        disk.close()


# -- group commit ---------------------------------------------------------------------------------


class _Passes:
    """A sync function that records each pass's files and can be held inside a pass."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail: BaseException | None = None

    def __call__(self, paths: Sequence[Path]) -> None:
        self.calls.append([p.name for p in paths])
        self.entered.set()
        self.release.wait(10)
        if self.fail is not None:
            failure, self.fail = self.fail, None
            raise failure


async def test_writers_waiting_together_share_one_pass(tmp_path: Path) -> None:
    passes = _Passes()
    group = GroupCommit(passes)
    names = ["a", "b", "a", "c", "b"]
    await asyncio.gather(*(group.durable(tmp_path / n) for n in names))
    assert passes.calls == [["a", "b", "c"]]  # one pass, each file once
    assert (group.passes, group.writers) == (1, 5)


async def test_a_writer_that_comes_during_a_pass_waits_for_the_next(tmp_path: Path) -> None:
    passes = _Passes()
    passes.release.clear()
    group = GroupCommit(passes)
    first = asyncio.ensure_future(group.durable(tmp_path / "a"))
    await asyncio.to_thread(passes.entered.wait, 10)
    second = asyncio.ensure_future(group.durable(tmp_path / "b"))  # its write may have missed pass 1
    await asyncio.sleep(0.01)
    assert not first.done() and not second.done()
    passes.release.set()
    await first
    await second
    assert passes.calls == [["a"], ["b"]]
    assert group.passes == 2


async def _one_came_during_a_pass(group: GroupCommit, passes: _Passes, tmp_path: Path) -> asyncio.Future[None]:
    """Writer "a" starts a pass that is held; "b" comes during it; the pass ends. Returns b's wait."""
    passes.release.clear()
    first = asyncio.ensure_future(group.durable(tmp_path / "a"))
    await asyncio.to_thread(passes.entered.wait, 10)
    second = asyncio.ensure_future(group.durable(tmp_path / "b"))
    await asyncio.sleep(0.01)
    passes.release.set()
    await first
    return second


@pytest.mark.parametrize(("gather", "expected"), [(0.0, [["a"], ["b"], ["c"]]), (0.5, [["a"], ["b", "c"]])])
async def test_a_gather_wait_lets_writers_that_come_just_after_a_pass_share_the_next(
    tmp_path: Path, gather: float, expected: list[list[str]]
) -> None:
    """Writers came during a pass (others are writing): the next pass waits ``gather`` for more."""
    passes = _Passes()
    group = GroupCommit(passes, gather_seconds=gather)
    second = await _one_came_during_a_pass(group, passes, tmp_path)
    third = asyncio.ensure_future(group.durable(tmp_path / "c"))  # just after pass 1 ended
    await asyncio.gather(second, third)
    assert passes.calls == expected
    assert (group.passes, group.writers) == (len(expected), 3)


@pytest.mark.parametrize(("files", "expected"), [(3, [["a"], ["b"], ["c"]]), (2, [["a"], ["b", "c"]])])
async def test_a_pass_waits_only_while_many_files_are_written(
    tmp_path: Path, files: int, expected: list[list[str]]
) -> None:
    """Writers came during a pass, but only two files are being written: with ``gather_files`` 3
    the next pass starts at once (a few agents would only wait longer), with 2 it gathers."""
    passes = _Passes()
    group = GroupCommit(passes, gather_seconds=0.5, gather_files=files)
    second = await _one_came_during_a_pass(group, passes, tmp_path)
    third = asyncio.ensure_future(group.durable(tmp_path / "c"))  # a third file, after pass 2 began
    await asyncio.gather(second, third)
    assert passes.calls == expected


async def test_writers_gathering_when_the_group_is_stopped_hear_of_it(tmp_path: Path) -> None:
    passes = _Passes()
    group = GroupCommit(passes, gather_seconds=30.0)
    second = await _one_came_during_a_pass(group, passes, tmp_path)
    await asyncio.sleep(0.05)  # the runner now waits for more writers (30 s)
    assert not second.done()
    runner = group._runner
    assert runner is not None
    runner.cancel()
    with pytest.raises(OSError, match="stopped"):
        await asyncio.wait_for(second, 5)
    assert passes.calls == [["a"]]


async def test_a_lone_writer_never_waits_for_the_gather(tmp_path: Path) -> None:
    passes = _Passes()
    group = GroupCommit(passes, gather_seconds=30.0)
    for name in "ab":  # one after the other: each finds the group idle
        await asyncio.wait_for(group.durable(tmp_path / name), 5)
    assert passes.calls == [["a"], ["b"]]


async def test_a_failed_pass_fails_its_writers_and_the_next_pass_works(tmp_path: Path) -> None:
    passes = _Passes()
    passes.fail = OSError(28, "No space left on device")
    group = GroupCommit(passes)
    results = await asyncio.gather(*(group.durable(tmp_path / n) for n in "ab"), return_exceptions=True)
    assert all(isinstance(r, OSError) and r.errno == 28 for r in results)
    await group.durable(tmp_path / "c")
    assert passes.calls == [["a", "b"], ["c"]] and group.passes == 1


async def test_a_writer_that_goes_away_does_not_stop_the_pass(tmp_path: Path) -> None:
    passes = _Passes()
    passes.release.clear()
    group = GroupCommit(passes)
    leaving = asyncio.ensure_future(group.durable(tmp_path / "a"))
    staying = asyncio.ensure_future(group.durable(tmp_path / "b"))
    await asyncio.to_thread(passes.entered.wait, 10)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    passes.release.set()
    await staying
    await group.drain()
    assert passes.calls == [["a", "b"]] and (group.passes, group.writers) == (1, 2)


async def test_an_unexpected_failure_reaches_every_writer(tmp_path: Path) -> None:
    """Whatever stops a pass (not only a disk error), no writer is left waiting forever."""
    passes = _Passes()
    passes.fail = RuntimeError("cannot schedule new futures after shutdown")
    group = GroupCommit(passes)
    results = await asyncio.gather(*(group.durable(tmp_path / n) for n in "ab"), return_exceptions=True)
    assert [type(r) for r in results] == [RuntimeError, RuntimeError]


# -- the files store ------------------------------------------------------------------------------


async def _store(root: Path, durability: Durability = Durability.FSYNC, **files: Any) -> FilesStore:
    store = FilesStore(root, Settings(durability=durability, files=FilesSettings(**files)), clock=TickingClock())
    await store.open()
    return store


async def test_concurrent_appends_in_fsync_durability_share_passes_and_survive(tmp_path: Path) -> None:
    root = tmp_path / "data"
    store = await _store(root)
    sids = [(await store.create_session(caller=ALICE, profile_id="p")).id for _ in range(20)]
    before = store._group.passes
    for turn in range(3):
        await asyncio.gather(
            *(store.append_messages(sid, [Message(Role.USER, f"{sid[:4]} {turn}")], caller=ALICE) for sid in sids)
        )
    passes = store._group.passes - before
    assert 3 <= passes < 30  # 60 durable appends in far fewer passes
    assert store.stats.log_fsyncs >= 60
    if SYNCFS_HERE:
        assert store._disk.filesystem_syncs >= 1
    await store.close()
    reopened = await _store(root)
    for sid in sids:
        rows = await reopened.load_context(sid, caller=ALICE)
        assert [m.content for m in rows] == [f"{sid[:4]} {t}" for t in range(3)]
    assert reopened.stats.recovered_logs == 0
    await reopened.close()


async def test_the_files_settings_shape_the_group_commit(tmp_path: Path) -> None:
    store = await _store(tmp_path / "data", group_commit_wait_ms=5, group_commit_min_logs=3)
    try:
        assert (store._group._gather, store._group._gather_files) == (0.005, 3)
    finally:
        await store.close()


async def test_an_append_whose_sync_fails_is_unavailable_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The line is written before its pass: when the pass fails, the append fails, memory does not
    take it, its mark is not raised, and the next append writes over it, so a reload shows only
    what was acknowledged (and no damage)."""
    root = tmp_path / "data"
    store = await _store(root)
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(sid, [Message(Role.USER, "kept")], caller=ALICE)
    real = store._group._sync

    def refused(paths: Sequence[Path]) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store._group, "_sync", refused)
    with pytest.raises(Unavailable):
        await store.append_messages(sid, [Message(Role.USER, "lost")], caller=ALICE)
    monkeypatch.setattr(store._group, "_sync", real)
    info = await store.get_session(sid, caller=ALICE)
    assert info.last_sequence == 1
    mark = read_mark(root / "sessions" / f"{sid}.jsonl.mark")
    assert mark is not None and mark[0] == 1  # never claims the append that failed
    assert (await store.append_messages(sid, [Message(Role.USER, "next")], caller=ALICE)).sequence_numbers == [2]
    await store.close()
    reopened = await _store(root)
    assert [m.content for m in await reopened.load_context(sid, caller=ALICE)] == ["kept", "next"]
    assert reopened.stats.recovered_logs == 0
    # Not damaged (a mark above the log's rows would make it read-only): it takes appends.
    assert (await reopened.append_messages(sid, [Message(Role.USER, "more")], caller=ALICE)).sequence_numbers == [3]
    await reopened.close()


async def test_the_batch_flusher_syncs_many_logs_at_once(tmp_path: Path, fsynced: list[str]) -> None:
    async def never(seconds: float) -> None:
        await asyncio.Event().wait()

    root = tmp_path / "data"
    store = FilesStore(root, Settings(durability=Durability.BATCH), clock=TickingClock(), sleep=never)
    await store.open()
    sids = [(await store.create_session(caller=ALICE, profile_id="p")).id for _ in range(4)]
    for sid in sids:
        await store.append_messages(sid, [Message(Role.USER, "m")], caller=ALICE)
    assert store.pending_fsync == 4
    fsynced.clear()
    await store.flush()
    assert store.pending_fsync == 0 and store.stats.log_fsyncs == 4
    if SYNCFS_HERE:
        assert fsynced == [] and store._disk.filesystem_syncs == 1
    else:
        assert len(fsynced) == 4
    await store.close()
