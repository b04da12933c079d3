"""ListMessages paging on every store (issue #8, item 1): for random buffers after compactions,
flag changes and forks, the pages of either buffer concatenate to exactly the one-page listing,
for every page size from 1 to the buffer's length.

The context buffer is ordered by position (a summary sits where the first row it replaced was),
not by sequence number: paging it by sequence lost the summary between pages and returned
placeholders out of order. ``page_token`` names a position, so it cannot."""

from __future__ import annotations

import random

import pytest

from contextsvc.config import Settings
from contextsvc.core.messages import BufferKind, Flags, Message, Role
from contextsvc.engine.engine import Engine
from contextsvc.errors import InvalidArgument
from contextsvc.ports import SessionStore
from tests.conformance.helpers import ALICE, assistant, compression_record, seqs, summary, tool, user
from tests.support.engines import make_engine


async def _engine(store: SessionStore, settings: Settings) -> Engine:
    return make_engine(store, settings, retention=10)


async def _paged(engine: Engine, sid: str, buffer: BufferKind, size: int) -> list[int]:
    """Every row of a buffer by following next_page_token from the newest page back."""
    pages: list[list[int]] = []
    token = ""
    for _ in range(10_000):  # bounded: a buffer here has far fewer rows
        page = await engine.sessions.list_messages(
            ALICE, sid, buffer=buffer, page_size=size, before_sequence=0, page_token=token
        )
        assert len(page.messages) <= size
        pages.append(seqs(page.messages))
        if buffer is BufferKind.CONTEXT:
            assert page.next_before_sequence == 0
        if not page.next_page_token:
            break
        assert page.messages, "a page that promises more is never empty"
        token = page.next_page_token
    return [n for p in reversed(pages) for n in p]


async def _random_session(store: SessionStore, rng: random.Random) -> str:
    """Turns with tool groups, then compactions (summary anchored at the first dropped row,
    placeholders anchored at the result they stand for), demotions and re-promotions."""
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    call = 0
    for _round in range(rng.randint(2, 4)):
        batch: list[Message] = []
        for _turn in range(rng.randint(2, 6)):
            batch.append(user(f"u{rng.random():.3f}", is_pinned=rng.random() < 0.1))
            for _ in range(rng.randint(0, 2)):
                call += 1
                batch += [assistant("", f"c{call}"), tool(f"c{call}", "x" * rng.randint(1, 40))]
            batch.append(assistant("a"))
        await store.append_messages(sid, batch, caller=ALICE)
        context = [m for m in await store.load_context(sid, caller=ALICE) if not m.flags.is_pinned]
        if len(context) < 4:
            continue
        choice = rng.random()
        if choice < 0.5:
            # A summary compaction of a prefix of the context, plus placeholders for some results.
            cut = rng.randint(2, len(context) - 1)
            dropped = context[:cut]
            first = min(m.sequence_number for m in dropped)
            last = max(m.sequence_number for m in dropped)
            kept_tools = [m for m in context[cut:] if m.role is Role.TOOL]
            cleared = rng.sample(kept_tools, k=min(len(kept_tools), rng.randint(0, 2)))
            placeholders = [
                Message(
                    role=Role.TOOL,
                    content="[result cleared]",
                    tool_call_id=m.tool_call_id,
                    name=m.name,
                    flags=Flags(is_display=False),
                    context_anchor=m.sequence_number,
                )
                for m in cleared
            ]
            await store.commit_compaction(
                sid,
                caller=ALICE,
                demote=[m.sequence_number for m in dropped + cleared],
                append=[summary("S", anchor=first, replaces=(first, last)), *placeholders, compression_record("c")],
                context_tokens=10,
            )
        elif choice < 0.8:
            # Flag changes: demote some rows, and bring some demoted display rows back.
            demote = rng.sample([m.sequence_number for m in context], k=rng.randint(1, 3))
            await store.set_context_flags(sid, demote, caller=ALICE, is_context=False)
            if rng.random() < 0.5:
                await store.set_context_flags(sid, demote[:1], caller=ALICE, is_context=True)
    return sid


@pytest.mark.parametrize("seed", range(6))
async def test_pages_concatenate_to_the_buffer_for_every_page_size(
    store: SessionStore, settings: Settings, seed: int
) -> None:
    rng = random.Random(seed)
    engine = await _engine(store, settings)
    try:
        sid = await _random_session(store, rng)
        info = await store.get_session(sid, caller=ALICE)
        fork = await engine.sessions.fork(ALICE, sid, at_sequence=rng.randint(1, info.last_sequence))
        for session_id in (sid, fork.id):
            for buffer in (BufferKind.CONTEXT, BufferKind.DISPLAY):
                whole = await engine.sessions.list_messages(
                    ALICE, session_id, buffer=buffer, page_size=1000, before_sequence=0
                )
                expected = seqs(whole.messages)
                assert not whole.next_page_token
                if buffer is BufferKind.CONTEXT:
                    assert expected == seqs(await store.load_context(session_id, caller=ALICE))
                for size in range(1, len(expected) + 1):
                    assert await _paged(engine, session_id, buffer, size) == expected, (buffer, size)
    finally:
        await engine.close()


async def test_a_summary_between_pages_is_not_lost(store: SessionStore, settings: Settings) -> None:
    """The defect as reported: a summary placed before rows with smaller sequence numbers."""
    engine = await _engine(store, settings)
    try:
        sid = (await store.create_session(caller=ALICE, profile_id="p")).id
        await store.append_messages(sid, [user(f"m{i}") for i in range(1, 9)], caller=ALICE)
        await store.commit_compaction(
            sid,
            caller=ALICE,
            demote=[1, 2, 3, 4],
            append=[summary("S", anchor=1, replaces=(1, 4)), compression_record("c")],
            context_tokens=5,
        )
        # Context: 9 (the summary, at row 1's place), 5, 6, 7, 8.
        first = await engine.sessions.list_messages(
            ALICE, sid, buffer=BufferKind.CONTEXT, page_size=3, before_sequence=0
        )
        assert seqs(first.messages) == [6, 7, 8]
        second = await engine.sessions.list_messages(
            ALICE, sid, buffer=BufferKind.CONTEXT, page_size=3, before_sequence=0, page_token=first.next_page_token
        )
        assert seqs(second.messages) == [9, 5]
        assert not second.next_page_token
        # before_sequence on the context buffer: the rows placed before message 6.
        before = await engine.sessions.list_messages(
            ALICE, sid, buffer=BufferKind.CONTEXT, page_size=9, before_sequence=6
        )
        assert seqs(before.messages) == [9, 5]
    finally:
        await engine.close()


async def test_page_tokens_are_checked(store: SessionStore, settings: Settings) -> None:
    engine = await _engine(store, settings)
    try:
        sid = (await store.create_session(caller=ALICE, profile_id="p")).id
        other = (await store.create_session(caller=ALICE, profile_id="p")).id
        for s in (sid, other):
            await store.append_messages(s, [user(f"m{i}") for i in range(1, 6)], caller=ALICE)
        page = await engine.sessions.list_messages(
            ALICE, sid, buffer=BufferKind.CONTEXT, page_size=2, before_sequence=0
        )
        display = await engine.sessions.list_messages(
            ALICE, sid, buffer=BufferKind.DISPLAY, page_size=2, before_sequence=0
        )
        assert page.next_page_token and display.next_page_token
        assert display.next_before_sequence == 4
        bad = [
            ("not base64 !!", sid, BufferKind.CONTEXT),
            ("eyJ4IjoxfQ", sid, BufferKind.CONTEXT),  # {"x":1}
            (page.next_page_token, other, BufferKind.CONTEXT),  # another session's
            (page.next_page_token, sid, BufferKind.DISPLAY),  # another buffer's
            (display.next_page_token, sid, BufferKind.CONTEXT),
        ]
        for token, session_id, buffer in bad:
            with pytest.raises(InvalidArgument) as caught:
                await engine.sessions.list_messages(
                    ALICE, session_id, buffer=buffer, page_size=2, before_sequence=0, page_token=token
                )
            assert caught.value.violations[0].field == "page_token"
        with pytest.raises(InvalidArgument):
            await engine.sessions.list_messages(
                ALICE, sid, buffer=BufferKind.CONTEXT, page_size=2, before_sequence=3, page_token=page.next_page_token
            )
    finally:
        await engine.close()
