"""The files store's clean-shutdown seal (``stores/_seal.py``): after a clean stop the start-up
index is taken without a look at each log, and a log changed while no server ran is still found
(in the background once serving, or at once by the read that needs it)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

import contextsvc.stores.files as files_module
from contextsvc.config import FilesSettings
from contextsvc.stores._seal import read_seal
from contextsvc.stores.files import FilesStore
from tests.unit.test_files_store import ALICE, log_of, mark_of, opened, session_with, user


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "data"


def _no_scan(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every directory scan of the sessions folder made at open."""
    scans: list[str] = []
    real = FilesStore._session_logs

    def counting(self: FilesStore, **kw: object) -> object:
        scans.append("scan")
        return real(self, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(FilesStore, "_session_logs", counting)
    return scans


async def _three_sessions(root: Path) -> list[str]:
    store = await opened(root)
    sids = [await session_with(store, n) for n in (2, 3, 4)]
    await store.close()
    return sids


async def test_a_clean_stop_seals_and_the_next_open_reads_no_log(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sids = await _three_sessions(root)
    assert read_seal((root / "lock").read_bytes()) is not None
    scans = _no_scan(monkeypatch)
    store = await opened(root)
    assert store.stats.sealed_open and scans == [] and store.stats.logs_read_at_open == 0
    # The seal is gone from the lock file as soon as the store holds it (a crash now leaves none).
    assert read_seal((root / "lock").read_bytes()) is None
    await asyncio.wait_for(store.startup_verified(), 10)
    assert store.stats.logs_verified == 3 and store.stats.logs_changed_after_seal == 0
    assert [(await store.get_session(s, caller=ALICE)).last_sequence for s in sids] == [2, 3, 4]
    assert (await store.append_messages(sids[0], [user("more")], caller=ALICE)).sequence_numbers == [3]
    await store.close()
    again = await opened(root)  # sealed again by that clean stop, with the new message
    assert again.stats.sealed_open
    assert (await again.get_session(sids[0], caller=ALICE)).last_sequence == 3
    await again.close()


async def test_without_a_clean_stop_every_log_is_looked_at(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    await _three_sessions(root)
    crashed = await opened(root)  # takes the seal, then "crashes": never closed, lock dropped
    crashed._dir_lock.release()
    scans = _no_scan(monkeypatch)
    store = await opened(root)
    assert not store.stats.sealed_open and scans == ["scan"]
    await store.close()


async def test_a_log_removed_while_stopped_breaks_the_seal(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sids = await _three_sessions(root)
    log_of(root, sids[1]).unlink()
    mark_of(root, sids[1]).unlink()
    scans = _no_scan(monkeypatch)
    store = await opened(root)
    assert not store.stats.sealed_open and scans == ["scan"]
    listed = await store.list_sessions(caller=ALICE, offset=0, limit=10)
    assert {s.id for s in listed.sessions} == {sids[0], sids[2]}
    await store.close()


async def test_an_index_changed_while_stopped_breaks_the_seal(root: Path) -> None:
    await _three_sessions(root)
    index = root / "index.jsonl"
    index.write_bytes(index.read_bytes())  # same bytes, another write: its ctime moved
    store = await opened(root)
    assert not store.stats.sealed_open
    await store.close()


async def test_a_log_rolled_back_while_stopped_is_found_in_the_background(root: Path) -> None:
    sids = await _three_sessions(root)
    target = sids[2]
    before = log_of(root, target).read_bytes()
    store = await opened(root)
    await store.startup_verified()  # as a serving server does, so that its stop seals again
    await store.append_messages(target, [user("acknowledged, then its log was restored")], caller=ALICE)
    await store.close()
    # The log rolled back to its earlier content (same name: the folder's times do not move), the
    # mark kept, as a careless restore from a copy would leave it.
    log_of(root, target).write_bytes(before)
    store = await opened(root)
    assert store.stats.sealed_open  # the seal says nothing of a log's content
    await asyncio.wait_for(store.startup_verified(), 10)
    assert store.stats.logs_changed_after_seal == 1
    assert store.damage_changed.is_set()  # the health service is told at once
    # Read whole as an open without the seal reads it: the mark says 5 was acknowledged, the log
    # holds 4, so number 5 is lost (and stays taken), and the session is damaged.
    info = await store.get_session(target, caller=ALICE)
    assert info.last_sequence == 5
    assert (await store.health_check()).damaged_sessions == 1
    await store.close()


async def test_get_session_checks_its_log_before_the_background_does(root: Path) -> None:
    sids = await _three_sessions(root)
    target = sids[0]
    older = log_of(root, target).read_bytes(), mark_of(root, target).read_bytes()
    store = await opened(root)
    await store.startup_verified()
    await store.append_messages(target, [user("third")], caller=ALICE)
    await store.close()
    # An older, consistent copy of the session restored by hand (log and mark): 2 messages.
    log_of(root, target).write_bytes(older[0])
    mark_of(root, target).write_bytes(older[1])
    loop = asyncio.get_running_loop()
    gate = asyncio.Event()
    real = files_module._log_keys

    def held(folder: Path, ids: list[str]) -> list[object]:
        if len(ids) > 1:  # the background check waits until the test has read its session
            asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(10)
        return real(folder, ids)  # type: ignore[return-value]

    files_module._log_keys = held  # type: ignore[assignment]
    try:
        store = await opened(root)
        assert store.stats.sealed_open
        info = await store.get_session(target, caller=ALICE)
        assert info.last_sequence == 2 and info.display_message_count == 2
        gate.set()
        await asyncio.wait_for(store.startup_verified(), 10)
        assert store.stats.logs_changed_after_seal == 1
        assert (await store.append_messages(target, [user("next")], caller=ALICE)).sequence_numbers == [3]
        await store.close()
    finally:
        files_module._log_keys = real


async def test_a_damaged_session_prevents_the_seal(root: Path) -> None:
    sids = await _three_sessions(root)
    path = log_of(root, sids[1])
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b"m2", b"m9")  # a changed byte: message 2 fails its check
    path.write_bytes(b"\n".join(lines))
    os.utime(root / "sessions")  # and break the seal, as a crash would
    (root / "lock").write_bytes(b"")
    store = await opened(root)
    assert (await store.health_check()).damaged_sessions == 1
    await store.close()
    assert read_seal((root / "lock").read_bytes()) is None  # damaged sessions are read at every start


async def test_the_background_check_waits_for_the_server_to_serve(root: Path) -> None:
    await _three_sessions(root)
    store = await opened(root, files=FilesSettings(verify_delay_seconds=60))
    assert store.stats.sealed_open
    await asyncio.sleep(0.2)  # the start goes on: nothing is checked before the server serves
    assert store.stats.logs_verified == 0
    store.begin_checks()  # what the server calls once it reports SERVING
    await asyncio.wait_for(store._verified.wait(), 10)
    assert store.stats.logs_verified == 3
    await store.close()


async def test_a_stop_before_the_logs_were_checked_leaves_no_seal(root: Path) -> None:
    await _three_sessions(root)
    store = await opened(root, files=FilesSettings(verify_delay_seconds=60))
    assert store.stats.sealed_open and store.stats.logs_verified == 0
    await store.close()  # the background check never ran: the index was not checked this time
    assert read_seal((root / "lock").read_bytes()) is None
    again = await opened(root)
    assert not again.stats.sealed_open and again.stats.logs_read_at_open == 0  # every key matched
    await again.close()
    assert read_seal((root / "lock").read_bytes()) is not None
