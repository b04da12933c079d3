"""The in-process event bus: a bounded retained log plus live fan-out to subscribers."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from contextsvc.clock import SystemClock
from contextsvc.core.session import Principal
from contextsvc.errors import EventIdAhead, EventsExpired
from contextsvc.ports import Clock, StoredEvent


@dataclass(eq=False, slots=True)
class _Watcher:
    """One subscriber: where it is in the shared log. It holds no events of its own, so a watcher
    that stops reading costs nothing but this (its stream is held back by gRPC flow control)."""

    visible: Callable[[StoredEvent], bool]
    #: the session it streams ("" = all of the caller's): maintenance spares those.
    session_id: str
    #: the id of the next event it looks at; every event before it was delivered or not visible.
    pos: int
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    #: waiting for an event: ``publish`` moves ``pos`` past events it may not see and wakes it
    #: for one it may.
    idle: bool = False
    #: a visible event that left the log before this watcher read it (0: none).
    lost: int = 0


class MemoryEventBus:
    """Events live in process memory: resume works while the process lives and within retention.

    Ids start from the wall clock in microseconds so that they keep increasing across restarts
    of a single replica (a client resuming with an id from before a restart gets no duplicates).
    Within a process they follow each other (+1), so an id is also a position in the log.

    Every watcher reads the one retained log at its own pace (nothing is copied per watcher): one
    that is behind catches up from the log, and one whose unread events left the log (more than
    ``retention`` events of all sessions behind) ends with ``EVENTS_EXPIRED`` rather than skipping them.
    """

    def __init__(self, *, retention: int, clock: Clock | None = None):
        self._log: deque[StoredEvent] = deque(maxlen=retention)
        self._watchers: list[_Watcher] = []
        self._next_id = time.time_ns() // 1000
        self._clock = clock or SystemClock()
        self._closed = False
        #: retained ``session_deleted`` events by session (``retained_deletion``), let go with the log's.
        self._deletions: dict[str, StoredEvent] = {}

    def watched_sessions(self) -> set[str]:
        """Sessions with a stream open on them (store maintenance never removes those)."""
        return {w.session_id for w in self._watchers if w.session_id}

    async def publish(self, *, session_id: str, user_id: str, kind: str, payload: Mapping[str, Any]) -> StoredEvent:
        self._next_id += 1
        event = StoredEvent(
            event_id=self._next_id,
            session_id=session_id,
            user_id=user_id,
            time=self._clock.now(),
            kind=kind,
            payload=dict(payload),
        )
        evicted = self._log[0] if len(self._log) == self._log.maxlen else None
        self._log.append(event)
        if kind == "session_deleted":
            self._deletions[session_id] = event
        if (
            evicted is not None
            and evicted.kind == "session_deleted"
            and self._deletions.get(evicted.session_id) is evicted
        ):
            del self._deletions[evicted.session_id]
        for w in self._watchers:
            if w.idle:
                # Only visible events wake a watcher: other sessions' traffic costs it no task switch.
                if w.visible(event):
                    w.idle = False
                    w.wake.set()
                else:
                    w.pos = event.event_id + 1
            elif evicted is not None and not w.lost and evicted.event_id >= w.pos and w.visible(evicted):
                w.lost = evicted.event_id
        return event

    async def subscribe(
        self, *, caller: Principal, session_id: str = "", after_event_id: int = 0
    ) -> AsyncIterator[StoredEvent]:
        def visible(e: StoredEvent) -> bool:
            return (not session_id or e.session_id == session_id) and caller.may_read(e.user_id)

        if after_event_id > self._next_id:
            raise EventIdAhead(after_event_id, self._next_id)
        # Positioned when the stream starts reading: after_event_id 0 means what comes from now on.
        watcher = _Watcher(visible, session_id, after_event_id + 1 if after_event_id else self._next_id + 1)
        self._watchers.append(watcher)
        last = after_event_id
        try:
            while not self._closed:
                if watcher.lost:
                    raise EventsExpired(
                        after_event_id=last,
                        lost_event_id=watcher.lost,
                        oldest_event_id=self._log[0].event_id if self._log else self._next_id + 1,
                    )
                if not self._log:
                    # Nothing published in this process yet: an id it started from (the clock) or
                    # below names no event it has, so the watcher waits for the first one.
                    watcher.pos = self._next_id + 1
                if watcher.pos > self._next_id:
                    watcher.idle = True
                    watcher.wake.clear()
                    await watcher.wake.wait()
                    continue
                oldest = self._log[0].event_id
                if watcher.pos < oldest:
                    # A resume from before the retained log starts at its oldest event (the README's
                    # event_retention); a live watcher gets here only past events it may not see.
                    watcher.pos = oldest
                event = self._log[watcher.pos - oldest]
                watcher.pos += 1
                if visible(event):
                    last = event.event_id
                    yield event
        finally:
            self._watchers.remove(watcher)

    async def retained_deletion(self, session_id: str) -> StoredEvent | None:
        return self._deletions.get(session_id)

    async def close(self) -> None:
        self._closed = True
        for watcher in self._watchers:
            watcher.wake.set()
