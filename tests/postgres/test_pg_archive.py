"""Archiving old rows out of the hot table: every read still returns them, unchanged."""

from __future__ import annotations

import asyncpg
import pytest

from contextsvc.config import MaintenanceSettings
from contextsvc.core.messages import BufferKind, Flags, ImageRef, Message, Role, ToolCall
from contextsvc.core.session import Principal
from contextsvc.engine.maintenance import run_maintenance
from contextsvc.errors import NotFound
from contextsvc.stores.postgres import PostgresStore

ALICE = Principal("alice")
BOB = Principal("bob")


def rows() -> list[Message]:
    out: list[Message] = []
    for i in range(10):
        out.append(Message(Role.USER, f"question {i}", metadata={"i": i}))
        out.append(
            Message(
                Role.ASSISTANT,
                f"answer {i}",
                tool_calls=(ToolCall(id=f"c{i}", name="shell", arguments_json='{"cmd": "ls"}'),),
                images=(ImageRef(blob_id=f"{i:064x}", mime_type="image/png", width=10, height=10),),
                thinking="hmm",
            )
        )
    return out


async def snapshot(store: PostgresStore, sid: str) -> tuple[object, ...]:
    return (
        await store.list_messages(sid, caller=ALICE, buffer=BufferKind.DISPLAY, limit=100),
        await store.list_messages(sid, caller=ALICE, buffer=BufferKind.CONTEXT, limit=100),
        await store.list_messages(sid, caller=ALICE, buffer=BufferKind.DISPLAY, before_sequence=12, limit=3),
        await store.load_context(sid, caller=ALICE),
        await store.get_messages(sid, caller=ALICE, first=1, last=100),
        await store.get_session(sid, caller=ALICE),
    )


async def hot_and_archived(dsn: str, sid: str) -> tuple[int, int]:
    conn = await asyncpg.connect(dsn)
    try:
        hot = await conn.fetchval("SELECT count(*) FROM messages WHERE session_id = $1", sid)
        cold = await conn.fetchval("SELECT count(*) FROM messages_archive WHERE session_id = $1", sid)
        return int(hot), int(cold)
    finally:
        await conn.close()


async def test_archive_round_trip(store: PostgresStore, postgres_db: str) -> None:
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(sid, rows(), caller=ALICE)
    # A compaction: old rows demoted, a context-only summary anchored where they were.
    summary = Message(Role.USER, "summary of 1-8", flags=Flags(is_summary=True, is_display=False), context_anchor=1)
    await store.commit_compaction(sid, caller=ALICE, demote=range(1, 9), append=[summary], context_tokens=7)
    before = await snapshot(store, sid)

    assert await store.archive_old_messages(sid, 11, caller=ALICE) == 10
    assert await hot_and_archived(postgres_db, sid) == (11, 10)
    assert await snapshot(store, sid) == before  # reads are transparent
    archived = await store.list_archived_messages(sid, caller=ALICE, limit=100)
    assert [m.sequence_number for m in archived] == list(range(1, 11))
    assert archived == before[4][:10]  # type: ignore[index]
    assert [m.sequence_number for m in await store.list_archived_messages(sid, caller=ALICE, before_sequence=5)] == [
        1,
        2,
        3,
        4,
    ]
    assert await store.archive_old_messages(sid, 11, caller=ALICE) == 0  # nothing left to move

    # Flags of archived rows can still change (a demoted row promoted back), counters follow.
    await store.set_context_flags(sid, [2], caller=ALICE, is_context=True)
    context = await store.load_context(sid, caller=ALICE)
    assert 2 in [m.sequence_number for m in context]
    info = await store.get_session(sid, caller=ALICE)
    assert info.context_message_count == len(context)

    # Listings and match positions still see archived content.
    page = await store.list_sessions(caller=ALICE, offset=0, limit=10, query="question 0")
    assert [s.id for s in page.sessions] == [sid]
    assert (await store.search_matches([sid], "question 0", caller=ALICE))[sid][0] == [0]

    # Not another user's to archive or read; deleting the session deletes the archive too.
    with pytest.raises(NotFound):
        await store.archive_old_messages(sid, 20, caller=BOB)
    await store.delete_session(sid, caller=ALICE)
    assert await hot_and_archived(postgres_db, sid) == (0, 0)


async def test_maintenance_archives_by_rule_and_every_read_still_sees_the_rows(
    store: PostgresStore, postgres_db: str
) -> None:
    long = (await store.create_session(caller=ALICE, profile_id="p")).id
    short = (await store.create_session(caller=ALICE, profile_id="p")).id
    for _ in range(3):
        await store.append_messages(long, rows(), caller=ALICE)  # 60 rows
    await store.append_messages(short, rows()[:5], caller=ALICE)
    before = {sid: await snapshot(store, sid) for sid in (long, short)}
    now = (await store.get_session(long, caller=ALICE)).update_time
    assert now is not None
    config = MaintenanceSettings(archive_keep_messages=25, prune_after_days=0)

    dry = await run_maintenance(store, None, config, now=now, dry_run=True)
    assert dry is not None and dry.archived == {} and await hot_and_archived(postgres_db, long) == (60, 0)
    result = await run_maintenance(store, None, config, now=now)  # mode warn: archiving loses nothing
    assert result is not None and result.removals == [] and result.archived == {long: 35}
    assert await hot_and_archived(postgres_db, long) == (25, 35)
    assert await hot_and_archived(postgres_db, short) == (5, 0)
    for sid in (long, short):
        assert await snapshot(store, sid) == before[sid]  # ListMessages, ExpandSummary's rows, the header
    # The rule holds as the session grows; a second run moves only what is new.
    await store.append_messages(long, rows()[:10], caller=ALICE)
    again = await run_maintenance(store, None, config, now=now)
    assert again is not None and again.archived == {long: 10}
    assert await hot_and_archived(postgres_db, long) == (25, 45)
