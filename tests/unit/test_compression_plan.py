"""Compaction planning (contextsvc.core.compression.plan)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contextsvc.config import SummarizerSettings
from contextsvc.core.compression import (
    CompactionPlan,
    PlanMode,
    mid_turn_keep_messages,
    plan_compaction,
    plan_hard_truncate,
    summary_message,
)
from contextsvc.core.legal import is_legal
from contextsvc.core.messages import Flags, Message, Role, context_order
from contextsvc.core.turns import analyze
from tests.support.compression_checks import PER_MESSAGE, conversation, count_chars, defects, split_groups
from tests.support.legal_oracle import legality_violations
from tests.support.message_strategies import (
    assistant,
    message_sequences,
    numbered,
    record,
    summary,
    tool,
    user,
    well_formed_conversations,
)


def seqs(rows: tuple[Message, ...] | list[Message]) -> list[int]:
    return [m.sequence_number for m in rows]


def text_turns(n: int, chars: int = 40) -> list[Message]:
    """n turns of user + plain answer, every message ``chars`` long (so ``chars + 4`` tokens)."""
    rows: list[Message] = []
    for k in range(1, n + 1):
        rows += [user(f"ask {k}".ljust(chars, ".")), assistant(f"answer {k}".ljust(chars, "."))]
    return rows


def tool_rounds(rounds: int, result_chars: int = 10, first: int = 1) -> list[Message]:
    rows: list[Message] = []
    for k in range(first, first + rounds):
        rows += [assistant("", f"c{k}"), tool(f"c{k}", "r" * result_chars)]
    return rows


def plan(context: list[Message], **kw: object) -> CompactionPlan:
    args: dict[str, object] = {"window": 100_000, "target": 0.5, "keep_recent": 4, "count": count_chars}
    args.update(kw)
    return plan_compaction(context, **args)  # type: ignore[arg-type]


# --- turn mode ------------------------------------------------------------------------------


def test_keeps_the_newest_keep_recent_turns_and_drops_the_rest() -> None:
    ctx = numbered(text_turns(6))
    p = plan(ctx)
    assert (p.mode, p.would_compress, p.detail) == (PlanMode.TURNS, True, "")
    assert seqs(p.drop) == [1, 2, 3, 4]
    assert seqs(p.keep) == list(range(5, 13))
    assert (p.turns_kept, p.keep_recent, p.keep_from) == (4, 4, 4)
    assert p.tokens_kept == 8 * 44 and p.tokens_before == 12 * 44 and p.budget == 50_000
    assert p.replaced_range == (1, 4)


def test_keep_recent_shrinks_until_the_kept_part_fits_the_target() -> None:
    ctx = numbered(text_turns(6))  # a turn is 88 tokens
    p = plan(ctx, window=400, target=0.5)  # budget 200: two turns (176) fit, three (264) do not
    assert (p.budget, p.keep_recent, p.turns_kept, p.tokens_kept) == (200, 2, 2, 176)
    assert seqs(p.keep) == [9, 10, 11, 12] and p.fits_target
    exact = plan(ctx, window=352, target=0.5)  # budget 176: exactly two turns still fit
    assert exact.keep_recent == 2 and exact.tokens_kept == exact.budget


def test_pinned_messages_are_kept_in_order_and_count_toward_the_kept_part() -> None:
    rows = text_turns(6)
    rows[2] = user("answer in French".ljust(40, "."), pinned=True)  # turn 2's request
    ctx = numbered(rows)
    p = plan(ctx, keep_recent=2)
    assert seqs(p.keep) == [3, 9, 10, 11, 12]
    assert seqs(p.drop) == [1, 2, 4, 5, 6, 7, 8]
    assert p.tokens_kept == 5 * 44


def test_a_pinned_tool_result_keeps_its_whole_group() -> None:
    rows = [user("start"), assistant("", "c1", "c2"), tool("c1", "a" * 50), tool("c2", "b" * 50), assistant("done")]
    rows[2] = dataclasses.replace(rows[2], flags=Flags(is_pinned=True))
    ctx = numbered(rows + text_turns(3))
    p = plan(ctx, keep_recent=1)
    assert seqs(p.keep) == [2, 3, 4, 10, 11]
    assert seqs(p.drop) == [1, 5, 6, 7, 8, 9]
    assert not split_groups(ctx, p.keep)
    assert is_legal([summary(), *p.keep])


def test_records_are_kept_like_pinned_rows() -> None:
    ctx = numbered([record("task_note", "deploy on friday"), *text_turns(3)])
    p = plan(ctx, keep_recent=1)
    assert seqs(p.keep) == [1, 6, 7]


def test_the_pending_call_of_the_newest_turn_is_kept_last() -> None:
    ctx = numbered([*text_turns(3), user("run it"), assistant("", "p1")])
    p = plan(ctx, keep_recent=1)
    assert seqs(p.keep) == [7, 8] and p.keep[-1].tool_calls
    assert is_legal([summary(), *p.keep])


# --- swaps ----------------------------------------------------------------------------------

_FILLER_CHARS = 300  # longer than filler_turn_chars, so these turns are never filler


def _swap_context(first_turn: list[Message]) -> list[Message]:
    long = "x" * _FILLER_CHARS
    return numbered(
        [
            *first_turn,  # turn 1: old; important or not depending on the case
            user(long),
            assistant(long),  # turn 2: old, ordinary
            user("thanks"),
            assistant("you're welcome"),  # turn 3: recent filler
            user(long),
            assistant(long),  # turn 4
            user("ok"),
            assistant("sure"),  # turn 5: recent filler
            user("ok"),
            assistant("sure"),  # turn 6: the newest, filler too, never swapped
        ]
    )


IMPORTANT_TURNS = [
    pytest.param(
        [user("migrate the db"), assistant("", "m1"), tool("m1", "Error: relation users does not exist")],
        (),
        id="error",
    ),
    pytest.param(
        [user("no, use tabs for indentation from now on"), assistant("noted")],
        (),
        id="correction",
    ),
    pytest.param(
        [
            user("read the spec"),
            assistant("", "m1"),
            dataclasses.replace(tool("m1", "spec text"), flags=Flags(is_compression_critical=True)),
        ],
        (),
        id="critical-flag",
    ),
    pytest.param(
        [user("read the spec"), assistant("", "m1"), tool("m1", "spec text")], ("tool_m1",), id="critical-name"
    ),
]


@pytest.mark.parametrize(("first_turn", "critical"), IMPORTANT_TURNS)
def test_an_important_old_turn_swaps_with_the_oldest_recent_filler(
    first_turn: list[Message], critical: tuple[str, ...]
) -> None:
    ctx = _swap_context(first_turn)
    n = len(first_turn)
    p = plan(ctx, keep_recent=4, critical_tool_names=critical)
    turn3, turn5 = n + 3, n + 7
    assert p.swapped_in == (1,) and p.swapped_out == (turn3,)
    assert seqs(p.keep) == [*range(1, n + 1), *range(turn3 + 2, len(ctx) + 1)]
    assert seqs(p.drop) == [n + 1, n + 2, turn3, turn3 + 1]
    assert turn5 in seqs(p.keep) and p.turns_kept == 4
    assert p.fits_target and is_legal([summary(), *p.keep])


def test_no_swap_without_an_important_turn() -> None:
    ctx = _swap_context([user("hello there"), assistant("hi")])
    p = plan(ctx, keep_recent=4)
    assert p.swapped_in == () and seqs(p.drop) == [1, 2, 3, 4]


def test_no_swap_when_the_important_turn_does_not_fit() -> None:
    ctx = _swap_context([user("migrate"), assistant("", "m1"), tool("m1", "Error: " + "e" * 5000)])
    tokens = count_chars(ctx[5:])  # the four newest turns
    p = plan(ctx, keep_recent=4, window=tokens * 2, target=0.5)
    assert p.swapped_in == () and seqs(p.keep) == seqs(ctx[5:])


def test_the_newest_turn_is_never_swapped_away() -> None:
    long = "x" * _FILLER_CHARS
    failed = [user("migrate"), assistant("", "m1"), tool("m1", "Traceback (most recent call last): boom")]
    ctx = numbered([*failed, user(long), assistant(long), user("ok"), assistant("sure")])
    p = plan(ctx, keep_recent=2)
    assert p.swapped_in == () and seqs(p.keep) == [4, 5, 6, 7]


# --- intra-turn -----------------------------------------------------------------------------


def test_mid_turn_keeps_the_request_and_the_newest_messages_of_one_long_turn() -> None:
    ctx = numbered([user("go"), *tool_rounds(20)])  # a_k = 2k, t_k = 2k + 1
    p = plan(ctx, keep_recent_messages=12)
    assert p.mode is PlanMode.INTRA_TURN and p.would_compress
    assert seqs(p.keep) == [1, *range(30, 42)]
    assert seqs(p.drop) == list(range(2, 30))
    assert (p.keep_recent_messages, p.keep_from, p.turns_kept) == (12, 29, 0)
    assert is_legal([summary(), *p.keep])


def test_the_intra_turn_cut_moves_back_rather_than_split_a_group() -> None:
    rows: list[Message] = [user("go")]
    for k in range(6):
        rows += [assistant("", f"a{k}", f"b{k}"), tool(f"b{k}"), tool(f"a{k}")]
    ctx = numbered(rows)  # 19 rows; the last two groups are 14-16 and 17-19
    p = plan(ctx, keep_recent_messages=4)
    assert seqs(p.keep) == [1, *range(14, 20)]
    assert not split_groups(ctx, p.keep)


def test_mid_turn_retries_with_two_messages_when_n_covers_the_whole_turn() -> None:
    ctx = numbered([user("go"), *tool_rounds(3)])
    p = plan(ctx, keep_recent_messages=12)
    assert p.keep_recent_messages == SummarizerSettings().midturn_retry_messages == 2
    assert seqs(p.keep) == [1, 6, 7] and seqs(p.drop) == [2, 3, 4, 5]


def test_the_intra_turn_tail_shrinks_until_it_fits() -> None:
    ctx = numbered([user("go"), *tool_rounds(10, result_chars=500)])
    budget = count_chars([ctx[0], *ctx[-4:]]) + 10  # room for the request and two rounds only
    p = plan(ctx, window=budget * 2, target=0.5, keep_recent_messages=12)
    assert p.budget == budget
    assert seqs(p.keep) == [1, 18, 19, 20, 21] and p.fits_target


def test_the_intra_turn_tail_keeps_at_least_the_newest_group_even_over_budget() -> None:
    ctx = numbered([user("go"), *tool_rounds(3, result_chars=5000)])
    p = plan(ctx, window=1000, target=0.5, keep_recent_messages=12)
    assert seqs(p.keep) == [1, 6, 7]
    assert p.would_compress and not p.fits_target and "over the budget" in p.detail


def test_pre_turn_falls_back_to_the_intra_turn_partition_when_one_turn_is_too_big() -> None:
    ctx = numbered([*text_turns(2), user("go"), *tool_rounds(20, result_chars=100)])
    tail = count_chars(ctx[-12:]) + count_chars([ctx[4]])
    p = plan(ctx, window=(tail + 100) * 2, target=0.5, keep_recent=4)
    assert p.mode is PlanMode.INTRA_TURN
    assert p.keep_recent_messages == mid_turn_keep_messages(4) == 12
    assert seqs(p.keep) == [5, *seqs(ctx[-12:])]
    assert seqs(p.drop) == [*range(1, 5), *range(6, ctx[-12].sequence_number)]


def test_mid_turn_prefers_whole_turns_when_they_fit() -> None:
    ctx = numbered(text_turns(6))
    p = plan(ctx, keep_recent_messages=12)
    assert p.mode is PlanMode.TURNS and seqs(p.keep) == list(range(5, 13))


@pytest.mark.parametrize(("keep_recent", "expected"), [(1, 12), (4, 12), (6, 12), (7, 14), (8, 16), (30, 60)])
def test_mid_turn_keep_messages_is_max_of_12_and_twice_keep_recent(keep_recent: int, expected: int) -> None:
    assert mid_turn_keep_messages(keep_recent) == expected


# --- nothing to do --------------------------------------------------------------------------

NOTHING_CASES = [
    pytest.param([], {}, "the context is empty", id="empty"),
    pytest.param([summary(), user("rule", pinned=True)], {}, "no user turn", id="no-turn"),
    pytest.param(text_turns(2), {}, "keep_recent=4", id="fewer-turns-than-keep-recent"),
    pytest.param([summary(), *text_turns(2)], {}, "only the existing summary", id="lone-summary"),
    pytest.param(
        [user("go"), assistant("", "c1"), tool("c1")],
        {"keep_recent_messages": 12},
        "cannot be cut",
        id="one-group-turn",
    ),
]


@pytest.mark.parametrize(("rows", "kw", "detail"), NOTHING_CASES)
def test_nothing_to_compress_says_why(rows: list[Message], kw: dict[str, object], detail: str) -> None:
    p = plan(numbered(rows), **kw)
    assert not p.would_compress
    assert detail in p.detail


def test_would_compress_is_false_when_dropping_does_not_shrink_the_callers_count() -> None:
    ctx = numbered(text_turns(6))
    kept = count_chars(ctx[4:])
    assert plan(ctx, current_tokens=kept + 1).would_compress
    p = plan(ctx, current_tokens=kept)
    assert not p.would_compress and "would not shrink" in p.detail and p.tokens_before == kept


@pytest.mark.parametrize(
    "kw",
    [
        {"window": 0},
        {"target": 0.0},
        {"target": 1.5},
        {"keep_recent": 0},
        {"keep_recent_messages": 0},
    ],
)
def test_bad_arguments_are_refused(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        plan(numbered(text_turns(2)), **kw)


# --- hard truncation ------------------------------------------------------------------------


def hard(context: list[Message], window: int, fraction: float = 0.5) -> CompactionPlan:
    return plan_hard_truncate(context, window=window, fraction=fraction, count=count_chars)


def test_hard_truncate_drops_the_oldest_turns_until_under_the_fraction() -> None:
    ctx = numbered([summary("s" * 36), *text_turns(6)])  # summary 40 tokens, each turn 88
    p = hard(ctx, window=2 * (40 + 2 * 88))
    assert p.mode is PlanMode.HARD_TRUNCATE and p.would_compress and p.fits_target
    assert seqs(p.keep) == [1, 10, 11, 12, 13]  # the summary survives: it goes last
    assert seqs(p.drop) == list(range(2, 10))


def test_hard_truncate_drops_an_old_summary_only_when_the_turns_are_not_enough() -> None:
    ctx = numbered([summary("s" * 36), *text_turns(3)])
    p = hard(ctx, window=2 * 88)
    assert seqs(p.keep) == [6, 7] and seqs(p.drop) == [1, 2, 3, 4, 5]


def test_hard_truncate_keeps_a_pinned_answer_with_its_request_so_the_result_stays_legal() -> None:
    rows = text_turns(4)
    rows[1] = dataclasses.replace(rows[1], flags=Flags(is_pinned=True))
    ctx = numbered(rows)
    p = hard(ctx, window=2 * 2 * 88)  # room for the pinned answer's turn and the newest turn
    assert seqs(p.keep) == [1, 2, 7, 8]
    assert is_legal(p.keep)


def test_hard_truncate_keeps_the_newest_turn_even_over_budget() -> None:
    ctx = numbered([*text_turns(2), user("go"), *tool_rounds(3, result_chars=5000)])
    p = hard(ctx, window=1000)
    assert seqs(p.keep) == list(range(5, 12)) and p.would_compress and not p.fits_target


def test_hard_truncate_with_room_to_spare_drops_nothing() -> None:
    p = hard(numbered(text_turns(3)), window=100_000)
    assert not p.would_compress and p.drop == () and "nothing to drop" in p.detail


def test_hard_truncate_fraction_comes_from_settings() -> None:
    fraction = SummarizerSettings().hard_truncate_fraction
    assert fraction == 0.5
    assert hard(numbered(text_turns(3)), window=1001, fraction=fraction).budget == 500


# --- invariants -----------------------------------------------------------------------------


def _partition_holds(context: list[Message], p: CompactionPlan) -> None:
    ids = [id(m) for m in context]
    assert sorted(ids) == sorted(id(m) for m in (*p.drop, *p.keep)), "dropped + kept must be the input, once each"
    order = {id(m): k for k, m in enumerate(context)}
    assert [order[id(m)] for m in p.keep] == sorted(order[id(m)] for m in p.keep)
    assert [order[id(m)] for m in p.drop] == sorted(order[id(m)] for m in p.drop)
    kept = {id(m) for m in p.keep}
    assert all(id(m) in kept for m in context if m.flags.is_pinned or m.role is Role.SYSTEM)
    assert not split_groups(context, p.keep)
    conv = conversation(context)
    if conv:
        assert id(conv[-1]) in kept, "the newest message is always kept"
    if p.would_compress:
        assert p.drop and p.tokens_kept < p.tokens_before
    assert p.tokens_kept == count_chars(p.keep)


@st.composite
def plan_args(draw: st.DrawFn) -> dict[str, object]:
    return {
        "window": draw(st.integers(20, 3000)),
        "target": draw(st.floats(0.05, 0.95)),
        "keep_recent": draw(st.integers(1, 6)),
        "keep_recent_messages": draw(st.none() | st.integers(1, 16)),
        "current_tokens": draw(st.none() | st.integers(0, 5000)),
        "critical_tool_names": draw(st.sampled_from([(), ("tool_c1",), ("tool_t0r0c0", "tool_t1r0c1")])),
        "count": count_chars,
    }


def _check_plan(context: list[Message], args: dict[str, object]) -> CompactionPlan:
    p = plan_compaction(context, **args)  # type: ignore[arg-type]
    again = plan_compaction(context, **args)  # type: ignore[arg-type]
    assert p == again, "the dry run and the real run must plan the same"
    _partition_holds(context, p)
    if p.would_compress and p.mode is PlanMode.TURNS:
        assert p.tokens_kept <= p.budget
    turns = [t for t in analyze(context).turns if not context[t.start].flags.is_summary]
    if turns and p.drop:
        assert any(m is context[turns[-1].start] for m in p.keep), "the current request is always kept"
    # The summary sorts before every kept row, and the kept part is no less legal than the input.
    new = dataclasses.replace(summary_message("S", dropped=p.drop, kept=p.keep), sequence_number=len(context) + 1)
    assert context_order([*p.keep, new]) == [new, *p.keep]
    if p.drop:
        assert defects([new, *p.keep]) <= defects(context)
    return p


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(message_sequences(max_turns=6), plan_args())
def test_plan_invariants_on_any_context(context: list[Message], args: dict[str, object]) -> None:
    _check_plan(context, args)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(well_formed_conversations(max_turns=6), plan_args())
def test_plan_of_a_legal_context_is_legal_after_the_summary(context: list[Message], args: dict[str, object]) -> None:
    p = _check_plan(context, args)
    if p.drop:
        after = [summary(seq=len(context) + 1), *p.keep]
        assert is_legal(after) and legality_violations(after) == []


@settings(max_examples=200, deadline=None)
@given(message_sequences(max_turns=6), st.integers(20, 3000), st.floats(0.1, 0.9))
def test_hard_truncate_invariants(context: list[Message], window: int, fraction: float) -> None:
    p = plan_hard_truncate(context, window=window, fraction=fraction, count=count_chars)
    assert p == plan_hard_truncate(context, window=window, fraction=fraction, count=count_chars)
    _partition_holds(context, p)
    assert defects(p.keep) <= defects(context)
    if not p.fits_target:
        _nothing_more_could_go(context, p)


def _nothing_more_could_go(context: list[Message], p: CompactionPlan) -> None:
    """Every kept row before the newest conversational turn is one hard truncation must keep."""
    if p.mode is PlanMode.NONE:  # no conversational turn: hard truncation keeps everything
        return
    shape = analyze(context)
    pinned = [i for i, m in enumerate(context) if m.flags.is_pinned]
    must: set[int] = set(pinned)
    for i in pinned:
        group, turn = shape.group_of(i), shape.turn_of(i)
        if group is not None:
            must.update((group.assistant_index, *group.result_indices))
        if turn is not None:
            must.add(turn.start)
    turns = [t for t in shape.turns if not context[t.start].flags.is_summary and not all(r in must for r in t.rows)]
    kept = {id(m) for m in p.keep}
    for i, m in enumerate(context[: turns[-1].start]):
        if id(m) in kept and m.role is not Role.SYSTEM:
            assert i in must, f"row {m.sequence_number} could have been dropped"


@settings(max_examples=150, deadline=None)
@given(well_formed_conversations(max_turns=6), st.integers(20, 3000))
def test_hard_truncate_of_a_legal_context_is_legal(context: list[Message], window: int) -> None:
    p = plan_hard_truncate(context, window=window, fraction=0.5, count=count_chars)
    if p.drop and any(m.role is not Role.SYSTEM for m in p.keep):
        assert is_legal(p.keep) and legality_violations(p.keep) == []


def test_per_message_overhead_of_the_test_counter() -> None:
    # Pins the arithmetic the table-driven cases rely on.
    assert count_chars([user("x" * 40)]) == 40 + PER_MESSAGE


def test_the_planning_numbers_come_from_settings() -> None:
    ctx = numbered([*text_turns(2), user("go"), *tool_rounds(20, result_chars=100)])
    tight = count_chars(ctx[-4:]) + count_chars([ctx[4]]) + 50
    custom = SummarizerSettings(midturn_min_messages=4)
    p = plan(ctx, window=(tight + 1000) * 2, target=0.5, settings=custom)
    assert p.mode is PlanMode.INTRA_TURN and p.keep_recent_messages == 8  # max(4, 2 * keep_recent)
    swapped = plan(_swap_context(IMPORTANT_TURNS[0].values[0]), keep_recent=4)  # type: ignore[arg-type]
    assert swapped.swapped_in
    no_fillers = SummarizerSettings(filler_turn_chars=0)
    assert plan(_swap_context(IMPORTANT_TURNS[0].values[0]), keep_recent=4, settings=no_fillers).swapped_in == ()  # type: ignore[arg-type]


def test_a_rows_text_signals_are_read_once_across_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compaction plans more than once over the same stored rows, and the next one over most of
    them again: whether a row reports an error or records a correction is read from its text once
    per message, and the plans are the same."""
    from contextsvc.core.compression import importance

    read: list[int] = []
    for name in ("_is_error_result", "_is_correction"):
        real = getattr(importance, name)
        monkeypatch.setattr(importance, name, lambda m, real=real: read.append(m.sequence_number) or real(m))
    ctx = _swap_context([user("no, use tabs for indentation from now on"), assistant("noted")])
    first = plan(ctx, keep_recent=4)
    assert first.swapped_in == (1,)  # the correction made its turn important
    once = sorted(read)
    assert once and len(once) == len(set(once))
    again = plan(ctx, keep_recent=4)
    assert sorted(read) == once and again == first
    changed = [dataclasses.replace(m) if m.sequence_number == 1 else m for m in ctx]  # a new object
    assert plan(changed, keep_recent=4).swapped_in == (1,)
    assert sorted(read) == sorted([*once, 1])
