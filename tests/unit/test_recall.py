"""Search terms and BM25 ranking of history chunks (contextsvc.core.recall)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rank_bm25 import BM25Okapi

from contextsvc.core.recall import RecallIndex, document_terms, query_terms, rank_chunks, terms
from contextsvc.ports import HistoryChunk


def chunk(text: str, last: int = 1, *, crumbs: tuple[str, ...] = (), key: str = "") -> HistoryChunk:
    return HistoryChunk(f"{key}{text}|{crumbs}", text, last, last, None, None, crumbs)


# --- terms: table-driven -----------------------------------------------------------------------

TERM_CASES = [
    pytest.param("Hello WORLD", ["hello", "world"], id="case-folded"),
    pytest.param("rank_chunks", ["rank_chunks", "rank", "chunk"], id="snake-case"),
    pytest.param(
        "see contextsvc/core/recall.py.",
        ["see", "contextsvc/core/recall.py", "recall.py", "contextsvc", "core", "recal", "py"],
        id="file-path",
    ),
    pytest.param("HistoryChunk", ["historychunk", "histori", "chunk"], id="camel-case"),
    pytest.param("HTTPServer BM25Okapi", ["httpserver", "http", "server", "bm25okapi", "bm25", "okapi"], id="acronyms"),
    pytest.param("v1.2.3 on port 8080", ["v1.2.3", "v1", "2", "3", "port", "8080"], id="digits"),
    pytest.param("pg-test-cluster.sh", ["pg-test-cluster.sh", "pg", "test", "cluster", "sh"], id="hyphens"),
    pytest.param("Сервер УПАЛ, ёж!", ["сервер", "упа", "ёж"], id="cyrillic"),
    pytest.param("हिन्दी naïve", ["हिन्दी", "naïve"], id="combining-marks-stay-in-the-word"),
    pytest.param("ｆｕｌｌｗｉｄｔｈ Straße", ["fullwidth", "strass"], id="nfkc-and-casefold"),  # noqa: RUF001
    pytest.param("数据库设计", ["数据库设计", "数据", "据库", "库设", "设计"], id="cjk-bigrams"),
    pytest.param("the of and и в не", [], id="stop-words-only"),
    pytest.param("  ...  --  ", [], id="no-words"),
]


@pytest.mark.parametrize(("text", "expected"), TERM_CASES)
def test_terms(text: str, expected: list[str]) -> None:
    assert terms(text) == expected


def test_every_occurrence_counts() -> None:
    assert terms("error, error; error_code") == ["error", "error", "error_code", "error", "code"]


def test_query_terms_are_distinct_and_keep_their_order() -> None:
    assert query_terms("build error build The") == ["build", "error"]
    assert query_terms("the and") == []


def test_breadcrumbs_are_document_terms() -> None:
    found = document_terms(chunk("ran tests", crumbs=("project apollo", "step 3")))
    assert found == ["ran", "test", "project", "apollo", "step", "3"]


# --- terms: invariants -------------------------------------------------------------------------

texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=80)


@given(texts)
def test_terms_are_non_empty_folded_and_never_stop_words(text: str) -> None:
    for term in terms(text):
        assert term and term == term.casefold()
        assert term not in {"the", "and", "и", "не"}
        assert not any(c.isspace() for c in term)


@given(texts, texts, texts)
def test_a_query_found_verbatim_in_a_chunk_finds_it(before: str, query: str, after: str) -> None:
    # Whitespace keeps the query's compounds intact inside the document.
    text = f"{before} {query} {after}"
    assert set(terms(query)) <= set(terms(text))
    if query_terms(query):
        found = rank_chunks([chunk("unrelated filler", 1), chunk(text, 2)], query, 5)
        assert text in [s.chunk.text for s in found]


# --- ranking -----------------------------------------------------------------------------------


def test_why_not_plain_bm25okapi() -> None:
    # With two chunks, a term found in only one of them has IDF 0 under BM25Okapi; with one
    # chunk every IDF is negative. Either way the only match would score <= 0 and be dropped.
    assert BM25Okapi([["zygote"], ["other"]]).get_scores(["zygote"]).tolist() == [0.0, 0.0]
    assert BM25Okapi([["zygote", "x"]]).get_scores(["zygote"]).tolist()[0] < 0
    # Ours finds the match in both.
    assert [s.chunk.text for s in rank_chunks([chunk("zygote"), chunk("other")], "zygote", 5)] == ["zygote"]
    only = rank_chunks([chunk("zygote x")], "zygote", 5)
    assert len(only) == 1 and only[0].score > 0


def test_a_term_in_every_chunk_still_scores() -> None:
    found = rank_chunks([chunk(f"error {n}", n, key=str(n)) for n in range(1, 4)], "error", 5)
    assert [s.chunk.last_sequence for s in found] == [3, 2, 1]
    assert all(s.score > 0 for s in found)


def test_rare_terms_outweigh_frequent_ones() -> None:
    common = [chunk(f"build error error build {n}", n) for n in range(1, 9)]
    rare = chunk("zygote", 9)
    found = rank_chunks([*common, rare], "build error zygote", 3)
    assert found[0].chunk == rare and len(found) == 3


def test_ties_go_to_the_newest_then_the_latest_added() -> None:
    same = [chunk("retry", 5, key="a"), chunk("retry", 9, key="b"), chunk("retry", 5, key="c")]
    assert [s.chunk.content_hash[0] for s in rank_chunks(same, "retry", 5)] == ["b", "c", "a"]


def test_nothing_matches() -> None:
    index = RecallIndex([chunk("alpha"), chunk("the and", 2)])
    assert index.search("beta", 5) == []
    assert index.search("the", 5) == []  # stop words only: no terms
    assert index.search("alpha", 0) == []
    assert RecallIndex().search("alpha", 5) == []
    # Only stop words indexed: average length 0 must not be divided by.
    assert RecallIndex([chunk("the and of")]).search("alpha", 5) == []


def test_the_index_is_unique_by_hash_and_rebuilds_after_an_add() -> None:
    index = RecallIndex()
    a = chunk("alpha")
    assert index.fresh([a, a]) == [a]
    assert index.add([a, a]) == 1
    assert index.add([a]) == 0 and len(index) == 1
    assert [s.chunk for s in index.search("alpha", 5)] == [a]
    b = chunk("alpha beta", 2)
    assert index.add([b]) == 1
    assert [s.chunk for s in index.search("beta", 5)] == [b]  # the statistics followed the add
    assert index.chunks == [a, b]


_token_chars = st.sampled_from([*"abcxyzABCXYZ0189_./\\:@-", "é", "Ж", "漢", "字", "かな", "ß", "ǅ"])


@given(st.lists(_token_chars, min_size=1, max_size=12).map("".join))
def test_the_plain_word_shortcut_expands_as_the_rules_do(token: str) -> None:
    from contextsvc.core import recall

    segment_pattern = recall._patterns()[1]
    assert recall._expand(token, segment_pattern) == recall._expand_rules(token, segment_pattern)


@pytest.mark.parametrize("token", ["hello", "HTTP", "2024", "abc123", "ABC123", "HistoryChunk", "a_b", "x.y", "漢字"])
def test_the_plain_word_shortcut_on_known_tokens(token: str) -> None:
    from contextsvc.core import recall

    segment_pattern = recall._patterns()[1]
    assert recall._expand(token, segment_pattern) == recall._expand_rules(token, segment_pattern)
