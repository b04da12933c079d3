"""The ``SessionStore`` methods over sessions held in memory, shared by the memory and files stores.

Subclasses make it durable through hooks (``_persist_create``, ``_persist``, ``_persist_delete``,
``_after_apply``, ``_persist_observations``, ``_load_history``, ``_persist_history``) and provide
the blob methods. Every mutation runs under the session's lock inside a shielded task: a caller
cancelled half-way (a client deadline) can neither split a record between disk and memory nor
let the next mutation overtake it. The raw history index of each session is a ``RecallIndex``
(``core/recall.py``) in ``_history``, ranked in process.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import hashlib
import logging
import re
import types
import uuid
from collections.abc import Awaitable, Callable, Collection, Coroutine, Generator, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar, cast

from contextsvc.clock import SYSTEM_CLOCK
from contextsvc.config import Settings
from contextsvc.core.calibration import Observation
from contextsvc.core.codec import copy_plain
from contextsvc.core.messages import BufferKind, Message
from contextsvc.core.recall import RecallIndex
from contextsvc.core.session import (
    AppendResult,
    ListPosition,
    Principal,
    SessionInfo,
    SessionPage,
    is_session_id,
    listing_key,
)
from contextsvc.errors import Conflict, InvalidArgument, NotFound, RequestIdReused, SessionDamaged
from contextsvc.ports import Clock, HistoryChunk, InitialContent, ScoredChunk, SessionProfileChanged, ViewRecord
from contextsvc.stores._session import (
    AppendRecord,
    CompactionRecord,
    FlagsRecord,
    HeaderRecord,
    Record,
    RowsShed,
    SaveViewRecord,
    SessionState,
    StateRecord,
    utc,
)

if TYPE_CHECKING:
    from contextsvc.core.maintenance import Candidate

T = TypeVar("T")

logger = logging.getLogger(__name__)

_BLOB_ID = re.compile(r"[0-9a-f]{64}")


def is_blob_id(value: object) -> bool:
    """A lowercase hex SHA-256."""
    return isinstance(value, str) and _BLOB_ID.fullmatch(value) is not None


def check_blob(data: bytes, blob_id: str) -> None:
    """Blobs are content-addressed: ``blob_id`` must be the SHA-256 of ``data``."""
    if not is_blob_id(blob_id):
        raise InvalidArgument.field("blob_id", "must be the lowercase hex SHA-256 of the bytes")
    if hashlib.sha256(data).hexdigest() != blob_id:
        raise InvalidArgument.field("blob_id", "does not match the SHA-256 of the bytes")


def session_not_found(session_id: str) -> NotFound:
    # Same answer for unknown and foreign sessions: never reveal that another user's exists.
    return NotFound("session not found", metadata={"session_id": str(session_id)[:64]})


def session_damaged(st: SessionState) -> SessionDamaged:
    return SessionDamaged(
        "the session's stored history is damaged; it is read-only until repaired (contextsvc fsck --repair)",
        metadata={"session_id": st.id, "damage": st.damage[:200]},
    )


def compaction_conflict(session_id: str, sequence_number: int) -> Conflict:
    """A compaction demotes a row that is no longer in the context: another one committed first."""
    return Conflict(
        f"message #{sequence_number} is no longer in the context: another compaction committed first",
        reason="COMPACTION_CONFLICT",
        metadata={"session_id": session_id, "sequence_number": str(sequence_number)},
    )


def context_bound(before_sequence: int, before_position: tuple[int, int] | None) -> tuple[int, int] | None:
    """The context-order key a context page ends before (None = the end of the buffer):
    ``before_position`` when given, else the position of message ``before_sequence`` — every row
    placed before it, a summary included when it stands for older rows."""
    if before_position is not None:
        anchor, sequence = before_position
        if anchor < 0 or sequence < 0:
            raise InvalidArgument.field("before_position", "must not be negative")
        return (anchor, sequence)
    return (before_sequence, 0) if before_sequence > 0 else None


def _list_key(st: SessionState) -> tuple[bool, int, str]:
    return listing_key(st.pinned, st.update_time, st.id)


def _listed_page(
    found: list[SessionState], after: ListPosition | None, offset: int, limit: int
) -> tuple[list[SessionState], int]:
    """The page of ``found`` (unsorted) that starts after ``after`` then skips ``offset``, and the
    total."""
    found.sort(key=_list_key)
    start = bisect.bisect_right(found, after.key(), key=_list_key) if after is not None else 0
    return found[start + offset : start + offset + limit], len(found)


class RowStore:
    """Sessions in a dict of ``SessionState``; mutations build a record, persist it, apply it."""

    def compaction_lock(self, session_id: str) -> contextlib.AbstractAsyncContextManager[None]:
        """A no-op: one process owns a memory or files store, and the engine serializes
        compactions within the process."""
        return contextlib.nullcontext()

    def pinned_lock(self, session_id: str) -> contextlib.AbstractAsyncContextManager[None]:
        """A no-op, as ``compaction_lock``: the engine serializes pinned appends within the process."""
        return contextlib.nullcontext()

    def __init__(
        self,
        settings: Settings | None,
        clock: Clock | None,
        sessions: dict[str, SessionState],
        observations: dict[str, list[Observation]],
        history: dict[str, RecallIndex] | None = None,
    ) -> None:
        self._settings = settings if settings is not None else Settings()
        self._clock: Clock = clock if clock is not None else SYSTEM_CLOCK
        self._sessions = sessions
        #: model -> its newest observations, oldest first.
        self._observations = observations
        #: session id -> its raw history index (all of it, or the sessions loaded so far).
        self._history = history if history is not None else {}
        self._create_lock = asyncio.Lock()
        #: calibration observations waiting for the writer (``add_calibration_observation``).
        self._observations_queued: list[tuple[str, Observation, asyncio.Future[None]]] = []
        self._observations_writer: asyncio.Future[None] | None = None
        self._inflight: set[asyncio.Future[Any]] = set()

    # -- hooks -----------------------------------------------------------------------------

    async def _persist_create(self, st: SessionState, history: Sequence[HistoryChunk] = ()) -> None:
        """Make a new session durable as ``st`` holds it (empty, or a fork's rows and state), with
        its first ``history`` chunks, in one step: after a crash it exists whole or not at all."""

    async def _persist(self, st: SessionState, record: Record) -> None:
        """Make ``record`` durable before it is applied to memory."""

    async def _persist_delete(self, st: SessionState) -> None:
        """Remove what ``_persist_create`` and ``_persist`` wrote."""

    async def _after_apply(self, st: SessionState) -> None:
        """Housekeeping after a mutation, still under the session lock."""

    async def _persist_observations(self, batch: Sequence[tuple[str, Observation]]) -> None:
        """Persist calibration observations (model, observation), in order, before they are kept
        in memory: one write for the whole batch (the files store defers it to its flusher)."""

    async def _load_history(self, st: SessionState) -> RecallIndex:
        """The session's history index when it is not in ``_history`` yet (under the session lock)."""
        return RecallIndex()

    async def _persist_history(self, st: SessionState, chunks: Sequence[HistoryChunk]) -> None:
        """Make new history chunks durable before they are indexed in memory."""

    async def _ensure_rows(self, st: SessionState, *, whole: bool = True) -> None:
        """Make ``st`` hold its rows (under the session lock). The memory store always does; the
        files store loads a session known by its summary only (``SessionState.resident``), and,
        with ``whole``, one that let rows outside its context go (``SessionState.shed_rows``)."""

    def _touch(self, st: SessionState) -> None:
        """A resident session was used (the files store keeps its least recently used order)."""

    @property
    def observations_kept(self) -> int:
        """Observations kept per model: a few fitting windows, so history beyond the fit stays bounded."""
        return 4 * self._settings.tokens.calibration_window

    # -- helpers ---------------------------------------------------------------------------

    def _now(self) -> datetime:
        return utc(self._clock.now())

    def _info(self, st: SessionState) -> SessionInfo:
        return st.info(self._settings.preview_chars)

    def _owned(self, session_id: str, caller: Principal) -> SessionState:
        st = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if st is None or st.deleted or not caller.may_read(st.user_id):
            raise session_not_found(session_id)
        return st

    async def _shielded(self, work: Callable[[], Awaitable[T]]) -> T:
        """``work()``, which a caller that goes away does not interrupt. It starts at once, in the
        caller's step: a mutation that completes without suspending (the memory store's, a
        resident session's) costs no task; one that suspends goes on in a task of its own, which
        the caller awaits through a shield, and which ``_drain`` waits for."""
        rest, value = _begun(work())
        if rest is None:
            return cast(T, value)
        return await self._in_task(rest)

    async def _in_task(self, coro: Coroutine[Any, Any, T]) -> T:
        task = asyncio.ensure_future(coro)
        self._inflight.add(task)
        task.add_done_callback(_settle)
        task.add_done_callback(self._inflight.discard)
        return await asyncio.shield(task)

    async def _serialized(
        self, st: SessionState, work: Callable[[], Awaitable[T]], *, rows: bool = True, whole: bool = True
    ) -> T:
        """``work()`` under the session lock, with its rows held (``rows``); ``whole`` False when
        ``work`` reads no row outside the context (a turn's calls: appends, state, views)."""

        async def locked() -> T:
            async with st.lock:
                if st.deleted:
                    raise session_not_found(st.id)
                if rows:
                    await self._ensure_rows(st, whole=whole)
                return await work()

        return await self._shielded(locked)

    async def _commit(self, st: SessionState, record: Record) -> None:
        if st.damage and isinstance(record, AppendRecord | CompactionRecord | FlagsRecord | HeaderRecord):
            # Engine bookkeeping (state, views) goes on, so reads and BuildContext still work.
            raise session_damaged(st)
        await self._persist(st, record)
        st.apply(record)
        await self._after_apply(st)

    async def _read(self, st: SessionState, read: Callable[[SessionState], T]) -> T:
        """``read(st)`` over the session's rows: at once when they are in memory, else under the
        session lock once ``_ensure_rows`` loaded them whole (so they cannot be evicted meanwhile).
        A read that reaches a row let go (``RowsShed``) is also made again that way."""
        if st.resident:
            self._touch(st)
            try:
                return read(st)
            except RowsShed:
                pass

        async def work() -> T:
            return read(st)

        return await self._serialized(st, work)

    async def _drain(self) -> None:
        """Wait for mutations still running for callers that went away."""
        while self._inflight:
            await asyncio.wait(list(self._inflight))

    # -- sessions --------------------------------------------------------------------------

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
        st = SessionState(
            SessionInfo(
                id=sid,
                user_id=caller.user_id,
                profile_id=profile_id,
                name=name,
                metadata=copy_plain(dict(metadata or {})),
                create_time=now,
                update_time=now,
            )
        )

        history = RecallIndex()
        chunks: list[HistoryChunk] = []
        if initial is not None:
            # Applied to the state before anything is written: the new session is written whole.
            if initial.messages:
                rows = st.number(initial.messages, now)  # numbered from 1, flags as given
                st.apply(AppendRecord(now, rows, "", initial.context_tokens, ""))
            if initial.state is not None:
                st.apply(StateRecord(now, None, None, copy_plain(dict(initial.state))))
            chunks = history.fresh([_normalized(c) for c in initial.history])

        async def work() -> SessionInfo:
            async with self._create_lock:
                if sid in self._sessions:
                    raise Conflict("session already exists", metadata={"session_id": sid})
                await self._persist_create(st, chunks)
                self._sessions[sid] = st
                if chunks:
                    history.add(chunks)
                    self._history[sid] = history
            return self._info(st)

        return await self._shielded(work)

    async def get_session(self, session_id: str, *, caller: Principal) -> SessionInfo:
        return self._info(self._owned(session_id, caller))

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
        if offset < 0:
            raise InvalidArgument.field("offset", "must not be negative")
        if limit < 0:
            raise InvalidArgument.field("limit", "must not be negative")
        needle = query.lower()
        visible = [
            st
            for st in list(self._sessions.values())
            if not st.deleted
            and caller.may_read(st.user_id)
            and (not profile_id or st.profile_id == profile_id)
            and (not needle or st.matches(needle))
        ]
        page, total = _listed_page(visible, after, offset, limit)
        return SessionPage([self._info(st) for st in page], total=total)

    async def update_session(
        self,
        session_id: str,
        *,
        caller: Principal,
        name: str | None = None,
        pinned: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SessionInfo:
        st = self._owned(session_id, caller)
        if name is None and pinned is None and metadata is None:
            return self._info(st)

        async def work() -> SessionInfo:
            meta = copy_plain(dict(metadata)) if metadata is not None else None
            await self._commit(st, HeaderRecord(self._now(), name=name, pinned=pinned, metadata=meta))
            return self._info(st)

        return await self._serialized(st, work, whole=False)

    async def delete_session(self, session_id: str, *, caller: Principal) -> None:
        st = self._owned(session_id, caller)

        async def work() -> None:
            await self._persist_delete(st)
            st.deleted = True
            self._sessions.pop(st.id, None)
            self._history.pop(st.id, None)

        await self._serialized(st, work, rows=False)

    async def maintenance_candidates(self, busy: Collection[str] = ()) -> tuple[list[Candidate], int]:
        """Every session with the characters of its rows as its size (the files store counts its
        bytes on disk instead), for store maintenance (``core/maintenance.py``)."""
        from contextsvc.core.maintenance import Candidate  # maintenance's model: not needed to start

        epoch = datetime.min.replace(tzinfo=UTC)
        return [
            Candidate(
                session_id=st.id,
                update_time=st.update_time or st.create_time or epoch,
                pinned=st.pinned,
                size_bytes=sum(len(m.content) for m in st.rows),
                busy=st.id in busy,
                user_id=st.user_id,
            )
            for st in list(self._sessions.values())
            if not st.deleted
        ], 0

    # -- rows ------------------------------------------------------------------------------

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
    ) -> AppendResult:
        st = self._owned(session_id, caller)
        if expected_profile_id is not None and st.profile_id != expected_profile_id:
            raise SessionProfileChanged(session_id)

        async def work() -> AppendResult:
            replay = self._replay(st, request_id, request_fingerprint)
            if replay is not None:
                return replay
            now = self._now()
            fingerprint = request_fingerprint if request_id else ""
            record = AppendRecord(now, st.number(messages, now), request_id, context_tokens_delta, fingerprint)
            await self._commit(st, record)
            return AppendResult([m.sequence_number for m in record.messages], self._info(st))

        return await self._serialized(st, work, whole=False)

    async def replayed_append(
        self, session_id: str, request_id: str, *, caller: Principal, request_fingerprint: str = ""
    ) -> AppendResult | None:
        st = self._owned(session_id, caller)

        async def work() -> AppendResult | None:  # as the append's (a session let go is read again)
            return self._replay(st, request_id, request_fingerprint)

        return await self._serialized(st, work, whole=False)

    def _replay(self, st: SessionState, request_id: str, request_fingerprint: str) -> AppendResult | None:
        """The first call's answer to a repeat of ``request_id`` (``append_messages``), or None."""
        first = st.requests.get(request_id) if request_id else None
        if first is None:
            return None
        stored = st.request_fingerprints.get(request_id, "")
        if stored and request_fingerprint and stored != request_fingerprint:
            raise RequestIdReused(request_id)
        tokens = st.request_tokens.get(request_id)
        return AppendResult(list(first), self._info(st), replayed=True, first_context_tokens=tokens)

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
        st = self._owned(session_id, caller)
        if before_sequence < 0:
            raise InvalidArgument.field("before_sequence", "must not be negative")
        if limit < 0:
            raise InvalidArgument.field("limit", "must not be negative")
        if BufferKind(buffer) is BufferKind.CONTEXT:
            bound = context_bound(before_sequence, before_position)
            return await self._read(st, lambda s: s.context_page(bound, limit))
        return await self._read(st, lambda s: s.display_page(before_sequence, limit))

    async def load_context(self, session_id: str, *, caller: Principal) -> list[Message]:
        return await self._read(self._owned(session_id, caller), SessionState.context)

    async def context_and_session(self, session_id: str, *, caller: Principal) -> tuple[SessionInfo, list[Message]]:
        # One read of the held state: nothing runs between taking the two.
        return await self._read(self._owned(session_id, caller), lambda s: (self._info(s), s.context()))

    def context_as_read(self, session: SessionInfo) -> list[Message] | None:
        # The held state is read without a statement: ``context_and_session`` costs no round trip.
        del session
        return None

    async def get_messages(self, session_id: str, *, caller: Principal, first: int, last: int) -> list[Message]:
        return await self._read(self._owned(session_id, caller), lambda s: s.span(first, last))

    async def set_context_flags(
        self, session_id: str, sequence_numbers: Sequence[int], *, caller: Principal, is_context: bool
    ) -> None:
        st = self._owned(session_id, caller)
        wanted = tuple(sorted(set(sequence_numbers)))

        async def work() -> None:
            _check_rows(st, wanted)
            await self._commit(st, FlagsRecord(self._now(), wanted, is_context))

        await self._serialized(st, work)

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
        st = self._owned(session_id, caller)
        if context_tokens is None and context_truncated is None and state is None:
            return self._info(st)

        async def work() -> SessionInfo:
            new_state = copy_plain(dict(state)) if state is not None else None
            tokens = context_tokens
            if tokens is not None and context_tokens_as_of is not None:
                tokens += st.context_tokens - context_tokens_as_of  # what appends added since
            record = StateRecord(self._now(), tokens, context_truncated, new_state, soft=not durable)
            await self._commit(st, record)
            return self._info(st)

        return await self._serialized(st, work, whole=False)

    async def update_state_if_unchanged(
        self,
        session_id: str,
        *,
        caller: Principal,
        read: SessionInfo,
        context_tokens: int,
        state: Mapping[str, Any],
    ) -> SessionInfo | None:
        # The compaction lock of these stores is the engine's in-process one: the engine holds it.
        st = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if st is None or st.deleted or not caller.allowed(st.user_id):
            return None

        async def work() -> SessionInfo | None:
            if st.create_time != read.create_time or st.last_sequence != read.last_sequence or st.state != read.state:
                return None
            record = StateRecord(self._now(), context_tokens, False, copy_plain(dict(state)), soft=True)
            await self._commit(st, record)
            caller.may_read(st.user_id)  # an admin's write is audited once written, as PostgreSQL's
            return self._info(st)

        try:
            return await self._serialized(st, work, whole=False)
        except NotFound:  # deleted while it waited
            return None

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
        st = self._owned(session_id, caller)
        demoted = tuple(sorted(set(demote)))
        chunks = [_normalized(c) for c in history]

        async def work() -> list[int]:
            _check_rows(st, demoted)
            _check_in_context(st, demoted)
            if chunks and not st.damage:  # a damaged session refuses the commit below
                # Durable before the compaction's record: a crash in between leaves chunks of
                # rows still in the context (recall skips those), never demoted rows unindexed.
                await self._index_before_commit(st, chunks)
            now = self._now()
            new_state = copy_plain(dict(state)) if state is not None else None
            tokens = context_tokens
            if context_tokens_as_of is not None:
                tokens += st.context_tokens - context_tokens_as_of  # what appends added since
            record = CompactionRecord(now, demoted, st.number(append, now), tokens, new_state)
            await self._commit(st, record)
            return [m.sequence_number for m in record.messages]

        return await self._serialized(st, work, whole=False)

    # -- calibration and views (TokenStore) --------------------------------------------------

    async def add_calibration_observation(self, model: str, observation: Observation) -> None:
        """Persisted and kept in the caller's step when nothing else is being written and the
        store's write does not suspend (the memory store's; the files store's, which defers its
        lines to the flusher); else queued for one writer that persists everything queued
        meanwhile in one write (a files store rewriting its calibration log). Returns once the
        observation is persisted as the store persists it, and kept."""
        idle = not self._observations_queued and (self._observations_writer is None or self._observations_writer.done())
        first: Coroutine[Any, Any, None] | None = None
        if idle:
            # Nothing queued or being written: the write starts in the caller's step, and one that
            # completes without suspending costs no writer task and no futures.
            first, _ = _begun(self._persist_observations([(model, observation)]))
            if first is None:
                self._keep_observations([(model, observation)])
                return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._observations_queued.append((model, observation, done))
        if self._observations_writer is None or self._observations_writer.done():
            writer = asyncio.ensure_future(self._write_observations(first))
            self._observations_writer = writer
            self._inflight.add(writer)
            writer.add_done_callback(_settle)
            writer.add_done_callback(self._inflight.discard)
        await asyncio.shield(done)  # a caller that goes away does not take its write with it

    def _keep_observations(self, batch: Sequence[tuple[str, Observation]]) -> None:
        """Observations made durable, kept in memory (the newest ``observations_kept`` per model)."""
        for model, obs in batch:
            kept = self._observations.setdefault(model, [])
            kept.append(obs)
            del kept[: -self.observations_kept]

    async def _write_observations(self, first: Coroutine[Any, Any, None] | None = None) -> None:
        """Persist what is queued, batch after batch. ``first``: the write of the one observation
        queued so far, already started (``add_calibration_observation``), finished here."""
        while self._observations_queued:
            if first is not None:  # its batch is the one observation queued when it started
                batch, self._observations_queued = self._observations_queued[:1], self._observations_queued[1:]
                writing, first = first, None
            else:
                batch, self._observations_queued = self._observations_queued, []
                writing = self._persist_observations([(model, obs) for model, obs, _ in batch])
            try:
                await writing
            except Exception as exc:  # each waiting caller gets the store's error
                for _, _, done in batch:
                    if not done.done():
                        done.set_exception(exc)
                        done.add_done_callback(_settle)
                continue
            self._keep_observations([(model, obs) for model, obs, _ in batch])
            for _, _, done in batch:
                if not done.done():
                    done.set_result(None)

    async def list_calibration_observations(self, model: str, *, limit: int) -> list[Observation]:
        if limit <= 0:
            return []
        return list(self._observations.get(model, ())[-limit:])

    async def save_view(self, session_id: str, view: ViewRecord, *, keep: int) -> None:
        st = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if st is None or st.deleted:
            raise session_not_found(session_id)

        async def work() -> None:
            await self._commit(st, SaveViewRecord(view, keep))

        await self._serialized(st, work, whole=False)

    async def get_view(self, session_id: str, view_id: str) -> ViewRecord | None:
        st = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if st is None or st.deleted:
            return None
        try:
            return await self._read(st, lambda s: s.views.get(view_id))
        except NotFound:  # deleted while we waited for the lock
            return None

    # -- raw history index (HistoryStore) ------------------------------------------------------

    async def add_history_chunks(self, session_id: str, chunks: Sequence[HistoryChunk]) -> int:
        st = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if st is None or st.deleted:
            raise session_not_found(session_id)
        normalized = [_normalized(c) for c in chunks]

        async def work() -> int:
            index = await self._history_of(st)
            new = index.fresh(normalized)
            if new:
                await self._persist_history(st, new)
                index.add(new)
            return len(new)

        # Under the session lock: a delete cannot slip between the write and the index update.
        return await self._serialized(st, work, rows=False)

    async def _index_before_commit(self, st: SessionState, chunks: Sequence[HistoryChunk]) -> None:
        """A compaction's chunks, under its session lock; a failure is logged, never raised."""
        try:
            index = await self._history_of(st)
            new = index.fresh(chunks)
            if new:
                await self._persist_history(st, new)
                index.add(new)
        except Exception:
            # DESIGN §5.6: an index failure never fails a compaction (the rows are safe anyway).
            logger.warning("history index write failed", extra={"session_id": st.id}, exc_info=True)

    async def search_history(self, session_id: str, query: str, *, limit: int) -> list[ScoredChunk]:
        st = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if st is None or st.deleted or limit <= 0:
            return []
        index = self._history.get(st.id)
        if index is not None and not index.pending:
            return index.search(query, limit)

        async def work() -> list[ScoredChunk]:
            return (await self._indexed_history(st)).search(query, limit)

        try:
            return await self._serialized(st, work, rows=False)
        except NotFound:  # deleted while we waited for the lock
            return []

    async def _indexed_history(self, st: SessionState) -> RecallIndex:
        """The session's history index with every chunk's terms found (under the session lock).

        Compactions add chunks without their terms (``RecallIndex.add``); the first search after
        them finds the terms here, in a worker thread, so a long history (a whole log read back
        after a restart) never holds the event loop. The lock keeps adds and other such searches
        out meanwhile, and the caller searches before letting it go (once it is let go, an add
        may make chunks pending again); a search reads the index without the lock only when
        nothing is pending, in one step of the event loop."""
        index = await self._history_of(st)
        if index.pending:
            await asyncio.to_thread(index.index_pending)
        return index

    async def _history_of(self, st: SessionState) -> RecallIndex:
        index = self._history.get(st.id)
        if index is None:
            index = await self._load_history(st)
            self._history[st.id] = index
        return index


def _check_rows(st: SessionState, sequence_numbers: Sequence[int]) -> None:
    bad = st.unknown(sequence_numbers)
    if bad:
        raise NotFound("message not found", metadata={"session_id": st.id, "sequence_number": str(bad[0])})


def _check_in_context(st: SessionState, sequence_numbers: Sequence[int]) -> None:
    # Optimistic check under the session lock, before anything is written: the compaction was
    # planned on a context read earlier, and if the cross-process compaction lock was lost in
    # between, another compaction may have demoted some of these rows already.
    for seq in sorted(sequence_numbers):
        if not st.rows[seq - 1].flags.is_context:
            raise compaction_conflict(st.id, seq)


def _normalized(chunk: HistoryChunk) -> HistoryChunk:
    # Times as every store returns them (aware UTC); breadcrumbs a tuple whatever the caller passed.
    return dataclasses.replace(
        chunk,
        start_time=utc(chunk.start_time) if chunk.start_time is not None else None,
        end_time=utc(chunk.end_time) if chunk.end_time is not None else None,
        breadcrumbs=tuple(chunk.breadcrumbs),
    )


class _Resumed:
    """Drives a coroutine that already ran to its first suspension (``waiting``, what it yielded)
    from inside another one: what a task would have done with it from the start."""

    __slots__ = ("coro", "waiting")

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting: Any) -> None:
        self.coro = coro
        self.waiting = waiting

    def __await__(self) -> Generator[Any, None, Any]:
        coro, waiting = self.coro, self.waiting
        while True:
            try:
                yield waiting
            except BaseException as exc:  # the task's cancellation, passed on as a task would
                try:
                    waiting = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    waiting = coro.send(None)
                except StopIteration as done:
                    return done.value


async def _resume(coro: Coroutine[Any, Any, T], waiting: Any) -> T:
    return cast(T, await _Resumed(coro, waiting))


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


def _begun(awaitable: Awaitable[T]) -> tuple[Coroutine[Any, Any, T] | None, T | None]:
    """Run ``awaitable`` in the caller's step up to its first suspension: ``(None, result)`` when
    it completed without one, else ``(rest, None)``, a coroutine that finishes it wherever it is
    awaited (a task of its own). An exception it raises before suspending is raised here."""
    if not isinstance(awaitable, types.CoroutineType):
        return _awaited(awaitable), None
    try:
        waiting = awaitable.send(None)
    except StopIteration as done:
        return None, cast(T, done.value)
    return _resume(awaitable, waiting), None


def _settle(task: asyncio.Future[Any]) -> None:
    # A caller that was cancelled never awaits its task; fetch the outcome so asyncio does not
    # report "exception was never retrieved" (the caller already got its CancelledError).
    if not task.cancelled():
        task.exception()
