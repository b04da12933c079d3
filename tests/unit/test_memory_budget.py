"""One memory budget (``files.cache_mb``) bounds everything held per session touched (issue #9):
the files store's rows, the engine's reused views and per-message memos, and the API adapter's
encoded messages. A session the store lets go is dropped from every cache."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from contextsvc.api.mapping import message_to_pb
from contextsvc.api.wire import ENTRY_OVERHEAD_BYTES, WireCache, encode_build_response, frame
from contextsvc.config import Durability, FilesSettings, Settings
from contextsvc.core import sizing
from contextsvc.core.message_memo import IdentityMemo
from contextsvc.core.messages import Message, Role
from contextsvc.core.profile import ProfileOverrides
from contextsvc.core.session import ANONYMOUS
from contextsvc.engine.engine import Engine
from contextsvc.server import share_memory_budget
from contextsvc.stores.files import FilesStore
from tests.support.engines import make_engine
from tests.support.stores import TickingClock
from tests.unit.test_wire import stored

MB = 1024 * 1024
SESSIONS = 40
ROWS = 30


@dataclass
class World:
    store: FilesStore
    engine: Engine
    wire: WireCache
    sids: list[str]
    budget: int

    async def build(self, sid: str) -> None:
        built = await self.engine.build_context(
            ANONYMOUS, sid, profile=ProfileOverrides(), incoming=None, mid_turn=False, auto_compress=False
        )
        encode_build_response(built, sid, self.wire)


async def open_world(root: Path, cache_mb: float, sids: list[str]) -> World:
    settings = Settings(durability=Durability.BATCH, files=FilesSettings(cache_mb=cache_mb))
    store = FilesStore(root, settings, clock=TickingClock())
    await store.open()
    engine = make_engine(store, settings)
    wire = WireCache(64 * MB)  # far above the budget: only the shared budget can bound it
    share_memory_budget(store, engine, wire)
    return World(store, engine, wire, sids, int(cache_mb * MB))


@pytest.fixture
async def data(tmp_path: Path) -> AsyncIterator[tuple[Path, list[str]]]:
    root = tmp_path / "data"
    yield root, await write_sessions(root)


async def write_sessions(root: Path) -> list[str]:
    """SESSIONS sessions of ROWS rows (~300 characters each), written and closed: nothing held."""
    world = await open_world(root, 64, [])
    sids = []
    for s in range(SESSIONS):
        sid = (await world.store.create_session(caller=ANONYMOUS, profile_id="", name=f"s{s}")).id
        rows = [
            Message(role=Role.USER if r % 2 == 0 else Role.ASSISTANT, content=f"s{s} r{r} " + "lorem ipsum " * 25)
            for r in range(ROWS)
        ]
        await world.store.append_messages(sid, rows, caller=ANONYMOUS)
        sids.append(sid)
    await world.engine.close()
    await world.store.close()
    return sids


async def close(world: World) -> None:
    await world.engine.close()
    await world.store.close()


async def test_a_session_the_store_lets_go_leaves_every_cache(data: tuple[Path, list[str]]) -> None:
    root, sids = data
    world = await open_world(root, 0.25, sids)
    for sid in sids:
        await world.build(sid)
        # The encodings are counted with the rows: the one budget holds them all.
        assert world.store.held_bytes <= world.budget
    wire = world.wire.stats()
    assert 0 < wire["bytes"] < world.store.held_bytes
    held = [sid for sid in sids if world.store._sessions[sid].resident]
    gone = [sid for sid in sids if sid not in held]
    assert 1 <= len(held) <= SESSIONS // 4 and sids[-1] in held
    for sid in gone:
        assert not world.wire.holds(sid), sid
        assert sid not in world.engine.views._memo, sid
        assert sid not in world.engine.views._saved, sid
    assert wire["sessions"] <= len(held)
    # Built again: read from the log, encoded again, and the bound still holds.
    for sid in gone[:3]:
        await world.build(sid)
        assert world.wire.holds(sid)
        assert world.store.held_bytes <= world.budget
    await close(world)


async def test_a_deleted_session_leaves_every_cache(data: tuple[Path, list[str]]) -> None:
    root, sids = data
    world = await open_world(root, 64, sids)
    await world.build(sids[0])
    assert world.wire.holds(sids[0]) and sids[0] in world.engine.views._memo
    before = world.store.held_bytes
    await world.store.delete_session(sids[0], caller=ANONYMOUS)
    assert not world.wire.holds(sids[0]) and sids[0] not in world.engine.views._memo
    assert world.store.held_bytes < before
    # A cache reporting bytes for a session that no longer exists is not counted.
    world.store.hold_outside(sids[0], 10_000)
    assert sids[0] not in world.store._lru
    await close(world)


async def test_memory_after_touching_every_session_stays_within_the_budget(data: tuple[Path, list[str]]) -> None:
    """What the process really allocates (tracemalloc) for SESSIONS sessions built and encoded
    stays within the budget: the store's estimate covers every cache of the rows it holds."""
    root, sids = data
    world = await open_world(root, 0.5, sids)
    await world.build(sids[0])  # first-use costs (model calibration, counters) out of the way
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for sid in sids[1:]:
            await world.build(sid)
        # The process-wide text memos are bounded on their own (``core.sizing``), not per session.
        sizing.clear_caches()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert world.store.stats.evictions >= SESSIONS // 2
    # Every session touched keeps its summary (header, counters, engine state, index line: ~2 KB
    # here) whatever the budget; the rows and every cache of them are what the budget bounds.
    summaries = SESSIONS * 2048
    assert grown <= world.budget + summaries, f"{grown / MB:.2f} MB held for a budget of {world.budget / MB:.2f} MB"
    await close(world)


def test_a_memo_entry_is_small() -> None:
    """Two memos (size, features) hold an entry per stored row built into a view: ~190 bytes
    each now, ~520 with a closure, a tuple and a plain weak reference per entry."""
    memo: IdentityMemo[int] = IdentityMemo()
    rows = [Message(role=Role.USER, content="x" * i) for i in range(5000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for m in rows:
            memo.get(m, lambda m: len(m.content) + 1000)
        per_entry = (tracemalloc.get_traced_memory()[0] - before) / len(rows)
    finally:
        tracemalloc.stop()
    assert per_entry < 260, per_entry
    del rows, m
    gc.collect()
    assert len(memo) == 0


def test_the_wire_cache_reports_each_session_and_drops_the_least_recently_used_first() -> None:
    told: list[tuple[str, int]] = []
    row = "z" * 150
    one = len(frame(message_to_pb(stored(1, row)).SerializeToString())) + ENTRY_OVERHEAD_BYTES
    cache = WireCache(10 * one, on_size=lambda sid, n: told.append((sid, n)))
    for sid in ("a", "b"):
        for seq in range(1, 5):
            cache.framed(sid, stored(seq, row))
        cache.told(sid)
    assert told == [("a", 4 * one), ("b", 4 * one)]
    cache.framed("a", stored(1, row))  # a hit: "a" is the most recently used now
    for seq in range(5, 8):
        cache.framed("c", stored(seq, row))
    # "b" went whole (least recently used), not the oldest rows of every session, and was told.
    assert told[-1] == ("b", 0) and not cache.holds("b")
    assert cache.session_bytes("a") == 4 * one and cache.session_bytes("c") == 3 * one
    # One session alone over the bound keeps its newest rows.
    for seq in range(8, 30):
        cache.framed("c", stored(seq, row))
    assert not cache.holds("a") and cache.stats()["bytes"] <= 10 * one
    cache.framed("c", stored(29, row))
    assert cache.stats()["hits"] == 2
    before = len(told)
    cache.forget_session("c")  # asked for: nobody is told
    assert len(told) == before and cache.stats()["bytes"] == 0 and cache.stats()["sessions"] == 0
