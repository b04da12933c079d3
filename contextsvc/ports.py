"""The ports the engine depends on. Adapters (stores, event buses, summarizers) implement them.

Every store passes the same conformance suite (tests/conformance/); the docstrings here are
the contract that suite checks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, cast

from contextsvc.core.calibration import Observation
from contextsvc.core.credentials import ApiToken
from contextsvc.core.history import HistoryChunk as HistoryChunk  # re-exported for adapters
from contextsvc.core.history import ScoredChunk as ScoredChunk
from contextsvc.core.messages import BufferKind, Message
from contextsvc.core.session import AppendResult, ListPosition, Principal, SessionInfo, SessionPage


class Clock(Protocol):
    def now(self) -> datetime: ...


@dataclass(slots=True, frozen=True)
class StoreHealth:
    """What the server's health service reports for a store that can tell (``health_check``:
    the files and PostgreSQL stores; ``store_health.py`` polls it)."""

    writable: bool
    detail: str = ""
    damaged_sessions: int = 0


@dataclass(slots=True, frozen=True)
class InitialContent:
    """What ``create_session`` fills a new session with, in the same durable step as its creation
    (a fork): a crash part-way must never leave a session that exists with only part of it.

    ``messages`` are numbered from 1 in order (their ``sequence_number`` is ignored) with their
    flags as given; ``context_tokens`` is the session's count of them; ``state`` the engine state;
    ``history`` the raw history index's chunks of the rows that start demoted."""

    messages: Sequence[Message] = ()
    context_tokens: int = 0
    state: Mapping[str, Any] | None = None
    history: Sequence[HistoryChunk] = ()


class SessionProfileChanged(Exception):
    """``append_messages`` with ``expected_profile_id``: the session has another profile (nothing
    was appended). Not a client error: the engine reads the session and prices again."""


@dataclass(slots=True, frozen=True)
class ViewRecord:
    """What RecordBaseline needs to know about a view BuildContext returned, on any replica."""

    view_id: str
    model: str
    chars: int
    estimated_tokens: int
    had_images: bool
    last_sequence: int
    create_time: datetime
    #: the session's compaction count when the view was built: a baseline from a view older than
    #: the last compaction describes a context that no longer exists.
    epoch: int = 0
    #: the view's calibration features (``core.priors.FEATURES``): what a baseline of it is fitted on.
    features: tuple[float, ...] = ()
    #: estimated tokens of the not-yet-stored incoming message the view carried: once appended it
    #: is newer than ``last_sequence``, so a baseline of this view must not count it twice.
    incoming_tokens: int = 0
    #: tokens of ``estimated_tokens`` the counter priced (``TokenEstimate.priced``): a baseline's
    #: residual is relative to them. 0 when not known (recorded before this field).
    priced_tokens: int = 0
    #: tokens of the images the view carried, by the image pricing rule (``core.images``): part of
    #: the truncation floor. 0 when none (or recorded before this field).
    image_tokens: int = 0
    #: ``core.profile.view_shape`` of the profile it was built with: a baseline of it anchors
    #: only views of the same shape. "" when recorded before this field (anchors any).
    shape: str = ""
    #: the stored rows the view sent cut to the per-message budget, as (sequence number, the
    #: features of the cut it sent): a baseline of it carries them into the session's anchor, so a
    #: later view that cuts one of them elsewhere (another fit) prices the difference
    #: (``engine.views``). () when none was cut; None when not known (recorded before this field,
    #: features of another set, or more cut rows than ``tokens.anchor_cuts_max``).
    cuts: tuple[tuple[int, tuple[int, ...]], ...] | None = None


class TokenStore(Protocol):
    """Calibration observations and built-view records. Part of every SessionStore."""

    async def add_calibration_observation(self, model: str, observation: Observation) -> None:
        """Persist one observation for ``model`` (shared by every replica on the same store)."""
        ...

    async def list_calibration_observations(self, model: str, *, limit: int) -> list[Observation]:
        """The newest ``limit`` observations of ``model``, oldest first. Never another model's."""
        ...

    async def save_view(self, session_id: str, view: ViewRecord, *, keep: int) -> None:
        """Remember a built view (the newest ``keep`` per session are kept). Views are soft state:
        a store may write them without forcing them to disk; losing one only means a later
        RecordBaseline for it is refused as unknown."""
        ...

    async def get_view(self, session_id: str, view_id: str) -> ViewRecord | None: ...


class HistoryStore(Protocol):
    """The raw history index. Part of every SessionStore; deleting a session deletes its chunks."""

    async def add_history_chunks(self, session_id: str, chunks: Sequence[HistoryChunk]) -> int:
        """Store chunks; a chunk whose ``content_hash`` the session already has is skipped
        (idempotent). Returns how many were new."""
        ...

    async def search_history(self, session_id: str, query: str, *, limit: int) -> list[ScoredChunk]:
        """Chunks of the session ranked for ``query`` (full-text; best first, score > 0 only)."""
        ...


class SessionStore(TokenStore, HistoryStore, Protocol):
    """Sessions and their rows. Every method that names a session checks ownership through
    ``caller`` and raises ``NotFound`` for an unknown session *and* for another user's session.

    Mutations of one session are serialized by the store (sequence numbers never collide);
    readers never see half of a mutation.
    """

    async def open(self) -> None:
        """Connect / load / migrate. Called once before use."""
        ...

    async def close(self) -> None:
        """Flush pending writes and release resources."""
        ...

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
        """Create a session owned by ``caller.user_id``: empty, or holding ``initial``, all of it
        durable in one step (after a crash the session exists whole or not at all)."""
        ...

    async def get_session(self, session_id: str, *, caller: Principal) -> SessionInfo: ...

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
        """Sessions ``caller`` may read: pinned first, then newest ``update_time`` first, then id.

        ``query`` matches (case-insensitive substring) the name or any display message's content.
        Summaries carry counters and a preview; no history is returned. The page starts after
        ``after`` (a position in that order, as a previous page ended) and then skips ``offset``;
        ``total`` counts every matching session, those before ``after`` included.
        """
        ...

    async def update_session(
        self,
        session_id: str,
        *,
        caller: Principal,
        name: str | None = None,
        pinned: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SessionInfo:
        """Change the given header fields (None = unchanged)."""
        ...

    async def delete_session(self, session_id: str, *, caller: Principal) -> None:
        """Remove the session, its rows, blobs references and index chunks."""
        ...

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
        """Assign the next gap-free sequence numbers and store ``messages`` atomically.

        With ``expected_profile_id``, nothing is appended and ``SessionProfileChanged`` is raised
        when the session's profile is another one (a session deleted and created again under the
        same id, by another replica): the caller priced the messages for that profile without
        reading the session first.

        A repeated non-empty ``request_id`` for the same session appends nothing and returns the
        first call's sequence numbers with ``replayed=True``. The ``request_fingerprint`` (a hash
        of what the client sent) is stored with the id; a repeat whose fingerprint differs from the
        stored one raises ``RequestIdReused`` and appends nothing (an empty one on either side is
        not compared: records from before fingerprints existed). ``context_tokens_delta`` is added to
        the session's ``context_tokens`` in the same step.
        """
        ...

    async def replayed_append(
        self, session_id: str, request_id: str, *, caller: Principal, request_fingerprint: str = ""
    ) -> AppendResult | None:
        """What ``append_messages`` would answer a repeat of the non-empty ``request_id`` with
        (``replayed=True``; ``RequestIdReused`` when the fingerprints differ), or None when no
        append of the session used it. Reads only."""
        ...

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
        """Up to ``limit`` rows of the buffer just before a position, returned in buffer order.

        DISPLAY: rows with ``is_display`` and sequence < ``before_sequence`` (0 = no bound), by
        sequence. CONTEXT: rows with ``is_context`` whose ``context_sort_key`` is below
        ``before_position`` — or, without one, below ``(before_sequence, 0)``: the rows placed
        before message ``before_sequence`` (0 = no bound) — in context order. Pages cut at a
        position, never at a sequence number, so consecutive pages concatenate to the buffer."""
        ...

    async def load_context(self, session_id: str, *, caller: Principal) -> list[Message]:
        """The whole context buffer in context order. Must not cost more with a longer display
        history: stores keep the context rows indexed."""
        ...

    async def context_and_session(self, session_id: str, *, caller: Principal) -> tuple[SessionInfo, list[Message]]:
        """The session and its whole context buffer (``load_context``) read at one moment: no
        mutation committed between the two (a compaction would pair the old baseline with the
        compacted context). BuildContext reads both for every build."""
        ...

    def context_as_read(self, session: SessionInfo) -> list[Message] | None:
        """The context buffer as it was when this store returned ``session`` from a baseline's
        anchor (``update_state_if_unchanged``, ``anchor_baseline``), when the store holds exactly
        that version without a read; else None (read it: ``context_and_session``). The post-turn
        check after a baseline judges the session as that baseline left it."""
        ...

    async def get_messages(self, session_id: str, *, caller: Principal, first: int, last: int) -> list[Message]:
        """Every stored row with first <= sequence <= last, by sequence (both buffers)."""
        ...

    async def set_context_flags(
        self, session_id: str, sequence_numbers: Sequence[int], *, caller: Principal, is_context: bool
    ) -> None:
        """Persist ``is_context`` explicitly for the given rows (context-only rows included)."""
        ...

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
        """Replace the given counters / engine state (None = unchanged).

        ``context_tokens_as_of``: ``context_tokens`` is the count of the session as it stood when
        its context tokens were this value (a read taken before the write): what appends committed
        since added is kept on top, in the same write, rather than overwritten.

        ``durable=False``: a write the engine can afford to lose in a crash (a baseline's anchor:
        a measurement, taken again on the next turn). A store that syncs each write to disk
        may answer before this one is synced; it reaches the disk with the session's next
        synced write, in order (never a later write without it)."""
        ...

    async def update_state_if_unchanged(
        self,
        session_id: str,
        *,
        caller: Principal,
        read: SessionInfo,
        context_tokens: int,
        state: Mapping[str, Any],
    ) -> SessionInfo | None:
        """``update_state(context_tokens=..., context_truncated=False, state=..., durable=False)``,
        done only if the session is still as ``read`` left it (the same creation, engine state
        and newest sequence number) and no other process holds its ``compaction_lock``: a
        baseline's anchor written without taking that lock. None when any of it does not hold
        (the session changed, is being compacted elsewhere, is gone or is not the caller's):
        nothing is written, and the caller takes the locked way, which says why."""
        ...

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
        """In one atomic step: demote ``demote`` from the context, append ``append`` (summary,
        compression record, placeholders) and set the counters. Returns the new sequence numbers.
        Readers see either the old or the new context, never a mix.

        ``history``: the demoted originals' chunks for the raw history index, stored as
        ``add_history_chunks`` would, once the check below passed and no later than the
        compaction itself (in its transaction, or durable before its record), so a crash never
        leaves a committed compaction whose rows search cannot find. Failing to store them is
        logged and never fails the commit (DESIGN §5.6: the rows are safe in the display history).

        ``context_tokens_as_of``: the session's context tokens when the compacted context was
        read (``update_state``'s): what appends committed since added (rows the compaction kept
        as they are) is kept on top of ``context_tokens``.

        Optimistic check, in the same step: every number in ``demote`` must still be in the
        context (``is_context``) when the commit is applied. A number no row has raises
        ``NotFound``; a row already out of the context (another compaction committed first, e.g.
        after the ``compaction_lock`` was lost) raises ``Conflict`` (reason
        ``COMPACTION_CONFLICT``, naming the smallest such number). Either way nothing changes."""
        ...

    def compaction_lock(self, session_id: str) -> AbstractAsyncContextManager[None]:
        """Held while one compaction of the session is planned and committed, so that no other
        process compacts it at the same time (a store used by one process may return a no-op:
        the engine also serializes compactions in process)."""
        ...

    def pinned_lock(self, session_id: str) -> AbstractAsyncContextManager[None]:
        """Held while an append of pinned messages checks the pinned cap against the context and
        appends, so that no other process appends pinned messages to the session in between (a
        store used by one process may return a no-op: the engine also serializes them in process)."""
        ...

    async def put_blob(self, data: bytes, *, blob_id: str) -> None:
        """Store bytes under their content address (idempotent: stored once)."""
        ...

    async def get_blob(self, blob_id: str) -> bytes | None: ...


@dataclass(slots=True, frozen=True)
class StoredEvent:
    """An event as it travels on the bus. ``payload`` is a core-level dict; the API adapter maps
    ``kind`` + ``payload`` onto the protobuf oneof."""

    event_id: int
    session_id: str
    user_id: str
    time: datetime
    kind: str
    payload: Mapping[str, Any]


@dataclass(slots=True, frozen=True)
class SummaryRequest:
    """What a summarizer gets: the dropped rows, and the same rows formatted as capped text."""

    messages: Sequence[Message]
    text: str
    instructions: str
    max_tokens: int
    temperature: float
    images: Sequence[bytes] = ()
    #: the session being compacted: telemetry's gen_ai.conversation.id (never sent to the model).
    session_id: str = ""


class SummarizerError(Exception):
    """The summarizer failed (down, timed out, garbage); the caller falls back, never fails the turn."""


class SummarizerUnavailable(SummarizerError):
    """The summarizer gave no answer: it timed out or could not be reached, its retries and its
    whole-call bound spent. Asking again at once, with another input, would wait as long again."""


class CutSummary(str):
    """A summary the summarizer's output cap cut short (``finish_reason``/``done_reason``
    ``length``): its end, where the fact lines and the KEYS line it was asked for go, is missing."""

    __slots__ = ()


class Summarizer(Protocol):
    """Turns dropped turns into a summary whose last line is ``KEYS: a; b; c``; a ``CutSummary``
    when the answer was cut at the output cap."""

    name: str
    vision: bool

    async def summarize(self, request: SummaryRequest) -> str:
        """The summary text; raises ``SummarizerError`` on any failure."""
        ...

    async def close(self) -> None: ...


class Summarizers(Protocol):
    """The summarizers profiles may name, built once by the bootstrap (``summarizers.registry``);
    the engine only looks them up by name and closes them with itself."""

    def get(self, name: str) -> Summarizer:
        """The summarizer called ``name``; ``InvalidArgument`` naming the profile field otherwise."""
        ...

    def __contains__(self, name: object) -> bool: ...

    async def close(self) -> None: ...


@dataclass(slots=True, frozen=True)
class AppendEvent:
    """The event an append publishes in its own statement (``EventPublishingStore``): its kind
    and payload, to which the store adds ``sequence_numbers`` and ``context_tokens`` (known only
    once the rows are numbered), as the engine's ``messages_appended`` event carries them."""

    kind: str
    payload: Mapping[str, Any]


@dataclass(slots=True, frozen=True)
class BaselineWrite:
    """What a baseline writes besides its anchor (``EventPublishingStore.anchor_baseline``): the
    calibration observation of the view's model, and the event that says it was recorded."""

    model: str
    observation: Observation
    event_kind: str
    event_payload: Mapping[str, Any]


class EventPublishingStore(Protocol):
    """A store whose writes can publish their event in their own statement, on an event bus of
    the same database (PostgreSQL: one round trip and one commit instead of two; the event is
    committed exactly when the rows are): an append's, and a baseline's with its anchor and
    observation. The engine uses it only for a bus the store says it publishes to
    (``publishes_appends_to``); with any other bus it publishes itself."""

    def publishes_appends_to(self, bus: EventBus) -> bool: ...

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
        """``SessionStore.append_messages``; with ``event``, a new append (not a replay) also
        publishes it, and ``AppendResult.event_id`` is its id."""
        ...

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
        """``update_state_if_unchanged``, and with the anchor, in the same transaction, the
        observation (``add_calibration_observation``) and the event of ``write``: all three or,
        when the anchor is refused (None), none of them."""
        ...

    async def observe_baseline(
        self, session_id: str, *, caller: Principal, write: BaselineWrite, created: datetime | None = None
    ) -> bool:
        """The observation (``add_calibration_observation``) and the event of ``write`` about
        session ``session_id``, in one statement, when that session is ``caller``'s (and, with
        ``created``, was created then): both, or neither and False. For a baseline whose anchor
        is applied (or deferred) on its own."""
        ...


def statement_publisher(store: object, bus: EventBus) -> EventPublishingStore | None:
    """``store`` when its statements publish their events on ``bus`` (``EventPublishingStore``)."""
    publishes = getattr(store, "publishes_appends_to", None)
    return cast(EventPublishingStore, store) if callable(publishes) and publishes(bus) else None


class EventBus(Protocol):
    """Publishes events and lets watchers replay retained ones and then follow live ones."""

    async def publish(self, *, session_id: str, user_id: str, kind: str, payload: Mapping[str, Any]) -> StoredEvent: ...

    def subscribe(
        self, *, caller: Principal, session_id: str = "", after_event_id: int = 0
    ) -> AsyncIterator[StoredEvent]:
        """Retained events with id > ``after_event_id`` (when non-zero), then live ones, in id
        order, without gaps or duplicates, filtered to what ``caller`` may read."""
        ...

    async def retained_deletion(self, session_id: str) -> StoredEvent | None:
        """The ``session_deleted`` event of ``session_id`` while the bus still retains it, else None:
        a watcher of a session deleted while it was away resumes up to that event."""
        ...

    async def close(self) -> None: ...


class ApiTokenStore(Protocol):
    """API tokens (DESIGN §5.10), kept by every session store (``api_tokens()``) or on their own.

    Only hashes are stored (``core/credentials.py``). A token is never deleted, only revoked, so
    ``tokens list`` keeps its history; ids and hashes are unique.
    """

    async def add_api_token(self, token: ApiToken) -> None:
        """Store a new token; durable when this returns."""
        ...

    async def find_api_token(self, token_hash: str) -> ApiToken | None:
        """The token with this hash (revoked and expired ones too), or None."""
        ...

    async def list_api_tokens(self) -> list[ApiToken]:
        """Every token, oldest first."""
        ...

    async def revoke_api_token(self, token_id: str, when: datetime) -> ApiToken | None:
        """Mark the token revoked at ``when`` (a token already revoked keeps its first time);
        None when no token has this id. Durable when this returns."""
        ...

    async def touch_api_token(self, token_id: str, when: datetime) -> None:
        """Record a use (``last_used_time``). Soft state: callers throttle it, and a store may
        lose the newest touch in a crash."""
        ...
