"""Use cases on sessions and their history: create, read, list, update, delete, append, fork."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from contextsvc.config import Settings
from contextsvc.core.messages import BufferKind, ImageRef, Message, text_bytes
from contextsvc.core.profile import EffectiveProfile
from contextsvc.core.session import AppendResult, ListPosition, Principal, SessionInfo
from contextsvc.core.tokens import carry_measures, context_total
from contextsvc.engine.accounting import TokenAccounting
from contextsvc.engine.attachments import describe_images
from contextsvc.engine.idempotency import append_fingerprint
from contextsvc.engine.paging import (
    decode_listing_token,
    decode_position_token,
    encode_listing_token,
    encode_position_token,
)
from contextsvc.engine.remembered_profile import PROFILE_KEY, counted_budget, remembered_stored, session_profile
from contextsvc.engine.state import BESIDE_KEY, EngineState
from contextsvc.engine.validation import (
    IncomingMessage,
    check_messages,
    check_metadata,
    check_name,
    check_no_nul,
    check_page_size,
    metadata_size,
    require_session_id,
)
from contextsvc.errors import FailedPrecondition, InvalidArgument, NotFound, quoted
from contextsvc.ports import (
    AppendEvent,
    Clock,
    EventBus,
    EventPublishingStore,
    HistoryChunk,
    InitialContent,
    SessionProfileChanged,
    SessionStore,
    StoredEvent,
    statement_publisher,
)

# Metadata key of a compression record listing the sequence ranges it demoted (used by fork).
DEMOTED_RANGES_KEY = "demoted_ranges"


@dataclass(slots=True, frozen=True)
class SessionList:
    sessions: list[SessionInfo]
    next_page_token: str
    total: int


@dataclass(slots=True, frozen=True)
class AppendOutcome:
    sequence_numbers: list[int]
    context_tokens: int
    window_fraction: float
    replayed: bool


@dataclass(slots=True, frozen=True)
class MessagePage:
    messages: list[Message]
    #: display buffer only: the sequence to pass as ``before_sequence`` for the older page.
    next_before_sequence: int
    #: either buffer: the opaque token of the older page ("" when there is none).
    next_page_token: str = ""


#: Bytes a listed row takes on the wire besides its text and metadata (numbers, flags, times), and
#: each image reference (a blob id, its type and size).
_ROW_WIRE_BYTES = 256
_IMAGE_REF_WIRE_BYTES = 160
#: A metadata value's protobuf ``Struct`` over its compact JSON, at most: a number in a list is 2-4
#: JSON bytes (``0,`` or ``0.0,``) and 11 on the wire; keys, strings and nesting cost less than that.
_METADATA_WIRE_FACTOR = 6


def _row_wire_bytes(m: Message) -> int:
    """About what ``m`` takes in a ListMessages response (an upper bound of its text's share)."""
    size = _ROW_WIRE_BYTES + _IMAGE_REF_WIRE_BYTES * len(m.images) + 16 * len(m.tool_calls) + text_bytes(m)
    if m.metadata:
        size += _METADATA_WIRE_FACTOR * metadata_size(m.metadata)
    return size


def _rows_within(page: Sequence[Message], budget: int) -> int:
    """How many of the newest rows of ``page`` (oldest first) fit ``budget`` bytes; at least one."""
    total = 0
    for taken, m in enumerate(reversed(page)):
        total += _row_wire_bytes(m)
        if total > budget and taken:
            return taken
    return len(page)


class SessionService:
    """Everything about a session except building views and compressing them."""

    def __init__(
        self,
        *,
        store: SessionStore,
        bus: EventBus,
        settings: Settings,
        clock: Clock,
        accounting: TokenAccounting,
    ):
        self._store = store
        self._bus = bus
        self._settings = settings
        self._clock = clock
        self._accounting = accounting
        self._limits = settings.limits
        #: session id -> its profile id (never changes for a session), the profile its appends
        #: price with (the named one with the overrides it remembers: ``remembered_profile``) and
        #: those overrides as stored, for the sessions appended to most recently
        #: (``hot_path.view_cache_sessions`` of them): an append to one of them needs no session
        #: read; the store checks the profile id in the append itself (``append``). A build here
        #: that remembers other overrides forgets the entry; one on another replica shows in the
        #: session an append returns, which refreshes it.
        self._profiles: OrderedDict[str, tuple[str, EffectiveProfile, Any]] = OrderedDict()
        #: the store, when its appends publish their event for this bus in the same statement
        #: (``ports.EventPublishingStore``: PostgreSQL with its own bus); else the engine publishes.
        self._publisher: EventPublishingStore | None = statement_publisher(store, bus)
        #: session id -> the in-process lock of its pinned appends and its holders and waiters.
        self._pinned_locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    async def create(
        self, caller: Principal, *, profile_id: str, name: str, metadata: Mapping[str, Any]
    ) -> SessionInfo:
        if profile_id and self._settings.profile(profile_id) is None:
            known = ", ".join(sorted(self._settings.profiles))
            raise InvalidArgument.field("profile_id", f"unknown profile {quoted(profile_id)} (known: {known})")
        check_name(name, self._limits, "name")
        check_metadata(metadata, self._limits, "metadata")
        return await self._store.create_session(
            caller=caller, profile_id=profile_id or self._settings.default_profile, name=name, metadata=metadata
        )

    async def get(self, caller: Principal, session_id: str) -> SessionInfo:
        return await self._store.get_session(require_session_id(session_id), caller=caller)

    async def list(
        self, caller: Principal, *, page_size: int, page_token: str, profile_id: str, query: str
    ) -> SessionList:
        limit = check_page_size(page_size, self._limits)
        check_no_nul(profile_id, "profile_id")
        check_no_nul(query, "query")
        after, offset = decode_listing_token(page_token, "sessions", profile_id, query)
        # One more than the page: whether a next page exists, whatever changed before this one.
        page = await self._store.list_sessions(
            caller=caller,
            offset=0 if after else offset,
            limit=limit + 1,
            profile_id=profile_id,
            query=query,
            after=after,
        )
        sessions = page.sessions[:limit]
        more = len(page.sessions) > limit
        token = ""
        if more:
            end = offset + len(sessions)  # (for replicas still on offset tokens)
            token = encode_listing_token(ListPosition.of(sessions[-1]), end, "sessions", profile_id, query)
        return SessionList(sessions=sessions, next_page_token=token, total=page.total)

    async def update(
        self,
        caller: Principal,
        session_id: str,
        *,
        name: str | None,
        pinned: bool | None,
        metadata: Mapping[str, Any] | None,
    ) -> SessionInfo:
        sid = require_session_id(session_id, "session.id")
        if name is not None:
            check_name(name, self._limits, "session.name")
        if metadata is not None:
            check_metadata(metadata, self._limits, "session.metadata")
        return await self._store.update_session(sid, caller=caller, name=name, pinned=pinned, metadata=metadata)

    async def delete(self, caller: Principal, session_id: str) -> None:
        sid = require_session_id(session_id)
        session = await self._store.get_session(sid, caller=caller)
        await self._store.delete_session(sid, caller=caller)
        self._profiles.pop(sid, None)
        await self._bus.publish(session_id=sid, user_id=session.user_id, kind="session_deleted", payload={})

    async def append(
        self,
        caller: Principal,
        session_id: str,
        incoming: Sequence[IncomingMessage],
        *,
        request_id: str,
        turn_complete: bool,
    ) -> AppendOutcome:
        sid = require_session_id(session_id)
        if len(request_id) > 128:
            raise InvalidArgument.field("request_id", "exceeds 128 characters")
        check_no_nul(request_id, "request_id")
        check_messages(incoming, self._limits)
        # A session this process has appended to needs no read: the store's append checks what the
        # read did (the session exists and is the caller's) and that its profile is still the one
        # priced for. Not with images (their blobs are stored before the append) nor pinned rows
        # (capped by the session's window as it is now; the cap check reads the context anyway).
        known = None if any(m.images or m.message.flags.is_pinned for m in incoming) else self._profiles.get(sid)
        try:
            return await self._append(
                caller, sid, incoming, request_id=request_id, turn_complete=turn_complete, known=known
            )
        except SessionProfileChanged:  # deleted and created again, elsewhere: read it, price again
            self._profiles.pop(sid, None)
            return await self._append(
                caller, sid, incoming, request_id=request_id, turn_complete=turn_complete, known=None
            )
        except NotFound:
            self._profiles.pop(sid, None)
            raise

    async def _append(
        self,
        caller: Principal,
        sid: str,
        incoming: Sequence[IncomingMessage],
        *,
        request_id: str,
        turn_complete: bool,
        known: tuple[str, EffectiveProfile, Any] | None,
    ) -> AppendOutcome:
        if known is None:
            session = await self._store.get_session(sid, caller=caller)
            expected, profile_id, profile = None, session.profile_id, self._profile_of(session)
            priced_for = remembered_stored(session)
        else:
            (profile_id, profile, priced_for), expected = known, known[0]
        now = self._clock.now()
        await self._accounting.ensure_loaded(profile.model)
        rows: list[Message] = []
        for i, item in enumerate(incoming):
            images: tuple[ImageRef, ...] = ()
            if item.images:
                images, _ = await describe_images(
                    self._store, item.images, self._settings.tokens, f"messages[{i}].images", persist=True
                )
            # One copy per message, priced on the client's message (images are priced by their
            # refs, never as text), and measured once: the copy keeps what was measured.
            tokens = self._accounting.message_tokens(profile.model, item.message, images=images)
            message = item.message.copy_with(images=images, create_time=now, sequence_number=0, token_count=tokens)
            rows.append(carry_measures(item.message, message))
        # What the rows add to the context's count: a view sends a long one cut to the budget.
        budget, fallback = profile.per_message_budget, self._settings.tokens.image_tokens_fallback
        delta = context_total(rows, budget, fallback_tokens=fallback)
        fingerprint = append_fingerprint(incoming) if request_id else ""
        if any(m.flags.is_pinned for m in rows):
            # The cap is checked against the context as read: no other pinned append of the
            # session may come between that read and this append (here or on another replica).
            async with self._pinned_lock(sid):
                try:
                    await self._check_pinned_cap(caller, sid, rows, profile.context_window)
                except FailedPrecondition:
                    # A retry of a pinned append that was stored finds its own rows in the
                    # context: it is answered as the first call was (DESIGN §4), not refused.
                    replay = None
                    if request_id:
                        replay = await self._store.replayed_append(
                            sid, request_id, caller=caller, request_fingerprint=fingerprint
                        )
                    if replay is None:
                        raise
                    result = replay
                else:
                    result = await self._store_append(
                        sid, rows, caller, request_id, delta, fingerprint, expected, turn_complete
                    )
        else:
            result = await self._store_append(
                sid, rows, caller, request_id, delta, fingerprint, expected, turn_complete
            )
        remembered = remembered_stored(result.session)
        if remembered != priced_for:
            # A build remembered other overrides since (on another replica: this one's own builds
            # forget the entry): the next append prices with them, read from the session returned.
            profile = self._profile_of(result.session)
        self._remember_profile(sid, profile_id, profile, remembered)
        # A retry is answered as its first call was (DESIGN §4), when the store kept what it was.
        first = result.first_context_tokens if result.replayed else None
        tokens = result.session.context_tokens if first is None else first
        if not result.replayed and not result.event_id:
            await self._bus.publish(
                session_id=sid,
                user_id=result.session.user_id,
                kind="messages_appended",
                payload={
                    "sequence_numbers": result.sequence_numbers,
                    "context_tokens": tokens,
                    "request_id": request_id,
                    "turn_complete": turn_complete,
                },
            )
        return AppendOutcome(
            sequence_numbers=result.sequence_numbers,
            context_tokens=tokens,
            window_fraction=tokens / profile.context_window,
            replayed=result.replayed,
        )

    async def _store_append(
        self,
        sid: str,
        rows: Sequence[Message],
        caller: Principal,
        request_id: str,
        delta: int,
        fingerprint: str,
        expected: str | None,
        turn_complete: bool,
    ) -> AppendResult:
        target: Any = self._store
        published: dict[str, AppendEvent] = {}
        if self._publisher is not None:
            # The event is published by the append's own statement (the store adds the sequence
            # numbers and the context tokens, as below).
            target = self._publisher
            published["event"] = AppendEvent(
                "messages_appended", {"request_id": request_id, "turn_complete": turn_complete}
            )
        return cast(
            AppendResult,
            await target.append_messages(
                sid,
                rows,
                caller=caller,
                request_id=request_id,
                context_tokens_delta=delta,
                request_fingerprint=fingerprint,
                expected_profile_id=expected,
                **published,
            ),
        )

    @contextlib.asynccontextmanager
    async def _pinned_lock(self, sid: str) -> AsyncIterator[None]:
        """Pinned appends of one session one at a time: in this process, then across processes
        (the store's lock). The in-process entry lives only while someone holds or waits for it."""
        entry = self._pinned_locks.setdefault(sid, (asyncio.Lock(), [0]))
        entry[1][0] += 1
        try:
            async with entry[0], self._store.pinned_lock(sid):
                yield
        finally:
            entry[1][0] -= 1
            if not entry[1][0]:
                del self._pinned_locks[sid]

    def _profile_of(self, session: SessionInfo) -> EffectiveProfile:
        """The profile an append to ``session`` prices with and caps pinned rows by (``session_profile``)."""
        return session_profile(self._settings, session)

    def forget_profile(self, sid: str) -> None:
        """The session's next append reads the profile it prices with again."""
        self._profiles.pop(sid, None)

    def _remember_profile(self, sid: str, profile_id: str, profile: EffectiveProfile, remembered: Any) -> None:
        self._profiles[sid] = (profile_id, profile, remembered)
        self._profiles.move_to_end(sid)
        while len(self._profiles) > self._settings.hot_path.view_cache_sessions:
            self._profiles.popitem(last=False)

    async def _check_pinned_cap(self, caller: Principal, sid: str, rows: Sequence[Message], window: int) -> None:
        """Pinned messages are never compressed, so their total must leave room for the rest."""
        context = await self._store.load_context(sid, caller=caller)
        pinned = sum(m.token_count for m in [*context, *rows] if m.flags.is_pinned and m.flags.is_context)
        cap = int(window * self._settings.pinned_max_fraction)
        if pinned > cap:
            raise FailedPrecondition(
                f"pinned messages would take {pinned} tokens; the cap is {cap} "
                f"({self._settings.pinned_max_fraction:.0%} of the {window}-token window)",
                reason="PINNED_CAP_EXCEEDED",
                metadata={"pinned_tokens": str(pinned), "cap": str(cap)},
            )

    async def list_messages(
        self,
        caller: Principal,
        session_id: str,
        *,
        buffer: BufferKind,
        page_size: int,
        before_sequence: int,
        page_token: str = "",
    ) -> MessagePage:
        """One page of a buffer, in buffer order, newest page first.

        ``page_token`` (AIP-158) pages either buffer: it holds the buffer position of the oldest
        row of the previous page, so the pages concatenate to exactly the buffer — also the
        context buffer, whose order is not sequence order (a summary sits where the rows it
        replaced were). ``before_sequence`` still pages the display buffer; on the context buffer
        it means "the rows placed before message N" and no ``next_before_sequence`` is given,
        because a sequence number cannot name a position there."""
        sid = require_session_id(session_id)
        limit = check_page_size(page_size, self._limits)
        kind = BufferKind(buffer)
        if before_sequence < 0:
            raise InvalidArgument.field("before_sequence", "must not be negative")
        if page_token and before_sequence:
            raise InvalidArgument.field("before_sequence", "set either page_token or before_sequence, not both")
        scope = (sid, kind.name)
        position = decode_position_token(page_token, "messages", *scope)
        if position is not None and kind is BufferKind.DISPLAY:
            before_sequence, position = position[1], None
        # One extra row tells whether an older page exists without a second query.
        rows = await self._store.list_messages(
            sid, caller=caller, buffer=kind, before_sequence=before_sequence, before_position=position, limit=limit + 1
        )
        more = len(rows) > limit
        page = rows[-limit:] if more else rows
        fits = _rows_within(page, self._limits.max_page_bytes)
        if fits < len(page):
            page, more = page[len(page) - fits :], True
        if not (more and page):
            return MessagePage(messages=page, next_before_sequence=0)
        oldest = page[0]
        token = encode_position_token(
            oldest.context_sort_key if kind is BufferKind.CONTEXT else (0, oldest.sequence_number), "messages", *scope
        )
        next_before = oldest.sequence_number if kind is BufferKind.DISPLAY else 0
        return MessagePage(messages=page, next_before_sequence=next_before, next_page_token=token)

    async def fork(
        self,
        caller: Principal,
        session_id: str,
        *,
        at_sequence: int,
        chunks_of: Callable[[Sequence[Message]], Sequence[HistoryChunk]] | None = None,
    ) -> SessionInfo:
        """A new session whose two buffers are the parent's as they stood right after ``at_sequence``.

        A point inside a compaction (its summary, before its compression record) is the state that
        compaction left: its rows and its record were committed together, and the buffers never
        held the summary beside the originals it replaced. ``chunks_of`` (the compactor's) makes
        the raw history index's chunks of the rows the fork inherits as demoted, so its searches
        and recall find them. The store creates the fork with its rows, state and chunks in one
        step: a crash part-way never leaves a fork holding part of them."""
        sid = require_session_id(session_id)
        if at_sequence < 0:
            raise InvalidArgument.field("at_sequence", "must not be negative")
        parent = await self._store.get_session(sid, caller=caller)
        last = at_sequence or parent.last_sequence
        if last > parent.last_sequence:
            raise InvalidArgument.field("at_sequence", f"is past the session's last message ({parent.last_sequence})")
        # Every row through the newest, in one read: a compaction committed since ``parent`` was
        # read demoted rows at or before ``last`` and put its summary and record after it; its
        # record (below) is what lets the fork restore them. Read only up to the number ``parent``
        # gave, the fork would keep the demotions and lose both the old context and its summary.
        every = await self._store.get_messages(sid, caller=caller, first=1, last=_THROUGH_NEWEST)
        last = _whole_compaction(every, last)
        rows = [m for m in every if m.sequence_number <= last]
        # Compactions committed after the fork point demoted rows that were still context then.
        restore: set[int] = set()
        for m in every:
            if m.sequence_number > last and m.flags.is_compression:
                for first_seq, last_seq in m.metadata.get(DEMOTED_RANGES_KEY, []):
                    restore.update(range(int(first_seq), int(last_seq) + 1))
        copied = [m.with_flags(is_context=True) if m.sequence_number in restore else m for m in rows]
        demoted = [m for m in copied if not m.flags.is_context]
        # What the parent learned of its runtime is the fork's too: the profile it remembers (the
        # rows carry the prices its appends gave them, for that profile's model: without it the
        # fork's first build with that profile took it for a model change and repriced its count
        # from the default model's prices) and the tokens its client sends beside each view (tool
        # definitions: without them the fork's first view, priced whole, left them out).
        extra = {key: copy.deepcopy(parent.state[key]) for key in _INHERITED_STATE if key in parent.state}
        budget = counted_budget(self._settings, parent)
        initial = InitialContent(
            messages=copied,  # rows keep their numbers: the parent's are gap-free from 1
            context_tokens=context_total(copied, budget, fallback_tokens=self._settings.tokens.image_tokens_fallback),
            # The fork holds a compacted history: its builds recall from it, as the parent's do
            # (recall skips sessions that never compacted, whose epoch is 0).
            state=EngineState(epoch=1 if demoted else 0, extra=extra).to_dict() if demoted or extra else None,
            history=chunks_of(demoted) if chunks_of is not None and demoted else (),
        )
        return await self._store.create_session(
            caller=caller,
            profile_id=parent.profile_id,
            name=f"{parent.name or 'session'} (fork)",
            metadata={**parent.metadata, "forked_from": sid, "forked_at": last},
            initial=initial,
        )

    async def events(self, caller: Principal, *, session_id: str, after_event_id: int) -> AsyncIterator[StoredEvent]:
        if after_event_id < 0:
            raise InvalidArgument.field("after_event_id", "must not be negative")
        sid = ""
        if session_id:
            sid = require_session_id(session_id)
            try:
                await self._store.get_session(sid, caller=caller)
            except NotFound:
                # Deleted while the watcher was away: it may still read what it missed, up to the
                # deletion, while the bus retains it (the stream ends after ``session_deleted``).
                gone = await self._bus.retained_deletion(sid) if after_event_id else None
                if gone is None or gone.event_id <= after_event_id or not caller.may_read(gone.user_id):
                    raise
        async for event in self._bus.subscribe(caller=caller, session_id=sid, after_event_id=after_event_id):
            yield event


#: engine-state keys a fork copies from its parent (``SessionService.fork``).
_INHERITED_STATE = (PROFILE_KEY, BESIDE_KEY)

#: ``get_messages``'s ``last`` for "through the newest row" (stores clamp it; PostgreSQL's bigint holds it).
_THROUGH_NEWEST = 2**62


def _whole_compaction(rows: Sequence[Message], last: int) -> int:
    """``last``, or the compression record of the compaction whose summary it names: a summary
    and the record after it were written together (nothing but that compaction's own rows, none
    of them displayed, lies between them)."""
    by_number = {m.sequence_number: m for m in rows}
    at = by_number.get(last)
    if at is None or not at.flags.is_summary:
        return last
    for n in range(last + 1, max(by_number, default=last) + 1):
        m = by_number.get(n)
        if m is None:
            return last
        if m.flags.is_compression:
            return n
        if m.flags.is_display:
            return last
    return last
