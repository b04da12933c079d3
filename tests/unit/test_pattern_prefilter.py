"""A pattern is skipped over a text that holds none of what it needs (``lazy_re.may_match``), and a
case-free pattern searches ASCII text lower-cased (``lazy_re.folded``): the entities, fact anchors,
anchor kinds, fact lines and search terms found are exactly those of running every pattern with
``re.I``."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextsvc.core import breadcrumbs, facts, recall
from contextsvc.core.compression import importance
from contextsvc.core.history import HistoryChunk
from contextsvc.core.lazy_re import DIGIT, FoldedPattern, folded, has_digit, lazy, may_match
from contextsvc.core.messages import Message, Role

# Letters ``re.I`` matches to ASCII ones (i, s, k) though lower-casing does not make them those.
DOTLESS_I, LONG_S, KELVIN, DOTTED_I = "\u0131", "\u017f", "\u212a", "\u0130"

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
    f"{LONG_S}ep 9",  # Unicode folding makes it a month: the date is found in non-ASCII text only
    "DEC. 12",
    "3 MS",
    "us-southeast-1",  # a cloud region (recall's kind words), and near misses
    "EU-WEST-2",
    "ap-gov-north-1",
    f"us-ea{LONG_S}t-1",
    "sa-east-x",
    "INC-4411",  # a ticket
    "INC-4",
    "acct_9f3k2x",  # an id for search: letters and digits in one word
    "run_command",
    "db1.prod.example.org",
    "`build`",
    '"release notes"',
    "«заметки»",
    "'quoted name'",
    "$ ls -la; pwd",
    "error",
    "Timed out",
    "ERROR",
    f"fa{DOTLESS_I}led",
    f"tracebac{KELVIN}",
    f"you mu{LONG_S}t",
    "We MUST keep it",
    "I prefer tabs",
    "Call me Ana",
    "don't",
    "decided.",
    "Alice Smith",
    "said, Bob Jones",
    "met Zoë",
    "и Иван Петров",
    "x Y",
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
SEPARATORS = [" ", ", ", "; ", ". ", "! ", "? ", ".", "\n", "\n$ ", ": ", "/", "", '"', "(", ")", "-", "_"]
texts = st.lists(st.tuples(st.sampled_from(PIECES), st.sampled_from(SEPARATORS)), max_size=24).map(
    lambda parts: "".join(p + s for p, s in parts)
)


def _everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every pattern whatever the text holds, the case-free ones with ``re.I``."""
    monkeypatch.setattr(breadcrumbs, "may_match", lambda text, needs: True)
    monkeypatch.setattr(facts, "may_match", lambda text, needs: True)
    monkeypatch.setattr(facts, "_ERROR", lazy(facts._ERROR.pattern, re.I))
    monkeypatch.setattr(facts, "_PREFERENCE", lazy(facts._PREFERENCE.pattern, re.I))
    monkeypatch.setattr(recall, "may_match", lambda text, needs: True)
    anchors = {kind: lazy(p.pattern, re.I) if isinstance(p, FoldedPattern) else p for kind, p in facts._ANCHORS.items()}
    monkeypatch.setattr(facts, "_ANCHORS", anchors)


def _found(text: str) -> tuple[object, ...]:
    rows = [Message(role=role, content=text) for role in (Role.USER, Role.ASSISTANT, Role.TOOL)]
    return (
        tuple(breadcrumbs._from_text(text, max_chars=200, scan_chars=20_000)),
        facts._anchors(text),
        facts.anchor_kinds(text),
        facts.fact_lines(rows),
        recall.kind_terms(text),
        recall.document_terms(HistoryChunk("h", text, 1, 1, None, None, (text[:40],))),
    )


@settings(max_examples=300, deadline=None)
@given(texts)
def test_skipping_patterns_finds_what_running_them_all_finds(text: str) -> None:
    skipped = _found(text)
    with pytest.MonkeyPatch.context() as monkeypatch:
        _everything(monkeypatch)
        assert _found(text) == skipped


def _every_anchor_kind(text: str) -> set[str]:
    """``facts.anchor_kinds`` the long way: every match of every pattern (with ``re.I`` where the
    pattern is case-free), none skipped, and none left unread once its kind is known."""
    found: set[str] = set()
    for kind, pattern in facts._ANCHORS.items():
        scan = lazy(pattern.pattern, re.I) if isinstance(pattern, FoldedPattern) else pattern
        for match in scan.finditer(text):
            value = facts._value(match).strip(".,;:")
            if len(value) < 3 or (kind == "name" and value in facts._COMMON_NAMES):
                continue
            found.add("ip" if kind == "host" and facts._IPV4.fullmatch(value) else kind)
    return found


@settings(max_examples=300, deadline=None)
@given(texts)
def test_anchor_kinds_are_those_of_every_anchor(text: str) -> None:
    assert facts.anchor_kinds(text) == _every_anchor_kind(text)


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


def test_gates_that_are_patterns_find_exactly_where_their_pattern_can_start() -> None:
    """A gate scans a text once, a character class first (fast in ``re``): it must hold wherever
    its pattern matches, and fail on the texts each gate was written to pass over."""
    gates = {kind: needs for kind, needs in facts._NEEDS.items()}
    assert not may_match("the build failed. we retried.", gates["host"])  # a full stop is no host
    assert may_match("db1.prod.example.org", gates["host"])
    assert not may_match("note: see below", gates["file_line"]) and may_match("a.py:3", gates["file_line"])
    assert not may_match("Bob left. Ana stayed", gates["name"])  # capitals starting sentences
    assert may_match("then, Bob left", gates["name"])
    assert not may_match("Plain Prose Here", gates["id"]) and may_match("getValue", gates["id"])
    camel = next(needs for kind, p, needs in breadcrumbs._patterns() if "[A-Z][a-z0-9]+" in p.pattern)
    assert camel is not None and not may_match("Prose With Capitals", camel) and may_match("v2Api", camel)
    assert not may_match("a well-known north-east wind", recall._REGION_NEEDS)
    assert may_match("in us-southeast-1", recall._REGION_NEEDS) and may_match("EU-WEST-2", recall._REGION_NEEDS)
    assert not may_match("a well-known fact", recall._TICKET_NEEDS) and may_match("INC-4411", recall._TICKET_NEEDS)


# Words of the folded patterns, spelt with the letters Unicode folding matches, and others.
FOLDED_WORDS = [
    *("kit", "Kit", f"{KELVIN}it", f"{LONG_S}it", f"s{DOTLESS_I}t", "KIT", f"S{DOTTED_I}T"),
    *("error", f"fa{DOTLESS_I}led", "Failed", f"mu{LONG_S}t", "MUST", "must"),
    *("no,", "No!", f"in{LONG_S}tead", "INSTEAD", "Don't", "ACTUALLY", "let's go with"),
]
folded_texts = st.lists(
    st.tuples(st.sampled_from([*FOLDED_WORDS, "x", DOTTED_I, "don't", DOTLESS_I]), st.sampled_from([" ", "-", ". "])),
    max_size=8,
).map(lambda parts: "".join(w + sep for w, sep in parts))


@settings(max_examples=300, deadline=None)
@given(folded_texts)
def test_a_folded_pattern_finds_what_re_i_finds(text: str) -> None:
    for source in (facts._ERROR.pattern, facts._PREFERENCE.pattern, importance._CORRECTION.pattern, r"\b(?:kit|sit)\b"):
        cheap, exact = folded(source).search(text), re.search(source, text, re.I)
        assert (cheap is None) == (exact is None), source
        if cheap is not None and exact is not None:
            assert cheap.span() == exact.span()


def test_a_folded_pattern_is_written_in_lower_case() -> None:
    with pytest.raises(ValueError, match="lower case"):
        folded(r"\bError\b")
    assert folded(r"\bnot\S+\b").search("NOTE") is not None  # escapes may be upper case


@given(st.text(alphabet=st.sampled_from("ab 09٣੭x\n"), max_size=30))
def test_has_digit_is_what_re_finds(text: str) -> None:
    assert has_digit(text) == (re.search(r"\d", text) is not None)


def test_may_match() -> None:
    assert may_match("no needs", None)
    assert not may_match("plain prose", ("://", "@"))
    assert may_match("mail me@x.org", ("://", "@"))
    assert may_match("٣", (DIGIT,)) and not may_match("three", (DIGIT,))
    assert not may_match("a literal \\d is no digit", (DIGIT,))
