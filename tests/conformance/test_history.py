"""The raw history index (DESIGN §5.6): idempotent by content hash, per session, ranked, deleted
with its session, durable. Word forms are stemmed alike by every store (core/recall.py)."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest

from contextsvc.core.recall import document_terms, term_coverage
from contextsvc.core.session import Principal
from contextsvc.errors import NotFound
from contextsvc.ports import HistoryChunk, ScoredChunk, SessionStore
from tests.conformance.helpers import ALICE, BOB, Reopen

T0 = datetime(2026, 3, 1, 9, 0, tzinfo=UTC)


def chunk(
    text: str, first: int, last: int | None = None, *, crumbs: tuple[str, ...] = (), key: str = ""
) -> HistoryChunk:
    """A chunk hashed like the engine would (over its text), unless ``key`` makes it distinct."""
    last = first if last is None else last
    return HistoryChunk(
        content_hash=hashlib.sha256(f"{key}{text}".encode()).hexdigest(),
        text=text,
        first_sequence=first,
        last_sequence=last,
        start_time=T0 + timedelta(minutes=first),
        end_time=T0 + timedelta(minutes=last),
        breadcrumbs=crumbs,
    )


async def session(store: SessionStore, caller: Principal = ALICE) -> str:
    return (await store.create_session(caller=caller, profile_id="p")).id


def texts(found: list[ScoredChunk]) -> list[str]:
    return [s.chunk.text for s in found]


async def test_a_chunk_is_stored_once_per_content_hash(store: SessionStore) -> None:
    sid = await session(store)
    a, b, c = chunk("ran pytest on the parser", 1), chunk("parser tests pass", 2), chunk("parser released", 3)
    assert await store.add_history_chunks(sid, [a, b]) == 2
    assert await store.add_history_chunks(sid, [a]) == 0
    assert await store.add_history_chunks(sid, [b, c, c, a]) == 1  # duplicates inside one call too
    assert await store.add_history_chunks(sid, []) == 0
    # The hash is the identity: a known hash with another text is skipped, text and all.
    impostor = HistoryChunk(a.content_hash, "zeppelin", 9, 9, None, None)
    assert await store.add_history_chunks(sid, [impostor]) == 0
    assert await store.search_history(sid, "zeppelin", limit=10) == []
    found = await store.search_history(sid, "parser", limit=10)
    assert sorted(texts(found)) == sorted([a.text, b.text, c.text])


async def test_chunks_belong_to_one_session(store: SessionStore) -> None:
    mine, theirs = await session(store), await session(store, BOB)
    shared = chunk("deployed the gateway to staging", 4)
    assert await store.add_history_chunks(mine, [shared, chunk("alice rotated the keys", 5)]) == 2
    # Uniqueness is per session: the same chunk is new to another session.
    assert await store.add_history_chunks(theirs, [shared, chunk("bob migrated the database", 6)]) == 2
    assert texts(await store.search_history(mine, "keys database", limit=10)) == ["alice rotated the keys"]
    assert texts(await store.search_history(theirs, "keys database", limit=10)) == ["bob migrated the database"]
    assert len(await store.search_history(theirs, "gateway", limit=10)) == 1


async def test_the_chunk_with_the_rare_query_terms_ranks_first(store: SessionStore) -> None:
    sid = await session(store)
    common = [chunk(f"build {n}: compile error in module {n}, error again, build error", n) for n in range(1, 7)]
    rare = chunk("the linker reported a zygote_allocator overflow", 7)
    await store.add_history_chunks(sid, [*common[:3], rare, *common[3:]])
    found = await store.search_history(sid, "build error zygote_allocator", limit=10)
    assert found[0].chunk == rare
    # A part of an identifier finds it too, and still ranks the rare chunk first.
    assert (await store.search_history(sid, "zygote error", limit=3))[0].chunk == rare
    assert len(found) == 7
    assert all(s.score > 0 for s in found)
    assert [s.score for s in found] == sorted((s.score for s in found), reverse=True)


async def test_breadcrumbs_are_searched_with_the_text(store: SessionStore) -> None:
    sid = await session(store)
    crumbed = chunk("ran the migration twice", 3, 8, crumbs=("project apollo", "step: schema upgrade"))
    await store.add_history_chunks(sid, [crumbed, chunk("ran the linter", 9)])
    assert [s.chunk for s in await store.search_history(sid, "apollo", limit=5)] == [crumbed]
    assert texts(await store.search_history(sid, "schema", limit=5)) == [crumbed.text]


async def test_a_found_chunks_terms_are_its_search_terms(store: SessionStore) -> None:
    """Recall checks a found chunk's coverage of the query with the terms the store gives
    (``ScoredChunk.terms``): they must be exactly the ones it would find in the chunk itself."""
    sid = await session(store)
    crumbed = chunk("Deployed build 42 to db1.prod.example.org; the parser failed", 1, crumbs=("apollo rollout",))
    plain = chunk("Ана проверила ParserError в src/app/main.py:17", 2)
    await store.add_history_chunks(sid, [crumbed, plain])
    found = await store.search_history(sid, "parser apollo Ана", limit=5)
    assert {s.chunk for s in found} == {crumbed, plain}
    for hit in found:
        assert hit.terms is not None
        assert set(hit.terms) == set(document_terms(hit.chunk))
        assert term_coverage(["parser", "apollo"], hit.chunk, hit.terms) == term_coverage(
            ["parser", "apollo"], hit.chunk
        )


async def test_limit_and_score_bounds(store: SessionStore) -> None:
    sid = await session(store)
    await store.add_history_chunks(sid, [chunk(f"timeout talking to replica {n}", n) for n in range(1, 11)])
    await store.add_history_chunks(sid, [chunk("unrelated words only", 11)])
    assert len(await store.search_history(sid, "timeout", limit=3)) == 3
    assert len(await store.search_history(sid, "timeout", limit=50)) == 10  # score > 0 only
    assert await store.search_history(sid, "timeout", limit=0) == []
    assert await store.search_history(sid, "nonexistentword", limit=5) == []
    # Blank and stop-word-only queries are the engine's to reject; a store just finds nothing.
    for query in ("", "   ", "the of and"):
        assert await store.search_history(sid, query, limit=5) == []


async def test_equal_scores_go_to_the_newest_chunk(store: SessionStore) -> None:
    sid = await session(store)
    same = [chunk("restarted the worker pool", n, n + 1, key=str(n)) for n in (30, 10, 50, 20, 40)]
    await store.add_history_chunks(sid, same)
    found = await store.search_history(sid, "worker", limit=5)
    assert [s.chunk.last_sequence for s in found] == [51, 41, 31, 21, 11]
    assert len({s.score for s in found}) == 1


async def test_cyrillic_queries_and_text(store: SessionStore) -> None:
    sid = await session(store)
    ru = chunk("Сервер упал из-за нехватки памяти на узле Б", 2)
    await store.add_history_chunks(sid, [chunk("the server ran out of memory", 1), ru, chunk("Ёлка и ёж", 3)])
    assert [s.chunk for s in await store.search_history(sid, "памяти сервер", limit=5)] == [ru]
    assert [s.chunk for s in await store.search_history(sid, "ПАМЯТИ", limit=5)] == [ru]  # any case
    assert texts(await store.search_history(sid, "ёж", limit=5)) == ["Ёлка и ёж"]


async def test_unknown_sessions_have_no_history(store: SessionStore) -> None:
    unknown = str(uuid.uuid4())
    assert await store.search_history(unknown, "anything", limit=5) == []
    with pytest.raises(NotFound):
        await store.add_history_chunks(unknown, [chunk("x marks the spot", 1)])


async def test_deleting_a_session_deletes_its_chunks(store: SessionStore, reopen: Reopen) -> None:
    gone, kept = await session(store), await session(store)
    old = chunk("the password reset token leaked", 1)
    await store.add_history_chunks(gone, [old])
    await store.add_history_chunks(kept, [chunk("the password policy changed", 2)])
    await store.delete_session(gone, caller=ALICE)
    assert await store.search_history(gone, "password", limit=5) == []
    with pytest.raises(NotFound):
        await store.add_history_chunks(gone, [old])

    store = await reopen()
    assert await store.search_history(gone, "password", limit=5) == []
    # A new session under the same id starts with an empty index.
    await store.create_session(caller=BOB, profile_id="p", session_id=gone)
    assert await store.search_history(gone, "leaked", limit=5) == []
    assert await store.add_history_chunks(gone, [old]) == 1
    assert texts(await store.search_history(kept, "password", limit=5)) == ["the password policy changed"]


async def test_chunks_survive_a_restart(store: SessionStore, reopen: Reopen) -> None:
    sid, other = await session(store), await session(store)
    plus_two = timezone(timedelta(hours=2))
    stored = [
        chunk("first pass over the tokenizer", 1, 4, crumbs=("tokenizer work", "pass 1")),
        HistoryChunk("h-2", "tokenizer ✓ ünïcödé", 5, 9, datetime(2026, 3, 1, 12, 0, tzinfo=plus_two), None, ()),
    ]
    await store.add_history_chunks(sid, stored)
    await store.add_history_chunks(other, [chunk("the other tokenizer session", 1)])
    before = await store.search_history(sid, "tokenizer", limit=10)
    assert {s.chunk.content_hash for s in before} == {c.content_hash for c in stored}
    returned = next(s.chunk for s in before if s.chunk.content_hash == "h-2")
    # Times come back as aware UTC, the same instant the caller gave.
    assert returned.start_time is not None and returned.start_time.utcoffset() == timedelta(0)
    assert returned.start_time == stored[1].start_time

    store = await reopen()
    assert await store.search_history(sid, "tokenizer", limit=10) == before
    assert await store.add_history_chunks(sid, stored) == 0  # still idempotent after the restart
    assert await store.add_history_chunks(sid, [chunk("second pass over the tokenizer", 10)]) == 1
    assert len(await store.search_history(sid, "tokenizer", limit=10)) == 3
    assert texts(await store.search_history(other, "tokenizer", limit=10)) == ["the other tokenizer session"]


async def test_every_store_ranks_identifiers_and_reports_rarity_alike(store: SessionStore) -> None:
    sid = await session(store)
    await store.add_history_chunks(
        sid,
        [
            chunk("account acct_9f3k2x opened for billing", 1),
            *[chunk(f"acct list 9f3k2x account account billing run {n}", n + 2, key=str(n)) for n in range(3)],
            chunk("the replicas were restarted", 9),
        ],
    )
    found = await store.search_history(sid, "billing account acct_9f3k2x", limit=5)
    # The exact identifier counts double: its chunk first, although the others repeat its parts.
    assert found[0].chunk.first_sequence == 1
    assert (found[0].rarest_df, found[0].chunk_count) == (1, 5)
    assert [s.rarest_df for s in found[1:]] == [4, 4, 4]  # their rarest match, "acct", is in four
    # Stemmed: "restart" finds "restarted", "replica" finds "replicas".
    assert texts(await store.search_history(sid, "replica restart", limit=5)) == ["the replicas were restarted"]


async def test_searches_racing_compactions_rank_as_one_index_of_every_chunk(store: SessionStore) -> None:
    """Chunks added while searches run (a compaction's chunks, an incoming message's recall): each
    search sees whole chunks only, and once all are in, the ranking is that of every chunk at once.
    (The in-process stores find a chunk's terms at the first search after it came, in a worker
    thread, with adds kept out meanwhile.)"""
    sid = await session(store)
    batches = [
        [
            chunk(f"deploy step {b}-{i} rolled back on host node-{b}{i} after error E{b}{i}", 10 * b + i)
            for i in range(6)
        ]
        for b in range(8)
    ]

    async def add(batch: list[HistoryChunk]) -> None:
        await store.add_history_chunks(sid, batch)

    async def search(q: str) -> list[ScoredChunk]:
        return await store.search_history(sid, q, limit=5)

    queries = ["deploy rolled back", "node-37 error", "E52"]
    during = await asyncio.gather(*(add(b) for b in batches), *(search(q) for q in queries * 4))
    for found in during[len(batches) :]:
        assert isinstance(found, list)
        assert all(s.chunk.text.startswith("deploy step") and s.score > 0 for s in found)
    at_once = await session(store)
    await store.add_history_chunks(at_once, [c for b in batches for c in b])
    for q in queries:
        want = await store.search_history(at_once, q, limit=5)
        got = await search(q)
        assert want and texts(got) == texts(want)
        assert [(s.score, s.rarest_df, s.chunk_count) for s in got] == [
            (s.score, s.rarest_df, s.chunk_count) for s in want
        ]
