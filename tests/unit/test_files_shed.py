"""The files store lets rows outside a context go before it drops whole sessions (round 19, #15).

Agents take turns in a cycle; once their sessions' histories outgrow ``files.cache_mb``, dropping
whole sessions made every turn read a log again. A turn reads only the context and appends, so the
rows outside each context (all but a tail) go first, and a read that needs one reads the log whole.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from contextsvc.config import Durability, FilesSettings, Settings
from contextsvc.core.messages import BufferKind, Flags, Message, Role
from contextsvc.core.session import Principal
from contextsvc.stores._session import SHED
from contextsvc.stores.files import FilesStore
from tests.support.stores import TickingClock

ALICE = Principal(user_id="alice")
MB = 1024 * 1024


async def opened(root: Path, **files: Any) -> FilesStore:
    settings = Settings(durability=Durability.BATCH, files=FilesSettings(**files))
    store = FilesStore(root, settings, clock=TickingClock())
    await store.open()
    return store


def row(text: str, *, context: bool = True, display: bool = True) -> Message:
    return Message(role=Role.USER, content=text, flags=Flags(is_context=context, is_display=display))


async def long_sessions(store: FilesStore, count: int, history: int, context: int) -> list[str]:
    """``count`` sessions of ``history`` rows outside the context, then ``context`` rows in it."""
    sids = []
    for s in range(count):
        sid = (await store.create_session(caller=ALICE, profile_id="p", name=f"agent {s}")).id
        old = [row(f"s{s} old {i} " + "h" * 200, context=False) for i in range(history)]
        for start in range(0, history, 50):
            await store.append_messages(sid, old[start : start + 50], caller=ALICE)
        await store.append_messages(sid, [row(f"s{s} ctx {i}") for i in range(context)], caller=ALICE)
        sids.append(sid)
    return sids


async def everything(store: FilesStore, sid: str) -> list[Message]:
    info = await store.get_session(sid, caller=ALICE)
    return await store.get_messages(sid, caller=ALICE, first=1, last=info.last_sequence)


async def test_turns_on_long_sessions_over_the_budget_read_no_log(tmp_path: Path) -> None:
    store = await opened(tmp_path, cache_mb=0.6, resident_tail_rows=8)
    sids = await long_sessions(store, 6, 150, 20)  # ~0.3 MB of history each, 6 contexts of ~40 KB
    budget = int(0.6 * MB)
    assert store.stats.rows_shed > 0 and store.held_bytes <= budget
    loads = store.stats.loads
    for turn in range(5):  # agents in a cycle: context, append, context
        for sid in sids:
            context = await store.load_context(sid, caller=ALICE)
            assert len(context) == 20 + turn and all(m is not SHED for m in context)
            await store.append_messages(sid, [row(f"turn {turn}")], caller=ALICE)
            assert store.held_bytes <= budget
    assert store.stats.loads == loads and store.stats.evictions == 0  # no log read again
    assert all(store._sessions[sid].resident for sid in sids)
    # The newest rows stay: the latest display page needs no log either.
    page = await store.list_messages(sids[0], caller=ALICE, buffer=BufferKind.DISPLAY, limit=8)
    assert [m.content for m in page][-1] == "turn 4" and store.stats.loads == loads
    await store.close()


async def partial(root: Path, *, tail: int = 2, history: int = 100, context: int = 5) -> tuple[FilesStore, list[str]]:
    """Three sessions and a budget that holds one whole and the others' contexts and tails: the
    newest stays whole, the two others let the rest go."""
    row_bytes = 1700 + 215  # _session.row_bytes of these rows, about
    whole = (history + context) * row_bytes
    lean = (context + tail) * row_bytes + 4096
    store = await opened(root, cache_mb=(whole + 2 * lean + 30_000) / MB, resident_tail_rows=tail)
    sids = await long_sessions(store, 3, history, context)
    assert [bool(store._sessions[sid].shed) for sid in sids] == [True, True, False]
    assert all(store._sessions[sid].resident for sid in sids)
    return store, sids


async def test_every_read_of_rows_let_go_gives_the_rows(tmp_path: Path) -> None:
    full = await opened(tmp_path / "full")
    want = [await everything(full, sid) for sid in await long_sessions(full, 3, 100, 5)]
    lean, sids = await partial(tmp_path / "lean", tail=4)
    assert lean.stats.rows_shed == 2 * 100  # every row outside the context (the tail is in it)
    loads = lean.stats.loads
    assert await everything(lean, sids[0]) == want[0]  # read whole from the log
    assert lean.stats.loads == loads + 1 and not lean._sessions[sids[0]].shed
    # A display page of rows let go: read whole again.
    page = await lean.list_messages(sids[1], caller=ALICE, buffer=BufferKind.DISPLAY, before_sequence=30, limit=5)
    assert page == want[1][24:29] and lean.stats.loads == loads + 2
    # The newest rows of a session that let rows go need no log.
    assert lean._sessions[sids[0]].shed, "the budget let its rows go again"
    newest = await lean.list_messages(sids[0], caller=ALICE, buffer=BufferKind.DISPLAY, limit=4)
    assert newest == want[0][-4:] and lean.stats.loads == loads + 2
    # A search that matches rows let go reads the logs, and keeps nothing of them.
    hits = await lean.list_sessions(caller=ALICE, offset=0, limit=10, query=" OLD 17 ")
    assert hits.total == 3 and lean.stats.loads == loads + 2
    assert (await lean.list_sessions(caller=ALICE, offset=0, limit=10, query="s2 old 3 ")).total == 1
    await full.close()
    await lean.close()


async def test_a_flag_change_on_a_row_let_go_brings_it_back_into_the_context(tmp_path: Path) -> None:
    store, (a, _, _) = await partial(tmp_path)
    await store.set_context_flags(a, [7], caller=ALICE, is_context=True)
    context = await store.load_context(a, caller=ALICE)
    assert context[0].sequence_number == 7 and context[0].content.startswith("s0 old 6 ")
    await store.close()
    store = await opened(tmp_path)  # and the log says the same
    assert (await store.load_context(a, caller=ALICE))[0].sequence_number == 7
    await store.close()


async def test_a_compaction_lets_the_rows_it_took_out_go_too(tmp_path: Path) -> None:
    store, (a, _, c) = await partial(tmp_path, context=40)
    st = store._sessions[a]
    before = st.shed
    summary = Message(role=Role.SYSTEM, content="summary", flags=Flags(is_context=True, is_display=False))
    demoted = list(range(101, 131))
    await store.commit_compaction(a, caller=ALICE, demote=demoted, append=[summary], context_tokens=5)
    turn = [row(f"another agent's turn {i} " + "t" * 190) for i in range(30)]
    await store.append_messages(c, turn, caller=ALICE)  # over the budget again: a lets them go now
    assert st.shed == before + 30
    rows = await everything(store, a)
    assert [m.flags.is_context for m in rows[100:130]] == [False] * 30 and rows[-1].content == "summary"
    assert [m.sequence_number for m in await store.load_context(a, caller=ALICE)] == [*range(131, 141), 141]
    await store.close()


async def test_log_compaction_of_a_session_that_let_rows_go_keeps_every_row(tmp_path: Path) -> None:
    store, sids = await partial(tmp_path)
    want = {sid: await everything(store, sid) for sid in sids}  # each read whole, then let go again
    store._settings.files.compact_min_records = 1  # every log due now
    store._settings.files.compact_records_per_row = 0
    for sid in sids:
        for tokens in (9, 10):  # records that make its log due
            await store.update_state(sid, caller=ALICE, context_tokens=tokens)
    store._evict()
    shed = [sid for sid in sids if store._sessions[sid].shed]
    assert shed
    done = store.stats.rewrites
    for sid in sids:
        store._want_compaction(sid)
    await store.compactions_done()
    assert store.stats.rewrites >= done + len(shed)  # the ones that let rows go, from their logs
    assert all(store._sessions[sid].shed for sid in shed)  # and still lean
    await store.rewrite_log(shed[0])  # on demand: the log read whole first
    await store.close()
    store = await opened(tmp_path)
    for sid, rows in want.items():
        assert await everything(store, sid) == rows
    await store.close()


async def test_memory_counted_after_a_whole_read_is_what_a_fresh_load_counts(tmp_path: Path) -> None:
    store, (a, _, _) = await partial(tmp_path)
    counted = store._lru[a]
    await everything(store, a)  # read whole again
    held = store._lru[a]
    assert held > counted
    await store.close()
    store = await opened(tmp_path)
    await everything(store, a)
    assert store._lru[a] == held
    await store.close()


@pytest.mark.parametrize("seed", range(12))
async def test_a_store_that_lets_rows_go_reads_the_same_as_one_that_holds_them(tmp_path: Path, seed: int) -> None:
    """Random appends (in or out of the context), flag changes, compactions and reads of every kind
    on two stores, one with room for everything and one that must let rows go: every read agrees."""
    rnd = random.Random(seed)
    full = await opened(tmp_path / "full")
    lean = await opened(tmp_path / "lean", cache_mb=0.06, resident_tail_rows=rnd.choice([0, 1, 3, 8]))
    ids: list[tuple[str, str]] = []
    for s in range(3):
        made = [await st.create_session(caller=ALICE, profile_id="p", name=f"n{s}") for st in (full, lean)]
        ids.append((made[0].id, made[1].id))
    for step in range(150):
        a, b = rnd.choice(ids)
        last = (await full.get_session(a, caller=ALICE)).last_sequence
        op = rnd.random()
        if op < 0.5 or last < 3:
            batch = [
                row(f"{step} w{rnd.randrange(40)} " + "t" * rnd.randrange(300), context=rnd.random() < 0.3)
                for _ in range(rnd.randint(1, 6))
            ]
            got = [await st.append_messages(sid, batch, caller=ALICE) for st, sid in ((full, a), (lean, b))]
            assert got[0].sequence_numbers == got[1].sequence_numbers
        elif op < 0.6:
            seqs = rnd.sample(range(1, last + 1), k=min(3, last))
            value = rnd.random() < 0.5
            for st, sid in ((full, a), (lean, b)):
                await st.set_context_flags(sid, seqs, caller=ALICE, is_context=value)
        elif op < 0.68:
            context = await full.load_context(a, caller=ALICE)
            demote = [m.sequence_number for m in context if m.sequence_number][: rnd.randint(1, 5)]
            summary = Message(
                role=Role.SYSTEM, content=f"summary {step}", flags=Flags(is_context=True, is_display=False)
            )
            if demote:
                for st, sid in ((full, a), (lean, b)):
                    await st.commit_compaction(sid, caller=ALICE, demote=demote, append=[summary], context_tokens=step)
        elif op < 0.78:
            first = rnd.randint(1, last)
            last_read = rnd.randint(first, last)
            reads = [
                await st.get_messages(sid, caller=ALICE, first=first, last=last_read)
                for st, sid in ((full, a), (lean, b))
            ]
            assert reads[0] == reads[1]
        elif op < 0.88:
            before, limit = rnd.randint(0, last + 1), rnd.randint(0, 12)
            pages = [
                await st.list_messages(
                    sid, caller=ALICE, buffer=BufferKind.DISPLAY, before_sequence=before, limit=limit
                )
                for st, sid in ((full, a), (lean, b))
            ]
            assert pages[0] == pages[1]
        elif op < 0.93:
            needle = f"w{rnd.randrange(40)} "
            found = [await st.list_sessions(caller=ALICE, offset=0, limit=10, query=needle) for st in (full, lean)]
            assert found[0].total == found[1].total
        else:
            contexts = [await st.load_context(sid, caller=ALICE) for st, sid in ((full, a), (lean, b))]
            assert contexts[0] == contexts[1]
        assert all(m is not SHED for m in await lean.load_context(b, caller=ALICE))
    assert lean.stats.rows_shed > 0 and lean.stats.loads > 0  # rows let go, and reads of them
    for a, b in ids:
        assert await everything(full, a) == await everything(lean, b)
    want = {b: await everything(full, a) for a, b in ids}
    await full.close()
    await lean.close()
    reopened = await opened(tmp_path / "lean")  # the log holds what was let go
    for b, rows in want.items():
        assert await everything(reopened, b) == rows
    await reopened.close()


async def test_a_whole_read_puts_back_only_the_rows_let_go(tmp_path: Path) -> None:
    """The rows held stay the same objects (the engine's per-message caches know them by identity)."""
    store, (a, _, _) = await partial(tmp_path)
    context = await store.load_context(a, caller=ALICE)
    await everything(store, a)
    st = store._sessions[a]
    assert not st.shed and SHED not in st.rows
    assert all(x is y for x, y in zip(await store.load_context(a, caller=ALICE), context, strict=True))
    await store.close()
