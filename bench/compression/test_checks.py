"""The benchmark's own checks must be able to fail: run with ``pytest bench/compression -q``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checks import (
    Compaction,
    context_split_groups,
    dropped_rows,
    hysteresis,
    split_groups,
    view_problems,
)

from contextsvc.core.messages import Message, Role, ToolCall


def _user(seq: int, text: str = "ask") -> Message:
    return Message(role=Role.USER, content=text, sequence_number=seq)


def _call(seq: int, *ids: str) -> Message:
    return Message(role=Role.ASSISTANT, tool_calls=tuple(ToolCall(id=i, name="t") for i in ids), sequence_number=seq)


def _result(seq: int, call_id: str) -> Message:
    return Message(role=Role.TOOL, content="out", tool_call_id=call_id, sequence_number=seq)


def _answer(seq: int) -> Message:
    return Message(role=Role.ASSISTANT, content="done", sequence_number=seq)


SYSTEM = Message(role=Role.SYSTEM, content="prompt")


def test_a_legal_view_has_no_problems_and_a_pending_call_may_end_it() -> None:
    view = [SYSTEM, _user(1), _call(2, "a", "b"), _result(3, "a"), _result(4, "b"), _answer(5), _user(6), _call(7, "c")]
    assert view_problems(view) == []


def test_orphans_missing_results_and_bad_starts_are_reported() -> None:
    assert view_problems([SYSTEM, _answer(1), _user(2)]) == ["conversation starts with assistant #1"]
    assert view_problems([_user(1), _result(2, "x")]) == ["orphan tool result #2 (call x)"]
    missing = view_problems([_user(1), _call(2, "a", "b"), _result(3, "a"), _answer(4)])
    assert missing == ["#2: calls ['b'] without results"]
    # Unanswered calls are pending only on the very last message.
    assert view_problems([_user(1), _call(2, "a"), _result(3, "a"), _call(4, "b"), _user(5)]) == [
        "#4: calls ['b'] without results"
    ]
    assert view_problems([_user(1), SYSTEM]) == ["system row #0 inside the conversation"]
    assert view_problems([_user(1), _result(2, "a")]) != []


def test_a_group_the_repair_shrank_is_a_split_group() -> None:
    stored = {2: _call(2, "a", "b")}
    repaired = [_user(1), _call(2, "a"), _result(3, "a")]
    assert view_problems(repaired) == []  # legal, yet the group lost a call
    assert split_groups(repaired, stored) == ["#2 lost calls ['b'] in the view"]
    assert split_groups([_user(1), _call(2, "a", "b"), _result(3, "a"), _result(4, "b")], stored) == []


def test_context_split_and_dropped_rows() -> None:
    context = [_user(1), _call(2, "a", "b"), _result(3, "a"), _result(9, "z")]
    assert context_split_groups(context) == [
        "call b (#2) has no result in the context",
        "result #9 answers call z, not in the context",
    ]
    assert dropped_rows([_user(1), _call(2, "a")], [_user(1), _call(2, "a"), _result(3, "a")]) == [3]


def test_hysteresis_counts_small_growth_except_forced_and_separates_truncation() -> None:
    runs = [
        Compaction("preturn", "summary", before=7400, after=5000, turn=1),
        Compaction("midturn", "summary", before=7100, after=5200, turn=2),  # grew 2100: fine
        Compaction("postturn", "summary", before=6000, after=4000, turn=3),  # grew 800: violation
        Compaction("forced", "summary", before=4100, after=3000, turn=4),  # forced: exempt
        Compaction("postturn", "summary", before=3500, after=3000, after_truncation=True, turn=5),
    ]
    check = hysteresis(runs, band=2048)
    assert check.pairs == 3
    assert len(check.violations) == 1 and check.violations[0].startswith("turn 3: compaction 3")
    assert len(check.after_truncation) == 1 and check.after_truncation[0].startswith("turn 5:")
    assert check.min_growth == 500


def test_a_budget_crossing_inside_the_band_is_exempt_only_in_the_two_cases_of_the_design() -> None:
    # budget 6144, band 2048. A compaction aimed at 3000 with a 10% margin rate, ended under it.
    first = Compaction("midturn", "summary", before=6100, after=2900, turn=1, margin=100, aim=3000, rate=0.10)
    # A crossing of the budget inside the band with a margin wider than the rate aimed for: exempt.
    wide = Compaction("midturn", "summary", before=4500, after=2800, turn=2, margin=1700, aim=3000, rate=0.10)
    check = hysteresis([first, wide], band=2048, budget=6144)
    assert not check.violations and len(check.budget_exempt) == 1
    assert "larger share" in check.budget_exempt[0]
    # Under the budget (estimate + margin < 6144) inside the band: a violation whatever the margin.
    under = Compaction("midturn", "summary", before=4000, after=2800, turn=2, margin=1000, aim=3000, rate=0.10)
    assert len(hysteresis([first, under], band=2048, budget=6144).violations) == 1
    # The compaction before ended above its aim: exempt, with that reason.
    above = Compaction("midturn", "clear_tool_results", before=6100, after=3500, turn=1, margin=90, aim=3000, rate=0.1)
    check = hysteresis([above, wide], band=2048, budget=6144)
    assert not check.violations and "above its aim" in check.budget_exempt[0]
    # An aim that was not a band below the crossing (6144 / 1.1 - 2048 = 3537, not 4500), reached,
    # and a margin within the rate: the crossing at 5600 + 550 comes 1,200 tokens after, a violation.
    high = Compaction("midturn", "summary", before=6100, after=4400, turn=1, margin=100, aim=4500, rate=0.10)
    cur = Compaction("midturn", "summary", before=5600, after=3000, turn=2, margin=550, aim=3500, rate=0.10)
    check = hysteresis([high, cur], band=2048, budget=6144)
    assert len(check.violations) == 1 and not check.budget_exempt
    # Without a budget (a threshold-triggered window) nothing is exempt.
    assert len(hysteresis([first, wide], band=2048).violations) == 1
