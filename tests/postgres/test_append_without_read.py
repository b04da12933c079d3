"""Review of wip/turn5 (issue #15): AppendMessages without the session read, on PostgreSQL, with two
replicas (two stores, two engines) sharing one database. Whatever replica B did to the session,
replica A's append (which remembers the session's profile from its own earlier append) must answer
what an append that reads the session first answers."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from contextsvc.config import Settings
from contextsvc.core.messages import Flags, Message, Role
from contextsvc.core.session import Principal
from contextsvc.engine.engine import Engine
from contextsvc.engine.validation import IncomingMessage
from contextsvc.errors import NotFound
from contextsvc.ports import SessionProfileChanged
from contextsvc.stores.postgres import PostgresStore, make_postgres_store
from tests.postgres.conftest import two_profile_settings
from tests.support.engines import make_engine

ALICE = Principal(user_id="alice")
BOB = Principal(user_id="bob")


@pytest.fixture
def settings() -> Settings:
    return two_profile_settings()


@pytest.fixture
async def replicas(postgres_db: str, settings: Settings) -> AsyncIterator[tuple[Engine, Engine, PostgresStore]]:
    stores = [await make_postgres_store(postgres_db, settings) for _ in range(2)]
    engines = [make_engine(s, settings) for s in stores]
    try:
        yield engines[0], engines[1], stores[1]
    finally:
        for e in engines:
            await e.close()
        for s in stores:
            await s.close()


def _user(text: str, *, pinned: bool = False) -> list[IncomingMessage]:
    return [IncomingMessage(Message(role=Role.USER, content=text, flags=Flags(is_pinned=pinned)))]


async def _recreated(a: Engine, b: Engine, store_b: PostgresStore, *, owner: Principal, profile: str) -> str:
    """A session Alice created and appended to through A, then deleted and created again under the
    same id through B (``owner``, ``profile``)."""
    sid = (await a.sessions.create(ALICE, profile_id="small", name="", metadata={})).id
    await a.append(ALICE, sid, _user("hello"), request_id="", turn_complete=False)
    await b.sessions.delete(ALICE, sid)
    await store_b.create_session(caller=owner, profile_id=profile, session_id=sid)
    return sid


async def test_a_retry_on_a_replica_with_a_stale_profile_is_answered_for_the_sessions_profile(
    replicas: tuple[Engine, Engine, PostgresStore],
) -> None:
    """B recreated the session with profile ``big`` and appended request r1; the client's retry of r1
    lands on A. Found: the statement answers the replay before it looks at the profile (the replay
    branch has no profile check), so A prices the answer for ``small``: window_fraction is
    context_tokens / 16,000 instead of / 400,000 (the memory store raises SessionProfileChanged
    first, and the engine reads the session and answers right)."""
    a, b, store_b = replicas
    sid = await _recreated(a, b, store_b, owner=ALICE, profile="big")
    first = await b.append(ALICE, sid, _user("retry me"), request_id="r1", turn_complete=False)
    again = await a.append(ALICE, sid, _user("retry me"), request_id="r1", turn_complete=False)
    assert again.replayed and again.sequence_numbers == first.sequence_numbers
    assert again.context_tokens == first.context_tokens
    assert again.window_fraction == first.window_fraction == first.context_tokens / 400_000


async def test_the_store_refuses_a_replay_priced_for_another_profile_like_the_memory_store(
    replicas: tuple[Engine, Engine, PostgresStore],
) -> None:
    """The port's contract (``expected_profile_id``): SessionProfileChanged when the session's
    profile is another one; the row stores check it before the request id."""
    a, b, store_b = replicas
    sid = await _recreated(a, b, store_b, owner=ALICE, profile="big")
    row = [Message(role=Role.USER, content="x")]
    await store_b.append_messages(sid, row, caller=ALICE, request_id="r1", expected_profile_id="big")
    with pytest.raises(SessionProfileChanged):
        await store_b.append_messages(sid, row, caller=ALICE, request_id="r1", expected_profile_id="small")


async def test_an_append_after_another_replica_recreated_the_session_is_priced_for_its_new_profile(
    replicas: tuple[Engine, Engine, PostgresStore],
) -> None:
    a, b, store_b = replicas
    sid = await _recreated(a, b, store_b, owner=ALICE, profile="big")
    out = await a.append(ALICE, sid, _user("after"), request_id="", turn_complete=False)
    assert out.sequence_numbers == [1] and out.window_fraction == out.context_tokens / 400_000
    (stored,) = await store_b.get_messages(sid, caller=ALICE, first=1, last=1)
    assert stored.token_count == a.accounting.message_tokens("other", stored)


async def test_an_append_after_another_user_took_the_id_is_not_found_and_writes_nothing(
    replicas: tuple[Engine, Engine, PostgresStore],
) -> None:
    a, b, store_b = replicas
    sid = await _recreated(a, b, store_b, owner=BOB, profile="small")
    with pytest.raises(NotFound):
        await a.append(ALICE, sid, _user("mine?"), request_id="", turn_complete=False)
    with pytest.raises(NotFound):
        await a.append(ALICE, sid, _user("mine?"), request_id="r9", turn_complete=False)
    assert (await store_b.get_session(sid, caller=BOB)).last_sequence == 0


async def test_an_append_after_another_replica_deleted_the_session_is_not_found(
    replicas: tuple[Engine, Engine, PostgresStore],
) -> None:
    a, b, _ = replicas
    sid = (await a.sessions.create(ALICE, profile_id="small", name="", metadata={})).id
    await a.append(ALICE, sid, _user("hello"), request_id="r1", turn_complete=False)
    await b.sessions.delete(ALICE, sid)
    with pytest.raises(NotFound):
        await a.append(ALICE, sid, _user("hello"), request_id="r1", turn_complete=False)  # no replay either


async def test_a_pinned_append_after_a_recreation_with_a_bigger_window_is_accepted(
    replicas: tuple[Engine, Engine, PostgresStore],
) -> None:
    """Found (also on the memory store): the pinned cap is checked with the remembered profile's
    window before the store can report the profile change, so A refuses PINNED_CAP_EXCEEDED."""
    a, b, store_b = replicas
    sid = await _recreated(a, b, store_b, owner=ALICE, profile="big")
    text = "pinned fact number " * 2000  # ~6,000 tokens: over small's cap (4,000), within big's
    out = await a.append(ALICE, sid, _user(text, pinned=True), request_id="", turn_complete=False)
    assert out.sequence_numbers == [1]
