"""The cross-process compaction lock (``PostgresStore.compaction_lock``).

Each "replica" is a store with its own pools, as separate processes would have; the crash test
uses a real separate process killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator

import asyncpg
import pytest

from contextsvc.core.messages import Message, Role
from contextsvc.core.session import Principal
from contextsvc.errors import Conflict
from contextsvc.stores.postgres import PostgresStore, make_postgres_store
from contextsvc.stores.postgres.schema import COMPACTION_LOCK_SPACE, compaction_lock_keys
from tests.postgres.conftest import pg_settings

ALICE = Principal("alice")
WAIT = 30.0  # bound on every wait; each normally takes milliseconds
SID = "0b7e4c1a-5d2f-4e8a-9c3b-1f2a3b4c5d6e"
OTHER = "7c9d2e1f-3a4b-4c5d-8e6f-0a1b2c3d4e5f"


@pytest.fixture
async def replicas(postgres_db: str) -> AsyncIterator[list[PostgresStore]]:
    stores = [await make_postgres_store(postgres_db, pg_settings()) for _ in range(3)]
    try:
        yield stores
    finally:
        for store in stores:
            await store.close()


async def quick(dsn: str, seconds: float = 0.3) -> PostgresStore:
    """A replica that gives up waiting for the lock after ``seconds``."""
    return await make_postgres_store(dsn, pg_settings(compaction_lock_timeout_seconds=seconds))


async def test_two_replicas_never_hold_it_at_once(replicas: list[PostgresStore]) -> None:
    a, b, _ = replicas
    order: list[str] = []
    holding = asyncio.Event()
    release = asyncio.Event()

    async def first() -> None:
        async with a.compaction_lock(SID):
            order.append("a in")
            holding.set()
            await asyncio.wait_for(release.wait(), WAIT)
            order.append("a out")

    async def second() -> None:
        await asyncio.wait_for(holding.wait(), WAIT)
        async with b.compaction_lock(SID):
            order.append("b in")
        order.append("b out")

    holder = asyncio.ensure_future(first())
    waiter = asyncio.ensure_future(second())
    await asyncio.wait_for(holding.wait(), WAIT)
    await asyncio.sleep(0.5)  # room for b to (wrongly) get in
    assert not waiter.done()
    assert order == ["a in"]
    release.set()
    await asyncio.wait_for(asyncio.gather(holder, waiter), WAIT)
    assert order == ["a in", "a out", "b in", "b out"]


async def test_a_bounded_wait_ends_in_conflict(replicas: list[PostgresStore], postgres_db: str) -> None:
    a = replicas[0]
    impatient = await quick(postgres_db)
    try:
        async with a.compaction_lock(SID):
            with pytest.raises(Conflict) as raised:
                async with impatient.compaction_lock(SID):
                    pytest.fail("entered a lock another replica holds")
            assert raised.value.metadata["session_id"] == SID
            async with impatient.compaction_lock(OTHER):  # other sessions are not blocked
                pass
        async with impatient.compaction_lock(SID):  # free again once released
            pass
    finally:
        await impatient.close()


async def test_the_holder_can_work_on_a_one_connection_pool(postgres_db: str) -> None:
    """The lock's connection comes from a pool of its own, so the guarded work never waits for
    the connection that holds the lock."""
    store = await make_postgres_store(
        postgres_db, pg_settings(pool_min_size=1, pool_max_size=1, acquire_timeout_seconds=2.0)
    )
    try:
        sid = (await store.create_session(caller=ALICE, profile_id="p")).id
        async with store.compaction_lock(sid):
            result = await store.append_messages(sid, [Message(Role.USER, "inside")], caller=ALICE)
            assert result.sequence_numbers == [1]
    finally:
        await store.close()


async def test_locks_of_more_sessions_than_the_pool_holds_wait_for_a_connection(postgres_db: str) -> None:
    """Each held lock keeps a connection of the lock pool (``pool_max_size``) for its whole
    compaction, summarizer call included. One more session's lock waits for one of them, as
    long as a lock may be waited for, and is not refused after ``acquire_timeout_seconds`` as if
    PostgreSQL had stopped answering (it was UNAVAILABLE with more sessions compacting at once on
    one replica than its pool holds)."""
    store = await make_postgres_store(
        postgres_db, pg_settings(pool_max_size=2, acquire_timeout_seconds=0.3, compaction_lock_timeout_seconds=WAIT)
    )
    release = asyncio.Event()
    held = 0

    async def compaction(sid: str) -> None:
        nonlocal held
        async with store.compaction_lock(sid):
            held += 1
            await asyncio.wait_for(release.wait(), WAIT)

    try:
        sessions = [(await store.create_session(caller=ALICE, profile_id="p")).id for _ in range(3)]
        running = [asyncio.ensure_future(compaction(sid)) for sid in sessions[:2]]
        for _ in range(int(WAIT / 0.05)):  # bounded: both take their lock at once
            if held == 2:
                break
            await asyncio.sleep(0.05)
        assert held == 2
        third = asyncio.ensure_future(compaction(sessions[2]))
        await asyncio.sleep(1.0)  # past acquire_timeout_seconds
        assert not third.done()  # still waiting, not refused
        release.set()
        await asyncio.wait_for(asyncio.gather(*running, third), WAIT)
        assert held == 3
    finally:
        await store.close()


async def test_a_lock_pool_connection_not_free_in_time_is_a_conflict(postgres_db: str) -> None:
    """A session's lock that found no free connection within ``compaction_lock_timeout_seconds``
    (this replica holds that many other locks) is ABORTED like any lock not had in time, saying
    why, never UNAVAILABLE: PostgreSQL answers."""
    store = await make_postgres_store(postgres_db, pg_settings(pool_max_size=1, compaction_lock_timeout_seconds=0.3))
    try:
        first, second = [(await store.create_session(caller=ALICE, profile_id="p")).id for _ in range(2)]
        async with store.compaction_lock(first):
            with pytest.raises(Conflict) as raised:
                async with store.compaction_lock(second):
                    pytest.fail("entered a lock without a connection to hold it")
        assert raised.value.metadata["session_id"] == second
        assert "pool_max_size" in str(raised.value)
        async with store.compaction_lock(second):  # a connection is free again
            pass
    finally:
        await store.close()


async def test_the_pinned_lock_serializes_pinned_appends_and_never_waits_for_a_compaction(
    replicas: list[PostgresStore], postgres_db: str
) -> None:
    a, b, _ = replicas
    impatient = await make_postgres_store(postgres_db, pg_settings(acquire_timeout_seconds=0.3))
    try:
        async with a.compaction_lock(SID), b.pinned_lock(SID):  # a key space of its own
            with pytest.raises(Conflict) as raised:
                async with impatient.pinned_lock(SID):
                    pytest.fail("entered a pinned lock another replica holds")
            assert raised.value.metadata["session_id"] == SID
        async with impatient.pinned_lock(SID):  # free again once released
            pass
    finally:
        await impatient.close()


async def test_cancelling_a_waiter_or_a_holder_leaves_nothing_locked(
    replicas: list[PostgresStore], postgres_db: str
) -> None:
    a, b, c = replicas
    impatient = await quick(postgres_db)
    try:

        async def hold_forever(store: PostgresStore, entered: asyncio.Event) -> None:
            async with store.compaction_lock(SID):
                entered.set()
                await asyncio.sleep(WAIT)

        # A holder cancelled in the middle of its work.
        entered = asyncio.Event()
        holder = asyncio.ensure_future(hold_forever(a, entered))
        await asyncio.wait_for(entered.wait(), WAIT)
        holder.cancel()
        with pytest.raises(asyncio.CancelledError):
            await holder
        async with impatient.compaction_lock(SID):
            pass

        # A waiter cancelled while PostgreSQL has it queued behind the holder.
        async with c.compaction_lock(SID):
            entered = asyncio.Event()
            waiter = asyncio.ensure_future(hold_forever(b, entered))
            await asyncio.sleep(0.3)
            assert not entered.is_set()
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
        async with impatient.compaction_lock(SID):  # the cancelled waiter took nothing
            pass
    finally:
        await impatient.close()


_HOLDER = """
import asyncio, sys
from contextsvc.stores.postgres import make_postgres_store

async def main():
    store = await make_postgres_store(sys.argv[1])
    async with store.compaction_lock(sys.argv[2]):
        print("held", flush=True)
        await asyncio.sleep(120)  # bounded: the test kills this process long before

asyncio.run(main())
"""


async def test_a_crashed_holders_lock_is_released(postgres_db: str) -> None:
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _HOLDER,
        postgres_db,
        SID,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    impatient = await quick(postgres_db)
    try:
        assert holder.stdout is not None
        line = await asyncio.wait_for(holder.stdout.readline(), WAIT)
        assert line.strip() == b"held"
        with pytest.raises(Conflict):
            async with impatient.compaction_lock(SID):
                pytest.fail("entered a lock a live process holds")

        os.kill(holder.pid, signal.SIGKILL)
        await asyncio.wait_for(holder.wait(), WAIT)
        # The kernel closes the dead process's socket; its backend ends and the lock with it.
        async with asyncio.timeout(WAIT):
            while True:
                try:
                    async with impatient.compaction_lock(SID):
                        break
                except Conflict:
                    await asyncio.sleep(0.1)
    finally:
        if holder.returncode is None:
            holder.kill()
            await asyncio.wait_for(holder.wait(), WAIT)
        await impatient.close()


async def test_the_lock_uses_the_two_key_advisory_space(replicas: list[PostgresStore], postgres_db: str) -> None:
    """Two-key advisory locks (objsubid 2) never collide with the one-key bigint locks of the
    migrations and the event bus, whatever the session id hashes to."""
    first, second = compaction_lock_keys(SID)
    assert first == COMPACTION_LOCK_SPACE
    conn = await asyncpg.connect(postgres_db)
    try:
        async with replicas[0].compaction_lock(SID):
            rows = await conn.fetch(
                "SELECT classid::bigint, objid::bigint, objsubid FROM pg_locks"
                " WHERE locktype = 'advisory' AND granted AND database = (SELECT oid FROM pg_database"
                " WHERE datname = current_database())"
            )
            assert [(r[0], r[1], r[2]) for r in rows] == [(first & 0xFFFFFFFF, second & 0xFFFFFFFF, 2)]
        assert await conn.fetchval("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2") == 0
    finally:
        await conn.close()
