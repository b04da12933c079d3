"""Migrations: applied once, a no-op on every later start, safe from several processes at once."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import asyncpg

from contextsvc.config import Settings
from contextsvc.stores.postgres import make_postgres_store
from contextsvc.stores.postgres.pool import migrate_database
from contextsvc.stores.postgres.schema import MIGRATIONS
from tests.support.postgres import ROOT, fresh_database

LATEST = [m.version for m in MIGRATIONS]


async def fingerprint(dsn: str) -> dict[str, Any]:
    """Everything a migration could change: columns, indexes, constraints, views, extensions."""
    conn = await asyncpg.connect(dsn)
    try:
        return {
            "columns": [
                tuple(r)
                for r in await conn.fetch(
                    """SELECT table_name, column_name, data_type, is_nullable, column_default, collation_name
                         FROM information_schema.columns WHERE table_schema = 'public' ORDER BY 1, 2"""
                )
            ],
            "indexes": [
                tuple(r)
                for r in await conn.fetch(
                    "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1"
                )
            ],
            "constraints": [
                tuple(r)
                for r in await conn.fetch(
                    """SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint
                        WHERE connamespace = 'public'::regnamespace ORDER BY 1"""
                )
            ],
            "views": [
                tuple(r)
                for r in await conn.fetch(
                    "SELECT viewname, definition FROM pg_views WHERE schemaname = 'public' ORDER BY 1"
                )
            ],
            "extensions": [r[0] for r in await conn.fetch("SELECT extname FROM pg_extension ORDER BY 1")],
            "migrations": [
                tuple(r) for r in await conn.fetch("SELECT version, name, applied_at FROM schema_migrations ORDER BY 1")
            ],
        }
    finally:
        await conn.close()


async def test_migrations_apply_once_and_then_change_nothing(postgres_db: str) -> None:
    settings = Settings()
    first = await migrate_database(postgres_db, settings.postgres)
    assert first.applied == LATEST
    assert first.trigram
    before = await fingerprint(postgres_db)
    assert {"sessions", "messages", "messages_archive", "events", "history_chunks"} <= {c[0] for c in before["columns"]}
    assert "pg_trgm" in before["extensions"]

    second = await migrate_database(postgres_db, settings.postgres)
    assert second.applied == []
    assert second.trigram
    assert await fingerprint(postgres_db) == before

    # A store opening the database is the same no-op, and it works.
    store = await make_postgres_store(postgres_db, settings)
    await store.close()
    assert await fingerprint(postgres_db) == before


async def test_stores_opening_at_once_migrate_exactly_once(postgres_db: str, postgres_dsn: str) -> None:
    stores = await asyncio.gather(*(make_postgres_store(postgres_db, Settings()) for _ in range(4)))
    try:
        after = await fingerprint(postgres_db)
        assert [v for v, _, _ in after["migrations"]] == LATEST
    finally:
        for store in stores:
            await store.close()

    # The same schema as a database migrated alone.
    async with fresh_database(postgres_dsn) as alone:
        await migrate_database(alone, Settings().postgres)
        reference = await fingerprint(alone)
    strip = {k: v for k, v in after.items() if k != "migrations"}
    assert strip == {k: v for k, v in reference.items() if k != "migrations"}


_MIGRATE_IN_A_PROCESS = """
import asyncio, sys
from contextsvc.config import Settings
from contextsvc.stores.postgres.pool import migrate_database
report = asyncio.run(migrate_database(sys.argv[1], Settings().postgres))
print(",".join(map(str, report.applied)) or "-")
"""


async def test_two_processes_migrating_at_once(postgres_db: str) -> None:
    """Real processes (not just connections): the advisory lock lets one migrate, the other waits."""
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _MIGRATE_IN_A_PROCESS,
            postgres_db,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for _ in range(2)
    ]
    outputs = []
    for proc in procs:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
        assert proc.returncode == 0, err.decode()
        outputs.append(out.decode().strip())
    # Exactly one process applied the migrations; the other found nothing to do.
    assert sorted(outputs) == sorted(["-", ",".join(map(str, LATEST))])
    rows = (await fingerprint(postgres_db))["migrations"]
    assert [v for v, _, _ in rows] == LATEST
