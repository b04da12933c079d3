"""What only the files store has: its logs on disk, recovery on load, rewrites, durability modes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import hypothesis
import pytest
from hypothesis import given
from hypothesis import strategies as st

import contextsvc.stores._log_records as log_records
import contextsvc.stores.files as files_module
from contextsvc.config import Durability, FilesSettings, Settings
from contextsvc.core.calibration import Observation
from contextsvc.core.messages import BufferKind, Flags, Message, Role
from contextsvc.core.priors import CYRILLIC_FEATURES, LEGACY_FEATURES, N_FEATURES, PREVIOUS_FEATURES
from contextsvc.core.session import Principal
from contextsvc.errors import InvalidArgument, NotFound, SessionDamaged, Unavailable
from contextsvc.stores._dirlock import DataDirLocked
from contextsvc.stores._session import LOST_KEY, AppendRecord
from contextsvc.stores.files import FilesStore
from tests.conformance.helpers import view
from tests.support.stores import TickingClock

ALICE = Principal(user_id="alice")


def user(content: str) -> Message:
    return Message(role=Role.USER, content=content)


def summary(content: str, anchor: int) -> Message:
    return Message(
        role=Role.USER, content=content, flags=Flags(is_summary=True, is_display=False), context_anchor=anchor
    )


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "data"


def settings(**kw: Any) -> Settings:
    return Settings(**{"durability": Durability.FSYNC, **kw})


async def opened(root: Path, **kw: Any) -> FilesStore:
    store = FilesStore(
        root, settings(**{k: v for k, v in kw.items() if k != "sleep"}), clock=TickingClock(), sleep=kw.get("sleep")
    )
    await store.open()
    return store


def log_of(root: Path, sid: str) -> Path:
    return root / "sessions" / f"{sid}.jsonl"


def mark_of(root: Path, sid: str) -> Path:
    return root / "sessions" / f"{sid}.jsonl.mark"


def lines_of(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes()
    assert data.endswith(b"\n")
    # Each line is a checked record: {"c": CRC32C, "r": the record}.
    return [json.loads(line)["r"] for line in data.split(b"\n")[:-1]]


async def everything(store: FilesStore, sid: str) -> tuple[Any, ...]:
    info = await store.get_session(sid, caller=ALICE)
    return (
        info,
        await store.get_messages(sid, caller=ALICE, first=1, last=info.last_sequence),
        await store.load_context(sid, caller=ALICE),
    )


async def session_with(store: FilesStore, n: int) -> str:
    sid = (await store.create_session(caller=ALICE, profile_id="p", name="s")).id
    for i in range(1, n + 1):
        await store.append_messages(sid, [user(f"m{i}")], caller=ALICE, request_id=f"r{i}")
    return sid


# -- the log format -----------------------------------------------------------------------------


async def test_the_log_is_a_header_then_one_record_per_mutation(root: Path) -> None:
    store = await opened(root)
    sid = await session_with(store, 2)
    await store.set_context_flags(sid, [1], caller=ALICE, is_context=False)
    await store.update_session(sid, caller=ALICE, pinned=True)
    await store.update_state(sid, caller=ALICE, context_tokens=3)
    await store.commit_compaction(sid, caller=ALICE, demote=[2], append=[summary("S", 1)], context_tokens=1)
    kinds = [line["t"] for line in lines_of(log_of(root, sid))]
    assert kinds == ["session", "append", "append", "flags", "header", "state", "compaction"]
    first = lines_of(log_of(root, sid))[0]
    assert first["session"]["id"] == sid and first["session"]["user_id"] == "alice"
    compaction = lines_of(log_of(root, sid))[-1]
    assert compaction["demote"] == [2] and [m["seq"] for m in compaction["messages"]] == [3]
    await store.close()


# -- recovery on load ---------------------------------------------------------------------------


@pytest.mark.parametrize("tail", [b'{"t":"append","messages":[{"seq":4,"ro', b'{"t":"append" garbage\n'])
async def test_a_torn_last_line_is_dropped_and_kept_aside(
    root: Path, caplog: pytest.LogCaptureFixture, tail: bytes
) -> None:
    store = await opened(root)
    sid = await session_with(store, 3)
    before = await everything(store, sid)
    await store.close()
    path = log_of(root, sid)
    original = path.read_bytes() + tail
    path.write_bytes(original)

    with caplog.at_level(logging.WARNING, logger="contextsvc.stores.files"):
        store = await opened(root)
    assert await everything(store, sid) == before
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and sid in r.getMessage()]
    assert len(warnings) == 1 and "torn" in warnings[0].getMessage()
    (aside,) = root.joinpath("sessions").glob(f"{sid}.jsonl.torn-*")
    assert aside.read_bytes() == original
    assert len(lines_of(path)) == 4  # rewritten without the torn line
    assert store.stats.recovered_logs == 1
    # The session goes on from where it was; a second reload is clean.
    assert (await store.append_messages(sid, [user("m4")], caller=ALICE)).sequence_numbers == [4]
    await store.close()
    caplog.clear()
    store = await opened(root)
    assert (await store.get_session(sid, caller=ALICE)).last_sequence == 4
    assert store.stats.recovered_logs == 0 and not caplog.records
    await store.close()


async def test_a_torn_compaction_is_all_or_nothing(root: Path) -> None:
    store = await opened(root)
    sid = await session_with(store, 4)
    before = await everything(store, sid)
    mark = mark_of(root, sid).read_bytes()
    await store.commit_compaction(
        sid, caller=ALICE, demote=[1, 2, 3], append=[summary("S", 1), user("record")], context_tokens=1
    )
    await store.close()
    path = log_of(root, sid)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 25])  # a crash in the middle of writing the compaction record
    mark_of(root, sid).write_bytes(mark)  # ... so the mark was never moved past it

    store = await opened(root)
    assert await everything(store, sid) == before
    await store.close()


@pytest.mark.parametrize(
    "bad_line",
    [
        b"this is not json",
        b'{"t":"append","messages":[{"seq":9,"role":"user","content":"gap"}]}',  # unchecked, wrong number
        b'{"t":"teleport"}',
        None,  # one byte of the record flipped: its checksum fails
    ],
)
async def test_a_bad_record_in_the_middle_is_set_aside_and_the_session_is_read_only(
    root: Path, caplog: pytest.LogCaptureFixture, bad_line: bytes | None
) -> None:
    store = await opened(root)
    sid = await session_with(store, 1)
    await store.append_messages(sid, [user("m2")], caller=ALICE)
    await store.append_messages(sid, [user("m3")], caller=ALICE)
    await store.close()
    path = log_of(root, sid)
    lines = path.read_bytes().split(b"\n")
    # header, m1, [m2 -> bad], m3
    lines[2] = bad_line if bad_line is not None else lines[2].replace(b'"m2"', b'"m7"')
    original = b"\n".join(lines)
    path.write_bytes(original)

    with caplog.at_level(logging.WARNING, logger="contextsvc.stores.files"):
        store = await opened(root)
    rows = await store.get_messages(sid, caller=ALICE, first=1, last=9)
    assert [m.sequence_number for m in rows] == [1, 2, 3]  # the neighbours survive
    assert [m.content for m in rows][::2] == ["m1", "m3"]
    assert rows[1].metadata == {LOST_KEY: True} and "#2 was lost" in rows[1].content
    assert not rows[1].flags.is_context  # a stand-in never reaches the model
    assert [m.content for m in await store.load_context(sid, caller=ALICE)] == ["m1", "m3"]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and sid in r.getMessage()]
    assert len(errors) == 1 and "line 3" in errors[0] and "#2" in errors[0], errors
    (aside,) = root.joinpath("sessions").glob(f"{sid}.jsonl.corrupt-*")
    assert aside.read_bytes() == original
    # Read-only: a number a client saw is never handed out again, writes say why.
    with pytest.raises(SessionDamaged) as raised:
        await store.append_messages(sid, [user("new")], caller=ALICE)
    assert raised.value.reason == "SESSION_DAMAGED"
    await store.update_state(sid, caller=ALICE, context_tokens=5)  # engine bookkeeping goes on
    await store.close()
    store = await opened(root)  # the damage is remembered (in the rewritten header)
    with pytest.raises(SessionDamaged):
        await store.append_messages(sid, [user("new")], caller=ALICE)
    assert (await store.get_session(sid, caller=ALICE)).last_sequence == 3
    await store.close()


async def test_garbage_lines_that_cost_no_message_are_set_aside_and_the_session_stays_writable(root: Path) -> None:
    store = await opened(root)
    sid = await session_with(store, 2)
    await store.update_state(sid, caller=ALICE, context_tokens=7)
    before = await everything(store, sid)
    await store.close()
    path = log_of(root, sid)
    lines = path.read_bytes().split(b"\n")
    lines.insert(2, b"\x00\x00garbage\xff")
    path.write_bytes(b"\n".join(lines) + b"more garbage\n")
    store = await opened(root)
    assert await everything(store, sid) == before
    assert store.stats.recovered_logs == 1
    assert (await store.append_messages(sid, [user("m3")], caller=ALICE)).sequence_numbers == [3]
    await store.close()


async def test_a_log_cut_short_keeps_every_number_it_acknowledged(root: Path) -> None:
    store = await opened(root)
    sid = await session_with(store, 5)
    await store.close()
    path = log_of(root, sid)
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join(lines[:3]) + b"\n")  # header, m1, m2: m3..m5 gone at a line boundary
    store = await opened(root)
    info = await store.get_session(sid, caller=ALICE)
    assert info.last_sequence == 5  # from the mark file
    rows = await store.get_messages(sid, caller=ALICE, first=1, last=5)
    assert [m.metadata.get(LOST_KEY, False) for m in rows] == [False, False, True, True, True]
    with pytest.raises(SessionDamaged):
        await store.append_messages(sid, [user("m6")], caller=ALICE)
    await store.close()


@pytest.mark.parametrize("torn", [False, True])
async def test_in_batch_durability_a_log_end_lost_unsynced_keeps_its_numbers_and_the_session_writable(
    root: Path, caplog: pytest.LogCaptureFixture, torn: bool
) -> None:
    """A machine crash in batch durability may lose appends acknowledged before their sync while
    their mark reached the disk (README: "may lose"). That loss is allowed: the numbers get
    stand-ins (never handed out again) and the session stays writable, where it was read-only
    until ``fsck --repair`` (and still is in fsync durability, where no such loss is allowed)."""
    store = await opened(root, durability=Durability.BATCH)
    sid = await session_with(store, 5)
    await store.close()
    path = log_of(root, sid)
    lines = path.read_bytes().split(b"\n")
    cut = b"\n".join(lines[:4]) + b"\n"  # header, m1..m3: m4 and m5 never reached the disk
    path.write_bytes(cut + (lines[4][:9] if torn else b""))  # and m4's line half written
    with caplog.at_level(logging.WARNING, logger="contextsvc.stores.files"):
        store = await opened(root, durability=Durability.BATCH)
    rows = await store.get_messages(sid, caller=ALICE, first=1, last=5)
    assert [m.content for m in rows[:3]] == ["m1", "m2", "m3"]
    assert [bool(m.metadata.get(LOST_KEY)) for m in rows] == [False, False, False, True, True]
    assert "batched sync" in rows[3].content
    assert (await store.append_messages(sid, [user("m6")], caller=ALICE)).sequence_numbers == [6]
    said = [r for r in caplog.records if sid in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "#4-5" in said[0].getMessage() and "stays writable" in said[0].getMessage()
    await store.close()
    store = await opened(root, durability=Durability.BATCH)  # the stand-ins were written: a clean log now
    assert [m.content for m in await store.load_context(sid, caller=ALICE)] == ["m1", "m2", "m3", "m6"]
    await store.close()


async def test_a_lost_header_is_rebuilt_from_the_mark_and_the_first_records(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = await opened(root)
    good = await session_with(store, 1)
    bad = await session_with(store, 2)
    await store.close()
    path = log_of(root, bad)
    path.write_bytes(path.read_bytes().split(b"\n", 1)[1])  # the header line deleted

    with caplog.at_level(logging.ERROR, logger="contextsvc.stores.files"):
        store = await opened(root)
    assert (await store.get_session(good, caller=ALICE)).last_sequence == 1
    info = await store.get_session(bad, caller=ALICE)  # still Alice's: the mark file kept the owner
    assert (info.user_id, info.profile_id, info.last_sequence) == ("alice", "p", 2)
    assert [m.content for m in await store.load_context(bad, caller=ALICE)] == ["m1", "m2"]
    with pytest.raises(SessionDamaged):
        await store.append_messages(bad, [user("m3")], caller=ALICE)
    assert any(bad in r.getMessage() and "header lost" in r.getMessage() for r in caplog.records)
    await store.close()


async def test_a_deleted_log_comes_back_damaged_from_its_mark(root: Path) -> None:
    store = await opened(root)
    sid = await session_with(store, 3)
    await store.close()
    log_of(root, sid).unlink()
    store = await opened(root)
    info = await store.get_session(sid, caller=ALICE)
    assert (info.user_id, info.last_sequence) == ("alice", 3)
    rows = await store.get_messages(sid, caller=ALICE, first=1, last=3)
    assert all(m.metadata.get(LOST_KEY) for m in rows)
    with pytest.raises(SessionDamaged):
        await store.append_messages(sid, [user("m4")], caller=ALICE)
    await store.close()


async def test_a_log_with_nothing_readable_and_no_mark_is_moved_aside(root: Path) -> None:
    store = await opened(root)
    bad = await session_with(store, 1)
    await store.close()
    log_of(root, bad).write_bytes(b"{broken\n")
    mark_of(root, bad).unlink()
    store = await opened(root)
    with pytest.raises(NotFound):
        await store.get_session(bad, caller=ALICE)
    assert not log_of(root, bad).exists()
    assert len(list(root.joinpath("sessions").glob(f"{bad}.jsonl.corrupt-*"))) == 1
    await store.close()


async def test_a_log_written_before_checksums_still_loads(root: Path) -> None:
    fixture = Path(__file__).parent / "data" / "legacy_session.jsonl"
    sid = "0b5e5a3c-1111-4222-8333-944455556666"
    (root / "sessions").mkdir(parents=True)
    log_of(root, sid).write_bytes(fixture.read_bytes())
    store = await opened(root)
    info = await store.get_session(sid, caller=Principal(user_id="anonymous", is_admin=True))
    assert (info.user_id, info.name, info.last_sequence, info.context_message_count) == ("anonymous", "legacy", 3, 2)
    assert store.stats.recovered_logs == 0
    anyone = Principal(user_id="anonymous")
    assert (await store.append_messages(sid, [user("new")], caller=anyone)).sequence_numbers == [4]
    await store.close()
    store = await opened(root)
    assert (await store.get_session(sid, caller=anyone)).last_sequence == 4
    await store.close()


async def test_a_torn_calibration_line_is_skipped(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = await opened(root)
    await store.add_calibration_observation("m", Observation(100, 40))
    await store.close()
    with (root / "calibration.jsonl").open("ab") as fh:
        fh.write(b'{"model":"m","cha')
    with caplog.at_level(logging.WARNING, logger="contextsvc.stores.files"):
        store = await opened(root)
    assert await store.list_calibration_observations("m", limit=8) == [Observation(100, 40)]
    assert any("calibration" in r.getMessage() for r in caplog.records)
    await store.add_calibration_observation("m", Observation(200, 80))
    await store.close()
    store = await opened(root)
    assert await store.list_calibration_observations("m", limit=8) == [Observation(100, 40), Observation(200, 80)]
    await store.close()


async def test_observations_and_views_of_the_first_feature_set_are_mapped_or_dropped(root: Path) -> None:
    """Features written before the CJK class was split (11 numbers, one ``cjk`` class) load in the
    current order when they hold no CJK units; with CJK units they cannot be split and are dropped
    (the observation is then not fitted), never read as if they were in the new order."""
    assert len(LEGACY_FEATURES) == 11 and N_FEATURES == 18
    latin = (10.0, 20.0, 3.0, 4.0, 5.0, 0.0, 0.0, 1.0, 2.0, 1.0, 1.0)  # word .. cyrillic, cjk=0, other, overheads
    cjk = (10.0, 0.0, 0.0, 4.0, 5.0, 0.0, 70.0, 0.0, 2.0, 0.0, 1.0)
    store = await opened(root)
    await store.add_calibration_observation("m", Observation(45, 30, features=latin, residual=0.02))
    await store.add_calibration_observation("m", Observation(89, 60, features=cjk))
    sid = (await store.create_session(caller=Principal("alice"), profile_id="p")).id
    await store.append_messages(sid, [user("a")], caller=Principal("alice"))
    await store.save_view(sid, dataclasses.replace(view("old", last_sequence=1), features=cjk), keep=3)
    await store.save_view(sid, dataclasses.replace(view("latin", last_sequence=1), features=latin), keep=3)
    await store.close()
    store = await opened(root)
    mapped = (10.0, 20.0, 3.0, 4.0, 5.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 1.0, 1.0)
    assert await store.list_calibration_observations("m", limit=8) == [
        Observation(45, 30, features=mapped, residual=0.02),
        Observation(89, 60, features=()),
    ]
    assert not (await store.list_calibration_observations("m", limit=8))[1].usable
    assert (await store.get_view(sid, "latin")).features == mapped  # type: ignore[union-attr]
    assert (await store.get_view(sid, "old")).features == ()  # type: ignore[union-attr]
    await store.close()


async def test_observations_and_views_of_the_second_feature_set_are_mapped_or_dropped(root: Path) -> None:
    """Features written before the families' own Cyrillic columns (13 numbers: the classes, then the
    overheads) load in the current order with those columns 0 when they hold no Cyrillic units; with
    Cyrillic units each family's own count is unknown, so they are dropped (not fitted)."""
    assert len(PREVIOUS_FEATURES) == 13
    latin = (10.0, 20.0, 3.0, 4.0, 5.0, 0.0, 6.0, 0.0, 0.0, 1.0, 2.0, 1.0, 1.0)  # word .. other, overheads
    russian = (10.0, 0.0, 0.0, 4.0, 5.0, 70.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0, 1.0)
    store = await opened(root)
    await store.add_calibration_observation("m", Observation(51, 30, features=latin, residual=0.02))
    await store.add_calibration_observation("m", Observation(89, 60, features=russian))
    sid = (await store.create_session(caller=Principal("alice"), profile_id="p")).id
    await store.append_messages(sid, [user("a")], caller=Principal("alice"))
    await store.save_view(sid, dataclasses.replace(view("ru", last_sequence=1), features=russian), keep=3)
    await store.save_view(sid, dataclasses.replace(view("latin", last_sequence=1), features=latin), keep=3)
    await store.close()
    store = await opened(root)
    mapped = (10.0, 20.0, 3.0, 4.0, 5.0, 0.0, 6.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 1.0, 1.0)
    assert await store.list_calibration_observations("m", limit=8) == [
        Observation(51, 30, features=mapped, residual=0.02),
        Observation(89, 60, features=()),
    ]
    assert (await store.get_view(sid, "latin")).features == mapped  # type: ignore[union-attr]
    assert (await store.get_view(sid, "ru")).features == ()  # type: ignore[union-attr]
    await store.close()


async def test_observations_and_views_of_the_third_feature_set_are_mapped(root: Path) -> None:
    """Features written before the prefixed identifiers' column (17 numbers: the classes, the
    families' Cyrillic columns, the overheads) load with that column 0, Cyrillic units and all."""
    assert len(CYRILLIC_FEATURES) == 17
    russian = (10.0, 8.0, 0.0, 4.0, 5.0, 70.0, 0.0, 0.0, 0.0, 0.0, 60.0, 90.0, 62.0, 95.0, 2.0, 0.0, 1.0)
    store = await opened(root)
    await store.add_calibration_observation("m", Observation(89, 60, features=russian, residual=0.01))
    sid = (await store.create_session(caller=Principal("alice"), profile_id="p")).id
    await store.append_messages(sid, [user("a")], caller=Principal("alice"))
    await store.save_view(sid, dataclasses.replace(view("ru", last_sequence=1), features=russian), keep=3)
    await store.close()
    store = await opened(root)
    mapped = (*russian[:14], 0.0, *russian[14:])
    assert await store.list_calibration_observations("m", limit=8) == [
        Observation(89, 60, features=mapped, residual=0.01)
    ]
    assert (await store.get_view(sid, "ru")).features == mapped  # type: ignore[union-attr]
    await store.close()


async def test_concurrent_calibration_observations_wait_for_no_disk_and_share_one_write(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Observations recorded together (issue #15 item 5): in fsync durability too, none waits for
    a write or a sync (an observation is one sample, not an acknowledged mutation); the flusher's
    next pass writes them all with one write and one fsync, in order, and they survive a restart."""
    store = await opened(root, sleep=_never)  # the flusher's pass runs when the test says
    before = store.stats.log_fsyncs
    writes = []
    real = files_module._append_at
    monkeypatch.setattr(files_module, "_append_at", lambda *a, **kw: writes.append(a[0]) or real(*a, **kw))
    observations = [Observation(100 + i, 40 + i) for i in range(min(20, store.observations_kept))]
    await asyncio.gather(*(store.add_calibration_observation("m", o) for o in observations))
    assert store._observations_writer is None  # each was kept in its caller's step
    assert writes == [] and store.stats.log_fsyncs == before and store.pending_fsync == 0
    assert await store.list_calibration_observations("m", limit=100) == observations
    await store.flush()
    assert writes == [root / "calibration.jsonl"]
    assert store.stats.log_fsyncs == before + 1 and store.pending_fsync == 0
    await store.close()
    store = await opened(root)
    assert await store.list_calibration_observations("m", limit=100) == observations
    await store.close()


def _refuse_first_write(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The next ``_append_at`` fails as on a full disk, later ones write; ``n`` counts them all."""
    real = files_module._append_at
    calls = {"n": 0}

    def failing_once(*args: Any, **kw: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(28, "No space left on device")
        return real(*args, **kw)

    monkeypatch.setattr(files_module, "_append_at", failing_once)
    return calls


@pytest.mark.parametrize("durability", [Durability.FSYNC, Durability.BATCH])
async def test_observations_wait_for_the_flusher_and_survive_a_refused_write(
    root: Path, monkeypatch: pytest.MonkeyPatch, durability: Durability
) -> None:
    store = await opened(root, durability=durability)
    calibration = root / "calibration.jsonl"
    size = calibration.stat().st_size
    calls = _refuse_first_write(monkeypatch)
    await store.add_calibration_observation("m", Observation(1, 1))  # no baseline waits for the disk
    await store.add_calibration_observation("m", Observation(2, 2))
    assert calibration.stat().st_size == size  # deferred: not a write each
    await store.flush()  # the disk refuses the pass's write: the lines are kept for the next one
    assert calls["n"] == 1 and calibration.stat().st_size == size
    await store.add_calibration_observation("m", Observation(3, 3))
    await store.flush()
    assert calls["n"] == 2  # all three in one write
    assert await store.list_calibration_observations("m", limit=10) == [Observation(i, i) for i in (1, 2, 3)]
    await store.close()
    store = await opened(root)
    assert await store.list_calibration_observations("m", limit=10) == [Observation(i, i) for i in (1, 2, 3)]
    await store.close()


# -- deferred lines (views, anchors) ------------------------------------------------------------


async def _never(seconds: float) -> None:
    """A flusher's sleep that never ends: only the test writes deferred lines."""
    await asyncio.Event().wait()


def kinds_of(root: Path, sid: str) -> list[str]:
    return [line["t"] for line in lines_of(log_of(root, sid))]


async def test_soft_lines_share_the_next_lines_write_in_order(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await opened(root, sleep=_never)
    sid = await session_with(store, 1)
    await store.save_view(sid, view("v1", last_sequence=1), keep=3)
    await store.update_state(sid, caller=ALICE, context_tokens=7, state={"anchor": 1}, durable=False)
    assert kinds_of(root, sid) == ["session", "append"]  # nothing written for them yet
    writes: list[bytes] = []
    real = files_module._append_at

    def counted(path: Path, expected: int, data: bytes) -> int:
        writes.append(data)
        return real(path, expected, data)

    monkeypatch.setattr(files_module, "_append_at", counted)
    await store.append_messages(sid, [user("m2")], caller=ALICE, request_id="r2")
    assert len(writes) == 1  # the view, the anchor and the append: one write
    assert kinds_of(root, sid) == ["session", "append", "view", "state", "append"]
    await store.close()
    again = await opened(root)
    assert (await again.get_view(sid, "v1")) == view("v1", last_sequence=1)
    info = await again.get_session(sid, caller=ALICE)
    assert info.context_tokens == 7 and info.state == {"anchor": 1} and info.last_sequence == 2
    await again.close()


@pytest.mark.parametrize("durability", [Durability.FSYNC, Durability.BATCH])
async def test_the_flusher_writes_soft_lines_no_line_follows(root: Path, durability: Durability) -> None:
    store = await opened(root, durability=durability, fsync_batch_ms=1, files=FilesSettings(soft_line_wait_ms=0))
    sid = await session_with(store, 1)
    await store.save_view(sid, view("v1", last_sequence=1), keep=3)
    await _until(lambda: "view" in kinds_of(root, sid))
    # A killed process (no close): the operating system holds what the flusher wrote.
    store._dir_lock.release()
    again = await opened(root)
    assert (await again.get_view(sid, "v1")) == view("v1", last_sequence=1)
    await again.close()
    await store.close()


async def test_a_soft_line_waits_its_time_for_a_line_to_share_a_write_with(root: Path) -> None:
    store = await opened(root, sleep=_never, files=FilesSettings(soft_line_wait_ms=60_000))
    sid = await session_with(store, 1)
    await store.save_view(sid, view("v1", last_sequence=1), keep=3)
    await store._flush_pass(every=False)  # a flusher's pass before the wait is over
    assert kinds_of(root, sid) == ["session", "append"]
    await store.flush()  # every deferred line, whatever its wait (a clean stop flushes)
    assert kinds_of(root, sid) == ["session", "append", "view"]
    await store.close()


async def test_a_log_read_back_whole_first_gets_its_deferred_lines(root: Path) -> None:
    store = await opened(root, sleep=_never, files=FilesSettings(cache_mb=0))  # only sessions in use stay
    sid = await session_with(store, 2)
    await store.save_view(sid, view("v1", last_sequence=2), keep=3)
    await session_with(store, 1)  # the first session's rows go
    assert not store._sessions[sid].resident
    assert await store.get_messages(sid, caller=ALICE, first=1, last=2)  # read whole again
    assert "view" in kinds_of(root, sid)
    assert (await store.get_view(sid, "v1")) == view("v1", last_sequence=2)
    await store.close()


async def test_a_deleted_or_rewritten_session_drops_its_deferred_lines(root: Path) -> None:
    store = await opened(root, sleep=_never)
    sid = await session_with(store, 1)
    await store.save_view(sid, view("gone", last_sequence=1), keep=3)
    await store.delete_session(sid, caller=ALICE)
    again = await store.create_session(caller=ALICE, profile_id="p", session_id=sid)
    await store.flush()
    assert again.id == sid and kinds_of(root, sid) == ["session"]  # not the deleted session's view
    await store.save_view(sid, view("kept", last_sequence=0), keep=3)
    await store.rewrite_log(sid)  # written whole from memory: the view is in its header line
    await store.flush()
    assert kinds_of(root, sid) == ["session"]
    assert [v["view_id"] for v in lines_of(log_of(root, sid))[0]["views"]] == ["kept"]
    await store.close()
    reopened = await opened(root)
    assert (await reopened.get_view(sid, "kept")) == view("kept", last_sequence=0)
    await reopened.close()


# -- rewriting a log ----------------------------------------------------------------------------


async def _churn(store: FilesStore, sid: str, rounds: int) -> None:
    for i in range(rounds):
        await store.set_context_flags(sid, [1], caller=ALICE, is_context=i % 2 == 1)
        await store.update_state(sid, caller=ALICE, context_tokens=i, state={"round": i})
        await store.update_session(sid, caller=ALICE, name=f"name {i}")


async def test_rewrite_log_keeps_everything_and_leaves_no_temp_files(root: Path) -> None:
    store = await opened(root)
    sid = await session_with(store, 5)
    await store.commit_compaction(sid, caller=ALICE, demote=[1, 2], append=[summary("S", 1)], context_tokens=9)
    await _churn(store, sid, 10)
    before = await everything(store, sid)
    lines_before = len(lines_of(log_of(root, sid)))

    await store.rewrite_log(sid)
    assert len(lines_of(log_of(root, sid))) == 1 + 6  # header + one line per row
    assert lines_before == 1 + 5 + 1 + 30
    assert sorted(p.name for p in root.joinpath("sessions").iterdir()) == [f"{sid}.jsonl", f"{sid}.jsonl.mark"]
    assert await everything(store, sid) == before
    await store.close()

    store = await opened(root)
    assert await everything(store, sid) == before
    replay = await store.append_messages(sid, [user("again")], caller=ALICE, request_id="r3")
    assert (replay.sequence_numbers, replay.replayed) == ([3], True)
    assert (replay.first_context_tokens, replay.session.context_tokens) == (0, 9)  # as the first call left them
    await store.close()


async def test_a_failed_rewrite_leaves_the_old_log(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await opened(root)
    sid = await session_with(store, 3)
    before = await everything(store, sid)
    original = log_of(root, sid).read_bytes()

    def broken_replace(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(Unavailable):
        await store.rewrite_log(sid)
    monkeypatch.undo()
    assert log_of(root, sid).read_bytes() == original
    assert sorted(p.name for p in root.joinpath("sessions").iterdir()) == [f"{sid}.jsonl", f"{sid}.jsonl.mark"]
    assert await everything(store, sid) == before
    await store.append_messages(sid, [user("m4")], caller=ALICE)
    await store.close()
    store = await opened(root)
    assert (await store.get_session(sid, caller=ALICE)).last_sequence == 4
    await store.close()


async def test_the_log_is_rewritten_when_overhead_records_pile_up(root: Path) -> None:
    store = await opened(root, files=FilesSettings(compact_min_records=10))
    sid = await session_with(store, 3)
    await _churn(store, sid, 20)  # 60 flag/state/header records for 3 rows
    async with asyncio.timeout(10):
        await store.compactions_done()  # in the background, not in the calls that crossed the line
    assert store.stats.rewrites >= 4 and store.stats.compactions == store.stats.rewrites
    assert len(lines_of(log_of(root, sid))) <= 1 + 3 + 11
    before = await everything(store, sid)
    await store.close()
    store = await opened(root)
    assert await everything(store, sid) == before
    await store.close()


# -- durability ---------------------------------------------------------------------------------


async def test_fsync_mode_fsyncs_the_log_before_an_append_returns(root: Path, fsynced: list[str]) -> None:
    store = await opened(root)
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    path = str(log_of(root, sid).resolve())
    for i in range(3):
        fsynced.clear()
        await store.append_messages(sid, [user(f"m{i}")], caller=ALICE)
        assert fsynced == [path]
    assert store.stats.log_fsyncs == 3 and store.pending_fsync == 0
    await store.close()


async def test_batch_mode_fsyncs_within_the_configured_interval(root: Path, fsynced: list[str]) -> None:
    delays: list[float] = []
    tick = asyncio.Event()

    async def controlled_sleep(seconds: float) -> None:
        delays.append(seconds)
        await tick.wait()
        tick.clear()

    store = await opened(root, durability=Durability.BATCH, fsync_batch_ms=40, sleep=controlled_sleep)
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    path = str(log_of(root, sid).resolve())
    fsynced.clear()
    await store.append_messages(sid, [user("m1")], caller=ALICE)
    await store.append_messages(sid, [user("m2")], caller=ALICE)
    # Acknowledged and written, not yet forced to disk: one log waits for the flusher.
    assert fsynced == [] and store.pending_fsync == 1 and store.stats.batch_flushes == 0
    assert len(lines_of(log_of(root, sid))) == 3

    await _until(lambda: delays == [0.040])  # the flusher waits exactly fsync_batch_ms ...
    tick.set()
    await _until(lambda: store.stats.batch_flushes == 1)  # ... then fsyncs every written log once
    assert fsynced == [path] and store.pending_fsync == 0

    # Idle: nothing written, the flusher does not wake up; the next write arms it again.
    await store.update_state(sid, caller=ALICE, context_tokens=1)
    await _until(lambda: len(delays) == 2)
    tick.set()
    await _until(lambda: store.stats.batch_flushes == 2)
    assert fsynced == [path, path]
    await store.close()


async def test_batch_mode_close_flushes_what_is_pending(root: Path, fsynced: list[str]) -> None:
    async def never(seconds: float) -> None:
        await asyncio.Event().wait()

    store = await opened(root, durability=Durability.BATCH, sleep=never)
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    fsynced.clear()
    await store.append_messages(sid, [user("m1")], caller=ALICE)
    assert fsynced == []
    await store.close()
    # The log, then only the start-up index written at a clean stop (its temp file, the directory).
    assert fsynced[0] == str(log_of(root, sid).resolve())
    assert all(".index.jsonl." in p or p.endswith("/data") for p in fsynced[1:]), fsynced


async def test_a_process_crash_in_batch_mode_loses_nothing_written(root: Path) -> None:
    async def never(seconds: float) -> None:
        await asyncio.Event().wait()

    store = await opened(root, durability=Durability.BATCH, sleep=never)
    sid = await session_with(store, 5)
    before = await everything(store, sid)
    # No close(): the process "dies"; the OS still holds what was written, and the kernel drops
    # a dead process's flock.
    store._dir_lock.release()
    again = await opened(root)
    assert await everything(again, sid) == before
    await again.close()
    await store.close()


async def _until(condition: Callable[[], bool]) -> None:
    """Wait (bounded, not timed) for a background task to reach a state."""
    async with asyncio.timeout(10):
        while not condition():  # noqa: ASYNC110  (a plain counter, no event to wait on)
            await asyncio.sleep(0.001)


# -- failures and cancellation ------------------------------------------------------------------


async def test_a_half_written_record_is_cut_before_the_next_write(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await opened(root)
    sid = await session_with(store, 2)
    before = await everything(store, sid)
    real_pwrite = os.pwrite

    def disk_full(fd: int, data: Any, offset: int) -> int:
        real_pwrite(fd, bytes(data[:-1]), offset)  # all but the newline made it
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", disk_full)
    with pytest.raises(Unavailable):
        await store.append_messages(sid, [user("lost " * 100)], caller=ALICE)
    monkeypatch.undo()
    assert await everything(store, sid) == before
    assert (await store.append_messages(sid, [user("m3")], caller=ALICE)).sequence_numbers == [3]
    await store.close()
    store = await opened(root)
    assert [m.content for m in await store.load_context(sid, caller=ALICE)] == ["m1", "m2", "m3"]
    assert store.stats.recovered_logs == 0
    await store.close()


async def test_a_cancelled_caller_does_not_split_disk_and_memory(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await opened(root)
    sid = await session_with(store, 1)
    entered, release = threading.Event(), threading.Event()
    real = store._group._sync

    def slow(paths: Any) -> None:  # the append's line is written; its sync pass is under way
        entered.set()
        release.wait(10)
        real(paths)

    monkeypatch.setattr(store._group, "_sync", slow)
    task = asyncio.ensure_future(store.append_messages(sid, [user("m2")], caller=ALICE))
    await asyncio.to_thread(entered.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    monkeypatch.setattr(store._group, "_sync", real)
    release.set()
    # The write was under way: it completes, in memory and on disk, before anything else runs.
    assert (await store.append_messages(sid, [user("m3")], caller=ALICE)).sequence_numbers == [3]
    await store.close()
    store = await opened(root)
    assert [m.content for m in await store.load_context(sid, caller=ALICE)] == ["m1", "m2", "m3"]
    await store.close()


# -- ids and paths ------------------------------------------------------------------------------


def _tree(folder: Path) -> list[Path]:
    return sorted(p.relative_to(folder) for p in folder.rglob("*"))


TRICKS = ["../../../etc/passwd", "..", "a/../../b", "/etc/passwd", "00000000-0000-4000-8000-00000000000%", ""]


async def test_path_tricks_are_not_found_and_touch_nothing(root: Path, tmp_path: Path) -> None:
    store = await opened(root)
    sid = await session_with(store, 1)
    listing_before = _tree(tmp_path)
    for bad in [*TRICKS, f"../sessions/{sid}", sid + "/", sid.upper()]:
        with pytest.raises(NotFound):
            await store.get_session(bad, caller=ALICE)
        with pytest.raises(NotFound):
            await store.delete_session(bad, caller=ALICE)
        with pytest.raises(NotFound):
            await store.rewrite_log(bad)
        with pytest.raises(InvalidArgument):
            await store.create_session(caller=ALICE, profile_id="p", session_id=bad)
        assert await store.get_blob(bad) is None
        with pytest.raises(InvalidArgument):
            await store.put_blob(b"x", blob_id=bad)
    assert _tree(tmp_path) == listing_before
    await store.close()


async def test_only_logs_named_by_their_own_session_id_are_loaded(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = await opened(root)
    sid = await session_with(store, 1)
    await store.close()
    sessions = root / "sessions"
    other = "11111111-1111-4111-8111-111111111111"
    (sessions / "evil.jsonl").write_bytes(log_of(root, sid).read_bytes())
    (sessions / f"{other}.jsonl").write_bytes(log_of(root, sid).read_bytes())  # header names sid

    store = await opened(root)
    assert [s.id for s in (await store.list_sessions(caller=ALICE, offset=0, limit=10)).sessions] == [sid]
    with pytest.raises(NotFound):
        await store.get_session(other, caller=ALICE)
    await store.close()


async def test_delete_removes_the_log_and_its_copies(root: Path) -> None:
    store = await opened(root)
    keep = await session_with(store, 1)
    gone = await session_with(store, 2)
    await store.close()
    with log_of(root, gone).open("ab") as fh:
        fh.write(b"{torn")
    store = await opened(root)  # leaves a .torn copy aside
    await store.delete_session(gone, caller=ALICE)
    assert sorted(p.name for p in (root / "sessions").iterdir()) == [f"{keep}.jsonl", f"{keep}.jsonl.mark"]
    await store.close()


async def test_stale_temp_files_are_removed_on_open(root: Path) -> None:
    store = await opened(root)
    sid = await session_with(store, 1)
    await store.close()
    (root / "sessions" / f".{sid}.jsonl.deadbeef.tmp").write_bytes(b"half a rewrite")
    # A read-only opener (maintain --dry-run beside a server) removes nothing: the owner may be mid-write.
    reader = FilesStore(root, Settings(), read_only=True)
    await reader.open()
    assert (root / "sessions" / f".{sid}.jsonl.deadbeef.tmp").exists()
    await reader.close()
    store = await opened(root)
    assert sorted(p.name for p in (root / "sessions").iterdir()) == [f"{sid}.jsonl", f"{sid}.jsonl.mark"]
    assert (await store.get_session(sid, caller=ALICE)).last_sequence == 1
    await store.close()


# -- one writer per data directory ---------------------------------------------------------------


async def test_a_second_store_on_the_same_directory_is_refused_before_reading(root: Path) -> None:
    store = await opened(root)
    sid = await session_with(store, 2)
    second = FilesStore(root, Settings())
    with pytest.raises(DataDirLocked, match=rf"in use by pid {os.getpid()} \(started "):
        await second.open()
    assert not second._sessions  # nothing was read
    assert (await store.append_messages(sid, [user("still mine")], caller=ALICE)).sequence_numbers == [3]
    await store.close()
    # Released on close: the next owner opens it and sees everything.
    again = await opened(root)
    assert (await again.get_session(sid, caller=ALICE)).last_sequence == 3
    await again.close()


async def test_other_files_in_the_data_directory_are_left_alone(root: Path) -> None:
    store = await opened(root)
    await store.close()
    (root / "tokens.json").write_text("{}")
    store = await opened(root)
    await session_with(store, 1)
    await store.close()
    assert (root / "tokens.json").read_text() == "{}"
    # The holder's note is gone on release; a clean stop leaves its seal instead (stores/_seal.py).
    assert b'"pid"' not in (root / "lock").read_bytes() and b"clean-shutdown" in (root / "lock").read_bytes()


async def test_a_view_record_is_written_by_orjson_and_a_model_name_it_refuses_falls_back(root: Path) -> None:
    """View records (one per build) are written by orjson, byte for byte what json writes; a lone
    surrogate in the model name is refused by orjson and written by the standard library instead.
    Both read back as saved, after a restart."""
    store = await opened(root)
    sid = (await store.create_session(caller=Principal("alice"), profile_id="p")).id
    await store.append_messages(sid, [user("a")], caller=Principal("alice"))
    plain = dataclasses.replace(view("plain", last_sequence=1), features=tuple(float(i) for i in range(N_FEATURES)))
    odd = dataclasses.replace(view("odd", last_sequence=1), model="model-\ud800")
    await store.save_view(sid, plain, keep=4)
    await store.save_view(sid, odd, keep=4)
    line = log_records._encode(log_records.SaveViewRecord(view=plain, keep=4), 1)
    assert log_records._dumps(line) == log_records._dumps_standard(line)  # the same bytes either way
    assert b"\\ud800" in log_records._dumps(log_records._encode(log_records.SaveViewRecord(view=odd, keep=4), 1))
    await store.close()
    store = await opened(root)
    assert await store.get_view(sid, "plain") == plain
    assert await store.get_view(sid, "odd") == odd
    await store.close()


_TEXT = st.text(st.characters(exclude_categories=["Cs"]) | st.sampled_from(["\ud800", "\n", "\x00", "\u2028", '"']))
#: a text that holds "null" (what sends a line to the standard library) without being one
_NULLISH = st.builds("{}null{}".format, _TEXT, _TEXT)
_FLOAT = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e16, 1e-7, -0.0, 5e-324, 1.7e308])
_INT = st.integers(min_value=-(2**70), max_value=2**70)
_JSON = st.recursive(
    st.none() | st.booleans() | _INT | _FLOAT | _TEXT | _NULLISH,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12,
)


def _same(a: Any, b: Any) -> bool:
    """Equal, with a NaN equal to a NaN (and -0.0 told from 0.0)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@hypothesis.settings(max_examples=400, deadline=None)
@given(value=_JSON, key=_TEXT)
def test_a_line_reads_back_as_the_standard_librarys_whatever_it_holds(value: Any, key: str) -> None:
    """Every line is written by orjson where it writes what ``json`` would, else by ``json``: for
    any JSON value (NaN and infinities, integers past 64 bits, lone surrogates, control characters,
    line separators, the text "null"), the line is one line, and reads back as the standard
    library's line does and as the value itself."""
    obj = {"t": "state", key: value, "n": 1}
    line, standard = log_records._dumps(obj), log_records._dumps_standard(obj)
    assert line.endswith(b"\n") and line.count(b"\n") == 1  # one line, whatever the text holds
    read = log_records._loads(line[:-1])
    assert _same(read, log_records._loads(standard[:-1]))
    assert _same(read, obj)


def test_orjson_writes_the_lines_it_can_and_json_the_others() -> None:
    """The fast path is taken (the same bytes as json's for a plain row), and the values orjson
    would write differently go to json: a NaN in a client's metadata stays a NaN."""
    rows = (user("a"), dataclasses.replace(user("b"), metadata={"x": 1.5}))
    line = log_records._encode(AppendRecord(None, rows, "", 0, ""), 2)
    assert log_records._dumps(line) == log_records._dumps_standard(line)
    odd = log_records._encode(
        AppendRecord(None, (dataclasses.replace(user("c"), metadata={"x": math.nan}),), "", 0, ""), 3
    )
    written = log_records._dumps(odd)
    assert b"NaN" in written and b"null" not in written
    assert math.isnan(log_records._loads(written[:-1])["messages"][0]["metadata"]["x"])


@pytest.mark.parametrize(
    "when",
    [
        datetime(2026, 12, 4, 15, 50, 3, 351540, tzinfo=UTC),
        datetime(2026, 12, 4, 15, 50, 3, tzinfo=UTC),  # no microseconds: isoformat leaves them out
        datetime(2026, 12, 4, 15, 50, 3, 5),  # naive (a test clock's)
        datetime(2026, 12, 4, 15, 50, 3, 5, tzinfo=timezone(timedelta(hours=5, minutes=30))),
        datetime(1, 1, 1, tzinfo=UTC),
    ],
)
def test_record_times_are_written_as_isoformat_writes_them(when: datetime) -> None:
    """Records keep their times as datetimes for orjson to write: the line is byte for byte what
    the standard library writes with ``isoformat``, and the times read back."""
    rows = (dataclasses.replace(user("a"), sequence_number=1, create_time=when),)
    saved = log_records.SaveViewRecord(view=dataclasses.replace(view("v", last_sequence=1), create_time=when), keep=2)
    for record in (AppendRecord(when, rows, "r", 0, ""), saved):
        line = log_records._encode(record, 1)
        written = log_records._dumps(line)
        assert written == log_records._dumps_standard(line)
        assert f'"{when.isoformat()}"'.encode() in written
        read = log_records._decode(log_records._loads(written[:-1]))
        if isinstance(read, AppendRecord):
            assert read.time == when and read.messages[0].create_time == when
        else:
            assert read.view.create_time == when  # type: ignore[union-attr]


async def test_rows_of_any_text_and_their_metadata_survive_a_restart_and_a_log_rewrite(root: Path) -> None:
    store = await opened(root)
    sid = (await store.create_session(caller=Principal("alice"), profile_id="p")).id
    texts = ["plain", 'line\nbreak \u2028 \x00 "quoted"', "lone \ud800 surrogate", "кириллица 漢字"]
    sent = [user(t) for t in texts] + [dataclasses.replace(user("with metadata"), metadata={"k": [1, 2.5, "v"]})]
    await store.append_messages(sid, sent, caller=Principal("alice"), request_id="r-\ud800")
    await store.close()
    for rewrite in (False, True):
        store = await opened(root)
        got = await store.list_messages(sid, caller=Principal("alice"), buffer=BufferKind.DISPLAY, limit=10)
        assert [m.content for m in got] == [m.content for m in sent]
        assert got[-1].metadata == {"k": [1, 2.5, "v"]}
        if rewrite:
            await store.rewrite_log(sid)
        await store.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("admin", "false"),
        ("admin", 0),
        ("expires", "2020-01-01T00:00:00"),
        ("revoked", "2020-01-01T00:00:00"),
    ],
)
async def test_a_hand_edited_tokens_file_is_never_read_generously(tmp_path: Path, field: str, value: Any) -> None:
    # "admin": "false" read as bool("false") made an admin; a time without a zone failed every
    # call of that token with UNKNOWN (a TypeError comparing it with the clock). Either is a
    # damaged file: it authenticates nobody until fixed (the token store is unavailable).
    from contextsvc.core.credentials import issue
    from contextsvc.stores.api_tokens import FilesTokenStore

    issued = issue(user="gina", is_admin=False, now=datetime.now(UTC), expire_time=None)
    await FilesTokenStore(tmp_path).add_api_token(issued.record)
    path = tmp_path / "tokens.json"
    data = json.loads(path.read_text())
    data["tokens"][0][field] = value
    path.write_text(json.dumps(data))
    with pytest.raises(Unavailable):
        await FilesTokenStore(tmp_path).find_api_token(issued.record.token_hash)
