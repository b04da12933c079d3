"""Context flags, engine state and compaction: explicit, persisted, atomic."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from contextsvc.config import Settings
from contextsvc.core.session import Principal
from contextsvc.errors import Conflict, NotFound
from contextsvc.ports import HistoryChunk, SessionStore
from tests.conformance.helpers import (
    ALICE,
    BOB,
    Reopen,
    assistant,
    compression_record,
    seqs,
    snapshot,
    summary,
    tool,
    user,
)
from tests.support.stores import Backing, TickingClock


async def _session_with(store: SessionStore, n: int) -> str:
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(sid, [user(f"m{i}", is_pinned=i == 3) for i in range(1, n + 1)], caller=ALICE)
    return sid


async def test_set_context_flags_demotes_and_promotes_and_persists(store: SessionStore, reopen: Reopen) -> None:
    sid = await _session_with(store, 5)
    await store.set_context_flags(sid, [2, 4], caller=ALICE, is_context=False)
    assert seqs(await store.load_context(sid, caller=ALICE)) == [1, 3, 5]
    info = await store.get_session(sid, caller=ALICE)
    assert (info.context_message_count, info.display_message_count) == (3, 5)
    await store.set_context_flags(sid, [4], caller=ALICE, is_context=True)
    assert seqs(await store.load_context(sid, caller=ALICE)) == [1, 3, 4, 5]
    # Setting a flag to the value it has is harmless.
    await store.set_context_flags(sid, [1, 1, 3], caller=ALICE, is_context=True)
    rows = await store.get_messages(sid, caller=ALICE, first=1, last=5)
    assert [m.flags.is_context for m in rows] == [True, False, True, True, True]

    store = await reopen()
    assert seqs(await store.load_context(sid, caller=ALICE)) == [1, 3, 4, 5]
    assert (await store.get_session(sid, caller=ALICE)).context_message_count == 4


async def test_unknown_sequence_numbers_change_nothing(store: SessionStore) -> None:
    sid = await _session_with(store, 3)
    before = await snapshot(store, sid)
    with pytest.raises(NotFound):
        await store.set_context_flags(sid, [2, 99], caller=ALICE, is_context=False)
    with pytest.raises(NotFound):
        await store.set_context_flags(sid, [0], caller=ALICE, is_context=False)
    assert await snapshot(store, sid) == before


async def test_update_state_replaces_only_the_given_values(store: SessionStore, reopen: Reopen) -> None:
    sid = await _session_with(store, 1)
    info = await store.update_state(sid, caller=ALICE, context_tokens=120, state={"baseline": {"tokens": 100}})
    assert (info.context_tokens, info.context_truncated, info.state) == (120, False, {"baseline": {"tokens": 100}})
    info = await store.update_state(sid, caller=ALICE, context_truncated=True)
    assert (info.context_tokens, info.context_truncated, info.state) == (120, True, {"baseline": {"tokens": 100}})
    info = await store.update_state(sid, caller=ALICE, state={"epoch": 2})
    assert (info.context_tokens, info.context_truncated, info.state) == (120, True, {"epoch": 2})
    store = await reopen()
    assert await store.get_session(sid, caller=ALICE) == info


async def test_update_state_as_of_a_read_keeps_what_appends_added_since(store: SessionStore, reopen: Reopen) -> None:
    """A baseline's anchor is priced on a read; appends committed after it (they take no
    compaction lock) keep what they added: ``context_tokens_as_of`` is the count that read saw."""
    sid = await _session_with(store, 1)
    read = await store.update_state(sid, caller=ALICE, context_tokens=50)
    await store.append_messages(sid, [user("after the read")], caller=ALICE, context_tokens_delta=7)
    info = await store.update_state(
        sid, caller=ALICE, context_tokens=120, context_tokens_as_of=read.context_tokens, state={"epoch": 1}
    )
    assert (info.context_tokens, info.state) == (127, {"epoch": 1})
    # Without appends since the read it is the plain write; without a read, the absolute one.
    info = await store.update_state(sid, caller=ALICE, context_tokens=90, context_tokens_as_of=info.context_tokens)
    assert info.context_tokens == 90
    info = await store.update_state(sid, caller=ALICE, context_truncated=True, context_tokens_as_of=3)
    assert (info.context_tokens, info.context_truncated) == (90, True)
    store = await reopen()
    assert await store.get_session(sid, caller=ALICE) == info


async def test_a_state_written_only_if_unchanged_is_written_when_nothing_changed(
    store: SessionStore, reopen: Reopen
) -> None:
    sid = await _session_with(store, 2)
    read = await store.update_state(sid, caller=ALICE, context_truncated=True, state={"epoch": 3})
    info = await store.update_state_if_unchanged(
        sid, caller=ALICE, read=read, context_tokens=77, state={"epoch": 3, "baseline": {"tokens": 70}}
    )
    assert info is not None
    assert (info.context_tokens, info.context_truncated, info.state) == (
        77,
        False,
        {"epoch": 3, "baseline": {"tokens": 70}},
    )
    assert info.last_sequence == read.last_sequence == 2
    assert await store.get_session(sid, caller=ALICE) == info
    # Against the session it wrote, the next write applies too; against the older read, not.
    again = await store.update_state_if_unchanged(sid, caller=ALICE, read=info, context_tokens=80, state={"epoch": 4})
    assert again is not None and (again.context_tokens, again.state) == (80, {"epoch": 4})
    assert await store.update_state_if_unchanged(sid, caller=ALICE, read=read, context_tokens=1, state={}) is None
    assert await store.get_session(sid, caller=ALICE) == again
    # Written like update_state(durable=False): a clean close keeps it.
    store = await reopen()
    assert await store.get_session(sid, caller=ALICE) == again


async def test_a_state_written_only_if_unchanged_is_refused_after_any_change(store: SessionStore) -> None:
    sid = await _session_with(store, 2)
    read = await store.get_session(sid, caller=ALICE)

    async def refused() -> None:
        got = await store.update_state_if_unchanged(
            sid, caller=ALICE, read=read, context_tokens=5, state={"baseline": {"tokens": 5}}
        )
        assert got is None

    # Another writer's state (a compaction's new cycle, a memory-flush mark, ...).
    await store.update_state(sid, caller=ALICE, state={"epoch": 1})
    await refused()
    read = await store.update_state(sid, caller=ALICE, state={})
    # The same state again, but a row appended meanwhile (its tokens are not in the anchor).
    await store.append_messages(sid, [user("late")], caller=ALICE)
    await refused()
    stale, read = read, await store.get_session(sid, caller=ALICE)
    before = await snapshot(store, sid)
    # Strangers get nothing written, and no hint that the session exists.
    assert await store.update_state_if_unchanged(sid, caller=BOB, read=read, context_tokens=5, state={}) is None
    assert await store.update_state_if_unchanged("no-such", caller=ALICE, read=read, context_tokens=5, state={}) is None
    assert await snapshot(store, sid) == before
    assert (await store.get_session(sid, caller=ALICE)).state == read.state
    # An admin's refused write is not audited (nothing of the session was touched); a written one
    # is, once.
    audited: list[str] = []
    admin = Principal("root", is_admin=True, on_foreign_read=audited.append)
    assert await store.update_state_if_unchanged(sid, caller=admin, read=stale, context_tokens=5, state={}) is None
    assert audited == []
    # Deleted: nothing to write.
    await store.delete_session(sid, caller=ALICE)
    await refused()
    # Created again under the same id, with the same rows, counters and state as the old read:
    # only its create time tells it apart, and that refuses the write.
    again = await store.create_session(caller=ALICE, profile_id="p", session_id=sid)
    await store.append_messages(sid, [user(f"n{i}") for i in range(read.last_sequence)], caller=ALICE)
    now = await store.get_session(sid, caller=ALICE)
    assert (now.last_sequence, now.state) == (read.last_sequence, read.state) and again.create_time != read.create_time
    await refused()
    assert (await store.get_session(sid, caller=ALICE)).context_tokens == now.context_tokens
    written = await store.update_state_if_unchanged(sid, caller=admin, read=now, context_tokens=9, state={})
    assert written is not None and written.context_tokens == 9 and audited == ["alice"]


async def test_compaction_as_of_a_read_keeps_what_appends_added_since(store: SessionStore, reopen: Reopen) -> None:
    """Appends take no compaction lock: those committed after the compaction read the context stay
    in it, and ``context_tokens_as_of`` (the count that read saw) keeps their tokens in the count."""
    sid = await _session_with(store, 6)
    read = await store.update_state(sid, caller=ALICE, context_tokens=300)
    await store.append_messages(sid, [user("meanwhile")], caller=ALICE, context_tokens_delta=11)
    await store.commit_compaction(
        sid,
        caller=ALICE,
        demote=[1, 2],
        append=[summary("summary of 1-2", anchor=1, replaces=(1, 2)), compression_record("compressed 1-2")],
        context_tokens=120,
        state={"epoch": 1},
        context_tokens_as_of=read.context_tokens,
    )
    info = await store.get_session(sid, caller=ALICE)
    assert (info.context_tokens, info.state, info.last_sequence) == (131, {"epoch": 1}, 9)
    store = await reopen()
    assert await store.get_session(sid, caller=ALICE) == info


async def test_compaction_places_the_summary_first_and_keeps_pinned_rows(store: SessionStore, reopen: Reopen) -> None:
    sid = await _session_with(store, 10)
    new = await store.commit_compaction(
        sid,
        caller=ALICE,
        demote=[1, 2, 4, 5, 6],
        append=[summary("summary of 1-6", anchor=1, replaces=(1, 6)), compression_record("compressed 1-6")],
        context_tokens=42,
        state={"epoch": 1},
    )
    assert new == [11, 12]
    expected = [11, 3, 7, 8, 9, 10]  # summary at its anchor, then the pinned row, then the kept ones
    context = await store.load_context(sid, caller=ALICE)
    assert seqs(context) == expected
    assert context[0].replaces == (1, 6) and context[0].flags.is_summary and not context[0].flags.is_display
    assert context[1].flags.is_pinned
    info = await store.get_session(sid, caller=ALICE)
    assert (info.context_tokens, info.state, info.last_sequence) == (42, {"epoch": 1}, 12)
    assert (info.context_message_count, info.display_message_count) == (6, 11)
    # The display history is never rewritten: every original row is still there, plus the record.
    rows = await store.get_messages(sid, caller=ALICE, first=1, last=12)
    assert [m.content for m in rows[:10]] == [f"m{i}" for i in range(1, 11)]
    assert rows[11].flags.is_compression and not rows[11].flags.is_context

    store = await reopen()
    assert seqs(await store.load_context(sid, caller=ALICE)) == expected
    assert await store.get_session(sid, caller=ALICE) == info


async def test_a_failing_compaction_changes_nothing(store: SessionStore) -> None:
    sid = await _session_with(store, 4)
    before = await snapshot(store, sid)
    with pytest.raises(NotFound):
        await store.commit_compaction(
            sid, caller=ALICE, demote=[1, 2, 77], append=[summary("S", anchor=1, replaces=(1, 2))], context_tokens=1
        )
    assert await snapshot(store, sid) == before


async def test_readers_see_the_old_or_the_new_context_never_a_mix(store: SessionStore) -> None:
    sid = await _session_with(store, 40)
    old = seqs(await store.load_context(sid, caller=ALICE))
    demote = list(range(1, 31))
    task = asyncio.ensure_future(
        store.commit_compaction(
            sid,
            caller=ALICE,
            demote=demote,
            append=[summary("S", anchor=1, replaces=(1, 30)), compression_record("r")],
            context_tokens=5,
        )
    )
    seen: list[list[int]] = []
    while not task.done():
        seen.append(seqs(await store.load_context(sid, caller=ALICE)))
        await asyncio.sleep(0)
    await task
    new = [41, *range(31, 41)]
    seen.append(seqs(await store.load_context(sid, caller=ALICE)))
    assert all(s in (old, new) for s in seen)
    assert seen[-1] == new


async def test_a_demoted_summary_stays_demoted_after_a_restart(store: SessionStore, reopen: Reopen) -> None:
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(
        sid,
        [user("q1"), assistant("", "c1"), tool("c1", "r1"), assistant("a1"), user("q2"), assistant("a2")],
        caller=ALICE,
    )
    first = await store.commit_compaction(
        sid,
        caller=ALICE,
        demote=[1, 2, 3, 4],
        append=[summary("S1", anchor=1, replaces=(1, 4)), compression_record("c1")],
        context_tokens=20,
    )
    assert first == [7, 8]
    await store.append_messages(sid, [user("q3"), assistant("a3")], caller=ALICE)
    # The second compaction demotes the older summary (a context-only row) with the turn it covered.
    second = await store.commit_compaction(
        sid,
        caller=ALICE,
        demote=[7, 5, 6],
        append=[summary("S2", anchor=1, replaces=(1, 6)), compression_record("c2")],
        context_tokens=15,
    )
    assert second == [11, 12]
    expected = ["S2", "q3", "a3"]
    assert [m.content for m in await store.load_context(sid, caller=ALICE)] == expected
    before = await snapshot(store, sid)

    store = await reopen()
    assert [m.content for m in await store.load_context(sid, caller=ALICE)] == expected
    old_summary = (await store.get_messages(sid, caller=ALICE, first=7, last=7))[0]
    assert old_summary.flags.is_summary and not old_summary.flags.is_context and not old_summary.flags.is_display
    assert await snapshot(store, sid) == before


async def _compact(store: SessionStore, sid: str, demote: list[int], *, tokens: int, epoch: int) -> list[int]:
    first, last = min(demote), max(demote)
    return await store.commit_compaction(
        sid,
        caller=ALICE,
        demote=demote,
        append=[summary(f"S{first}-{last}", anchor=first, replaces=(first, last)), compression_record("r")],
        context_tokens=tokens,
        state={"epoch": epoch},
    )


async def test_demoting_a_row_already_out_of_the_context_conflicts_and_changes_nothing(
    store: SessionStore, reopen: Reopen
) -> None:
    sid = await _session_with(store, 8)
    assert await _compact(store, sid, [1, 2], tokens=30, epoch=1) == [9, 10]
    # Out of the context by hand: a display row and a context-only row (the first summary).
    await store.set_context_flags(sid, [6, 9], caller=ALICE, is_context=False)
    before = await snapshot(store, sid)

    # Planned on a context read before the first compaction: 2 is gone (and 6).
    with pytest.raises(Conflict) as raised:
        await _compact(store, sid, [6, 4, 2, 3], tokens=5, epoch=2)
    assert raised.value.reason == "COMPACTION_CONFLICT"
    assert raised.value.metadata["sequence_number"] == "2"  # the smallest offending number
    assert "#2" in raised.value.message
    with pytest.raises(Conflict) as raised:
        await _compact(store, sid, [9, 3, 4], tokens=5, epoch=2)
    assert raised.value.metadata["sequence_number"] == "9"
    # A number no row has is still NotFound, even next to a row that conflicts.
    with pytest.raises(NotFound):
        await _compact(store, sid, [2, 3, 99], tokens=5, epoch=2)
    assert await snapshot(store, sid) == before  # rows, both buffers, counters, state

    store = await reopen()
    assert await snapshot(store, sid) == before  # nothing of the refused commits was persisted
    # The rows still in context can be compacted: the check refuses only what it must.
    assert await _compact(store, sid, [3, 4], tokens=20, epoch=2) == [11, 12]
    assert seqs(await store.load_context(sid, caller=ALICE)) == [11, 5, 7, 8]


async def test_the_second_of_two_overlapping_compactions_from_two_store_objects_conflicts(
    store: SessionStore, backing: Backing, clock: TickingClock, settings: Settings
) -> None:
    """Two replicas that both planned on the same context (their compaction lock was lost): the
    first commit wins, the second changes nothing."""
    sid = await _session_with(store, 8)
    planned = seqs(await store.load_context(sid, caller=ALICE))
    assert planned == list(range(1, 9))
    await _compact(store, sid, [1, 2, 3, 4], tokens=40, epoch=1)
    # A second store object over the same backing (for the files store, which one process owns,
    # opened after the first commit; memory and PostgreSQL would see it live as well).
    other = await backing.open(clock=clock, settings=settings)
    before = await snapshot(other, sid)
    assert before == await snapshot(store, sid)
    with pytest.raises(Conflict) as raised:
        await _compact(other, sid, [3, 4, 5, 6], tokens=10, epoch=1)
    assert (raised.value.reason, raised.value.metadata["sequence_number"]) == ("COMPACTION_CONFLICT", "3")
    assert await snapshot(other, sid) == before
    assert await snapshot(store, sid) == before
    info = await other.get_session(sid, caller=ALICE)
    assert (info.context_tokens, info.state, info.last_sequence) == (40, {"epoch": 1}, 10)
    assert seqs(await other.load_context(sid, caller=ALICE)) == [9, 5, 6, 7, 8]


def _chunk(text: str, first: int, last: int) -> HistoryChunk:
    return HistoryChunk(hashlib.sha256(text.encode()).hexdigest(), text, first, last, None, None)


async def test_a_compaction_stores_its_history_chunks_in_the_same_step(store: SessionStore, reopen: Reopen) -> None:
    """The demoted rows' chunks come with the commit (never after it, where a crash could lose
    them), are idempotent like ``add_history_chunks``, and a refused commit stores none."""
    sid = await _session_with(store, 8)
    chunks = [_chunk("m1 ran the zanzibar_migration", 1, 1), _chunk("m2 checked quokka_flags", 2, 2)]
    await store.commit_compaction(
        sid,
        caller=ALICE,
        demote=[1, 2],
        append=[summary("S1-2", anchor=1, replaces=(1, 2)), compression_record("r")],
        context_tokens=30,
        history=chunks,
    )
    found = await store.search_history(sid, "zanzibar_migration quokka_flags", limit=10)
    assert sorted(s.chunk.text for s in found) == sorted(c.text for c in chunks)
    # A chunk the session already has is skipped.
    assert await store.add_history_chunks(sid, chunks) == 0

    with pytest.raises(Conflict):
        await store.commit_compaction(
            sid,
            caller=ALICE,
            demote=[2, 3],
            append=[summary("S2-3", anchor=2, replaces=(2, 3))],
            context_tokens=20,
            history=[_chunk("m3 touched the wombat_cache", 3, 3)],
        )
    assert await store.search_history(sid, "wombat_cache", limit=10) == []

    store = await reopen()
    assert len(await store.search_history(sid, "zanzibar_migration quokka_flags", limit=10)) == 2
