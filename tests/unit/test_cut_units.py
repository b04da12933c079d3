"""A view's cut of a long field is measured from the whole field's pieces (``sizing.cut_feature_units``,
``tokens.remember_cut``): the same numbers as measuring the cut text whole, for any text, any cut."""

from __future__ import annotations

import dataclasses
import gc
import random
import weakref

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from contextsvc.core import sizing, tokens
from contextsvc.core.calibration import Calibration
from contextsvc.core.messages import Message, Role
from contextsvc.core.priors import N_CLASSES, N_UNITS
from contextsvc.core.tokens import CalibratedCounter, message_features
from contextsvc.core.view_budget import cut_marker, truncate_for_view

#: Bits of text whose pieces meet at every kind of border: letter runs (Latin, Cyrillic, CJK),
#: prefixed identifiers, digit groups, punctuation runs with newlines, space and newline runs
#: longer than one piece, a marker-like bracket, emoji.
BITS = [
    "word", " ", "  ", "   ", "\n", "\n\n", "\r\n", "\t", "Привет", " мир", "_x", ".attr", "123456", "7",
    "{", "}", '"', "::", "漢字", "かな", "한국", "CamelCase", "HTTPServer", ",", ". ", "\u2013", "😀", "é",
    "[… 12 chars cut …]", "x" * 40, " " * 40, "!" * 70, "!" * 41, "\n" * 40, "Ё" * 35, "wordwordword" * 3 + "AB",
]  # fmt: skip

texts = st.lists(st.sampled_from(BITS), min_size=1, max_size=120).map("".join)


@pytest.fixture(autouse=True)
def _fresh_memos() -> None:
    sizing.clear_caches(pieces=False)


@settings(max_examples=300, deadline=None)
@given(texts, st.floats(0, 1), st.floats(0, 1), st.sampled_from([1, 2, 64]), st.booleans())
@example("!!!abc def", 0.3, 0.5, 1, True)  # a punctuation run the marker's newline joins
def test_a_cut_measured_from_its_texts_pieces_is_the_cut_measured_whole(
    text: str, at: float, span: float, step: int, marked: bool
) -> None:
    head = int(len(text) * at)
    tail = head + int((len(text) - head) * span)
    marker = cut_marker(tail - head) if marked else " " * (tail % 7)
    cut = text[:head] + marker + text[tail:]
    whole = sizing.feature_units(cut)
    sizing.clear_caches(pieces=False)  # measured again below, not read from the memo
    old = sizing._INDEX_STEP
    sizing._INDEX_STEP = step  # the index's entries every piece, every other one, or sparse
    try:
        assert sizing.cut_feature_units(text, cut, head, tail) == whole  # its own index
        index = sizing.cut_index(text)
        assert index is not None and index.whole() == sizing.feature_units(text)
        assert sizing.cut_feature_units(text, cut, head, tail, index) == whole  # a kept one
    finally:
        sizing._INDEX_STEP = old


def test_many_random_cuts_of_mixed_text() -> None:
    """The same, over a fixed set of random texts and cuts (many cheap cases, sparse and dense
    indexes): a cut's border inside or next to any kind of piece."""
    rng = random.Random(20261205)
    old = sizing._INDEX_STEP
    try:
        for trial in range(1500):
            sizing._INDEX_STEP = (1, 2, 5, 64)[trial % 4]
            sizing.clear_caches(pieces=False)
            text = "".join(rng.choice(BITS) for _ in range(rng.randint(1, 200)))
            head = rng.randint(0, len(text))
            tail = rng.randint(head, len(text))
            marker = cut_marker(tail - head) if rng.random() < 0.7 else rng.choice(["", "x", " ", "\n", "Я", " " * 50])
            cut = text[:head] + marker + text[tail:]
            whole = sizing.feature_units(cut)
            sizing.clear_caches(pieces=False)
            assert sizing.cut_feature_units(text, cut, head, tail) == whole, (text, head, tail, marker)
    finally:
        sizing._INDEX_STEP = old


@pytest.mark.parametrize(
    "longest",
    [
        " " + "!" * 32 + "\n" * 32,  # a punctuation run with its newlines: the longest piece
        " " * 32 + "\n" * 32,  # a space run ending in newlines
        " " * 40 + "x",  # spaces the next word's piece leaves one of
        "a" * 32 + "é" * 3,  # a letter run at its longest
    ],
)
def test_cuts_anywhere_in_and_around_the_longest_pieces(longest: str) -> None:
    """A cut whose border falls anywhere in (or just after) the longest pieces the pattern makes:
    the pieces it must split again reach back that far."""
    text = "lead in " * 20 + longest + "tail out " * 20
    for head in range(120, 260):
        for tail in (head, head + 1, head + 37, len(text) - 3):
            cut = text[:head] + cut_marker(tail - head) + text[tail:]
            whole = sizing.feature_units(cut)
            sizing.clear_caches(pieces=False)
            assert sizing.cut_feature_units(text, cut, head, tail) == whole, (head, tail)


#: Every class and the message and tool-call framing priced: a cut moves each column.
LINE = CalibratedCounter(
    Calibration((0.3,) * N_CLASSES + (0.2,) * (N_UNITS - N_CLASSES) + (2.4, 4.8, 100.0), 2, True, 0.0)
)


@settings(max_examples=100, deadline=None)
@given(texts, texts, st.integers(0, 40), st.integers(5, 400))
def test_a_truncated_message_carries_the_features_it_would_be_measured_with(
    content: str, thinking: str, repeat: int, budget: int
) -> None:
    m = Message(role=Role.TOOL, content=content * repeat, thinking=thinking * (repeat // 2), tool_call_id="c1")
    cut = truncate_for_view(m, budget, LINE)
    assert message_features(cut) == tokens._features(cut)  # what it carries == measured whole


@pytest.mark.parametrize(
    ("text", "cut", "head", "tail"),
    [
        ("123" * 32 + "привет мир", "привет мир", 0, 96),  # the cut starts on a tail piece of the text
        ("привет всем", "\nпривет всем", 0, 0),  # noqa: RUF001
        ("abc def", "abc def", 0, 0),
    ],
)
def test_a_cut_whose_first_piece_is_one_of_the_texts_inner_pieces(text: str, cut: str, head: int, tail: int) -> None:
    """The text priced that piece as an inner one; the cut prices it as its first."""
    assert cut == text[:head] + cut[head : len(cut) - (len(text) - tail)] + text[tail:]
    assert sizing.cut_feature_units(text, cut, head, tail) == sizing.feature_units(cut)


def test_a_messages_cut_index_is_made_once_and_dropped_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-cut in turn (each new calibration), a fleet's long rows are indexed once each, however
    many there are (a bounded text memo cycled through more than it held rebuilt every index),
    and an index goes with its message."""
    made: list[str] = []

    def counted(text: str) -> sizing.CutIndex | None:
        made.append(text)
        return sizing.cut_index(text)

    monkeypatch.setattr(tokens, "cut_index", counted)
    rows = [
        Message(role=Role.TOOL, content=f"row {i}: " + "word, another; " * 4_000, tool_call_id=f"c{i}")
        for i in range(40)
    ]
    for scale in (1.0, 1.01, 1.02):  # three calibrations: every row cut at another place each time
        counter = CalibratedCounter(
            dataclasses.replace(LINE.calibration, weights=tuple(w * scale for w in LINE.calibration.weights))
        )
        for m in rows:
            cut = truncate_for_view(m, 2_000, counter)
            assert cut is not m and message_features(cut) == tokens._features(cut)
    assert len(made) == len(rows)  # one index a row, not one a cut
    index = tokens._CUT_INDEXES.get(rows[0], lambda _: {})["content"]
    assert index is not None and index.starts.itemsize == 4 and index.nbytes < len(rows[0].content)
    probe, held = weakref.ref(rows[0]), len(tokens._CUT_INDEXES._entries)
    del rows, m, cut
    gc.collect()
    assert probe() is None and len(tokens._CUT_INDEXES._entries) == held - 40
