"""What only the PostgreSQL store has: kept counters, blob references, limits of the database.

The generic behaviour of every store is the conformance suite's (tests/conformance/).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
from datetime import timedelta

import asyncpg
import pytest

from contextsvc.core.calibration import Observation
from contextsvc.core.messages import Flags, ImageRef, Message, Role
from contextsvc.core.priors import CYRILLIC_FEATURES, LEGACY_FEATURES, PREVIOUS_FEATURES
from contextsvc.core.session import Principal
from contextsvc.errors import Conflict, InvalidArgument, NotFound
from contextsvc.stores.postgres import PostgresStore, make_postgres_store
from tests.conformance.helpers import view
from tests.postgres.conftest import pg_settings

ALICE = Principal("alice")


async def counted(dsn: str, sid: str) -> tuple[int, int, int]:
    """(last sequence, display rows, context rows) counted from the rows themselves."""
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            """SELECT coalesce(max(seq), 0), count(*) FILTER (WHERE is_display), count(*) FILTER (WHERE is_context)
                 FROM all_messages WHERE session_id = $1""",
            sid,
        )
        return int(row[0]), int(row[1]), int(row[2])
    finally:
        await conn.close()


async def test_kept_counters_match_the_rows(store: PostgresStore, postgres_db: str) -> None:
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(sid, [Message(Role.USER, f"m{i}") for i in range(12)], caller=ALICE)
    hidden = Message(Role.USER, "summary", flags=Flags(is_display=False, is_summary=True), context_anchor=1)
    record = Message(Role.SYSTEM, "compressed", flags=Flags(is_context=False, is_compression=True))
    await store.commit_compaction(sid, caller=ALICE, demote=[1, 2, 3, 4, 9], append=[hidden, record], context_tokens=3)
    await store.set_context_flags(sid, [2, 2, 3], caller=ALICE, is_context=True)
    await store.set_context_flags(sid, [13], caller=ALICE, is_context=False)  # a context-only row
    await store.set_context_flags(sid, [5, 6], caller=ALICE, is_context=True)  # already in context
    await store.archive_old_messages(sid, 8, caller=ALICE)
    await store.set_context_flags(sid, [1], caller=ALICE, is_context=True)  # an archived row
    info = await store.get_session(sid, caller=ALICE)
    assert (info.last_sequence, info.display_message_count, info.context_message_count) == await counted(
        postgres_db, sid
    )
    assert info.preview == "compressed"  # the newest display row with content


async def test_text_postgresql_cannot_store_is_invalid_argument(store: PostgresStore) -> None:
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    with pytest.raises(InvalidArgument):
        await store.append_messages(sid, [Message(Role.USER, "nul \x00 byte")], caller=ALICE)
    assert (await store.get_session(sid, caller=ALICE)).last_sequence == 0


async def test_pooled_connections_come_back_clean_without_a_reset_round_trip(store: PostgresStore) -> None:
    """The main pool skips asyncpg's reset query on release (one round trip per use): that holds
    only while nothing on it leaves session state behind. After every kind of work, each pooled
    connection holds no advisory lock, no open transaction and default settings (synchronous commit
    on again after the statements that commit asynchronously)."""
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(sid, [Message(Role.USER, f"m{i}") for i in range(4)], caller=ALICE, request_id="r")
    await store.append_messages(sid, [Message(Role.USER, "m0")], caller=ALICE, request_id="r")  # a replay
    async with store.compaction_lock(sid):
        await store.commit_compaction(
            sid, caller=ALICE, demote=[1, 2], append=[Message(Role.SYSTEM, "s", context_anchor=1)], context_tokens=1
        )
    await store.add_calibration_observation("m", Observation(100, 40, features=(1.0,)))
    # Two statements that commit asynchronously (set_config's ``local``: for their transaction only).
    await store.save_view(sid, view("v1"), keep=2)
    read = await store.get_session(sid, caller=ALICE)
    assert await store.update_state_if_unchanged(sid, caller=ALICE, read=read, context_tokens=5, state={"e": 1})
    bus = store.make_event_bus()
    await bus.publish(session_id=sid, user_id="alice", kind="k", payload={})
    await bus.close()
    with pytest.raises(InvalidArgument):  # a failed transaction
        await store.append_messages(sid, [Message(Role.USER, "nul \x00 byte")], caller=ALICE)
    pool = store._pool
    size = pool.get_size()
    held = [await pool.acquire() for _ in range(size)]  # every connection the pool has
    try:
        for conn in held:
            row = await conn.fetchrow(
                """SELECT (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()),
                          current_setting('lock_timeout'), (SELECT count(*) FROM pg_cursors WHERE name <> ''),
                          current_setting('synchronous_commit')"""
            )
            assert tuple(row) == (0, "0", 0, "on")
            assert not conn.is_in_transaction()
    finally:
        for conn in held:
            await pool.release(conn)


async def test_unreferenced_blobs_are_pruned_referenced_ones_kept(store: PostgresStore, postgres_db: str) -> None:
    used, orphan = b"used image", b"orphan image"
    used_id, orphan_id = hashlib.sha256(used).hexdigest(), hashlib.sha256(orphan).hexdigest()
    await store.put_blob(used, blob_id=used_id)
    await store.put_blob(orphan, blob_id=orphan_id)
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(
        sid, [Message(Role.USER, "look", images=(ImageRef(blob_id=used_id, mime_type="image/png"),))], caller=ALICE
    )
    assert await store.prune_unreferenced_blobs(older_than=timedelta(hours=1)) == 0  # too young to judge
    assert await store.prune_unreferenced_blobs(older_than=timedelta(0)) == 1
    assert await store.get_blob(orphan_id) is None
    assert await store.get_blob(used_id) == used
    await store.delete_session(sid, caller=ALICE)  # drops the reference, not the bytes
    assert await store.get_blob(used_id) == used
    assert await store.prune_unreferenced_blobs(older_than=timedelta(0)) == 1
    assert await store.get_blob(used_id) is None


async def test_calibration_keeps_a_bounded_history_per_model(postgres_db: str) -> None:
    store = await make_postgres_store(postgres_db, pg_settings(calibration_keep=5))
    try:
        for k in range(1, 9):
            await store.add_calibration_observation("m", Observation(chars=100 * k, tokens=30 * k))
        kept = await store.list_calibration_observations("m", limit=100)
        assert kept == [Observation(100 * k, 30 * k) for k in range(4, 9)]
    finally:
        await store.close()


async def test_features_of_the_first_feature_set_are_mapped_or_dropped(store: PostgresStore) -> None:
    """Rows written before the CJK class was split (11 features, one ``cjk`` class) read back in the
    current order when they hold no CJK units, and without features (not fitted) when they do."""
    assert len(LEGACY_FEATURES) == 11
    latin = (10.0, 20.0, 3.0, 4.0, 5.0, 0.0, 0.0, 1.0, 2.0, 1.0, 1.0)
    cjk = (10.0, 0.0, 0.0, 4.0, 5.0, 0.0, 70.0, 0.0, 2.0, 0.0, 1.0)
    await store.add_calibration_observation("m", Observation(45, 30, features=latin, residual=0.02))
    await store.add_calibration_observation("m", Observation(89, 60, features=cjk))
    mapped = (10.0, 20.0, 3.0, 4.0, 5.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 1.0, 1.0)
    assert await store.list_calibration_observations("m", limit=8) == [
        Observation(45, 30, features=mapped, residual=0.02),
        Observation(89, 60, features=()),
    ]
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(sid, [Message(Role.USER, "a")], caller=ALICE)
    await store.save_view(sid, dataclasses.replace(view("old", last_sequence=1), features=cjk), keep=3)
    await store.save_view(sid, dataclasses.replace(view("latin", last_sequence=1), features=latin), keep=3)
    assert (await store.get_view(sid, "latin")).features == mapped  # type: ignore[union-attr]
    assert (await store.get_view(sid, "old")).features == ()  # type: ignore[union-attr]


async def test_features_of_the_second_feature_set_are_mapped_or_dropped(store: PostgresStore) -> None:
    """Rows written before the families' own Cyrillic columns (13 features) read back with those
    columns 0 when they hold no Cyrillic units, and without features (not fitted) when they do."""
    assert len(PREVIOUS_FEATURES) == 13
    latin = (10.0, 20.0, 3.0, 4.0, 5.0, 0.0, 6.0, 0.0, 0.0, 1.0, 2.0, 1.0, 1.0)
    russian = (10.0, 0.0, 0.0, 4.0, 5.0, 70.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0, 1.0)
    await store.add_calibration_observation("m2", Observation(51, 30, features=latin, residual=0.02))
    await store.add_calibration_observation("m2", Observation(89, 60, features=russian))
    mapped = (10.0, 20.0, 3.0, 4.0, 5.0, 0.0, 6.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 1.0, 1.0)
    assert await store.list_calibration_observations("m2", limit=8) == [
        Observation(51, 30, features=mapped, residual=0.02),
        Observation(89, 60, features=()),
    ]
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(sid, [Message(Role.USER, "a")], caller=ALICE)
    await store.save_view(sid, dataclasses.replace(view("ru", last_sequence=1), features=russian), keep=3)
    await store.save_view(sid, dataclasses.replace(view("latin", last_sequence=1), features=latin), keep=3)
    assert (await store.get_view(sid, "latin")).features == mapped  # type: ignore[union-attr]
    assert (await store.get_view(sid, "ru")).features == ()  # type: ignore[union-attr]


async def test_features_of_the_third_feature_set_are_mapped(store: PostgresStore) -> None:
    """Rows written before the prefixed identifiers' column (17 features) read back with that column
    0, Cyrillic units and all."""
    assert len(CYRILLIC_FEATURES) == 17
    russian = (10.0, 8.0, 0.0, 4.0, 5.0, 70.0, 0.0, 0.0, 0.0, 0.0, 60.0, 90.0, 62.0, 95.0, 2.0, 0.0, 1.0)
    await store.add_calibration_observation("m3", Observation(89, 60, features=russian, residual=0.01))
    mapped = (*russian[:14], 0.0, *russian[14:])
    assert await store.list_calibration_observations("m3", limit=8) == [
        Observation(89, 60, features=mapped, residual=0.01)
    ]
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(sid, [Message(Role.USER, "a")], caller=ALICE)
    await store.save_view(sid, dataclasses.replace(view("ru", last_sequence=1), features=russian), keep=3)
    assert (await store.get_view(sid, "ru")).features == mapped  # type: ignore[union-attr]


async def test_update_state_checks_the_owner_in_its_one_statement(store: PostgresStore) -> None:
    """A stranger's update is not found and changes nothing; an admin's is applied and audited."""
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.update_state(sid, caller=ALICE, context_tokens=7, state={"k": 1})
    with pytest.raises(NotFound):
        await store.update_state(sid, caller=Principal("mallory"), context_tokens=99, state={"k": 2})
    info = await store.get_session(sid, caller=ALICE)
    assert (info.context_tokens, info.state) == (7, {"k": 1})
    audited: list[str] = []
    admin = Principal("root", is_admin=True, on_foreign_read=audited.append)
    assert (await store.update_state(sid, caller=admin, context_truncated=True)).context_truncated
    assert audited == ["alice"]
    with pytest.raises(NotFound):
        await store.update_state("00000000-0000-4000-8000-000000000000", caller=admin, context_tokens=1)


async def test_a_state_written_only_if_unchanged_waits_for_no_compaction_lock(postgres_db: str) -> None:
    """While another replica holds the session's compaction lock, the one-statement write is
    refused at once (nothing written, no wait); once the lock is free it writes, and leaves no
    advisory lock behind on the connection that wrote."""
    store = await make_postgres_store(postgres_db, pg_settings())
    other = await make_postgres_store(postgres_db, pg_settings())
    try:
        sid = (await store.create_session(caller=ALICE, profile_id="p")).id
        read = await store.update_state(sid, caller=ALICE, context_tokens=3, state={"epoch": 1})
        wanted = {"epoch": 1, "baseline": {"tokens": 40}}
        async with other.compaction_lock(sid):
            got = await asyncio.wait_for(
                store.update_state_if_unchanged(sid, caller=ALICE, read=read, context_tokens=40, state=wanted), 5
            )
            assert got is None
            assert await store.get_session(sid, caller=ALICE) == read
        got = await store.update_state_if_unchanged(sid, caller=ALICE, read=read, context_tokens=40, state=wanted)
        assert got is not None and (got.context_tokens, got.state) == (40, wanted)
        # The compaction lock is free again for the next compaction, on any replica.
        async with other.compaction_lock(sid):
            pass
        audited: list[str] = []
        admin = Principal("root", is_admin=True, on_foreign_read=audited.append)
        again = await store.update_state_if_unchanged(sid, caller=admin, read=got, context_tokens=41, state={})
        assert again is not None and again.context_tokens == 41 and audited == ["alice"]
    finally:
        await store.close()
        await other.close()


async def test_lock_pool_connections_come_back_holding_no_lock_without_a_reset(postgres_db: str) -> None:
    """The lock pool does not reset on release either: after a lock held and released, a lock
    refused at its timeout and a caller cancelled while it waited, no connection of it holds an
    advisory lock."""
    store = await make_postgres_store(postgres_db, pg_settings(compaction_lock_timeout_seconds=0.3))
    other = await make_postgres_store(postgres_db, pg_settings(compaction_lock_timeout_seconds=0.3))
    try:
        sid = (await store.create_session(caller=ALICE, profile_id="p")).id
        async with store.compaction_lock(sid):
            pass
        async with other.compaction_lock(sid):
            with pytest.raises(Conflict):  # refused at the timeout
                async with store.compaction_lock(sid):
                    raise AssertionError("taken twice")
            waiting = asyncio.create_task(store.compaction_lock(sid).__aenter__())
            await asyncio.sleep(0.1)
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
        async with store.compaction_lock(sid):  # free again, and taken at once
            pass
        pool = store._lock_pool
        held = [await pool.acquire() for _ in range(pool.get_size())]
        try:
            assert held
            for conn in held:
                locks = await conn.fetchval(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
                )
                assert locks == 0
                assert not conn.is_in_transaction()
        finally:
            for conn in held:
                await pool.release(conn)
    finally:
        await store.close()
        await other.close()
