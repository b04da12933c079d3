"""Listing search with and without pg_trgm, search_matches, and the indexes behind them."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from contextsvc.core.messages import Flags, Message, Role
from contextsvc.core.session import Principal
from contextsvc.stores.postgres import PostgresStore, make_postgres_store
from contextsvc.stores.postgres.schema import TRIGRAM_INDEXES
from tests.postgres.conftest import pg_settings
from tests.support.postgres import with_database

ALICE = Principal("alice")
BOB = Principal("bob")
ADMIN = Principal("root", is_admin=True)


async def seed(store: PostgresStore) -> dict[str, str]:
    """Sessions whose names and messages the queries below aim at."""
    ids = {}
    ids["deploy"] = (await store.create_session(caller=ALICE, profile_id="p", name="Deploy notes")).id
    ids["chat"] = (await store.create_session(caller=ALICE, profile_id="p", name="chat")).id
    ids["bob"] = (await store.create_session(caller=BOB, profile_id="p", name="bob's")).id
    await store.append_messages(
        ids["chat"],
        [
            Message(Role.USER, "How do I rotate the Kubernetes secrets?"),
            Message(Role.ASSISTANT, "Use 100%_sure steps"),
            Message(Role.USER, "Сервер упал ночью"),
            # Context-only rows (summaries) are not part of what a listing search looks at.
            Message(Role.USER, "hidden zebra summary", flags=Flags(is_display=False)),
        ],
        caller=ALICE,
    )
    await store.append_messages(ids["bob"], [Message(Role.USER, "kubernetes for bob")], caller=BOB)
    return ids


async def names(store: PostgresStore, caller: Principal, query: str) -> list[str]:
    page = await store.list_sessions(caller=caller, offset=0, limit=50, query=query)
    assert page.total == len(page.sessions)
    assert await store.count_sessions(caller=caller, query=query) == page.total
    return sorted(s.name for s in page.sessions)


async def check_queries(store: PostgresStore) -> None:
    await seed(store)
    assert await names(store, ALICE, "KUBERNETES") == ["chat"]
    assert await names(store, ADMIN, "kubernetes") == ["bob's", "chat"]
    assert await names(store, ALICE, "deploy") == ["Deploy notes"]
    assert await names(store, ALICE, "УПАЛ НОЧЬЮ") == ["chat"]  # case folding beyond ASCII
    assert await names(store, ALICE, "100%_s") == ["chat"]  # LIKE wildcards are literal
    assert await names(store, ALICE, "100%%") == []
    assert await names(store, ALICE, "e_s") == []  # "_" is not "any character"
    assert await names(store, ALICE, "zebra") == []  # display rows only
    assert await names(store, ALICE, "") == ["Deploy notes", "chat"]


async def index_names(dsn: str) -> set[str]:
    conn = await asyncpg.connect(dsn)
    try:
        return {r[0] for r in await conn.fetch("SELECT indexname FROM pg_indexes WHERE schemaname = 'public'")}
    finally:
        await conn.close()


async def test_trigram_indexes_exist_and_serve_the_search(store: PostgresStore, postgres_db: str) -> None:
    assert store.trigram_enabled
    assert set(TRIGRAM_INDEXES) <= await index_names(postgres_db)
    await check_queries(store)
    # The planner can answer the content search from the trigram index (seq scans discouraged
    # so that a tiny table does not hide it).
    conn = await asyncpg.connect(postgres_db)
    try:
        await conn.execute("SET enable_seqscan = off")
        plan = "\n".join(
            r[0] for r in await conn.fetch("EXPLAIN SELECT 1 FROM messages WHERE content ILIKE $1", "%kubernetes%")
        )
        assert "messages_content_trgm" in plan
        # load_context reads the partial context index, not the whole history.
        plan = "\n".join(
            r[0]
            for r in await conn.fetch(
                "EXPLAIN SELECT * FROM all_messages WHERE session_id = $1 AND is_context ORDER BY context_key, seq",
                "x",
            )
        )
        assert "messages_context" in plan and "messages_archive_context" in plan
    finally:
        await conn.close()


async def test_trigram_off_by_settings_uses_the_slow_path(postgres_db: str) -> None:
    store = await make_postgres_store(postgres_db, pg_settings(trigram=False))
    try:
        assert not store.trigram_enabled
        assert not set(TRIGRAM_INDEXES) & await index_names(postgres_db)
        await check_queries(store)
    finally:
        await store.close()


@pytest.fixture
async def limited_dsn(postgres_db: str, postgres_dsn: str) -> AsyncIterator[str]:
    """A role that may create tables in ``public`` but not extensions (no CREATE on the database),
    like a service account an operator set up without pg_trgm."""
    role = f"ctx_limited_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(postgres_db)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN")
        await admin.execute(f"GRANT CONNECT ON DATABASE {postgres_db.rsplit('/', 1)[1]} TO {role}")
        await admin.execute(f"GRANT USAGE, CREATE ON SCHEMA public TO {role}")
    finally:
        await admin.close()
    try:
        yield with_database(postgres_db, postgres_db.rsplit("/", 1)[1], user=role)
    finally:
        admin = await asyncpg.connect(postgres_db)
        try:
            await admin.execute(f"DROP OWNED BY {role} CASCADE")
            await admin.execute(f"REVOKE ALL ON DATABASE {postgres_db.rsplit('/', 1)[1]} FROM {role}")
        finally:
            await admin.close()
        server = await asyncpg.connect(postgres_dsn)
        try:
            await server.execute(f"DROP ROLE IF EXISTS {role}")
        finally:
            await server.close()


async def test_without_privilege_for_pg_trgm_one_log_line_and_search_still_works(
    limited_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="contextsvc.stores.postgres.schema"):
        store = await make_postgres_store(limited_dsn, pg_settings())
    try:
        assert not store.trigram_enabled
        warnings = [r for r in caplog.records if "pg_trgm unavailable" in r.getMessage()]
        assert len(warnings) == 1
        assert not set(TRIGRAM_INDEXES) & await index_names(limited_dsn)
        await check_queries(store)
    finally:
        await store.close()


async def test_search_matches_gives_display_positions_and_a_snippet(store: PostgresStore) -> None:
    ids = await seed(store)
    long_text = "x" * 100 + " the Kubernetes cluster " + "y" * 100
    await store.append_messages(ids["chat"], [Message(Role.USER, long_text)], caller=ALICE)
    found = await store.search_matches([ids["chat"], ids["deploy"], ids["bob"]], "kubernetes", caller=ALICE)
    # Positions count display rows only (the hidden summary is not one); bob's session is not
    # alice's to search, and "deploy" has no matching message.
    assert set(found) == {ids["chat"]}
    positions, snippet = found[ids["chat"]]
    assert positions == [0, 3]
    assert snippet == "How do I rotate the Kubernetes secrets?"
    found = await store.search_matches([ids["chat"]], "cluster", caller=ALICE)
    snippet = found[ids["chat"]][1]
    assert "Kubernetes cluster" in snippet and len(snippet) <= 40  # cut to preview_chars, around the match
    assert set(await store.search_matches(list(ids.values()), "kubernetes", caller=ADMIN)) == {ids["chat"], ids["bob"]}
    assert await store.search_matches([ids["chat"]], "", caller=ALICE) == {}
