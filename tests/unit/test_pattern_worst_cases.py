"""What compaction and recall scan finishes in time linear in the text, on the inputs that made a
pattern search again from every character of a long run (issue #15: a client's message, or a
summarizer's reply, held the event loop for seconds to minutes). Each call below took 7 s to
over a minute before; a deadline turns a return of that into a failure instead of a hang."""

from __future__ import annotations

import json
import random
import re

from contextsvc.core import breadcrumbs, facts, recall
from contextsvc.core.messages import Message, Role, ToolCall
from tests.support.deadline import deadline


def user(text: str) -> Message:
    return Message(role=Role.USER, content=text)


def test_a_long_blank_line_in_a_summary_is_not_read_as_a_keys_line_slowly() -> None:
    summary = "Did things.\nKEYS: a; b\n" + " " * 3_200 + "x"  # read from the last line up
    with deadline():
        assert breadcrumbs.split_keys_line(summary)[1] == ["a", "b"]


def test_the_keys_line_pattern_matches_as_the_backtracking_one_did() -> None:
    old = re.compile(breadcrumbs._KEYS_LINE.pattern.replace(r"\s*+", r"\s*"), re.IGNORECASE)
    rng = random.Random(15)
    bits = [" ", "\t", "-", "*", "**", "__", "#", ">", "•", "keys", "KEYS", ":", "\uff1a", "a", "b;c", "\u3000"]
    for _ in range(20_000):
        line = "".join(rng.choice(bits) for _ in range(rng.randint(0, 12)))
        a, b = breadcrumbs._KEYS_LINE.match(line), old.match(line)
        assert (a and a.groupdict()) == (b and b.groupdict()), line


def test_a_tool_call_path_of_stars_is_canonicalized_at_once() -> None:
    stars = "x" + "*" * 80_000 + "x"
    call = ToolCall(id="c1", name="read", arguments_json=json.dumps({"path": stars}))
    with deadline():
        breadcrumbs.extract_entities([Message(role=Role.ASSISTANT, content="", tool_calls=(call,))])
        assert breadcrumbs.canonical_key("**" + "*" * 50_000 + "a" + "*" * 50_000) == breadcrumbs.canonical_key(
            "**" + "*" * 50_000 + "a" + "*" * 50_000
        )
    old = re.compile(r"^\*{2,}|\*{2,}$")
    for text in ["**a**", "a***", "***", "*a*", "**", "a**b**", "****a", "a*"]:
        assert breadcrumbs._BOLD_EDGES.sub("", text) == old.sub("", text), text


def test_rows_of_numbers_percentages_and_plus_paths_are_scanned_at_once() -> None:
    csv = "1," * 10_000
    with deadline():
        breadcrumbs.extract_entities([user(csv), user("% " + csv), user("a/+" * 6_667)])
    found = {e.text for e in breadcrumbs.extract_entities([user("p99 was 1,250 ms and 12% of 3,000 requests")])}
    assert {"1,250 ms", "12%"} <= found


def test_one_long_sentence_of_separators_is_scanned_for_facts_at_once() -> None:
    with deadline():
        facts.fact_lines([user("@:/ " + "a." * 25_000), user("a-" * 25_000), user(": " + "a." * 25_000)])
        facts.fact_lines([user("_" + "a_." * 20_000), user("a_-" * 20_000), user("x_" + "a-" * 25_000)])
    lines = facts.fact_lines([user("We deploy to api.example.com from src/app/main.py:42 as ops-team-7, mail a@b.io.")])
    assert lines and "api.example.com" in lines[0]


def test_recall_terms_of_one_long_token_are_found_at_once() -> None:
    with deadline():
        recall.terms("a.b/" * 25_000)
        recall.kind_terms("a-" * 20_000)


def test_what_the_rewritten_patterns_find_is_what_they_found() -> None:
    """Runs that start with separators, numbers next to numbers: the linear patterns keep these."""
    anchors = facts._anchors(
        "make: ../../src/parser.c:142:7: error, see |----src/main.py:9, mail ----john.doe@example.com"
    )
    assert {"src/parser.c:142", "src/main.py:9", "john.doe@example.com"} <= anchors
    assert "file_line" in facts.anchor_kinds("../../lib/util.c:42: warning")
    # A first label or word with an underscore: the whole name, not nothing (nor a part of it).
    named = facts._anchors("Set _dmarc.mail.example.com, restart my_app-worker-3 on db_primary.internal.net.")
    assert {"_dmarc.mail.example.com", "my_app-worker-3", "db_primary.internal.net"} <= named
    assert "host" in facts.anchor_kinds("see _sip._tcp.example.org")
    text = "Conversion rate by week: 0.25,12% and p50 latency 1.5,20 ms, size,1.5,200kb, 1,250 ms, x1,5ms"
    found = [e.text for e in breadcrumbs.extract_entities([user(text)])]
    assert {"12%", "20 ms", "200kb", "1,250 ms", "5ms"} <= set(found)
