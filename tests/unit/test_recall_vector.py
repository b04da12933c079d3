"""``RecallIndex`` sums a search's BM25 parts with numpy when its terms' postings are long, and with
a Python loop when they are short: both paths give the same scores to the bit and the same ranking.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import contextsvc.core.recall as recall_module
from contextsvc.core.recall import RecallIndex, weighted_query_terms
from contextsvc.ports import HistoryChunk
from tests.unit.test_recall_incremental import WORDS, fresh_ranking

texts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=14).map(" ".join)


def _chunks(spec: list[tuple[str, int]]) -> list[HistoryChunk]:
    return [HistoryChunk(f"{i}:{text}", text, last, last, None, None) for i, (text, last) in enumerate(spec)]


def _forced(monkeypatch: pytest.MonkeyPatch, vector: bool) -> None:
    # 1: any search with a known term goes to numpy; a huge number: none does
    monkeypatch.setattr(recall_module, "_VECTOR_MIN_POSTINGS", 1 if vector else 10**9)


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.tuples(texts, st.integers(1, 6)), min_size=1, max_size=40),
    st.lists(texts, min_size=1, max_size=5),
    st.integers(1, 12),
)
def test_numpy_and_the_loop_score_and_rank_alike(spec: list[tuple[str, int]], queries: list[str], limit: int) -> None:
    # last_sequence drawn from a few values: equal scores with equal sequences are common, so the
    # ties' last rule (the later position first) is exercised too.
    chunks = _chunks(spec)
    with pytest.MonkeyPatch.context() as mp:
        results = []
        for vector in (False, True):
            _forced(mp, vector)
            index = RecallIndex(chunks)
            results.append(
                ([index.search(q, limit) for q in queries], [index.scores(weighted_query_terms(q)) for q in queries])
            )
    loop, numpy = results
    assert loop == numpy  # ScoredChunk equality compares every score with ==: to the bit
    for q, ranked in zip(queries, numpy[0], strict=True):
        assert ranked == fresh_ranking(chunks, q, limit)


def test_weights_kept_by_either_path_serve_the_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """A term's parts computed by the loop are reused by numpy (and new chunks drop both)."""
    chunks = _chunks([(" ".join(WORDS[i % 7 : i % 7 + 6]), i) for i in range(30)])
    index = RecallIndex(chunks)
    _forced(monkeypatch, False)
    first = index.search("deploy error database retry", 10)
    _forced(monkeypatch, True)
    assert index.search("deploy error database retry", 10) == first
    index.add(_chunks([("deploy deploy zygote", 99)])[0:1])
    again = index.search("deploy error database retry", 10)
    assert again == fresh_ranking(
        [*chunks, *_chunks([("deploy deploy zygote", 99)])[0:1]], "deploy error database retry", 10
    )


def test_long_postings_are_summed_by_numpy_and_short_ones_by_the_loop() -> None:
    common = _chunks([(f"deploy error retry {i}", i) for i in range(1, 61)])
    index = RecallIndex(common)
    wanted = weighted_query_terms("deploy error")
    assert isinstance(index._sums(wanted), np.ndarray)  # 60 postings a term
    few = RecallIndex(common[:3])
    assert isinstance(few._sums(wanted), list)  # 3 postings a term: numpy's fixed cost would dominate


def test_ties_go_to_the_newest_chunk_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    # 30 chunks with the same text: equal scores, ranked by last_sequence, newest first.
    chunks = [
        HistoryChunk(f"h{i}", "ledger reconciliation", 0, seq, None, None) for i, seq in enumerate(range(30, 0, -1))
    ]
    for vector in (False, True):
        _forced(monkeypatch, vector)
        ranked: list[Any] = RecallIndex(chunks).search("ledger", 5)
        assert [r.chunk.last_sequence for r in ranked] == [30, 29, 28, 27, 26]
        assert len({r.score for r in ranked}) == 1
