"""Search terms kept in PostgreSQL: written with their version, re-derived at start when an older
tokenizer made them (stores/postgres/reindex.py), so old chunks rank like new ones."""

from __future__ import annotations

import asyncpg

from contextsvc.core.recall import TERMS_VERSION
from contextsvc.core.session import Principal
from contextsvc.ports import HistoryChunk
from contextsvc.stores.postgres import PostgresStore, make_postgres_store
from contextsvc.stores.postgres.reindex import rederive_terms
from tests.postgres.conftest import pg_settings

ALICE = Principal("alice")


def chunk(text: str, seq: int) -> HistoryChunk:
    return HistoryChunk(f"h{seq}", text, seq, seq, None, None)


async def test_chunks_written_by_an_older_tokenizer_are_re_derived_at_start(
    store: PostgresStore, postgres_db: str
) -> None:
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.add_history_chunks(
        sid, [chunk("The primary databases were migrated", 1), chunk("unrelated chatter here", 2)]
    )
    conn = await asyncpg.connect(postgres_db)
    try:
        assert await conn.fetchval("SELECT min(terms_version) FROM history_chunks") == TERMS_VERSION
        # As version 1 left them: unstemmed words.
        await conn.execute(
            """UPDATE history_chunks SET terms = ARRAY['primary', 'databases', 'were', 'migrated'],
                      term_count = 4, terms_version = 1 WHERE content_hash = 'h1'"""
        )
        assert await store.search_history(sid, "database migration", limit=5) == []  # stale terms miss

        # A second store on the same database (a restart) brings them up to date.
        await store.close()
        again = await make_postgres_store(postgres_db, pg_settings())
        try:
            found = await again.search_history(sid, "database migration", limit=5)
            assert [s.chunk.content_hash for s in found] == ["h1"]
            assert found[0].rarest_df == 1 and found[0].chunk_count == 2
        finally:
            await again.close()
        assert await conn.fetchval("SELECT min(terms_version) FROM history_chunks") == TERMS_VERSION
        assert await rederive_terms(conn) == 0  # nothing left: a later start does no work
    finally:
        await conn.close()


async def test_rederiving_works_in_bounded_batches(store: PostgresStore, postgres_db: str) -> None:
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.add_history_chunks(sid, [chunk(f"servers number {n} restarted", n) for n in range(1, 8)])
    conn = await asyncpg.connect(postgres_db)
    try:
        await conn.execute("UPDATE history_chunks SET terms = '{}', term_count = 0, terms_version = 1")
        assert await rederive_terms(conn, batch=3) == 7
        found = await store.search_history(sid, "server restart", limit=10)
        assert len(found) == 7
    finally:
        await conn.close()
