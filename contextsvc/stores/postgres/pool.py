"""Connections to PostgreSQL: the migration connection and the pool, shared by store and bus.

Callers wrap these in ``pg_errors``; nothing here translates errors.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from contextsvc.config import PostgresSettings
from contextsvc.stores.postgres.errors import STALE_CONNECTION_ERRORS
from contextsvc.stores.postgres.reindex import rederive_terms
from contextsvc.stores.postgres.rows import dumps
from contextsvc.stores.postgres.schema import MigrationReport, migrate


async def init_connection(conn: Any) -> None:
    """Per-connection setup: json/jsonb travel as Python values."""
    for name in ("json", "jsonb"):
        await conn.set_type_codec(name, encoder=dumps, decoder=json.loads, schema="pg_catalog")


async def keep_session(conn: Any) -> None:
    """The pools' release hook: nothing to reset (see ``open_pool``, ``open_lock_pool``). asyncpg
    still rolls back a transaction left open and drops listeners before it calls this."""


async def migrate_database(dsn: str, pg: PostgresSettings) -> MigrationReport:
    """Apply missing migrations on a dedicated connection (no statement timeout: index builds
    on a big table may take long; the advisory lock is session-level)."""
    conn = await asyncpg.connect(
        dsn, timeout=pg.connect_timeout_seconds, server_settings={"application_name": "contextsvc-migrate"}
    )
    try:
        report = await migrate(conn, trigram=pg.trigram, lock_timeout_seconds=pg.migration_lock_timeout_seconds)
        await rederive_terms(conn)
        return report
    finally:
        await conn.close()


async def open_pool(dsn: str, pg: PostgresSettings) -> Any:
    """The asyncpg pool. It replaces connections the server closed (a restart) by itself.

    Released connections are not reset (``keep_session``): asyncpg's default reset is one more
    round trip per use (``pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL``), as much as
    the statement of a read, for state nothing on this pool ever leaves behind: its statements
    take transaction-scoped advisory locks only, open no cursors outside a transaction and change
    no setting. Session-level locks and ``SET`` live on the lock pool (``open_lock_pool``), LISTEN
    on the bus's own connection, migrations on their own connection.
    """
    return await asyncpg.create_pool(
        dsn,
        min_size=pg.pool_min_size,
        max_size=pg.pool_max_size,
        timeout=pg.connect_timeout_seconds,
        # A client-side guard for a server that stops answering without closing the socket.
        command_timeout=pg.statement_timeout_ms / 1000 + 5 if pg.statement_timeout_ms else None,
        server_settings={
            "application_name": "contextsvc",
            "statement_timeout": str(pg.statement_timeout_ms),
            # JIT compiles a plan whose *estimated* cost is high (a listing search's per-session
            # subplans): 150 ms of compiling for 10 ms of work, measured by bench/store/run.py.
            # Every statement of this store is short; JIT never pays off here.
            "jit": "off",
        },
        init=init_connection,
        reset=keep_session,
    )


LOCK_APPLICATION_NAME = "contextsvc-lock"


async def open_lock_pool(dsn: str, pg: PostgresSettings) -> Any:
    """Connections that hold session-level advisory locks (compaction locks) while the work they
    guard runs on the main pool, which they therefore never starve. Opened empty: connections
    are made when the first lock is taken and kept a while for the next ones.

    No statement timeout: the wait for a lock is bounded by ``lock_timeout`` instead.

    Not reset on release either (``keep_session``; asyncpg's reset was one more round trip for
    every lock, so every baseline): a connection comes back holding no lock, because the store
    returns it only after its unlock answered or when the lock was refused, and terminates it
    whenever that is uncertain (``PostgresStore._take_lock``, ``_unlock``). The ``lock_timeout``
    a lock set stays behind, and is harmless: every statement on this pool is a lock, which sets
    its own first, or an unlock, which never waits.
    """
    return await asyncpg.create_pool(
        dsn,
        min_size=0,
        max_size=pg.pool_max_size,
        timeout=pg.connect_timeout_seconds,
        server_settings={"application_name": LOCK_APPLICATION_NAME, "statement_timeout": "0"},
        reset=keep_session,
    )


class pooled:
    """``async with pooled(pool, timeout) as conn``: a pooled connection. When one turns out dead
    (the server restarted), every connection opened before is presumed dead too: the pool
    replaces them all on their next use, so one failed call, not one per pooled connection, pays
    for a restart.

    A class rather than an ``asynccontextmanager`` generator: every store call goes through it,
    and a generator frame per call costs more than the acquire itself (``bench/load/append_inproc.py``).
    """

    __slots__ = ("_acquire", "_pool")

    def __init__(self, pool: Any, acquire_timeout: float) -> None:
        self._pool = pool
        self._acquire = pool.acquire(timeout=acquire_timeout)

    async def __aenter__(self) -> Any:
        return await self._acquire.__aenter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        try:
            if exc is not None and isinstance(exc, STALE_CONNECTION_ERRORS):
                await self._pool.expire_connections()
        finally:
            await self._acquire.__aexit__(exc_type, exc, tb)
