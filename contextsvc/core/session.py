"""Sessions as the core sees them."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
#: ``epoch_micros`` of the latest time a ``datetime`` holds.
MAX_EPOCH_MICROS = (datetime.max.replace(tzinfo=UTC) - _EPOCH) // _MICROSECOND
_SESSION_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def is_session_id(value: object) -> bool:
    """A canonical (lowercase, hyphenated) UUID: the only ids a store ever builds a path from."""
    return isinstance(value, str) and _SESSION_ID.fullmatch(value) is not None


def epoch_micros(when: datetime | None) -> int:
    """``when`` in whole microseconds since the epoch (0 for None): exact, unlike a float."""
    return (when - _EPOCH) // _MICROSECOND if when is not None else 0


def listing_key(pinned: bool, update_time: datetime | None, session_id: str) -> tuple[bool, int, str]:
    """The sort key of the session listing: pinned first, newest ``update_time`` first, then id."""
    return (not pinned, -epoch_micros(update_time), session_id)


@dataclass(slots=True, frozen=True)
class Principal:
    """Who is calling. Admins see every session; others only their own."""

    user_id: str
    is_admin: bool = False
    #: told the owner each time an admin is let into another user's session (the API adapter
    #: writes an audit line); not part of the identity.
    on_foreign_read: Callable[[str], None] | None = field(default=None, compare=False, repr=False)

    def may_read(self, owner: str) -> bool:
        """``allowed`` for a read that happens now: an admin let into another user's session is
        audited."""
        if owner == self.user_id:
            return True
        if self.is_admin and self.on_foreign_read is not None:
            self.on_foreign_read(owner)
        return self.is_admin

    def allowed(self, owner: str) -> bool:
        """Whether this caller may touch ``owner``'s sessions, asked before deciding whether to
        touch one at all (nothing audited: call ``may_read`` once it is touched)."""
        return owner == self.user_id or self.is_admin


ANONYMOUS = Principal(user_id="anonymous", is_admin=True)


@dataclass(slots=True, frozen=True)
class SessionInfo:
    """A session's header and counters; never its history.

    ``state`` is a small JSON-able mapping the engine owns (baseline, compaction cycle, the
    views built for RecordBaseline...). Stores persist it verbatim and never interpret it.
    """

    id: str
    user_id: str
    profile_id: str
    name: str = ""
    pinned: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    create_time: datetime | None = None
    update_time: datetime | None = None
    context_tokens: int = 0
    context_truncated: bool = False
    display_message_count: int = 0
    context_message_count: int = 0
    last_sequence: int = 0
    preview: str = ""
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class ListPosition:
    """Where a page of a session listing ended: the listing order's key (pinned first, newest
    ``update_time`` first, then id) of its last session. The next page starts strictly after it,
    so sessions created, updated or deleted meanwhile never shift a later page: no session is
    listed twice, and none is skipped because another moved. A session updated during the pass
    moves ahead of the position; a new listing shows it."""

    pinned: bool
    update_micros: int  # ``epoch_micros`` of the session's update_time
    session_id: str

    @classmethod
    def of(cls, session: SessionInfo) -> ListPosition:
        return cls(session.pinned, epoch_micros(session.update_time), session.id)

    def key(self) -> tuple[bool, int, str]:
        """``listing_key`` of the session it names."""
        return (not self.pinned, -self.update_micros, self.session_id)

    @property
    def update_time(self) -> datetime:
        return _EPOCH + self.update_micros * _MICROSECOND


@dataclass(slots=True, frozen=True)
class SessionPage:
    sessions: list[SessionInfo]
    total: int


@dataclass(slots=True, frozen=True)
class AppendResult:
    sequence_numbers: list[int]
    session: SessionInfo
    replayed: bool = False
    #: the id of the event the store published with the append (``ports.AppendEvent``), else 0
    event_id: int = 0
    #: a replay: the session's context tokens right after the first call (None: not known, a
    #: request stored before they were kept), which the retry answers as the first call did
    first_context_tokens: int | None = None
