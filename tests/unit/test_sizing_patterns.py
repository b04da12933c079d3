"""The size measure's patterns accept what they were written to accept, in time linear in the
piece: a pattern that splits a run every possible way before failing stalls the event loop for
minutes on one 32-letter piece a client can send."""

from __future__ import annotations

import itertools
import re

from contextsvc.core import sizing
from tests.support.deadline import deadline

#: The camelCase pattern as first written: the language the rewrite must keep.
NESTED_CAMEL = re.compile(r"(?:[A-Z]?[a-z]+)+")


def test_the_camel_pattern_accepts_exactly_the_strings_the_nested_one_did() -> None:
    camel = sizing._CAMEL
    for n in range(1, 9):
        for letters in itertools.product("abAB", repeat=n):
            word = "".join(letters)
            assert bool(camel.fullmatch(word)) == bool(NESTED_CAMEL.fullmatch(word)), word


def test_a_long_lower_case_run_that_fails_the_camel_pattern_is_classified_at_once() -> None:
    sizing.piece_class.cache_clear()
    sizing._piece_split.cache_clear()
    with deadline(10):
        assert sizing.piece_class("a" * 30 + "AB") == sizing.IDENT  # two capitals: no camel hump
        assert sizing.piece_class(" " + "b" * 31 + "C") == sizing.IDENT  # a hump without its lower case
        assert sizing.feature_units("x" * 29 + "HTTP " * 100)[sizing.IDENT] > 0
    assert sizing.piece_class("a" * 30 + "Ab") == sizing.WORD  # still camelCase when it is
