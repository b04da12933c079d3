"""ASCII text is split by an ASCII-class copy of the piece pattern (``sizing._ASCII_PIECE``), which is
faster; it must split every ASCII text into exactly the pieces the Unicode pattern makes, or every
size, feature and calibration would move."""

from __future__ import annotations

import itertools
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from contextsvc.core import sizing

ASCII = "".join(map(chr, range(128)))


def _patterns() -> tuple[re.Pattern[str], re.Pattern[str]]:
    sizing._PIECE.findall("")  # compiled at first use (``lazy_global``)
    sizing._ASCII_PIECE.findall("")
    return sizing._PIECE, sizing._ASCII_PIECE


def test_every_ascii_character_and_pair_splits_the_same() -> None:
    unicode, ascii_only = _patterns()
    for text in itertools.chain(ASCII, map("".join, itertools.product(ASCII, repeat=2))):
        assert ascii_only.findall(text) == unicode.findall(text), repr(text)


# Runs of one kind (long words, digit runs, whitespace with the separators \x1c-\x1f) are where the
# alternatives and their 32-character bounds meet.
_RUNS = st.sampled_from(
    ["a", "Z", "word", "x" * 40, "_", ".", "()", "!!", "7", "1234567", " ", "  ", "\t", "\n", "\r\n", "\x0b", "\x0c"]
    + [chr(c) for c in range(0x1C, 0x20)]
    + [" " * 35, "\x1c" * 33, "-" * 40]
)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(_RUNS, st.text(alphabet=ASCII, max_size=12)), max_size=40))
def test_any_ascii_text_splits_the_same(parts: list[str]) -> None:
    unicode, ascii_only = _patterns()
    text = "".join(parts)
    assert ascii_only.findall(text) == unicode.findall(text)


def test_sizes_use_the_ascii_pattern_and_agree_with_the_unicode_one() -> None:
    unicode, _ = _patterns()
    text = "def f(x):\n    return x_1 + 42  # note\x1c\x1d end.\r\n" * 3
    assert sizing.pieces(text) == unicode.findall(text)
    assert sizing.text_size(text) == sizing._units(unicode.findall(text))
    assert sizing.feature_units(text) == sizing._units_of(unicode.findall(text))


def test_whitespace_is_written_out_because_ascii_classes_differ_there() -> None:
    """Why ``_ASCII_SPACE``: the piece pattern compiled with ASCII classes alone splits text holding
    \\x1c-\\x1f otherwise (Unicode counts them as whitespace, ASCII classes do not)."""
    unicode, ascii_only = _patterns()
    naive = re.compile(sizing._PIECE_SOURCE, re.ASCII)
    text = "\x1c "
    assert naive.findall(text) != unicode.findall(text)
    assert ascii_only.findall(text) == unicode.findall(text)
