"""The PostgreSQL schema: versioned migrations applied at start, and the optional trigram indexes.

Every table is keyed by ``session_id`` first (blobs by ``blob_id``, calibration by ``model``), so
the schema can be distributed by session (Citus-style) without changes to the queries.

Migrations run under a session-level advisory lock, so any number of replicas may start at once:
the first applies what is missing, the others wait and then find nothing to do. A migration is
never edited once released; a change is a new version appended to ``MIGRATIONS``.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import asyncpg

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Migration:
    version: int
    name: str
    sql: str


_V1 = """
CREATE TABLE sessions (
    session_id        text PRIMARY KEY,
    user_id           text NOT NULL,
    profile_id        text NOT NULL DEFAULT '',
    name              text NOT NULL DEFAULT '',
    pinned            boolean NOT NULL DEFAULT false,
    metadata          jsonb NOT NULL DEFAULT '{}'::jsonb,
    state             jsonb NOT NULL DEFAULT '{}'::jsonb,
    context_tokens    bigint NOT NULL DEFAULT 0,
    context_truncated boolean NOT NULL DEFAULT false,
    -- Counters kept by every mutation (under the session's row lock), so a listing or a
    -- BuildContext never counts a long history.
    last_sequence     bigint NOT NULL DEFAULT 0,
    display_count     bigint NOT NULL DEFAULT 0,
    context_count     bigint NOT NULL DEFAULT 0,
    -- Content of the newest display row with content (cut to 4096 chars; listings cut further).
    preview           text NOT NULL DEFAULT '',
    create_time       timestamptz NOT NULL,
    update_time       timestamptz NOT NULL
);
CREATE INDEX sessions_by_user ON sessions (user_id, pinned DESC, update_time DESC, session_id);
CREATE INDEX sessions_by_order ON sessions (pinned DESC, update_time DESC, session_id);

-- One row per message: the codec's JSON (without content and seq) plus real columns for
-- everything a query filters or sorts on.
CREATE TABLE messages (
    session_id  text NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    seq         bigint NOT NULL,
    role        text NOT NULL,
    is_context  boolean NOT NULL,
    is_display  boolean NOT NULL,
    context_key bigint NOT NULL,
    content     text NOT NULL,
    create_time timestamptz,
    body        jsonb NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE INDEX messages_context ON messages (session_id, context_key, seq) WHERE is_context;
CREATE INDEX messages_display ON messages (session_id, seq) WHERE is_display;

-- Old rows moved out of the hot table; every read goes through all_messages, so they stay visible.
CREATE TABLE messages_archive (
    session_id  text NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    seq         bigint NOT NULL,
    role        text NOT NULL,
    is_context  boolean NOT NULL,
    is_display  boolean NOT NULL,
    context_key bigint NOT NULL,
    content     text NOT NULL,
    create_time timestamptz,
    body        jsonb NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE INDEX messages_archive_context ON messages_archive (session_id, context_key, seq) WHERE is_context;
CREATE INDEX messages_archive_display ON messages_archive (session_id, seq) WHERE is_display;

CREATE VIEW all_messages AS
    SELECT session_id, seq, role, is_context, is_display, context_key, content, create_time, body,
           false AS archived
      FROM messages
    UNION ALL
    SELECT session_id, seq, role, is_context, is_display, context_key, content, create_time, body,
           true AS archived
      FROM messages_archive;

-- AppendMessages idempotency: the first call's sequence numbers per request id.
CREATE TABLE append_requests (
    session_id       text NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    request_id       text NOT NULL,
    sequence_numbers bigint[] NOT NULL,
    create_time      timestamptz NOT NULL,
    PRIMARY KEY (session_id, request_id)
);

-- Content-addressed bytes, stored once whatever the number of sessions referring to them.
CREATE TABLE blobs (
    blob_id     text PRIMARY KEY,
    data        bytea NOT NULL,
    size_bytes  bigint NOT NULL,
    create_time timestamptz NOT NULL
);
-- Which sessions refer to a blob (deleted with the session; unreferenced blobs can be pruned).
CREATE TABLE session_blobs (
    session_id text NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    blob_id    text NOT NULL,
    PRIMARY KEY (session_id, blob_id)
);
CREATE INDEX session_blobs_by_blob ON session_blobs (blob_id);

CREATE TABLE calibration_observations (
    model          text NOT NULL,
    observation_id bigserial,
    chars          bigint NOT NULL,
    tokens         bigint NOT NULL,
    had_images     boolean NOT NULL,
    create_time    timestamptz NOT NULL,
    PRIMARY KEY (model, observation_id)
);

-- Views built by BuildContext, so RecordBaseline works on any replica (soft state).
CREATE SEQUENCE views_saved;
CREATE TABLE views (
    session_id       text NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    view_id          text NOT NULL,
    saved            bigint NOT NULL DEFAULT nextval('views_saved'),
    model            text NOT NULL,
    chars            bigint NOT NULL,
    estimated_tokens bigint NOT NULL,
    had_images       boolean NOT NULL,
    last_sequence    bigint NOT NULL,
    create_time      timestamptz NOT NULL,
    epoch            bigint NOT NULL,
    PRIMARY KEY (session_id, view_id)
);
CREATE INDEX views_by_saved ON views (session_id, saved);

-- The event bus. No foreign key: a session's events (its deletion included) outlive it.
CREATE TABLE events (
    session_id text NOT NULL,
    event_id   bigserial,
    user_id    text NOT NULL,
    kind       text NOT NULL,
    payload    jsonb NOT NULL,
    time       timestamptz NOT NULL,
    PRIMARY KEY (session_id, event_id)
);
CREATE INDEX events_by_id ON events (event_id);
CREATE INDEX events_by_user ON events (user_id, event_id);
CREATE INDEX events_by_time ON events (time);

-- The raw history index (DESIGN 5.6): verbatim chunks of demoted messages. ``terms`` holds the
-- core's search terms of the text and breadcrumbs (contextsvc.core.recall.document_terms, repeats
-- kept for term frequencies), so the database ranks with the same terms and BM25 as every store.
CREATE TABLE history_chunks (
    session_id     text NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    chunk_id       bigserial,
    content_hash   text NOT NULL,
    text           text NOT NULL,
    first_sequence bigint NOT NULL,
    last_sequence  bigint NOT NULL,
    start_time     timestamptz,
    end_time       timestamptz,
    breadcrumbs    jsonb NOT NULL DEFAULT '[]'::jsonb,
    terms          text[] NOT NULL,
    term_count     integer NOT NULL,
    create_time    timestamptz NOT NULL,
    PRIMARY KEY (session_id, chunk_id),
    UNIQUE (session_id, content_hash)
);
CREATE INDEX history_chunks_terms ON history_chunks USING gin (terms);
"""

# API tokens (DESIGN 5.10): only the SHA-256 of a token is stored. Not per session: a small
# table keyed by its hash (a reference table, when distributed).
_V2_API_TOKENS = """
CREATE TABLE api_tokens (
    token_hash     text PRIMARY KEY,
    token_id       text NOT NULL UNIQUE,
    user_id        text NOT NULL,
    is_admin       boolean NOT NULL,
    note           text NOT NULL DEFAULT '',
    create_time    timestamptz NOT NULL,
    expire_time    timestamptz,
    last_used_time timestamptz,
    revoke_time    timestamptz
);
"""

# AppendMessages idempotency remembers what was sent with a request id, so a reused id with a
# different body is refused (REQUEST_ID_REUSED). NULL for rows written before this migration.
_V3_FINGERPRINTS = """
ALTER TABLE append_requests ADD COLUMN fingerprint text;
"""

# Calibration features (content-class units and overheads) of observations and views.
_V4_FEATURES = """
ALTER TABLE calibration_observations ADD COLUMN features double precision[] NOT NULL DEFAULT '{}';
ALTER TABLE views ADD COLUMN features double precision[] NOT NULL DEFAULT '{}';
ALTER TABLE views ADD COLUMN incoming_tokens bigint NOT NULL DEFAULT 0;
"""

# Out-of-sample residuals of baselines (the calibration's margin) and the priced part of a view's
# estimate they are relative to. NULL / 0 for rows written before this migration.
_V5_RESIDUALS = """
ALTER TABLE calibration_observations ADD COLUMN residual double precision;
ALTER TABLE views ADD COLUMN priced_tokens bigint NOT NULL DEFAULT 0;
"""

# Search terms carry the version of the tokenizer that made them (core/recall.TERMS_VERSION):
# rows of an older one are re-derived at start (stores/postgres/reindex.py). Existing rows were
# made by version 1 (no stemming).
_V6_TERMS_VERSION = """
ALTER TABLE history_chunks ADD COLUMN terms_version integer NOT NULL DEFAULT 1;
"""

# The image tokens a view carried (by the image pricing rule): part of its truncation floor.
# 0 for rows written before this migration (their floor is their text's, as before).
_V7_VIEW_IMAGES = """
ALTER TABLE views ADD COLUMN image_tokens bigint NOT NULL DEFAULT 0;
"""

# A session's context epoch: bumped by every statement that changes ``is_context`` of a stored
# row (flag changes, compactions), so a replica's cached context (``context_cache.py``) knows it
# must read the context again rather than only the rows appended since. 0 for existing sessions.
_V8_CONTEXT_EPOCH = """
ALTER TABLE sessions ADD COLUMN context_epoch bigint NOT NULL DEFAULT 0;
"""

# The shape of a view (``core.profile.view_shape``: model, system prompt, vision, per-message
# budget), which its baseline carries into the session's anchor. '' for rows written before.
_V9_VIEW_SHAPE = """
ALTER TABLE views ADD COLUMN shape text NOT NULL DEFAULT '';
"""

# The events that open and close compactions, by session: finding the compactions a replica that
# died left announced and never closed (``PostgresEventBus.open_compressions``) reads this index.
_V10_COMPRESSION_EVENTS = """
CREATE INDEX events_compressions ON events (session_id, event_id)
 WHERE kind IN ('compression_started', 'context_compressed', 'compression_refused');
"""

# AppendMessages idempotency answers a retry as the first call was answered: the session's context
# tokens right after it, beside its sequence numbers. NULL for requests stored before.
_V11_REQUEST_TOKENS = """
ALTER TABLE append_requests ADD COLUMN context_tokens bigint;
"""

# A session's deletion by session: a watcher resuming the stream of a session deleted while it was
# away finds it there (``PostgresEventBus.retained_deletion``), one row a deleted session.
_V12_DELETION_EVENTS = """
CREATE INDEX events_deletions ON events (session_id) WHERE kind = 'session_deleted';
"""

# The rows a view sent cut, and how (``ports.ViewRecord.cuts``), which its baseline carries into
# the session's anchor. NULL (not known) for rows written before: their anchors price no cut anew.
_V13_VIEW_CUTS = """
ALTER TABLE views ADD COLUMN cuts jsonb;
"""

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "initial schema", _V1),
    Migration(2, "api tokens", _V2_API_TOKENS),
    Migration(3, "append request fingerprints", _V3_FINGERPRINTS),
    Migration(4, "calibration features", _V4_FEATURES),
    Migration(5, "calibration residuals", _V5_RESIDUALS),
    Migration(6, "search terms version", _V6_TERMS_VERSION),
    Migration(7, "view image tokens", _V7_VIEW_IMAGES),
    Migration(8, "context epoch", _V8_CONTEXT_EPOCH),
    Migration(9, "view shape", _V9_VIEW_SHAPE),
    Migration(10, "compression events index", _V10_COMPRESSION_EVENTS),
    Migration(11, "append request context tokens", _V11_REQUEST_TOKENS),
    Migration(12, "deletion events index", _V12_DELETION_EVENTS),
    Migration(13, "view cuts", _V13_VIEW_CUTS),
)

#: Built when pg_trgm is installed: ILIKE '%q%' then uses an index instead of a full scan.
TRIGRAM_INDEXES: dict[str, str] = {
    "sessions_name_trgm": "sessions USING gin (name gin_trgm_ops)",
    "messages_content_trgm": "messages USING gin (content gin_trgm_ops)",
    "messages_archive_content_trgm": "messages_archive USING gin (content gin_trgm_ops)",
    "history_chunks_text_trgm": "history_chunks USING gin (text gin_trgm_ops)",
}


def lock_key(name: str) -> int:
    """A stable signed 64-bit advisory lock key for ``name``."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


MIGRATION_LOCK = lock_key("contextsvc:migrations")


def lock_key32(name: str) -> int:
    """A stable signed 32-bit key for ``name`` (one half of a two-key advisory lock)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big", signed=True)


#: Compaction locks use PostgreSQL's two-key form ``pg_advisory_lock(int4, int4)``, whose key space
#: is separate from the one-key ``bigint`` form of ``MIGRATION_LOCK`` and the event bus's publish
#: lock: no session id can ever collide with those. The first key names the purpose.
COMPACTION_LOCK_SPACE = lock_key32("contextsvc:compaction")


def compaction_lock_keys(session_id: str) -> tuple[int, int]:
    """The two advisory-lock keys of ``session_id``'s compaction lock. Two sessions whose ids
    share a 32-bit hash merely compact one at a time; correctness does not depend on the hash."""
    return COMPACTION_LOCK_SPACE, lock_key32(session_id)


#: Pinned appends of one session (``PostgresStore.pinned_lock``): a space of their own, so they
#: never wait for a compaction.
PINNED_LOCK_SPACE = lock_key32("contextsvc:pinned")


def pinned_lock_keys(session_id: str) -> tuple[int, int]:
    """The two advisory-lock keys of ``session_id``'s pinned-append lock."""
    return PINNED_LOCK_SPACE, lock_key32(session_id)


@dataclass(slots=True)
class MigrationReport:
    applied: list[int] = field(default_factory=list)
    trigram: bool = False


async def migrate(conn: Any, *, trigram: bool, lock_timeout_seconds: float) -> MigrationReport:
    """Bring the database to the newest schema; safe to run from many processes at once.

    ``conn`` is a dedicated asyncpg connection (session-level advisory lock; no statement timeout,
    since index builds on a big table may take long).
    """
    report = MigrationReport()
    await conn.execute(f"SET lock_timeout = '{int(lock_timeout_seconds * 1000)}ms'")
    await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK)
    try:
        await conn.execute("RESET lock_timeout")
        await conn.execute(
            """CREATE TABLE IF NOT EXISTS schema_migrations (
                   version    integer PRIMARY KEY,
                   name       text NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT now())"""
        )
        applied = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
        known = {m.version for m in MIGRATIONS}
        if applied - known:
            # A newer replica migrated further (rolling deploy): run, but say so once.
            log.warning("database schema is newer than this build", extra={"unknown_versions": sorted(applied - known)})
        for migration in MIGRATIONS:
            if migration.version in applied:
                continue
            async with conn.transaction():
                await conn.execute(migration.sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", migration.version, migration.name
                )
            report.applied.append(migration.version)
            log.info("schema migration applied", extra={"version": migration.version, "migration": migration.name})
        report.trigram = await _trigram(conn) if trigram else False
        if not trigram:
            log.info("trigram search disabled by settings; search scans rows")
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK)
    return report


async def _trigram(conn: Any) -> bool:
    """Install pg_trgm if allowed, then build the trigram indexes; False (with one log line) if not."""
    installed = await conn.fetchval("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'pg_trgm')")
    if not installed:
        try:
            await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
        except (
            asyncpg.InsufficientPrivilegeError,
            asyncpg.UndefinedFileError,
            asyncpg.FeatureNotSupportedError,
        ) as exc:
            # Trusted since PostgreSQL 13, but still needs CREATE on the database; an operator can
            # run "CREATE EXTENSION pg_trgm" once and the next start builds the indexes.
            log.warning(
                "pg_trgm unavailable; search falls back to sequential scans",
                extra={"reason": str(exc).splitlines()[0]},
            )
            return False
    for name, target in TRIGRAM_INDEXES.items():
        await conn.execute(f"CREATE INDEX IF NOT EXISTS {name} ON {target}")
    return True
