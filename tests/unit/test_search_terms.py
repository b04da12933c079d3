"""Identifier-aware search (issue 14 item 8): stemming, identifier segments, exact-identifier
ranking and the chunks a long tool output is cut into (core/recall.py, core/chunking.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contextsvc.core.chunking import chunk_line, pieces, turns
from contextsvc.core.messages import Message, Role
from contextsvc.core.recall import (
    IDENTIFIER_WEIGHT,
    is_identifier,
    query_terms,
    rank_chunks,
    stem,
    term_coverage,
    terms,
    weighted_query_terms,
)
from contextsvc.ports import HistoryChunk


def chunk(text: str, last: int = 1, key: str = "") -> HistoryChunk:
    return HistoryChunk(f"{key}{text}", text, last, last, None, None)


# --- stemming ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "text"),
    [
        ("database", "the primary databases are down"),
        ("come", "the crash comes from the retry loop"),
        ("approve the budget", "the budget was approved on Monday"),
        ("deploying", "deployed twice"),
        ("согласовать бюджет", "Бюджет согласует Алексей"),
    ],
)
def test_inflected_forms_find_each_other(query: str, text: str) -> None:
    assert rank_chunks([chunk("unrelated words only", 1), chunk(text, 2)], query, 5)[0].chunk.text == text


def test_identifiers_and_numbers_are_never_stemmed() -> None:
    assert "acct_9f3k2x" in terms("account acct_9f3k2x")
    assert "running_jobs" in terms("running_jobs")  # the whole identifier as written ...
    assert "run" in terms("running_jobs")  # ... and its parts stemmed
    assert stem("eu") == "eu" and stem("1200") == "1200"
    assert stem("naïve") == "naïve"  # not ASCII, not Cyrillic: as it is


def test_segments_between_colons_and_at_signs_are_terms() -> None:
    assert "handler.py" in terms("src/api/handler.py:142")
    assert "example.com" in terms("oncall@example.com")
    assert "status.example.org" in terms("https://status.example.org/incidents/88")
    assert "2026.03" in terms("release/2026.03")


# --- exact identifiers first ------------------------------------------------------------------------


def test_identifier_terms_weigh_more_in_a_query() -> None:
    weighted = weighted_query_terms("billing id acct_9f3k2x")
    assert weighted.count("acct_9f3k2x") == IDENTIFIER_WEIGHT
    assert weighted.count("bill") == 1
    assert is_identifier("10.0.3.7") and is_identifier("inc-4411") and is_identifier("1200")
    assert not is_identifier("billing") and not is_identifier("3")


def test_the_exact_identifier_outranks_shared_parts_and_words() -> None:
    exact = chunk("account acct_9f3k2x opened", 1, key="e")
    parts = [chunk(f"acct list 9f3k2x account account billing {n}", n + 2, key=str(n)) for n in range(3)]
    found = rank_chunks([exact, *parts], "billing account acct_9f3k2x", 5)
    assert found[0].chunk is exact


def test_term_coverage_is_the_share_of_query_terms_present() -> None:
    wanted = query_terms("Which cache node evicted keys?")
    assert term_coverage(wanted, chunk("cache node cache-02.eu.example.net evicted 1200 keys")) == 1.0
    assert term_coverage(wanted, chunk("the cache is warm")) == pytest.approx(0.25)  # cache, node, evict, key
    assert term_coverage([], chunk("anything")) == 0.0


# --- chunks ----------------------------------------------------------------------------------------


def msg(seq: int, role: Role, content: str, call_id: str = "") -> Message:
    return Message(role=role, content=content, sequence_number=seq, tool_call_id=call_id)


def log_turn(first: int, lines: int, fact: str, at: int) -> list[Message]:
    body = [f"12:00:{i % 60:02d} worker ok batch {i}" for i in range(lines)]
    body.insert(at, fact)
    return [
        msg(first, Role.USER, "run the job"),
        msg(first + 1, Role.ASSISTANT, "running"),
        msg(first + 2, Role.TOOL, "\n".join(body), "c1"),
        msg(first + 3, Role.ASSISTANT, "done"),
    ]


def test_a_short_turn_is_one_chunk() -> None:
    rows = [msg(1, Role.USER, "hello"), msg(2, Role.ASSISTANT, "hi"), msg(3, Role.USER, "next")]
    got = pieces(rows, max_chars=800)
    assert [p.text for p in got] == ["#1 user: hello\n#2 assistant: hi", "#3 user: next"]
    assert [len(p.rows) for p in got] == [2, 1]
    assert [len(t) for t in turns(rows)] == [2, 1]


def test_a_long_tool_output_is_cut_into_line_windows_with_a_header() -> None:
    fact = "replica listening on 10.0.3.7 port 5433 accepted the connection"
    rows = log_turn(10, 60, fact, 37)
    got = pieces(rows, max_chars=400, overlap_lines=1)
    windows = [p for p in got if p.rows == (rows[2],)]
    assert len(windows) > 3
    assert all(p.text.startswith("#12 tool c1:\n") and len(p.text) <= 400 for p in windows)
    assert sum(fact in p.text for p in windows) >= 1
    # Nothing is lost: every line of the output is in some window.
    for line in rows[2].content.splitlines():
        assert any(line in p.text for p in windows)
    # The short messages around it are packed into their own chunks.
    packed = [p for p in got if p.rows != (rows[2],)]
    assert [m.sequence_number for p in packed for m in p.rows] == [10, 11, 13]
    # And the fact's window wins the search among all of them.
    chunks = [chunk(p.text, i + 1, key=str(i)) for i, p in enumerate(got)]
    assert fact in rank_chunks(chunks, "What is the replica's IP address?", 1)[0].chunk.text


def test_a_line_longer_than_a_chunk_is_cut_at_whitespace() -> None:
    rows = [msg(1, Role.USER, "x " + "word " * 400)]
    got = pieces(rows, max_chars=200)
    assert len(got) > 5 and all(len(p.text) <= 200 for p in got)
    assert pieces([msg(1, Role.USER, "y" * 1000)], max_chars=200)[0].text.startswith("#1 user:\ny")


def test_zero_max_chars_keeps_one_chunk_per_turn() -> None:
    rows = log_turn(1, 60, "fact", 3)
    assert [p.text for p in pieces(rows, max_chars=0)] == ["\n".join(chunk_line(m) for m in rows)]


@given(
    st.lists(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=300), min_size=1, max_size=8),
    st.integers(40, 600),
    st.integers(0, 3),
)
def test_every_word_of_every_row_is_in_some_chunk_within_the_size(
    contents: list[str], max_chars: int, overlap: int
) -> None:
    rows = [msg(i + 1, Role.USER if i % 3 == 0 else Role.TOOL, c, "c") for i, c in enumerate(contents)]
    got = pieces(rows, max_chars=max_chars, overlap_lines=overlap)
    for m in rows:
        covering = " ".join(p.text for p in got if m in p.rows)
        for word in m.content.split():
            assert word[:8] in covering
    assert all(len(p.text) <= max_chars for p in got)
