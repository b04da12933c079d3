"""One session held in memory, changed only by applying records.

The memory and files stores share this model: the files store writes each record to the
session's log before applying it, and replays the same records on load, so a reload goes
through exactly the code that built the state in the first place.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from contextsvc.core.codec import copy_plain
from contextsvc.core.messages import Flags, Message, Role
from contextsvc.core.session import SessionInfo
from contextsvc.core.tokens import carry_measures
from contextsvc.ports import ViewRecord


@dataclass(slots=True, frozen=True)
class AppendRecord:
    """Rows appended with their sequence numbers already assigned. ``time`` None (a rewritten
    log) leaves ``update_time`` alone."""

    time: datetime | None
    messages: tuple[Message, ...]
    request_id: str = ""
    context_tokens_delta: int = 0
    #: hash of the request the client sent with ``request_id`` ("" = not recorded).
    request_fingerprint: str = ""


@dataclass(slots=True, frozen=True)
class FlagsRecord:
    """An explicit ``is_context`` change, context-only rows included."""

    time: datetime
    sequence_numbers: tuple[int, ...]
    is_context: bool


@dataclass(slots=True, frozen=True)
class HeaderRecord:
    """Header fields set by the owner (None = unchanged)."""

    time: datetime
    name: str | None = None
    pinned: bool | None = None
    metadata: dict[str, Any] | None = None


@dataclass(slots=True, frozen=True)
class StateRecord:
    """Counters and engine state (None = unchanged)."""

    time: datetime
    context_tokens: int | None = None
    context_truncated: bool | None = None
    state: dict[str, Any] | None = None
    #: the caller may lose it in a crash (``update_state(durable=False)``): not synced on its own
    #: (not part of the log line)
    soft: bool = False


@dataclass(slots=True, frozen=True)
class CompactionRecord:
    """Demotions, appended rows and counters of one compaction: applied all at once."""

    time: datetime
    demote: tuple[int, ...]
    messages: tuple[Message, ...]
    context_tokens: int
    state: dict[str, Any] | None = None


@dataclass(slots=True, frozen=True)
class SaveViewRecord:
    """A built view remembered for RecordBaseline (soft state: never bumps ``update_time``)."""

    view: ViewRecord
    keep: int

    @property
    def time(self) -> None:
        return None


Record = AppendRecord | FlagsRecord | HeaderRecord | StateRecord | CompactionRecord | SaveViewRecord


class RecordError(ValueError):
    """A record does not fit the session it is applied to (a corrupt log)."""


class RowsShed(Exception):
    """A read needs rows the session let go (``SessionState.shed_rows``): the store reads the
    session's log whole again and asks once more."""


#: stands in for a row let go to save memory (``SessionState.shed_rows``); never handed out: every
#: read that could reach one checks for it and raises ``RowsShed``.
SHED = Message(role=Role.SYSTEM, flags=Flags(is_context=False, is_display=False))


#: metadata key marking a stand-in for a row lost to log damage (see ``SessionState.fill_lost``).
LOST_KEY = "contextsvc.lost"


def lost_row(seq: int, note: str, time: datetime | None) -> Message:
    return Message(
        role=Role.SYSTEM,
        content=f"[message #{seq} was lost: {note}]",
        flags=Flags(is_context=False, is_display=True),
        metadata={LOST_KEY: True},
        sequence_number=seq,
        create_time=time,
    )


#: estimated memory of a held row beyond its text: the row itself (~600 B measured with its
#: decoded fields) and what the engine keeps for it once it was built into a view (per-message
#: size and feature memos, their values, the reused view's entry: ~1,000 B more), measured with
#: tracemalloc (tests/unit/test_memory_budget.py, bench/store/memory.py). The API adapter's
#: encodings of the rows are counted as it reports them (the files store's ``hold_outside``).
ROW_BYTES = 1700


def row_bytes(m: Message) -> int:
    """Estimated memory of a held row and the engine's caches of it (``ROW_BYTES``): the budget
    unit of the files store's rows and of the PostgreSQL store's cached contexts."""
    return ROW_BYTES + len(m.content) + sum(len(c.arguments_json) for c in m.tool_calls)


def utc(value: datetime) -> datetime:
    """Aware UTC; a naive value is taken to be UTC already."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _copied(d: dict[str, Any]) -> dict[str, Any]:
    return copy_plain(d) if d else {}


class SessionState:
    """Header, rows and incrementally maintained counters of one session.

    ``rows[i]`` holds sequence number ``i + 1`` (numbers are gap-free). The context buffer is
    kept as its own sorted index, so reading it costs the context size, not the history size.
    """

    __slots__ = (
        "_copies",
        "_ctx",
        "_ctx_keys",
        "_info",
        "_stub_ctx",
        "_stub_last",
        "context_tokens",
        "context_truncated",
        "create_time",
        "damage",
        "deleted",
        "display_count",
        "id",
        "lock",
        "metadata",
        "name",
        "pinned",
        "preview_source",
        "profile_id",
        "request_fingerprints",
        "request_tokens",
        "requests",
        "resident",
        "rows",
        "shed",
        "shed_scan",
        "state",
        "update_time",
        "user_id",
        "views",
    )

    def __init__(self, header: SessionInfo, *, share: bool = False) -> None:
        self.id = header.id
        self.user_id = header.user_id
        self.profile_id = header.profile_id
        self.name = header.name
        self.pinned = header.pinned
        # Copied, so the caller's dicts never change under it; ``share``: they are the caller's
        # to give away (freshly decoded), which saves two deep copies per session at start-up.
        self.metadata: dict[str, Any] = header.metadata if share else _copied(header.metadata)
        self.create_time = header.create_time
        self.update_time = header.update_time
        self.context_tokens = header.context_tokens
        self.context_truncated = header.context_truncated
        self.state: dict[str, Any] = header.state if share else _copied(header.state)
        self.rows: list[Message] = []
        self._ctx: list[Message] = []
        self._ctx_keys: list[tuple[int, int]] = []
        self.display_count = 0
        #: content of the newest display row with non-empty content (cut when read).
        self.preview_source = ""
        #: request_id -> the sequence numbers its first append got.
        self.requests: dict[str, tuple[int, ...]] = {}
        #: request_id -> the fingerprint of its first request (absent for records without one).
        self.request_fingerprints: dict[str, str] = {}
        #: request_id -> the context tokens right after its first append (its retry's answer).
        self.request_tokens: dict[str, int] = {}
        #: view_id -> view, oldest first (dicts keep insertion order).
        self.views: dict[str, ViewRecord] = {}
        self.lock = asyncio.Lock()
        #: the last ``info`` snapshot and the preview length it was cut to; dropped by every change.
        self._info: tuple[int, SessionInfo] | None = None
        #: the metadata and the state the last snapshot copied, each with its copy: a change of the
        #: header alone (every append) makes a new snapshot, but these two are replaced, never
        #: changed in place, so the same objects need no new copies.
        self._copies: tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]] | None = None
        self.deleted = False
        #: why the history cannot be trusted ("" = it can): the session is then read-only.
        self.damage = ""
        #: False: a summary only (the files store evicted its rows or has not loaded them yet):
        #: header fields, counters and preview are kept; rows, context, requests and views are not.
        self.resident = True
        #: rows of ``rows`` that are ``SHED`` now, and how far ``shed_rows`` has looked (an index).
        self.shed = 0
        self.shed_scan = 0
        self._stub_ctx = 0
        self._stub_last = 0

    # -- reading -------------------------------------------------------------------------

    @property
    def last_sequence(self) -> int:
        return len(self.rows) if self.resident else self._stub_last

    @property
    def context_count(self) -> int:
        return len(self._ctx) if self.resident else self._stub_ctx

    def info(self, preview_chars: int) -> SessionInfo:
        """A snapshot the caller may keep: its dicts are copies, made once per change of the session
        and shared by every read until the next one (callers never mutate a ``SessionInfo``'s dicts;
        every read of an unchanged session would otherwise deep-copy its state again)."""
        cached = self._info
        if cached is not None and cached[0] == preview_chars:
            return cached[1]
        copies = self._copies
        if copies is None or copies[0] is not self.metadata or copies[2] is not self.state:
            metadata = copies[1] if copies is not None and copies[0] is self.metadata else copy_plain(self.metadata)
            state = copies[3] if copies is not None and copies[2] is self.state else copy_plain(self.state)
            copies = self._copies = (self.metadata, metadata, self.state, state)
        info = SessionInfo(
            id=self.id,
            user_id=self.user_id,
            profile_id=self.profile_id,
            name=self.name,
            pinned=self.pinned,
            metadata=copies[1],
            create_time=self.create_time,
            update_time=self.update_time,
            context_tokens=self.context_tokens,
            context_truncated=self.context_truncated,
            display_message_count=self.display_count,
            context_message_count=self.context_count,
            last_sequence=self.last_sequence,
            preview=self.preview_source[:preview_chars],
            state=copies[3],
        )
        self._info = (preview_chars, info)
        return info

    def context(self) -> list[Message]:
        return list(self._ctx)

    def context_page(self, before: tuple[int, int] | None, limit: int) -> list[Message]:
        """The ``limit`` context rows placed just before position ``before`` (None = the end),
        in context order."""
        end = bisect_left(self._ctx_keys, before) if before is not None else len(self._ctx_keys)
        return self._ctx[max(0, end - limit) : end]

    def display_page(self, before: int, limit: int) -> list[Message]:
        """The ``limit`` newest display rows with sequence < ``before``, oldest first."""
        top = len(self.rows) if before <= 0 else min(before - 1, len(self.rows))
        picked: list[Message] = []
        for index in range(top - 1, -1, -1):
            if len(picked) >= limit:
                break
            row = self.rows[index]
            if row is SHED:
                raise RowsShed(self.id)
            if row.flags.is_display:
                picked.append(row)
        picked.reverse()
        return picked

    def span(self, first: int, last: int) -> list[Message]:
        rows = self.rows[max(first, 1) - 1 : max(last, 0)]
        if self.shed and any(row is SHED for row in rows):
            raise RowsShed(self.id)
        return rows

    def matches(self, needle: str) -> bool:
        """Case-insensitive substring over the name and every display row's content."""
        if needle in self.name.lower():
            return True
        if self.shed:
            raise RowsShed(self.id)
        return any(row.flags.is_display and needle in row.content.lower() for row in self.rows)

    # -- letting rows go (the files store's memory bound) ------------------------------------

    def shed_rows(self, tail: int) -> list[Message]:
        """Let go of the rows outside the context, all but the newest ``tail`` rows, and return
        them. What a turn reads (the context, views, request ids, counters) stays; a read of a
        row let go raises ``RowsShed`` (the store then reads the log whole again). Rows already
        looked at are not looked at again until a compaction demotes some of them."""
        rows = self.rows
        end = len(rows) - tail
        gone: list[Message] = []
        for index in range(self.shed_scan, end):
            row = rows[index]
            if row is not SHED and not row.flags.is_context:
                gone.append(row)
                rows[index] = SHED
        self.shed_scan = max(self.shed_scan, end)
        self.shed += len(gone)
        return gone

    def restore_rows(self, loaded: Sequence[Message]) -> None:
        """Put back the rows let go from ``loaded`` (the same session read from its log, with as
        many rows): only those; the rows held, the context and everything else stay the same
        objects (the engine's caches know them by identity)."""
        rows = self.rows
        for index, row in enumerate(rows):
            if row is SHED:
                rows[index] = loaded[index]
        self.shed = 0
        self.shed_scan = 0

    # -- summaries (the files store's lazy loading) ----------------------------------------

    @classmethod
    def summary(cls, info: SessionInfo, *, damage: str = "", share: bool = False) -> SessionState:
        """A session known by its summary only (``resident`` False): what ``info()`` returns
        and what a listing needs, without its rows. ``share`` as in ``__init__``."""
        st = cls(info, share=share)
        st.resident = False
        st.display_count = info.display_message_count
        st._stub_ctx = info.context_message_count
        st._stub_last = info.last_sequence
        st.preview_source = info.preview
        st.damage = damage
        return st

    @classmethod
    def summary_of(
        cls,
        session_id: str,
        user_id: str,
        profile_id: str,
        name: str,
        pinned: bool,
        metadata: dict[str, Any],
        create_time: datetime | None,
        update_time: datetime | None,
        context_tokens: int,
        context_truncated: bool,
        state: dict[str, Any],
        display_count: int,
        context_count: int,
        last_sequence: int,
        preview: str,
    ) -> SessionState:
        """``summary(SessionInfo(...), share=True)`` from the values themselves: the files store's
        start-up makes one per session from its index, and neither the ``SessionInfo`` nor the
        keyword calls are needed for that (the dicts are taken, not copied)."""
        st = cls.__new__(cls)
        st.id = session_id
        st.user_id = user_id
        st.profile_id = profile_id
        st.name = name
        st.pinned = pinned
        st.metadata = metadata
        st.create_time = create_time
        st.update_time = update_time
        st.context_tokens = context_tokens
        st.context_truncated = context_truncated
        st.state = state
        st.rows = []
        st._ctx = []
        st._ctx_keys = []
        st.display_count = display_count
        st.preview_source = preview
        st.requests = {}
        st.request_fingerprints = {}
        st.request_tokens = {}
        st.views = {}
        st.lock = asyncio.Lock()
        st._info = None
        st._copies = None
        st.deleted = False
        st.damage = ""
        st.resident = False
        st.shed = 0
        st.shed_scan = 0
        st._stub_ctx = context_count
        st._stub_last = last_sequence
        return st

    def evict(self, preview_chars: int) -> None:
        """Drop the rows, context, request ids and views; keep the header, counters and preview."""
        if not self.resident:
            return
        self._stub_ctx = len(self._ctx)
        self._stub_last = len(self.rows)
        self.preview_source = self.preview_source[:preview_chars]
        self.rows = []
        self._ctx = []
        self._ctx_keys = []
        self.requests = {}
        self.request_fingerprints = {}
        self.request_tokens = {}
        self.views = {}
        self.resident = False
        self.shed = 0
        self.shed_scan = 0

    def adopt(self, loaded: SessionState) -> None:
        """Take every field of ``loaded`` (the same session read from its log) but the lock and
        the deleted flag, so callers holding this object see the rows."""
        for name in SessionState.__slots__:
            if name not in ("lock", "deleted"):
                setattr(self, name, getattr(loaded, name))

    # -- building records ----------------------------------------------------------------

    def number(self, messages: Sequence[Message], time: datetime) -> tuple[Message, ...]:
        """Assign the next sequence numbers (and a create time where missing)."""
        start = len(self.rows) + 1
        return tuple(
            # The copy keeps what the engine measured of the message (its text is the same).
            carry_measures(
                m,
                m.copy_with(
                    sequence_number=start + i,
                    create_time=utc(m.create_time) if m.create_time is not None else time,
                    # The store keeps its own copy: a caller mutating its dict must not change history.
                    metadata=copy_plain(m.metadata) if m.metadata else {},
                ),
            )
            for i, m in enumerate(messages)
        )

    def unknown(self, sequence_numbers: Iterable[int]) -> list[int]:
        return sorted({s for s in sequence_numbers if not 1 <= s <= len(self.rows)})

    # -- applying records ----------------------------------------------------------------

    def apply(self, record: Record) -> None:
        """Apply one record; raises ``RecordError`` (changing nothing) if it does not fit."""
        if not isinstance(record, SaveViewRecord):  # views are not part of the snapshot
            self._info = None
        if isinstance(record, AppendRecord):
            self._check_numbers(record.messages)
            for m in record.messages:
                self._add_row(m)
            self.context_tokens += record.context_tokens_delta
            if record.request_id:
                self.requests[record.request_id] = tuple(m.sequence_number for m in record.messages)
                self.request_tokens[record.request_id] = self.context_tokens
                if record.request_fingerprint:
                    self.request_fingerprints[record.request_id] = record.request_fingerprint
        elif isinstance(record, FlagsRecord):
            self._check_known(record.sequence_numbers)
            self._set_context(record.sequence_numbers, record.is_context)
        elif isinstance(record, HeaderRecord):
            if record.name is not None:
                self.name = record.name
            if record.pinned is not None:
                self.pinned = record.pinned
            if record.metadata is not None:
                self.metadata = copy_plain(record.metadata)
        elif isinstance(record, StateRecord):
            self._set_state(record.context_tokens, record.context_truncated, record.state)
        elif isinstance(record, SaveViewRecord):
            self.remember_view(record.view, record.keep)
        else:
            self._check_known(record.demote)
            self._check_numbers(record.messages)
            self._set_context(record.demote, False)
            for m in record.messages:
                self._add_row(m)
            self._set_state(record.context_tokens, None, record.state)
        if record.time is not None:
            self.update_time = record.time

    def fill_lost(self, upto: int, note: str, time: datetime | None) -> list[int]:
        """Stand-ins for acknowledged rows that could not be read, up to ``upto``: they keep
        their sequence numbers taken (never handed out again) and show the loss in the display
        history; they never reach the context. Returns the numbers filled."""
        filled = list(range(len(self.rows) + 1, upto + 1))
        self._info = None
        for seq in filled:
            self._add_row(lost_row(seq, note, time))
        return filled

    def remember_view(self, view: ViewRecord, keep: int) -> None:
        self.views.pop(view.view_id, None)
        self.views[view.view_id] = view
        while len(self.views) > max(keep, 1):
            del self.views[next(iter(self.views))]

    def _check_numbers(self, messages: Sequence[Message]) -> None:
        expected = len(self.rows) + 1
        for i, m in enumerate(messages):
            if m.sequence_number != expected + i:
                raise RecordError(f"row {m.sequence_number} where {expected + i} was expected")

    def _check_known(self, sequence_numbers: Sequence[int]) -> None:
        bad = self.unknown(sequence_numbers)
        if bad:
            raise RecordError(f"unknown sequence numbers {bad[:5]}")

    def _add_row(self, m: Message) -> None:
        self.rows.append(m)
        if m.flags.is_display:
            self.display_count += 1
            if m.content:
                self.preview_source = m.content
        if m.flags.is_context:
            self._index(m)

    def _set_context(self, sequence_numbers: Iterable[int], value: bool) -> None:
        for seq in sorted(set(sequence_numbers)):
            row = self.rows[seq - 1]
            if row is SHED and value:
                # Never reached: the store reads a session whole before a flag change (a row let go
                # is outside the context, so a demotion of it changes nothing).
                raise RowsShed(self.id)
            if row.flags.is_context == value:
                continue
            if value:
                row = row.with_flags(is_context=True)
                self.rows[seq - 1] = row
                self._index(row)
            else:
                self._unindex(row)
                self.rows[seq - 1] = row.with_flags(is_context=False)
                self.shed_scan = min(self.shed_scan, seq - 1)  # now outside the context: may go too

    def _set_state(self, tokens: int | None, truncated: bool | None, state: Mapping[str, Any] | None) -> None:
        if tokens is not None:
            self.context_tokens = tokens
        if truncated is not None:
            self.context_truncated = truncated
        if state is not None:
            # A record's state is already the store's own copy (``update_state`` and
            # ``commit_compaction`` copy what the engine passed, a log's record is freshly parsed),
            # and neither the record nor the session changes it in place: shared, not copied again.
            self.state = state if type(state) is dict else copy_plain(dict(state))

    def _index(self, row: Message) -> None:
        key = row.context_sort_key
        at = bisect_left(self._ctx_keys, key)
        self._ctx_keys.insert(at, key)
        self._ctx.insert(at, row)

    def _unindex(self, row: Message) -> None:
        at = bisect_left(self._ctx_keys, row.context_sort_key)
        del self._ctx_keys[at]
        del self._ctx[at]
