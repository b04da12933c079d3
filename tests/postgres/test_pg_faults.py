"""Adversity: the server goes away and comes back; queries time out; the pool is closed.

Every failure reaches the caller as ``Unavailable`` (never a driver exception), and the store and
bus recover by themselves once PostgreSQL is back, without being reopened.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import asyncpg
import pytest

from contextsvc.core.messages import BufferKind, Message, Role
from contextsvc.core.session import Principal
from contextsvc.errors import Unavailable
from contextsvc.stores.postgres import PostgresStore, make_postgres_event_bus, make_postgres_store
from tests.postgres.conftest import pg_settings
from tests.support.postgres import PgCluster, create_database

ALICE = Principal("alice")
ADMIN = Principal("root", is_admin=True)
WAIT = 30.0  # bound on recovery; it normally takes well under a second
OTHER_SID = "3e5c7a9b-1d2f-4a6b-8c0d-2e4f6a8b0c1d"


@pytest.fixture(scope="module")
def private_cluster() -> Iterator[PgCluster]:
    """A cluster of this module's own: restarting it disturbs no other test."""
    cluster = PgCluster.create()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.remove()


async def eventually(action: Callable[[], Awaitable[Any]]) -> Any:
    """Retry ``action`` while it raises Unavailable, at most ``WAIT`` seconds."""
    async with asyncio.timeout(WAIT):
        while True:
            try:
                return await action()
            except Unavailable:
                await asyncio.sleep(0.1)


async def test_server_restart_gives_unavailable_then_recovers(private_cluster: PgCluster) -> None:
    dsn = await create_database(private_cluster.url)
    settings = pg_settings(pool_min_size=2, pool_max_size=4)
    store = await make_postgres_store(dsn, settings)
    bus = store.make_event_bus()
    other_bus = await make_postgres_event_bus(dsn, settings)
    try:
        sid = (await store.create_session(caller=ALICE, profile_id="p")).id
        await store.append_messages(sid, [Message(Role.USER, "before")], caller=ALICE)
        marker = await bus.publish(session_id=sid, user_id="alice", kind="k", payload={"n": -1})
        first = await bus.publish(session_id=sid, user_id="alice", kind="k", payload={"n": 0})
        watcher = other_bus.subscribe(caller=ADMIN, session_id=sid, after_event_id=marker.event_id)
        assert (await asyncio.wait_for(anext(watcher), WAIT)).event_id == first.event_id
        # A watcher waiting through the outage continues afterwards, without a gap.
        pending = asyncio.ensure_future(anext(watcher))

        private_cluster.stop()
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: store.get_session(sid, caller=ALICE),
            lambda: store.append_messages(sid, [Message(Role.USER, "lost?")], caller=ALICE),
            lambda: store.list_sessions(caller=ALICE, offset=0, limit=10),
            lambda: store.load_context(sid, caller=ALICE),
            lambda: bus.publish(session_id=sid, user_id="alice", kind="k", payload={}),
        ]
        for call in calls:
            with pytest.raises(Unavailable) as raised:
                await asyncio.wait_for(call(), WAIT)
            assert "PostgreSQL" in raised.value.message

        private_cluster.start()  # same port: the DSN the pool holds is valid again
        info = await eventually(lambda: store.get_session(sid, caller=ALICE))
        assert info.last_sequence == 1  # the append that failed left nothing behind
        result = await store.append_messages(sid, [Message(Role.USER, "after")], caller=ALICE)
        assert result.sequence_numbers == [2]
        rows = await store.list_messages(sid, caller=ALICE, buffer=BufferKind.DISPLAY)
        assert [m.content for m in rows] == ["before", "after"]

        # Events: the listener reconnected by itself; the waiting watcher gets what comes next.
        await asyncio.wait_for(other_bus.wait_listening(), WAIT)
        if pending.done():
            # Woken by a poll just as the server went down, its fetch failed: by design the
            # iterator raises Unavailable, and iterating again resumes after the last event.
            assert isinstance(pending.exception(), Unavailable)
            pending = asyncio.ensure_future(anext(watcher))
        later = await bus.publish(session_id=sid, user_id="alice", kind="k", payload={"n": 1})
        assert (await asyncio.wait_for(pending, WAIT)).event_id == later.event_id
    finally:
        await bus.close()
        await other_bus.close()
        await store.close()


async def test_opening_without_a_server_is_unavailable() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    with pytest.raises(Unavailable):
        await make_postgres_store(dsn, pg_settings())
    with pytest.raises(Unavailable):
        await make_postgres_event_bus(dsn, pg_settings())


async def test_a_missing_database_at_open_is_a_misconfiguration(postgres_dsn: str) -> None:
    """A running server answering "no such database" is no outage a retry mends: ``serve`` stops in
    one line (a ValueError at open) instead of waiting NOT_SERVING for ever."""
    with pytest.raises(ValueError, match=r'database "no_such_database" does not exist \(SQLSTATE 3D000\)'):
        await make_postgres_store(postgres_dsn.rsplit("/", 1)[0] + "/no_such_database", pg_settings())


async def test_a_statement_timeout_is_unavailable(postgres_db: str) -> None:
    store = await make_postgres_store(postgres_db, pg_settings(statement_timeout_ms=300))
    blocker = await asyncpg.connect(postgres_db)
    try:
        sid = (await store.create_session(caller=ALICE, profile_id="p")).id
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute("LOCK TABLE sessions IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(Unavailable) as raised:
            await asyncio.wait_for(store.get_session(sid, caller=ALICE), WAIT)
        assert "timeout" in raised.value.message
        await tx.rollback()
        assert (await store.get_session(sid, caller=ALICE)).id == sid
    finally:
        await blocker.close()
        await store.close()


async def test_a_closed_store_is_unavailable(store: PostgresStore) -> None:
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.close()
    with pytest.raises(Unavailable):
        await store.get_session(sid, caller=ALICE)
    with pytest.raises(Unavailable):
        await store.append_messages(sid, [Message(Role.USER, "x")], caller=ALICE)
    await store.close()  # closing twice is fine


async def test_the_compaction_lock_survives_a_server_restart(private_cluster: PgCluster) -> None:
    """A lock held through a restart is lost with its connection, and leaving the block does not
    fail the work it guarded; afterwards the lock is taken on the first try, the lock pool's dead
    connections replaced (no Unavailable for the first compaction after a restart)."""
    dsn = await create_database(private_cluster.url)
    store = await make_postgres_store(dsn, pg_settings(compaction_lock_timeout_seconds=5))
    try:
        sid = (await store.create_session(caller=ALICE, profile_id="p")).id
        async with store.compaction_lock(sid), store.compaction_lock(OTHER_SID):
            pass  # leaves two idle connections in the lock pool, which the restart kills
        async with store.compaction_lock(sid):
            private_cluster.stop()
            private_cluster.start()
        await eventually(lambda: store.get_session(sid, caller=ALICE))
        async with store.compaction_lock(sid), store.compaction_lock(OTHER_SID):
            pass
    finally:
        await store.close()
