"""Sessions: create, get, list, update, delete, and ownership on every method."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest

from contextsvc.config import Settings
from contextsvc.core.messages import BufferKind
from contextsvc.core.session import ListPosition
from contextsvc.errors import Conflict, InvalidArgument, NotFound
from contextsvc.ports import HistoryChunk, InitialContent, SessionStore
from tests.conformance.helpers import ADMIN, ALICE, BOB, Reopen, assistant, summary, user, view
from tests.support.stores import Backing, TickingClock


async def test_create_then_get_returns_the_same_header(store: SessionStore) -> None:
    created = await store.create_session(caller=ALICE, profile_id="coder", name="first", metadata={"k": [1, 2]})
    assert str(uuid.UUID(created.id)) == created.id
    assert (created.user_id, created.profile_id, created.name, created.metadata) == (
        "alice",
        "coder",
        "first",
        {"k": [1, 2]},
    )
    assert not created.pinned and not created.context_truncated
    assert (created.context_tokens, created.display_message_count, created.context_message_count) == (0, 0, 0)
    assert (created.last_sequence, created.preview, created.state) == (0, "", {})
    for stamp in (created.create_time, created.update_time):
        assert stamp is not None and stamp.utcoffset() == timedelta(0)
    assert await store.get_session(created.id, caller=ALICE) == created


async def test_create_with_an_explicit_id(store: SessionStore) -> None:
    sid = str(uuid.uuid4())
    created = await store.create_session(caller=ALICE, profile_id="p", session_id=sid)
    assert created.id == sid
    with pytest.raises(Conflict):
        await store.create_session(caller=BOB, profile_id="p", session_id=sid)
    assert (await store.get_session(sid, caller=ALICE)).user_id == "alice"


async def test_create_with_initial_content_holds_all_of_it(store: SessionStore, reopen: Reopen) -> None:
    """A fork's session is created holding its rows (numbered from 1, flags as given), its count,
    its state and its history chunks, in one step, and reads back the same after a restart."""
    text = "m1 ran the zanzibar_migration"
    initial = InitialContent(
        messages=[
            user("first", is_context=False).copy_with(sequence_number=7),
            assistant("second").copy_with(sequence_number=9),
            user("third"),
        ],
        context_tokens=42,
        state={"epoch": 1},
        history=[HistoryChunk(hashlib.sha256(text.encode()).hexdigest(), text, 1, 1, None, None)],
    )
    created = await store.create_session(
        caller=ALICE, profile_id="p", name="f", metadata={"forked_from": "x"}, initial=initial
    )
    sid = created.id

    async def check(s: SessionStore) -> None:
        info = await s.get_session(sid, caller=ALICE)
        assert (info.last_sequence, info.context_tokens, info.state, info.name) == (3, 42, {"epoch": 1}, "f")
        assert (info.display_message_count, info.context_message_count) == (3, 2)
        rows = await s.get_messages(sid, caller=ALICE, first=1, last=10)
        assert [(m.sequence_number, m.content, m.flags.is_context) for m in rows] == [
            (1, "first", False),
            (2, "second", True),
            (3, "third", True),
        ]
        assert [m.content for m in await s.load_context(sid, caller=ALICE)] == ["second", "third"]
        assert [c.chunk.text for c in await s.search_history(sid, "zanzibar_migration", limit=5)] == [text]

    await check(store)
    assert created == await store.get_session(sid, caller=ALICE)
    with pytest.raises(Conflict):  # the id is taken: nothing of the second one is written
        await store.create_session(caller=ALICE, profile_id="p", session_id=sid, initial=InitialContent([user("x")]))
    await check(store)
    store = await reopen()
    await check(store)
    appended = await store.append_messages(sid, [user("fourth")], caller=ALICE)
    assert appended.sequence_numbers == [4]


@pytest.mark.parametrize("bad", ["../../etc/passwd", "x", "", "ABCDEF00-0000-4000-8000-000000000000", "a/b"])
async def test_create_rejects_an_id_that_is_not_a_canonical_uuid(store: SessionStore, bad: str) -> None:
    with pytest.raises(InvalidArgument):
        await store.create_session(caller=ALICE, profile_id="p", session_id=bad)


async def test_unknown_and_malformed_ids_are_not_found(store: SessionStore) -> None:
    real = await store.create_session(caller=ALICE, profile_id="p")
    for sid in [str(uuid.uuid4()), real.id.upper(), "{" + real.id + "}", "../" + real.id, "../../etc/passwd", ""]:
        with pytest.raises(NotFound):
            await store.get_session(sid, caller=ADMIN)
        with pytest.raises(NotFound):
            await store.append_messages(sid, [user()], caller=ADMIN)


def _every_session_method(store: SessionStore, sid: str) -> dict[str, Callable[[Any], Awaitable[object]]]:
    """Each protocol method that names a session, called with a given principal."""
    return {
        "get_session": lambda who: store.get_session(sid, caller=who),
        "update_session": lambda who: store.update_session(sid, caller=who, name="taken"),
        "append_messages": lambda who: store.append_messages(sid, [user("intruder")], caller=who),
        "list_messages": lambda who: store.list_messages(sid, caller=who, buffer=BufferKind.DISPLAY),
        "load_context": lambda who: store.load_context(sid, caller=who),
        "context_and_session": lambda who: store.context_and_session(sid, caller=who),
        "get_messages": lambda who: store.get_messages(sid, caller=who, first=1, last=10),
        "set_context_flags": lambda who: store.set_context_flags(sid, [1], caller=who, is_context=False),
        "update_state": lambda who: store.update_state(sid, caller=who, context_tokens=999),
        # Row 2: set_context_flags above took row 1 out of the context, and demoting a row twice conflicts.
        "commit_compaction": lambda who: store.commit_compaction(
            sid, caller=who, demote=[2], append=[summary("s", anchor=2, replaces=(2, 2))], context_tokens=1
        ),
        "delete_session": lambda who: store.delete_session(sid, caller=who),
    }


async def test_another_users_session_is_not_found_and_untouched(store: SessionStore) -> None:
    sid = (await store.create_session(caller=ALICE, profile_id="p", name="mine")).id
    await store.append_messages(sid, [user("hello"), assistant("hi")], caller=ALICE)
    before = await store.get_session(sid, caller=ALICE)
    context = await store.load_context(sid, caller=ALICE)
    for name, call in _every_session_method(store, sid).items():
        with pytest.raises(NotFound) as raised:
            await call(BOB)
        # The same answer an unknown session gets: nothing tells bob that alice's exists.
        assert type(raised.value) is NotFound, name
    assert await store.get_session(sid, caller=ALICE) == before
    assert await store.load_context(sid, caller=ALICE) == context
    assert (await store.list_sessions(caller=BOB, offset=0, limit=10)).total == 0


async def test_an_admin_may_call_every_method_on_anyones_session(store: SessionStore) -> None:
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(sid, [user("hello"), assistant("hi")], caller=ALICE)
    for call in _every_session_method(store, sid).values():
        await call(ADMIN)
    with pytest.raises(NotFound):
        await store.get_session(sid, caller=ALICE)


async def test_update_session_changes_only_the_given_fields(store: SessionStore, reopen: Reopen) -> None:
    created = await store.create_session(caller=ALICE, profile_id="p", name="old", metadata={"a": 1})
    renamed = await store.update_session(created.id, caller=ALICE, name="new")
    assert (renamed.name, renamed.pinned, renamed.metadata) == ("new", False, {"a": 1})
    pinned = await store.update_session(created.id, caller=ALICE, pinned=True, metadata={"b": {"c": 2}})
    assert (pinned.name, pinned.pinned, pinned.metadata) == ("new", True, {"b": {"c": 2}})
    assert created.update_time is not None and renamed.update_time is not None and pinned.update_time is not None
    assert created.update_time < renamed.update_time < pinned.update_time
    assert pinned.create_time == created.create_time
    store = await reopen()
    assert await store.get_session(created.id, caller=ALICE) == pinned


async def test_every_mutation_bumps_update_time(store: SessionStore) -> None:
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    mutations: list[Callable[[], Awaitable[object]]] = [
        lambda: store.append_messages(sid, [user("a"), assistant("b")], caller=ALICE),
        lambda: store.update_session(sid, caller=ALICE, name="n"),
        lambda: store.set_context_flags(sid, [1], caller=ALICE, is_context=False),
        lambda: store.update_state(sid, caller=ALICE, context_tokens=5),
        lambda: store.commit_compaction(
            sid, caller=ALICE, demote=[2], append=[summary("s", anchor=1, replaces=(1, 2))], context_tokens=3
        ),
    ]
    last = (await store.get_session(sid, caller=ALICE)).update_time
    assert last is not None
    for mutate in mutations:
        await mutate()
        now = (await store.get_session(sid, caller=ALICE)).update_time
        assert now is not None and now > last
        last = now


async def _listing_fixture(store: SessionStore) -> dict[str, str]:
    """Four sessions whose last mutations happen in the order s2, s3, s4, s1."""
    s1 = (await store.create_session(caller=ALICE, profile_id="a", name="Alpha project")).id
    s2 = (await store.create_session(caller=ALICE, profile_id="b", name="beta")).id
    await store.append_messages(s2, [user("where is the NeEdLe?")], caller=ALICE)
    await store.commit_compaction(
        s2, caller=ALICE, demote=[], append=[summary("hidden haystack", anchor=1, replaces=(1, 1))], context_tokens=0
    )
    s3 = (await store.create_session(caller=ALICE, profile_id="a", name="gamma")).id
    await store.update_session(s3, caller=ALICE, pinned=True)
    s4 = (await store.create_session(caller=BOB, profile_id="a", name="bob's")).id
    await store.append_messages(s1, [user("latest")], caller=ALICE)
    return {"s1": s1, "s2": s2, "s3": s3, "s4": s4}


async def test_listing_order_filters_query_and_paging(store: SessionStore) -> None:
    ids = await _listing_fixture(store)
    s1, s2, s3, s4 = ids["s1"], ids["s2"], ids["s3"], ids["s4"]

    async def listed(who: Any = ALICE, **kw: Any) -> tuple[list[str], int]:
        kw.setdefault("offset", 0)
        kw.setdefault("limit", 100)
        page = await store.list_sessions(caller=who, **kw)
        return [s.id for s in page.sessions], page.total

    # Pinned first, then newest update_time first.
    assert await listed() == ([s3, s1, s2], 3)
    assert await listed(ADMIN) == ([s3, s1, s4, s2], 4)
    assert await listed(BOB) == ([s4], 1)
    assert await listed(profile_id="a") == ([s3, s1], 2)
    # Case-insensitive substring of the name or of display content; never of context-only rows.
    assert await listed(query="NEEDLE") == ([s2], 1)
    assert await listed(query="alp") == ([s1], 1)
    assert await listed(query="haystack") == ([], 0)
    assert await listed(ADMIN, query="BOB'S") == ([s4], 1)
    assert await listed(query="needle", profile_id="a") == ([], 0)
    # offset / limit cut the page; total counts every match.
    assert await listed(offset=1, limit=1) == ([s1], 3)
    assert await listed(offset=2, limit=5) == ([s2], 3)
    assert await listed(offset=5, limit=5) == ([], 3)
    assert await listed(limit=0) == ([], 3)
    with pytest.raises(InvalidArgument):
        await store.list_sessions(caller=ALICE, offset=-1, limit=5)


async def test_listing_carries_the_same_summaries_as_get(store: SessionStore) -> None:
    ids = await _listing_fixture(store)
    page = await store.list_sessions(caller=ADMIN, offset=0, limit=10)
    assert page.sessions == [await store.get_session(s.id, caller=ADMIN) for s in page.sessions]
    by_id = {s.id: s for s in page.sessions}
    s2 = by_id[ids["s2"]]
    assert (s2.display_message_count, s2.context_message_count, s2.last_sequence) == (1, 2, 2)
    assert s2.preview == "where is the NeEdLe?"


async def test_equal_update_times_are_ordered_by_id(backing: Backing, settings: Settings) -> None:
    store = await backing.open(clock=TickingClock(step=timedelta(0)), settings=settings)
    made = [(await store.create_session(caller=ALICE, profile_id="p")).id for _ in range(5)]
    pinned = made[3]
    await store.update_session(pinned, caller=ALICE, pinned=True)
    page = await store.list_sessions(caller=ALICE, offset=0, limit=10)
    assert [s.id for s in page.sessions] == [pinned, *sorted(set(made) - {pinned})]


async def test_a_listing_resumes_after_a_position_whatever_changed_ahead(backing: Backing, settings: Settings) -> None:
    """Pages cut by position, not offset: sessions updated, created or deleted ahead of the
    position neither repeat a session on the next page nor skip one."""
    store = await backing.open(clock=TickingClock(step=timedelta(seconds=1)), settings=settings)
    made = [(await store.create_session(caller=ALICE, profile_id="p", name=f"s{i}")).id for i in range(6)]
    first = await store.list_sessions(caller=ALICE, limit=3)
    assert [s.id for s in first.sessions] == made[::-1][:3] and first.total == 6
    position = ListPosition.of(first.sessions[-1])
    # Ahead of the position: the newest is updated (it moves to the top again), one is deleted and
    # one is created. An offset of 3 would now repeat made[3] and list made[1] twice or skip it.
    await store.append_messages(made[2], [user("later")], caller=ALICE)
    await store.delete_session(made[5], caller=ALICE)
    await store.create_session(caller=ALICE, profile_id="p", name="new")
    rest = await store.list_sessions(caller=ALICE, limit=10, after=position)
    assert [s.id for s in rest.sessions] == [made[1], made[0]]
    assert rest.total == 6
    # The session at the position itself gone: the next page starts where it stood.
    await store.delete_session(made[3], caller=ALICE)
    assert [s.id for s in (await store.list_sessions(caller=ALICE, limit=10, after=position)).sessions] == [
        made[1],
        made[0],
    ]
    # Pinned first: a position among the pinned sessions goes on to the unpinned ones.
    await store.update_session(made[0], caller=ALICE, pinned=True)
    pinned_page = await store.list_sessions(caller=ALICE, limit=1)
    assert [s.id for s in pinned_page.sessions] == [made[0]]
    after_pinned = await store.list_sessions(caller=ALICE, limit=10, after=ListPosition.of(pinned_page.sessions[0]))
    assert made[0] not in [s.id for s in after_pinned.sessions] and len(after_pinned.sessions) == 4


async def test_a_position_between_equal_update_times_goes_on_by_id(backing: Backing, settings: Settings) -> None:
    store = await backing.open(clock=TickingClock(step=timedelta(0)), settings=settings)
    made = sorted([(await store.create_session(caller=ALICE, profile_id="p")).id for _ in range(5)])
    seen: list[str] = []
    after = None
    for _ in range(5):
        page = await store.list_sessions(caller=ALICE, limit=2, after=after)
        seen += [s.id for s in page.sessions]
        if not page.sessions:
            break
        after = ListPosition.of(page.sessions[-1])
    assert seen == made


async def test_delete_removes_the_session_and_nothing_else(store: SessionStore, reopen: Reopen) -> None:
    keep = (await store.create_session(caller=ALICE, profile_id="p", name="keep")).id
    gone = (await store.create_session(caller=ALICE, profile_id="p", name="gone")).id
    for sid in (keep, gone):
        await store.append_messages(sid, [user(f"hello {sid}"), assistant("hi")], caller=ALICE)
    await store.save_view(gone, view("v1"), keep=4)
    kept_before = await store.get_session(keep, caller=ALICE)

    await store.delete_session(gone, caller=ALICE)
    with pytest.raises(NotFound):
        await store.get_session(gone, caller=ALICE)
    with pytest.raises(NotFound):
        await store.delete_session(gone, caller=ALICE)
    with pytest.raises(NotFound):
        await store.append_messages(gone, [user()], caller=ALICE)
    assert await store.get_view(gone, "v1") is None
    assert [s.id for s in (await store.list_sessions(caller=ALICE, offset=0, limit=10)).sessions] == [keep]

    store = await reopen()
    with pytest.raises(NotFound):
        await store.get_session(gone, caller=ADMIN)
    assert await store.get_session(keep, caller=ALICE) == kept_before
    # The id is free again.
    again = await store.create_session(caller=BOB, profile_id="p", session_id=gone)
    assert (again.last_sequence, again.user_id) == (0, "bob")
