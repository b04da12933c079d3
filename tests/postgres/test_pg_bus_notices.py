"""Notifications carry their events (``bus.notice``): a replica's feed takes an event that directly
follows its window from the notification, without reading the table, and reads the table for
anything else (a gap left by a rolled-back id, an event too large to carry). What watchers get
either way is exactly what the table holds."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import asyncpg
import pytest

from contextsvc.config import Settings
from contextsvc.core.messages import Message, Role
from contextsvc.core.session import Principal
from contextsvc.ports import AppendEvent, StoredEvent
from contextsvc.stores.postgres import PostgresEventBus, PostgresStore, make_postgres_event_bus, make_postgres_store
from contextsvc.stores.postgres.bus import NOTICE_BYTES
from tests.postgres.conftest import pg_settings
from tests.postgres.test_pg_bus import ADMIN, Collector

ALICE = Principal(user_id="alice")
POLL = 0.3  # pg_settings' event_poll_seconds: each poll may read once


@pytest.fixture
def settings() -> Settings:
    return pg_settings(event_retention_count=100_000)


@pytest.fixture
async def store(postgres_db: str, settings: Settings) -> AsyncIterator[PostgresStore]:
    made = await make_postgres_store(postgres_db, settings)
    try:
        # One event first, so the tests' first id is > 1 (a resume from 0 would mean "live only").
        warm = (await made.create_session(caller=ALICE, profile_id="default")).id
        await made.append_messages(warm, _rows("warm"), caller=ALICE, event=_event())
        yield made
    finally:
        await made.close()


@pytest.fixture
async def watched_bus(postgres_db: str, settings: Settings) -> AsyncIterator[PostgresEventBus]:
    """A replica that only watches (its own pool): every event reaches it by notification."""
    bus = await make_postgres_event_bus(postgres_db, settings)
    try:
        yield bus
    finally:
        await bus.close()


def _event() -> AppendEvent:
    return AppendEvent("messages_appended", {"request_id": "", "turn_complete": False})


def _rows(*texts: str) -> list[Message]:
    return [Message(role=Role.USER, content=t) for t in texts]


async def _table(bus: PostgresEventBus, after: int, count: int) -> list[StoredEvent]:
    """``count`` events after ``after`` as a resumed stream reads them: from the table."""
    assert after > 0  # 0 would mean "live only"
    resumed = Collector(bus, caller=ADMIN, after_event_id=after)
    try:
        return list(await resumed.wait_for(count))[:count]
    finally:
        await resumed.stop()


async def test_another_replicas_appends_reach_watchers_from_their_notifications_alone(
    store: PostgresStore, watched_bus: PostgresEventBus
) -> None:
    sid = (await store.create_session(caller=ALICE, profile_id="default")).id
    watcher = Collector(watched_bus, session_id=sid)
    await watcher.started()
    await watched_bus.wait_listening()
    await store.append_messages(sid, _rows("first"), caller=ALICE, event=_event())
    await watcher.wait_for(1)  # the window now ends at the newest event
    appends = 30
    before, began = watched_bus.feed_fetches, time.monotonic()
    for i in range(appends):
        texts = [f"m{i}"] if i % 3 else [f"m{i}", f"n{i}"]  # one or two rows: the numbers differ
        await store.append_messages(sid, _rows(*texts), caller=ALICE, event=_event())
    got = await watcher.wait_for(appends + 1)
    polls = (time.monotonic() - began) / POLL + 1
    assert watched_bus.feed_fetches - before <= polls  # one read an append before notices
    assert got == await _table(watched_bus, got[0].event_id - 1, appends + 1)
    await watcher.stop()


async def test_a_baseline_event_and_a_published_one_carry_the_same_as_the_table(
    store: PostgresStore, watched_bus: PostgresEventBus
) -> None:
    """Every statement that publishes notifies with the event whole: the bus's own publish, with
    odd text and nested values in its payload, and an append's computed payload."""
    sid = (await store.create_session(caller=ALICE, profile_id="default")).id
    everything = Collector(watched_bus)
    await everything.started()
    await watched_bus.wait_listening()
    publisher = store.make_event_bus()
    try:
        payload = {"text": 'quote " and \\ and \u2028 and é', "nested": {"a": [1, 2.5, None, True]}, "n": 10**15}
        sent = await publisher.publish(session_id=sid, user_id="alice", kind="context_compressed", payload=payload)
        await store.append_messages(sid, _rows("a", "b", "c"), caller=ALICE, event=_event())
        got = await everything.wait_for(2)
    finally:
        await publisher.close()
    assert got[0] == sent
    assert dict(got[1].payload)["sequence_numbers"] == [1, 2, 3]
    assert got == await _table(watched_bus, got[0].event_id - 1, 2)
    await everything.stop()


async def test_an_id_left_by_a_rolled_back_publish_makes_the_feed_read_and_nothing_is_lost(
    store: PostgresStore, watched_bus: PostgresEventBus, postgres_db: str
) -> None:
    sid = (await store.create_session(caller=ALICE, profile_id="default")).id
    watcher = Collector(watched_bus, session_id=sid)
    await watcher.started()
    await watched_bus.wait_listening()
    await store.append_messages(sid, _rows("before"), caller=ALICE, event=_event())
    await watcher.wait_for(1)
    conn = await asyncpg.connect(postgres_db)
    try:  # an event id drawn and never committed: the next notification does not follow the window
        tx = conn.transaction()
        await tx.start()
        await conn.execute(
            "INSERT INTO events (session_id, user_id, kind, payload, time) VALUES ($1, 'alice', 'x', '{}', now())", sid
        )
        await tx.rollback()
    finally:
        await conn.close()
    before = watched_bus.feed_fetches
    await store.append_messages(sid, _rows("after"), caller=ALICE, event=_event())
    got = await watcher.wait_for(2)
    assert watched_bus.feed_fetches > before
    assert got[1].event_id == got[0].event_id + 2
    assert got == await _table(watched_bus, got[0].event_id - 1, 2)
    await watcher.stop()


async def test_an_event_too_large_to_carry_is_notified_by_id_and_read_from_the_table(
    store: PostgresStore, watched_bus: PostgresEventBus
) -> None:
    sid = (await store.create_session(caller=ALICE, profile_id="default")).id
    watcher = Collector(watched_bus, session_id=sid)
    await watcher.started()
    await watched_bus.wait_listening()
    await store.append_messages(sid, _rows("small"), caller=ALICE, event=_event())
    await watcher.wait_for(1)
    publisher = store.make_event_bus()
    try:
        before = watched_bus.feed_fetches
        big = {"blob": "x" * (NOTICE_BYTES + 100)}
        sent = await publisher.publish(session_id=sid, user_id="alice", kind="context_compressed", payload=big)
        got = await watcher.wait_for(2)
    finally:
        await publisher.close()
    assert watched_bus.feed_fetches > before
    assert got[1] == sent and dict(got[1].payload) == big
    await watcher.stop()
