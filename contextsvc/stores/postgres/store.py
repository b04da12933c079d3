"""The PostgreSQL store: sessions shared by any number of replicas (DESIGN §5.7, §5.8).

An asyncpg pool; migrations at ``open()`` (see ``schema``). Every mutation of a session is one
transaction that starts by locking the session's row (``SELECT … FOR UPDATE``; the append, the
hot path, is one statement whose ``UPDATE`` of that row is its lock): mutations of one session are
serialized across processes, so sequence numbers never collide, and a request id appends once
(an append's twin that raced past the request-id check collides on it and is answered as a
replay). Readers use single statements and see whole commits.

Compactions of one session are serialized across processes by ``compaction_lock``: a
session-level advisory lock held on a connection of a small pool of its own (see its docstring).

Beyond ``SessionStore`` it offers what the listing, archive and maintenance paths need:
``count_sessions``, ``search_matches``, ``archive_old_messages`` / ``list_archived_messages``,
``prune_unreferenced_blobs`` and ``make_event_bus`` (a ``PostgresEventBus`` on the same pool).

Every driver error is translated by ``errors.pg_errors``; the pool replaces connections that died with
a server restart by itself, so the service recovers without being restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import asyncpg

from contextsvc.clock import SYSTEM_CLOCK
from contextsvc.config import Settings
from contextsvc.core.calibration import Observation
from contextsvc.core.maintenance import Candidate
from contextsvc.core.messages import BufferKind, Message
from contextsvc.core.priors import current_features
from contextsvc.core.recall import BM25_B, BM25_K1, TERMS_VERSION, weighted_query_terms
from contextsvc.core.session import AppendResult, ListPosition, Principal, SessionInfo, SessionPage, is_session_id
from contextsvc.errors import Conflict, ContextError, InvalidArgument, NotFound, RequestIdReused, Unavailable
from contextsvc.ports import (
    AppendEvent,
    BaselineWrite,
    Clock,
    HistoryChunk,
    InitialContent,
    ScoredChunk,
    SessionProfileChanged,
    StoreHealth,
    ViewRecord,
)
from contextsvc.stores._base import (
    check_blob,
    compaction_conflict,
    context_bound,
    is_blob_id,
    session_not_found,
)
from contextsvc.stores._session import utc
from contextsvc.stores.postgres.bus import EVENT_COLUMNS, PUBLISH_LOCK, PostgresEventBus, notice
from contextsvc.stores.postgres.context_cache import ContextCache, ContextVersion, KeyedRow, extended, whole
from contextsvc.stores.postgres.errors import STALE_CONNECTION_ERRORS, pg_errors
from contextsvc.stores.postgres.lanes import Group, StatementLanes
from contextsvc.stores.postgres.pool import migrate_database, open_lock_pool, open_pool, pooled
from contextsvc.stores.postgres.rows import (
    append_columns,
    chunk_columns,
    chunk_from_row,
    like_pattern,
    message_columns,
    message_from_row,
    newest_preview,
    session_from_row,
    stamped,
    view_from_row,
)
from contextsvc.stores.postgres.schema import compaction_lock_keys, pinned_lock_keys
from contextsvc.stores.postgres.tokens import PostgresTokenStore

T = TypeVar("T")

log = logging.getLogger(__name__)

_NO_BOUND = 2**63 - 1

__all__ = ["PostgresStore", "make_postgres_store"]


async def make_postgres_store(
    dsn: str, settings: Settings | None = None, *, clock: Clock | None = None
) -> PostgresStore:
    """An opened ``PostgresStore`` (migrated, pool ready). The conformance suite's factory."""
    store = PostgresStore(dsn, settings, clock=clock)
    await store.open()
    return store


class PostgresStore:
    """``SessionStore`` (and ``TokenStore``, ``HistoryStore``) on PostgreSQL through asyncpg."""

    def __init__(self, dsn: str, settings: Settings | None = None, *, clock: Clock | None = None) -> None:
        self._dsn = dsn
        self._settings = settings if settings is not None else Settings()
        self._pg = self._settings.postgres
        self._clock: Clock = clock if clock is not None else SYSTEM_CLOCK
        self._pool: Any = None
        self._lock_pool: Any = None
        self._trigram = False
        self._inflight: set[asyncio.Future[Any]] = set()
        #: appends run on a few connections kept while appends wait (``lanes.py``).
        lanes = min(self._pg.append_lanes, self._pg.pool_max_size)
        self._append_lanes = StatementLanes(self._connection, lanes, self._track)
        #: the other single statements of a turn, the same way (``_statement``).
        self._lanes = StatementLanes(
            self._connection, min(self._pg.statement_lanes, self._pg.pool_max_size), self._track
        )
        #: baselines anchored while others wait are anchored together (``_anchor_many``).
        self._anchor_group = Group(self._anchor_many, self._pg.anchor_group_max)
        #: views saved while others wait are saved together (``_save_views``).
        self._view_group = Group(self._save_views, self._pg.view_group_max)
        #: builds' context reads that wait for a statement lane together: one statement (``_read_contexts``).
        self._read_group = Group(self._read_contexts, self._pg.read_group_max)
        #: appends publishing their event that wait together commit together (``_append_many``).
        self._append_group = Group(self._append_many, self._pg.append_group_max)
        #: the event buses made on this store's pool (``make_event_bus``): appends may publish for them.
        self._buses: weakref.WeakSet[PostgresEventBus] = weakref.WeakSet()
        #: contexts read lately: a build reads only the rows added since (``context_cache.py``).
        self._contexts = ContextCache(int(self._pg.context_cache_mb * 1024 * 1024))
        #: model -> observations this replica wrote with an anchor (``anchor_baseline``) and has
        #: not trimmed since.
        self._untrimmed: dict[str, int] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def trigram_enabled(self) -> bool:
        """Whether pg_trgm indexes back ILIKE searches (else they scan)."""
        return self._trigram

    async def open(self) -> None:
        if self._pool is not None:
            return
        with pg_errors("open"):
            report = await migrate_database(self._dsn, self._pg)
            self._trigram = report.trigram
            self._pool = await open_pool(self._dsn, self._pg)
            try:
                self._lock_pool = await open_lock_pool(self._dsn, self._pg)
            except BaseException:
                await self._close_pool(self._pool)
                self._pool = None
                raise

    async def health_check(self) -> StoreHealth:
        """Can the database take this replica's writes now? One statement on a pooled connection,
        bounded by the pool's acquire and connect timeouts: a primary that is not read-only says
        yes; a stopped or unreachable server, a standby or a read-only database say no, and the
        health service turns NOT_SERVING until it answers again (``store_health.py``). It reads
        two settings rather than writing a row: a probe every few seconds on every replica would
        otherwise spend a transaction id each."""
        query = "SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'"
        bound = self._pg.acquire_timeout_seconds + self._pg.connect_timeout_seconds
        try:
            writable = await asyncio.wait_for(self._read("health check", lambda conn: conn.fetchval(query)), bound)
        except (ContextError, TimeoutError, OSError, asyncpg.PostgresError) as exc:
            return StoreHealth(writable=False, detail=str(exc) or type(exc).__name__)
        if not writable:
            return StoreHealth(writable=False, detail="the database is a standby or read-only")
        return StoreHealth(writable=True)

    async def close(self) -> None:
        while self._inflight:
            await asyncio.wait(list(self._inflight))
        pool, self._pool = self._pool, None
        lock_pool, self._lock_pool = self._lock_pool, None
        for each in (lock_pool, pool):
            if each is not None:
                await self._close_pool(each)

    async def _close_pool(self, pool: Any) -> None:
        try:
            await asyncio.wait_for(pool.close(), timeout=self._pg.connect_timeout_seconds)
        except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            pool.terminate()

    def api_tokens(self) -> PostgresTokenStore:
        """The API tokens of this database (``ports.ApiTokenStore``), through this store's pool."""
        return PostgresTokenStore(self._read, self._write)

    def make_event_bus(self) -> PostgresEventBus:
        """The event bus of this database, publishing and fetching through this store's pool."""
        if self._pool is None:
            raise Unavailable("PostgreSQL store is not open")
        bus = PostgresEventBus(self._dsn, self._settings, clock=self._clock, pool=self._pool)
        self._buses.add(bus)
        return bus

    def publishes_appends_to(self, bus: object) -> bool:
        """Whether an append can publish its event for ``bus`` in its own statement
        (``ports.EventPublishingStore``): a bus this store made, on this store's pool."""
        return isinstance(bus, PostgresEventBus) and bus in self._buses and bus.pool is self._pool

    # -- cross-process compaction lock --------------------------------------------------------

    @asynccontextmanager
    async def compaction_lock(self, session_id: str) -> AsyncIterator[None]:
        """Hold the session's compaction lock for the block, whichever replica asks.

        A session-level ``pg_advisory_lock`` (two-key form, see ``compaction_lock_keys``) on a
        connection of the lock pool, held for the whole block while the block's own statements
        run on the main pool. PostgreSQL releases it when that connection ends, so a replica
        that crashes mid-compaction (kill -9, lost network) never leaves the session locked.
        The same makes the lock lost when its connection dies under a running block (a server
        restart): ``commit_compaction`` then still refuses to demote a row that already left the
        context (``Conflict``), so two overlapping compactions never both commit.

        The wait is bounded by ``postgres.compaction_lock_timeout_seconds`` (``lock_timeout``
        on the server): past it, ``Conflict`` (another replica is still compacting). A caller
        cancelled while waiting or holding leaves nothing locked: a connection whose lock state
        is uncertain is terminated, never returned to the pool.
        """
        async with self._session_lock(
            session_id,
            compaction_lock_keys,
            self._pg.compaction_lock_timeout_seconds,
            "another replica is compacting this session; retry later",
        ):
            yield

    @asynccontextmanager
    async def pinned_lock(self, session_id: str) -> AsyncIterator[None]:
        """Hold the session's pinned-append lock for the block (``SessionStore.pinned_lock``):
        the same kind of lock as ``compaction_lock``, in a key space of its own. It is held for
        a context read and an append, so its wait is bounded like a pooled connection's
        (``postgres.acquire_timeout_seconds``), then ``Conflict``."""
        async with self._session_lock(
            session_id,
            pinned_lock_keys,
            self._pg.acquire_timeout_seconds,
            "another append of pinned messages to this session is running; retry later",
        ):
            yield

    @asynccontextmanager
    async def _session_lock(
        self, session_id: str, keys: Callable[[str], tuple[int, int]], wait: float, busy: str
    ) -> AsyncIterator[None]:
        """A session-level advisory lock on a lock-pool connection (``compaction_lock``), waited
        for at most ``wait`` seconds, then ``Conflict`` saying ``busy``."""
        if not isinstance(session_id, str):
            raise session_not_found(session_id)
        pool = self._lock_pool
        if pool is None:
            raise Unavailable("PostgreSQL store is not open")
        deadline = asyncio.get_running_loop().time() + wait
        first, second = keys(session_id)
        with pg_errors("compaction_lock"):
            try:
                conn = await self._take_lock(pool, first, second, deadline, session_id, wait)
            except STALE_CONNECTION_ERRORS:
                # A pooled connection that died with a server restart (nothing was locked on it):
                # the pool was told to replace them all; once more on a fresh one.
                conn = await self._take_lock(pool, first, second, deadline, session_id, wait)
        if conn is None:
            raise Conflict(busy, metadata={"session_id": session_id, "waited_seconds": f"{wait:g}"})
        try:
            yield
        finally:
            await self._unlock(pool, conn, first, second, session_id)

    async def _take_lock(
        self, pool: Any, first: int, second: int, deadline: float, session_id: str, wait: float
    ) -> Any:
        """A lock-pool connection holding the lock, or None when ``deadline`` passed first.
        Driver errors propagate untranslated (the caller retries a stale connection once)."""
        loop = asyncio.get_running_loop()
        remaining = max(deadline - loop.time(), 0.001)
        try:
            # Every connection of the lock pool busy means this replica holds that many locks
            # (compactions, summarizer calls included): waiting for one is waiting for a lock,
            # bounded alike. Making a connection stays bounded by connect_timeout_seconds.
            conn = await pool.acquire(timeout=remaining)
        except TimeoutError:
            if loop.time() < deadline:
                raise  # the connect timed out: PostgreSQL does not answer
            raise Conflict(
                f"this replica already holds {pool.get_max_size()} session locks "
                "(postgres.pool_max_size, mostly compactions running), none freed in time; retry later",
                metadata={"session_id": session_id, "waited_seconds": f"{wait:g}"},
            ) from None
        remaining = max(deadline - loop.time(), 0.001)
        try:
            # One round trip; the literals are our own integers. lock_timeout stays set on this
            # connection (the lock pool does not reset): the next lock taken on it sets its own.
            await conn.execute(
                f"SET lock_timeout = '{int(remaining * 1000) + 1}ms'; SELECT pg_advisory_lock({first}, {second})",
                # Client-side bound in case the server stops answering altogether.
                timeout=remaining + self._pg.connect_timeout_seconds,
            )
        except asyncpg.LockNotAvailableError:
            await pool.release(conn)  # the server gave up cleanly: nothing is held
            return None
        except BaseException as exc:
            # Failed or cancelled mid-wait: the lock may have been granted as we gave up. Ending
            # the connection is the one way to be sure it is not held.
            _discard(conn)
            await pool.release(conn)
            if isinstance(exc, STALE_CONNECTION_ERRORS):
                await pool.expire_connections()
            raise
        return conn

    async def _unlock(self, pool: Any, conn: Any, first: int, second: int, session_id: str) -> None:
        """Release the lock and return the connection. When that cannot be done cleanly (server
        gone, caller cancelled again) the connection is terminated, which releases the lock just
        as well; the guarded work's outcome stands either way, so only cancellation propagates."""
        try:
            released = await conn.fetchval(
                "SELECT pg_advisory_unlock($1, $2)", first, second, timeout=self._pg.connect_timeout_seconds
            )
            if not released:
                # Its connection was reset under us (a server restart): another replica may have
                # compacted meanwhile; the engine's epoch check covers what follows.
                log.warning("compaction lock was already gone on release", extra={"session_id": session_id})
        except Exception as exc:
            _discard(conn)
            log.warning(
                "compaction lock connection dropped on release",
                extra={"session_id": session_id, "error": f"{type(exc).__name__}: {str(exc)[:160]}"},
            )
        except BaseException:
            _discard(conn)
            raise
        finally:
            # asyncpg shields the release itself; a terminated connection is simply dropped.
            await pool.release(conn)

    # -- plumbing ----------------------------------------------------------------------------

    def _now(self) -> datetime:
        return utc(self._clock.now())

    def _info(self, row: Any) -> SessionInfo:
        return session_from_row(row, self._settings.preview_chars)

    def _connection(self) -> pooled:
        pool = self._pool
        if pool is None:
            raise Unavailable("PostgreSQL store is not open")
        return pooled(pool, self._pg.acquire_timeout_seconds)

    async def _read(self, operation: str, work: Callable[[Any], Awaitable[T]]) -> T:
        with pg_errors(operation):
            try:
                async with self._connection() as conn:
                    return await work(conn)
            except STALE_CONNECTION_ERRORS:
                # The pool handed out a connection the server had already closed (a restart);
                # a read is safe to repeat once on a fresh one.
                async with self._connection() as conn:
                    return await work(conn)

    async def _statement(
        self,
        operation: str,
        work: Callable[[Any], Awaitable[T]],
        *,
        read: bool = False,
        group: Group | None = None,
        item: Any = None,
    ) -> T:
        """``work(conn)``, one statement (its own transaction), on a statement lane (``lanes.py``):
        a connection kept while statements wait, no acquire and release each; with ``group``, it
        may run as ``item`` in one transaction with the group's others waiting. Shielded as
        ``_write`` is; a ``read`` runs once more on a fresh connection after a dead one."""
        with pg_errors(operation):
            try:
                return await self._lanes.run(work, group, item)
            except STALE_CONNECTION_ERRORS:
                if not read:
                    raise
                return await self._lanes.run(work, group, item)

    async def _write(self, operation: str, work: Callable[[Any], Awaitable[T]], *, transaction: bool = True) -> T:
        """One transaction, shielded: a caller cancelled half-way does not abort a commit in
        flight (its outcome would be unknown), and ``close()`` waits for it. ``transaction=False``:
        ``work`` runs single statements, each its own transaction (no BEGIN/COMMIT round trips)."""
        if not transaction:
            return await self._statement(operation, work)

        async def run() -> T:
            with pg_errors(operation):
                async with self._connection() as conn, conn.transaction():
                    return await work(conn)

        task = asyncio.ensure_future(run())
        self._track(task)
        return await asyncio.shield(task)

    def _events_committed(self, event_id: int | None) -> None:
        """A statement of this store committed event ``event_id`` for its buses
        (``PostgresEventBus.committed``)."""
        for bus in list(self._buses):
            bus.committed(event_id or None)

    def _track(self, task: asyncio.Future[Any]) -> None:
        """``close()`` waits for ``task``; its outcome is fetched even when nobody awaits it."""
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        task.add_done_callback(_settle)

    @staticmethod
    async def _owned(conn: Any, session_id: str, caller: Principal, *, lock: bool = False) -> Any:
        """The session's row if ``caller`` may use it; NotFound otherwise (unknown or foreign)."""
        if not isinstance(session_id, str):
            raise session_not_found(session_id)
        sql = "SELECT * FROM sessions WHERE session_id = $1" + (" FOR UPDATE" if lock else "")
        row = await conn.fetchrow(sql, session_id)
        if row is None or not caller.may_read(row["user_id"]):
            raise session_not_found(session_id)
        return row

    # -- sessions ----------------------------------------------------------------------------

    async def create_session(
        self,
        *,
        caller: Principal,
        profile_id: str,
        name: str = "",
        metadata: Mapping[str, Any] | None = None,
        session_id: str | None = None,
        initial: InitialContent | None = None,
    ) -> SessionInfo:
        sid = session_id if session_id is not None else str(uuid.uuid4())
        if not is_session_id(sid):
            raise InvalidArgument.field("session_id", "must be a lowercase hyphenated UUID")
        now = self._now()
        if initial is not None:
            return await self._create_filled(sid, caller, profile_id, name, dict(metadata or {}), now, initial)

        async def work(conn: Any) -> SessionInfo:
            row = await conn.fetchrow(
                """INSERT INTO sessions (session_id, user_id, profile_id, name, metadata, create_time, update_time)
                   VALUES ($1, $2, $3, $4, $5, $6, $6)
                   ON CONFLICT (session_id) DO NOTHING
                   RETURNING *""",
                sid,
                caller.user_id,
                profile_id,
                name,
                dict(metadata or {}),
                now,
            )
            if row is None:
                raise Conflict("session already exists", metadata={"session_id": sid})
            return self._info(row)

        return await self._write("create_session", work)

    async def _create_filled(
        self,
        sid: str,
        caller: Principal,
        profile_id: str,
        name: str,
        metadata: dict[str, Any],
        now: datetime,
        initial: InitialContent,
    ) -> SessionInfo:
        """A session created with its rows, state and history chunks in one transaction (a fork):
        it exists whole or not at all."""
        rows = list(initial.messages)  # numbered by the statement, from 1
        append = _append_args(sid, rows, caller=caller, now=now, context_tokens_delta=initial.context_tokens)
        chunks = chunk_columns(initial.history) if initial.history else None

        async def work(conn: Any) -> SessionInfo:
            created = await conn.fetchval(
                """INSERT INTO sessions (session_id, user_id, profile_id, name, metadata, create_time, update_time)
                   VALUES ($1, $2, $3, $4, $5, $6, $6)
                   ON CONFLICT (session_id) DO NOTHING
                   RETURNING 1""",
                sid,
                caller.user_id,
                profile_id,
                name,
                metadata,
                now,
            )
            if created is None:
                raise Conflict("session already exists", metadata={"session_id": sid})
            if rows:
                await conn.fetchrow(_APPEND_SQL, *append)
            if initial.state is not None:
                await conn.execute(
                    "UPDATE sessions SET state = $2::jsonb WHERE session_id = $1", sid, dict(initial.state)
                )
            if chunks is not None:
                await self._insert_chunks(conn, sid, chunks)
            return self._info(await conn.fetchrow("SELECT * FROM sessions WHERE session_id = $1", sid))

        return await self._write("create_session", work)

    async def replayed_append(
        self, session_id: str, request_id: str, *, caller: Principal, request_fingerprint: str = ""
    ) -> AppendResult | None:
        if not isinstance(session_id, str):
            raise session_not_found(session_id)

        async def work(conn: Any) -> Any:
            return await conn.fetchrow(
                """SELECT s.*, r.sequence_numbers AS prior_numbers, r.fingerprint AS prior_fingerprint,
                          r.context_tokens AS prior_context_tokens
                     FROM sessions s LEFT JOIN append_requests r
                       ON r.session_id = s.session_id AND r.request_id = $2
                    WHERE s.session_id = $1""",
                session_id,
                request_id,
            )

        row = await self._statement("replayed_append", work, read=True)
        if row is None or not caller.may_read(row["user_id"]):
            raise session_not_found(session_id)
        if row["prior_numbers"] is None or not request_id:
            return None
        stored = row["prior_fingerprint"] or ""
        if stored and request_fingerprint and stored != request_fingerprint:
            raise RequestIdReused(request_id)
        return AppendResult(
            list(row["prior_numbers"]), self._info(row), replayed=True, first_context_tokens=row["prior_context_tokens"]
        )

    async def get_session(self, session_id: str, *, caller: Principal) -> SessionInfo:
        async def work(conn: Any) -> SessionInfo:
            return self._info(await self._owned(conn, session_id, caller))

        return await self._statement("get_session", work, read=True)

    async def list_sessions(
        self,
        *,
        caller: Principal,
        offset: int = 0,
        limit: int,
        profile_id: str = "",
        query: str = "",
        after: ListPosition | None = None,
    ) -> SessionPage:
        """One statement: the total and the page (counters and preview come from the session
        rows, no history is read). The filter appears twice rather than in a CTE: a CTE would be
        materialized whole (every matching row, previews included) before the page is cut, while
        the page subquery walks the listing index and stops at ``offset + limit``; a trigram
        index keeps the count fast under ``query``. Both parts read the same snapshot."""
        if offset < 0:
            raise InvalidArgument.field("offset", "must not be negative")
        if limit < 0:
            raise InvalidArgument.field("limit", "must not be negative")
        args: list[Any] = []
        where = _listing_filter(caller, profile_id, query, args)
        page_where = where
        if after is not None:
            # Strictly after the position in the listing's order (pinned DESC, update_time DESC,
            # session_id), compared as that ORDER BY compares (the same collation).
            args += [after.pinned, after.update_time, after.session_id]
            p, t, i = (f"${len(args) - k}" for k in (2, 1, 0))
            page_where = f"""{where} AND (s.pinned < {p} OR (s.pinned = {p}
                               AND (s.update_time < {t} OR (s.update_time = {t} AND s.session_id > {i}))))"""
        args += [limit, offset]
        sql = f"""
            SELECT t.total, p.*
              FROM (SELECT count(*) AS total FROM sessions s WHERE {where}) t
              LEFT JOIN LATERAL (
                    SELECT s.* FROM sessions s WHERE {page_where}
                     ORDER BY s.pinned DESC, s.update_time DESC, s.session_id
                     LIMIT ${len(args) - 1} OFFSET ${len(args)}) p ON true
             ORDER BY p.pinned DESC, p.update_time DESC, p.session_id"""

        async def work(conn: Any) -> SessionPage:
            rows = await conn.fetch(sql, *args)
            total = rows[0]["total"] if rows else 0
            return SessionPage([self._info(r) for r in rows if r["session_id"] is not None], total=total)

        return await self._read("list_sessions", work)

    async def count_sessions(self, *, caller: Principal, profile_id: str = "", query: str = "") -> int:
        """How many sessions ``list_sessions`` would page through."""
        args: list[Any] = []
        sql = f"SELECT count(*) FROM sessions s WHERE {_listing_filter(caller, profile_id, query, args)}"

        async def work(conn: Any) -> int:
            return int(await conn.fetchval(sql, *args))

        return await self._read("count_sessions", work)

    async def search_matches(
        self, session_ids: Sequence[str], query: str, *, caller: Principal
    ) -> dict[str, tuple[list[int], str]]:
        """Where ``query`` occurs: per session, the positions in its display history (0-based,
        the numbering a client scrolls to) of the matching display rows, and a snippet around
        the first match. One aggregate over the given sessions; sessions ``caller`` may not read
        and sessions without a match are absent."""
        if not query or not session_ids:
            return {}
        preview = self._settings.preview_chars
        sql = """
            SELECT x.session_id,
                   array_agg(x.idx ORDER BY x.idx) AS indices,
                   (array_agg(substr(x.content, greatest(1, least(strpos(lower(x.content), lower($2)) - $4,
                                                             length(x.content) - $5 + 1)), $5)
                              ORDER BY x.idx))[1] AS snippet
              FROM (SELECT m.session_id, m.content,
                           row_number() OVER (PARTITION BY m.session_id ORDER BY m.seq) - 1 AS idx
                      FROM all_messages m JOIN sessions s ON s.session_id = m.session_id
                     WHERE m.session_id = ANY($1::text[]) AND m.is_display
                       AND ($6 OR s.user_id = $7)) x
             WHERE x.content ILIKE $3
             GROUP BY x.session_id"""
        ids = [s for s in session_ids if isinstance(s, str)]

        async def work(conn: Any) -> dict[str, tuple[list[int], str]]:
            rows = await conn.fetch(
                # A third of the snippet shows what precedes the match.
                sql,
                ids,
                query,
                like_pattern(query),
                preview // 3,
                preview,
                caller.is_admin,
                caller.user_id,
            )
            return {r["session_id"]: (list(r["indices"]), r["snippet"]) for r in rows}

        return await self._read("search_matches", work)

    async def update_session(
        self,
        session_id: str,
        *,
        caller: Principal,
        name: str | None = None,
        pinned: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SessionInfo:
        if name is None and pinned is None and metadata is None:
            return await self.get_session(session_id, caller=caller)

        async def work(conn: Any) -> SessionInfo:
            await self._owned(conn, session_id, caller, lock=True)
            row = await conn.fetchrow(
                """UPDATE sessions
                      SET name = COALESCE($2, name), pinned = COALESCE($3, pinned),
                          metadata = COALESCE($4::jsonb, metadata), update_time = $5
                    WHERE session_id = $1
                RETURNING *""",
                session_id,
                name,
                pinned,
                dict(metadata) if metadata is not None else None,
                self._now(),
            )
            return self._info(row)

        return await self._write("update_session", work)

    async def delete_session(self, session_id: str, *, caller: Principal) -> None:
        """Rows, archive, request ids, blob references, views and history chunks go with it
        (ON DELETE CASCADE); the blobs themselves stay until ``prune_unreferenced_blobs``."""

        async def work(conn: Any) -> None:
            await self._owned(conn, session_id, caller, lock=True)
            await conn.execute("DELETE FROM sessions WHERE session_id = $1", session_id)

        await self._write("delete_session", work)
        self._contexts.forget(session_id)

    async def maintenance_candidates(self, busy: Collection[str] = ()) -> tuple[list[Candidate], int]:
        """Every session with the bytes of its rows (hot and archived), for store maintenance
        (``core/maintenance.py``). Blobs, chunks and events are not counted."""

        async def work(conn: Any) -> list[Any]:
            return list(
                await conn.fetch(
                    "SELECT s.session_id, s.user_id, s.pinned, s.update_time,"
                    " COALESCE((SELECT sum(pg_column_size(m.*)) FROM messages m"
                    "   WHERE m.session_id = s.session_id), 0)"
                    " + COALESCE((SELECT sum(pg_column_size(a.*)) FROM messages_archive a"
                    "   WHERE a.session_id = s.session_id), 0) AS bytes"
                    " FROM sessions s"
                )
            )

        rows = await self._read("maintenance_candidates", work)
        busy_set = set(busy)
        return [
            Candidate(
                session_id=row["session_id"],
                update_time=utc(row["update_time"]),
                pinned=row["pinned"],
                size_bytes=int(row["bytes"]),
                busy=row["session_id"] in busy_set,
                user_id=row["user_id"],
            )
            for row in rows
        ], 0

    # -- rows --------------------------------------------------------------------------------

    async def append_messages(
        self,
        session_id: str,
        messages: Sequence[Message],
        *,
        caller: Principal,
        request_id: str = "",
        context_tokens_delta: int = 0,
        request_fingerprint: str = "",
        expected_profile_id: str | None = None,
        event: AppendEvent | None = None,
    ) -> AppendResult:
        """One statement in its own transaction (``_APPEND_SQL``): one round trip per append.

        With ``event`` (the engine passes one only for a bus this store made: ``publishes_appends_to``)
        the statement also publishes it (``_APPEND_PUBLISH_SQL``), in the bus's order, and the
        result carries its id: no second round trip, and the event commits with the rows.

        With ``expected_profile_id`` the statement appends only to a session of that profile;
        for one of another profile (deleted and created again under the same id) it appends
        nothing and returns the session's row, and ``SessionProfileChanged`` is raised.

        The session's row lock is the ``UPDATE`` (taken before any row is written; a twin append
        waits on it and, under READ COMMITTED, numbers its rows after this one's). The request-id
        check reads the statement's snapshot, taken before that wait: a twin with the same request
        id that committed meanwhile is not seen, so this one's ``append_requests`` row collides
        with the twin's, the whole statement rolls back, and it runs once more, when the twin's
        request is visible and is answered as a replay (what the lock-then-read used to give)."""
        if not isinstance(session_id, str):
            raise session_not_found(session_id)
        args = _append_args(
            session_id,
            messages,
            caller=caller,
            now=self._now(),
            request_id=request_id,
            context_tokens_delta=context_tokens_delta,
            request_fingerprint=request_fingerprint,
            expected_profile_id=expected_profile_id,
        )
        sql = _APPEND_SQL
        if event is not None:
            sql = _APPEND_PUBLISH_SQL
            args = (*args, PUBLISH_LOCK, event.kind, dict(event.payload), self._pg.event_channel)

        async def work(conn: Any) -> Any:
            try:
                return await conn.fetchrow(sql, *args)
            except asyncpg.UniqueViolationError as exc:
                if not request_id or exc.constraint_name != "append_requests_pkey":
                    raise
                return await conn.fetchrow(sql, *args)  # the twin committed: a replay now

        if self._pool is None:
            raise Unavailable("PostgreSQL store is not open")
        with pg_errors("append_messages"):
            if event is not None and self._append_group.max_size > 1:
                row = await self._append_lanes.run(work, self._append_group, args)
            else:
                row = await self._append_lanes.run(work)
        if row is None or not caller.may_read(row["user_id"]):
            raise session_not_found(session_id)
        if row["profile_changed"]:
            raise SessionProfileChanged(session_id)
        prior = row["prior_numbers"]
        if prior is not None:
            stored = row["prior_fingerprint"] or ""
            if stored and request_fingerprint and stored != request_fingerprint:
                raise RequestIdReused(request_id)
            return AppendResult(
                list(prior), self._info(row), replayed=True, first_context_tokens=row["prior_context_tokens"]
            )
        last = row["last_sequence"]
        event_id = row["event_id"] or 0
        if event_id:
            self._events_committed(event_id)
        return AppendResult(list(range(last - len(messages) + 1, last + 1)), self._info(row), event_id=event_id)

    async def _append_many(self, conn: Any, items: list[tuple[Any, ...]]) -> list[Any]:
        """Appends publishing their events (``_APPEND_PUBLISH_SQL`` arguments), in one transaction
        and one round trip (``_APPEND_GROUP_SQL``): one commit, one WAL flush for all of them.

        The first statement only locks every session row of the batch, in session id order; the
        appends then never wait for a row while one of them holds the bus's publish lock (each
        takes it after its row, as a lone append does, and keeps it to the commit). So batches
        and lone appends cannot deadlock: row locks are taken in one order, and whoever holds
        the publish lock waits for nothing but PostgreSQL. Event ids are drawn under that lock
        and committed together, so readers still see a gap-free prefix."""
        lock_rows: tuple[Any, ...] = (
            "",
            "",
            0,
            0,
            0,
            0,
            None,
            items[0][7],
            "",
            False,
            None,
            [],
            [],
            [],
            [],
            [],
            [],
            [],
            [],
            None,
        )
        first: tuple[Any, ...] = (
            *lock_rows,
            PUBLISH_LOCK,
            "",
            {},
            self._pg.event_channel,
            sorted({i[0] for i in items}),
        )
        rows = await conn.fetchmany(_APPEND_GROUP_SQL, [first, *((*i, _NO_ROWS) for i in items)])
        # One row per statement (``_APPEND_GROUP_SQL`` pads an empty result with NULLs).
        return [None if r["session_id"] is None else r for r in rows[1:]]

    async def list_messages(
        self,
        session_id: str,
        *,
        caller: Principal,
        buffer: BufferKind,
        before_sequence: int = 0,
        before_position: tuple[int, int] | None = None,
        limit: int = 50,
    ) -> list[Message]:
        if before_sequence < 0:
            raise InvalidArgument.field("before_sequence", "must not be negative")
        if limit < 0:
            raise InvalidArgument.field("limit", "must not be negative")
        if BufferKind(buffer) is BufferKind.CONTEXT:
            # Context order is (context_key, seq): the partial index messages_context serves it.
            bound = context_bound(before_sequence, before_position) or (_NO_BOUND, _NO_BOUND)
            sql = """SELECT * FROM all_messages
                      WHERE session_id = $1 AND is_context AND (context_key, seq) < ($2, $3)
                      ORDER BY context_key DESC, seq DESC LIMIT $4"""
            args: tuple[Any, ...] = (session_id, bound[0], bound[1], limit)
        else:
            sql = """SELECT * FROM all_messages
                      WHERE session_id = $1 AND is_display AND seq < $2
                      ORDER BY seq DESC LIMIT $3"""
            args = (session_id, before_sequence or _NO_BOUND, limit)

        async def work(conn: Any) -> list[Message]:
            await self._owned(conn, session_id, caller)
            rows = await conn.fetch(sql, *args)
            return [message_from_row(r) for r in reversed(rows)]

        return await self._read("list_messages", work)

    async def load_context(self, session_id: str, *, caller: Principal) -> list[Message]:
        return (await self.context_and_session(session_id, caller=caller))[1]

    async def context_and_session(self, session_id: str, *, caller: Principal) -> tuple[SessionInfo, list[Message]]:
        """One statement (``_CONTEXTS_SQL``, one snapshot): the session's row and its context rows
        numbered after those this replica holds for it (``context_cache.py``), or all of them; a
        second one, for all of them, only when the session changed otherwise since (a compaction,
        a flag change, deleted and created again). Builds of other sessions that wait for a
        statement lane meanwhile are read in the same statement (``_read_contexts``)."""
        if not isinstance(session_id, str):
            raise session_not_found(session_id)
        cached = self._contexts.get(session_id)

        async def read(after: int) -> tuple[Any, list[KeyedRow]]:
            item = (session_id, after)
            rows = await self._statement(
                "load_context",
                functools.partial(self._read_context, item),
                read=True,
                group=self._read_group if self._read_group.max_size > 1 else None,
                item=item,
            )
            if not rows or not caller.may_read(rows[0]["user_id"]):
                raise session_not_found(session_id)
            keyed = [((r["context_key"], r["seq"]), message_from_row(r)) for r in rows if r["seq"] is not None]
            return rows[0], keyed

        def version(head: Any) -> ContextVersion:
            return ContextVersion(head["create_time"], head["context_epoch"], head["last_sequence"])

        if cached is not None:
            head, added = await read(cached.version.last_sequence)
            entry = extended(cached, version(head), added, head["context_count"])
            if entry is not None:
                self._contexts.put(session_id, entry)
                return self._info(head), list(entry.rows)
        head, keyed = await read(0)
        entry = whole(version(head), keyed, head["context_count"])
        if entry is None:
            self._contexts.forget(session_id)
            return self._info(head), [m for _, m in keyed]
        self._contexts.put(session_id, entry)
        return self._info(head), list(entry.rows)

    async def _read_context(self, item: tuple[str, int], conn: Any) -> list[Any]:
        """``_read_contexts`` of one session (most reads of a served turn loop run alone): its
        rows (none when it does not exist), by the simpler statement of the two."""
        return list(await conn.fetch(_CONTEXT_SQL, *item))

    async def _read_contexts(self, conn: Any, items: list[tuple[str, int]]) -> list[list[Any]]:
        """The rows of ``_CONTEXTS_SQL`` for each ``(session id, after)`` of ``items``, in their
        order: one statement and one round trip for all (a turn's only read; ~one round trip a
        turn before, the rest of its statements being grouped already)."""
        rows = await conn.fetch(_CONTEXTS_SQL, [i[0] for i in items], [i[1] for i in items])
        out: list[list[Any]] = [[] for _ in items]
        for r in rows:
            out[r["item"] - 1].append(r)
        return out

    async def get_messages(self, session_id: str, *, caller: Principal, first: int, last: int) -> list[Message]:
        async def work(conn: Any) -> list[Message]:
            await self._owned(conn, session_id, caller)
            rows = await conn.fetch(
                "SELECT * FROM all_messages WHERE session_id = $1 AND seq BETWEEN $2 AND $3 ORDER BY seq",
                session_id,
                first,
                last,
            )
            return [message_from_row(r) for r in rows]

        return await self._read("get_messages", work)

    async def set_context_flags(
        self, session_id: str, sequence_numbers: Sequence[int], *, caller: Principal, is_context: bool
    ) -> None:
        wanted = sorted(set(sequence_numbers))

        async def work(conn: Any) -> None:
            row = await self._owned(conn, session_id, caller, lock=True)
            _check_known(row, wanted)
            changed = await _set_context(conn, session_id, wanted, is_context)
            await conn.execute(
                "UPDATE sessions SET context_count = context_count + $2, update_time = $3 WHERE session_id = $1",
                session_id,
                changed if is_context else -changed,
                self._now(),
            )

        await self._write("set_context_flags", work)

    async def update_state(
        self,
        session_id: str,
        *,
        caller: Principal,
        context_tokens: int | None = None,
        context_truncated: bool | None = None,
        state: Mapping[str, Any] | None = None,
        durable: bool = True,
        context_tokens_as_of: int | None = None,
    ) -> SessionInfo:
        del durable  # one statement either way: its commit is the write
        if context_tokens is None and context_truncated is None and state is None:
            return await self.get_session(session_id, caller=caller)

        if not isinstance(session_id, str):
            raise session_not_found(session_id)

        async def work(conn: Any) -> SessionInfo:
            # One statement, the owner checked in it: the UPDATE takes the row lock itself, so a
            # transaction around a locking read would only add three round trips (every baseline).
            row = await conn.fetchrow(
                # $8: the context tokens the caller read; what appends added since is kept.
                """UPDATE sessions
                      SET context_tokens = COALESCE($2 + context_tokens - $8, $2, context_tokens),
                          context_truncated = COALESCE($3, context_truncated),
                          state = COALESCE($4::jsonb, state), update_time = $5
                    WHERE session_id = $1 AND (user_id = $6 OR $7)
                RETURNING *""",
                session_id,
                context_tokens,
                context_truncated,
                dict(state) if state is not None else None,
                self._now(),
                caller.user_id,
                caller.is_admin,
                context_tokens_as_of,
            )
            if row is None or not caller.may_read(row["user_id"]):  # may_read: an admin's read is audited
                raise session_not_found(session_id)
            return self._info(row)

        return await self._write("update_state", work, transaction=False)

    async def update_state_if_unchanged(
        self,
        session_id: str,
        *,
        caller: Principal,
        read: SessionInfo,
        context_tokens: int,
        state: Mapping[str, Any],
    ) -> SessionInfo | None:
        if not isinstance(session_id, str):
            return None

        async def work(conn: Any) -> SessionInfo | None:
            row = await conn.fetchrow(
                _ANCHOR_UPDATE, *self._anchor_args(session_id, caller, read, context_tokens, state)
            )
            if row is None or not caller.may_read(row["user_id"]):  # may_read: an admin's write is audited
                return None
            return self._anchored(row)

        return await self._write("update_state_if_unchanged", work, transaction=False)

    def _anchored(self, row: Any) -> SessionInfo:
        """The session a baseline's anchor wrote (``row``), vouched for with this replica's cached
        context of the same version (``context_as_read``)."""
        session = self._info(row)
        version = ContextVersion(row["create_time"], row["context_epoch"], row["last_sequence"])
        self._contexts.vouch(session, version, row["context_count"])
        return session

    def context_as_read(self, session: SessionInfo) -> list[Message] | None:
        """The context of the version a baseline's anchor wrote ``session`` at, when this replica
        holds it (the build that made the view read it): the post-turn check that follows reads
        nothing (one statement a turn)."""
        rows = self._contexts.as_read(session)
        return list(rows) if rows is not None else None

    def _anchor_args(
        self, session_id: str, caller: Principal, read: SessionInfo, context_tokens: int, state: Mapping[str, Any]
    ) -> tuple[Any, ...]:
        """``_ANCHOR_UPDATE``'s arguments $1-$11."""
        first, second = compaction_lock_keys(session_id)
        return (
            session_id,
            context_tokens,
            dict(state),
            self._now(),
            caller.user_id,
            caller.is_admin,
            read.create_time,
            read.last_sequence,
            dict(read.state),
            first,
            second,
        )

    async def anchor_baseline(
        self,
        session_id: str,
        *,
        caller: Principal,
        read: SessionInfo,
        context_tokens: int,
        state: Mapping[str, Any],
        write: BaselineWrite,
    ) -> SessionInfo | None:
        """``update_state_if_unchanged``, the observation and the event in one statement
        (``_ANCHOR_BASELINE_SQL``), committed asynchronously as the anchor alone is: a crash of the
        database may lose the three together, never one without the others.

        The observation's trim to ``calibration_keep`` is left out of the statement (two of them
        trimming the same rows would wait on each other while one holds the bus's publish lock):
        this replica trims once it wrote ``calibration_trim_every`` such observations of a model,
        so a model holds at most that many more per replica for a while. The fit reads only the
        newest few, so they change no estimate."""
        if not isinstance(session_id, str):
            return None
        args = (*self._anchor_args(session_id, caller, read, context_tokens, state), *self._write_args(write))

        async def work(conn: Any) -> Any:
            return await conn.fetchrow(_ANCHOR_BASELINE_SQL, *args)

        group = self._anchor_group if self._anchor_group.max_size > 1 else None
        row = await self._statement("anchor_baseline", work, group=group, item=args)
        if row is None or not caller.may_read(row["user_id"]):  # may_read: an admin's write is audited
            return None
        session = self._anchored(row)
        self._events_committed(row["event_id"])
        await self._observed(write.model)
        return session

    async def observe_baseline(
        self, session_id: str, *, caller: Principal, write: BaselineWrite, created: datetime | None = None
    ) -> bool:
        """The observation and the event of ``write`` in one statement (``_OBSERVE_PUBLISH_SQL``),
        committed together, when the session is the caller's (and was created at ``created``):
        a baseline whose anchor goes its own way (it waits for a compaction of the session, or
        the session changed since the build) writes both without a round trip of its own for
        each. False, nothing written, for an unknown or foreign session. Trimmed as
        ``anchor_baseline``'s observations are."""
        if not isinstance(session_id, str):
            return False
        args = (session_id, caller.user_id, caller.is_admin, created, self._now(), *self._write_args(write))

        async def work(conn: Any) -> Any:
            return await conn.fetchrow(_OBSERVE_PUBLISH_SQL, *args)

        row = await self._statement("observe_baseline", work)
        if row is None or not caller.may_read(row["user_id"]):  # may_read: an admin's write is audited
            return False
        self._events_committed(row["event_id"])
        await self._observed(write.model)
        return True

    def _write_args(self, write: BaselineWrite) -> tuple[Any, ...]:
        """A baseline's observation and event as its statements take them, in this order: model,
        chars, tokens, had_images, features, residual, the bus's lock, kind, payload, channel."""
        observation = write.observation
        return (
            write.model,
            observation.chars,
            observation.tokens,
            observation.had_images,
            list(observation.features),
            observation.residual,
            PUBLISH_LOCK,
            write.event_kind,
            dict(write.event_payload),
            self._pg.event_channel,
        )

    async def _observed(self, model: str) -> None:
        """Count an observation of ``model`` written without its trim; trim once there were
        ``calibration_trim_every`` of them."""
        untrimmed = self._untrimmed.get(model, 0) + 1
        if untrimmed < self._pg.calibration_trim_every:
            self._untrimmed[model] = untrimmed
            return
        self._untrimmed[model] = 0
        try:
            await self._statement("trim_calibration_observations", functools.partial(self._trim, model))
        except ContextError as exc:  # housekeeping: the baseline is recorded; trimmed next time
            self._untrimmed[model] = untrimmed
            log.warning("calibration observations not trimmed", extra={"model": model}, exc_info=exc)

    async def _anchor_many(self, conn: Any, items: list[tuple[Any, ...]]) -> list[Any]:
        """Baselines anchored together (``_ANCHOR_BASELINE_SQL`` arguments), in one transaction
        and one round trip (``_ANCHOR_GROUP_SQL``), as ``_append_many`` runs appends: a first
        statement locks every session row of the batch in session id order, so no anchor waits
        for a row while the batch holds the bus's publish lock (taken by its first event)."""
        first = (*_NO_ANCHOR, sorted({i[0] for i in items}))
        rows = await conn.fetchmany(_ANCHOR_GROUP_SQL, [first, *((*i, _NO_ROWS) for i in items)])
        # One row per statement (``_ANCHOR_GROUP_SQL`` pads an empty result with NULLs).
        return [None if r["session_id"] is None else r for r in rows[1:]]

    async def _trim(self, model: str, conn: Any) -> None:
        """Keep the newest ``calibration_keep`` observations of ``model``."""
        await conn.execute(_TRIM_OBSERVATIONS_SQL, model, self._pg.calibration_keep)

    async def commit_compaction(
        self,
        session_id: str,
        *,
        caller: Principal,
        demote: Sequence[int],
        append: Sequence[Message],
        context_tokens: int,
        state: Mapping[str, Any] | None = None,
        context_tokens_as_of: int | None = None,
        history: Sequence[HistoryChunk] = (),
    ) -> list[int]:
        demoted = sorted(set(demote))
        columns = chunk_columns(history) if history else None

        async def work(conn: Any) -> list[int]:
            row = await self._owned(conn, session_id, caller, lock=True)
            _check_known(row, demoted)
            await _check_in_context(conn, session_id, demoted)
            if columns is not None:
                # In the compaction's transaction: the chunks commit with it or not at all. A
                # statement that fails only rolls back to its savepoint (DESIGN §5.6: an index
                # failure never fails a compaction; the rows are safe in the display history).
                try:
                    async with conn.transaction():
                        await self._insert_chunks(conn, session_id, columns)
                except asyncpg.PostgresError:
                    log.warning("history index write failed", extra={"session_id": session_id}, exc_info=True)
            now = self._now()
            removed = await _set_context(conn, session_id, demoted, False)
            rows = stamped(append, row["last_sequence"] + 1, now)
            await _insert_rows(conn, session_id, rows)
            # $9: the context tokens when the compacted context was read; appends since are kept.
            await conn.execute(
                """UPDATE sessions
                      SET last_sequence = last_sequence + $2, display_count = display_count + $3,
                          context_count = context_count + $4,
                          context_tokens = COALESCE($5 + context_tokens - $9, $5),
                          state = COALESCE($6::jsonb, state), preview = COALESCE($7, preview), update_time = $8
                    WHERE session_id = $1""",
                session_id,
                len(rows),
                sum(m.flags.is_display for m in rows),
                sum(m.flags.is_context for m in rows) - removed,
                context_tokens,
                dict(state) if state is not None else None,
                newest_preview(rows),
                now,
                context_tokens_as_of,
            )
            return [m.sequence_number for m in rows]

        return await self._write("commit_compaction", work)

    # -- archive -----------------------------------------------------------------------------

    async def archive_old_messages(self, session_id: str, before_sequence: int, *, caller: Principal) -> int:
        """Move rows with sequence < ``before_sequence`` out of the hot table; returns how many.

        Archived rows stay readable through every read method (``list_messages``,
        ``get_messages``, ``load_context``, listings and search); only the hot table, and so
        its indexes, shrink. Not a change of the session (``update_time`` stays)."""

        async def work(conn: Any) -> int:
            await self._owned(conn, session_id, caller, lock=True)
            moved = await conn.fetchval(
                """WITH moved AS (
                       DELETE FROM messages WHERE session_id = $1 AND seq < $2 RETURNING *)
                   , kept AS (
                       INSERT INTO messages_archive
                       SELECT session_id, seq, role, is_context, is_display, context_key, content,
                              create_time, body
                         FROM moved
                       RETURNING 1)
                   SELECT count(*) FROM kept""",
                session_id,
                before_sequence,
            )
            return int(moved)

        return await self._write("archive_old_messages", work)

    async def archive_by_rule(self, keep_messages: int, *, caller: Principal) -> dict[str, int]:
        """The archive rule of store maintenance: every session keeps its newest
        ``keep_messages`` rows in the hot table; older ones move to the archive (still read by
        ``ListMessages``, ``ExpandSummary`` and ``SearchHistory`` through ``all_messages``).
        Returns session id -> rows moved."""

        async def due(conn: Any) -> list[Any]:
            return list(
                await conn.fetch(
                    "SELECT s.session_id, s.last_sequence FROM sessions s"
                    " WHERE s.last_sequence > $1 AND EXISTS (SELECT 1 FROM messages m"
                    "   WHERE m.session_id = s.session_id AND m.seq <= s.last_sequence - $1)",
                    keep_messages,
                )
            )

        moved: dict[str, int] = {}
        if keep_messages <= 0:
            return moved
        for row in await self._read("archive_by_rule", due):
            try:
                n = await self.archive_old_messages(
                    row["session_id"], int(row["last_sequence"]) - keep_messages + 1, caller=caller
                )
            except NotFound:  # deleted meanwhile
                continue
            if n:
                moved[row["session_id"]] = n
        return moved

    async def list_archived_messages(
        self, session_id: str, *, caller: Principal, before_sequence: int = 0, limit: int = 50
    ) -> list[Message]:
        """Up to ``limit`` newest archived rows (both buffers) with sequence < ``before_sequence``
        (0 = no bound), oldest first."""

        async def work(conn: Any) -> list[Message]:
            await self._owned(conn, session_id, caller)
            rows = await conn.fetch(
                "SELECT * FROM messages_archive WHERE session_id = $1 AND seq < $2 ORDER BY seq DESC LIMIT $3",
                session_id,
                before_sequence or _NO_BOUND,
                max(limit, 0),
            )
            return [message_from_row(r) for r in reversed(rows)]

        return await self._read("list_archived_messages", work)

    # -- blobs -------------------------------------------------------------------------------

    async def put_blob(self, data: bytes, *, blob_id: str) -> None:
        check_blob(data, blob_id)

        async def work(conn: Any) -> None:
            await conn.execute(
                "INSERT INTO blobs (blob_id, data, size_bytes, create_time) VALUES ($1, $2, $3, $4)"
                " ON CONFLICT (blob_id) DO NOTHING",
                blob_id,
                bytes(data),
                len(data),
                self._now(),
            )

        await self._write("put_blob", work)

    async def get_blob(self, blob_id: str) -> bytes | None:
        if not is_blob_id(blob_id):
            return None

        async def work(conn: Any) -> bytes | None:
            data = await conn.fetchval("SELECT data FROM blobs WHERE blob_id = $1", blob_id)
            return bytes(data) if data is not None else None

        return await self._read("get_blob", work)

    async def prune_unreferenced_blobs(self, *, older_than: timedelta = timedelta(hours=1)) -> int:
        """Delete blobs no session refers to, stored more than ``older_than`` ago (younger ones
        may belong to an append still on its way). Returns how many were deleted."""
        cutoff = self._now() - older_than

        async def work(conn: Any) -> int:
            deleted = await conn.fetchval(
                """WITH gone AS (
                       DELETE FROM blobs b WHERE b.create_time < $1
                          AND NOT EXISTS (SELECT 1 FROM session_blobs r WHERE r.blob_id = b.blob_id)
                       RETURNING 1)
                   SELECT count(*) FROM gone""",
                cutoff,
            )
            return int(deleted)

        return await self._write("prune_unreferenced_blobs", work)

    # -- calibration and views (TokenStore) --------------------------------------------------

    async def add_calibration_observation(self, model: str, observation: Observation) -> None:
        """Shared by every replica; the newest ``postgres.calibration_keep`` per model are kept."""

        async def work(conn: Any) -> None:
            # One statement (one round trip, no BEGIN/COMMIT).
            await conn.execute(
                _ADD_OBSERVATION_SQL,
                model,
                observation.chars,
                observation.tokens,
                observation.had_images,
                self._now(),
                list(observation.features),
                observation.residual,
                self._pg.calibration_keep - 1,
            )

        await self._write("add_calibration_observation", work, transaction=False)

    async def list_calibration_observations(self, model: str, *, limit: int) -> list[Observation]:
        if limit <= 0:
            return []

        async def work(conn: Any) -> list[Observation]:
            rows = await conn.fetch(
                """SELECT chars, tokens, had_images, features, residual FROM calibration_observations
                    WHERE model = $1 ORDER BY observation_id DESC LIMIT $2""",
                model,
                limit,
            )
            return [
                Observation(
                    r["chars"], r["tokens"], r["had_images"], current_features(r["features"] or ()), r["residual"]
                )
                for r in reversed(rows)
            ]

        return await self._statement("list_calibration_observations", work, read=True)

    async def save_view(self, session_id: str, view: ViewRecord, *, keep: int) -> None:
        """Soft state: no session lock and no ``update_time`` change; the newest ``keep`` stay.

        Committed without waiting for the WAL flush (``synchronous_commit = off``): the row is
        visible to every replica at once, only its durability waits (~0.6 s at most), as the files
        store never fsyncs a view on its own. A crash loses at most a view just built, which
        RecordBaseline then reports as unknown; no acknowledged message depends on it."""

        if not isinstance(session_id, str):
            raise session_not_found(session_id)
        args = (
            session_id,
            view.view_id,
            view.model,
            view.chars,
            view.estimated_tokens,
            view.had_images,
            view.last_sequence,
            view.create_time,
            view.epoch,
            list(view.features),
            view.incoming_tokens,
            view.priced_tokens,
            view.image_tokens,
            view.shape,
            max(keep, 1) - 1,
            None if view.cuts is None else [[seq, list(features)] for seq, features in view.cuts],
        )

        async def work(conn: Any) -> Any:
            return await conn.fetchval(_SAVE_VIEW_SQL, *args)

        group = self._view_group if self._view_group.max_size > 1 else None
        if await self._statement("save_view", work, group=group, item=args) is None:
            raise session_not_found(session_id)

    async def _save_views(self, conn: Any, items: list[tuple[Any, ...]]) -> list[Any]:
        """Views saved together (``_SAVE_VIEW_SQL`` arguments), in one transaction and one round
        trip: what each statement returned, in ``items``' order. They run in session id order, so
        two batches saving views of the same sessions take those rows' locks in one order."""
        order = sorted(range(len(items)), key=lambda i: items[i][0])
        rows = await conn.fetchmany(_SAVE_VIEW_SQL, [items[i] for i in order])
        saved: list[Any] = [None] * len(items)
        for i, row in zip(order, rows, strict=True):
            saved[i] = row["saved"]
        return saved

    async def get_view(self, session_id: str, view_id: str) -> ViewRecord | None:
        if not isinstance(session_id, str) or not isinstance(view_id, str):
            return None

        async def work(conn: Any) -> ViewRecord | None:
            row = await conn.fetchrow("SELECT * FROM views WHERE session_id = $1 AND view_id = $2", session_id, view_id)
            return view_from_row(row) if row is not None else None

        return await self._statement("get_view", work, read=True)

    # -- raw history index (HistoryStore) ----------------------------------------------------

    async def add_history_chunks(self, session_id: str, chunks: Sequence[HistoryChunk]) -> int:
        """Idempotent by (session, content hash), also within one call; returns how many were new."""
        if not isinstance(session_id, str):
            raise session_not_found(session_id)
        columns = chunk_columns(chunks)

        async def work(conn: Any) -> int:
            # KEY SHARE: a concurrent delete of the session waits for these inserts.
            exists = await conn.fetchval("SELECT 1 FROM sessions WHERE session_id = $1 FOR KEY SHARE", session_id)
            if exists is None:
                raise session_not_found(session_id)
            if not chunks:
                return 0
            return await self._insert_chunks(conn, session_id, columns)

        return await self._write("add_history_chunks", work)

    async def _insert_chunks(self, conn: Any, session_id: str, columns: list[list[Any]]) -> int:
        """Insert ``chunk_columns`` of chunks the session does not have yet; how many were new."""
        added = await conn.fetchval(
            """WITH added AS (
                   INSERT INTO history_chunks (session_id, content_hash, text, first_sequence, last_sequence,
                                               start_time, end_time, breadcrumbs, terms, term_count, create_time,
                                               terms_version)
                   SELECT $1, u.h, u.t, u.f, u.l, u.s, u.e, u.b::jsonb,
                          ARRAY(SELECT jsonb_array_elements_text(u.w::jsonb)), u.n, $11, $12
                     FROM unnest($2::text[], $3::text[], $4::bigint[], $5::bigint[], $6::timestamptz[],
                                 $7::timestamptz[], $8::text[], $9::text[], $10::integer[])
                          WITH ORDINALITY AS u(h, t, f, l, s, e, b, w, n, i)
                    ORDER BY u.i
                   ON CONFLICT (session_id, content_hash) DO NOTHING
                   RETURNING 1)
               SELECT count(*) FROM added""",
            session_id,
            *columns,
            self._now(),
            TERMS_VERSION,
        )
        return int(added)

    async def search_history(self, session_id: str, query: str, *, limit: int) -> list[ScoredChunk]:
        """BM25 over the core's search terms, computed in the database: the GIN index on
        ``terms`` finds the candidate chunks, and the per-session statistics (chunk count,
        average length, document frequencies) make scores and order those of the in-process
        stores (``contextsvc.core.recall``), identifier terms weighted the same way (a repeated
        query term is summed once per repetition). Ties go to the newest chunk.

        Each candidate's terms are read once and counted per query term; document frequencies
        come from those counts. (Reading a chunk's terms once per query term, and counting each
        term's chunks apart, cost the database ~O(chunks x query terms x chunk terms) a search:
        the busiest statement of a fleet whose builds recall.)"""
        wanted = weighted_query_terms(query) if isinstance(query, str) else []
        if not wanted or limit <= 0 or not isinstance(session_id, str):
            return []

        async def work(conn: Any) -> list[ScoredChunk]:
            rows = await conn.fetch(
                """WITH stats AS (
                       SELECT count(*)::float8 AS n, avg(term_count)::float8 AS avgdl
                         FROM history_chunks WHERE session_id = $1),
                   wanted AS (SELECT DISTINCT term FROM unnest($2::text[]) AS w(term)),
                   tf AS (
                       -- each chunk holding a query term (the GIN index), its terms read once,
                       -- counted per query term
                       SELECT c.chunk_id, c.term_count, t.term, count(*)::float8 AS tf
                         FROM history_chunks c
                        CROSS JOIN LATERAL unnest(c.terms) AS t(term)
                         JOIN wanted ON wanted.term = t.term
                        WHERE c.session_id = $1 AND c.terms && $2::text[]
                        GROUP BY c.chunk_id, c.term_count, t.term),
                   df AS (
                       -- every chunk holding a term is among those: its document frequency
                       SELECT term, count(*)::float8 AS df FROM tf GROUP BY term),
                   params AS (
                       -- typed: left to inference, ``$3 + 1`` made k1 an integer (1.5 sent as 1,
                       -- b 0.75 as 0), and the database ranked unlike the in-process stores
                       SELECT $3::float8 AS k1, $4::float8 AS b),
                   scored AS (
                       -- joined with the query as written, so a repeated term adds once per repetition
                       SELECT tf.chunk_id,
                              sum(ln(1 + (stats.n - df.df + 0.5) / (df.df + 0.5)) * tf.tf * (params.k1 + 1)
                                  / (tf.tf + params.k1 * (1 - params.b + params.b * tf.term_count / stats.avgdl)))
                                  AS score,
                              min(df.df) AS rarest_df,
                              min(stats.n) AS chunk_count
                         FROM tf
                         JOIN df ON df.term = tf.term
                         JOIN unnest($2::text[]) AS q(term) ON q.term = tf.term
                        CROSS JOIN stats
                        CROSS JOIN params
                        GROUP BY tf.chunk_id)
                   SELECT c.*, s.score, s.rarest_df, s.chunk_count
                     FROM scored s JOIN history_chunks c ON c.session_id = $1 AND c.chunk_id = s.chunk_id
                    WHERE s.score > 0
                    ORDER BY s.score DESC, c.last_sequence DESC, c.chunk_id DESC
                    LIMIT $5""",
                session_id,
                wanted,
                BM25_K1,
                BM25_B,
                limit,
            )
            return [
                ScoredChunk(
                    chunk_from_row(r),
                    float(r["score"]),
                    rarest_df=int(r["rarest_df"] or 0),
                    chunk_count=int(r["chunk_count"] or 0),
                    # Terms of an older version are found again by the engine (reindex.py).
                    terms=frozenset(r["terms"]) if r["terms_version"] == TERMS_VERSION else None,
                )
                for r in rows
            ]

        return await self._read("search_history", work)


# -- helpers -----------------------------------------------------------------------------------


def _listing_filter(caller: Principal, profile_id: str, query: str, args: list[Any]) -> str:
    """WHERE clause over ``sessions s`` for listings; appends its parameters to ``args``."""

    def arg(value: Any) -> str:
        args.append(value)
        return f"${len(args)}"

    conditions = []
    if not caller.is_admin:
        conditions.append(f"s.user_id = {arg(caller.user_id)}")
    if profile_id:
        conditions.append(f"s.profile_id = {arg(profile_id)}")
    if query:
        p = arg(like_pattern(query))
        conditions.append(
            f"""(s.name ILIKE {p}
                 OR EXISTS (SELECT 1 FROM messages m
                             WHERE m.session_id = s.session_id AND m.is_display AND m.content ILIKE {p})
                 OR EXISTS (SELECT 1 FROM messages_archive a
                             WHERE a.session_id = s.session_id AND a.is_display AND a.content ILIKE {p}))"""
        )
    return " AND ".join(conditions) or "true"


#: ``save_view`` in one statement (one round trip: no BEGIN, SET LOCAL, DELETE and COMMIT of their
#: own). ``set_config(..., true)`` holds for the statement's own transaction, its commit included:
#: it does not wait for the WAL flush. The view is inserted (or, saved again, made the newest); the
#: other views of the session past the newest ``keep - 1`` ($15) go: the DELETE never touches the
#: row the INSERT writes (another view id), so the two never modify one row in one statement.
#: NULL when the session does not exist (nothing is written).
_SAVE_VIEW_SQL = """
WITH async_commit AS (SELECT set_config('synchronous_commit', 'off', true)),
saved AS (
    INSERT INTO views (session_id, view_id, model, chars, estimated_tokens, had_images, last_sequence,
                       create_time, epoch, features, incoming_tokens, priced_tokens, image_tokens, shape, cuts)
    SELECT session_id, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $16 FROM sessions, async_commit
     WHERE session_id = $1
    ON CONFLICT (session_id, view_id) DO UPDATE
       SET saved = nextval('views_saved'), model = EXCLUDED.model, chars = EXCLUDED.chars,
           estimated_tokens = EXCLUDED.estimated_tokens, had_images = EXCLUDED.had_images,
           last_sequence = EXCLUDED.last_sequence, create_time = EXCLUDED.create_time,
           epoch = EXCLUDED.epoch, features = EXCLUDED.features,
           incoming_tokens = EXCLUDED.incoming_tokens, priced_tokens = EXCLUDED.priced_tokens,
           image_tokens = EXCLUDED.image_tokens, shape = EXCLUDED.shape, cuts = EXCLUDED.cuts
    RETURNING saved
),
pruned AS (
    DELETE FROM views
     WHERE session_id = $1 AND view_id <> $2 AND EXISTS (SELECT 1 FROM saved) AND saved <= (
           SELECT saved FROM views WHERE session_id = $1 AND view_id <> $2
            ORDER BY saved DESC OFFSET $15 LIMIT 1)
)
SELECT (SELECT saved FROM saved) AS saved
"""

#: ``_read_context``: ``_CONTEXTS_SQL`` of the one session $1 after $2, without ``item``, and
#: with $2 read through a subquery (``(SELECT $2::bigint)``), which the planner does not look
#: into: it then prices a plan made with the value as one made without it, and a connection
#: keeps the latter after its first runs. Given the value, it priced a cached session's read (a
#: few rows past the last one held) far below the plan for any value (a third of the session's
#: rows) and planned again at every run: ~0.4 ms of the database's CPU for a read that runs in
#: ~0.1 (bench/RESULTS.md, round 38). ``_CONTEXTS_SQL`` is still planned at every run: its plan
#: for any arrays ran ~1.1-1.4 ms for two or three sessions, against ~0.5 ms planned each time.
_CONTEXT_SQL = """
SELECT s.*, m.seq, m.is_context, m.context_key, m.content, m.body
  FROM sessions s
  LEFT JOIN LATERAL (
       SELECT seq, is_context, context_key, content, body FROM all_messages
        WHERE session_id = s.session_id AND is_context AND seq > (SELECT $2::bigint)) m ON true
 WHERE s.session_id = $1
 ORDER BY m.context_key, m.seq
"""

#: ``_read_contexts``: for each session id of $1 (``item``: its place, from 1) the session's row
#: (its owner and version with it) and its context rows numbered after the same place of $2, in
#: context order (one row with NULL row columns when there is none; no row for an unknown
#: session). One statement: one snapshot. No column of ``sessions`` is named like one of the row's.
_CONTEXTS_SQL = """
SELECT q.n AS item, s.*, m.seq, m.is_context, m.context_key, m.content, m.body
  FROM unnest($1::text[], $2::bigint[]) WITH ORDINALITY AS q(session_id, after_seq, n)
  JOIN sessions s ON s.session_id = q.session_id
  LEFT JOIN LATERAL (
       SELECT seq, is_context, context_key, content, body FROM all_messages
        WHERE session_id = q.session_id AND is_context AND seq > q.after_seq) m ON true
 ORDER BY q.n, m.context_key, m.seq
"""

#: AppendMessages in one statement (``append_messages``). $1 session, $2 request id ('' for none),
#: $3 rows, $4 display rows, $5 context rows, $6 context tokens, $7 preview (NULL: unchanged),
#: $8 now, $9/$10 the caller (user, admin), $11 fingerprint, $12 blob ids, $13-$19 the rows'
#: columns (``append_columns``), $20 the profile the caller priced for (NULL: any). Sequence
#: numbers follow the locked row's ``last_sequence``; a row's context key is its anchor, or its own
#: number. The result: the session row after the append with NULL ``prior_numbers``, or (a replay)
#: the session row with the first call's numbers and fingerprint, or the session row with
#: ``profile_changed`` (another profile than $20: nothing was written), or no row (no such
#: session, or not the caller's: nothing was written).
_APPEND_CTES = """
WITH prior AS (
    SELECT sequence_numbers, fingerprint, context_tokens FROM append_requests
     WHERE $2 <> '' AND session_id = $1 AND request_id = $2
),
upd AS (
    UPDATE sessions
       SET last_sequence = last_sequence + $3, display_count = display_count + $4,
           context_count = context_count + $5, context_tokens = context_tokens + $6,
           preview = COALESCE($7, preview), update_time = $8
     WHERE session_id = $1 AND (user_id = $9 OR $10) AND NOT EXISTS (SELECT 1 FROM prior)
       AND ($20::text IS NULL OR profile_id = $20)
    RETURNING *
),
added AS (
    INSERT INTO messages (session_id, seq, role, is_context, is_display, context_key, content, create_time, body)
    SELECT $1, upd.last_sequence - $3 + u.n, u.role, u.is_context, u.is_display,
           CASE WHEN u.anchor > 0 THEN u.anchor ELSE upd.last_sequence - $3 + u.n END,
           u.content, u.create_time, u.body::jsonb
      FROM upd, unnest($13::text[], $14::boolean[], $15::boolean[], $16::bigint[], $17::text[],
                       $18::timestamptz[], $19::text[])
                WITH ORDINALITY AS u(role, is_context, is_display, anchor, content, create_time, body, n)
),
request AS (
    INSERT INTO append_requests (session_id, request_id, sequence_numbers, create_time, fingerprint, context_tokens)
    SELECT $1, $2, ARRAY(SELECT generate_series(upd.last_sequence - $3 + 1, upd.last_sequence)), $8, $11,
           upd.context_tokens
      FROM upd WHERE $2 <> ''
),
linked AS (
    INSERT INTO session_blobs (session_id, blob_id)
    SELECT $1, b FROM upd, unnest($12::text[]) AS b ON CONFLICT DO NOTHING
)
"""
_APPEND_RESULT = """
SELECT upd.*, NULL::bigint[] AS prior_numbers, NULL::text AS prior_fingerprint, false AS profile_changed,
       {event} AS event_id, NULL::bigint AS prior_context_tokens FROM upd
UNION ALL
SELECT s.*, p.sequence_numbers, p.fingerprint, false, NULL, p.context_tokens FROM sessions s, prior p
 WHERE s.session_id = $1 AND ($20::text IS NULL OR s.profile_id = $20)
UNION ALL
SELECT s.*, NULL, NULL, true, NULL, NULL FROM sessions s
 WHERE $20::text IS NOT NULL AND s.session_id = $1 AND (s.user_id = $9 OR $10) AND s.profile_id <> $20
"""
_APPEND_SQL = _APPEND_CTES + _APPEND_RESULT.format(event="NULL::bigint")


def _append_args(
    session_id: str,
    messages: Sequence[Message],
    *,
    caller: Principal,
    now: datetime,
    request_id: str = "",
    context_tokens_delta: int = 0,
    request_fingerprint: str = "",
    expected_profile_id: str | None = None,
) -> tuple[Any, ...]:
    """``_APPEND_SQL``'s arguments."""
    return (
        session_id,
        request_id,
        len(messages),
        sum(m.flags.is_display for m in messages),
        sum(m.flags.is_context for m in messages),
        context_tokens_delta,
        newest_preview(messages),
        now,
        caller.user_id,
        caller.is_admin,
        (request_fingerprint or None) if request_id else None,
        sorted({image.blob_id for m in messages for image in m.images if image.blob_id}),
        *append_columns(messages, now),
        expected_profile_id,
    )


# The observations of model $1 past the newest {keep} (a parameter), deleted. Rows another trim
# holds are skipped (that trim deletes them): two trims never wait on each other, so they cannot
# deadlock whatever order their scans take.
_TRIM_OBSERVATIONS = """
DELETE FROM calibration_observations
 WHERE observation_id IN (
       SELECT observation_id FROM calibration_observations
        WHERE model = $1 AND observation_id <= (
              SELECT observation_id FROM calibration_observations WHERE model = $1
               ORDER BY observation_id DESC OFFSET {keep} LIMIT 1)
          FOR UPDATE SKIP LOCKED)"""
_TRIM_OBSERVATIONS_SQL = _TRIM_OBSERVATIONS.format(keep="$2")
# An observation added, the model's older ones trimmed: the DELETE reads the snapshot from before
# the INSERT, so it keeps the newest ``calibration_keep - 1`` ($8) already there.
_ADD_OBSERVATION_SQL = """
WITH added AS (
    INSERT INTO calibration_observations (model, chars, tokens, had_images, create_time, features, residual)
    VALUES ($1, $2, $3, $4, $5, $6, $7))""" + _TRIM_OBSERVATIONS.format(keep="$8")
# A baseline's anchor (``update_state_if_unchanged``): one statement instead of lock, read, write,
# unlock. The transaction-level try-lock conflicts with the session-level lock a compaction (or any
# locked read-modify-write of the state) holds on another connection: while one runs, nothing is
# written. The CASE takes the lock only once the row is the caller's and as read (a stranger's call
# never holds it). Its commit is asynchronous, as save_view's: an anchor lost in a crash of the
# database is taken again next turn.
_ANCHOR_UPDATE = """
UPDATE sessions
   SET context_tokens = $2, context_truncated = false, state = $3::jsonb, update_time = $4
  FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit
 WHERE session_id = $1
   AND CASE WHEN (user_id = $5 OR $6) AND create_time = $7 AND last_sequence = $8 AND state = $9::jsonb
            THEN pg_try_advisory_xact_lock($10, $11) ELSE false END
RETURNING sessions.*"""


def _observed_and_published(source: str, first: int, now: int) -> str:
    """The CTEs writing a baseline's observation and event once for each row of the CTE
    ``source`` (the session's ``user_id`` in it; no row, nothing written): the parameters from
    ``$first`` are ``PostgresStore._write_args`` but the channel, ``$now`` the time, $1 the session."""
    p = [f"${first + i}" for i in range(9)]
    return f"""
observed AS (
    INSERT INTO calibration_observations (model, chars, tokens, had_images, create_time, features, residual)
    SELECT {p[0]}, {p[1]}, {p[2]}, {p[3]}, ${now}, {p[4]}, {p[5]} FROM {source}
),
locked AS (SELECT pg_advisory_xact_lock({p[6]}) FROM {source}),
published AS (
    INSERT INTO events (session_id, user_id, kind, payload, time)
    SELECT $1, {source}.user_id, {p[7]}, {p[8]}::jsonb, ${now} FROM {source}, locked
    RETURNING {EVENT_COLUMNS}
)"""


# The anchor with the baseline's observation and its event (``anchor_baseline``): no anchor, neither
# of the others. The event is published as an append's is (``_APPEND_PUBLISH_CTES``): the bus's lock,
# taken once the session's row is locked, before the event's id is drawn, released by the commit.
_ANCHOR_BASELINE_CTES = f"""
anchored AS ({_ANCHOR_UPDATE}),{_observed_and_published("anchored", 12, 4)}"""
_ANCHOR_BASELINE_RESULT = f"""
SELECT anchored.*, (SELECT e.event_id FROM published e, pg_notify($21, {notice("e")})) AS event_id
  FROM anchored"""
_ANCHOR_BASELINE_SQL = "WITH" + _ANCHOR_BASELINE_CTES + _ANCHOR_BASELINE_RESULT
# A baseline's observation and its event without its anchor (``observe_baseline``): $1 session,
# $2/$3 the caller (user, admin), $4 its create time (NULL: any), $5 now, $6-$11 the observation,
# $12 the bus's lock, $13/$14 the event, $15 the channel (``_write_args``). Neither is written for
# a session that is not the caller's. The event is published as the bus publishes (``bus.py``): its
# lock before its id is drawn, released by the commit. No row lock: the session's row is only read.
_OBSERVE_PUBLISH_SQL = f"""
WITH owned AS (
    SELECT user_id FROM sessions
     WHERE session_id = $1 AND (user_id = $2 OR $3) AND ($4::timestamptz IS NULL OR create_time = $4)
),{_observed_and_published("owned", 6, 5)}
SELECT owned.user_id, (SELECT e.event_id FROM published e, pg_notify($15, {notice("e")})) AS event_id
  FROM owned"""
# Anchors of a batch in one transaction (``PostgresStore._anchor_many``, run by asyncpg's
# ``fetchmany``): the same statement, plus $22, the session ids whose rows it locks first, in id
# order (the batch's first statement, an anchor of no session, passes all of them; every anchor
# passes none). Exactly one row per statement: an empty result is padded with NULLs.
_ANCHOR_GROUP_SQL = (
    "WITH grp AS (SELECT 1 FROM sessions WHERE session_id = ANY($22::text[]) ORDER BY session_id FOR UPDATE),"
    + _ANCHOR_BASELINE_CTES
    + "\nSELECT r.* FROM (SELECT count(*) FROM grp) AS g(n) LEFT JOIN ("
    + _ANCHOR_BASELINE_RESULT
    + ") AS r ON true"
)
# The same append publishing its ``messages_appended`` event (``ports.AppendEvent``): the bus's
# publish (``bus.py``) folded into the statement, so an append is one round trip and one commit.
# The event's order is the bus's: its lock (taken once the session's row is locked by ``upd``, so
# appends to a locked session never hold it while they wait) comes before the event's id is drawn
# and is released by the commit that makes the event visible with the rows. No row in ``upd``
# (a replay, another profile, an unknown session): no lock, no event.
_APPEND_PUBLISH_CTES = (
    _APPEND_CTES
    + f""",
locked AS (SELECT pg_advisory_xact_lock($21) FROM upd),
published AS (
    INSERT INTO events (session_id, user_id, kind, payload, time)
    SELECT $1, upd.user_id, $22,
           $23::jsonb || jsonb_build_object(
               'sequence_numbers',
               to_jsonb(ARRAY(SELECT generate_series(upd.last_sequence - $3 + 1, upd.last_sequence))),
               'context_tokens', upd.context_tokens),
           $8
      FROM upd, locked
    RETURNING {EVENT_COLUMNS}
)
"""
)
_APPEND_PUBLISH_RESULT = _APPEND_RESULT.format(
    event=f"(SELECT e.event_id FROM published e, pg_notify($24, {notice('e')}))"
)
_APPEND_PUBLISH_SQL = _APPEND_PUBLISH_CTES + _APPEND_PUBLISH_RESULT
# Appends of a batch in one transaction (``PostgresStore._append_many``, run by asyncpg's
# ``fetchmany``: one round trip, one commit). The same statement, plus $25: the session ids whose
# rows it locks first, in id order (the batch's first statement, an append to no session, passes
# all of them; every append passes none). Exactly one row per statement: an empty result is
# padded with NULLs, so the rows line up with the statements.
_NO_ROWS: list[str] = []
# ``_ANCHOR_GROUP_SQL``'s $1-$21 for its first statement, an anchor of no session.
_NO_ANCHOR: tuple[Any, ...] = (
    "",
    0,
    {},
    datetime(1970, 1, 1, tzinfo=UTC),
    "",
    False,
    datetime(1970, 1, 1, tzinfo=UTC),
    0,
    {},
    0,
    0,
    "",
    0,
    0,
    False,
    [],
    None,
    0,
    "",
    {},
    "",
)
_APPEND_GROUP_SQL = (
    _APPEND_PUBLISH_CTES
    + """,
grp AS (SELECT 1 FROM sessions WHERE session_id = ANY($25::text[]) ORDER BY session_id FOR UPDATE)
SELECT r.* FROM (SELECT count(*) FROM grp) AS g(n) LEFT JOIN (
"""
    + _APPEND_PUBLISH_RESULT
    + ") AS r ON true"
)


async def _insert_rows(conn: Any, session_id: str, rows: Sequence[Message]) -> None:
    """All rows in one statement (unnest of column arrays), plus their blob references."""
    if not rows:
        return
    await conn.execute(
        """INSERT INTO messages (session_id, seq, role, is_context, is_display, context_key, content, create_time, body)
           SELECT $1, u.seq, u.role, u.is_context, u.is_display, u.context_key, u.content, u.create_time, u.body::jsonb
             FROM unnest($2::bigint[], $3::text[], $4::boolean[], $5::boolean[], $6::bigint[], $7::text[],
                         $8::timestamptz[], $9::text[])
                  AS u(seq, role, is_context, is_display, context_key, content, create_time, body)""",
        session_id,
        *message_columns(rows),
    )
    blob_ids = sorted({image.blob_id for m in rows for image in m.images if image.blob_id})
    if blob_ids:
        await conn.execute(
            "INSERT INTO session_blobs (session_id, blob_id) SELECT $1, unnest($2::text[]) ON CONFLICT DO NOTHING",
            session_id,
            blob_ids,
        )


async def _set_context(conn: Any, session_id: str, sequence_numbers: Sequence[int], value: bool) -> int:
    """Set ``is_context`` on the rows (hot or archived) that differ; returns how many changed."""
    if not sequence_numbers:
        return 0
    changed = 0
    for table in ("messages", "messages_archive"):
        # A change bumps the session's context epoch: replicas holding its context read it again.
        changed += await conn.fetchval(
            f"""WITH changed AS (
                    UPDATE {table} SET is_context = $3
                     WHERE session_id = $1 AND seq = ANY($2::bigint[]) AND is_context <> $3
                    RETURNING 1),
                bumped AS (
                    UPDATE sessions SET context_epoch = context_epoch + 1
                     WHERE session_id = $1 AND EXISTS (SELECT 1 FROM changed))
                SELECT count(*) FROM changed""",
            session_id,
            list(sequence_numbers),
            value,
        )
    return changed


async def _check_in_context(conn: Any, session_id: str, sequence_numbers: Sequence[int]) -> None:
    """Optimistic check of a compaction, under the session's row lock: every row it demotes must
    still be in the context. The advisory compaction lock dies with its connection (a server
    restart), so two replicas may have planned on the same context; the second to commit loses."""
    if not sequence_numbers:
        return
    # The numbers still in context, by primary key in both tables; EXCEPT leaves those that are
    # not, and the smallest of them names the conflict. NULL when every row is still in context.
    first = await conn.fetchval(
        """SELECT min(seq) FROM (
               SELECT unnest($2::bigint[]) AS seq
               EXCEPT
               SELECT seq FROM all_messages
                WHERE session_id = $1 AND seq = ANY($2::bigint[]) AND is_context) AS gone""",
        session_id,
        list(sequence_numbers),
    )
    if first is not None:
        raise compaction_conflict(session_id, int(first))


def _check_known(row: Any, sequence_numbers: Sequence[int]) -> None:
    """Sequence numbers are gap-free from 1, so a row exists iff 1 <= seq <= last_sequence."""
    for seq in sequence_numbers:
        if not 1 <= seq <= row["last_sequence"]:
            raise NotFound("message not found", metadata={"session_id": row["session_id"], "sequence_number": str(seq)})


def _discard(conn: Any) -> None:
    """Close a pooled connection at once (its locks go with it). One that died already has been
    detached from its proxy by asyncpg, and calling it raises: nothing is left to close then."""
    with contextlib.suppress(asyncpg.InterfaceError):
        conn.terminate()


def _settle(task: asyncio.Future[Any]) -> None:
    # A cancelled caller never awaits its shielded task; fetch the outcome so asyncio does not
    # report "exception was never retrieved".
    if not task.cancelled():
        task.exception()
