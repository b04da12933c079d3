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
