"""The contexts a PostgreSQL replica built lately, kept so the next build reads only what changed.

Without it every ``BuildContext`` read the session's whole context and decoded each row again:
O(context) per build, and fresh ``Message`` objects each time, so the engine's and the API
adapter's per-message caches (sizes, features, encoded rows: keyed by the message object) never
hit. With it a build reads the session's version and the context rows numbered after the cached
ones, in one statement, and gets back the same objects for the rows it had.

A cached context is valid for one version of the session: its ``create_time`` (a session deleted
and created again under the same id is another one), its ``context_epoch`` (bumped by every
statement that changes ``is_context`` of a stored row: flag changes, compactions) and its
``last_sequence``. Appends only add rows, numbered after ``last_sequence``: the new ones are read
and added in context order when they sort after the cached ones (a row anchored earlier, as a
summary is, means a whole read instead). The session's ``context_count`` must then equal the
number of rows held, a second check that also catches a change by a writer that does not bump the
epoch (a replica of an older release during a rolling upgrade).

Memory is bounded by ``postgres.context_cache_mb``, least recently built sessions first, each row
priced as the files store prices a held row (``_session.row_bytes``). Pure Python, no SQL: the
store reads, this decides what it may reuse.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from contextsvc.core.messages import Message
from contextsvc.core.session import SessionInfo
from contextsvc.stores._session import row_bytes

#: a context row with its position in context order, ``(context_key, seq)`` as the table sorts it.
KeyedRow = tuple[tuple[int, int], Message]

#: estimated memory of a cached context beyond its rows (the entry, its version, the LRU's slot).
ENTRY_BYTES = 512


@dataclass(frozen=True, slots=True)
class ContextVersion:
    """What a session's context depends on, besides appends (read with the rows, one snapshot)."""

    create_time: datetime
    epoch: int
    last_sequence: int


@dataclass(frozen=True, slots=True)
class CachedContext:
    version: ContextVersion
    rows: tuple[Message, ...]
    #: ``(context_key, seq)`` of the last row in context order; ``(0, 0)`` when there is none.
    last_key: tuple[int, int]
    nbytes: int
    #: the session as a row of this very version read it, when this replica wrote that row
    #: (``ContextCache.vouch``): its context needs no read (``ContextCache.as_read``)
    session: SessionInfo | None = None


def whole(version: ContextVersion, rows: Sequence[KeyedRow], context_count: int) -> CachedContext | None:
    """The entry for a context read whole, or None when its rows do not add up to the session's
    count (a row changed by a writer that does not keep the count: not cached)."""
    if len(rows) != context_count:
        return None
    return CachedContext(
        version,
        tuple(m for _, m in rows),
        rows[-1][0] if rows else (0, 0),
        ENTRY_BYTES + sum(row_bytes(m) for _, m in rows),
    )


def extended(
    cached: CachedContext, version: ContextVersion, added: Sequence[KeyedRow], context_count: int
) -> CachedContext | None:
    """``cached`` with the context rows numbered after it (``added``, in context order), or None
    when the session changed otherwise since, and the context must be read whole."""
    held = cached.version
    if (
        version.create_time != held.create_time
        or version.epoch != held.epoch
        or version.last_sequence < held.last_sequence
        or (added and added[0][0] <= cached.last_key)
        or len(cached.rows) + len(added) != context_count
    ):
        return None
    if not added:
        return cached if version == held else CachedContext(version, cached.rows, cached.last_key, cached.nbytes)
    return CachedContext(
        version,
        cached.rows + tuple(m for _, m in added),
        added[-1][0],
        cached.nbytes + sum(row_bytes(m) for _, m in added),
    )


class ContextCache:
    """Session id -> its newest cached context, least recently used first, within a byte budget."""

    def __init__(self, budget_bytes: int) -> None:
        self._budget = budget_bytes
        self._entries: OrderedDict[str, CachedContext] = OrderedDict()
        self._held = 0

    @property
    def held_bytes(self) -> int:
        """Estimated memory of the cached contexts (at most the budget)."""
        return self._held

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str) -> CachedContext | None:
        entry = self._entries.get(session_id)
        if entry is not None:
            self._entries.move_to_end(session_id)
        return entry

    def put(self, session_id: str, entry: CachedContext) -> None:
        """Keep ``entry`` unless what is held is of a newer version of the same session (two builds
        of a session that read it at different moments may finish in either order)."""
        old = self._entries.get(session_id)
        if old is not None:
            if old.version.create_time == entry.version.create_time and (
                (old.version.epoch, old.version.last_sequence) > (entry.version.epoch, entry.version.last_sequence)
            ):
                return
            self._held -= old.nbytes
            del self._entries[session_id]
        if entry.nbytes > self._budget:
            return  # larger than the whole budget: read every time rather than evict everything
        self._entries[session_id] = entry
        self._held += entry.nbytes
        while self._held > self._budget:
            _, dropped = self._entries.popitem(last=False)
            self._held -= dropped.nbytes

    def vouch(self, session: SessionInfo, version: ContextVersion, context_count: int) -> None:
        """Note that ``session`` (a row of ``version`` holding ``context_count`` context rows, which
        a statement of this replica returned) goes with the held context of its session, when that
        context is of this very version and holds that many rows: ``as_read`` then gives it."""
        entry = self._entries.get(session.id)
        if entry is not None and entry.version == version and len(entry.rows) == context_count:
            self._entries[session.id] = dataclasses.replace(entry, session=session)  # (its place kept)

    def as_read(self, session: SessionInfo) -> tuple[Message, ...] | None:
        """The context that goes with ``session`` (``vouch``), or None when it is not held (read it)."""
        entry = self._entries.get(session.id)
        return entry.rows if entry is not None and entry.session is session else None

    def forget(self, session_id: str) -> None:
        old = self._entries.pop(session_id, None)
        if old is not None:
            self._held -= old.nbytes
