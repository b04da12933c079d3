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
from contextsvc.core.calibration import Observation
from contextsvc.core.messages import Message, Role
from contextsvc.core.session import Principal
from contextsvc.ports import AppendEvent, BaselineWrite, StoredEvent
from contextsvc.stores.postgres import PostgresEventBus, PostgresStore, make_postgres_event_bus
from contextsvc.stores.postgres.bus import NOTICE_BYTES, PUBLISH_LOCK
from tests.postgres.conftest import pg_settings
from tests.postgres.test_pg_bus import ADMIN, Collector

ALICE = Principal(user_id="alice")
POLL = 0.3  # pg_settings' event_poll_seconds: each poll may read once


@pytest.fixture
def settings() -> Settings:
    return pg_settings(event_retention_count=100_000)


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


async def _table(postgres_db: str, settings: Settings, after: int, count: int) -> list[StoredEvent]:
    """``count`` events after ``after``, read from the table: a resumed stream on a replica of its
    own, whose window starts at "now" (the watched replica would serve them from its window)."""
    assert after > 0  # 0 would mean "live only"
    reader = await make_postgres_event_bus(postgres_db, settings)
    resumed = Collector(reader, caller=ADMIN, after_event_id=after)
    try:
        return list(await resumed.wait_for(count))[:count]
    finally:
        await resumed.stop()
        await reader.close()


async def _watching(
    store: PostgresStore, bus: PostgresEventBus, *, every_session: bool = False
) -> tuple[str, Collector]:
    """A new session, watched on ``bus`` (or all sessions, ``every_session``), after its first
    event reached the watcher: the window now ends at that event. An event of another session
    comes first, so the first event's id is > 1 (a resume from just before it reads it)."""
    warm = (await store.create_session(caller=ALICE, profile_id="default")).id
    await store.append_messages(warm, _rows("warm"), caller=ALICE, event=_event())
    sid = (await store.create_session(caller=ALICE, profile_id="default")).id
    watcher = Collector(bus) if every_session else Collector(bus, session_id=sid)
    await watcher.started()
    await bus.wait_listening()
    await store.append_messages(sid, _rows("first"), caller=ALICE, event=_event())
    await watcher.wait_for(1)
    return sid, watcher


async def test_another_replicas_appends_reach_watchers_from_their_notifications_alone(
    store: PostgresStore, watched_bus: PostgresEventBus, postgres_db: str, settings: Settings
) -> None:
    sid, watcher = await _watching(store, watched_bus)
    appends = 30
    before, began = watched_bus.feed_fetches, time.monotonic()
    for i in range(appends):
        texts = [f"m{i}"] if i % 3 else [f"m{i}", f"n{i}"]  # one or two rows: the numbers differ
        await store.append_messages(sid, _rows(*texts), caller=ALICE, event=_event())
    got = await watcher.wait_for(appends + 1)
    polls = (time.monotonic() - began) / POLL + 1
    assert watched_bus.feed_fetches - before <= polls  # one read an append before notices
    assert got == await _table(postgres_db, settings, got[0].event_id - 1, appends + 1)
    await watcher.stop()


async def test_every_publishing_statement_notifies_its_event_as_the_table_holds_it(
    store: PostgresStore, watched_bus: PostgresEventBus, postgres_db: str, settings: Settings
) -> None:
    """The bus's own publish (odd text and nested values in its payload), an append (its payload
    computed in SQL), a baseline's observation alone and a baseline with its anchor: each event
    reaches the watching replica from its notification, equal to what the table holds."""
    sid, everything = await _watching(store, watched_bus, every_session=True)
    publisher = store.make_event_bus()
    before, began = watched_bus.feed_fetches, time.monotonic()
    try:
        payload = {"text": 'quote " and \\ and \u2028 and é', "nested": {"a": [1, 2.5, None, True]}, "n": 10**15}
        sent = await publisher.publish(session_id=sid, user_id="alice", kind="context_compressed", payload=payload)
        await store.append_messages(sid, _rows("a", "b", "c"), caller=ALICE, event=_event())
        observed = BaselineWrite("hp", Observation(chars=40, tokens=77, features=()), "baseline_recorded", {"n": 1})
        assert await store.observe_baseline(sid, caller=ALICE, write=observed)
        read = await store.get_session(sid, caller=ALICE)
        anchored = BaselineWrite("hp", Observation(chars=40, tokens=99, features=()), "baseline_recorded", {"n": 2})
        state = {**read.state, "baseline": {"tokens": 99}}
        assert (
            await store.anchor_baseline(sid, caller=ALICE, read=read, context_tokens=99, state=state, write=anchored)
            is not None
        )
        got = (await everything.wait_for(5))[1:]
    finally:
        await publisher.close()
    polls = (time.monotonic() - began) / POLL + 1
    assert watched_bus.feed_fetches - before <= polls
    assert got[0] == sent
    assert [e.kind for e in got] == [
        "context_compressed",
        "messages_appended",
        "baseline_recorded",
        "baseline_recorded",
    ]
    assert dict(got[1].payload)["sequence_numbers"] == [2, 3, 4]
    assert got == await _table(postgres_db, settings, got[0].event_id - 1, 4)
    await everything.stop()


async def test_an_event_that_does_not_follow_the_window_makes_the_feed_read_and_nothing_is_lost(
    store: PostgresStore, watched_bus: PostgresEventBus, postgres_db: str, settings: Settings
) -> None:
    """Two gaps before a notified event: an id drawn by a rolled-back insert (never visible) and an
    event committed under the publish lock without a notification (visible, announced by
    nobody). The notified event does not follow the window, so the feed reads the table: the
    silent event is delivered, in order, with the notified one."""
    sid, watcher = await _watching(store, watched_bus)
    insert = "INSERT INTO events (session_id, user_id, kind, payload, time) VALUES ($1, 'alice', $2, '{}', now())"
    conn = await asyncpg.connect(postgres_db)
    try:
        rolled_back = conn.transaction()
        await rolled_back.start()
        await conn.execute(insert, sid, "rolled_back")
        await rolled_back.rollback()
        async with conn.transaction():  # as a publisher does, minus the notification
            await conn.execute("SELECT pg_advisory_xact_lock($1)", PUBLISH_LOCK)
            await conn.execute(insert, sid, "silent")
    finally:
        await conn.close()
    await store.append_messages(sid, _rows("after"), caller=ALICE, event=_event())
    got = await watcher.wait_for(3)
    assert [e.kind for e in got] == ["messages_appended", "silent", "messages_appended"]
    assert got[1].event_id == got[0].event_id + 2 and got[2].event_id == got[1].event_id + 1
    assert got == await _table(postgres_db, settings, got[0].event_id - 1, 3)
    await watcher.stop()


async def test_an_event_too_large_to_carry_is_notified_by_id_and_read_from_the_table(
    store: PostgresStore, watched_bus: PostgresEventBus
) -> None:
    sid, watcher = await _watching(store, watched_bus)
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
