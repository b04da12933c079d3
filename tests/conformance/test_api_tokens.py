"""API tokens (DESIGN §5.10) in every store: only hashes stored, revocation and last use durable."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from contextsvc.core.credentials import TokenState, hash_token, issue
from contextsvc.ports import ApiTokenStore, SessionStore
from contextsvc.stores.token_access import tokens_of
from tests.conformance.helpers import Reopen

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def tokens(store: SessionStore) -> ApiTokenStore:
    return tokens_of(store)


async def test_a_token_is_found_by_its_hash_only_and_survives_a_reopen(store: SessionStore, reopen: Reopen) -> None:
    alice = issue(user="alice", is_admin=False, now=T0, expire_time=T0 + timedelta(days=90), note="ci")
    root = issue(user="root", is_admin=True, now=T0 + timedelta(seconds=1), expire_time=None)
    await tokens(store).add_api_token(alice.record)
    await tokens(store).add_api_token(root.record)

    found = await tokens(store).find_api_token(hash_token(alice.secret))
    assert found == alice.record
    assert await tokens(store).find_api_token(alice.secret) is None  # the secret itself is no key
    assert await tokens(store).find_api_token(hash_token(alice.secret + "x")) is None

    store = await reopen()
    listed = await tokens(store).list_api_tokens()
    assert [t.token_id for t in listed] == [alice.record.token_id, root.record.token_id]
    assert listed[0].user_id == "alice" and not listed[0].is_admin and listed[0].note == "ci"
    assert listed[0].expire_time == T0 + timedelta(days=90)
    assert listed[1].is_admin and listed[1].expire_time is None
    # Nothing the store keeps is the secret.
    for t in listed:
        assert "ctx_" not in repr(t)


async def test_revocation_and_last_use_are_recorded_and_kept(store: SessionStore, reopen: Reopen) -> None:
    issued = issue(user="bob", is_admin=False, now=T0, expire_time=None)
    await tokens(store).add_api_token(issued.record)
    await tokens(store).touch_api_token(issued.record.token_id, T0 + timedelta(minutes=5))
    await tokens(store).touch_api_token(issued.record.token_id, T0 + timedelta(minutes=1))  # older: ignored

    revoked = await tokens(store).revoke_api_token(issued.record.token_id, T0 + timedelta(hours=1))
    assert revoked is not None and revoked.revoke_time == T0 + timedelta(hours=1)
    again = await tokens(store).revoke_api_token(issued.record.token_id, T0 + timedelta(hours=2))
    assert again is not None and again.revoke_time == T0 + timedelta(hours=1)  # first revocation kept
    assert await tokens(store).revoke_api_token("no-such-id", T0) is None

    store = await reopen()
    found = await tokens(store).find_api_token(issued.record.token_hash)
    assert found is not None
    assert found.last_used_time == T0 + timedelta(minutes=5)
    assert found.state(T0 + timedelta(hours=3)) is TokenState.REVOKED


async def test_a_duplicate_token_is_refused(store: SessionStore) -> None:
    issued = issue(user="carol", is_admin=False, now=T0, expire_time=None)
    await tokens(store).add_api_token(issued.record)
    with pytest.raises(Exception):  # noqa: B017 - ValueError in process, a unique violation in PostgreSQL
        await tokens(store).add_api_token(issued.record)
    assert len(await tokens(store).list_api_tokens()) == 1
