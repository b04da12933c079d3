"""Breadcrumbs: entities of dropped text, the KEYS line, and merging the two (DESIGN §2, §5.4, §5.6)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextsvc.config import SummarizerSettings
from contextsvc.core import breadcrumbs
from contextsvc.core.breadcrumbs import (
    EntityKind,
    extract_breadcrumbs,
    extract_entities,
    format_keys_line,
    merge_breadcrumbs,
    split_keys_line,
)
from contextsvc.core.messages import Message, Role, ToolCall


@pytest.mark.parametrize(
    ("text", "kind", "expected"),
    [
        ("edit src/app/main.py now", EntityKind.PATH, "src/app/main.py"),
        ("see /etc/nginx/nginx.conf.", EntityKind.PATH, "/etc/nginx/nginx.conf"),
        ("in ~/projects/demo/", EntityKind.PATH, "~/projects/demo"),
        ("open ./build/out", EntityKind.PATH, "./build/out"),
        (r"saved to C:\Users\ann\report.docx today", EntityKind.PATH, r"C:\Users\ann\report.docx"),
        ("the file settings.toml", EntityKind.PATH, "settings.toml"),
        ("docs at https://example.com/a/b?x=1.", EntityKind.URL, "https://example.com/a/b?x=1"),
        ("mail bob.smith+ci@example.co.uk please", EntityKind.EMAIL, "bob.smith+ci@example.co.uk"),
        ("ticket ABC-123 is open", EntityKind.TICKET, "ABC-123"),
        ("see CVE-2024-3094", EntityKind.TICKET, "CVE-2024-3094"),
        ("id 123e4567-e89b-12d3-a456-426614174000 ok", EntityKind.UUID, "123e4567-e89b-12d3-a456-426614174000"),
        ("commit 3f2a9c1d landed", EntityKind.HASH, "3f2a9c1d"),
        ("call ContextService first", EntityKind.IDENTIFIER, "ContextService"),
        ("call getUserName()", EntityKind.IDENTIFIER, "getUserName"),
        ("set max_retries to 3", EntityKind.IDENTIFIER, "max_retries"),
        ("the v2_api_key value", EntityKind.IDENTIFIER, "v2_api_key"),
        ("export CONTEXTSVC_STORE", EntityKind.IDENTIFIER, "CONTEXTSVC_STORE"),
        ("read settings.summarizer.openai here", EntityKind.IDENTIFIER, "settings.summarizer.openai"),
        ("server 10.0.0.12:8080 is up", EntityKind.ADDRESS, "10.0.0.12:8080"),
        ("upgrade to v1.2.3 now", EntityKind.VERSION, "v1.2.3"),
        ("python 3.11.4 installed", EntityKind.VERSION, "3.11.4"),
        ("it costs $1,200.50 total", EntityKind.AMOUNT, "$1,200.50"),
        ("took 350 ms", EntityKind.QUANTITY, "350 ms"),
        ("used 12.5% of it", EntityKind.QUANTITY, "12.5%"),
        ("needs 4 GB", EntityKind.QUANTITY, "4 GB"),
        ("paid 500 EUR", EntityKind.QUANTITY, "500 EUR"),
        ('the project "Aurora Borealis" started', EntityKind.QUOTED, "Aurora Borealis"),
        ("the flag `--dry-run` helps", EntityKind.QUOTED, "--dry-run"),
        ("named 'blue team' here", EntityKind.QUOTED, "blue team"),
        ("named «Север» here", EntityKind.QUOTED, "Север"),
    ],
)
def test_each_kind_is_found(text: str, kind: EntityKind, expected: str) -> None:
    found = extract_entities([text])
    assert (kind, expected) in [(e.kind, e.text) for e in found], found


@pytest.mark.parametrize(
    "text",
    [
        "just some plain words and and/or a read/write thing",
        "it's fine, isn't it, the students' work",
        "UTF-8 and SHA-256 are standards",
        'json key "name": 1',
        "a/b 1/2 km/h",
        "the end.",
    ],
)
def test_plain_prose_yields_nothing(text: str) -> None:
    assert extract_breadcrumbs([text]) == []


def test_shell_lines_become_commands_split_on_semicolons() -> None:
    text = "Run this:\n$ pytest tests/unit -q; ruff check .\n  $ make build && make test\nnot $ here"
    found = [(e.kind, e.text) for e in extract_entities([text])]
    assert found[:3] == [
        (EntityKind.COMMAND, "pytest tests/unit -q"),
        (EntityKind.COMMAND, "ruff check ."),
        (EntityKind.COMMAND, "make build && make test"),
    ]
    # The path inside a command is part of the command, not reported twice.
    assert (EntityKind.PATH, "tests/unit") not in found


def test_tool_call_arguments_give_commands_and_paths() -> None:
    call_shell = ToolCall("c1", "shell", json.dumps({"command": "git log -3\ngit status", "timeout": 30}))
    call_edit = ToolCall("c2", "edit", json.dumps({"file_path": "src/x.py", "new_text": "see JIRA-7 for the reason"}))
    message = Message(Role.ASSISTANT, "", tool_calls=(call_shell, call_edit))
    found = [(e.kind, e.text) for e in extract_entities([message])]
    assert found == [
        (EntityKind.COMMAND, "git log -3"),
        (EntityKind.COMMAND, "git status"),
        (EntityKind.PATH, "src/x.py"),
        (EntityKind.TICKET, "JIRA-7"),
    ]


def test_unparseable_arguments_are_scanned_as_text() -> None:
    message = Message(Role.ASSISTANT, "", tool_calls=(ToolCall("c1", "x", "{broken /tmp/out.log"),))
    assert extract_breadcrumbs([message]) == ["/tmp/out.log"]


def test_breadcrumbs_of_an_earlier_summary_are_carried_over() -> None:
    old = Message(Role.USER, "Summary text", metadata={"breadcrumbs": ["Aurora", "PROJ-9"]})
    assert extract_breadcrumbs([old, "now see src/a.py"]) == ["Aurora", "PROJ-9", "src/a.py"]


def test_order_is_first_appearance_and_duplicates_are_dropped() -> None:
    texts = ["fix src/a.py then ABC-1", "again ABC-1 and SRC/A.PY and src/b.py", "abc-1"]
    assert extract_breadcrumbs(texts) == ["src/a.py", "ABC-1", "src/b.py"]


def test_same_input_same_output() -> None:
    texts = ["one src/a.py ABC-1 $5 and 3 GB", "ContextService v1.2.3 https://x.org/y"]
    assert extract_breadcrumbs(texts) == extract_breadcrumbs(list(texts))


def test_limit_keeps_most_valuable_kinds_in_appearance_order() -> None:
    text = "took 5 ms, then 6 ms, then 7 ms; see src/a.py; ABC-1; and 8 ms"
    assert extract_breadcrumbs([text], limit=2) == ["src/a.py", "ABC-1"]
    assert extract_breadcrumbs([text], limit=3) == ["5 ms", "src/a.py", "ABC-1"]
    assert extract_breadcrumbs([text], limit=0) == []


def test_long_entities_are_cut_to_max_chars() -> None:
    url = "https://example.com/" + "a" * 300
    [crumb] = extract_breadcrumbs([url], max_chars=40)
    assert len(crumb) == 40
    assert crumb.startswith("https://example.com/aaa") and crumb.endswith("…")


def test_a_huge_text_is_scanned_head_and_tail_only() -> None:
    text = "start src/head.py " + "x " * 200_000 + " MIDDLE-1 " + "y " * 200_000 + " end src/tail.py"
    assert extract_breadcrumbs([text], scan_chars=1000) == ["src/head.py", "src/tail.py"]


def test_defaults_come_from_the_settings() -> None:
    s = SummarizerSettings()
    assert (
        s.breadcrumb_limit,
        s.breadcrumb_max_chars,
        s.breadcrumb_scan_chars,
    ) == (breadcrumbs.DEFAULT_LIMIT, breadcrumbs.DEFAULT_MAX_CHARS, breadcrumbs.DEFAULT_SCAN_CHARS)
    many = " ".join(f"T{i}-{i}" for i in range(100))
    assert len(extract_breadcrumbs([many])) == s.breadcrumb_limit == 40


# --- the KEYS line --------------------------------------------------------------------------


def test_format_keys_line_round_trips() -> None:
    keys = ["a", "b; c", "1,000 USD", "multi\nline"]
    line = format_keys_line(keys)
    assert line == "KEYS: a; b, c; 1,000 USD; multi line"
    assert split_keys_line("body\n" + line) == ("body", ["a", "b, c", "1,000 USD", "multi line"])
    assert split_keys_line("body\n" + format_keys_line(["1,000 USD"])) == ("body", ["1,000 USD"])
    assert format_keys_line([]) == "KEYS:"


# --- merging --------------------------------------------------------------------------------


def test_merge_puts_summary_keys_first_and_dedupes() -> None:
    merged = merge_breadcrumbs(["Aurora", "src/a.py", "aurora"], ["SRC/A.PY", "ABC-1", "ABC-1"], 10)
    assert merged == ["Aurora", "src/a.py", "ABC-1"]


def test_merge_reserves_half_for_extracted() -> None:
    summary = [f"k{i}" for i in range(10)]
    extracted = [f"e{i}" for i in range(10)]
    assert merge_breadcrumbs(summary, extracted, 6) == ["k0", "k1", "k2", "e0", "e1", "e2"]
    # Unused room on one side goes to the other.
    assert merge_breadcrumbs(summary, ["e0"], 6) == ["k0", "k1", "k2", "k3", "k4", "e0"]
    assert merge_breadcrumbs(["k0"], extracted, 4) == ["k0", "e0", "e1", "e2"]
    assert merge_breadcrumbs(summary, extracted, 0) == []


def test_merge_cleans_keys() -> None:
    assert merge_breadcrumbs(["  a;b  ", "", "x" * 50], [], 5, max_chars=10) == ["a,b", "xxxxxxxxx…"]


# --- invariants -----------------------------------------------------------------------------

_pieces = st.sampled_from([*"abcXYZ019 _-./:;$@'\"`\n~%€", "src/", "http://", "ABC-", "\n$ ", " ms", ".py"])
_texty = st.lists(_pieces, max_size=120).map("".join)


@settings(max_examples=200, deadline=None)
@given(st.lists(_texty, max_size=5), st.integers(0, 20), st.integers(16, 60))
def test_output_is_bounded_unique_and_keys_safe(texts: list[str], limit: int, max_chars: int) -> None:
    crumbs = extract_breadcrumbs(texts, limit=limit, max_chars=max_chars)
    assert len(crumbs) <= limit
    assert len({c.casefold().rstrip("/") for c in crumbs}) == len(crumbs)
    for crumb in crumbs:
        assert crumb and crumb == crumb.strip()
        assert len(crumb) <= max_chars
        assert ";" not in crumb and "\n" not in crumb
    # Every list of breadcrumbs survives a trip through one KEYS line.
    assert split_keys_line("summary\n" + format_keys_line(crumbs))[1] == crumbs


# --- one extraction per text within a compaction (``shared_extraction``) ---------------------


@settings(max_examples=100, deadline=None)
@given(st.lists(_texty, max_size=6), st.integers(0, 20), st.integers(16, 60))
def test_shared_extraction_gives_what_each_call_gives_alone(texts: list[str], limit: int, max_chars: int) -> None:
    messages = [Message(role=Role.USER, content=t, sequence_number=i + 1) for i, t in enumerate(texts)]
    alone = [extract_entities(messages, limit=limit, max_chars=max_chars) for _ in range(2)]
    alone_texts = extract_breadcrumbs(texts, limit=limit, max_chars=max_chars)
    with breadcrumbs.shared_extraction():
        shared = [extract_entities(messages, limit=limit, max_chars=max_chars) for _ in range(2)]
        shared_texts = extract_breadcrumbs(texts, limit=limit, max_chars=max_chars)
        # Other bounds over the same texts are their own entries, not the first call's.
        wider = extract_entities(messages, limit=limit, max_chars=max_chars + 40)
    assert shared == alone
    assert shared_texts == alone_texts
    assert wider == extract_entities(messages, limit=limit, max_chars=max_chars + 40)


def test_shared_extraction_reads_each_text_once_and_forgets_at_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    scanned: list[str] = []
    real = breadcrumbs._from_text

    def counted(text: str, *, max_chars: int, scan_chars: int) -> object:
        scanned.append(text)
        return real(text, max_chars=max_chars, scan_chars=scan_chars)

    monkeypatch.setattr(breadcrumbs, "_from_text", counted)
    rows = [
        Message(role=Role.USER, content="edit src/app/main.py and see ABC-123", sequence_number=1),
        Message(role=Role.ASSISTANT, content="ran `make test` on 10.0.0.12:8080", sequence_number=2),
    ]
    with breadcrumbs.shared_extraction():
        first = extract_breadcrumbs(rows)
        with breadcrumbs.shared_extraction():  # a nested block shares the outer one's texts
            again = extract_breadcrumbs(rows[::-1])
        assert len(scanned) == 2
    assert first and set(again) == set(first)
    assert breadcrumbs._SHARED.get() is None  # nothing outlives the block
    extract_breadcrumbs(rows)
    assert len(scanned) == 4  # outside a block every call scans
