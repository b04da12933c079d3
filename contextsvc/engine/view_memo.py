"""The last assembled view of each session, reused while nothing it depends on changed (issue #15).

An assembled view is a pure function of: the effective profile, the model's counter (its
calibration), the session's baseline, the settings (fixed for the process) and the context rows.
Stored rows are immutable — an append adds rows, a flag change or a compaction replaces them with
new objects — so the identities of the rows name the context exactly. A build whose inputs all
match the session's last one returns that view without redoing any per-message work; anything
else (new rows, a flag change, a compaction, a new baseline, another profile, a refitted
calibration, a restart) misses and assembles from scratch, which is also what is kept next.
The entry holds the rows it was built from, so their identities cannot be reused meanwhile.
Bounded by a number of sessions (``hot_path.view_cache_sessions``), least recently used out first.
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

from contextsvc.core.messages import Message

__all__ = ["ViewMemo"]

T = TypeVar("T")


class ViewMemo(Generic[T]):
    __slots__ = ("_entries", "_lock", "_max_sessions", "hits", "misses")

    def __init__(self, max_sessions: int) -> None:
        self._max_sessions = max_sessions
        #: session -> (key, the rows the view was built from, the view)
        self._entries: OrderedDict[str, tuple[Hashable, tuple[Message, ...], T]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _same(kept: tuple[Message, ...], context: Sequence[Message]) -> bool:
        """Are ``kept`` the first ``len(kept)`` rows of ``context``, the very objects? (Compared in
        C, without building anything; ``map`` stops at the shorter, so the caller checks lengths.)"""
        return all(map(operator.is_, kept, context))

    def get(self, session_id: str, key: Hashable, context: Sequence[Message]) -> T | None:
        with self._lock:
            entry = self._entries.get(session_id)
        if entry is None or entry[0] != key or len(entry[1]) != len(context) or not self._same(entry[1], context):
            self.misses += 1
            return None
        with self._lock:
            if session_id in self._entries:
                self._entries.move_to_end(session_id)
        self.hits += 1
        return entry[2]

    def same_rows(self, session_id: str, context: Sequence[Message]) -> tuple[Hashable, T] | None:
        """The session's kept ``(key, view)`` when it was built from exactly these rows (whatever
        its key): a view whose other inputs changed may be re-priced instead of rebuilt."""
        with self._lock:
            entry = self._entries.get(session_id)
        if entry is None or len(entry[1]) != len(context) or not self._same(entry[1], context):
            return None
        return entry[0], entry[2]

    def prefix_of(self, session_id: str, context: Sequence[Message]) -> tuple[Hashable, int, T] | None:
        """The session's kept ``(key, rows, view)`` when its rows are the first ``rows`` of
        ``context`` (the same objects): new rows were appended since it was built."""
        with self._lock:
            entry = self._entries.get(session_id)
        if entry is None:
            return None
        n = len(entry[1])
        if n > len(context) or not self._same(entry[1], context):
            return None
        return entry[0], n, entry[2]

    def put(self, session_id: str, key: Hashable, context: Sequence[Message], value: T) -> None:
        if self._max_sessions <= 0:
            return
        entry = (key, tuple(context), value)
        with self._lock:
            self._entries[session_id] = entry
            self._entries.move_to_end(session_id)
            while len(self._entries) > self._max_sessions:
                self._entries.popitem(last=False)

    def holds(self, session_id: str, value: T) -> bool:
        """Is ``value`` (that very object) the session's kept view?"""
        entry = self._entries.get(session_id)
        return entry is not None and entry[2] is value

    def forget(self, session_id: str) -> None:
        with self._lock:
            self._entries.pop(session_id, None)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)
