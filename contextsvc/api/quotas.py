"""Per-user quotas (issue 13, item 4): call rate, appended bytes, sessions owned, open streams.

An admission (see ``api.decoding.Admission``) run on every ContextService call after it decoded.
The user is ``caller_of(context).user_id``: once API tokens land that is the token's user, and
until then everyone is ``anonymous``. Over a limit the call gets RESOURCE_EXHAUSTED with a
``QuotaFailure`` naming the limit and a ``RetryInfo`` saying when it would pass.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from contextsvc.api.auth import caller_of
from contextsvc.api.gate import SERVICE_PREFIX
from contextsvc.api.token_bucket import TokenBucket
from contextsvc.config import QuotaSettings
from contextsvc.core.session import Principal
from contextsvc.errors import ResourceExhausted

_SERVICE = SERVICE_PREFIX + "v1.ContextService/"
APPEND = _SERVICE + "AppendMessages"
STREAM = _SERVICE + "StreamEvents"
CREATES = frozenset({_SERVICE + "CreateSession", _SERVICE + "ForkSession"})

#: how a cap (sessions, streams) tells a client to come back: there is no refill time to compute.
CAP_RETRY_SECONDS = 1.0

#: counts the sessions a user owns (the engine's ListSessions total).
SessionCounter = Callable[[Principal], Awaitable[int]]


class _User:
    __slots__ = ("bytes", "calls", "creating", "streams")

    def __init__(self) -> None:
        self.calls: TokenBucket | None = None
        self.bytes: TokenBucket | None = None
        self.streams = 0
        self.creating: asyncio.Lock | None = None


class Quotas:
    """The per-user limits of ``QuotaSettings``; a no-op for every limit set to 0."""

    def __init__(
        self, settings: QuotaSettings, *, count_sessions: SessionCounter, clock: Callable[[], float] = time.monotonic
    ):
        self._s = settings
        self._count_sessions = count_sessions
        self._clock = clock
        self._users: OrderedDict[str, _User] = OrderedDict()
        self.enabled = bool(
            settings.calls_per_second
            or settings.append_bytes_per_minute
            or settings.sessions_per_user
            or settings.streams_per_user
        )

    def _user(self, user_id: str) -> _User:
        user = self._users.get(user_id)
        if user is not None:
            self._users.move_to_end(user_id)
            return user
        user = self._users[user_id] = _User()
        if len(self._users) > self._s.max_tracked_users:
            # Forget the least recently seen user whose counters are not in use.
            for key, state in self._users.items():
                if not state.streams and not (state.creating is not None and state.creating.locked()):
                    del self._users[key]
                    break
        return user

    async def __call__(self, method: str, request: Any, context: Any) -> Callable[[], None] | None:
        if not self.enabled or not method.startswith(_SERVICE):
            return None
        caller = caller_of(context)
        subject = f"user:{caller.user_id}"
        user = self._user(caller.user_id)
        now = self._clock()
        s = self._s
        if s.calls_per_second:
            if user.calls is None:
                burst = s.calls_burst or max(1, int(s.calls_per_second))
                user.calls = TokenBucket(burst, s.calls_per_second, now)
            wait = user.calls.take(1, now)
            if wait:
                raise ResourceExhausted(
                    f"calls_per_second: more than {s.calls_per_second:g} calls per second; retry in {wait:.2f} s",
                    limit="calls_per_second",
                    subject=subject,
                    retry_after_seconds=wait,
                )
        if method == APPEND and s.append_bytes_per_minute and request is not None:
            if user.bytes is None:
                user.bytes = TokenBucket(s.append_bytes_per_minute, s.append_bytes_per_minute / 60.0, now)
            size = request.ByteSize()
            wait = user.bytes.take(size, now)
            if wait:
                raise ResourceExhausted(
                    f"append_bytes_per_minute: appending {size} bytes would pass {s.append_bytes_per_minute} bytes "
                    f"per minute; retry in {wait:.2f} s",
                    limit="append_bytes_per_minute",
                    subject=subject,
                    retry_after_seconds=wait,
                )
        if method == STREAM and s.streams_per_user:
            if user.streams >= s.streams_per_user:
                raise ResourceExhausted(
                    f"streams_per_user: {user.streams} StreamEvents calls already open; the limit is "
                    f"{s.streams_per_user}",
                    limit="streams_per_user",
                    subject=subject,
                    retry_after_seconds=CAP_RETRY_SECONDS,
                )
            user.streams += 1

            def stream_closed() -> None:
                user.streams -= 1

            return stream_closed
        if method in CREATES and s.sessions_per_user:
            # One create per user at a time, so two concurrent creates cannot both pass the count.
            if user.creating is None:
                user.creating = asyncio.Lock()
            lock = user.creating
            await lock.acquire()
            try:
                owned = await self._count_sessions(caller)
            except BaseException:
                lock.release()
                raise
            if owned >= s.sessions_per_user:
                lock.release()
                raise ResourceExhausted(
                    f"sessions_per_user: {owned} sessions owned; the limit is {s.sessions_per_user}; "
                    "delete some to create more",
                    limit="sessions_per_user",
                    subject=subject,
                    retry_after_seconds=CAP_RETRY_SECONDS,
                )
            return lock.release
        return None
