"""Authentication: an ``authorization`` value -> the calling ``Principal`` (DESIGN §5.10).

Every refusal is ``Unauthenticated`` with a reason a client can act on: ``TOKEN_MISSING`` (no
credentials), ``TOKEN_INVALID`` (not a bearer token of ours, or no such token), ``TOKEN_REVOKED``,
``TOKEN_EXPIRED``. Nothing in a refusal depends on which users exist, and no message or log line
repeats the value the client sent.

Lookups are cached for ``auth.cache_seconds`` (unknown values too, so a client sending garbage
cannot make every call a store read), which bounds how long a revoked token keeps working on a
running server. ``last_used`` is written in the background, at most once per
``auth.last_used_interval_seconds`` per token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from datetime import datetime

from contextsvc.config import AuthSettings
from contextsvc.core.credentials import ApiToken, TokenState, bearer_token, hash_token, looks_like_token
from contextsvc.core.session import ANONYMOUS, Principal
from contextsvc.errors import ContextError, Unauthenticated
from contextsvc.ports import ApiTokenStore, Clock

log = logging.getLogger(__name__)

TOKEN_MISSING = "TOKEN_MISSING"
TOKEN_INVALID = "TOKEN_INVALID"
TOKEN_REVOKED = "TOKEN_REVOKED"
TOKEN_EXPIRED = "TOKEN_EXPIRED"


class Authenticator:
    """Checks bearer tokens against an ``ApiTokenStore``."""

    def __init__(self, tokens: ApiTokenStore, settings: AuthSettings, clock: Clock) -> None:
        self._tokens = tokens
        self._settings = settings
        self._clock = clock
        #: token hash -> (record or None when unknown, monotonic time of the lookup)
        self._cache: dict[str, tuple[ApiToken | None, float]] = {}
        #: token id -> wall time of the last use this process recorded (or saw recorded)
        self._touched: dict[str, datetime] = {}
        self._background: set[asyncio.Task[None]] = set()
        #: hashes of tokens this process accepted (the newest ``cache_entries``): from a peer whose
        #: failures are limited (``api/auth_limit.py``) these are still looked up.
        self._accepted: OrderedDict[str, None] = OrderedDict()

    def unvouched_lookup(self, authorization: str | None) -> bool:
        """Whether checking ``authorization`` would look up a token this process has not accepted
        lately: what a peer over its limit of failures is refused (a missing or malformed value
        costs no lookup, and is refused UNAUTHENTICATED as ever)."""
        secret = bearer_token(authorization) if authorization else None
        if secret is None or not looks_like_token(secret):
            return False
        return hash_token(secret) not in self._accepted

    async def authenticate(self, authorization: str | None) -> Principal:
        if not authorization:
            raise Unauthenticated(
                "this server requires an API token: send the metadata 'authorization: Bearer <token>'",
                reason=TOKEN_MISSING,
            )
        secret = bearer_token(authorization)
        if secret is None:
            raise Unauthenticated("the authorization metadata must be 'Bearer <token>'", reason=TOKEN_INVALID)
        if not looks_like_token(secret):
            raise Unauthenticated("the API token is not valid", reason=TOKEN_INVALID)
        token_hash = hash_token(secret)
        try:
            principal = await self._check(token_hash)
        except Unauthenticated:
            self._accepted.pop(token_hash, None)
            raise
        self._accepted[token_hash] = None
        self._accepted.move_to_end(token_hash)
        if len(self._accepted) > self._settings.cache_entries:
            self._accepted.popitem(last=False)
        return principal

    async def _check(self, token_hash: str) -> Principal:
        record = await self._lookup(token_hash)
        if record is None:
            raise Unauthenticated("the API token is not valid", reason=TOKEN_INVALID)
        now = self._clock.now()
        state = record.state(now)
        if state is TokenState.REVOKED:
            raise Unauthenticated("the API token was revoked", reason=TOKEN_REVOKED)
        if state is TokenState.EXPIRED:
            raise Unauthenticated("the API token has expired", reason=TOKEN_EXPIRED)
        if record.user_id == ANONYMOUS.user_id:
            # A token made before the name was reserved (or written by hand into a tokens file or
            # table) would own every session made while authentication was off.
            raise Unauthenticated(
                f"the API token's user name {ANONYMOUS.user_id!r} is reserved: revoke it, create one for another",
                reason=TOKEN_INVALID,
            )
        self._note_use(record, now)
        return Principal(user_id=record.user_id, is_admin=record.is_admin)

    async def close(self) -> None:
        """Wait for ``last_used`` writes still running."""
        while self._background:
            await asyncio.wait(list(self._background))

    async def _lookup(self, token_hash: str) -> ApiToken | None:
        ttl = self._settings.cache_seconds
        now = time.monotonic()
        cached = self._cache.get(token_hash)
        if cached is not None and now - cached[1] < ttl:
            return cached[0]
        record = await self._tokens.find_api_token(token_hash)
        if ttl > 0:
            if len(self._cache) >= self._settings.cache_entries:
                self._evict(now, ttl)
            self._cache[token_hash] = (record, now)
        return record

    def _evict(self, now: float, ttl: float) -> None:
        stale = [h for h, (_, at) in self._cache.items() if now - at >= ttl]
        for h in stale:
            del self._cache[h]
        if len(self._cache) >= self._settings.cache_entries:
            self._cache.clear()  # all fresh: a flood of distinct values; start over

    def _note_use(self, record: ApiToken, now: datetime) -> None:
        interval = self._settings.last_used_interval_seconds
        last = self._touched.get(record.token_id) or record.last_used_time
        if last is not None and (now - last).total_seconds() < interval:
            return
        self._touched[record.token_id] = now
        task = asyncio.create_task(self._touch(record.token_id, now), name="contextsvc-token-touch")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _touch(self, token_id: str, when: datetime) -> None:
        try:
            await self._tokens.touch_api_token(token_id, when)
        except (ContextError, OSError) as exc:
            # Bookkeeping only: a failed write never fails the call that used the token.
            log.warning("could not record a token's last use", extra={"token_id": token_id, "error": str(exc)})
