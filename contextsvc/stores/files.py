"""The files store, the embedded default: one append-only JSONL log per session.

Layout under the data directory::

    sessions/<session-id>.jsonl                 the session's log
    sessions/<session-id>.jsonl.torn-<time>     a log set aside on load (also ``.corrupt-<time>``)
    sessions/<session-id>.jsonl.mark            the highest sequence number ever acknowledged
    index.jsonl                                 the start-up index: a summary of every session
    blobs/<ab>/<sha256>                         image bytes, stored once under their SHA-256
    history/<session-id>.jsonl                  the session's raw history index (chunks), if any
    calibration.jsonl                           calibration observations, one per line, every model

A log's first line is the session header (``{"t": "session", ...}``, fields as in
``core/codec.py``); every mutation then appends one record: ``append`` (rows, request id,
token delta), ``flags`` (explicit ``is_context`` changes by sequence number, context-only rows
included), ``header`` (name / pinned / metadata), ``state`` (counters, engine state) or
``compaction`` (demotions + appended rows + counters in one line) or ``view`` (a built view kept
for RecordBaseline: soft state, never fsynced on its own). Writes go to the log first and then to
memory. Soft lines (views, a baseline's anchor) and calibration observations are
deferred (``_defer``): written together with the log's next line, or by the flusher once they
waited ``files.soft_line_wait_ms`` (observations: at its next pass), one write instead of one
each; a crash can lose the newest of them, never an acknowledged mutation.

Bounded memory and fast start (issue #9 item 3): ``open()`` reads the start-up index
(``index.jsonl``, ``_index``) instead of the logs, and only the logs it has no matching entry for;
every session starts as a summary (``SessionState.resident`` False: header, counters, preview). A
session's rows are read from its log on first use, under its lock (``_ensure_rows``). Past
``files.cache_mb``, the least recently used sessions first let go of their rows outside the context
but a tail (``files.resident_tail_rows``, ``_shed``): a turn reads only the context and appends, so
long compressed sessions keep serving turns from memory, and a read of a row let go reads the log
whole again. Only if that is not enough are whole sessions' rows dropped (never a session whose
lock is held). Logs are rewritten compactly in the background when flag/header/state/view records pile up
(``_compact_loop``; ``rewrite_log`` on demand).

The raw history index of a session (DESIGN §5.6) is a separate append-only file, one chunk per
line (``{"t": "chunk", "hash", "text", "first", "last", "start", "end", "crumbs"}``), created by
the session's first chunks. It is loaded lazily, on the session's first ``add_history_chunks`` or
``search_history`` after ``open()``, and then kept in memory and ranked in process
(``core/recall.py``): most sessions are never searched, so ``open()`` neither reads these files
nor holds their text twice. Its I/O errors are ``Unavailable`` and never touch the session log.

Durability (``settings.durability``):

* ``fsync`` (the default): a mutation's record is written and fsynced before the call returns.
  An acknowledged append survives a process crash, a kernel crash and a power loss (on a disk
  that honours fsync). A crash can lose only the mutation in flight, which was never
  acknowledged; its partial line is dropped on the next load. Writers waiting for the disk at
  the same time share one sync pass (group commit, ``_disk_sync.GroupCommit``): each writes its
  line, then returns once a pass that began after the write has made it durable; a pass of two
  or more logs is one ``syncfs`` of the filesystem (``files.sync_whole_filesystem``).
* ``batch``: the record is handed to the operating system before the call returns, and a
  background task fsyncs the written logs at most ``fsync_batch_ms`` (default 50 ms) later (one
  ``syncfs`` for them all, as above). A
  process crash (kill -9, out of memory) loses nothing that was acknowledged. A machine crash or
  power loss may lose mutations acknowledged within that last interval: appends lost at a log's
  end get stand-in rows, as below, but leave the session writable.

History chunks follow the same mode as session logs. In both modes, creating and deleting a
session, creating its history file, rewriting a log and storing a blob are durable before the
call returns (temp file + fsync + ``os.replace`` + directory fsync), and a compaction is a single
record, so after any crash a session shows all of a compaction or none.

Integrity (issue #9): the store holds ``<data>/lock`` (``_dirlock``) for its whole life, so one
process writes a directory. Every line is a checked record (``_frames``: CRC32C + the record,
which carries ``n``, the session's highest sequence number once it applies), and
``sessions/<id>.jsonl.mark`` keeps the highest number ever acknowledged and the header fields that
never change. Lines written before checksums load unchecked.

Recovery on load (``_log_records.scan_log``, shared with ``contextsvc fsck``): every line is checked on its
own; a bad one is set aside (the original log copied to ``.corrupt-<time>``, or ``.torn-<time>``
when only the last line is bad and nothing acknowledged is lost: an interrupted write) and the
records after it still load. Acknowledged numbers that cannot be read (a bad append record, a gap,
a tail below the mark) get stand-in rows (``SessionState.fill_lost``) so they are never handed out
again, and the session is damaged: read-only (``SESSION_DAMAGED`` on writes) until ``fsck
--repair``. A lost header is rebuilt from the mark file; a log with no readable record and no mark
is moved aside. A history file gets the same treatment, except that its chunks do not depend on
each other: every readable line is kept, unreadable ones are dropped (the original set aside as
``.torn-<time>`` or ``.corrupt-<time>``) and the file is rewritten. Deleting a session removes its
mark, its history file, then its log, and any copies of either set aside. A history file left
without a session (its log and mark removed by an operator) is kept, and removed if a session
with that id is ever created again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import itertools
import logging
import os
import shutil
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from contextsvc.config import Durability, Settings
from contextsvc.core.calibration import Observation
from contextsvc.core.codec import message_to_dict
from contextsvc.core.priors import current_features
from contextsvc.core.recall import RecallIndex
from contextsvc.core.session import ListPosition, Principal, SessionInfo, SessionPage, is_session_id
from contextsvc.errors import Conflict, ContextError, NotFound, Unavailable
from contextsvc.ports import Clock, HistoryChunk, StoreHealth
from contextsvc.stores._base import RowStore, _listed_page, check_blob, is_blob_id, session_not_found
from contextsvc.stores._dirlock import DataDirLock
from contextsvc.stores._disk_sync import DiskSync, GroupCommit
from contextsvc.stores._frames import mark_path, read_mark, write_mark, write_mark_number
from contextsvc.stores._index import (
    INDEX_NAME,
    FileKey,
    IndexEntry,
    encode_entry,
    file_key,
    index_bytes,
    read_index,
)
from contextsvc.stores._log_records import (
    FsckEntry,
    LogScan,
    _chunk_bytes,
    _chunk_from_dict,
    _chunk_to_dict,
    _dumps,
    _encode,
    _loads,
    _ranges,
    _session_line,
    _time,
    scan_log,
)
from contextsvc.stores._seal import read_seal, seal_holds, seal_note
from contextsvc.stores._session import (
    AppendRecord,
    CompactionRecord,
    FlagsRecord,
    HeaderRecord,
    Record,
    SaveViewRecord,
    SessionState,
    StateRecord,
    row_bytes,
)
from contextsvc.throttled_log import ThrottledLog

if TYPE_CHECKING:
    from contextsvc.core.maintenance import Candidate
from contextsvc.stores.api_tokens import FilesTokenStore

logger = logging.getLogger(__name__)
T = TypeVar("T")

_LOG_SUFFIX = ".jsonl"
_CALIBRATION = "calibration.jsonl"
_TMP_SUFFIX = ".tmp"
_MARK_SUFFIX = ".mark"
_MB = 1024 * 1024
#: estimated memory of a held session beyond its rows (state, lock, indexes).
_SESSION_BYTES = 4096


@dataclass(slots=True)
class FilesStoreStats:
    """Counters an operator (or a test) can read to see the store's disk work."""

    #: logs made durable after appends (fsync mode) or by the batch flusher: each counts once
    #: per pass, whether its pass fsynced it alone or synced the filesystem (``_disk_sync``).
    log_fsyncs: int = 0
    #: passes of the batch flusher that fsynced at least one log.
    batch_flushes: int = 0
    #: logs rewritten (on demand, automatically, or after recovery on load).
    rewrites: int = 0
    #: blobs written (a blob already stored is not written again).
    blob_writes: int = 0
    #: logs that needed recovery on load (torn or corrupt).
    recovered_logs: int = 0
    #: history files that needed recovery when loaded (torn or corrupt lines dropped).
    recovered_histories: int = 0
    #: sessions whose rows were read from their log on first use (lazy loading).
    loads: int = 0
    #: sessions whose rows were dropped to stay within ``files.cache_mb``.
    evictions: int = 0
    #: rows outside a context let go to stay within ``files.cache_mb`` (their session stays held).
    rows_shed: int = 0
    #: logs read whole at ``open()`` because the start-up index had no usable entry for them.
    logs_read_at_open: int = 0
    #: logs whose start-up index entry was used at ``open()``.
    index_hits: int = 0
    #: whether ``open()`` took the index under a clean-shutdown seal, without a look at each log (``_seal``).
    sealed_open: bool = False
    #: logs whose key was checked in the background after a sealed open, and those found changed (read whole).
    logs_verified: int = 0
    logs_changed_after_seal: int = 0
    #: background compactions of logs whose flag/header/state/view records piled up.
    compactions: int = 0
    #: times the start-up index was written.
    index_writes: int = 0


class _Log:
    """A log file the store appends to: its path, its size as written, ``overhead``, the
    flag/header/state/view records since it was last written whole, and ``pending``, lines
    that wait for the next write to it (``FilesStore._defer``)."""

    __slots__ = ("_mark", "_path", "overhead", "pending", "size")

    def __init__(self, path: Path | str, size: int, overhead: int = 0) -> None:
        # A str until first used: start-up makes one per session, most never touched, and a
        # Path costs more to build than the rest of an indexed session's start-up.
        self._path = path
        self._mark: Path | None = None
        self.size = size
        self.overhead = overhead
        #: None, not an empty list, for the many logs that never hold one (start-up makes a _Log
        #: per session).
        self.pending: list[bytes] | None = None

    @property
    def path(self) -> Path:
        path = self._path
        if isinstance(path, str):
            path = self._path = Path(path)
        return path

    @property
    def mark(self) -> Path:
        """The log's mark file (``_frames.mark_path``), made once: every append of rows writes it."""
        mark = self._mark
        if mark is None:
            mark = self._mark = mark_path(self.path)
        return mark

    def __repr__(self) -> str:
        return f"_Log({str(self._path)!r}, size={self.size}, overhead={self.overhead})"


#: what a load at open gives: every session's summary with its log and index line, the stored
#: calibration observations by model, and the calibration log.
_Loaded = tuple[list[tuple[SessionState, _Log, "bytes | None"]], dict[str, list[Observation]], _Log]


class FilesStore(RowStore):
    """A ``SessionStore`` over JSONL logs in a data directory (see the module docstring)."""

    #: bytes the health probe writes and fsyncs (about one record).
    PROBE_BYTES = 4096

    def __init__(
        self,
        path: str | os.PathLike[str],
        settings: Settings | None = None,
        *,
        clock: Clock | None = None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        read_only: bool = False,
    ) -> None:
        super().__init__(settings, clock, {}, {})
        self.root = Path(path)
        self._sessions_dir = self.root / "sessions"
        self._blobs_dir = self.root / "blobs"
        self._history_dir = self.root / "history"
        self._logs: dict[str, _Log] = {}
        #: history files of the sessions whose index is loaded (no entry: no file yet).
        self._history_logs: dict[str, _Log] = {}
        self._calibration = _Log(self.root / _CALIBRATION, 0)
        #: files written since their last fsync (batch mode; the calibration log in both modes).
        self._dirty: set[Path] = set()
        #: logs holding lines not yet written (``_defer``) -> when the flusher writes them
        #: (``time.monotonic``) if no other write to the log took them first.
        self._unwritten: dict[_Log, float] = {}
        #: how written files are made durable, and the group commit of fsync mode's writers.
        self._disk = DiskSync(self.root, whole_filesystem=self._settings.files.sync_whole_filesystem)
        #: a failing disk fails every write at once: its lines, at most so many a minute
        self._disk_errors = ThrottledLog(
            logger, per_minute=self._settings.files.error_log_per_minute, level=logging.ERROR
        )
        self._group = GroupCommit(
            self._disk.sync,
            gather_seconds=self._settings.files.group_commit_wait_ms / 1000,
            gather_files=self._settings.files.group_commit_min_logs,
        )
        self._dirty_event = asyncio.Event()
        self._sleep = sleep if sleep is not None else asyncio.sleep
        self._flusher: asyncio.Task[None] | None = None
        self.stats = FilesStoreStats()
        self._dir_lock = DataDirLock(self.root)
        #: read-only (``maintain --dry-run`` beside a running server): no lock, nothing written.
        self.read_only = read_only
        #: sessions holding rows or a history index, least recently used first -> estimated bytes.
        self._lru: OrderedDict[str, int] = OrderedDict()
        self._held = 0
        #: rows counted in ``_lru`` per session.
        self._held_rows: dict[str, int] = {}
        #: bytes counted in ``_lru`` that caches outside the store hold per session (``hold_outside``).
        self._outside: dict[str, int] = {}
        #: bytes of the rows a session let go (``SessionState.shed_rows``), counted again when it
        #: reads its log whole.
        self._shed_bytes: dict[str, int] = {}
        #: start-up index: encoded lines of sessions unchanged since, and sessions changed since.
        self._index_lines: dict[str, bytes] = {}
        self._index_dirty: set[str] = set()
        self._index_stale = False
        self._index_lock = asyncio.Lock()
        #: after a sealed open (``_seal``): the index's key of each log not yet checked against it.
        self._sealed_keys: dict[str, FileKey] = {}
        #: set once every log's key was checked after a sealed open (at once otherwise).
        self._verified = asyncio.Event()
        self._verified.set()
        #: set when the server serves (``begin_checks``): the check must not slow the start down.
        self._checks_go = asyncio.Event()
        #: set when a session is found damaged while serving (``StoreHealthWatcher`` waits on it).
        self.damage_changed = asyncio.Event()
        #: sessions whose log is due for a background compaction.
        self._compact_wanted: set[str] = set()
        self._compact_event = asyncio.Event()
        self._compact_idle = asyncio.Event()
        self._compact_idle.set()
        self._tasks: list[asyncio.Task[None]] = []
        #: called with a session id when its rows are dropped or it is deleted: the server drops
        #: every engine and API cache of it (``ViewService.forget``, ``WireCache``), which would
        #: otherwise keep the rows alive outside the budget.
        self.on_evict: Callable[[str], None] | None = None

    def _scan(self, data: bytes, session_id: str, mark: tuple[int, dict[str, Any]] | None) -> LogScan:
        """``scan_log`` with this store's settings: its default profile, and whether its logs are
        synced in batches (a machine crash may then lose the end of one: ``scan_log``'s ``batch``)."""
        batch = self._settings.durability is Durability.BATCH
        return scan_log(data, session_id, mark, self._settings.default_profile, batch=batch)

    @property
    def pending_fsync(self) -> int:
        """Files written but not yet fsynced (batch mode; the calibration log in both modes)."""
        return len(self._dirty)

    # -- lifecycle -------------------------------------------------------------------------

    def api_tokens(self) -> FilesTokenStore:
        """This store's API tokens (``ports.ApiTokenStore``): ``tokens.json`` in the data directory."""
        return FilesTokenStore(self.root)

    async def open(self) -> None:
        if self.read_only:
            # No lock and no write of any kind: the server may own the directory meanwhile.
            loaded, observations, calibration = await asyncio.to_thread(self._load_all_unswept)
        else:
            # One writer per directory, and the lock before anything is read (see ``_dirlock``).
            await asyncio.to_thread(self._lock_dir)
            try:
                self._disk.open()
                loaded, observations, calibration = await asyncio.to_thread(self._load_all_unswept)
            except BaseException:
                self._disk.close()
                self._dir_lock.release()
                raise
        self._observations.update(observations)
        self._calibration = calibration
        least = self._settings.files.compact_min_records  # no log with fewer records is ever due
        sessions, logs, lines = self._sessions, self._logs, self._index_lines
        for st, log, line in loaded:
            sid = st.id
            sessions[sid] = st
            logs[sid] = log
            if line is not None:
                lines[sid] = line
            if log.overhead > least and self._compaction_due(log, st.last_sequence):
                self._want_compaction(sid)
        if self.read_only:
            return
        if self._flusher is None:  # in fsync mode it only writes deferred lines (``_defer``)
            self._flusher = asyncio.create_task(self._flush_loop(), name="contextsvc-files-fsync")
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._compact_loop(), name="contextsvc-files-compact"),
                asyncio.create_task(self._index_loop(), name="contextsvc-files-index"),
            ]
            if self._sealed_keys:
                self._verified.clear()
                self._tasks.append(asyncio.create_task(self._verify_sealed(), name="contextsvc-files-verify"))

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._drain()  # a compaction under way finishes (it runs shielded)
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        if self.read_only:
            return
        note = b""
        try:
            await self._group.drain()
            await self.flush()
            if self._dir_lock.held:
                try:
                    await self.write_index()
                    note = self._seal()
                except OSError as exc:
                    logger.warning("files store: cannot write the start-up index: %s", exc)
        finally:
            self._disk.close()
            self._dir_lock.release(note)

    def _seal(self) -> bytes:
        """The clean-shutdown seal (``_seal``) when the index just written lists every session as
        its log is now (nothing left out, nothing damaged, every log checked), else nothing."""
        if self._index_dirty or self._index_stale or self._sealed_keys:
            return b""  # (the last: logs a sealed start has not checked yet)
        live = [sid for sid, st in self._sessions.items() if not st.deleted]
        if any(sid not in self._index_lines for sid in live):
            return b""
        try:
            return seal_note(self.root / INDEX_NAME, self._sessions_dir, len(live))
        except OSError:
            return b""

    # -- lazy loading, the memory bound, the start-up index ------------------------------------

    async def _ensure_rows(self, st: SessionState, *, whole: bool = True) -> None:
        """Load a session known by its summary only, or (``whole``) one that let rows go, under
        its lock; then keep within the budget."""
        if st.resident and not (whole and st.shed):
            self._touch(st)
            return
        await self._read_whole(st, st.last_sequence)

    async def _read_whole(self, st: SessionState, known: int) -> None:
        """Read the session's log whole into ``st`` (under its lock). ``known``: the highest number
        its summary counted, which stays taken even if the log lost it (0 after a log changed while
        no server ran, ``_reread_sealed``: the log and its mark are then all there is to trust)."""
        self._sealed_keys.pop(st.id, None)  # read whole now: nothing left to check (``_seal``)
        path = self._log_path(st.id)
        old = self._logs.get(st.id)
        if old is not None:
            self._write_deferred(old)  # the log is read back whole: it must hold all of them
        try:
            result = await asyncio.to_thread(self._load_one, path)
        except OSError as exc:
            raise self._unavailable("read", st.id, exc) from exc
        if result is None:
            # Its log and mark are gone (removed by hand) or nothing in them is readable.
            logger.error("files store: session %s has no readable log any more; it is gone", st.id)
            st.deleted = True
            self._sessions.pop(st.id, None)
            self._logs.pop(st.id, None)
            self._index_lines.pop(st.id, None)
            self._index_stale = True
            raise session_not_found(st.id)
        loaded, log = result
        if st.resident and st.shed and not loaded.damage and loaded.last_sequence == st.last_sequence:
            # A session that let rows go (``_shed``): only those come back.
            st.restore_rows(loaded.rows)
            self._logs[st.id] = log
            self.stats.loads += 1
            self._hold(st.id, self._shed_bytes.pop(st.id, 0))
            self._evict()
            return
        if loaded.last_sequence < known:
            # The log lost rows since its summary was taken (the mark was lost too): the numbers
            # the summary counted stay taken.
            lost = loaded.fill_lost(known, "the end of its log was lost", None)
            loaded.damage = loaded.damage or f"{len(lost)} acknowledged message(s) unreadable: {_ranges(lost)}"
        changed = old is None or old.size != log.size or loaded.last_sequence != known or bool(loaded.damage)
        # A session that let rows go and whose log now reads otherwise (damaged since): whole.
        regained = self._shed_bytes.pop(st.id, 0) if st.resident else 0
        st.adopt(loaded)
        if st.damage:
            self.damage_changed.set()  # the health service says so now, not at its next poll
        self._logs[st.id] = log
        self.stats.loads += 1
        if changed:
            self._index_dirty.add(st.id)
        self._count(st)
        if regained:
            self._hold(st.id, regained)
        self._evict()

    def _load_one(self, path: Path) -> tuple[SessionState, _Log] | None:
        mark_file = mark_path(path)
        if self.read_only:
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                data = b""
            scan = self._scan(data, path.name[: -len(_LOG_SUFFIX)], read_mark(mark_file))
            return None if scan.st is None else (scan.st, _Log(path, len(data), scan.overhead))
        if path.exists():
            return self._load_log(path)
        if mark_file.exists():
            return self._load_orphan_mark(mark_file)
        return None

    def _touch(self, st: SessionState) -> None:
        if st.id in self._lru:
            self._lru.move_to_end(st.id)

    def _hold(self, session_id: str, nbytes: int) -> None:
        """Count ``nbytes`` more held for the session and make it the most recently used."""
        if session_id not in self._lru:
            self._lru[session_id] = _SESSION_BYTES
            self._held += _SESSION_BYTES
        self._lru[session_id] += nbytes
        self._held += nbytes
        self._lru.move_to_end(session_id)

    def _count(self, st: SessionState) -> None:
        done = self._held_rows.get(st.id, 0)
        rows = st.rows
        added = sum(row_bytes(m) for m in rows[done:]) if len(rows) > done else 0
        self._held_rows[st.id] = len(rows)
        self._hold(st.id, added)

    @property
    def held_bytes(self) -> int:
        """Estimated memory of the rows and history indexes held now (bounded by ``files.cache_mb``)."""
        return self._held

    @property
    def resident_sessions(self) -> int:
        return sum(1 for st in list(self._sessions.values()) if st.resident and st.last_sequence)

    def _evict(self, keep: str = "") -> None:
        """While over budget: first let go of the rows outside the contexts (``_shed``), then drop
        the least recently used sessions' rows (and history indexes, and through
        ``on_evict`` every engine and API cache of them) while over budget; never ``keep``, the
        most recently used session (unless the budget is 0), nor a session whose lock is held (a
        mutation or a load is using it): those are tried again after the next call that held a
        session lock (``_serialized``)."""
        budget = int(self._settings.files.cache_mb * _MB)
        if self._held <= budget:
            return
        # With a budget at all, the most recently used session stays even when it alone is over
        # it: dropping it after every call made each call on a long session read and index its
        # whole log again (O(history) per call). 0 keeps only the sessions in use, as documented.
        newest = next(reversed(self._lru), "") if budget > 0 else ""
        if budget > 0:  # at 0 every session not in use goes whole anyway
            self._shed(budget, (keep, newest))
        for sid in list(self._lru):
            if self._held <= budget:
                break
            st = self._sessions.get(sid)
            if sid in (keep, newest) or (st is not None and (st.lock.locked() or st.damage)):
                continue
            self._forget(sid)
            if st is not None:
                st.evict(self._settings.preview_chars)
            self.stats.evictions += 1
            if self.on_evict is not None:
                self.on_evict(sid)

    def _shed(self, budget: int, spared: tuple[str, str]) -> None:
        """Before whole sessions go: the rows outside each context, but a tail
        (``files.resident_tail_rows``), least recently used sessions first. Agents take their
        turns in a cycle, so once their sessions outgrow the budget, dropping whole sessions made
        every turn read a log again; a turn reads only the context and appends (round 19)."""
        tail = self._settings.files.resident_tail_rows
        for sid in list(self._lru):
            if self._held <= budget:
                return
            st = self._sessions.get(sid)
            if (
                st is None
                or not st.resident
                or sid in spared
                or st.lock.locked()
                or st.damage
                # Looked at in batches of at least ``tail`` rows (one a time would scan every call).
                or len(st.rows) - tail - st.shed_scan < max(tail, 1)
            ):
                continue
            gone = st.shed_rows(tail)
            if gone:
                freed = sum(row_bytes(m) for m in gone)
                self._lru[sid] -= freed
                self._held -= freed
                self._shed_bytes[sid] = self._shed_bytes.get(sid, 0) + freed
                self.stats.rows_shed += len(gone)

    async def _serialized(
        self, st: SessionState, work: Callable[[], Awaitable[T]], *, rows: bool = True, whole: bool = True
    ) -> T:
        try:
            return await super()._serialized(st, work, rows=rows, whole=whole)
        finally:
            self._evict()  # the session is unlocked now: it may go if it is over the budget

    def hold_outside(self, session_id: str, nbytes: int) -> None:
        """A cache outside the store (the API adapter's encoded messages, ``api.wire``) holds
        ``nbytes`` for the session now: counted under the same budget (``files.cache_mb``) as
        its rows, so one bound covers everything held per session touched. When the session is
        let go, ``on_evict`` tells the cache to drop it. Never evicts the session itself now (it
        was just used); may evict others."""
        old = self._outside.pop(session_id, 0)
        if nbytes > 0 and session_id in self._sessions:
            self._outside[session_id] = nbytes
        else:
            nbytes = 0
        delta = nbytes - old
        if session_id in self._lru:
            self._lru[session_id] += delta
            self._held += delta
            self._lru.move_to_end(session_id)
        elif nbytes:
            self._lru[session_id] = nbytes
            self._held += nbytes
        self._evict(keep=session_id)

    def _forget(self, session_id: str) -> None:
        self._held -= self._lru.pop(session_id, 0)
        self._shed_bytes.pop(session_id, None)
        self._outside.pop(session_id, None)
        self._held_rows.pop(session_id, None)
        self._history.pop(session_id, None)
        self._history_logs.pop(session_id, None)

    async def write_index(self) -> None:
        """Write the start-up index if anything changed since it was last written (atomically)."""
        if self.read_only:
            return
        async with self._index_lock:
            if not self._index_dirty and not self._index_stale:
                return
            pending: list[tuple[str, SessionInfo, int, int, Path]] = []
            for sid in self._index_dirty:
                st = self._sessions.get(sid)
                log = self._logs.get(sid)
                self._index_lines.pop(sid, None)
                if st is None or st.deleted or log is None or st.damage:
                    continue  # gone, or damaged: read whole at every start
                pending.append((sid, st.info(self._settings.preview_chars), log.size, log.overhead, log.path))
            self._index_dirty.clear()
            self._index_stale = False
            clean = {sid: line for sid, line in self._index_lines.items() if sid in self._sessions}
            path = self.root / INDEX_NAME
            preview_chars = self._settings.preview_chars

            def write() -> dict[str, bytes]:
                fresh: dict[str, bytes] = {}
                for sid, info, size, overhead, log_path in pending:
                    try:
                        stat = os.stat(log_path)
                    except OSError:
                        continue
                    if stat.st_size == size:  # else a write is in flight: leave it out, not stale
                        fresh[sid] = encode_entry(IndexEntry(info, file_key(stat), overhead))
                _write_atomic(path, index_bytes([*clean.values(), *fresh.values()], preview_chars))
                return fresh

            try:
                fresh = await asyncio.to_thread(write)
            except BaseException:
                self._index_dirty.update(sid for sid, *_ in pending)
                raise
            self.stats.index_writes += 1
            self._index_lines.update(fresh)
            # Left out (a write in flight): try again next time.
            self._index_dirty.update(sid for sid, *_ in pending if sid not in fresh)

    async def _index_loop(self) -> None:
        while True:
            await asyncio.sleep(self._settings.files.index_interval_seconds)
            try:
                await self.write_index()
            except OSError as exc:
                logger.warning("files store: cannot write the start-up index: %s", exc)

    # -- background compaction of logs -------------------------------------------------------------

    def _compaction_due(self, log: _Log, rows: int) -> bool:
        f = self._settings.files
        return log.overhead > max(f.compact_min_records, f.compact_records_per_row * rows)

    async def compactions_done(self) -> None:
        """Until no background compaction is due or running (callers bound the wait)."""
        await self._compact_idle.wait()

    def _want_compaction(self, session_id: str) -> None:
        self._compact_wanted.add(session_id)
        self._compact_idle.clear()
        self._compact_event.set()

    async def _compact_loop(self) -> None:
        while True:
            await self._compact_event.wait()
            self._compact_event.clear()
            while self._compact_wanted:
                sid = self._compact_wanted.pop()
                st = self._sessions.get(sid)
                if st is None or st.deleted:
                    continue
                try:
                    await self._serialized(st, functools.partial(self._compact, st), rows=False)
                except (NotFound, Unavailable):
                    continue  # deleted meanwhile; or the disk refused (logged), retried when due again
                except Exception:
                    logger.exception("files store: background compaction of session %s failed", sid)
            self._compact_idle.set()

    async def _compact(self, st: SessionState) -> None:
        """Rewrite the session's log compactly, from memory when its rows are held, else from the
        log itself (a log that does not read back clean is left for a load or ``fsck``)."""
        log = self._logs.get(st.id)
        if log is None or not self._compaction_due(log, st.last_sequence):
            return
        if st.resident and not st.shed:
            await self._rewrite(st)
            self.stats.compactions += 1
            return
        self._write_deferred(log)  # rewritten from what the disk holds: all of it

        def from_disk() -> int | None:
            data = log.path.read_bytes()
            if len(data) != log.size:
                return None
            scan = self._scan(data, st.id, read_mark(mark_path(log.path)))
            if scan.st is None or scan.outcome != "ok":
                return None
            return _rewrite_log(scan.st, log.path)

        try:
            size = await asyncio.to_thread(from_disk)
        except OSError as exc:
            raise self._unavailable("rewrite", st.id, exc) from exc
        if size is None:
            return
        log.size = size
        log.overhead = 0
        self._dirty.discard(log.path)
        self._index_dirty.add(st.id)
        self.stats.rewrites += 1
        self.stats.compactions += 1

    # -- listing with a query over sessions not held -------------------------------------------------

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
        """As ``RowStore.list_sessions``; a query over sessions whose rows are not held reads their
        logs (in a worker thread, one at a time, nothing kept)."""
        if not query or offset < 0 or limit < 0:
            return await super().list_sessions(
                caller=caller, offset=offset, limit=limit, profile_id=profile_id, query=query, after=after
            )
        needle = query.lower()
        visible = [
            st
            for st in list(self._sessions.values())
            if not st.deleted and caller.may_read(st.user_id) and (not profile_id or st.profile_id == profile_id)
        ]
        held = {st.id for st in visible if st.resident and not st.shed}  # every row in memory
        hits = {st.id for st in visible if needle in st.name.lower() or (st.id in held and st.matches(needle))}
        on_disk = [st.id for st in visible if st.id not in held and st.id not in hits]
        if on_disk:
            try:
                hits.update(await asyncio.to_thread(self._disk_matches, on_disk, needle))
            except OSError as exc:
                logger.error("files store: cannot read logs to search them: %s", exc)
                raise Unavailable("the session store could not read its logs") from exc
        page, total = _listed_page([st for st in visible if st.id in hits and not st.deleted], after, offset, limit)
        return SessionPage([self._info(st) for st in page], total=total)

    def _disk_matches(self, session_ids: list[str], needle: str) -> set[str]:
        # A cheap test on the log's text first: JSON escapes only quotes, backslashes and control
        # characters (and, for text that is not valid UTF-8, everything beyond ASCII as a \u escape), so
        # unless the needle or the log has those, a needle absent from the log's lowered text is in
        # no row. Otherwise, and for every candidate, the log is replayed and its rows checked.
        plain = not any(c in needle for c in '"\\') and all(c >= " " for c in needle)
        hits: set[str] = set()
        for sid in session_ids:
            path = self._log_path(sid)
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            text = data.decode("utf-8", errors="replace").lower()
            if plain and needle not in text and "\\u" not in text:
                continue
            scan = self._scan(data, sid, read_mark(mark_path(path)))
            if scan.st is not None and scan.st.matches(needle):
                hits.add(sid)
        return hits

    async def maintenance_candidates(self, busy: Collection[str] = ()) -> tuple[list[Candidate], int]:
        """Every session with its bytes on disk (log, mark, history, copies set aside), and the
        bytes no session owns (blobs, calibration), for ``core/maintenance.py``."""
        sessions = [st for st in list(self._sessions.values()) if not st.deleted]

        def sizes() -> tuple[dict[str, int], int]:
            owned: dict[str, int] = {}
            other = 0
            for folder in (self._sessions_dir, self._history_dir):
                with os.scandir(folder) as entries:
                    for entry in entries:
                        sid = entry.name[:36]
                        size = entry.stat().st_size if entry.is_file() else 0
                        if is_session_id(sid):
                            owned[sid] = owned.get(sid, 0) + size
                        else:
                            other += size
            for dirpath, _dirs, names in os.walk(self._blobs_dir):
                other += sum(os.stat(os.path.join(dirpath, n)).st_size for n in names)
            return owned, other + self._calibration.size

        owned, other = await asyncio.to_thread(sizes)
        from contextsvc.core.maintenance import Candidate  # maintenance's model: not needed to start

        epoch = datetime.min.replace(tzinfo=UTC)
        candidates = [
            Candidate(
                session_id=st.id,
                update_time=st.update_time or st.create_time or epoch,
                pinned=st.pinned,
                size_bytes=owned.get(st.id, 0),
                busy=st.id in busy,
                user_id=st.user_id,
            )
            for st in sessions
        ]
        return candidates, other

    async def health_check(self) -> StoreHealth:
        """Can the store write right now (a probe write + fsync in the data directory), and how
        many sessions are damaged (read-only)? Polled by the server for the health service."""
        error = await asyncio.to_thread(self._probe)
        return StoreHealth(writable=error is None, detail=error or "", damaged_sessions=self.damaged_sessions())

    def damaged_sessions(self) -> int:
        """How many sessions are damaged (read-only) now; ``damage_changed`` is set when a session
        is found damaged while serving (read whole on first use, or by a sealed start's check)."""
        return sum(1 for st in list(self._sessions.values()) if st.damage)

    def _probe(self) -> str | None:
        path = self.root / f".probe{_TMP_SUFFIX}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                # About one record: a directory with room for a byte but not a record is full.
                os.write(fd, b"\0" * self.PROBE_BYTES)
                os.fsync(fd)
            finally:
                os.close(fd)
                with contextlib.suppress(OSError):
                    path.unlink()
        except OSError as exc:
            return f"{path.parent}: {exc.strerror or exc}"
        return None

    def _lock_dir(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._dir_lock.acquire()

    async def flush(self) -> None:
        """Write every deferred line (``_defer``), then fsync every log written since its last
        fsync (batch mode's logs; in both modes, the calibration log's deferred observations)."""
        await self._flush_pass(every=True)

    async def _flush_pass(self, *, every: bool) -> None:
        """The flusher's pass: the deferred lines that are due (``every``: all of them), then the
        fsyncs."""
        self._dirty_event.clear()
        if self._unwritten:
            now = time.monotonic()
            for log, due in list(self._unwritten.items()):
                if every or due <= now:
                    self._write_deferred(log)
            if self._unwritten:
                self._dirty_event.set()  # the rest at a later pass
        paths = sorted(self._dirty)
        self._dirty.clear()
        if not paths:
            return
        await asyncio.to_thread(self._disk.sync, paths)
        self.stats.log_fsyncs += len(paths)
        self.stats.batch_flushes += 1

    async def _flush_loop(self) -> None:
        # Sleep only while something is dirty or deferred: an idle store does not wake up.
        while True:
            await self._dirty_event.wait()
            await self._sleep(self._settings.fsync_batch_ms / 1000)
            try:
                await self._flush_pass(every=False)
            except OSError:
                logger.exception("files store: fsync of session logs failed; recent appends may not be durable")

    async def rewrite_log(self, session_id: str) -> None:
        """Rewrite the session's log compactly (atomically: temp file, fsync, rename, dir fsync)."""
        st = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if st is None or st.deleted:
            raise session_not_found(session_id)

        async def work() -> None:
            await self._rewrite(st)

        await self._serialized(st, work)

    # -- hooks -----------------------------------------------------------------------------

    async def _persist_create(self, st: SessionState, history: Sequence[HistoryChunk] = ()) -> None:
        path = self._log_path(st.id)
        # The header and a fork's rows, written whole (``_write_atomic``): a crash leaves the
        # session as a whole or no log at all, never a fork holding part of its rows.
        data = _log_image(st)
        logged = False
        try:
            # A history file nobody owns (its session's log was set aside) must not be adopted.
            await asyncio.to_thread(_remove_logs, self._history_dir, st.id)
            if history:
                # Before the log: a crash in between leaves a history file of no session (never
                # adopted: sessions are found by their logs), never a fork whose demoted rows are
                # unindexed.
                await self._persist_history(st, history)
            await asyncio.to_thread(_create_file, path, data)
            logged = True
            # After the log: a mark file never stands for a session that was not created.
            await asyncio.to_thread(write_mark, mark_path(path), st.last_sequence, _mark_meta(st))
        except (OSError, ContextError) as exc:
            self._forget(st.id)
            if history and not logged:
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(_remove_logs, self._history_dir, st.id)
            if isinstance(exc, FileExistsError):
                raise Conflict("session already exists", metadata={"session_id": st.id}) from None
            if isinstance(exc, OSError):
                raise self._unavailable("create", st.id, exc) from exc
            raise
        self._logs[st.id] = _Log(path, len(data))
        self._index_dirty.add(st.id)
        if st.rows:  # a fork's rows count toward files.cache_mb as appended ones do
            self._count(st)
            self._evict(keep=st.id)

    async def _persist(self, st: SessionState, record: Record) -> None:
        log = self._logs[st.id]
        numbered = isinstance(record, AppendRecord | CompactionRecord) and bool(record.messages)
        n = record.messages[-1].sequence_number if numbered else st.last_sequence  # type: ignore[union-attr]
        try:
            line = _encode(record, n)
            await self._append(
                log,
                _dumps(line),
                # Views, and states the engine may lose (an anchor): written with the next line.
                soft=isinstance(record, SaveViewRecord) or (isinstance(record, StateRecord) and record.soft),
                mark=n if numbered else None,
            )
        except OSError as exc:
            raise self._unavailable("append to", st.id, exc) from exc
        if isinstance(record, FlagsRecord | HeaderRecord | StateRecord | SaveViewRecord):
            log.overhead += 1

    async def _append(self, log: _Log, data: bytes, *, soft: bool = False, mark: int | None = None) -> None:
        """Append one line; fsync it now (fsync mode) or soon (batch mode). ``soft`` lines are
        deferred (``_defer``): written with the log's next line, or by the flusher, and never
        fsynced on their own. ``mark``: the new highest sequence number, recorded in the mark
        file once the line is written."""
        if soft:
            self._defer(log, data, self._settings.files.soft_line_wait_ms / 1000)
            return
        sync = self._settings.durability is Durability.FSYNC
        pending = log.pending
        if pending:
            data = b"".join((*pending, data))
        # Written here: a write into the page cache takes microseconds, less than a hop to a
        # worker thread and back.
        size = _append_at(log.path, log.size, data)
        if pending:
            log.pending = None
            self._unwritten.pop(log, None)
        if sync:
            # Durable by a pass shared with every writer waiting meanwhile (group commit). The
            # new size and the mark only once it is on disk: if the sync fails, the next write
            # cuts the line off, as if never written.
            await self._group.durable(log.path)
            self.stats.log_fsyncs += 1
        else:  # batch mode: the flusher syncs it
            self._dirty.add(log.path)
            self._dirty_event.set()
        log.size = size
        if mark is not None:
            _write_mark(log, mark)

    def _defer(self, log: _Log, data: bytes, wait: float) -> None:
        """Hold ``data`` for the log's next write, or for the flusher's first pass after ``wait``
        seconds: lines no caller waits for (views, anchors, calibration observations) then
        share a write with the line after them instead of costing a write of their own (four
        system calls: open, seek, write, close)."""
        if log.pending is None:
            log.pending = [data]
            self._unwritten[log] = time.monotonic() + wait
        else:
            log.pending.append(data)
        self._dirty_event.set()

    def _write_deferred(self, log: _Log) -> None:
        """Write the log's deferred lines now (before the log is read, or by the flusher). If the
        disk refuses, a session's lines (views, anchors: kept in memory, and nothing acknowledged
        depends on them) are dropped; calibration observations wait for the next pass (the
        calibration log's next rewrite bounds them)."""
        pending, log.pending = log.pending, None
        self._unwritten.pop(log, None)
        if not pending:
            return
        try:
            log.size = _append_at(log.path, log.size, b"".join(pending))
        except OSError as exc:
            if log is self._calibration:
                log.pending = pending
                self._unwritten[log] = 0.0  # at the next pass
                self._disk_errors.write(
                    "files store: cannot write calibration observations yet", lines=len(pending), error=str(exc)
                )
            elif not isinstance(exc, FileNotFoundError):  # not found: its session was deleted meanwhile
                self._disk_errors.write(
                    "files store: deferred lines of a session log not written",
                    lines=len(pending),
                    path=str(log.path),
                    error=str(exc),
                )
            return
        if log is self._calibration:
            self._dirty.add(log.path)  # synced by the flusher's pass that wrote them
        else:  # a session log: its start-up index entry names the log's size
            self._index_dirty.add(log.path.name[: -len(_LOG_SUFFIX)])

    def _drop_deferred(self, log: _Log | None) -> None:
        """Forget the log's deferred lines (it is being rewritten whole from memory, or removed)."""
        if log is not None and log.pending is not None:
            log.pending = None
            self._unwritten.pop(log, None)

    async def _persist_observations(self, batch: Sequence[tuple[str, Observation]]) -> None:
        """One line each for the observations queued meanwhile, deferred (``_defer``) for the
        flusher's next pass, which writes and syncs them together: no baseline waits for the disk,
        in either durability. An observation is one sample among the model's hundreds, not an
        acknowledged mutation, so a crash losing the newest few costs the fit nothing it cannot
        learn again (as the baseline's anchor, a soft line too); waiting for an fsync cost every
        baseline a suspension, a writer task and a share of a sync pass."""
        log = self._calibration
        lines = []
        for model, observation in batch:
            line: dict[str, Any] = {"model": model, "chars": observation.chars, "tokens": observation.tokens}
            if observation.had_images:
                line["had_images"] = True
            if observation.features:
                line["features"] = list(observation.features)
            if observation.residual is not None:
                line["residual"] = observation.residual
            lines.append(_dumps(line))
        data = b"".join(lines)
        self._defer(log, data, 0.0)
        log.overhead += len(batch)
        factor = self._settings.files.calibration_log_factor
        if log.overhead > factor * self.observations_kept * max(1, len(self._observations)):
            kept = {m: list(obs) for m, obs in self._observations.items()}
            for model, observation in batch:
                kept.setdefault(model, []).append(observation)
            self._drop_deferred(log)  # every one of them is in ``kept``
            log.size = await asyncio.to_thread(_rewrite_calibration, log.path, kept, self.observations_kept)
            log.overhead = sum(min(len(v), self.observations_kept) for v in kept.values())
            self._dirty.discard(log.path)

    async def _after_apply(self, st: SessionState) -> None:
        self._index_dirty.add(st.id)
        self._count(st)
        if self._compaction_due(self._logs[st.id], st.last_sequence) and st.id not in self._compact_wanted:
            # In the background: the call that crossed the line does not pay for the rewrite.
            self._want_compaction(st.id)
        self._evict()

    async def _persist_delete(self, st: SessionState) -> None:
        self._drop_deferred(self._logs.get(st.id))
        try:
            # The history first: a crash in between leaves a session without its index, never
            # an index without its session.
            await asyncio.to_thread(_remove_logs, self._history_dir, st.id)
            await asyncio.to_thread(_remove_logs, self._sessions_dir, st.id)
        except OSError as exc:
            raise self._unavailable("delete", st.id, exc) from exc
        for log in (self._logs.pop(st.id, None), self._history_logs.pop(st.id, None)):
            if log is not None:
                self._dirty.discard(log.path)
        self._forget(st.id)
        if self.on_evict is not None:
            self.on_evict(st.id)  # nothing of a deleted session stays in the engine's caches
        self._index_lines.pop(st.id, None)
        self._index_dirty.discard(st.id)
        self._compact_wanted.discard(st.id)
        self._index_stale = True

    async def _load_history(self, st: SessionState) -> RecallIndex:
        def read() -> tuple[RecallIndex, _Log | None]:
            chunks, log = self._read_history(st.id)
            # Read and parsed off the event loop; the chunks' terms wait for the first search.
            return RecallIndex(chunks), log

        try:
            index, log = await asyncio.to_thread(read)
        except OSError as exc:
            raise self._history_unavailable("read", st.id, exc) from exc
        if log is not None:
            self._history_logs[st.id] = log
        self._hold(st.id, sum(_chunk_bytes(c) for c in index.chunks))
        return index

    async def _persist_history(self, st: SessionState, chunks: Sequence[HistoryChunk]) -> None:
        data = b"".join(_dumps(_chunk_to_dict(c)) for c in chunks)
        log = self._history_logs.get(st.id)
        try:
            if log is None:
                path = self._history_path(st.id)
                await asyncio.to_thread(_write_atomic, path, data)
                self._history_logs[st.id] = _Log(path, len(data))
            else:
                await self._append(log, data)
        except OSError as exc:
            raise self._history_unavailable("write", st.id, exc) from exc
        self._hold(st.id, sum(_chunk_bytes(c) for c in chunks))

    async def _rewrite(self, st: SessionState) -> None:
        log = self._logs[st.id]
        self._drop_deferred(log)  # the rewrite writes the state they hold (views, anchor) whole
        try:
            log.size = await asyncio.to_thread(_rewrite_log, st, log.path)
        except OSError as exc:
            raise self._unavailable("rewrite", st.id, exc) from exc
        log.overhead = 0
        self._dirty.discard(log.path)  # the rewrite fsynced everything
        self._index_dirty.add(st.id)
        self.stats.rewrites += 1

    # -- blobs -----------------------------------------------------------------------------

    async def put_blob(self, data: bytes, *, blob_id: str) -> None:
        data = bytes(data)
        try:
            wrote = await asyncio.to_thread(self._put_blob, data, blob_id)
        except OSError as exc:
            self._disk_errors.write("files store: cannot write a blob", blob_id=blob_id, error=str(exc))
            raise Unavailable("the blob could not be stored") from exc
        if wrote:
            self.stats.blob_writes += 1

    async def get_blob(self, blob_id: str) -> bytes | None:
        if not is_blob_id(blob_id):
            return None
        try:
            return await asyncio.to_thread(self._blob_path(blob_id).read_bytes)
        except FileNotFoundError:
            return None

    def _put_blob(self, data: bytes, blob_id: str) -> bool:
        check_blob(data, blob_id)  # hashing off the event loop: a blob may be megabytes
        path = self._blob_path(blob_id)
        if path.exists():
            return False
        if not path.parent.exists():
            path.parent.mkdir(exist_ok=True)
            _fsync_dir(self._blobs_dir)
        _write_atomic(path, data)
        return True

    def _blob_path(self, blob_id: str) -> Path:
        assert is_blob_id(blob_id)  # never build a path from an unchecked id
        return self._blobs_dir / blob_id[:2] / blob_id

    def _log_path(self, session_id: str) -> Path:
        assert is_session_id(session_id)  # never build a path from an unchecked id
        return self._sessions_dir / f"{session_id}{_LOG_SUFFIX}"

    def _history_path(self, session_id: str) -> Path:
        assert is_session_id(session_id)  # never build a path from an unchecked id
        return self._history_dir / f"{session_id}{_LOG_SUFFIX}"

    # -- loading ---------------------------------------------------------------------------

    def _load_all_unswept(self) -> _Loaded:
        """``_load_all`` with the cyclic garbage collector paused: it makes about ten long-lived
        objects per session and frees almost none, so the collections their allocation would
        trigger (each one scanning all made so far) were a quarter of its CPU at 10,000 sessions."""
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._load_all()
        finally:
            if was_enabled:
                gc.enable()

    def _load_all(self) -> _Loaded:
        """Every session as a summary (rows not held): from the start-up index where its entry
        matches the log on disk, else by reading the log whole (recovering it as needed)."""
        preview_chars = self._settings.preview_chars
        if self.read_only:
            if not self._sessions_dir.is_dir():
                return [], {}, _Log(self.root / _CALIBRATION, 0)
            index = read_index(self.root / INDEX_NAME, preview_chars)
        else:
            index = read_index(self.root / INDEX_NAME, preview_chars)
            if index is not None and index.whole and index.current:
                seal = read_seal(self._dir_lock.previous)
                if seal_holds(seal, self.root / INDEX_NAME, self._sessions_dir, len(index)):
                    return self._load_sealed(index)
            folders = (self._sessions_dir, self._blobs_dir, self._history_dir)
            if not all(folder.is_dir() for folder in folders):
                for folder in folders:
                    folder.mkdir(parents=True, exist_ok=True)
                _fsync_dir(self.root)  # the new folders' entries, before any log relies on them
            _remove_temp_files(self.root)
            _remove_temp_files(self._history_dir)  # the sessions folder's: in its one scan below
            for sub in self._blobs_dir.iterdir():
                if sub.is_dir():
                    _remove_temp_files(sub)
        loaded: list[tuple[SessionState, _Log, bytes | None]] = []
        fresh: dict[str, bytes] = {}
        entries = index if index is not None else {}
        hits = 0
        for sid, path, stat in self._session_logs(remove_temp=not self.read_only, known=entries):
            entry = entries.get(sid)
            if entry is not None and stat is not None and entry.key == file_key(stat):
                hits += 1
                st = entry.summary_state()  # straight from the record: no SessionInfo made
                kept = entry.line or encode_entry(entry)
                loaded.append((st, _Log(path, stat.st_size, entry.overhead), kept))
                fresh[sid] = kept
                continue
            self.stats.logs_read_at_open += 1
            result = self._load_one(Path(path))
            if result is None:
                continue
            st, log = result
            if not st.damage:  # damaged sessions (rare) stay whole: their recovery is not redone
                st.evict(preview_chars)  # a summary, like the others: rows are read on first use
            line: bytes | None = None
            if not st.damage and not self.read_only:
                with contextlib.suppress(OSError):
                    now = os.stat(path)
                    if now.st_size == log.size:
                        line = encode_entry(IndexEntry(st.info(preview_chars), file_key(now), log.overhead))
                        fresh[sid] = line
            loaded.append((st, log, line))
        self.stats.index_hits += hits
        if not self.read_only and (
            index is None or not index.current or index.keys() != fresh.keys() or self.stats.logs_read_at_open
        ):
            try:
                _write_atomic(self.root / INDEX_NAME, index_bytes(fresh.values(), preview_chars))
                self.stats.index_writes += 1
            except OSError as exc:
                logger.warning("files store: cannot write the start-up index: %s", exc)
        if self.read_only:
            observations: dict[str, list[Observation]] = {}
            return loaded, observations, _Log(self.root / _CALIBRATION, 0)
        observations, calibration = self._load_calibration()
        return loaded, observations, calibration

    def _load_sealed(self, index: dict[str, IndexEntry]) -> _Loaded:
        """``_load_all`` after a clean stop (``_seal``): every session from its index entry as it
        is, no log looked at; their keys are checked once serving (``_verify_sealed``). A clean
        stop leaves no temp file behind (an atomic write removes its own when it fails)."""
        self.stats.sealed_open = True
        folder = f"{self._sessions_dir}{os.sep}"
        loaded: list[tuple[SessionState, _Log, bytes | None]] = []
        keys: dict[str, FileKey] = {}
        for sid, entry in index.items():
            log = _Log(f"{folder}{sid}{_LOG_SUFFIX}", entry.key[1], entry.overhead)
            loaded.append((entry.summary_state(), log, entry.line or encode_entry(entry)))
            keys[sid] = entry.key
        self.stats.index_hits += len(loaded)
        self._sealed_keys = keys
        observations, calibration = self._load_calibration()
        return loaded, observations, calibration

    async def _verify_sealed(self) -> None:
        """After a sealed open: compare every log's key with its index entry, a slice at a time
        in a worker thread, and read whole (as first use would) each log changed while no server
        ran, so its damage or its real summary shows without waiting for a client to touch it.
        A session read whole since the start (``_ensure_rows``) or checked by ``get_session``
        is no longer in ``_sealed_keys``: nothing to check."""
        keys = self._sealed_keys
        batch = self._settings.files.verify_batch
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._checks_go.wait(), self._settings.files.verify_delay_seconds)
            while keys:
                part = list(itertools.islice(keys, batch))
                now = await asyncio.to_thread(_log_keys, self._sessions_dir, part)
                self.stats.logs_verified += len(part)
                for sid, seen in zip(part, now, strict=True):
                    key = keys.pop(sid, None)
                    if key is not None and seen != key:
                        await self._reread_sealed(sid)
        finally:
            # Stopped before the end (the store closing), the logs left unchecked stay in
            # ``_sealed_keys``: that stop leaves no seal (``_seal``).
            self._verified.set()

    async def get_session(self, session_id: str, *, caller: Principal) -> SessionInfo:
        # The one read answered from the summary alone: check the log first if nothing has yet.
        key = self._sealed_keys.pop(session_id, None)
        if key is not None and _log_keys(self._sessions_dir, [session_id])[0] != key:  # one stat
            await self._reread_sealed(session_id)
        return await super().get_session(session_id, caller=caller)

    async def _reread_sealed(self, session_id: str) -> None:
        st = self._sessions.get(session_id)
        if st is None or st.deleted or st.resident:
            return
        self.stats.logs_changed_after_seal += 1
        logger.info("files store: log of session %s changed since the clean stop; reading it whole", session_id)
        self._index_dirty.add(session_id)

        async def read() -> None:
            if not st.resident:
                await self._read_whole(st, 0)  # as an open without the seal would have read it

        with contextlib.suppress(NotFound, Unavailable):
            await self._serialized(st, read, rows=False)

    def begin_checks(self) -> None:
        """The server serves: a sealed open's background check of the logs may start now (it starts
        ``files.verify_delay_seconds`` after the open anyway)."""
        self._checks_go.set()

    async def startup_verified(self) -> None:
        """Until the background check of a sealed open is done (at once otherwise; callers bound the wait)."""
        self._checks_go.set()
        await self._verified.wait()

    def _session_logs(
        self, *, remove_temp: bool = False, known: Collection[str] = ()
    ) -> list[tuple[str, Path | str, os.stat_result | None]]:
        """(session id, log path, its stat or None) of every log, and of every mark left without
        its log, in one pass over the directory, by session id; ``remove_temp`` (at open, under
        the lock): temp files left by a crash are removed in the same pass. ``known``: ids already
        checked (the start-up index's), whose names need no second look. The three kinds of name
        end differently (``.jsonl``, ``.jsonl.mark``, ``.tmp``), so the order of the tests is
        only the order of their frequency (two names per session: its log and its mark)."""
        logs: dict[str, tuple[str, os.stat_result]] = {}
        marks: list[str] = []
        cut = len(_LOG_SUFFIX)
        mark_suffix = _LOG_SUFFIX + _MARK_SUFFIX
        mark_cut = len(mark_suffix)
        with os.scandir(self._sessions_dir) as entries:
            for entry in entries:
                name = entry.name
                if name.endswith(_LOG_SUFFIX):
                    sid = name[:-cut]
                    if sid not in known and not is_session_id(sid):
                        logger.warning("files store: ignoring %s: not named <session-uuid>%s", entry.path, _LOG_SUFFIX)
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        logs[sid] = (entry.path, entry.stat())
                elif name.endswith(mark_suffix):
                    marks.append(name[:-mark_cut])  # checked below, if it has no log
                elif remove_temp and name.startswith(".") and name.endswith(_TMP_SUFFIX):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        out: list[tuple[str, Path | str, os.stat_result | None]] = [(sid, *logs[sid]) for sid in sorted(logs)]
        orphans = sorted(sid for sid in marks if sid not in logs and is_session_id(sid))
        if orphans:
            out.extend((sid, self._log_path(sid), None) for sid in orphans)
            out.sort(key=lambda item: item[0])
        return out

    def _session_files(self) -> list[tuple[str, Path, bool]]:
        """(session id, log path, log exists) of every log and of every mark left without its log."""
        found: dict[str, tuple[str, Path, bool]] = {}
        for path in sorted(self._sessions_dir.glob(f"*{_LOG_SUFFIX}")):
            sid = path.name[: -len(_LOG_SUFFIX)]
            if is_session_id(sid):
                found[sid] = (sid, path, True)
        for mark_file in sorted(self._sessions_dir.glob(f"*{_LOG_SUFFIX}.mark")):
            path = mark_file.with_name(mark_file.name[: -len(".mark")])
            sid = path.name[: -len(_LOG_SUFFIX)]
            if is_session_id(sid) and sid not in found:
                found[sid] = (sid, path, False)
        return [found[k] for k in sorted(found)]

    def fsck(self, *, repair: bool) -> list[FsckEntry]:
        """Check every session log (blocking; takes the directory lock, so no server may run).

        Without ``repair`` nothing is written. With it: a torn or recovered log is rewritten
        without its bad lines (the original set aside), a damaged session is rewritten with its
        stand-ins made permanent and its header rebuilt, and made writable again (the loss is
        accepted: the lost numbers stay taken), a log with nothing to rebuild from is moved aside.
        """
        self._lock_dir()
        try:
            if not self._sessions_dir.is_dir():
                return []
            entries = []
            for sid, path, exists in self._session_files():
                mark = read_mark(mark_path(path))
                try:
                    data = path.read_bytes() if exists else b""
                except OSError as exc:
                    # A directory where the log should be, a file it may not read: reported as
                    # this session's, and the others checked (it stopped the whole run, in
                    # Python's words). Not repaired: what is there is not a log to rewrite.
                    why = (
                        "is a directory where a file is expected"
                        if isinstance(exc, IsADirectoryError)
                        else f"cannot be read: {exc.strerror or exc}"
                    )
                    detail = f"{path.name} {why}" + ("; not repaired: move it away by hand" if repair else "")
                    entries.append(FsckEntry(sid, "unreadable", detail))
                    continue
                scan = self._scan(data, sid, mark)
                outcome = "unreadable" if scan.st is None else scan.outcome
                if not exists and scan.st is not None:
                    outcome = "damaged"
                entry = FsckEntry(sid, outcome, scan.describe() if scan.st is not None else "no readable record")
                if not exists:
                    entry.detail = f"log missing; {entry.detail}"
                if repair and outcome != "ok":
                    entry.repaired = self._repair(path, scan, mark)
                entries.append(entry)
            return entries
        finally:
            self._dir_lock.release()

    def _repair(self, path: Path, scan: LogScan, mark: tuple[int, dict[str, Any]] | None) -> str:
        st = scan.st
        if st is None and not path.exists():
            # Only a mark file, holding nothing to rebuild from: the mark goes aside (setting the
            # missing log aside stopped the whole run with "[Errno 2] No such file or directory").
            aside = self._set_aside(mark_path(path), "corrupt", copy=False)
            return f"no log and an unusable mark file: mark moved aside to {aside.name}"
        if st is None:
            aside = self._set_aside(path, "corrupt", copy=False)
            return f"moved aside to {aside.name}"
        kept = f"original kept as {self._set_aside(path, 'corrupt', copy=True).name}; " if path.exists() else ""
        was_damaged = bool(st.damage)
        st.damage = ""
        _rewrite_log(st, path)
        if mark is None or mark[0] < st.last_sequence or not mark[1]:
            self._save_mark(path, st)
        if was_damaged:
            return f"{kept}rewritten; writable again ({st.last_sequence} sequence numbers kept, lost ones stay taken)"
        return f"{kept}rewritten without the bad lines"

    def _load_calibration(self) -> tuple[dict[str, list[Observation]], _Log]:
        path = self.root / _CALIBRATION
        if not path.exists():
            try:
                path.touch()
                _fsync_dir(self.root)
            except OSError as exc:  # a read-only directory: no observations yet, writes will fail
                logger.error("files store: cannot create %s: %s", path, exc)
                return {}, _Log(path, 0)
        lines = path.read_bytes().split(b"\n")
        tail = lines.pop()
        observations: dict[str, list[Observation]] = {}
        bad = 0
        for raw in lines:
            try:
                d = _loads(raw)
                obs = Observation(
                    int(d["chars"]),
                    int(d["tokens"]),
                    bool(d.get("had_images", False)),
                    current_features(d.get("features", ())),  # an older feature set: mapped or dropped
                    None if d.get("residual") is None else float(d["residual"]),
                )
                observations.setdefault(str(d["model"]), []).append(obs)
            except (ValueError, KeyError, TypeError, AttributeError):
                bad += 1
        if not bad and not tail:
            return observations, _Log(path, path.stat().st_size, len(lines))
        # Observations only tune estimates: keep what is readable and go on, original kept aside.
        aside = self._set_aside(path, "torn" if not bad else "corrupt", copy=True)
        logger.warning(
            "files store: %d unreadable calibration line(s) skipped; original kept at %s", bad + bool(tail), aside
        )
        size = _rewrite_calibration(path, observations, self.observations_kept)
        return observations, _Log(path, size, sum(len(v) for v in observations.values()))

    def _load_log(self, path: Path) -> tuple[SessionState, _Log] | None:
        session_id = path.name[: -len(_LOG_SUFFIX)]
        mark = read_mark(mark_path(path))
        scan = self._scan(path.read_bytes(), session_id, mark)
        return self._adopt(path, scan, mark)

    def _load_orphan_mark(self, mark_file: Path) -> tuple[SessionState, _Log] | None:
        """A mark without its log: the log was lost; the session comes back damaged, every
        acknowledged number kept (see ``scan_log``)."""
        path = mark_file.with_name(mark_file.name[: -len(".mark")])
        mark = read_mark(mark_file)
        scan = self._scan(b"", path.name[: -len(_LOG_SUFFIX)], mark)
        if scan.st is None:
            return None
        return self._adopt(path, scan, mark)

    def _adopt(
        self, path: Path, scan: LogScan, mark: tuple[int, dict[str, Any]] | None
    ) -> tuple[SessionState, _Log] | None:
        """Act on a scan: keep a clean log, rewrite a recovered one (original set aside)."""
        session_id = path.name[: -len(_LOG_SUFFIX)]
        st = scan.st
        if st is None:
            aside = self._set_aside(path, "corrupt", copy=False)
            logger.error(
                "files store: session %s not loaded: its log has no readable record and no mark; moved to %s",
                session_id,
                aside,
            )
            return None
        if scan.outcome == "ok":
            if mark is None or mark[0] < st.last_sequence:
                self._save_mark(path, st)  # a log written before marks existed
            return st, _Log(path, path.stat().st_size, scan.overhead)
        # An interrupted write, or the loss batch durability allows: nothing is read-only after either.
        expected = not st.damage and scan.unsynced == len(scan.lost) and (scan.torn_tail or not scan.bad)
        problem = "torn" if expected else "corrupt"
        try:
            kept: Path | str = self._set_aside(path, problem, copy=True) if path.exists() else "nowhere (no log left)"
        except OSError as exc:  # a read-only or full directory: serve what loaded, write nothing
            st.damage = st.damage or f"the damaged log could not be set aside ({exc.strerror})"
            logger.error("files store: session %s is read-only: %s; %s", session_id, scan.describe(), st.damage)
            return st, _Log(path, path.stat().st_size if path.exists() else 0, scan.overhead)
        self.stats.recovered_logs += 1
        level = logging.WARNING if expected else logging.ERROR
        logger.log(
            level,
            "files store: session %s %s: %s; original kept at %s",
            session_id,
            scan.outcome,
            scan.describe(),
            kept,
        )
        try:
            size = _rewrite_log(st, path)
        except OSError as exc:
            # The bad lines stay in the log: nothing may be appended behind them.
            st.damage = st.damage or f"the recovered log could not be rewritten ({exc.strerror})"
            logger.error("files store: session %s is read-only: %s", session_id, st.damage)
            return st, _Log(path, path.stat().st_size if path.exists() else 0, scan.overhead)
        self.stats.rewrites += 1
        if mark is None or mark[0] < st.last_sequence or not mark[1]:
            self._save_mark(path, st)
        return st, _Log(path, size)

    def _save_mark(self, path: Path, st: SessionState) -> None:
        try:
            write_mark(mark_path(path), st.last_sequence, _mark_meta(st))
        except OSError as exc:
            logger.warning("files store: cannot write the sequence mark of session %s: %s", st.id, exc)

    def _read_history(self, session_id: str) -> tuple[list[HistoryChunk], _Log | None]:
        """The session's chunks and its history file (None: no file yet); recovers a damaged file."""
        path = self._history_path(session_id)
        try:
            lines = path.read_bytes().split(b"\n")
        except FileNotFoundError:
            return [], None
        tail = lines.pop()  # b"" when the file ends with a newline
        chunks: list[HistoryChunk] = []
        bad: list[int] = []
        for index, raw in enumerate(lines):
            try:
                chunks.append(_chunk_from_dict(_loads(raw)))
            except (ValueError, KeyError, TypeError, AttributeError):
                bad.append(index + 1)
        if tail:
            bad.append(len(lines) + 1)
        if not bad:
            return chunks, _Log(path, path.stat().st_size)
        # Only the last line bad: an interrupted write. Anything else: corruption.
        problem = "torn" if bad == [len(lines) + 1] or (bad == [len(lines)] and not tail) else "corrupt"
        aside = self._set_aside(path, problem, copy=True)
        self.stats.recovered_histories += 1
        level = logging.WARNING if problem == "torn" else logging.ERROR
        logger.log(
            level,
            "files store: session %s: %d %s line(s) of the history index dropped (first: line %d); original kept at %s",
            session_id,
            len(bad),
            problem,
            bad[0],
            aside,
        )
        data = b"".join(_dumps(_chunk_to_dict(c)) for c in chunks)
        _write_atomic(path, data)
        return chunks, _Log(path, len(data))

    def _set_aside(self, path: Path, problem: str, *, copy: bool) -> Path:
        stamp = self._now().strftime("%Y%m%dT%H%M%S%fZ")
        aside = path.with_name(f"{path.name}.{problem}-{stamp}")
        if copy:
            shutil.copyfile(path, aside)
        else:
            os.replace(path, aside)
        _fsync_dir(path.parent)
        return aside

    def _history_unavailable(self, action: str, session_id: str, exc: OSError) -> Unavailable:
        # The caller (compression, SearchHistory) treats this as "no index now"; the session is intact.
        self._disk_errors.write(
            f"files store: cannot {action} the history index of a session",
            session_id=session_id,
            error=str(exc),
        )
        return Unavailable("the raw history index could not be read or written", metadata={"session_id": session_id})

    def _unavailable(self, action: str, session_id: str, exc: OSError) -> Unavailable:
        self._disk_errors.write(
            f"files store: cannot {action} the log of a session", session_id=session_id, error=str(exc)
        )
        return Unavailable("the session store could not write to disk", metadata={"session_id": session_id})


# -- blocking file operations (run in a worker thread) --------------------------------------


def _append_at(path: Path, expected_size: int, data: bytes) -> int:
    """Write ``data`` at the log's known end and return the new size (not synced: the caller
    syncs, ``_disk_sync``).

    Writing at the known end (not O_APPEND) and cutting anything past it first means a record
    whose write failed half-way (disk full), or whose sync failed, never ends up in the middle of
    the log.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)  # the file's size, without building a stat result
        if size < expected_size:
            raise OSError(f"{path} is shorter than the store wrote ({size} < {expected_size} bytes)")
        if size > expected_size:
            os.ftruncate(fd, expected_size)
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], expected_size + done)
    finally:
        os.close(fd)
    return expected_size + len(data)


def _write_mark(log: _Log, n: int) -> None:
    """Record ``n``, the log's new highest sequence number, in its mark file (once the record
    holding it is written and, in fsync mode, durable: the mark claims it was acknowledged)."""
    try:
        write_mark_number(log.mark, n)
    except OSError as exc:
        # The record is in the log: the mark only guards against later damage to it.
        logger.warning("files store: cannot update the sequence mark of %s: %s", log.path, exc)


def _write_atomic(path: Path, data: bytes) -> None:
    """Temp file, flush, fsync, ``os.replace``, fsync of the directory: all or nothing."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{_TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _create_file(path: Path, data: bytes) -> None:
    if path.exists():
        raise FileExistsError(path)
    _write_atomic(path, data)


def _mark_meta(st: SessionState) -> dict[str, Any]:
    """The header fields that never change, kept in the mark file to rebuild a lost header."""
    return {
        "id": st.id,
        "user_id": st.user_id,
        "profile_id": st.profile_id,
        "create_time": _time(st.create_time),
    }


def _log_image(st: SessionState) -> bytes:
    """A log holding ``st`` as it is in memory: its header, then a line per row."""
    parts = [_dumps(_session_line(st))]
    parts.extend(
        _dumps({"t": "append", "messages": [message_to_dict(row, raw_time=True)], "n": row.sequence_number})
        for row in st.rows
    )
    return b"".join(parts)


def _rewrite_log(st: SessionState, path: Path) -> int:
    if st.shed:  # never reached: a log is rewritten from memory only when every row is held
        raise RuntimeError(f"session {st.id} let rows go; its log cannot be rewritten from memory")
    data = _log_image(st)
    _write_atomic(path, data)
    return len(data)


def _rewrite_calibration(path: Path, observations: dict[str, list[Observation]], keep: int) -> int:
    lines = []
    for model, kept in observations.items():
        for obs in kept[-keep:]:
            line: dict[str, Any] = {"model": model, "chars": obs.chars, "tokens": obs.tokens}
            if obs.features:
                line["features"] = list(obs.features)
            if obs.residual is not None:
                line["residual"] = obs.residual
            if obs.had_images:
                line["had_images"] = True
            lines.append(_dumps(line))
    data = b"".join(lines)
    _write_atomic(path, data)
    return len(data)


def _remove_logs(folder: Path, session_id: str) -> None:
    """Remove a session's file in ``folder`` and the copies set aside; durable once it returns."""
    log = folder / f"{session_id}{_LOG_SUFFIX}"
    # The mark first: a mark left without its log would bring the session back as damaged.
    paths = [mark_path(log), log, *folder.glob(f"{session_id}{_LOG_SUFFIX}.*")]
    removed = False
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed = True
    if removed:  # nothing removed, nothing to make durable (a new session has no old files)
        _fsync_dir(folder)


def _log_keys(folder: Path, session_ids: list[str]) -> list[FileKey | None]:
    keys: list[FileKey | None] = []
    for sid in session_ids:
        try:
            keys.append(file_key(os.stat(folder / f"{sid}{_LOG_SUFFIX}")))
        except OSError:
            keys.append(None)
    return keys


def _remove_temp_files(folder: Path) -> None:
    # Left by a crash during an atomic write; the target was never replaced. A read-only
    # directory keeps them (harmless: nothing reads them).
    for path in folder.glob(f".*{_TMP_SUFFIX}"):
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
