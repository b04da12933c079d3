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


class ServingGate:
    """An admission (see ``api.decoding.Admission``) over the server's lifecycle."""

    def __init__(self, state: ServingState = ServingState.STARTING, *, clock: Callable[[], float] = time.monotonic):
        self.state = state
        self._clock = clock
        #: when the last ContextService call reached the gate, admitted or refused.
        self._last_arrival = clock()
        #: set once draining starts; open StreamEvents calls end when it is.
        self.stopping = asyncio.Event()
        #: admitted ContextService calls still running.
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def ready(self) -> None:
        if self.state is ServingState.STARTING:
            self.state = ServingState.SERVING

    def drain(self) -> None:
        self.state = ServingState.DRAINING
        self.stopping.set()

    async def wait_idle(self, seconds: float) -> bool:
        """Wait until no admitted call runs (at most ``seconds``); True if none does."""
        try:
            await asyncio.wait_for(self._idle.wait(), seconds)
        except TimeoutError:
            return False
        return True

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

    def _release(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def __call__(self, method: str, request: Any, context: Any) -> Callable[[], None] | None:
        if not method.startswith(SERVICE_PREFIX):
            return None
        self._last_arrival = self._clock()
        if self.state is ServingState.SERVING:
            # Counted so that a drain waits for calls in flight before the transport shuts down
            # (grpc's own shutdown cancels calls it accepted but had not yet handed to us).
            self.in_flight += 1
            self._idle.clear()
            return self._release
        if self.state is ServingState.DRAINING:
            raise ServerShuttingDown("the server is shutting down; retry on another replica or after it restarts")
        raise StoreNotReady("the server is starting and its store has not answered yet; retry shortly")
