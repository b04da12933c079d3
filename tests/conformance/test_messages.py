"""Rows: appending (numbers, idempotency, counters), paging both buffers, ranges, the context index."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from contextsvc.core.messages import BufferKind, Message
from contextsvc.errors import InvalidArgument
from contextsvc.ports import SessionStore
from tests.conformance.helpers import (
    ADMIN,
    ALICE,
    BOB,
    Reopen,
    assistant,
    compression_record,
    image,
    seqs,
    summary,
    tool,
    user,
    without_store_fields,
)


async def _session(store: SessionStore) -> str:
    return (await store.create_session(caller=ALICE, profile_id="p")).id


async def test_append_numbers_rows_from_1_without_gaps(store: SessionStore) -> None:
    sid = await _session(store)
    first = [user("hello", is_pinned=True), assistant("", "c1"), tool("c1", "42")]
    r1 = await store.append_messages(sid, first, caller=ALICE)
    r2 = await store.append_messages(sid, [assistant("done")], caller=ALICE)
    assert (r1.sequence_numbers, r2.sequence_numbers) == ([1, 2, 3], [4])
    assert not r1.replayed and not r2.replayed
    assert (r2.session.last_sequence, r2.session.display_message_count, r2.session.context_message_count) == (4, 4, 4)
    rows = await store.get_messages(sid, caller=ALICE, first=1, last=4)
    assert seqs(rows) == [1, 2, 3, 4]
    assert [without_store_fields(m) for m in rows] == [*first, assistant("done")]
    for m in rows:
        assert m.create_time is not None and m.create_time.utcoffset() == timedelta(0)


async def test_a_given_create_time_is_kept_in_utc(store: SessionStore) -> None:
    sid = await _session(store)
    stamp = datetime(2025, 5, 1, 12, 30, 15, 123456, tzinfo=UTC)
    await store.append_messages(sid, [dataclasses.replace(user("old"), create_time=stamp)], caller=ALICE)
    (row,) = await store.get_messages(sid, caller=ALICE, first=1, last=1)
    assert row.create_time == stamp and row.create_time.utcoffset() == timedelta(0)


async def test_twenty_concurrent_appenders_get_contiguous_gap_free_numbers(store: SessionStore) -> None:
    sid = await _session(store)

    async def appender(k: int) -> list[tuple[list[int], list[str]]]:
        calls = []
        for i in range(5):
            contents = [f"writer {k} call {i} row {j}" for j in range(1 + (k + i) % 3)]
            result = await store.append_messages(sid, [user(c) for c in contents], caller=ALICE)
            calls.append((result.sequence_numbers, contents))
        return calls

    results = [call for calls in await asyncio.gather(*(appender(k) for k in range(20))) for call in calls]
    numbers = sorted(n for got, _ in results for n in got)
    assert numbers == list(range(1, len(numbers) + 1))
    rows = await store.get_messages(sid, caller=ALICE, first=1, last=len(numbers))
    for got, contents in results:
        assert got == list(range(got[0], got[0] + len(contents)))  # one call, one contiguous block
        assert [rows[n - 1].content for n in got] == contents
    assert (await store.get_session(sid, caller=ALICE)).last_sequence == len(numbers)


async def test_a_repeated_request_id_replays_the_first_result(store: SessionStore, reopen: Reopen) -> None:
    sid = await _session(store)
    other = await _session(store)
    first = await store.append_messages(
        sid, [user("a"), assistant("b")], caller=ALICE, request_id="r1", context_tokens_delta=7
    )
    again = await store.append_messages(
        sid, [user("something else")], caller=ALICE, request_id="r1", context_tokens_delta=100
    )
    assert (first.sequence_numbers, first.replayed) == ([1, 2], False)
    assert (again.sequence_numbers, again.replayed) == ([1, 2], True)
    assert (again.session.last_sequence, again.session.context_tokens, again.first_context_tokens) == (2, 7, 7)
    # Request ids are per session; an empty id is never deduplicated.
    assert (await store.append_messages(other, [user("x")], caller=ALICE, request_id="r1")).sequence_numbers == [1]
    assert (await store.append_messages(sid, [user("c")], caller=ALICE, context_tokens_delta=5)).sequence_numbers == [3]
    assert (await store.append_messages(sid, [user("d")], caller=ALICE, context_tokens_delta=5)).sequence_numbers == [4]

    store = await reopen()  # a client retrying after a restart still gets the first answer
    retried = await store.append_messages(sid, [user("a"), assistant("b")], caller=ALICE, request_id="r1")
    assert (retried.sequence_numbers, retried.replayed, retried.session.last_sequence) == ([1, 2], True, 4)
    # The context tokens as the first call left them, not the session's now (17).
    assert (retried.first_context_tokens, retried.session.context_tokens) == (7, 17)


async def test_context_tokens_delta_is_added_with_the_rows(store: SessionStore) -> None:
    sid = await _session(store)
    r1 = await store.append_messages(sid, [user("a")], caller=ALICE, context_tokens_delta=10)
    r2 = await store.append_messages(sid, [user("b")], caller=ALICE, context_tokens_delta=15)
    assert (r1.session.context_tokens, r2.session.context_tokens) == (10, 25)
    assert (await store.update_state(sid, caller=ALICE, context_tokens=4)).context_tokens == 4
    r3 = await store.append_messages(sid, [user("c")], caller=ALICE, context_tokens_delta=-1)
    assert r3.session.context_tokens == 3


async def test_counters_and_preview_follow_the_display_history(store: SessionStore) -> None:
    sid = await _session(store)
    long_text = "0123456789" * 10
    info = (await store.append_messages(sid, [user(long_text)], caller=ALICE)).session
    assert info.preview == long_text[:40]  # settings.preview_chars
    # A row without content (a bare tool call) leaves the preview on the newest text.
    info = (await store.append_messages(sid, [assistant("", "c1")], caller=ALICE)).session
    assert info.preview == long_text[:40]
    info = (await store.append_messages(sid, [tool("c1", "listing done")], caller=ALICE)).session
    assert info.preview == "listing done"
    # Context-only rows count in the context, not in the display history or the preview.
    await store.commit_compaction(
        sid, caller=ALICE, demote=[1], append=[summary("the summary", anchor=1, replaces=(1, 1))], context_tokens=9
    )
    info = await store.get_session(sid, caller=ALICE)
    assert (info.display_message_count, info.context_message_count, info.last_sequence) == (3, 3, 4)
    assert info.preview == "listing done"


async def _ten_with_a_summary(store: SessionStore) -> str:
    """Rows 1-10 displayed; 1, 2, 4-6 demoted; 11 a summary anchored at 1; 12 the record."""
    sid = await _session(store)
    await store.append_messages(sid, [user(f"m{i}", is_pinned=i == 3) for i in range(1, 11)], caller=ALICE)
    new = await store.commit_compaction(
        sid,
        caller=ALICE,
        demote=[1, 2, 4, 5, 6],
        append=[summary("S", anchor=1, replaces=(1, 6)), compression_record("compressed 1-6")],
        context_tokens=50,
    )
    assert new == [11, 12]
    return sid


async def test_display_pages_run_newest_first_and_return_oldest_first(store: SessionStore) -> None:
    sid = await _ten_with_a_summary(store)

    async def page(before: int, limit: int) -> list[int]:
        rows = await store.list_messages(
            sid, caller=ALICE, buffer=BufferKind.DISPLAY, before_sequence=before, limit=limit
        )
        return seqs(rows)

    # Row 11 is context-only: never in the display history.
    assert await page(0, 3) == [9, 10, 12]
    assert await page(0, 4) == [8, 9, 10, 12]
    assert await page(8, 3) == [5, 6, 7]
    assert await page(2, 50) == [1]
    assert await page(1, 50) == []
    assert await page(0, 100) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12]
    assert await page(0, 0) == []
    with pytest.raises(InvalidArgument):
        await store.list_messages(sid, caller=ALICE, buffer=BufferKind.DISPLAY, before_sequence=-1)


async def test_context_pages_are_cut_at_a_position_in_context_order(store: SessionStore) -> None:
    sid = await _ten_with_a_summary(store)

    async def page(before: int, limit: int, position: tuple[int, int] | None = None) -> list[int]:
        rows = await store.list_messages(
            sid, caller=ALICE, buffer=BufferKind.CONTEXT, before_sequence=before, before_position=position, limit=limit
        )
        return seqs(rows)

    # Context rows by sequence: 3, 7, 8, 9, 10, 11. The summary (11) sorts at its anchor (1).
    assert await page(0, 100) == [11, 3, 7, 8, 9, 10]
    assert await page(0, 3) == [8, 9, 10]
    # before_sequence N: the rows placed before message N (the summary stands at row 1's place).
    assert await page(8, 3) == [11, 3, 7]
    assert await page(3, 3) == [11]
    assert await page(1, 3) == []
    # A position: the (anchor, sequence) key of the oldest row of the previous page.
    assert await page(0, 2, (7, 7)) == [11, 3]
    assert await page(0, 2, (3, 3)) == [11]
    assert await page(0, 2, (1, 11)) == []
    with pytest.raises(InvalidArgument):
        await page(0, 2, (-1, 3))
    assert seqs(await store.load_context(sid, caller=ALICE)) == [11, 3, 7, 8, 9, 10]


async def test_get_messages_returns_both_buffers_by_sequence(store: SessionStore) -> None:
    sid = await _ten_with_a_summary(store)
    rows = await store.get_messages(sid, caller=ALICE, first=10, last=12)
    assert seqs(rows) == [10, 11, 12]
    assert [m.flags.is_display for m in rows] == [True, False, True]
    assert [m.flags.is_context for m in rows] == [True, True, False]
    assert seqs(await store.get_messages(sid, caller=ALICE, first=11, last=99)) == [11, 12]
    assert seqs(await store.get_messages(sid, caller=ALICE, first=0, last=2)) == [1, 2]
    assert await store.get_messages(sid, caller=ALICE, first=5, last=4) == []
    assert await store.get_messages(sid, caller=ALICE, first=13, last=20) == []


async def test_stored_rows_keep_every_field(store: SessionStore) -> None:
    sid = await _session(store)
    rich = Message(
        role=user("").role,
        content="look at these",
        images=(image(1), image(2)),
        thinking="",
        name="alice",
        metadata={"source": "ui", "nested": {"list": [1, "two", None, 3.5, True]}},
        token_count=321,
    )
    thinking = dataclasses.replace(assistant("answer", "c9"), thinking="hmm", token_count=12)
    await store.append_messages(sid, [rich, thinking, tool("c9", "x" * 5000)], caller=ALICE)
    rows = await store.get_messages(sid, caller=ALICE, first=1, last=3)
    assert [without_store_fields(m) for m in rows] == [rich, thinking, tool("c9", "x" * 5000)]


async def test_the_store_keeps_its_own_copy_of_metadata(store: SessionStore) -> None:
    sid = await _session(store)
    meta: dict[str, object] = {"k": ["v"]}
    await store.append_messages(sid, [Message(role=user().role, content="m", metadata=meta)], caller=ALICE)
    meta["k"] = "changed"
    (row,) = await store.get_messages(sid, caller=ALICE, first=1, last=1)
    assert row.metadata == {"k": ["v"]}


async def test_load_context_follows_anchors_and_flags(store: SessionStore) -> None:
    sid = await _session(store)
    await store.append_messages(sid, [user("a"), assistant("b"), user("c"), assistant("d")], caller=ALICE)
    await store.commit_compaction(
        sid,
        caller=ALICE,
        demote=[1, 2],
        append=[summary("S1", anchor=1, replaces=(1, 2)), compression_record("r1")],
        context_tokens=10,
    )
    await store.append_messages(sid, [user("e")], caller=ALICE)
    context = await store.load_context(sid, caller=ADMIN)
    assert [m.content for m in context] == ["S1", "c", "d", "e"]
    assert all(m.flags.is_context for m in context)


async def test_an_append_priced_for_another_profile_appends_nothing(store: SessionStore) -> None:
    """``expected_profile_id``: the engine appends without reading the session first; a session
    deleted and created again under the same id with another profile is refused, nothing written."""
    from contextsvc.errors import NotFound
    from contextsvc.ports import SessionProfileChanged

    sid = await _session(store)
    ok = await store.append_messages(sid, [user("a")], caller=ALICE, expected_profile_id="p")
    assert ok.sequence_numbers == [1]
    await store.delete_session(sid, caller=ALICE)
    with pytest.raises(NotFound):
        await store.append_messages(sid, [user("b")], caller=ALICE, expected_profile_id="p")
    await store.create_session(caller=ALICE, profile_id="q", session_id=sid)
    with pytest.raises(SessionProfileChanged):
        await store.append_messages(sid, [user("c")], caller=ALICE, expected_profile_id="p")
    with pytest.raises(NotFound):  # another user's session: not found, whatever its profile
        await store.append_messages(sid, [user("c")], caller=BOB, expected_profile_id="p")
    info = await store.get_session(sid, caller=ALICE)
    assert (info.last_sequence, info.display_message_count) == (0, 0)
    again = await store.append_messages(sid, [user("d")], caller=ALICE, expected_profile_id="q")
    assert again.sequence_numbers == [1]
    replay = await store.append_messages(sid, [user("d")], caller=ALICE, request_id="r1", expected_profile_id="q")
    assert await store.append_messages(
        sid, [user("d")], caller=ALICE, request_id="r1", expected_profile_id="q"
    ) == dataclasses.replace(replay, replayed=True, first_context_tokens=replay.session.context_tokens)


async def test_the_context_and_its_session_are_read_together(store: SessionStore) -> None:
    """``context_and_session`` gives what ``get_session`` and ``load_context`` give, of one moment."""
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(sid, [user("a"), user("b"), user("c")], caller=ALICE)
    await store.commit_compaction(
        sid, caller=ALICE, demote=[1, 2], append=[summary("s", anchor=1, replaces=(1, 2))], context_tokens=9
    )
    info, context = await store.context_and_session(sid, caller=ALICE)
    assert info == await store.get_session(sid, caller=ALICE)
    assert context == await store.load_context(sid, caller=ALICE)
    assert [m.content for m in context] == ["s", "c"] and info.context_tokens == 9
    await store.append_messages(sid, [user("d")], caller=ALICE)
    info, context = await store.context_and_session(sid, caller=ALICE)
    assert info.last_sequence == 5 and [m.content for m in context] == ["s", "c", "d"]
