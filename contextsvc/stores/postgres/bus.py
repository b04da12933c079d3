"""The event bus of many replicas: an ``events`` table plus LISTEN/NOTIFY (DESIGN §5.8).

``publish`` inserts a row and NOTIFYs the channel with the new event (below). Each subscriber
remembers the last id it delivered and, whenever woken, fetches the rows after it in id order. A
lost notification (a reconnect) costs latency, never an event, because subscribers are also
woken after every (re)connect of the listening connection and every ``event_poll_seconds``.

Gap-free ids need one more thing. A bigserial id is taken at INSERT but becomes visible at
COMMIT, so two concurrent publishers could commit ids 11 then 10 and a reader that already moved
past 11 would never see 10. Publishers therefore take a transaction-scoped advisory lock before
inserting: ids are handed out and committed in the same order, and what a reader sees is always
a prefix of the ids (minus rolled-back ones).

Fan-out (issue #15 item 6): watchers do not query per notification. Each bus runs one *feed*:
woken by a notification, a local publish, a reconnect or the poll, it fetches every event after
the newest it holds (one query per wake per replica, whatever the number of watchers) into a
bounded in-memory window (``postgres.event_fanout_events``) and wakes the watchers, which filter
that window in process (session, owner) as the SQL did. While no watcher is registered on the
replica the feed idles (no query per append or notification) and drops its window. The window
is a contiguous range of ids (``_floor``, ``_head``]; a watcher positioned before it (a resume
from an older id, or one that fell behind while the feed could not read) reads the table itself
until it reaches the window.

A notification carries its event whole (``notice``: the row as JSON, or only its id when that would
pass PostgreSQL's payload limit). One whose id directly follows the window's newest joins the
window as it is: ids are committed in the order they are drawn, so nothing can come between.
Then no replica reads the table for it; the feed reads only on a gap (a rolled-back id, a
notification lost in a reconnect, an event too large to carry), on a poll, or on a commit of
this replica whose notification has not arrived yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import weakref
from bisect import bisect_right
from collections import deque
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from contextsvc.clock import SYSTEM_CLOCK
from contextsvc.config import Settings
from contextsvc.core.session import Principal
from contextsvc.errors import ContextError, EventIdAhead, Unavailable
from contextsvc.ports import Clock, StoredEvent
from contextsvc.stores._session import utc
from contextsvc.stores.postgres.errors import STALE_CONNECTION_ERRORS, pg_errors
from contextsvc.stores.postgres.pool import migrate_database, open_pool, pooled
from contextsvc.stores.postgres.schema import lock_key

log = logging.getLogger(__name__)

PUBLISH_LOCK = lock_key("contextsvc:events:publish")
LISTEN_APPLICATION_NAME = "contextsvc-listen"

EVENT_COLUMNS = "event_id, session_id, user_id, kind, payload, time"
#: The events that open and close a compaction (``open_compressions``; indexed: schema v10).
_COMPRESSION_KINDS = "'compression_started', 'context_compressed', 'compression_refused'"
#: The largest notification payload sent whole: PostgreSQL refuses one of 8,000 bytes or more.
NOTICE_BYTES = 7_900


def notice(row: str) -> str:
    """SQL for the NOTIFY payload of the event in ``row`` (an alias with the ``events`` columns):
    the event as JSON when it fits ``NOTICE_BYTES``, else its id (``PostgresEventBus._on_notify``)."""
    whole = (
        f"json_build_object('event_id', {row}.event_id, 'session_id', {row}.session_id, 'user_id', "
        f"{row}.user_id, 'kind', {row}.kind, 'payload', {row}.payload, 'time', {row}.time)::text"
    )
    return (
        f"(SELECT CASE WHEN octet_length(n.j) <= {NOTICE_BYTES} THEN n.j ELSE {row}.event_id::text END "
        f"FROM (SELECT {whole} AS j) AS n)"
    )


__all__ = ["EVENT_COLUMNS", "NOTICE_BYTES", "PostgresEventBus", "make_postgres_event_bus", "notice"]

# One statement, its own transaction: the lock (a CTE with a volatile function is evaluated first,
# never inlined) is taken before the id is drawn and released after the commit made the row
# visible, so ids are committed in the order they are handed out (see the module docstring).
_PUBLISH_SQL = f"""
WITH locked AS (SELECT pg_advisory_xact_lock($7)),
     added AS (
    INSERT INTO events (session_id, user_id, kind, payload, time)
    SELECT $1, $2, $3, $4, $5 FROM locked RETURNING {EVENT_COLUMNS})
SELECT event_id FROM added, pg_notify($6, {notice("added")})"""


#: The payload key naming the ``compression_started`` a closing event closes (``publish_close``).
CLOSES_KEY = "started_event_id"
_CLOSES = f"""
    SELECT 1 FROM events
     WHERE session_id = $1 AND event_id > $2 AND kind IN ('context_compressed', 'compression_refused')
       AND payload->>'{CLOSES_KEY}' = $2::text"""
# A compaction's closing event, inserted only while its start has none. Its own statement after
# the publish lock (taken by the transaction's first statement), so its snapshot sees every close
# committed before the lock was granted.
_CLOSE_SQL = f"""
WITH added AS (
    INSERT INTO events (session_id, user_id, kind, payload, time)
    SELECT $1, $3, $4, $5, $6 WHERE NOT EXISTS ({_CLOSES})
    RETURNING {EVENT_COLUMNS})
SELECT event_id FROM added, pg_notify($7, {notice("added")})"""


async def make_postgres_event_bus(
    dsn: str, settings: Settings | None = None, *, clock: Clock | None = None
) -> PostgresEventBus:
    """A bus with its own pool, opened (schema migrated). A store's ``make_event_bus()`` gives
    one that shares the store's pool instead."""
    bus = PostgresEventBus(dsn, settings, clock=clock)
    await bus.open()
    return bus


class PostgresEventBus:
    """``EventBus`` shared by every replica on one database.

    One dedicated LISTEN connection per bus (opened when the first subscriber starts reading);
    subscribers fetch through the pool. Retention: events older than
    ``postgres.event_retention_seconds`` or beyond the newest ``postgres.event_retention_count``
    are deleted every ``postgres.event_prune_interval_seconds`` (by any bus that publishes).
    """

    def __init__(
        self, dsn: str, settings: Settings | None = None, *, clock: Clock | None = None, pool: Any = None
    ) -> None:
        self._dsn = dsn
        self._pg = (settings if settings is not None else Settings()).postgres
        self._clock: Clock = clock if clock is not None else SYSTEM_CLOCK
        self._pool = pool
        self._owns_pool = pool is None
        self._subscriptions: weakref.WeakSet[_Subscription] = weakref.WeakSet()
        self._listener: asyncio.Task[None] | None = None
        self._pruner: asyncio.Task[None] | None = None
        self._listening = asyncio.Event()
        self._inflight: set[asyncio.Future[Any]] = set()
        self._closed = False
        # The feed: every event with an id in (_floor, _head], oldest first (see the docstring).
        self._feed: asyncio.Task[None] | None = None
        self._feed_wake = asyncio.Event()
        self._window: list[StoredEvent] = []
        self._window_ids: list[int] = []
        self._floor: int | None = None
        self._head: int | None = None
        #: the feed's last read succeeded (watchers read through it only then).
        self._feed_ok = False
        #: queries the feed ran (tests and measurements).
        self.feed_fetches = 0

    async def open(self) -> None:
        """Migrate and open a pool (only for a bus built without one)."""
        if self._pool is not None:
            return
        with pg_errors("open event bus"):
            await migrate_database(self._dsn, self._pg)
            self._pool = await open_pool(self._dsn, self._pg)

    async def close(self) -> None:
        self._closed = True
        for subscription in list(self._subscriptions):
            subscription.wake()
        for task in (self._listener, self._pruner, self._feed):
            if task is not None:
                task.cancel()
        for task in (self._listener, self._pruner, self._feed):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._listener = self._pruner = self._feed = None
        while self._inflight:
            await asyncio.wait(list(self._inflight))
        pool, self._pool = self._pool, None
        if pool is not None and self._owns_pool:
            try:
                await asyncio.wait_for(pool.close(), timeout=self._pg.connect_timeout_seconds)
            except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                pool.terminate()

    # -- publishing --------------------------------------------------------------------------

    async def publish(self, *, session_id: str, user_id: str, kind: str, payload: Mapping[str, Any]) -> StoredEvent:
        time = utc(self._clock.now())
        body = dict(payload)

        async def run() -> int:
            with pg_errors("publish"):
                async with self._acquire() as conn:
                    # Lock, insert, notify and commit: one round trip instead of four.
                    event_id: int = await conn.fetchval(
                        _PUBLISH_SQL,
                        session_id,
                        user_id,
                        kind,
                        body,
                        time,
                        self._pg.event_channel,
                        PUBLISH_LOCK,
                    )
                    return event_id

        # Shielded: a cancelled caller must not leave the outcome of a commit unknown.
        task = asyncio.ensure_future(run())
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        task.add_done_callback(_settle)
        event_id = await asyncio.shield(task)
        self.committed(event_id)
        return StoredEvent(
            event_id=event_id, session_id=session_id, user_id=user_id, time=time, kind=kind, payload=body
        )

    async def publish_close(self, started: StoredEvent, *, kind: str, payload: Mapping[str, Any]) -> StoredEvent | None:
        """Publish the event that closes the compaction ``started`` announced
        (``context_compressed`` or ``compression_refused``), naming it (``CLOSES_KEY``), unless
        that start was closed already: None then. Whoever closes a start (the compaction itself,
        the next compaction or a sweep that took it for abandoned, a compaction whose lock died
        with a server restart) goes through here, so a start gets one close whatever the race."""
        time = utc(self._clock.now())
        body = {**payload, CLOSES_KEY: started.event_id}

        async def run() -> int | None:
            with pg_errors("publish"):
                async with self._acquire() as conn, conn.transaction():
                    await conn.execute("SELECT pg_advisory_xact_lock($1)", PUBLISH_LOCK)
                    event_id: int | None = await conn.fetchval(
                        _CLOSE_SQL,
                        started.session_id,
                        started.event_id,
                        started.user_id,
                        kind,
                        body,
                        time,
                        self._pg.event_channel,
                    )
                    return event_id

        task = asyncio.ensure_future(run())  # shielded, as ``publish``
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        task.add_done_callback(_settle)
        event_id = await asyncio.shield(task)
        if event_id is None:
            return None
        self.committed(event_id)
        return StoredEvent(
            event_id=event_id,
            session_id=started.session_id,
            user_id=started.user_id,
            time=time,
            kind=kind,
            payload=body,
        )

    async def start_closed(self, started: StoredEvent) -> bool:
        """Whether the compaction ``started`` announced was closed already (``publish_close``)."""
        rows = await self._read("start closed", f"SELECT EXISTS ({_CLOSES})", started.session_id, started.event_id)
        return bool(rows[0][0])

    def committed(self, event_id: int | None = None) -> None:
        """An event of this bus was committed (by ``publish``, or by the store's append statement,
        ``PostgresStore.append_messages``): local subscribers need not wait for the
        notification's round trip; retention runs from now on. ``event_id``: its id, when known;
        an event its notification already brought into the window needs no read."""
        if event_id is None or not self._holds(event_id):
            self._wake_all()
        self._start_pruner()

    def _window_head(self) -> int | None:
        """The newest id of a window that watchers read (every committed id up to it is in it), or
        None when there is none to rely on (no watcher here, the feed idle or its last read failed)."""
        return self._head if self._feed_ok and self._subscriptions else None

    def _holds(self, event_id: int) -> bool:
        """Whether the window holds every event up to ``event_id`` (watchers were woken for them
        when they joined it)."""
        head = self._window_head()
        return head is not None and event_id <= head

    def _took(self, event: StoredEvent) -> bool:
        """``event`` (from its notification) joined the window, or was in it already; False when
        the feed must read the table (it does not directly follow the window's newest)."""
        head = self._window_head()
        if head is None or event.event_id > head + 1:
            return False
        if event.event_id == head + 1:
            self._hold([event])
            self._wake_watchers()
        return True

    def _hold(self, rows: list[StoredEvent]) -> None:
        """Add ``rows`` (ids after ``_head``, in order) to the window, keeping its newest
        ``event_fanout_events`` once it holds twice that."""
        cap = self._pg.event_fanout_events
        self._window.extend(rows)
        self._window_ids.extend(e.event_id for e in rows)
        self._head = rows[-1].event_id
        if len(self._window) > 2 * cap:
            drop = len(self._window) - cap
            self._floor = self._window_ids[drop - 1]
            del self._window[:drop], self._window_ids[:drop]

    @property
    def pool(self) -> Any:
        """The pool the bus publishes and reads through (the store's, for a bus it made)."""
        return self._pool

    async def prune(self) -> int:
        """Apply retention now; returns how many events were deleted."""
        cutoff = utc(self._clock.now()) - timedelta(seconds=self._pg.event_retention_seconds)
        with pg_errors("prune events"):
            async with self._acquire() as conn:
                by_age = await conn.fetchval(
                    "WITH gone AS (DELETE FROM events WHERE time < $1 RETURNING 1) SELECT count(*) FROM gone", cutoff
                )
                by_count = await conn.fetchval(
                    """WITH gone AS (
                           DELETE FROM events WHERE event_id < (
                               SELECT event_id FROM events ORDER BY event_id DESC OFFSET $1 LIMIT 1)
                           RETURNING 1)
                       SELECT count(*) FROM gone""",
                    self._pg.event_retention_count - 1,
                )
        return int(by_age) + int(by_count)

    # -- subscribing -------------------------------------------------------------------------

    def subscribe(self, *, caller: Principal, session_id: str = "", after_event_id: int = 0) -> _Subscription:
        """Retained events with id > ``after_event_id`` (when non-zero), then live ones; with 0,
        only events committed after the first ``__anext__``."""
        return _Subscription(self, caller, session_id, after_event_id)

    @property
    def listening(self) -> bool:
        """Whether the LISTEN connection is up (notifications arrive)."""
        return self._listening.is_set()

    async def wait_listening(self) -> None:
        """Wait until the LISTEN connection is up (tests, readiness checks; bound it yourself)."""
        await self._listening.wait()

    def _register(self, subscription: _Subscription) -> None:
        if self._closed:
            return
        self._subscriptions.add(subscription)
        if self._listener is None or self._listener.done():
            self._listener = asyncio.get_running_loop().create_task(self._listen(), name="pg-event-listener")
        if self._feed is None or self._feed.done():
            self._feed = asyncio.get_running_loop().create_task(self._run_feed(), name="pg-event-feed")
        else:
            self._feed_wake.set()  # an idle feed starts reading again

    def _unregister(self, subscription: _Subscription) -> None:
        self._subscriptions.discard(subscription)
        if not self._subscriptions:
            self._feed_wake.set()  # the feed lets its window go and idles

    def _wake_all(self) -> None:
        """Something may have been committed: the feed reads it once for every watcher. Nobody
        watching on this replica: nothing to read (appends and notifications cost no query)."""
        if not self._subscriptions:
            return
        if self._feed is not None and not self._feed.done():
            self._feed_wake.set()
        else:
            self._wake_watchers()

    def _wake_watchers(self) -> None:
        for subscription in list(self._subscriptions):
            subscription.wake()

    async def _run_feed(self) -> None:
        """Fetch what was committed after ``_head`` whenever woken; keep the newest
        ``event_fanout_events`` in the window; wake the watchers. On an error the watchers are
        woken too: they then read the table themselves (and get the error), as before the feed."""
        self._feed_wake.set()
        while not self._closed:
            await self._feed_wake.wait()
            self._feed_wake.clear()
            if not self._subscriptions:
                # Idle: no window to keep up to date. The next watcher starts it from "now"
                # (one it would cover can read the table meanwhile: ``_from_window`` gives None).
                self._feed_ok = False
                self._head = self._floor = None
                self._window.clear()
                self._window_ids.clear()
                continue
            try:
                if self._head is None:
                    self._head = self._floor = await self._current_id()
                while True:
                    after = self._head
                    rows = await self._fetch(after, _FEED, "")
                    self.feed_fetches += 1
                    # Notifications may have brought some of them into the window meanwhile.
                    head = self._head if self._head is not None else after
                    newer = [e for e in rows if e.event_id > head]
                    if newer:
                        self._hold(newer)
                    self._feed_ok = True
                    if len(rows) < self._pg.event_batch:
                        break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._feed_ok = False
                log.debug("event feed read failed; watchers read the table", extra={"error": str(exc)[:160]})
            self._wake_watchers()

    def _from_window(self, after: int, caller: Principal, session_id: str) -> tuple[list[StoredEvent], int] | None:
        """The window's events after ``after`` that the watcher may see, and the id it is then
        positioned at; None when ``after`` is before the window (or the feed cannot read)."""
        floor, head = self._floor, self._head
        if not self._feed_ok or floor is None or head is None or after < floor:
            return None
        start = bisect_right(self._window_ids, after)
        admin, user = caller.is_admin, caller.user_id
        picked = [
            e
            for e in self._window[start:]
            if (not session_id or e.session_id == session_id) and (admin or e.user_id == user)
        ]
        return picked, max(after, head)

    async def _read(self, operation: str, sql: str, *args: Any) -> list[Any]:
        with pg_errors(operation):
            try:
                async with self._acquire() as conn:
                    return list(await conn.fetch(sql, *args))
            except STALE_CONNECTION_ERRORS:
                # A pooled connection that died with a server restart: once more on a fresh one.
                async with self._acquire() as conn:
                    return list(await conn.fetch(sql, *args))

    async def _newest_id_given(self) -> int:
        """The newest event id ever handed out (the sequence's), kept or not: the events table
        may be empty (pruned by age, a new database) while ids up to it were given to clients."""
        rows = await self._read(
            "subscribe", "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM events_event_id_seq"
        )
        return int(rows[0][0])

    async def _current_id(self) -> int:
        rows = await self._read("subscribe", "SELECT COALESCE(max(event_id), 0) FROM events")
        return int(rows[0][0])

    async def _fetch(self, after: int, caller: Principal, session_id: str) -> list[StoredEvent]:
        # Three query shapes, each served by its own index (by session, by user, by id).
        args: list[Any] = [after]
        where = "event_id > $1"
        if session_id:
            args.append(session_id)
            where += f" AND session_id = ${len(args)}"
        if not caller.is_admin:
            args.append(caller.user_id)
            where += f" AND user_id = ${len(args)}"
        args.append(self._pg.event_batch)
        sql = f"SELECT {EVENT_COLUMNS} FROM events WHERE {where} ORDER BY event_id LIMIT ${len(args)}"
        rows = await self._read("fetch events", sql, *args)
        return [_stored(r, r["time"]) for r in rows]

    async def open_compressions(self, *, started_before: datetime, limit: int) -> list[StoredEvent]:
        """Sessions whose newest compression event is a ``compression_started`` published before
        ``started_before``: compactions announced and never closed, if nothing holds their lock
        (a replica that died running one; ``Engine.close_abandoned_compactions`` checks the lock)."""
        sql = f"""
            SELECT {EVENT_COLUMNS} FROM (
                SELECT DISTINCT ON (session_id) {EVENT_COLUMNS} FROM events
                 WHERE kind IN ({_COMPRESSION_KINDS}) ORDER BY session_id, event_id DESC
            ) AS newest
             WHERE kind = 'compression_started' AND time < $1 ORDER BY event_id LIMIT $2"""
        rows = await self._read("open compressions", sql, started_before, limit)
        return [_stored(r, r["time"]) for r in rows]

    async def newest_compression(self, session_id: str) -> StoredEvent | None:
        """The session's newest compression event (started, compressed or refused), if any."""
        sql = f"""SELECT {EVENT_COLUMNS} FROM events WHERE session_id = $1 AND kind IN ({_COMPRESSION_KINDS})
                   ORDER BY event_id DESC LIMIT 1"""
        rows = await self._read("newest compression", sql, session_id)
        return _stored(rows[0], rows[0]["time"]) if rows else None

    async def retained_deletion(self, session_id: str) -> StoredEvent | None:
        sql = f"""SELECT {EVENT_COLUMNS} FROM events WHERE session_id = $1 AND kind = 'session_deleted'
                   ORDER BY event_id DESC LIMIT 1"""
        rows = await self._read("retained deletion", sql, session_id)
        return _stored(rows[0], rows[0]["time"]) if rows else None

    def _acquire(self) -> Any:
        if self._pool is None:
            raise Unavailable("PostgreSQL event bus is not open")
        return pooled(self._pool, self._pg.acquire_timeout_seconds)

    # -- background tasks --------------------------------------------------------------------

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        if not self._subscriptions:
            return  # nobody watching here: nothing to read or hold
        # The event whole (``notice``), or its id when it was too large to carry.
        if payload.startswith("{"):
            try:
                event = _noticed(payload)
            except (ValueError, KeyError, TypeError):
                event = None
            if event is not None and self._took(event):
                return
        elif payload.isdigit() and self._holds(int(payload)):
            return
        self._wake_all()

    async def _listen(self) -> None:
        """Keep one LISTEN connection up; wake every subscriber after each (re)connect and every
        poll interval, which is also the connection's keepalive."""
        pause = 0.1
        while not self._closed:
            conn: Any = None
            try:
                conn = await asyncpg.connect(
                    self._dsn,
                    timeout=self._pg.connect_timeout_seconds,
                    server_settings={"application_name": LISTEN_APPLICATION_NAME},
                )
                lost = asyncio.Event()
                conn.add_termination_listener(_setter(lost))
                await conn.add_listener(self._pg.event_channel, self._on_notify)
                self._listening.set()
                pause = 0.1
                self._wake_all()  # catch up on what was committed while nobody listened
                while not self._closed and not lost.is_set():
                    try:
                        await asyncio.wait_for(lost.wait(), timeout=self._pg.event_poll_seconds)
                    except TimeoutError:
                        await conn.fetchval("SELECT 1", timeout=self._pg.connect_timeout_seconds)
                        self._wake_all()
                if lost.is_set():
                    log.warning("event listener connection lost; reconnecting")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Whatever a dying connection raises (OSError, asyncpg's connection, interface and
                # internal client errors...), this task must live on: it is the bus's only ear.
                log.warning(
                    "event listener cannot reach PostgreSQL; retrying",
                    extra={"error": f"{type(exc).__name__}: {str(exc)[:160]}"},
                )
            finally:
                self._listening.clear()
                if conn is not None:
                    conn.terminate()
            if not self._closed:
                await asyncio.sleep(pause)
                pause = min(pause * 2, self._pg.reconnect_max_seconds)

    def _start_pruner(self) -> None:
        if self._pruner is None and not self._closed:
            self._pruner = asyncio.get_running_loop().create_task(self._prune_forever(), name="pg-event-pruner")

    async def _prune_forever(self) -> None:
        while not self._closed:
            await asyncio.sleep(self._pg.event_prune_interval_seconds)
            try:
                deleted = await self.prune()
                if deleted:
                    log.info("events pruned", extra={"deleted": deleted})
            except ContextError as exc:
                log.warning("event pruning skipped", extra={"error": exc.message})


class _Subscription:
    """One watcher: an async iterator that fetches rows after the last id it delivered."""

    __slots__ = (
        "__weakref__",
        "_buffer",
        "_bus",
        "_caller",
        "_closed",
        "_last",
        "_registered",
        "_session_id",
        "_woken",
    )

    def __init__(self, bus: PostgresEventBus, caller: Principal, session_id: str, after_event_id: int) -> None:
        self._bus = bus
        self._caller = caller
        self._session_id = session_id
        #: None until the first read: "live" starts at the newest id committed then.
        self._last: int | None = after_event_id if after_event_id > 0 else None
        self._buffer: deque[StoredEvent] = deque()
        self._woken = asyncio.Event()
        self._registered = False
        self._closed = False

    def wake(self) -> None:
        self._woken.set()

    @property
    def position(self) -> int | None:
        """The id after which the next fetch starts; None until the first read fixed "now"."""
        return self._last

    def __aiter__(self) -> _Subscription:
        return self

    async def __anext__(self) -> StoredEvent:
        bus = self._bus
        try:
            while True:
                if self._buffer:
                    return self._buffer.popleft()
                if self._closed or bus._closed:
                    raise StopAsyncIteration
                if not self._registered:
                    if self._last is not None:
                        newest = await bus._newest_id_given()
                        # 1 is the first id the table gives: "from the start" even before any
                        # event was published (the gateway's streams begin there).
                        if self._last > max(newest, 1):
                            raise EventIdAhead(self._last, newest)
                    # Registered before the first fetch: a notification arriving meanwhile
                    # leaves the wake flag set, so nothing committed after it is missed.
                    bus._register(self)
                    self._registered = True
                    self._woken.set()
                await self._woken.wait()
                self._woken.clear()
                if self._closed or bus._closed:
                    raise StopAsyncIteration
                if self._last is None:
                    self._last = await bus._current_id()
                served = bus._from_window(self._last, self._caller, self._session_id)
                if served is not None:
                    rows, self._last = served
                    self._buffer.extend(rows)
                    continue
                # Before the feed's window: read the table. Every id up to the newest committed
                # before the read is then seen, so a full page's absence moves past them too.
                newest = await bus._current_id()
                rows = await bus._fetch(self._last, self._caller, self._session_id)
                if rows:
                    self._last = rows[-1].event_id
                    self._buffer.extend(rows)
                if len(rows) >= bus._pg.event_batch:
                    self._woken.set()  # more are waiting
                else:
                    self._last = max(self._last, newest)
                    if bus._feed_ok:
                        self._woken.set()  # into the window now
        except Unavailable:
            self._unregister()
            if self._closed or bus._closed:
                # Closed while a read was in flight: the end of the stream, not an outage.
                raise StopAsyncIteration from None
            raise
        except BaseException:
            # Unavailable, cancellation or the end: stop being woken. A caller that keeps
            # iterating after Unavailable re-registers and resumes after the last delivered id.
            self._unregister()
            raise

    async def aclose(self) -> None:
        self._closed = True
        self._unregister()
        self._woken.set()

    def _unregister(self) -> None:
        if self._registered:
            self._bus._unregister(self)
            self._registered = False


#: The feed reads every event (an admin's view, no session filter); watchers filter in process.
_FEED = Principal(user_id="contextsvc", is_admin=True)


def _setter(event: asyncio.Event) -> Any:
    def on_terminate(_conn: Any) -> None:
        event.set()

    return on_terminate


def _settle(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _stored(row: Mapping[str, Any], time: datetime) -> StoredEvent:
    """The event of an ``events`` row (``EVENT_COLUMNS``: a record read, or a notification's JSON)."""
    return StoredEvent(
        event_id=int(row["event_id"]),
        session_id=row["session_id"],
        user_id=row["user_id"],
        time=time,
        kind=row["kind"],
        payload=row["payload"],
    )


def _noticed(payload: str) -> StoredEvent:
    """The event a notification carries (``notice``), as a read of the table would give it."""
    row = json.loads(payload)
    return _stored(row, utc(datetime.fromisoformat(row["time"])))
