"""Whether ContextService calls are admitted: not before the store answers, not while draining.

Health and reflection always answer (health says NOT_SERVING meanwhile), so orchestrators and
load balancers can watch the state. Refused calls get UNAVAILABLE with a RetryInfo delay: every
gRPC client library treats that as "try again, maybe elsewhere".
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from typing import Any

from contextsvc.errors import Unavailable

SERVICE_PREFIX = "/contextsvc."


class ServingState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"


class ServerShuttingDown(Unavailable):
    """The server is draining after SIGTERM: retry against another replica or after restart."""

    reason = "SHUTTING_DOWN"


class StoreNotReady(Unavailable):
    """The server started but its store has not answered yet."""

    reason = "STORE_NOT_READY"


class _Running:
    """A count of calls running, with a wait for it to reach zero."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> Callable[[], None]:
        self.count += 1
        self._idle.clear()
        return self._leave

    def _leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self, seconds: float) -> bool:
        """Wait until none runs (at most ``seconds``); True if none does."""
        if self.count == 0:
            # Not asyncio.wait_for's answer: with no time left (a grace of 0) it gives up on the
            # set event before looking, and the drain would say calls were cancelled when none ran.
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), seconds)
        except TimeoutError:
            return False
        return True


class ServingGate:
    """An admission (see ``api.decoding.Admission``) over the server's lifecycle.

    ``watch_methods`` are the streams that run until the client leaves (StreamEvents): a drain
    waits for the other calls, then ends those (``end_watches``), so a watcher still receives the
    events the last calls emit before it is told where to resume."""

    def __init__(
        self,
        state: ServingState = ServingState.STARTING,
        *,
        watch_methods: frozenset[str] = frozenset(),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.state = state
        #: set once the calls in flight and the compactions running on their own finished (or the
        #: grace ran out): open watch streams end.
        self.stopping = asyncio.Event()
        self.watch_methods = watch_methods
        #: admitted ContextService calls still running, watch streams apart.
        self.calls = _Running()
        #: the tasks running those calls (``cancel_calls``).
        self._call_tasks: set[asyncio.Task[Any]] = set()
        self.watches = _Running()
        self._clock = clock
        #: when the last ContextService call reached the gate, admitted or refused.
        self._last_arrival = clock()

    @property
    def in_flight(self) -> int:
        """Admitted ContextService calls still running, watch streams included."""
        return self.calls.count + self.watches.count

    def ready(self) -> None:
        if self.state is ServingState.STARTING:
            self.state = ServingState.SERVING

    def drain(self) -> None:
        """Refuse new calls from now on; the ones running go on, watch streams too."""
        self.state = ServingState.DRAINING

    def end_watches(self) -> None:
        self.stopping.set()

    def cancel_calls(self) -> int:
        """Cancel the calls still running (a drain whose grace ran out), so that what they do on
        the way out (a compaction's closing event) happens before the watch streams end rather
        than after; how many were cancelled. Their clients get what the transport's own close
        would have given them."""
        tasks = [task for task in self._call_tasks if not task.done()]
        for task in tasks:
            task.cancel()
        return len(tasks)

    async def wait_quiet(self, quiet: float, at_most: float) -> bool:
        """Wait until no call reached the gate for ``quiet`` seconds (at most ``at_most``); True if
        none did. A call the transport accepted but had not yet handed over would be cancelled by
        its shutdown: given this long, it reaches the gate and is refused with UNAVAILABLE instead."""
        give_up = self._clock() + at_most
        while True:
            now = self._clock()
            quiet_at = self._last_arrival + quiet
            if now >= quiet_at:
                return True
            if now >= give_up:
                return False
            await asyncio.sleep(min(quiet_at, give_up) - now)

    async def __call__(self, method: str, request: Any, context: Any) -> Callable[[], None] | None:
        if not method.startswith(SERVICE_PREFIX):
            return None
        self._last_arrival = self._clock()
        if self.state is ServingState.SERVING:
            # Counted so that a drain waits for calls in flight before the transport shuts down
            # (grpc's own shutdown cancels calls it accepted but had not yet handed to us).
            if method in self.watch_methods:
                return self.watches.enter()
            leave = self.calls.enter()
            task = asyncio.current_task()
            if task is None:  # pragma: no cover - admissions run in the call's task
                return leave
            self._call_tasks.add(task)

            def release() -> None:
                self._call_tasks.discard(task)
                leave()

            return release
        if self.state is ServingState.DRAINING:
            raise ServerShuttingDown("the server is shutting down; retry on another replica or after it restarts")
        raise StoreNotReady("the server is starting and its store has not answered yet; retry shortly")
