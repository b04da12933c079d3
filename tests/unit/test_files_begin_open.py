"""``FilesStore.begin_open`` and the entry point's paused collector (issue #9, start-up time).

``serve`` starts reading the data directory in a thread while it imports the server's modules;
what ``open`` then has must be exactly what an ``open`` alone reads, the directory's lock must be
taken before anything is read and released when the read fails, and a second server must be
refused the same way as before.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from contextsvc import cli
from contextsvc.config import Durability, Settings
from contextsvc.stores._dirlock import DataDirLocked
from contextsvc.stores.files import FilesStore
from tests.support.stores import TickingClock
from tests.unit.test_files_lazy import ALICE, listing, make_sessions, user


def new_store(root: Path) -> FilesStore:
    return FilesStore(root, Settings(durability=Durability.FSYNC), clock=TickingClock())


async def test_a_store_read_in_the_background_holds_what_an_open_alone_reads(tmp_path: Path) -> None:
    root = tmp_path / "data"
    first = new_store(root)
    await first.open()
    sids = await make_sessions(first, 6, 4)
    await first.close()

    alone = new_store(root)
    await alone.open()
    expected = await listing(alone)
    expected_rows = [[m.content for m in await alone.load_context(sid, caller=ALICE)] for sid in sids]
    await alone.close()

    early = new_store(root)
    early.begin_open()
    early.begin_open()  # a second call changes nothing
    await early.open()
    try:
        assert early.stats.index_hits == 6 and early.stats.logs_read_at_open == 0
        assert await listing(early) == expected
        rows = [[m.content for m in await early.load_context(sid, caller=ALICE)] for sid in sids]
        assert rows == expected_rows
        appended = await early.append_messages(sids[0], [user("after")], caller=ALICE, request_id="after")
        assert appended.sequence_numbers == [5]
    finally:
        await early.close()


async def test_the_lock_is_taken_in_the_background_and_a_second_store_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "data"
    owner = new_store(root)
    owner.begin_open()
    await owner.open()
    try:
        second = new_store(root)
        second.begin_open()
        with pytest.raises(DataDirLocked):
            await second.open()
        sid = (await owner.create_session(caller=ALICE, profile_id="p", name="kept")).id
    finally:
        await owner.close()
    after = new_store(root)
    after.begin_open()
    await after.open()
    try:
        assert [s.id for s in (await listing(after))[0]] == [sid]
    finally:
        await after.close()


async def test_a_failed_background_read_releases_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "data"
    broken = new_store(root)

    def fail() -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(broken, "_load_all_unswept", fail)
    broken.begin_open()
    with pytest.raises(OSError, match="disk gone"):
        await broken.open()
    again = new_store(root)
    await again.open()  # not refused: the failed read let the lock go
    await again.close()


def test_commands_other_than_serve_run_with_the_collector_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gc.disable()  # as the entry point does
    try:
        assert cli.main(["config"]) == 0
        assert gc.isenabled()
    finally:
        gc.enable()
    assert '"store"' in capsys.readouterr().out


def test_only_serve_keeps_the_collector_paused() -> None:
    assert cli._serves(["serve", "--listen", "127.0.0.1:0"])
    assert cli._serves(["--version"]) is False
    assert cli._serves(["fsck", "--repair"]) is False
    assert cli._serves(["config"]) is False
