"""The in-process event bus: a bounded retained log plus live fan-out to subscribers."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from contextsvc.clock import SystemClock
from contextsvc.core.session import Principal
from contextsvc.errors import EventIdAhead, Unavailable
from contextsvc.ports import Clock, StoredEvent

# Subscribers that fall this far behind are cut off rather than holding memory forever;
# they reconnect with after_event_id and replay from the retained log.
_SUBSCRIBER_QUEUE = 10_000


class SubscriberLagged(Unavailable):
    """A subscriber fell behind the live stream; it must reconnect with after_event_id."""

    reason = "SUBSCRIBER_LAGGED"


class MemoryEventBus:
    """Events live in process memory: resume works while the process lives and within retention.

    Ids start from the wall clock in microseconds so that they keep increasing across restarts
    of a single replica (a client resuming with an id from before a restart gets no duplicates).
    """

    def __init__(self, *, retention: int, clock: Clock | None = None):
        self._log: deque[StoredEvent] = deque(maxlen=retention)
        # Each subscriber's queue with the filter of what it may see: only visible events are
        # queued, so traffic of other sessions never makes a watcher fall behind.
        self._subscribers: dict[asyncio.Queue[StoredEvent | None], Callable[[StoredEvent], bool]] = {}
        self._next_id = time.time_ns() // 1000
        self._clock = clock or SystemClock()
        self._closed = False
        #: the session each subscriber streams ("" = all of the caller's): maintenance spares them.
        self._watching: dict[asyncio.Queue[StoredEvent | None], str] = {}

    def watched_sessions(self) -> set[str]:
        """Sessions with a stream open on them (store maintenance never removes those)."""
        return {sid for sid in self._watching.values() if sid}

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
        self._log.append(event)
        for queue, visible in list(self._subscribers.items()):
            if not visible(event):
                continue
            if queue.qsize() >= _SUBSCRIBER_QUEUE:
                del self._subscribers[queue]
                queue.put_nowait(None)
            else:
                queue.put_nowait(event)
        return event

    async def subscribe(
        self, *, caller: Principal, session_id: str = "", after_event_id: int = 0
    ) -> AsyncIterator[StoredEvent]:
        def visible(e: StoredEvent) -> bool:
            return (not session_id or e.session_id == session_id) and caller.may_read(e.user_id)

        if after_event_id > self._next_id:
            raise EventIdAhead(after_event_id, self._next_id)
        queue: asyncio.Queue[StoredEvent | None] = asyncio.Queue()
        # Register before snapshotting the log: nothing published in between can be missed,
        # and duplicates are removed by the id check below.
        self._subscribers[queue] = visible
        self._watching[queue] = session_id
        try:
            last = after_event_id
            if after_event_id:
                for event in list(self._log):
                    if event.event_id > last and visible(event):
                        last = event.event_id
                        yield event
            while not self._closed:
                item = await queue.get()
                if item is None:
                    if self._closed:
                        return
                    raise SubscriberLagged(f"this watcher fell behind; reconnect with after_event_id={last} to resume")
                if item.event_id > last and visible(item):
                    last = item.event_id
                    yield item
        finally:
            self._subscribers.pop(queue, None)
            self._watching.pop(queue, None)

    async def close(self) -> None:
        self._closed = True
        for queue in list(self._subscribers):
            queue.put_nowait(None)
        self._subscribers.clear()
        self._watching.clear()
