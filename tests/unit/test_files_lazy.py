"""The files store's start-up index, lazy loading, memory bound and background compaction (#9 item 3)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

import contextsvc.stores.files as files_module
from contextsvc.config import Durability, FilesSettings, Settings
from contextsvc.core.messages import Flags, Message, Role
from contextsvc.core.session import Principal, SessionInfo
from contextsvc.errors import SessionDamaged
from contextsvc.stores._frames import frame
from contextsvc.stores._index import FIELDS, INDEX_FORMAT, INDEX_NAME
from contextsvc.stores._session import LOST_KEY
from contextsvc.stores.files import FilesStore
from tests.support.stores import TickingClock

ALICE = Principal(user_id="alice")
ADMIN = Principal(user_id="root", is_admin=True)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "data"


async def opened(root: Path, **files: Any) -> FilesStore:
    settings = Settings(durability=Durability.FSYNC, files=FilesSettings(**files))
    store = FilesStore(root, settings, clock=TickingClock())
    await store.open()
    return store


def user(content: str, **flags: bool) -> Message:
    return Message(role=Role.USER, content=content, flags=Flags(**flags))


async def make_sessions(store: FilesStore, count: int, rows: int, size: int = 20) -> list[str]:
    sids = []
    for s in range(count):
        sid = (await store.create_session(caller=ALICE, profile_id="p", name=f"session {s}")).id
        for r in range(rows):
            await store.append_messages(sid, [user(f"s{s} r{r} " + "x" * size)], caller=ALICE, request_id=f"q{r}")
        sids.append(sid)
    return sids


async def listing(store: FilesStore, **kw: Any) -> tuple[list[SessionInfo], int]:
    page = await store.list_sessions(caller=ALICE, offset=0, limit=1000, **kw)
    return page.sessions, page.total


def index_of(root: Path) -> Path:
    return root / INDEX_NAME


def log_of(root: Path, sid: str) -> Path:
    return root / "sessions" / f"{sid}.jsonl"


# -- the start-up index --------------------------------------------------------------------------


async def test_open_reads_the_index_and_no_log(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await opened(root)
    await make_sessions(store, 12, 3)
    before = await listing(store)
    await store.close()
    assert index_of(root).exists()

    def no_log_reads(*args: Any, **kw: Any) -> Any:
        raise AssertionError("a log was read at open")

    monkeypatch.setattr(files_module, "scan_log", no_log_reads)
    store = await opened(root)
    assert store.stats.index_hits == 12 and store.stats.logs_read_at_open == 0
    assert store.resident_sessions == 0 and store.held_bytes == 0
    assert await listing(store) == before  # counters, preview, times: all from the index
    await store.close()


async def test_an_index_of_the_previous_format_serves_the_start_and_is_written_anew(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An index written before format 2 (one object per session): a start after the upgrade uses it
    # (no log read) and writes it again in the current format.
    store = await opened(root)
    await make_sessions(store, 4, 3)
    before = await listing(store)
    await store.close()
    lines = index_of(root).read_bytes().splitlines()
    old = [frame(json.dumps({"t": "index", "format": 1, "preview_chars": 160}).encode())]
    for line in lines[1:]:
        v = json.loads(line)["r"]
        header = dict(zip(FIELDS[:11], v[:11], strict=True))
        record = {"s": header, "d": v[11], "x": v[12], "q": v[13], "p": v[14], "o": v[15], "k": v[16:]}
        old.append(frame(json.dumps(record).encode()))
    index_of(root).write_bytes(b"".join(old))

    def no_log_reads(*args: Any, **kw: Any) -> Any:
        raise AssertionError("a log was read at open")

    monkeypatch.setattr(files_module, "scan_log", no_log_reads)
    store = await opened(root)
    assert store.stats.index_hits == 4 and store.stats.logs_read_at_open == 0
    assert await listing(store) == before
    await store.close()
    assert json.loads(index_of(root).read_bytes().splitlines()[0])["r"]["format"] == INDEX_FORMAT == 2


async def test_an_entry_older_than_its_log_is_not_used(root: Path) -> None:
    store = await opened(root)
    sids = await make_sessions(store, 5, 2)
    await store.close()
    old_index = index_of(root).read_bytes()

    store = await opened(root)
    await store.append_messages(sids[2], [user("newer")], caller=ALICE)
    await store.close()
    index_of(root).write_bytes(old_index)  # an index written before that append (a crash, say)

    store = await opened(root)
    assert store.stats.logs_read_at_open == 1 and store.stats.index_hits == 4
    info = await store.get_session(sids[2], caller=ALICE)
    assert info.last_sequence == 3 and info.preview == "newer"
    # The next append gets the next number, never one the stale entry would hand out again.
    result = await store.append_messages(sids[2], [user("after")], caller=ALICE)
    assert result.sequence_numbers == [4]
    await store.close()


async def test_a_log_replaced_with_the_same_size_and_time_is_still_read(root: Path) -> None:
    store = await opened(root)
    (sid,) = await make_sessions(store, 1, 2)
    await store.close()
    path = log_of(root, sid)
    stat = path.stat()
    data = path.read_bytes().replace(b"s0 r1", b"s0 R1")  # same size, another checksum: unreadable
    tmp = path.with_name("replacement")
    tmp.write_bytes(data)
    os.utime(tmp, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(tmp, path)  # another inode (and ctime), same size and mtime
    store = await opened(root)
    assert store.stats.logs_read_at_open == 1
    with pytest.raises(SessionDamaged):  # the bad record was found at open, not hidden by the index
        await store.append_messages(sid, [user("x")], caller=ALICE)
    await store.close()


@pytest.mark.parametrize("damage", ["missing", "garbage", "flipped entry", "other preview length"])
async def test_a_missing_or_corrupt_index_is_rebuilt_from_the_logs(root: Path, damage: str) -> None:
    store = await opened(root)
    await make_sessions(store, 6, 2)
    before = await listing(store)
    await store.close()
    path = index_of(root)
    if damage == "missing":
        path.unlink()
    elif damage == "garbage":
        path.write_bytes(b"\x00garbage\n" + path.read_bytes()[7:])
    elif damage == "flipped entry":
        lines = path.read_bytes().split(b"\n")
        flipped = bytearray(lines[3])
        flipped[len(flipped) // 2] ^= 0x01  # a bit of the record: fails its checksum
        lines[3] = bytes(flipped)
        path.write_bytes(b"\n".join(lines))
    settings = Settings(durability=Durability.FSYNC, preview_chars=20 if damage == "other preview length" else 160)
    store = FilesStore(root, settings, clock=TickingClock())
    await store.open()
    read = store.stats.logs_read_at_open
    assert read == (1 if damage == "flipped entry" else 6)
    if damage != "other preview length":
        assert await listing(store) == before
    await store.close()
    store = FilesStore(root, settings, clock=TickingClock())
    await store.open()  # the rebuilt index serves the next start
    assert store.stats.logs_read_at_open == 0 and store.stats.index_hits == 6
    await store.close()


async def test_a_deleted_session_leaves_the_index(root: Path) -> None:
    store = await opened(root)
    sids = await make_sessions(store, 3, 1)
    await store.close()
    store = await opened(root)
    await store.delete_session(sids[0], caller=ALICE)
    await store.close()
    assert sids[0].encode() not in index_of(root).read_bytes()
    store = await opened(root)
    assert store.stats.index_hits == 2 and store.stats.logs_read_at_open == 0
    assert {s.id for s in (await listing(store))[0]} == set(sids[1:])
    await store.close()


# -- lazy loading and the memory bound -------------------------------------------------------------


async def test_rows_load_on_first_use_and_the_least_recently_used_go(root: Path) -> None:
    store = await opened(root)
    sids = await make_sessions(store, 8, 40, size=400)  # ~36 KB estimated per session
    expected = {sid: await store.get_messages(sid, caller=ALICE, first=1, last=40) for sid in sids}
    await store.close()
    store = await opened(root, cache_mb=0.1)  # room for about two sessions
    evicted: list[str] = []
    store.on_evict = evicted.append  # the server drops the engine's reused view of these
    budget = int(0.1 * 1024 * 1024)
    for _round in range(2):
        for sid in sids:
            assert await store.get_messages(sid, caller=ALICE, first=1, last=40) == expected[sid]
            assert store.held_bytes <= budget
    assert store.stats.loads >= 2 * len(sids) - 2  # the second round loaded them again
    assert store.stats.evictions >= len(sids) and len(evicted) == store.stats.evictions
    assert set(evicted) <= set(sids) and sids[-1] not in evicted[-2:]
    assert 1 <= store.resident_sessions <= 3
    await store.close()


async def test_a_session_larger_than_the_budget_stays_while_it_is_the_one_in_use(root: Path) -> None:
    """One long session alone over ``files.cache_mb`` is not read again at every call (that made
    each call O(history)); another session's call lets it go, and a budget of 0 keeps nothing."""
    store = await opened(root)
    big, small = await make_sessions(store, 2, 60, size=2000)  # ~0.2 MB each, over the budget below
    await store.close()

    store = await opened(root, cache_mb=0.05)
    for _ in range(3):
        assert len(await store.get_messages(big, caller=ALICE, first=1, last=60)) == 60
    assert store.stats.loads == 1 and store._sessions[big].resident
    assert store.held_bytes > int(0.05 * 1024 * 1024)  # over the budget by that one session only
    await store.get_messages(small, caller=ALICE, first=1, last=60)  # now the most recently used
    assert not store._sessions[big].resident and store._sessions[small].resident
    assert store.stats.loads == 2
    await store.close()

    store = await opened(root, cache_mb=0)
    for _ in range(2):
        await store.get_messages(big, caller=ALICE, first=1, last=60)
    assert store.stats.loads == 2 and not store._sessions[big].resident
    await store.close()


async def test_an_evicted_session_keeps_its_numbers_and_request_ids(root: Path) -> None:
    store = await opened(root, cache_mb=0)  # nothing held beyond the call using it
    a, b = await make_sessions(store, 2, 3)
    await store.get_messages(b, caller=ALICE, first=1, last=3)
    assert not store._sessions[a].resident  # evicted by the use of b
    replay = await store.append_messages(a, [user("again")], caller=ALICE, request_id="q1")
    assert replay.replayed and replay.sequence_numbers == [2]  # request ids came back with the rows
    await store.get_messages(b, caller=ALICE, first=1, last=3)
    result = await store.append_messages(a, [user("new")], caller=ALICE)
    assert result.sequence_numbers == [4]
    assert (await store.get_session(a, caller=ALICE)).last_sequence == 4
    await store.close()


async def test_rows_lost_behind_the_summary_keep_their_numbers(root: Path) -> None:
    store = await opened(root)
    (sid,) = await make_sessions(store, 1, 5)
    await store.close()
    store = await opened(root)  # a summary from the index: 5 rows
    path = log_of(root, sid)
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join(lines[:4]) + b"\n")  # the header and rows 1-3 left
    (root / "sessions" / f"{sid}.jsonl.mark").unlink()  # and no mark to tell
    rows = await store.get_messages(sid, caller=ALICE, first=1, last=9)
    assert [m.sequence_number for m in rows] == [1, 2, 3, 4, 5]
    assert rows[3].metadata == {LOST_KEY: True}
    with pytest.raises(SessionDamaged):
        await store.append_messages(sid, [user("x")], caller=ALICE)
    await store.close()


async def test_a_query_finds_rows_of_sessions_not_held(root: Path) -> None:
    store = await opened(root)
    sids = await make_sessions(store, 4, 2)
    await store.append_messages(sids[1], [user("the Quartz wyvern")], caller=ALICE)
    await store.append_messages(sids[2], [user("quartz wyvern, hidden", is_display=False)], caller=ALICE)
    await store.append_messages(sids[3], [user('a "quoted" quartz\\wyvern')], caller=ALICE)
    everything_held = [await listing(store, query=q) for q in ("quartz wyvern", '"quoted"', "zzz", "session 2")]
    await store.close()
    store = await opened(root, cache_mb=0)
    assert store.resident_sessions == 0
    assert [await listing(store, query=q) for q in ("quartz wyvern", '"quoted"', "zzz", "session 2")] == everything_held
    assert [s.id for s in (await listing(store, query="QUARTZ WYVERN"))[0]] == [sids[1]]
    assert (await listing(store, query='"quoted"'))[1] == 1 and (await listing(store, query="zzz"))[1] == 0
    await store.close()


# -- background compaction ---------------------------------------------------------------------------


async def test_a_log_due_for_compaction_at_open_is_compacted_in_the_background_without_loading(root: Path) -> None:
    store = await opened(root)
    (sid,) = await make_sessions(store, 1, 3)
    for i in range(30):
        await store.set_context_flags(sid, [1], caller=ALICE, is_context=i % 2 == 1)
    before = (await store.get_session(sid, caller=ALICE), await store.load_context(sid, caller=ALICE))
    await store.close()
    lines_before = len(log_of(root, sid).read_bytes().split(b"\n"))

    store = await opened(root, compact_min_records=10)
    async with asyncio.timeout(10):
        await store.compactions_done()
    assert store.stats.compactions == 1 and store.stats.loads == 0  # rewritten from the log, not loaded
    assert len(log_of(root, sid).read_bytes().split(b"\n")) == lines_before - 30
    assert (await store.get_session(sid, caller=ALICE), await store.load_context(sid, caller=ALICE)) == before
    await store.close()
    store = await opened(root)
    assert store.stats.index_hits == 1  # the index knows the rewritten log
    assert (await store.get_session(sid, caller=ALICE), await store.load_context(sid, caller=ALICE)) == before
    await store.close()


async def test_compaction_waits_for_the_session_and_loses_no_append(root: Path) -> None:
    store = await opened(root, compact_min_records=4, compact_records_per_row=0)
    (sid,) = await make_sessions(store, 1, 1)

    async def flags() -> None:
        for i in range(40):
            await store.set_context_flags(sid, [1], caller=ALICE, is_context=i % 2 == 1)

    async def appends() -> list[int]:
        got = []
        for i in range(40):
            got.extend((await store.append_messages(sid, [user(f"a{i}")], caller=ALICE)).sequence_numbers)
        return got

    _, numbers = await asyncio.gather(flags(), appends())
    async with asyncio.timeout(10):
        await store.compactions_done()
    assert numbers == list(range(2, 42)) and store.stats.compactions >= 3
    await store.close()
    store = await opened(root)
    rows = await store.get_messages(sid, caller=ALICE, first=1, last=99)
    assert [m.content for m in rows[1:]] == [f"a{i}" for i in range(40)]
    assert json.loads(log_of(root, sid).read_bytes().split(b"\n")[0])["r"]["t"] == "session"
    await store.close()


# -- read-only opening (maintain --dry-run beside a server) -----------------------------------------


async def test_a_read_only_store_needs_no_lock_and_writes_nothing(root: Path) -> None:
    server = await opened(root)
    sids = await make_sessions(server, 3, 2)
    await server.append_messages(sids[0], [user("unindexed yet")], caller=ALICE)

    def snapshot() -> dict[str, tuple[int, int]]:
        return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}

    files_before = snapshot()
    reader = FilesStore(root, Settings(), read_only=True)
    await reader.open()  # the server holds the lock: a read-only store does not need it
    assert {s.id for s in (await reader.list_sessions(caller=ADMIN, offset=0, limit=10)).sessions} == set(sids)
    assert (await reader.get_session(sids[0], caller=ADMIN)).last_sequence == 3
    candidates, _other = await reader.maintenance_candidates()
    assert {c.session_id for c in candidates} == set(sids) and all(c.size_bytes > 0 for c in candidates)
    await reader.close()
    assert snapshot() == files_before
    await server.append_messages(sids[0], [user("still the writer")], caller=ALICE)  # the server is unharmed
    await server.close()
