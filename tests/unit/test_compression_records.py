"""The rows a compaction appends (contextsvc.core.compression.records)."""

from __future__ import annotations

import dataclasses

import pytest

from contextsvc.core.codec import message_from_dict, message_to_dict
from contextsvc.core.compression import (
    BREADCRUMBS_KEY,
    DEMOTED_RANGES_KEY,
    compression_record,
    covered_range,
    demoted_ranges,
    placeholder_for,
    plan_compaction,
    summary_anchor,
    summary_message,
)
from contextsvc.core.messages import Flags, Message, Role, context_order
from contextsvc.engine import sessions
from tests.support.compression_checks import count_chars
from tests.support.message_strategies import assistant, numbered, record, summary, tool, user


def test_the_demoted_ranges_key_is_the_one_fork_reads() -> None:
    assert DEMOTED_RANGES_KEY == sessions.DEMOTED_RANGES_KEY == "demoted_ranges"


@pytest.mark.parametrize(
    ("seqs", "runs"),
    [
        ([], []),
        ([5], [[5, 5]]),
        ([1, 2, 3, 7, 8, 10], [[1, 3], [7, 8], [10, 10]]),
        ([10, 3, 2, 1, 2, 0], [[1, 3], [10, 10]]),
    ],
)
def test_demoted_ranges_are_runs_of_sequence_numbers(seqs: list[int], runs: list[list[int]]) -> None:
    assert demoted_ranges(seqs) == runs


# --- the summary row -------------------------------------------------------------------------


def test_the_summary_is_a_context_only_user_row_with_its_range_and_breadcrumbs() -> None:
    rows = numbered([user("a"), assistant("b"), user("c"), assistant("d")])
    s = summary_message("what happened", dropped=rows[:2], kept=rows[2:], breadcrumbs=["src/a.py", "deploy"])
    assert (s.role, s.content, s.replaces, s.context_anchor) == (Role.USER, "what happened", (1, 2), 1)
    assert s.flags == Flags(is_context=True, is_display=False, is_summary=True)
    assert s.metadata[BREADCRUMBS_KEY] == ["src/a.py", "deploy"]
    assert s.metadata["summarized_messages"] == 2


ANCHOR_CASES = [
    pytest.param([2, 3], [1, 4], -1, id="kept-seq-1-first: below 1 is -1"),
    pytest.param([1, 2], [3, 4], 1, id="where-the-first-dropped-was"),
    pytest.param([6, 7], [5, 8], 4, id="one-below-the-first-kept"),
    pytest.param([], [3], 2, id="nothing-dropped"),
]


@pytest.mark.parametrize(("dropped", "kept", "anchor"), ANCHOR_CASES)
def test_the_summary_anchor_sorts_before_every_kept_row(dropped: list[int], kept: list[int], anchor: int) -> None:
    rows = {k: dataclasses.replace(user(f"m{k}"), sequence_number=k) for k in range(1, 9)}
    d, k = [rows[s] for s in dropped], [rows[s] for s in kept]
    assert summary_anchor(d, k) == anchor
    s = dataclasses.replace(summary_message("S", dropped=d, kept=k), sequence_number=100)
    assert context_order([*k, s]) == [s, *k]


def test_the_anchor_follows_older_anchors() -> None:
    old = dataclasses.replace(summary("old"), sequence_number=50, context_anchor=-1, replaces=(1, 30))
    kept = numbered([user("x"), assistant("y")], first=31)
    assert summary_anchor([old], kept) == -1
    pinned_first = dataclasses.replace(user("rule", pinned=True), sequence_number=1)
    assert summary_anchor([old], [pinned_first]) == -1


def test_a_negative_anchor_survives_the_codec() -> None:
    s = summary_message("S", dropped=[], kept=[dataclasses.replace(user(), sequence_number=1)])
    assert s.context_anchor == -1
    assert message_from_dict(message_to_dict(s)) == s


def test_the_covered_range_counts_older_summaries_and_placeholders_by_what_they_stand_for() -> None:
    old = dataclasses.replace(summary("old"), sequence_number=60, replaces=(1, 20))
    original = dataclasses.replace(tool("c1", "x" * 500), sequence_number=25)
    cleared = dataclasses.replace(placeholder_for(original), sequence_number=70)
    plain = dataclasses.replace(user("q"), sequence_number=30)
    assert covered_range([old, cleared, plain]) == (1, 30)
    assert covered_range([cleared]) == (25, 25)
    assert covered_range([]) is None


# --- the compression record ------------------------------------------------------------------


def test_the_compression_record_is_display_only_and_lists_what_was_demoted() -> None:
    demoted = [dataclasses.replace(user(), sequence_number=s) for s in (1, 2, 3, 5, 9)]
    r = compression_record(
        method="summary",
        reason="preturn",
        demoted=demoted,
        summary="what happened",
        breadcrumbs=["a"],
        tokens_before=900,
        tokens_after=400,
        messages_before=20,
        messages_after=8,
    )
    assert (r.role, r.content) == (Role.SYSTEM, "what happened")
    assert r.flags == Flags(is_context=False, is_display=True, is_compression=True)
    assert r.metadata == {
        "source": "compression",
        "method": "summary",
        "reason": "preturn",
        DEMOTED_RANGES_KEY: [[1, 3], [5, 5], [9, 9]],
        BREADCRUMBS_KEY: ["a"],
        "tokens_before": 900,
        "tokens_after": 400,
        "messages_before": 20,
        "messages_after": 8,
        "replaces": [1, 9],
    }


@pytest.mark.parametrize(
    ("method", "text"),
    [("hard_truncate", "2 message(s) (#4-#5) removed"), ("clear_tool_results", "2 old tool result(s) (#4-#5) cleared")],
)
def test_a_record_without_a_summary_says_what_was_removed(method: str, text: str) -> None:
    demoted = [dataclasses.replace(user(), sequence_number=s) for s in (4, 5)]
    r = compression_record(method=method, reason="forced", demoted=demoted)
    assert text in r.content and "display history" in r.content


def test_a_whole_compaction_reloads_in_the_planned_order() -> None:
    """Plan, build the rows, apply them like a store: summary first, kept rows in order, nothing else."""
    rows = numbered(
        [
            user("standing rule", pinned=True),
            record("task_note", "ship on friday"),
            *[m for k in range(5) for m in (user(f"ask {k}"), assistant("", f"c{k}"), tool(f"c{k}", "r" * 200))],
        ]
    )
    plan = plan_compaction(rows, window=2000, target=0.5, keep_recent=2, count=count_chars)
    assert plan.would_compress
    s = summary_message("S", dropped=plan.drop, kept=plan.keep)
    rec = compression_record(method="summary", reason="forced", demoted=plan.drop, summary="S")
    stored: list[Message] = [m.with_flags(is_context=False) if m in plan.drop else m for m in rows]
    stored += [
        dataclasses.replace(s, sequence_number=len(rows) + 1),
        dataclasses.replace(rec, sequence_number=len(rows) + 2),
    ]
    after = context_order(stored)
    assert [m.sequence_number for m in after] == [len(rows) + 1, *plan.keep_sequences]
    assert after[1].flags.is_pinned and after[2].role is Role.SYSTEM
    restored = {s for first, last in rec.metadata[DEMOTED_RANGES_KEY] for s in range(first, last + 1)}
    assert restored == set(plan.drop_sequences)


@pytest.mark.parametrize("bits", range(2 ** len(dataclasses.fields(Flags))))
def test_every_flag_combination_is_written_and_read_back(bits: int) -> None:
    """``message_to_dict`` keeps the flags that differ from the defaults (worked out once per
    combination), and a shared answer is never handed out: changing one dict leaves the next alone."""
    names = [f.name for f in dataclasses.fields(Flags)]
    flags = Flags(**{n: bool(bits >> i & 1) for i, n in enumerate(names)})
    m = Message(Role.USER, "x", sequence_number=1, flags=flags)
    d = message_to_dict(m)
    expected = {n: getattr(flags, n) for n in names if getattr(flags, n) != getattr(Flags(), n)}
    assert d.get("flags", {}) == expected
    assert message_from_dict(d) == m
    if "flags" in d:
        d["flags"].clear()
        assert message_to_dict(m)["flags"] == expected
