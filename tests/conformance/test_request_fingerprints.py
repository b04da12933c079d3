"""A request id reused with a different body is refused on every store, and nothing is appended."""

from __future__ import annotations

import pytest

from contextsvc.errors import NotFound, RequestIdReused
from contextsvc.ports import SessionStore
from tests.conformance.helpers import ALICE, BOB, Reopen, assistant, user


async def test_reused_request_id_with_another_fingerprint_is_refused(store: SessionStore, reopen: Reopen) -> None:
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    first = await store.append_messages(
        sid, [user("a"), assistant("b")], caller=ALICE, request_id="r1", request_fingerprint="v1:aaa"
    )
    same = await store.append_messages(
        sid, [user("a"), assistant("b")], caller=ALICE, request_id="r1", request_fingerprint="v1:aaa"
    )
    assert (first.sequence_numbers, first.replayed) == ([1, 2], False)
    assert (same.sequence_numbers, same.replayed) == ([1, 2], True)
    with pytest.raises(RequestIdReused) as caught:
        await store.append_messages(sid, [user("other")], caller=ALICE, request_id="r1", request_fingerprint="v1:bbb")
    assert caught.value.reason == "REQUEST_ID_REUSED"
    assert caught.value.metadata == {"request_id": "r1"}
    assert [v.field for v in caught.value.violations] == ["request_id"]
    assert (await store.get_session(sid, caller=ALICE)).last_sequence == 2

    # The fingerprint is part of the durable idempotency record: it survives a restart.
    store = await reopen()
    with pytest.raises(RequestIdReused):
        await store.append_messages(sid, [user("other")], caller=ALICE, request_id="r1", request_fingerprint="v1:bbb")
    again = await store.append_messages(sid, [user("a")], caller=ALICE, request_id="r1", request_fingerprint="v1:aaa")
    assert (again.sequence_numbers, again.replayed, again.session.last_sequence) == ([1, 2], True, 2)
    # The same id in another session is another request.
    other = (await store.create_session(caller=ALICE, profile_id="p")).id
    assert (
        await store.append_messages(other, [user("x")], caller=ALICE, request_id="r1", request_fingerprint="v1:bbb")
    ).sequence_numbers == [1]


async def test_records_without_a_fingerprint_still_replay(store: SessionStore, reopen: Reopen) -> None:
    """Idempotency records written before fingerprints existed (or by a caller that sends none)
    cannot be compared: the retry replays, as before."""
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(sid, [user("a")], caller=ALICE, request_id="old")
    store = await reopen()
    replay = await store.append_messages(
        sid, [user("changed")], caller=ALICE, request_id="old", request_fingerprint="v1:new"
    )
    assert (replay.sequence_numbers, replay.replayed) == ([1], True)
    await store.append_messages(sid, [user("b")], caller=ALICE, request_id="new", request_fingerprint="v1:fp")
    unchecked = await store.append_messages(sid, [user("c")], caller=ALICE, request_id="new")
    assert (unchecked.sequence_numbers, unchecked.replayed, unchecked.session.last_sequence) == ([2], True, 2)


async def test_a_replayed_append_is_read_without_appending(store: SessionStore, reopen: Reopen) -> None:
    """``replayed_append``: the answer a repeat of a request id would get, or None; nothing written."""
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    assert await store.replayed_append(sid, "r1", caller=ALICE, request_fingerprint="v1:aaa") is None
    first = await store.append_messages(
        sid, [user("a"), assistant("b")], caller=ALICE, request_id="r1", request_fingerprint="v1:aaa"
    )
    await store.append_messages(sid, [user("c")], caller=ALICE)
    for reopened in (False, True):
        current = await reopen() if reopened else store  # the record is durable
        replay = await current.replayed_append(sid, "r1", caller=ALICE, request_fingerprint="v1:aaa")
        assert replay is not None
        assert (replay.sequence_numbers, replay.replayed) == (first.sequence_numbers, True)
        assert (
            replay.first_context_tokens
            == (
                await current.append_messages(
                    sid, [user("a"), assistant("b")], caller=ALICE, request_id="r1", request_fingerprint="v1:aaa"
                )
            ).first_context_tokens
        )
        with pytest.raises(RequestIdReused):
            await current.replayed_append(sid, "r1", caller=ALICE, request_fingerprint="v1:bbb")
        assert await current.replayed_append(sid, "r2", caller=ALICE) is None
        assert (await current.get_session(sid, caller=ALICE)).last_sequence == 3
    with pytest.raises(NotFound):
        await current.replayed_append(sid, "r1", caller=BOB)
