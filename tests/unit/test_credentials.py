"""API tokens in the core: their shape, their hash, expiry parsing; the authenticator's verdicts."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from contextsvc.config import AuthSettings
from contextsvc.core.credentials import (
    TOKEN_PREFIX,
    TokenState,
    bearer_token,
    check_user,
    hash_token,
    issue,
    looks_like_token,
    parse_expiry,
)
from contextsvc.engine.authn import Authenticator
from contextsvc.errors import Unauthenticated
from contextsvc.stores.api_tokens import MemoryTokenStore

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_a_token_has_the_prefix_and_256_random_bits_and_is_stored_as_its_sha256() -> None:
    issued = issue(user="alice", is_admin=False, now=T0, expire_time=None)
    assert issued.secret.startswith(TOKEN_PREFIX)
    raw = base64.urlsafe_b64decode(issued.secret.removeprefix(TOKEN_PREFIX) + "=")
    assert len(raw) * 8 == 256
    assert looks_like_token(issued.secret)
    assert issued.record.token_hash == hash_token(issued.secret)
    assert len(issued.record.token_hash) == 64 and issued.secret not in repr(issued.record)
    secrets_seen = {issue(user="a", is_admin=False, now=T0, expire_time=None).secret for _ in range(200)}
    assert len(secrets_seen) == 200


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90d", T0 + timedelta(days=90)),
        ("12h", T0 + timedelta(hours=12)),
        ("4w", T0 + timedelta(weeks=4)),
        ("never", None),
        (" Never ", None),
    ],
)
def test_expiry_durations(text: str, expected: datetime | None) -> None:
    assert parse_expiry(text, T0) == expected


@pytest.mark.parametrize("text", ["0d", "90", "-1d", "1y", "90 days", "1.5d", "", "0", "  "])
def test_bad_expiry_is_refused_naming_the_forms(text: str) -> None:
    with pytest.raises(ValueError, match="90d"):
        parse_expiry(text, T0)


@pytest.mark.parametrize("name", ["", " alice", "a b", "-x", "x" * 129, "al\nice", "é", "anonymous"])
def test_bad_user_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError):
        check_user(name)


def test_bearer_parsing() -> None:
    assert bearer_token("Bearer ctx_abc") == "ctx_abc"
    assert bearer_token("bearer   ctx_abc ") == "ctx_abc"
    assert bearer_token("Basic dXNlcjpwdw==") is None
    assert bearer_token("Bearer") is None
    assert bearer_token("ctx_abc") is None


class Clock:
    def __init__(self) -> None:
        self.current = T0

    def now(self) -> datetime:
        return self.current


class CountingTokens(MemoryTokenStore):
    def __init__(self) -> None:
        super().__init__()
        self.finds = 0
        self.touches = 0

    async def find_api_token(self, token_hash: str):  # type: ignore[no-untyped-def]
        self.finds += 1
        return await super().find_api_token(token_hash)

    async def touch_api_token(self, token_id: str, when: datetime) -> None:
        self.touches += 1
        await super().touch_api_token(token_id, when)


async def _refusal(auth: Authenticator, header: str | None) -> str:
    with pytest.raises(Unauthenticated) as caught:
        await auth.authenticate(header)
    return caught.value.reason


async def test_every_refusal_has_its_reason_and_never_echoes_the_value() -> None:
    store, clock = CountingTokens(), Clock()
    auth = Authenticator(store, AuthSettings(cache_seconds=0), clock)
    good = issue(user="alice", is_admin=False, now=T0, expire_time=T0 + timedelta(days=1))
    revoked = issue(user="bob", is_admin=False, now=T0, expire_time=None)
    await store.add_api_token(good.record)
    await store.add_api_token(revoked.record)
    await store.revoke_api_token(revoked.record.token_id, T0)

    principal = await auth.authenticate(f"Bearer {good.secret}")
    assert (principal.user_id, principal.is_admin) == ("alice", False)

    assert await _refusal(auth, None) == "TOKEN_MISSING"
    assert await _refusal(auth, "") == "TOKEN_MISSING"
    assert await _refusal(auth, "Basic abc") == "TOKEN_INVALID"
    assert await _refusal(auth, "Bearer not-a-token") == "TOKEN_INVALID"
    unknown = issue(user="alice", is_admin=False, now=T0, expire_time=None).secret
    assert await _refusal(auth, f"Bearer {unknown}") == "TOKEN_INVALID"
    assert await _refusal(auth, f"Bearer {revoked.secret}") == "TOKEN_REVOKED"
    clock.current = T0 + timedelta(days=1)
    assert await _refusal(auth, f"Bearer {good.secret}") == "TOKEN_EXPIRED"
    # A token of the reserved user name (made before it was reserved, or written by hand into a
    # tokens file or table): it would own every session made while authentication was off.
    legacy = issue(user="alice", is_admin=False, now=T0, expire_time=None)
    await store.add_api_token(dataclasses.replace(legacy.record, user_id="anonymous"))
    assert await _refusal(auth, f"Bearer {legacy.secret}") == "TOKEN_INVALID"
    for header in (f"Bearer {unknown}", f"Bearer {revoked.secret}", f"Bearer {good.secret}"):
        with pytest.raises(Unauthenticated) as caught:
            await auth.authenticate(header)
        assert header.split()[1] not in caught.value.message
    await auth.close()


async def test_lookups_are_cached_and_last_use_is_written_at_most_once_per_interval() -> None:
    store, clock = CountingTokens(), Clock()
    auth = Authenticator(store, AuthSettings(cache_seconds=60, last_used_interval_seconds=60), clock)
    issued = issue(user="alice", is_admin=True, now=T0, expire_time=None)
    await store.add_api_token(issued.record)
    for i in range(100):
        clock.current = T0 + timedelta(seconds=i * 0.5)
        await auth.authenticate(f"Bearer {issued.secret}")
    await asyncio.sleep(0)
    await auth.close()
    assert store.finds == 1
    assert store.touches == 1  # 50 s of calls: one write
    clock.current = T0 + timedelta(seconds=61)
    await auth.authenticate(f"Bearer {issued.secret}")
    await auth.close()
    assert store.touches == 2
    found = await store.find_api_token(issued.record.token_hash)
    assert found is not None and found.last_used_time == T0 + timedelta(seconds=61)
    assert found.state(clock.current) is TokenState.ACTIVE
