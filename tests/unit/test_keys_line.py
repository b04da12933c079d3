"""The one KEYS-line parser (issue #8, item 5) and breadcrumbs as words a person would keep
(item 4). ``core.compression.split_keys`` and ``core.breadcrumbs.split_keys_line`` are one
function; this table pins its rule (see its docstring)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextsvc.core.breadcrumbs import canonical_key, extract_breadcrumbs, format_keys_line, split_keys_line
from contextsvc.core.compression import split_keys
from contextsvc.core.compression.formatting import split_keys as split_keys_from_formatting


def test_there_is_one_parser() -> None:
    assert split_keys is split_keys_line is split_keys_from_formatting


KEYS_CASES = [
    # rule 1: the last line labelled KEYS, decorated or not
    pytest.param("- did x\nKEYS: a; b; c", "- did x", ["a", "b", "c"], id="plain"),
    pytest.param("- did x\nkeys:a;b", "- did x", ["a", "b"], id="lower-no-space"),
    pytest.param("- did x\n\n**KEYS:** `src/app.py`; make deploy", "- did x", ["src/app.py", "make deploy"], id="bold"),
    pytest.param("- did\n**KEYS: a; b**", "- did", ["a", "b"], id="bold-wrapped-line"),
    pytest.param("- did\n- KEYS: `a`; `b`", "- did", ["a", "b"], id="bullet-ticks"),
    pytest.param("- x\n## KEYS: a; b", "- x", ["a", "b"], id="heading"),
    pytest.param("- x\n  KEYS\uff1a甲; 乙", "- x", ["甲", "乙"], id="fullwidth-colon"),
    pytest.param("KEYS: old\n- x\nKEYS: new", "KEYS: old\n- x", ["new"], id="last-wins"),
    # rule 2: upper case counts anywhere; other spellings only at the end (the case the two
    # parsers used to disagree on: an upper-case KEYS line followed by more text)
    pytest.param("- x\nKEYS: a; b\nThat is all.", "- x\nThat is all.", ["a", "b"], id="upper-then-chatter"),
    pytest.param("KEYS: a\n- a later line", "- a later line", ["a"], id="upper-then-bullet"),
    pytest.param("- Keys: rotated\n- next step", "- Keys: rotated\n- next step", [], id="lower-mid-text"),
    pytest.param("- did x\n- Keys: a, b, c\n", "- did x", ["a", "b", "c"], id="lower-at-end"),
    pytest.param("- no keys\n- KEYS are discussed inline", "- no keys\n- KEYS are discussed inline", [], id="no-label"),
    # rule 3: separators, bullets under a bare label
    pytest.param("- did x\nKEYS: budget 12,000 EUR; x", "- did x", ["budget 12,000 EUR", "x"], id="commas-inside"),
    pytest.param("- did x\nKEYS: a, b, c\n\n", "- did x", ["a", "b", "c"], id="commas"),
    pytest.param("- did x\nKEYS:\n- a\n- b\n", "- did x", ["a", "b"], id="bullets-under"),
    pytest.param("- did\nKEYS:", "- did", [], id="empty"),
    # rule 4: canonical items
    pytest.param("- did x\nKEYS: a; ; a; b.\n", "- did x", ["a", "b"], id="empty-duplicates-full-stop"),
    pytest.param(
        "- x\nKEYS: _private_name; __init__; *args; **bold**; .env; ruff check .",
        "- x",
        ["_private_name", "__init__", "*args", "bold", ".env", "ruff check ."],
        id="names-stay-whole",
    ),
    pytest.param('- x\nKEYS: "Aurora"; \'beta\'; echo "hi"', "- x", ["Aurora", "beta", 'echo "hi"'], id="quotes"),
    # rule 5
    pytest.param("- did x\n- done", "- did x\n- done", [], id="missing"),
]


@pytest.mark.parametrize(("text", "summary_text", "keys"), KEYS_CASES)
def test_the_keys_rule(text: str, summary_text: str, keys: list[str]) -> None:
    assert split_keys_line(text) == (summary_text, keys)


@given(st.text(max_size=200))
def test_canonical_key_is_idempotent(item: str) -> None:
    once = canonical_key(item)
    assert canonical_key(once) == once


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30), max_size=8))
def test_canonical_keys_round_trip_through_one_line(raw: list[str]) -> None:
    keys = list(dict.fromkeys(k for r in raw if (k := canonical_key(r.replace(";", ",")))))
    keys = [k for k in keys if "\n" not in k and "\r" not in k]
    line = format_keys_line(keys)
    assert split_keys_line("summary\n" + line)[1] == [canonical_key(" ".join(k.split())) for k in keys if k.split()]


# --- item 4: breadcrumbs are whole names, never JSON fragments ----------------------------------

JSON_OUTPUTS = [
    '{"id": 79924, "name": "Aurora", "path": "src/app.py", "size": 512, "ok": true}',
    '[{"total_tokens": 79924, "model": "gpt-4o"}, {"total_tokens": 1200, "note": "deploy done"}]',
    '{"user": {"email": "ann@example.org", "plan": "Team"}, "invoice": {"amount": 12.5, "currency": "EUR"}}',
    'result: {"a": 1, "b": 2}, then "c", 42, "d"',
    'status {"count": 79924, "state": "ready"} and "Project Aurora" next',
]


@pytest.mark.parametrize("text", JSON_OUTPUTS)
def test_no_breadcrumb_is_a_json_fragment(text: str) -> None:
    for crumb in extract_breadcrumbs([text]):
        assert crumb[0] not in ':,{}[]"' and crumb[-1] not in ':,{}[]"', crumb
        assert '": ' not in crumb and '", "' not in crumb, crumb
        assert any(c.isalpha() for c in crumb), crumb  # a bare number has no meaning


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (JSON_OUTPUTS[0], ["id=79924", "Aurora", "src/app.py", "size=512"]),
        (JSON_OUTPUTS[1], ["total_tokens=79924", "gpt-4o", "total_tokens=1200", "deploy done"]),
        (JSON_OUTPUTS[2], ["ann@example.org", "Team", "amount=12.5", "EUR"]),
    ],
)
def test_json_output_gives_names_and_numbers_with_their_key(text: str, expected: list[str]) -> None:
    assert extract_breadcrumbs([text]) == expected


def test_quoted_names_in_prose_stay_whole() -> None:
    crumbs = extract_breadcrumbs([JSON_OUTPUTS[4]])
    assert "Project Aurora" in crumbs
    assert not any("79924" in c and "count" not in c for c in crumbs)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(_json_values)
def test_breadcrumbs_of_any_json_are_never_fragments(value: object) -> None:
    for compact in (True, False):
        text = json.dumps(value, separators=(",", ":") if compact else None)
        for crumb in extract_breadcrumbs([text, f"output: {text} done"]):
            assert not crumb.startswith((":", ",", "{", "}", "[", "]")), (text, crumb)
            assert '":' not in crumb and '","' not in crumb and '", "' not in crumb, (text, crumb)
