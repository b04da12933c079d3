"""One upstream event stream per watched session, fanned out to every socket watching it.

A hub reads ``StreamEvents`` of one session (with one caller's token) and hands each event, already
serialised once, to the bounded queue of every attached socket. It keeps the newest events in a ring
so that a socket reconnecting with its last seen event id gets exactly what it missed. That ring is a
cache of the service's own retained log: when it does not reach back far enough, the socket replays
from the service (``StreamEvents`` with ``after_event_id``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from contextsvc.config import GatewaySettings
from contextsvc.gateway import frames
from contextsvc.gateway.upstream import Upstream, UpstreamError

log = logging.getLogger(__name__)

CLOSE_DENIED = 4003
CLOSE_NOT_FOUND = 4004
CLOSE_SLOW = 4008
CLOSE_UNAVAILABLE = 1013
#: the close reason of a socket the service refused a stream or a call for a per-user quota.
OVER_QUOTA = "over a quota of the service; try again later"

Item = tuple[int, bytes]  # (event id or 0 for replies, the frame as UTF-8 JSON, encoded once)


@dataclass(eq=False, slots=True)
class Subscriber:
    """One socket's side of the fan-out: a bounded queue, and a pending list while it replays.

    Bounded twice: in frames (``maxsize``) and in bytes (``max_bytes``). The frame count alone let a
    socket that asks for big views and reads none of them hold ``maxsize`` of them, each up to the
    size of a session's view. A frame that finds nothing waiting is always taken, however big."""

    maxsize: int
    on_close: Callable[[int, str], None]
    #: writes a frame at once when nothing is waiting (saves a task switch per socket per event);
    #: returns False when the frame must wait in the queue instead.
    write_now: Callable[[bytes], bool] | None = None
    #: bytes of frames waiting (pending and queued) past which the socket is closed 4008; 0 = no bound.
    max_bytes: int = 0
    queue: asyncio.Queue[Item | None] = field(init=False)
    pending: list[Item] | None = field(default_factory=list)
    closed: bool = False
    #: bytes of the frames in ``pending`` and ``queue``.
    waiting_bytes: int = 0

    def __post_init__(self) -> None:
        self.queue = asyncio.Queue()

    def offer(self, item: Item) -> None:
        if self.closed:
            return
        backlog = len(self.pending) if self.pending is not None else self.queue.qsize()
        if backlog >= self.maxsize:
            self.close(CLOSE_SLOW, f"too slow: {backlog} frames waiting")
            return
        size = len(item[1])
        if backlog and self.max_bytes and self.waiting_bytes + size > self.max_bytes:
            self.close(CLOSE_SLOW, f"too slow: {self.waiting_bytes + size} bytes waiting")
            return
        if self.pending is not None:
            self.pending.append(item)
        elif self.queue.empty() and self.write_now is not None and self.write_now(item[1]):
            return
        else:
            self.queue.put_nowait(item)
        self.waiting_bytes += size

    async def next(self) -> Item | None:
        """The next frame to write, in order; None once the socket is closed."""
        item = await self.queue.get()
        if item is not None:
            self.waiting_bytes -= len(item[1])
        return item

    def backfill(self, items: list[Item]) -> None:
        """Put events published before this socket attached ahead of those pending since."""
        if self.pending is None or not items:
            return
        self.pending[:0] = items
        self.waiting_bytes += sum(len(text) for _, text in items)

    def go_live(self, after_id: int) -> None:
        """Move the pending events newer than ``after_id`` to the queue; from now on events go there."""
        pending, self.pending = self.pending or [], None
        for event_id, text in pending:
            if event_id > after_id:
                self.queue.put_nowait((event_id, text))
            else:
                self.waiting_bytes -= len(text)

    def close(self, code: int, reason: str) -> None:
        if not self.closed:
            self.closed = True
            self.queue.put_nowait(None)
            self.on_close(code, reason)


class SessionHub:
    """The upstream stream of one (token, session) and its sockets."""

    def __init__(self, upstream: Upstream, settings: GatewaySettings, token: str, session_id: str, after_event_id: int):
        self._upstream = upstream
        self._settings = settings
        self.token = token
        self.session_id = session_id
        self._ring: deque[Item] = deque()
        # The stream always starts from an event id, never "live only": a live-only stream misses
        # what is published before the service has registered it, and nothing would replay that.
        # It starts from the service's whole retained log of the session (the ring keeps the newest
        # part), which also lets it serve older resume points; never from the id of the socket that
        # opened it: the hub is shared, and an id past the newest event (a client's guess) made the
        # service refuse every reopening, leaving every socket of the session without live events.
        del after_event_id
        start = 1
        #: every event of the session with an id above ``floor`` is in the ring (None: not known).
        self.floor: int | None = start
        self.last_id = start
        #: the newest event of the backlog replayed at start, once settled: what came after it is
        #: live, also for the sockets that were waiting for the hub to settle.
        self.live_from = start
        self.subscribers: set[Subscriber] = set()
        self.refs = 0
        self.linger: asyncio.TimerHandle | None = None
        self._started_at = time.time()
        self._received = 0
        self._settled = False
        self._task = asyncio.create_task(self._pump(), name=f"hub:{session_id}")
        self.failed: UpstreamError | None = None

    async def settled(self) -> None:
        """Wait until the backlog replayed at start is in the ring: an event from after the start
        arrived, or none came for ``replay_settle_seconds``."""
        while not self._settled and self.failed is None:
            seen = self._received
            await asyncio.sleep(self._settings.replay_settle_seconds)
            if self._received == seen and not self._settled:
                self._settled = True
                self.live_from = self.last_id

    def attach(self, sub: Subscriber, last_id: int) -> list[Item] | None:
        """Attach a socket (synchronously: nothing can slip in between). Returns the events after
        ``last_id`` from the ring, or None when the ring does not reach back that far."""
        self.subscribers.add(sub)
        if last_id <= 0:
            return []
        if self.floor is not None and last_id >= self.floor:
            return [item for item in self._ring if item[0] > last_id]
        return None

    def detach(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)

    def _publish(self, event_id: int, text: bytes) -> None:
        self._ring.append((event_id, text))
        while len(self._ring) > self._settings.replay_buffer_events:
            self.floor = self._ring.popleft()[0]
        self.last_id = event_id
        for sub in list(self.subscribers):
            sub.offer((event_id, text))

    async def _pump(self) -> None:
        settings = self._settings
        while True:
            try:
                async for event in self._upstream.events(self.token, self.session_id, self.last_id):
                    if event.event_id <= self.last_id:
                        continue
                    self._received += 1
                    # To the microsecond: ToSeconds() drops the fraction, so an event in the hub's
                    # first second counted as backlog, and the sockets waiting for the hub lost it.
                    if not self._settled and event.time.ToMicroseconds() >= self._started_at * 1e6:
                        self._settled = True
                        self.live_from = self.last_id
                    frame = frames.event_frame(event)
                    self._publish(event.event_id, frames.dumps(frame).encode())
                    if frame["type"] == "session_deleted":
                        self._fail(UpstreamError("NOT_FOUND", "the session was deleted"))
                        return
            except UpstreamError as exc:
                # Over a quota (streams_per_user): retrying in the background left the sockets
                # open and deaf; closed 1013, a page reconnects later with its last event id.
                if exc.denied or exc.not_found or exc.code == "RESOURCE_EXHAUSTED":
                    self._fail(exc)
                    return
                log.warning("upstream event stream broke; reopening", extra={"code": exc.code})
            # Reopened from the last event seen: nothing is missed, duplicates are skipped above.
            await asyncio.sleep(settings.upstream_retry_seconds)

    def _fail(self, exc: UpstreamError) -> None:
        self.failed = exc
        code, reason = CLOSE_DENIED, exc.message[:100]
        if exc.code == "RESOURCE_EXHAUSTED":
            code, reason = CLOSE_UNAVAILABLE, OVER_QUOTA
        elif not exc.denied:
            code = CLOSE_NOT_FOUND
        for sub in list(self.subscribers):
            sub.close(code, reason)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


class HubRegistry:
    """Hubs by (token, session id), kept a while after their last socket leaves."""

    def __init__(self, upstream: Upstream, settings: GatewaySettings):
        self._upstream = upstream
        self._settings = settings
        self._hubs: dict[tuple[str, str], SessionHub] = {}
        #: sessions with a `compact` running through this gateway.
        self.compacting: set[str] = set()

    def __len__(self) -> int:
        return len(self._hubs)

    async def acquire(self, token: str, session_id: str, last_id: int) -> tuple[SessionHub, int]:
        """The hub of (token, session), settled, and the id of the newest event that came before
        this call: the events after it are new to the socket asking (``attach`` gives them)."""
        key = (token, session_id)
        hub = self._hubs.get(key)
        if hub is None or hub.failed is not None:
            hub = SessionHub(self._upstream, self._settings, token, session_id, last_id)
            self._hubs[key] = hub
        hub.refs += 1
        if hub.linger is not None:
            hub.linger.cancel()
            hub.linger = None
        # A hub still settling publishes live events before this returns: they count from where
        # its backlog ended, not from its newest event once settled.
        settled_before = hub._settled
        await hub.settled()
        return hub, hub.last_id if settled_before else min(hub.live_from, hub.last_id)

    def release(self, hub: SessionHub) -> None:
        hub.refs -= 1
        if hub.refs > 0:
            return
        key = (hub.token, hub.session_id)
        if hub.failed is not None or self._settings.hub_linger_seconds <= 0:
            self._drop(key, hub)
        else:
            hub.linger = asyncio.get_running_loop().call_later(self._settings.hub_linger_seconds, self._drop, key, hub)

    def _drop(self, key: tuple[str, str], hub: SessionHub) -> None:
        if hub.refs > 0:
            return
        if self._hubs.get(key) is hub:
            del self._hubs[key]
        asyncio.get_running_loop().create_task(hub.close())

    async def close(self) -> None:
        hubs, self._hubs = list(self._hubs.values()), {}
        for hub in hubs:
            if hub.linger is not None:
                hub.linger.cancel()
            await hub.close()
