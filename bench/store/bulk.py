"""Bulk loading the benchmark's data into each store, fast, in each store's own format.

- files: the session logs are written directly, line for line as the store itself writes them
  (the header line of a new session, then one ``append`` record per row: what
  ``FilesStore.rewrite_log`` produces), through the store's own encoders; one ``os.sync()`` at
  the end instead of an fsync per file. ``FilesStore.open()`` then loads them as usual.
- PostgreSQL: the schema comes from the store's own migrations (``PostgresStore.open()``, trigram
  indexes off); rows go in with ``COPY`` (asyncpg ``copy_records_to_table``), built by the
  store's own row mapping (``postgres.rows.message_columns``), kept counters and preview included.
  ``build_trigram`` then opens the store with trigram on, which builds the indexes as any start
  would.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401 - this checkout's contextsvc, see _checkout.py
import asyncpg
from synth import Generator

from contextsvc.config import PostgresSettings, Settings
from contextsvc.core.codec import message_to_dict
from contextsvc.stores._log_records import _dumps, _session_line
from contextsvc.stores._session import SessionState
from contextsvc.stores.postgres import make_postgres_store
from contextsvc.stores.postgres.rows import message_columns, newest_preview

_SESSION_COLUMNS = (
    "session_id",
    "user_id",
    "profile_id",
    "name",
    "pinned",
    "metadata",
    "state",
    "context_tokens",
    "context_truncated",
    "last_sequence",
    "display_count",
    "context_count",
    "preview",
    "create_time",
    "update_time",
)
_MESSAGE_COLUMNS = (
    "session_id",
    "seq",
    "role",
    "is_context",
    "is_display",
    "context_key",
    "content",
    "create_time",
    "body",
)
_COPY_ROWS = 50_000


def pg_settings(*, trigram: bool) -> Settings:
    return Settings(postgres=PostgresSettings(trigram=trigram, pool_max_size=4))


def write_files(root: Path, gen: Generator) -> float:
    """Write every session's log under ``root``; returns the seconds it took (sync included)."""
    started = time.perf_counter()
    folder = root / "sessions"
    folder.mkdir(parents=True, exist_ok=True)
    for data in gen:
        lines = [_dumps(_session_line(SessionState(data.info)))]
        lines.extend(_dumps({"t": "append", "messages": [message_to_dict(m)]}) for m in data.rows)
        (folder / f"{data.info.id}.jsonl").write_bytes(b"".join(lines))
    os.sync()
    return time.perf_counter() - started


async def copy_postgres(dsn: str, gen: Generator) -> float:
    """Migrate an empty database and COPY every session and row in; returns the seconds it took."""
    started = time.perf_counter()
    store = await make_postgres_store(dsn, pg_settings(trigram=False))
    await store.close()
    # A plain connection: jsonb travels as JSON text, which postgres.rows already produces.
    conn = await asyncpg.connect(dsn)
    try:
        sessions: list[tuple[Any, ...]] = []
        messages: list[tuple[Any, ...]] = []
        for data in gen:
            info, rows = data.info, data.rows
            sessions.append(
                (
                    info.id,
                    info.user_id,
                    info.profile_id,
                    info.name,
                    False,
                    "{}",
                    "{}",
                    0,
                    False,
                    len(rows),
                    len(rows),
                    len(rows),
                    newest_preview(rows) or "",
                    info.create_time,
                    info.update_time,
                )
            )
            columns = message_columns(rows)
            messages.extend((info.id, *values) for values in zip(*columns, strict=True))
            if len(messages) >= _COPY_ROWS:
                await _flush(conn, sessions, messages)
        await _flush(conn, sessions, messages)
        await conn.execute("ANALYZE")
    finally:
        await conn.close()
    return time.perf_counter() - started


async def _flush(conn: Any, sessions: list[tuple[Any, ...]], messages: list[tuple[Any, ...]]) -> None:
    # Sessions first: every message row refers to its session.
    if sessions:
        await conn.copy_records_to_table("sessions", records=sessions, columns=_SESSION_COLUMNS)
    if messages:
        await conn.copy_records_to_table("messages", records=messages, columns=_MESSAGE_COLUMNS)
    sessions.clear()
    messages.clear()


async def build_trigram(dsn: str) -> float:
    """Open the store with trigram indexes on (it builds them, as any start does), then ANALYZE."""
    started = time.perf_counter()
    store = await make_postgres_store(dsn, pg_settings(trigram=True))
    try:
        if not store.trigram_enabled:
            raise RuntimeError("pg_trgm is not available on this server (install postgresql-contrib)")
    finally:
        await store.close()
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("ANALYZE")
    finally:
        await conn.close()
    return time.perf_counter() - started
