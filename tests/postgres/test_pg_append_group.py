"""Issue #15, round 9: PostgreSQL appends waiting together commit together (``_APPEND_GROUP_SQL``).

One transaction per batch (asyncpg's ``fetchmany``: one round trip, one commit), so what must hold
is what each append alone gave: every caller gets its own statement's outcome (numbers, a replay,
an unknown session, an error), a failing statement costs the others nothing, no append deadlocks
against another batch or a lone append, and watchers see every event exactly once, in id order,
gap-free, on the all-sessions stream and on every session's stream (live and resumed).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator

import pytest

from contextsvc.config import Settings
from contextsvc.core.messages import Message, Role
from contextsvc.core.session import Principal
from contextsvc.errors import InvalidArgument, NotFound
from contextsvc.ports import AppendEvent, AppendResult
from contextsvc.stores.postgres import PostgresEventBus, PostgresStore, make_postgres_store
from tests.postgres.conftest import pg_settings
from tests.postgres.test_pg_bus import ADMIN, Collector, until

ALICE = Principal(user_id="alice")
UNKNOWN = "99999999-9999-4999-8999-999999999999"


def _event() -> AppendEvent:
    return AppendEvent("messages_appended", {"request_id": "", "turn_complete": False})


def _rows(*texts: str) -> list[Message]:
    return [Message(role=Role.USER, content=t) for t in texts]


@pytest.fixture
def settings() -> Settings:
    return pg_settings(append_lanes=3, append_group_max=8, event_retention_count=100_000)


@pytest.fixture
async def store_and_bus(postgres_db: str, settings: Settings) -> AsyncIterator[tuple[PostgresStore, PostgresEventBus]]:
    store = await make_postgres_store(postgres_db, settings)
    bus = store.make_event_bus()
    try:
        yield store, bus
    finally:
        await bus.close()
        await store.close()


async def _sessions(store: PostgresStore, n: int) -> list[str]:
    return [(await store.create_session(caller=ALICE, profile_id="default")).id for _ in range(n)]


async def test_concurrent_appends_to_many_sessions_lose_nothing_and_keep_every_stream_gap_free(
    store_and_bus: tuple[PostgresStore, PostgresEventBus],
) -> None:
    store, bus = store_and_bus
    sids = await _sessions(store, 12)
    # One event first, so the first id below is > 1 (a resume from 0 would mean "live only").
    (warm,) = await _sessions(store, 1)
    await store.append_messages(warm, _rows("warm"), caller=ALICE, event=_event())
    everything = Collector(bus)
    per_session = {sid: Collector(bus, session_id=sid) for sid in sids}
    for w in [everything, *per_session.values()]:
        await w.started()
    rng = random.Random(9)
    plan = [rng.choice(sids) for _ in range(360)]
    done: dict[str, list[AppendResult]] = {sid: [] for sid in sids}

    async def writer(k: int) -> None:
        for i in range(k, len(plan), 40):
            sid = plan[i]
            # A session's appends come from many writers at once: their order is the store's
            # numbering, so results are compared by their numbers, not by issue order.
            done[sid].append(await store.append_messages(sid, _rows(f"q{i}", f"a{i}"), caller=ALICE, event=_event()))

    started = time.monotonic()
    await asyncio.gather(*(writer(k) for k in range(40)))
    elapsed = time.monotonic() - started
    group = store._append_group
    assert group.batches > 0 and group.grouped > group.batches  # batches did form
    assert group.failed == 0  # no batch failed (a deadlock would have: PostgreSQL aborts one)
    assert elapsed < 20
    events = await everything.wait_for(len(plan))
    ids = [e.event_id for e in events]
    assert ids == list(range(ids[0], ids[0] + len(plan)))  # in id order, none lost, no gap
    by_id = {e.event_id: e for e in events}
    for sid in sids:
        results = sorted(done[sid], key=lambda r: r.sequence_numbers[0])
        numbers = [n for r in results for n in r.sequence_numbers]
        assert numbers == list(range(1, 2 * len(results) + 1))  # rows numbered without gaps
        stored = await store.load_context(sid, caller=ALICE)
        assert [m.sequence_number for m in stored] == numbers
        # The session's stream: one event per append, in the session's order, ids increasing.
        mine = await per_session[sid].wait_for(len(results))
        assert [e.event_id for e in mine] == sorted(r.event_id for r in results)
        assert [dict(e.payload)["sequence_numbers"] for e in mine] == [r.sequence_numbers for r in results]
        assert all(by_id[r.event_id].session_id == sid for r in results)
        # Resumed from before its first event: the same events again, in the same order.
        resumed = Collector(bus, session_id=sid, after_event_id=mine[0].event_id - 1)
        assert [e.event_id for e in await resumed.wait_for(len(mine))] == [e.event_id for e in mine]
        await resumed.stop()
    await asyncio.sleep(0.3)
    assert len(everything.events) == len(plan)  # nothing twice
    for w in [everything, *per_session.values()]:
        await w.stop()


async def test_lone_appends_and_batches_on_the_same_sessions_never_deadlock(
    postgres_db: str, store_and_bus: tuple[PostgresStore, PostgresEventBus], settings: Settings
) -> None:
    """Two stores (two replicas): one batches, the other appends one at a time (group max 1),
    both on the same few sessions in random orders. A row lock taken under the publish lock
    would deadlock them (PostgreSQL then aborts one after ``deadlock_timeout``)."""
    batching, bus = store_and_bus
    lone_settings = settings.model_copy(
        update={"postgres": settings.postgres.model_copy(update={"append_group_max": 1})}
    )
    lone = await make_postgres_store(postgres_db, lone_settings)
    lone_bus = lone.make_event_bus()
    try:
        sids = await _sessions(batching, 5)
        everything = Collector(bus)
        await everything.started()
        rng = random.Random(15)

        async def writer(store: PostgresStore, k: int) -> int:
            n = 0
            for _ in range(12):
                await store.append_messages(rng.choice(sids), _rows(f"w{k}"), caller=ALICE, event=_event())
                n += 1
            return n

        counts = await asyncio.wait_for(
            asyncio.gather(*(writer(batching, k) for k in range(20)), *(writer(lone, k) for k in range(10))), 30
        )
        assert batching._append_group.failed == 0 and batching._append_group.batches > 0
        total = sum(counts)
        ids = [e.event_id for e in await everything.wait_for(total)]
        assert ids == list(range(ids[0], ids[0] + total))
        for sid in sids:
            info = await batching.get_session(sid, caller=ALICE)
            stored = await batching.load_context(sid, caller=ALICE)
            assert [m.sequence_number for m in stored] == list(range(1, info.last_sequence + 1))
        await everything.stop()
    finally:
        await lone_bus.close()
        await lone.close()


async def test_each_caller_of_a_batch_gets_its_own_outcome(postgres_db: str) -> None:
    """One lane, so every append below waits behind the first and they run as one batch: a new
    append, an unknown session, a replay of a request in the same batch, a foreign caller."""
    store = await make_postgres_store(postgres_db, pg_settings(append_lanes=1))
    bus = store.make_event_bus()
    try:
        a, b = await _sessions(store, 2)
        watcher = Collector(bus)
        await watcher.started()
        ev = _event()
        outcomes = await asyncio.gather(
            store.append_messages(a, _rows("one", "two"), caller=ALICE, event=_event()),
            store.append_messages(UNKNOWN, _rows("lost"), caller=ALICE, event=_event()),
            store.append_messages(b, _rows("x"), caller=ALICE, request_id="r1", request_fingerprint="f", event=ev),
            store.append_messages(b, _rows("x"), caller=ALICE, request_id="r1", request_fingerprint="f", event=ev),
            store.append_messages(a, _rows("not yours"), caller=Principal(user_id="bob"), event=_event()),
            store.append_messages(a, _rows("three"), caller=ALICE, event=_event()),
            return_exceptions=True,
        )
        assert store._append_group.batches == 1 and store._append_group.grouped == 6
        first, unknown, new, replay, foreign, last = outcomes
        assert isinstance(first, AppendResult) and first.sequence_numbers == [1, 2] and first.event_id
        assert isinstance(unknown, NotFound) and isinstance(foreign, NotFound)
        assert isinstance(new, AppendResult) and new.sequence_numbers == [1] and not new.replayed
        assert isinstance(replay, AppendResult) and replay.replayed and replay.sequence_numbers == [1]
        assert isinstance(last, AppendResult) and last.sequence_numbers == [3]
        assert last.session.last_sequence == 3 and last.session.display_message_count == 3
        got = await watcher.wait_for(3)
        assert [e.event_id for e in got] == [first.event_id, new.event_id, last.event_id]
        await asyncio.sleep(0.3)
        assert len(watcher.events) == 3  # none for the unknown, the replay or the foreign caller
        await watcher.stop()
    finally:
        await bus.close()
        await store.close()


async def test_a_failing_statement_fails_alone_and_the_rest_of_its_batch_commits(postgres_db: str) -> None:
    store = await make_postgres_store(postgres_db, pg_settings(append_lanes=1))
    bus = store.make_event_bus()
    try:
        (sid,) = await _sessions(store, 1)
        watcher = Collector(bus, session_id=sid)
        await watcher.started()
        outcomes = await asyncio.gather(
            store.append_messages(sid, _rows("before"), caller=ALICE, event=_event()),
            store.append_messages(sid, _rows("bad \x00 byte"), caller=ALICE, event=_event()),
            store.append_messages(sid, _rows("after"), caller=ALICE, event=_event()),
            return_exceptions=True,
        )
        assert store._append_group.failed == 1  # the batch rolled back, then each ran alone
        before, bad, after = outcomes
        assert isinstance(bad, InvalidArgument)
        assert isinstance(before, AppendResult) and before.sequence_numbers == [1]
        assert isinstance(after, AppendResult) and after.sequence_numbers == [2]
        stored = await store.load_context(sid, caller=ALICE)
        assert [m.content for m in stored] == ["before", "after"]
        got = await watcher.wait_for(2)
        assert [dict(e.payload)["sequence_numbers"] for e in got] == [[1], [2]]
        await asyncio.sleep(0.3)
        assert len(watcher.events) == 2
        await watcher.stop()
    finally:
        await bus.close()
        await store.close()


async def test_nobody_watching_on_a_replica_costs_no_event_query(
    store_and_bus: tuple[PostgresStore, PostgresEventBus],
) -> None:
    """The bus's feed reads the events table for its watchers; once the last one leaves, appends
    (and their notifications, and the poll) make it read nothing until a watcher comes back."""
    store, bus = store_and_bus
    (sid,) = await _sessions(store, 1)
    watcher = Collector(bus, session_id=sid)
    await watcher.started()
    await store.append_messages(sid, _rows("seen"), caller=ALICE, event=_event())
    await watcher.wait_for(1)
    await watcher.stop()
    await until(lambda: bus._head is None)  # the feed let its window go
    fetches = bus.feed_fetches
    for i in range(20):
        await store.append_messages(sid, _rows(f"unseen {i}"), caller=ALICE, event=_event())
    await asyncio.sleep(1.0)  # notifications and three polls (event_poll_seconds 0.3) went by
    assert bus.feed_fetches == fetches
    back = Collector(bus, session_id=sid)
    await back.started()
    sent = await store.append_messages(sid, _rows("seen again"), caller=ALICE, event=_event())
    (event,) = await back.wait_for(1)
    assert event.event_id == sent.event_id
    assert bus.feed_fetches > fetches
    admin = Collector(bus, caller=ADMIN, after_event_id=event.event_id - 21)  # a resume reads the table
    got = await admin.wait_for(21)
    assert [dict(e.payload)["sequence_numbers"] for e in got] == [[i] for i in range(2, 23)]
    await admin.stop()
    await back.stop()
