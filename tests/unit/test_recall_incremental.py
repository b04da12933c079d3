"""The incremental BM25 of ``RecallIndex`` ranks exactly as a model built fresh over every chunk.

The reference is ``rank_bm25``'s ``BM25Okapi`` with the Lucene IDF (what ``RecallIndex`` rebuilt
after every ``add`` before it kept its statistics up to date): scores must be equal bit for bit and
the ranking identical, however the chunks arrive (one by one, in batches, with duplicates).
"""

from __future__ import annotations

import heapq
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from rank_bm25 import BM25Okapi

from contextsvc.core.recall import (
    BM25_B,
    BM25_K1,
    RecallIndex,
    bm25_idf,
    document_terms,
    weighted_query_terms,
)
from contextsvc.ports import HistoryChunk, ScoredChunk


class _LuceneIdf(BM25Okapi):  # type: ignore[misc]  # rank_bm25 ships no type hints
    def _calc_idf(self, nd: dict[str, int]) -> None:
        self.df = dict(nd)
        self.idf = {word: math.log(1.0 + (self.corpus_size - f + 0.5) / (f + 0.5)) for word, f in nd.items()}


def fresh_ranking(chunks: list[HistoryChunk], query: str, limit: int) -> list[ScoredChunk]:
    """What ``RecallIndex.search`` returned when it built a ``rank_bm25`` model over every chunk."""
    unique: dict[str, HistoryChunk] = {}
    for c in chunks:
        unique.setdefault(c.content_hash, c)
    docs = list(unique.values())
    wanted = weighted_query_terms(query)
    if not wanted or limit <= 0 or not docs:
        return []
    model: Any = _LuceneIdf([document_terms(c) for c in docs], k1=BM25_K1, b=BM25_B)
    if not any(t in model.idf for t in wanted):
        return []
    scores = model.get_scores(wanted).tolist()
    best = heapq.nsmallest(
        limit,
        (i for i, s in enumerate(scores) if s > 0),
        key=lambda i: (-scores[i], -docs[i].last_sequence, -i),
    )
    out = []
    for i in best:
        rarest = min((model.df[t] for t in set(wanted) if t in model.doc_freqs[i]), default=len(docs))
        out.append(ScoredChunk(docs[i], float(scores[i]), rarest_df=rarest, chunk_count=len(docs)))
    return out


WORDS = [
    "deploy",
    "deploys",
    "error",
    "database",
    "payments-api-eu",
    "INV-2026-48213",
    "/srv/billing/ledger.csv",
    "retry",
    "the",
    "HistoryChunk",
    "acct_9f3k2x",
    "10.0.3.7",
    "Margarethe",
    "сервер",
    "数据库",
    "2026-03-14",
]
texts = st.lists(st.sampled_from(WORDS), min_size=0, max_size=12).map(" ".join)
chunks_st = st.lists(
    st.tuples(texts, st.integers(1, 40), st.lists(st.sampled_from(WORDS), max_size=2)),
    min_size=0,
    max_size=14,
)


def _chunk(i: int, text: str, last: int, crumbs: list[str]) -> HistoryChunk:
    # Duplicate texts get one hash now and then, so the index's dedup is exercised too.
    key = text if i % 3 == 0 else f"{i}:{text}"
    return HistoryChunk(key, text, max(1, last - 2), last, None, None, tuple(crumbs))


@settings(max_examples=150, deadline=None)
@given(chunks_st, st.lists(texts, min_size=1, max_size=4), st.integers(0, 3), st.integers(1, 8))
def test_incremental_ranking_is_identical_to_a_fresh_model(
    spec: list[tuple[str, int, list[str]]], queries: list[str], batch: int, limit: int
) -> None:
    chunks = [_chunk(i, t, last, crumbs) for i, (t, last, crumbs) in enumerate(spec)]
    index = RecallIndex()
    added: list[HistoryChunk] = []
    step = batch + 1
    for at in range(0, len(chunks), step):
        index.add(chunks[at : at + step])
        added += chunks[at : at + step]
        # Searched between adds: a stale statistic would show up on the next search.
        for q in queries:
            assert index.search(q, limit) == fresh_ranking(added, q, limit)
    for q in queries:
        assert index.search(q, limit) == fresh_ranking(chunks, q, limit)
        assert RecallIndex(chunks).search(q, limit) == fresh_ranking(chunks, q, limit)


def test_scores_are_bit_for_bit_those_of_rank_bm25() -> None:
    chunks = [_chunk(i, " ".join(WORDS[i : i + 5]), i + 1, []) for i in range(len(WORDS))]
    index = RecallIndex(chunks)
    wanted = weighted_query_terms("deploy error INV-2026-48213 сервер")
    got = index.scores(wanted)
    model: Any = _LuceneIdf([document_terms(c) for c in chunks], k1=BM25_K1, b=BM25_B)
    expected = model.get_scores(wanted).tolist()
    assert got and all(got.get(i, 0.0) == s for i, s in enumerate(expected))
    assert bm25_idf(10, 10) > 0  # a term in every chunk still counts


def test_a_search_costs_the_postings_not_the_history() -> None:
    # 2,000 chunks without the query's term, 3 with it: only those 3 are scored.
    filler = [HistoryChunk(f"f{i}", f"filler line {i}", i, i, None, None) for i in range(1, 2001)]
    rare = [HistoryChunk(f"r{i}", f"zygote {i}", 3000 + i, 3000 + i, None, None) for i in range(3)]
    index = RecallIndex([*filler, *rare])
    assert set(index.scores(weighted_query_terms("zygote"))) == {2000, 2001, 2002}
    assert [s.chunk.last_sequence for s in index.search("zygote", 5)] == [3002, 3001, 3000]


def test_a_chunks_terms_are_found_by_the_first_search_after_it_came(monkeypatch: Any) -> None:
    """Adding keeps chunks (compactions add them to sessions that may never be searched); the first
    search finds the terms of every chunk added since, once each, and ranks as a fresh model."""
    import contextsvc.core.recall as recall_module

    seen: list[str] = []
    real = recall_module.document_terms

    def counted(c: HistoryChunk) -> list[str]:
        seen.append(c.content_hash)
        return real(c)

    monkeypatch.setattr(recall_module, "document_terms", counted)
    chunks = [_chunk(i, " ".join(WORDS[i : i + 4]), i + 1, []) for i in range(len(WORDS))]
    index = RecallIndex(chunks[:3])
    index.add(chunks[3:6])
    index.add(chunks[2:8])  # two already kept: added once
    assert seen == [] and index.pending and len(index) == 8
    first = index.search("deploy error", 5)
    assert first and first == fresh_ranking(chunks[:8], "deploy error", 5)
    assert seen == [c.content_hash for c in chunks[:8]] and not index.pending
    index.search("сервер", 5)
    index.add(chunks[8:])
    assert len(seen) == 8  # nothing new until the next search
    last = index.search("сервер", 5)
    assert last and last == fresh_ranking(chunks, "сервер", 5)
    assert seen == [c.content_hash for c in chunks]
