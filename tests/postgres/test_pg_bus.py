"""The PostgreSQL event bus: events cross buses (replicas) in id order, without gaps or duplicates."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from contextsvc.config import Settings
from contextsvc.core.session import Principal
from contextsvc.errors import EventIdAhead
from contextsvc.ports import StoredEvent
from contextsvc.stores.postgres import LISTEN_APPLICATION_NAME, PostgresEventBus, PostgresStore, make_postgres_event_bus
from tests.postgres.conftest import pg_settings

ADMIN = Principal("root", is_admin=True)
ALICE = Principal("alice")
S1 = "11111111-1111-4111-8111-111111111111"
S2 = "22222222-2222-4222-8222-222222222222"
WAIT = 15.0  # bound on every wait; events normally arrive in milliseconds


class Collector:
    """Reads a subscription in the background."""

    def __init__(self, bus: PostgresEventBus, caller: Principal = ADMIN, **kwargs: object) -> None:
        self.subscription = bus.subscribe(caller=caller, **kwargs)  # type: ignore[arg-type]
        self.events: list[StoredEvent] = []
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        async for event in self.subscription:
            self.events.append(event)

    async def started(self) -> None:
        """Live subscriptions start at the first read: wait until it fixed its position."""
        await until(lambda: self.subscription.position is not None)

    async def wait_for(self, count: int) -> list[StoredEvent]:
        await until(lambda: len(self.events) >= count or self.task.done())
        if self.task.done():
            self.task.result()
        return self.events

    async def stop(self) -> None:
        await self.subscription.aclose()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def until(condition: Callable[[], bool]) -> None:
    """Wait, at most ``WAIT`` seconds, for a condition that another task makes true."""
    async with asyncio.timeout(WAIT):
        while not condition():  # noqa: ASYNC110 - conditions on other objects' state, not one event
            await asyncio.sleep(0.01)


@pytest.fixture
def settings() -> Settings:
    return pg_settings(event_retention_count=10)


@pytest.fixture
async def make_bus(postgres_db: str, settings: Settings) -> AsyncIterator[Callable[[], Awaitable[PostgresEventBus]]]:
    made: list[PostgresEventBus] = []

    async def make() -> PostgresEventBus:
        bus = await make_postgres_event_bus(postgres_db, settings)
        made.append(bus)
        return bus

    yield make
    for bus in made:
        await bus.close()


async def publish(bus: PostgresEventBus, n: int, *, session_id: str = S1, user_id: str = "alice") -> list[StoredEvent]:
    return [
        await bus.publish(session_id=session_id, user_id=user_id, kind="messages_appended", payload={"n": i})
        for i in range(n)
    ]


async def test_events_published_on_one_bus_arrive_on_another_in_order(make_bus: Callable[..., Any]) -> None:
    a, b = await make_bus(), await make_bus()
    watcher = Collector(b)
    await watcher.started()
    sent = await publish(a, 5)

    async def burst(k: int) -> list[StoredEvent]:
        return [
            await a.publish(session_id=S2, user_id="bob", kind="context_compressed", payload={"k": k, "i": i})
            for i in range(10)
        ]

    for batch in await asyncio.gather(*(burst(k) for k in range(4))):
        sent += batch
    got = await watcher.wait_for(len(sent))
    assert [e.event_id for e in got] == sorted(e.event_id for e in sent)
    assert {e.event_id: (e.session_id, e.user_id, e.kind, dict(e.payload)) for e in got} == {
        e.event_id: (e.session_id, e.user_id, e.kind, dict(e.payload)) for e in sent
    }
    await asyncio.sleep(0.5)  # nothing more, nothing twice
    assert len(watcher.events) == len(sent)
    await watcher.stop()


async def test_concurrent_publishers_on_two_buses_leave_no_gap(make_bus: Callable[..., Any]) -> None:
    """Ids are committed in the order they are taken, so a reader never skips a late commit."""
    a, b, c = await make_bus(), await make_bus(), await make_bus()
    watcher = Collector(c)
    await watcher.started()

    async def many(bus: PostgresEventBus) -> list[StoredEvent]:
        return [e for batch in await asyncio.gather(*(publish(bus, 10) for _ in range(5))) for e in batch]

    sent = [e for batch in await asyncio.gather(many(a), many(b)) for e in batch]
    got = await watcher.wait_for(len(sent))
    assert [e.event_id for e in got] == sorted(e.event_id for e in sent)
    await watcher.stop()


async def test_resume_from_an_event_id_replays_then_follows(make_bus: Callable[..., Any]) -> None:
    a, b = await make_bus(), await make_bus()
    sent = await publish(a, 8)
    resumed = Collector(b, after_event_id=sent[2].event_id)
    assert [e.event_id for e in await resumed.wait_for(5)] == [e.event_id for e in sent[3:]]
    more = await publish(a, 3)
    got = await resumed.wait_for(8)
    assert [e.event_id for e in got] == [e.event_id for e in sent[3:] + more]
    await asyncio.sleep(0.5)
    assert len(resumed.events) == 8
    await resumed.stop()
    # A client resuming from the last id it saw gets exactly what came after.
    again = Collector(b, after_event_id=more[-1].event_id)
    newest = await publish(a, 1)
    assert [e.event_id for e in await again.wait_for(1)] == [newest[0].event_id]
    await again.stop()


async def test_a_resume_past_the_newest_event_is_refused(make_bus: Callable[..., Any], postgres_db: str) -> None:
    """Resumed past the newest id, a watcher would skip every event up to it in silence."""
    a, b = await make_bus(), await make_bus()
    # Before any event was published, 1 ("from the start", the gateway's) is no id ahead.
    first = Collector(b, after_event_id=1)
    await asyncio.sleep(0.2)
    assert not first.task.done()
    await first.stop()
    sent = await publish(a, 2)
    ahead = b.subscribe(caller=ADMIN, after_event_id=sent[-1].event_id + 3)
    with pytest.raises(EventIdAhead) as err:
        await asyncio.wait_for(anext(ahead), WAIT)
    assert err.value.metadata["newest_event_id"] == str(sent[-1].event_id)
    assert [v.field for v in err.value.violations] == ["after_event_id"]
    # Ids handed out stay resume points once their events are pruned (an empty table).
    conn = await asyncpg.connect(postgres_db)
    try:
        await conn.execute("DELETE FROM events")
    finally:
        await conn.close()
    kept = Collector(b, after_event_id=sent[-1].event_id)
    newest = await publish(a, 1)
    assert [e.event_id for e in await kept.wait_for(1)] == [newest[0].event_id]
    await kept.stop()


async def test_watchers_see_only_what_they_may_read(make_bus: Callable[..., Any]) -> None:
    a, b = await make_bus(), await make_bus()
    first = await publish(a, 1)
    alice_all = Collector(b, ALICE, after_event_id=first[0].event_id)
    alice_s2 = Collector(b, ALICE, session_id=S2, after_event_id=first[0].event_id)
    admin_s1 = Collector(b, ADMIN, session_id=S1, after_event_id=first[0].event_id)
    mine = await publish(a, 2, session_id=S1, user_id="alice")
    theirs = await publish(a, 2, session_id=S2, user_id="bob")
    mine_s2 = await publish(a, 1, session_id=S2, user_id="alice")
    assert [e.event_id for e in await alice_all.wait_for(3)] == [e.event_id for e in mine + mine_s2]
    assert [e.event_id for e in await alice_s2.wait_for(1)] == [mine_s2[0].event_id]
    assert [e.event_id for e in await admin_s1.wait_for(2)] == [e.event_id for e in mine]
    await asyncio.sleep(0.5)
    assert (len(alice_all.events), len(alice_s2.events), len(admin_s1.events)) == (3, 1, 2)
    assert theirs  # published, but no watcher above may read them
    for w in (alice_all, alice_s2, admin_s1):
        await w.stop()


async def test_an_event_without_notification_arrives_by_the_poll(
    make_bus: Callable[..., Any], postgres_db: str
) -> None:
    bus = await make_bus()
    watcher = Collector(bus)
    await watcher.started()
    conn = await asyncpg.connect(postgres_db)
    try:  # as if the NOTIFY had been lost
        await conn.execute(
            "INSERT INTO events (session_id, user_id, kind, payload, time) VALUES ($1, 'alice', 'quiet', '{}', now())",
            S1,
        )
    finally:
        await conn.close()
    got = await watcher.wait_for(1)
    assert got[0].kind == "quiet"
    await watcher.stop()


async def test_the_listener_reconnects_and_catches_up(make_bus: Callable[..., Any], postgres_db: str) -> None:
    a, b = await make_bus(), await make_bus()
    watcher = Collector(b)
    await watcher.started()
    await asyncio.wait_for(b.wait_listening(), WAIT)
    conn = await asyncpg.connect(postgres_db)
    try:
        killed = await conn.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name = $1 AND datname = current_database()",
            LISTEN_APPLICATION_NAME,
        )
        assert killed == 1
    finally:
        await conn.close()
    sent = await publish(a, 5)  # while b's listener is (likely) down
    got = await watcher.wait_for(5)
    assert [e.event_id for e in got] == [e.event_id for e in sent]
    await until(lambda: b.listening)
    later = await publish(a, 1)
    assert (await watcher.wait_for(6))[-1].event_id == later[0].event_id
    await watcher.stop()


async def test_retention_by_count_and_by_age(postgres_db: str, settings: Settings) -> None:
    class Clock:
        current = datetime(2026, 1, 1, tzinfo=UTC)

        def now(self) -> datetime:
            return self.current

    clock = Clock()
    bus = PostgresEventBus(postgres_db, settings, clock=clock)
    await bus.open()
    try:
        sent = await publish(bus, 15)
        assert await bus.prune() == 5  # the newest 10 are kept
        watcher = Collector(bus, after_event_id=sent[0].event_id)
        assert [e.event_id for e in await watcher.wait_for(10)] == [e.event_id for e in sent[5:]]
        await watcher.stop()
        clock.current += timedelta(days=8)
        fresh = await publish(bus, 2)
        assert await bus.prune() == 10  # a week old
        watcher = Collector(bus, after_event_id=1)
        assert [e.event_id for e in await watcher.wait_for(2)] == [e.event_id for e in fresh]
        await watcher.stop()
    finally:
        await bus.close()


async def test_closing_the_bus_ends_its_subscriptions(make_bus: Callable[..., Any]) -> None:
    bus = await make_bus()
    watcher = Collector(bus)
    await watcher.started()
    await bus.close()
    await asyncio.wait_for(watcher.task, WAIT)  # ends without an error
    assert watcher.events == []


async def test_a_store_bus_shares_the_pool_and_the_events(store: PostgresStore, make_bus: Callable[..., Any]) -> None:
    shared = store.make_event_bus()
    other = await make_bus()
    watcher = Collector(other)
    await watcher.started()
    event = await shared.publish(session_id=S1, user_id="alice", kind="session_deleted", payload={"x": [1, "два"]})
    got = await watcher.wait_for(1)
    assert got[0].event_id == event.event_id and dict(got[0].payload) == {"x": [1, "два"]}
    await watcher.stop()
    await shared.close()
    # Closing the shared bus leaves the store's pool open.
    assert (await store.list_sessions(caller=ADMIN, offset=0, limit=1)).total == 0


async def test_one_fetch_per_wake_serves_every_watcher_of_a_replica(
    make_bus: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #15 item 6: 30 watchers on one replica cost one query per notification, not 30;
    every watcher still gets exactly its events, in order (session and owner filtered in process)."""
    a, b = await make_bus(), await make_bus()
    queries = {"n": 0}
    real = b._fetch

    async def counted(*args: Any, **kw: Any) -> list[StoredEvent]:
        queries["n"] += 1
        return await real(*args, **kw)

    monkeypatch.setattr(b, "_fetch", counted)
    watchers = [Collector(b, session_id=S1) for _ in range(20)]
    watchers += [Collector(b, caller=ALICE) for _ in range(5)]
    watchers += [Collector(b, session_id=S2) for _ in range(5)]
    for w in watchers:
        await w.started()
    await until(lambda: b._feed_ok)
    before = queries["n"]
    sent_s1 = await publish(a, 20)
    sent_s2 = await publish(a, 10, session_id=S2, user_id="bob")
    for w in watchers[:20]:
        assert [e.event_id for e in await w.wait_for(20)] == [e.event_id for e in sent_s1]
    for w in watchers[20:25]:  # alice's events only
        assert [e.event_id for e in await w.wait_for(20)] == [e.event_id for e in sent_s1]
    for w in watchers[25:]:
        assert [e.event_id for e in await w.wait_for(10)] == [e.event_id for e in sent_s2]
    await asyncio.sleep(0.3)
    assert all(len(w.events) == (10 if w in watchers[25:] else 20) for w in watchers)
    # About one query per published event on this replica (notifications coalesce; the 0.3 s poll
    # adds a few), never one per watcher: that was 30 watchers x 30 events here.
    assert queries["n"] - before <= 2 * 30
    for w in watchers:
        await w.stop()


async def test_a_watcher_resuming_before_the_window_reads_the_table_then_joins_it(
    postgres_db: str, make_bus: Callable[..., Any]
) -> None:
    bus = await make_postgres_event_bus(postgres_db, pg_settings(event_retention_count=1000, event_fanout_events=4))
    try:
        live = Collector(bus)
        await live.started()
        sent = await publish(bus, 30)
        await live.wait_for(30)
        assert bus._floor is not None and bus._floor > sent[0].event_id  # the window holds only the newest
        late = Collector(bus, after_event_id=sent[2].event_id)
        got = await late.wait_for(27)
        assert [e.event_id for e in got] == [e.event_id for e in sent[3:]]
        more = await publish(bus, 5)
        got = await late.wait_for(32)
        assert [e.event_id for e in got] == [e.event_id for e in sent[3:] + more]
        await late.stop()
        await live.stop()
    finally:
        await bus.close()


async def test_a_publish_draws_its_id_only_once_it_holds_the_publish_lock(
    postgres_db: str, make_bus: Callable[..., Any]
) -> None:
    """The one-statement publish takes the advisory lock before the id: while another transaction
    holds the lock, the publish waits and the id sequence does not move."""
    from contextsvc.stores.postgres.bus import PUBLISH_LOCK

    bus = await make_bus()
    await publish(bus, 1)  # the sequence has a value to compare with
    holder = await asyncpg.connect(postgres_db)
    try:
        seq = "pg_get_serial_sequence('events', 'event_id')"
        before = await holder.fetchval(f"SELECT last_value FROM {await holder.fetchval(f'SELECT {seq}')}")
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT pg_advisory_xact_lock($1)", PUBLISH_LOCK)
        waiting = asyncio.create_task(publish(bus, 1))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        async with asyncio.timeout(WAIT):
            probe = await asyncpg.connect(postgres_db)
            try:
                name = await probe.fetchval(f"SELECT {seq}")
                assert await probe.fetchval(f"SELECT last_value FROM {name}") == before
            finally:
                await probe.close()
        await tx.commit()
        async with asyncio.timeout(WAIT):
            (event,) = await waiting
        assert event.event_id == before + 1
    finally:
        await holder.close()
