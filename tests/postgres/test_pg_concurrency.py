"""Many replicas on one session: separate store instances (separate pools) appending at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from contextsvc.config import Settings
from contextsvc.core.messages import BufferKind, Message, Role
from contextsvc.core.session import Principal
from contextsvc.errors import Conflict
from contextsvc.stores.postgres import PostgresStore, make_postgres_store
from tests.postgres.conftest import pg_settings

ALICE = Principal("alice")
REPLICAS = 3
APPENDERS = 30
APPENDS_EACH = 3
BATCH = 2


@pytest.fixture
async def replicas(postgres_db: str) -> AsyncIterator[list[PostgresStore]]:
    # Small pools, so appenders also queue for connections, as on a busy replica.
    settings: Settings = pg_settings(pool_min_size=1, pool_max_size=5)
    stores = [await make_postgres_store(postgres_db, settings) for _ in range(REPLICAS)]
    try:
        yield stores
    finally:
        for store in stores:
            await store.close()


async def test_concurrent_appenders_get_unique_contiguous_numbers(replicas: list[PostgresStore]) -> None:
    sid = (await replicas[0].create_session(caller=ALICE, profile_id="p")).id

    async def appender(n: int) -> list[tuple[list[int], list[str]]]:
        store = replicas[n % REPLICAS]
        done = []
        for k in range(APPENDS_EACH):
            contents = [f"appender {n} append {k} row {r}" for r in range(BATCH)]
            result = await store.append_messages(
                sid, [Message(Role.USER, c) for c in contents], caller=ALICE, context_tokens_delta=1
            )
            done.append((result.sequence_numbers, contents))
        return done

    results = [r for batch in await asyncio.gather(*(appender(n) for n in range(APPENDERS))) for r in batch]
    total = APPENDERS * APPENDS_EACH * BATCH
    numbers = [seq for seqs, _ in results for seq in seqs]
    assert sorted(numbers) == list(range(1, total + 1))  # unique and gap-free
    for seqs, _ in results:  # one append's rows are consecutive
        assert seqs == list(range(seqs[0], seqs[0] + BATCH))

    # Every row holds what the append that got its number sent, whichever replica reads it.
    expected = {seq: content for seqs, contents in results for seq, content in zip(seqs, contents, strict=True)}
    rows = await replicas[1].get_messages(sid, caller=ALICE, first=1, last=total)
    assert {m.sequence_number: m.content for m in rows} == expected
    info = await replicas[2].get_session(sid, caller=ALICE)
    assert (info.last_sequence, info.display_message_count, info.context_message_count) == (total, total, total)
    assert info.context_tokens == APPENDERS * APPENDS_EACH
    page = await replicas[2].list_messages(sid, caller=ALICE, buffer=BufferKind.DISPLAY, limit=total)
    assert [m.sequence_number for m in page] == list(range(1, total + 1))


async def test_a_request_id_retried_on_every_replica_appends_once(replicas: list[PostgresStore]) -> None:
    sid = (await replicas[0].create_session(caller=ALICE, profile_id="p")).id
    rows = [Message(Role.USER, "once"), Message(Role.ASSISTANT, "only once")]
    results = await asyncio.gather(
        *(replicas[n % REPLICAS].append_messages(sid, rows, caller=ALICE, request_id="req-1") for n in range(12))
    )
    assert [r.replayed for r in results].count(False) == 1
    assert {tuple(r.sequence_numbers) for r in results} == {(1, 2)}
    info = await replicas[1].get_session(sid, caller=ALICE)
    assert info.last_sequence == 2


async def test_twins_that_both_started_before_either_committed_append_once(
    replicas: list[PostgresStore], postgres_db: str
) -> None:
    """The append is one statement whose request-id check reads the statement's snapshot: twins
    that both start while the session row is locked cannot see each other's request. The second
    must still answer as a replay (its request row collides, the statement rolls back and runs
    again), with the first call's numbers and no rows of its own."""
    import asyncpg

    sid = (await replicas[0].create_session(caller=ALICE, profile_id="p")).id
    rows = [Message(Role.USER, "twin"), Message(Role.ASSISTANT, "twin answer")]
    holder = await asyncpg.connect(postgres_db)
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT 1 FROM sessions WHERE session_id = $1 FOR UPDATE", sid)
        twins = [
            asyncio.ensure_future(replicas[n].append_messages(sid, rows, caller=ALICE, request_id="twin-1"))
            for n in range(2)
        ]
        # Both statements are running (waiting on the row lock) before the lock goes.
        for _ in range(1000):  # up to ~10 s on a busy machine
            waiting = await holder.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database() AND pid <> pg_backend_pid()"
            )
            if waiting >= 2:
                break
            await asyncio.sleep(0.01)
        assert waiting >= 2
        await tx.commit()
        results = await asyncio.gather(*twins)
    finally:
        await holder.close()
    assert sorted(r.replayed for r in results) == [False, True]
    assert [r.sequence_numbers for r in results] == [[1, 2], [1, 2]]
    info = await replicas[1].get_session(sid, caller=ALICE)
    assert (info.last_sequence, info.display_message_count) == (2, 2)
    assert [m.content for m in await replicas[2].get_messages(sid, caller=ALICE, first=1, last=10)] == [
        "twin",
        "twin answer",
    ]


async def test_one_session_id_created_twice_at_once_conflicts(replicas: list[PostgresStore]) -> None:
    sid = "6f1c2a4e-8b7d-4c3a-9e21-0a5b6c7d8e9f"
    outcomes = await asyncio.gather(
        *(store.create_session(caller=ALICE, profile_id="p", session_id=sid) for store in replicas),
        return_exceptions=True,
    )
    assert sum(isinstance(o, Conflict) for o in outcomes) == REPLICAS - 1
    assert sum(not isinstance(o, BaseException) for o in outcomes) == 1


async def test_compaction_and_appends_from_two_replicas_interleave_whole(replicas: list[PostgresStore]) -> None:
    """A compaction on one replica and appends on another: every step is whole, numbers unique,
    and the context counter matches the rows."""
    a, b = replicas[0], replicas[1]
    sid = (await a.create_session(caller=ALICE, profile_id="p")).id
    await a.append_messages(sid, [Message(Role.USER, f"m{i}") for i in range(10)], caller=ALICE)

    async def compact() -> list[int]:
        return await b.commit_compaction(
            sid, caller=ALICE, demote=list(range(1, 9)), append=[Message(Role.USER, "summary")], context_tokens=5
        )

    async def appends() -> list[int]:
        out: list[int] = []
        for i in range(5):
            out += (await a.append_messages(sid, [Message(Role.USER, f"late {i}")], caller=ALICE)).sequence_numbers
        return out

    compacted, appended = await asyncio.gather(compact(), appends())
    assert sorted(compacted + appended) == list(range(11, 17))
    context = await b.load_context(sid, caller=ALICE)
    info = await a.get_session(sid, caller=ALICE)
    assert info.context_message_count == len(context) == 2 + 1 + 5
    assert {m.content for m in context} >= {"m8", "m9", "summary"}
