"""A pattern is skipped over a text that holds none of what it needs (``lazy_re.may_match``): the
entities, fact anchors and anchor kinds found are exactly those of running every pattern."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextsvc.core import breadcrumbs, facts
from contextsvc.core.lazy_re import DIGIT, may_match

# Pieces that make the patterns match (and nearly match), joined by separators that matter to them.
PIECES = [
    "https://example.org/a/b?c=1",
    "ftp://files.example.net",
    "ops@example.com",
    "C:\\Users\\me\\notes.txt",
    "~/src/app/main.py",
    "./run.sh",
    "src/app/main.py:42",
    "ABC-123",
    "123e4567-e89b-12d3-a456-426614174000",
    "PROJ-7-2",
    "10.0.0.12:8080",
    "localhost:5432",
    "v1.2.3",
    "2.10.0-rc1",
    "3f2a9bc1",
    "deadbeef",
    "abcdef0",  # the shortest hex run an id is (the id gate's second half)
    "cafe12",  # one short of it
    "defaced",  # hex letters only: an id too
    "xYz",  # the shortest camelCase word (the gate's first half)
    "Xy",
    "HttpServer",
    "getValue",
    "MAX_RETRIES",
    "os.path.join",
    "$1,200",
    "€5k",
    "12%",
    "250ms",
    "3 tokens",
    "2026-03-04",
    "Mar 4th, 2026",
    "db1.prod.example.org",
    "`build`",
    '"release notes"',
    "«заметки»",
    "'quoted name'",
    "$ ls -la; pwd",
    "error",
    "Timed out",
    "Alice Smith",
    "said, Bob Jones",
    "٣ days",  # a digit \\d matches though it is not ASCII
    "plain",
    "words",
    "Москва",
    "-",
    ".",
    "/",
    ":",
    "_",
    "@",
    "%",
    "$",
    "'",
]
SEPARATORS = [" ", ", ", "; ", ". ", "\n", "\n$ ", ": ", "/", "", '"', "(", ")"]
texts = st.lists(st.tuples(st.sampled_from(PIECES), st.sampled_from(SEPARATORS)), max_size=24).map(
    lambda parts: "".join(p + s for p, s in parts)
)


def _everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every pattern whatever the text holds."""
    monkeypatch.setattr(breadcrumbs, "may_match", lambda text, needs: True)
    monkeypatch.setattr(facts, "may_match", lambda text, needs: True)


def _found(text: str) -> tuple[object, ...]:
    return (
        tuple(breadcrumbs._from_text(text, max_chars=200, scan_chars=20_000)),
        facts._anchors(text),
        facts.anchor_kinds(text),
    )


@settings(max_examples=300, deadline=None)
@given(texts)
def test_skipping_patterns_finds_what_running_them_all_finds(text: str) -> None:
    skipped = _found(text)
    with pytest.MonkeyPatch.context() as monkeypatch:
        _everything(monkeypatch)
        assert _found(text) == skipped


def _kept(match: re.Match[str]) -> bool:
    """A match ``breadcrumbs`` keeps: a quantity's number without its unit is not one."""
    return "unit" not in match.re.groupindex or match.group("unit") is not None


def test_each_pattern_matches_only_where_its_needs_are() -> None:
    """The needs are real: a piece each pattern matches holds one of them (else a wrong need
    would skip matches the property above might not generate)."""
    for kind, pattern, needs in breadcrumbs._patterns():
        matched = [p for p in PIECES if any(map(_kept, pattern.finditer(p)))]
        assert matched, kind
        assert all(may_match(p, needs) for p in matched), (kind, pattern.pattern)
    for kind, needs in facts._NEEDS.items():
        matched = [p for p in PIECES if facts._ANCHORS[kind].search(p)]
        assert matched, kind
        assert all(may_match(p, needs) for p in matched), kind


def test_may_match() -> None:
    assert may_match("no needs", None)
    assert not may_match("plain prose", ("://", "@"))
    assert may_match("mail me@x.org", ("://", "@"))
    assert may_match("٣", (DIGIT,)) and not may_match("three", (DIGIT,))
    assert not may_match("a literal \\d is no digit", (DIGIT,))
