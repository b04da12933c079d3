"""The PostgreSQL store's cached contexts (``stores/postgres/context_cache.py``) against a real server.

A replica that caches must read exactly what a replica without the cache reads, whatever another
replica (or it) did in between; and it must reuse the rows it holds rather than decode them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator

import asyncpg
import pytest

from contextsvc.core.messages import Flags, Message, Role
from contextsvc.core.session import Principal
from contextsvc.errors import NotFound
from contextsvc.stores.postgres import PostgresStore, make_postgres_store
from tests.postgres.conftest import pg_settings

ALICE = Principal("alice")
SID = "00000000-0000-4000-8000-00000000c0de"


@contextlib.asynccontextmanager
async def _replicas(
    dsn: str, *, cache_mb: float = 64.0
) -> AsyncIterator[tuple[PostgresStore, PostgresStore, PostgresStore]]:
    """(caching replica, another replica, a reader without the cache) on one database."""
    stores = (
        await make_postgres_store(dsn, pg_settings(context_cache_mb=cache_mb)),
        await make_postgres_store(dsn, pg_settings()),
        await make_postgres_store(dsn, pg_settings(context_cache_mb=0)),
    )
    try:
        yield stores
    finally:
        for store in stores:
            await store.close()


async def _sessions(store: PostgresStore, count: int, rows: int) -> list[str]:
    """``count`` new sessions of ALICE's through ``store``, each with ``rows`` user messages
    ``s{session} m{row}`` (numbers from 0)."""
    sids = []
    for i in range(count):
        sid = (await store.create_session(caller=ALICE, profile_id="p")).id
        await store.append_messages(sid, [Message(Role.USER, f"s{i} m{j}") for j in range(rows)], caller=ALICE)
        sids.append(sid)
    return sids


async def _step(rng: random.Random, writer: PostgresStore, sid: str, n: int) -> str:
    """One random change of the session through ``writer``; returns what it did."""
    info = await writer.get_session(sid, caller=ALICE)
    last = info.last_sequence
    kind = rng.choice(["append", "append", "append", "anchored", "demote", "promote", "compact", "archive"])
    if kind == "append" or last < 3:
        rows = [
            Message(rng.choice([Role.USER, Role.ASSISTANT]), f"turn {n}.{i} " + "x" * rng.randrange(40))
            for i in range(rng.randrange(1, 4))
        ]
        if rng.random() < 0.2:  # a display-only row: appended, never in the context
            rows.append(Message(Role.ASSISTANT, f"shown {n}", flags=Flags(is_context=False)))
        await writer.append_messages(sid, rows, caller=ALICE)
        return "append"
    if kind == "anchored":  # a context-only row placed earlier in context order
        row = Message(Role.USER, f"note {n}", flags=Flags(is_display=False), context_anchor=rng.randrange(1, last + 1))
        await writer.append_messages(sid, [row], caller=ALICE)
        return kind
    context = await writer.load_context(sid, caller=ALICE)
    numbered = [m.sequence_number for m in context]
    if kind == "demote" and numbered:
        await writer.set_context_flags(sid, rng.sample(numbered, min(2, len(numbered))), caller=ALICE, is_context=False)
    elif kind == "promote":
        await writer.set_context_flags(sid, rng.sample(range(1, last + 1), 2), caller=ALICE, is_context=True)
    elif kind == "compact" and len(numbered) >= 2:
        gone = numbered[: rng.randrange(1, len(numbered))]
        flags = Flags(is_display=False, is_summary=True)
        summary = Message(Role.USER, f"summary {n}", flags=flags, context_anchor=gone[0])
        await writer.commit_compaction(sid, caller=ALICE, demote=gone, append=[summary], context_tokens=10)
    elif kind == "archive":
        await writer.archive_old_messages(sid, rng.randrange(1, last + 1), caller=ALICE)
    return kind


async def test_a_cached_context_reads_what_an_uncached_reader_reads_after_any_change(postgres_db: str) -> None:
    async with _replicas(postgres_db) as (cached, other, plain):
        for seed in range(3):
            rng = random.Random(seed)
            sid = (await cached.create_session(caller=ALICE, profile_id="p")).id
            done: set[str] = set()
            for n in range(45):
                writer = cached if rng.random() < 0.4 else other
                done.add(await _step(rng, writer, sid, n))
                if rng.random() < 0.7:  # not after every change: several changes between two reads
                    got = await cached.load_context(sid, caller=ALICE)
                    assert got == await plain.load_context(sid, caller=ALICE), (seed, n)
            assert await cached.load_context(sid, caller=ALICE) == await plain.load_context(sid, caller=ALICE)
            # Every kind of change came up, each read by the caching replica in between.
            assert done >= {"append", "anchored", "demote", "promote", "compact", "archive"}, done


async def test_rows_held_come_back_as_the_same_objects(postgres_db: str) -> None:
    """The point of the cache: the engine's per-message caches are keyed by the message object."""
    async with _replicas(postgres_db) as (cached, other, plain):
        sid = (await cached.create_session(caller=ALICE, profile_id="p")).id
        await other.append_messages(sid, [Message(Role.USER, f"m{i}") for i in range(6)], caller=ALICE)
        first = await cached.load_context(sid, caller=ALICE)
        await other.append_messages(sid, [Message(Role.ASSISTANT, "new")], caller=ALICE)
        second = await cached.load_context(sid, caller=ALICE)
        assert [m.content for m in second] == [*(f"m{i}" for i in range(6)), "new"]
        assert all(a is b for a, b in zip(first, second[:6], strict=True))
        again = await plain.load_context(sid, caller=ALICE)
        assert again == second and not any(a is b for a, b in zip(again, second, strict=True))
        # A compaction elsewhere: read whole again (the demoted rows are gone from the context).
        await other.commit_compaction(
            sid, caller=ALICE, demote=[1, 2], append=[Message(Role.USER, "sum", context_anchor=1)], context_tokens=5
        )
        third = await cached.load_context(sid, caller=ALICE)
        assert [m.content for m in third] == ["sum", "m2", "m3", "m4", "m5", "new"]
        assert third == await plain.load_context(sid, caller=ALICE)


async def test_flags_swapped_elsewhere_are_seen_though_the_count_is_the_same(postgres_db: str) -> None:
    """One row out of the context and another in, by another replica, nothing appended: only the
    context epoch tells the cached rows are stale."""
    async with _replicas(postgres_db) as (cached, other, plain):
        sid = (await cached.create_session(caller=ALICE, profile_id="p")).id
        rows = [
            Message(Role.USER, "a"),
            Message(Role.USER, "b"),
            Message(Role.USER, "c", flags=Flags(is_context=False)),
        ]
        await cached.append_messages(sid, rows, caller=ALICE)
        assert [m.content for m in await cached.load_context(sid, caller=ALICE)] == ["a", "b"]
        await other.set_context_flags(sid, [1], caller=ALICE, is_context=False)
        await other.set_context_flags(sid, [3], caller=ALICE, is_context=True)
        assert [m.content for m in await cached.load_context(sid, caller=ALICE)] == ["b", "c"]
        assert await cached.load_context(sid, caller=ALICE) == await plain.load_context(sid, caller=ALICE)


async def test_a_session_created_again_under_its_id_is_read_afresh(postgres_db: str) -> None:
    async with _replicas(postgres_db) as (cached, other, _):
        await cached.create_session(caller=ALICE, profile_id="p", session_id=SID)
        await cached.append_messages(SID, [Message(Role.USER, "old one"), Message(Role.USER, "old two")], caller=ALICE)
        assert len(await cached.load_context(SID, caller=ALICE)) == 2
        # Deleted and created again by another replica, with as many rows: same numbers, other rows.
        await other.delete_session(SID, caller=ALICE)
        await other.create_session(caller=ALICE, profile_id="p", session_id=SID)
        await other.append_messages(SID, [Message(Role.USER, "new one"), Message(Role.USER, "new two")], caller=ALICE)
        assert [m.content for m in await cached.load_context(SID, caller=ALICE)] == ["new one", "new two"]


async def test_a_writer_that_does_not_bump_the_epoch_is_caught_by_the_count(postgres_db: str) -> None:
    """A replica of an older release (no ``context_epoch``) demoting a row in a rolling upgrade:
    its statements keep ``context_count``, so the cached rows no longer add up and are read again."""
    async with _replicas(postgres_db) as (cached, other, plain):
        sid = (await cached.create_session(caller=ALICE, profile_id="p")).id
        await cached.append_messages(sid, [Message(Role.USER, f"m{i}") for i in range(4)], caller=ALICE)
        assert len(await cached.load_context(sid, caller=ALICE)) == 4
        conn = await asyncpg.connect(postgres_db)
        try:
            async with conn.transaction():
                await conn.execute("UPDATE messages SET is_context = false WHERE session_id = $1 AND seq = 2", sid)
                await conn.execute("UPDATE sessions SET context_count = context_count - 1 WHERE session_id = $1", sid)
        finally:
            await conn.close()
        await other.append_messages(sid, [Message(Role.USER, "m4")], caller=ALICE)
        got = await cached.load_context(sid, caller=ALICE)
        assert [m.content for m in got] == ["m0", "m2", "m3", "m4"]
        assert got == await plain.load_context(sid, caller=ALICE)


async def test_the_cache_stays_within_its_budget_and_zero_keeps_nothing(postgres_db: str) -> None:
    # 12 KB: about five contexts of one ~2 KB row each (``_session.row_bytes`` + the entry).
    async with _replicas(postgres_db, cache_mb=12 / 1024) as (small, other, none):
        sids = []
        for i in range(10):
            sid = (await other.create_session(caller=ALICE, profile_id="p")).id
            await other.append_messages(sid, [Message(Role.USER, f"s{i}")], caller=ALICE)
            sids.append(sid)
            assert [m.content for m in await small.load_context(sid, caller=ALICE)] == [f"s{i}"]
            assert [m.content for m in await none.load_context(sid, caller=ALICE)] == [f"s{i}"]
            assert small._contexts.held_bytes <= 12 * 1024
        assert 3 <= len(small._contexts) < 10  # the least recently read went first
        assert small._contexts.get(sids[-1]) is not None and small._contexts.get(sids[0]) is None
        assert len(none._contexts) == 0 and none._contexts.held_bytes == 0


async def test_a_context_read_by_a_stranger_is_not_found_cached_or_not(postgres_db: str) -> None:
    async with _replicas(postgres_db) as (cached, _, plain):
        sid = (await cached.create_session(caller=ALICE, profile_id="p")).id
        await cached.append_messages(sid, [Message(Role.USER, "private")], caller=ALICE)
        await cached.load_context(sid, caller=ALICE)
        for store in (cached, plain):
            with pytest.raises(NotFound):
                await store.load_context(sid, caller=Principal("mallory"))


async def test_reads_waiting_together_are_one_statement_and_each_gets_its_own(postgres_db: str) -> None:
    """Builds of many sessions that wait for a statement lane read in one statement
    (``_read_contexts``): each gets what it would have read alone, cached or whole, and an unknown
    or foreign session is not found without failing the others."""
    grouped = await make_postgres_store(postgres_db, pg_settings(statement_lanes=1))
    try:
        async with _replicas(postgres_db) as (_, other, plain):
            sids = await _sessions(other, 6, 3)
            for sid in sids[:4]:  # cached on the grouping replica: the next read is of rows after
                await grouped.load_context(sid, caller=ALICE)
            await other.append_messages(sids[0], [Message(Role.ASSISTANT, "added")], caller=ALICE)
            summary = Message(Role.USER, "sum", flags=Flags(is_display=False, is_summary=True), context_anchor=1)
            await other.commit_compaction(sids[1], caller=ALICE, demote=[1, 2], append=[summary], context_tokens=5)
            before = grouped._read_group.grouped
            unknown = "00000000-0000-4000-8000-00000000dead"
            calls = [
                *(grouped.load_context(sid, caller=ALICE) for sid in sids),
                grouped.load_context(unknown, caller=ALICE),
                grouped.load_context(sids[2], caller=Principal("mallory")),
                grouped.load_context(sids[0], caller=ALICE),  # the same session twice
            ]
            got = await asyncio.gather(*calls, return_exceptions=True)
            assert grouped._read_group.grouped - before >= len(calls) - 1 and grouped._read_group.failed == 0
            for sid, context in zip([*sids, sids[0]], [*got[: len(sids)], got[-1]], strict=True):
                assert context == await plain.load_context(sid, caller=ALICE)
            assert [m.content for m in got[0]] == ["s0 m0", "s0 m1", "s0 m2", "added"]  # type: ignore[union-attr]
            assert [m.content for m in got[1]] == ["sum", "s1 m2"]  # type: ignore[union-attr]
            assert isinstance(got[len(sids)], NotFound) and isinstance(got[len(sids) + 1], NotFound)
    finally:
        await grouped.close()


async def test_a_connection_keeps_the_plan_of_a_lone_context_read(postgres_db: str) -> None:
    """The read of a cached context (a few rows past the last one held, in a session of hundreds)
    is planned once per connection, not at every run: given the value, PostgreSQL would price
    such a read far below the plan kept for any value and plan it again each time (several times
    the cost of running it), which the statement avoids by reading its value through a subquery."""
    from contextsvc.stores.postgres.store import _CONTEXT_SQL

    async with _replicas(postgres_db) as (store, _, _):
        sids = await _sessions(store, 10, 300)
        conn = await asyncpg.connect(postgres_db)
        try:
            await conn.execute("ANALYZE")  # the statistics a long-running database has
            for after in range(286, 298):
                rows = await conn.fetch(_CONTEXT_SQL, sids[0], after)
                assert [r["seq"] for r in rows] == list(range(after + 1, 301))
            plans = await conn.fetchrow(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1", _CONTEXT_SQL
            )
        finally:
            await conn.close()
        assert plans is not None and plans["generic_plans"] >= 6 and plans["custom_plans"] <= 6, dict(plans or {})
