"""Issue #15 item 6: on PostgreSQL with the store's own bus, an append publishes its
``messages_appended`` event in the append's own statement (one round trip, one commit).

What a watcher sees must not change: the same event (kind, session, owner, payload) an engine
publishing through the bus gives, exactly once per new append (none for a replay or an append
refused for another profile), in id order and without gaps while appends of many sessions race
with the bus's own publishes on another replica; and the id is drawn only once the bus's publish
lock is held.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from contextsvc.config import Settings
from contextsvc.core.messages import Message, Role
from contextsvc.core.session import Principal
from contextsvc.engine.engine import Engine
from contextsvc.engine.validation import IncomingMessage
from contextsvc.ports import StoredEvent
from contextsvc.stores.postgres import PostgresEventBus, PostgresStore, make_postgres_event_bus, make_postgres_store
from contextsvc.stores.postgres.bus import PUBLISH_LOCK
from tests.postgres.conftest import two_profile_settings
from tests.postgres.test_pg_bus import ADMIN, WAIT, Collector
from tests.support.engines import make_engine

ALICE = Principal(user_id="alice")
BOB = Principal(user_id="bob")


@pytest.fixture
def settings() -> Settings:
    return two_profile_settings()


class Replica:
    """A store, its engine and the engine's bus: the store's own (``folded``) or a bus with its
    own pool (the engine then publishes through it, as before)."""

    def __init__(self, store: PostgresStore, bus: PostgresEventBus, engine: Engine) -> None:
        self.store, self.bus, self.engine = store, bus, engine
        self.publishes = 0
        publish = bus.publish

        async def counted(**kwargs: Any) -> StoredEvent:
            self.publishes += 1
            return await publish(**kwargs)

        bus.publish = counted  # type: ignore[method-assign]


@pytest.fixture
async def replicas(postgres_db: str, settings: Settings) -> AsyncIterator[tuple[Replica, Replica]]:
    made: list[Replica] = []
    for folded in (True, False):
        store = await make_postgres_store(postgres_db, settings)
        bus = store.make_event_bus() if folded else await make_postgres_event_bus(postgres_db, settings)
        made.append(Replica(store, bus, make_engine(store, settings, bus=bus)))
    try:
        yield made[0], made[1]
    finally:
        for r in made:
            await r.engine.close()
            await r.bus.close()
            await r.store.close()


def _rows(*texts: str) -> list[IncomingMessage]:
    return [IncomingMessage(Message(role=Role.USER, content=t)) for t in texts]


def _seen(e: StoredEvent) -> tuple[str, str, str, dict[str, Any]]:
    return (e.session_id, e.user_id, e.kind, dict(e.payload))


async def test_the_store_publishes_for_its_own_bus_only(replicas: tuple[Replica, Replica]) -> None:
    folded, plain = replicas
    assert folded.store.publishes_appends_to(folded.bus)
    assert not folded.store.publishes_appends_to(plain.bus)  # another pool: the engine publishes
    assert not plain.store.publishes_appends_to(plain.bus)
    assert not folded.store.publishes_appends_to(object())


async def test_a_folded_append_publishes_the_same_event_once_and_a_replay_none(
    replicas: tuple[Replica, Replica],
) -> None:
    folded, plain = replicas
    watcher = Collector(plain.bus)
    await watcher.started()
    got: dict[str, list[StoredEvent]] = {}
    for r in (folded, plain):
        sid = (await r.engine.sessions.create(ALICE, profile_id="small", name="", metadata={})).id
        await r.engine.append(ALICE, sid, _rows("one"), request_id="", turn_complete=False)
        outcome = await r.engine.append(ALICE, sid, _rows("two", "three"), request_id="req-1", turn_complete=True)
        replay = await r.engine.append(ALICE, sid, _rows("two", "three"), request_id="req-1", turn_complete=True)
        assert replay.replayed and replay.sequence_numbers == outcome.sequence_numbers == [2, 3]
        await watcher.wait_for(sum(map(len, got.values())) + 2)
        got[sid] = [e for e in watcher.events if e.session_id == sid and e.kind == "messages_appended"]
    assert folded.publishes == 0  # every event above came from the append statement
    assert plain.publishes == 2
    (a, b) = got.values()
    assert len(a) == len(b) == 2  # one per new append, none for the replay
    # The same events a bus publish gives (only the session differs).
    assert [_seen(e)[1:] for e in a] == [_seen(e)[1:] for e in b]
    assert dict(a[1].payload) == {
        "sequence_numbers": [2, 3],
        "context_tokens": dict(b[1].payload)["context_tokens"],
        "request_id": "req-1",
        "turn_complete": True,
    }
    assert dict(a[1].payload)["context_tokens"] > dict(a[0].payload)["context_tokens"] > 0
    await asyncio.sleep(0.3)  # nothing more, nothing twice
    assert len([e for e in watcher.events if e.kind == "messages_appended"]) == 4
    await watcher.stop()


async def test_an_append_refused_for_another_profile_publishes_nothing(
    replicas: tuple[Replica, Replica],
) -> None:
    folded, plain = replicas
    sid = (await folded.engine.sessions.create(ALICE, profile_id="small", name="", metadata={})).id
    await folded.engine.append(ALICE, sid, _rows("hello"), request_id="", turn_complete=False)
    # Deleted and created again under the same id with another profile, through the other replica:
    # the folded replica's append (no session read) is refused by the statement, then reads and
    # appends once more. One event for that append, none for the refused statement.
    await plain.engine.sessions.delete(ALICE, sid)
    await plain.store.create_session(caller=ALICE, profile_id="big", session_id=sid)
    watcher = Collector(plain.bus, session_id=sid)
    await watcher.started()
    outcome = await folded.engine.append(ALICE, sid, _rows("again"), request_id="", turn_complete=False)
    assert outcome.sequence_numbers == [1]
    (event,) = await watcher.wait_for(1)
    assert dict(event.payload)["sequence_numbers"] == [1]
    await asyncio.sleep(0.3)
    assert len(watcher.events) == 1
    await watcher.stop()


async def test_folded_appends_racing_bus_publishes_arrive_in_order_without_gaps(
    replicas: tuple[Replica, Replica],
) -> None:
    folded, plain = replicas
    watcher = Collector(plain.bus)
    await watcher.started()
    sessions = [
        (await folded.engine.sessions.create(ALICE, profile_id="small", name="", metadata={})).id for _ in range(6)
    ]

    async def appends(sid: str) -> list[list[int]]:
        return [
            (
                await folded.engine.append(ALICE, sid, _rows(f"{sid} {i}", "x"), request_id="", turn_complete=False)
            ).sequence_numbers
            for i in range(8)
        ]

    async def publishes(k: int) -> list[StoredEvent]:
        return [
            await plain.bus.publish(session_id=sessions[k], user_id="alice", kind="baseline_recorded", payload={"i": i})
            for i in range(8)
        ]

    results = await asyncio.gather(*(appends(s) for s in sessions), *(publishes(k) for k in range(3)))
    expected = 6 * 8 + 3 * 8
    got = await watcher.wait_for(expected)
    ids = [e.event_id for e in got]
    assert ids == sorted(ids) and len(set(ids)) == expected
    assert ids == list(range(ids[0], ids[0] + expected))  # no gap: nothing rolled back here
    for sid, numbers in zip(sessions, results[:6], strict=True):
        mine = [
            dict(e.payload)["sequence_numbers"] for e in got if e.session_id == sid and e.kind == "messages_appended"
        ]
        assert mine == numbers  # each append once, in the session's order
    await asyncio.sleep(0.3)
    assert len(watcher.events) == expected
    await watcher.stop()


async def test_a_folded_append_draws_its_event_id_only_once_it_holds_the_publish_lock(
    postgres_db: str, replicas: tuple[Replica, Replica]
) -> None:
    folded, _ = replicas
    sid = (await folded.engine.sessions.create(ALICE, profile_id="small", name="", metadata={})).id
    await folded.engine.append(ALICE, sid, _rows("first"), request_id="", turn_complete=False)
    holder = await asyncpg.connect(postgres_db)
    try:
        seq = await holder.fetchval("SELECT pg_get_serial_sequence('events', 'event_id')")
        before = await holder.fetchval(f"SELECT last_value FROM {seq}")
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT pg_advisory_xact_lock($1)", PUBLISH_LOCK)
        waiting = asyncio.create_task(
            folded.engine.append(ALICE, sid, _rows("second"), request_id="", turn_complete=False)
        )
        await asyncio.sleep(0.5)
        assert not waiting.done()
        probe = await asyncpg.connect(postgres_db)
        try:
            assert await probe.fetchval(f"SELECT last_value FROM {seq}") == before
            # The session's rows are not visible either: the append commits with its event.
            assert await probe.fetchval("SELECT count(*) FROM messages WHERE session_id = $1", sid) == 1
        finally:
            await probe.close()
        await tx.commit()
        async with asyncio.timeout(WAIT):
            outcome = await waiting
        assert outcome.sequence_numbers == [2]
        events = await folded.bus._fetch(before, ADMIN, sid)
        assert [e.event_id for e in events] == [before + 1]
    finally:
        await holder.close()
