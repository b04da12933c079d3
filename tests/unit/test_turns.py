"""Turns, tool-call groups and cut points (contextsvc.core.turns)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contextsvc.core.messages import Message, Role
from contextsvc.core.turns import ToolGroup, analyze, answerable_ids, cut_points, split_turns, tool_groups
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

# --- table-driven ----------------------------------------------------------------------------

TURN_CASES = [
    pytest.param([], None, [], id="empty"),
    pytest.param([user()], None, [(0, 1, (0,))], id="one-user"),
    pytest.param(
        [user(), assistant("a"), user(), assistant("", "c1"), tool("c1"), assistant("done")],
        None,
        [(0, 2, (0, 1)), (2, 6, (2, 3, 4, 5))],
        id="two-turns",
    ),
    pytest.param(
        [assistant("hello"), tool("x"), user(), assistant("b")],
        (0, 2, (0, 1)),
        [(2, 4, (2, 3))],
        id="preamble",
    ),
    pytest.param(
        [record(), assistant("hello"), user(), record(), assistant("b"), record()],
        (1, 2, (1,)),
        [(2, 6, (2, 4))],
        id="records-are-not-members",
    ),
    pytest.param([record(), record()], None, [], id="records-only"),
    pytest.param([assistant("x")], (0, 1, (0,)), [], id="preamble-only"),
    pytest.param(
        [summary(), user("rule", pinned=True), user(), assistant("a")],
        None,
        [(0, 1, (0,)), (1, 2, (1,)), (2, 4, (2, 3))],
        id="summary-and-pinned-start-turns",
    ),
]


@pytest.mark.parametrize(("rows", "preamble", "turns"), TURN_CASES)
def test_split_turns(
    rows: list[Message],
    preamble: tuple[int, int, tuple[int, ...]] | None,
    turns: list[tuple[int, int, tuple[int, ...]]],
) -> None:
    shape = analyze(rows)
    got_preamble = (shape.preamble.start, shape.preamble.end, shape.preamble.rows) if shape.preamble else None
    assert got_preamble == preamble
    assert [(t.start, t.end, t.rows) for t in shape.turns] == turns
    assert all(t.user_index == t.start and not t.is_preamble for t in shape.turns)
    expected = ([shape.preamble] if shape.preamble else []) + list(shape.turns)
    assert split_turns(rows) == expected
    if shape.preamble:
        assert shape.preamble.is_preamble and shape.preamble.user_index is None


GROUP_CASES = [
    pytest.param(
        [user(), assistant("", "a", "b"), tool("b"), tool("a")],
        [ToolGroup(1, ("a", "b"), frozenset({"a", "b"}), (2, 3))],
        [],
        id="parallel-results-any-order",
    ),
    pytest.param(
        [user(), assistant("", "a", "b"), tool("a")],
        [ToolGroup(1, ("a", "b"), frozenset({"a"}), (2,))],
        [],
        id="partial",
    ),
    pytest.param(
        [user(), assistant("", "a"), user(), tool("a")],
        [ToolGroup(1, ("a",), frozenset(), ())],
        [3],
        id="result-after-user-is-orphan",
    ),
    pytest.param(
        [user(), assistant("", "a"), assistant("", "b"), tool("a"), tool("b")],
        [ToolGroup(1, ("a",), frozenset(), ()), ToolGroup(2, ("b",), frozenset({"b"}), (4,))],
        [3],
        id="result-after-another-assistant-is-orphan",
    ),
    pytest.param(
        [user(), assistant("", "a"), tool("zz"), tool("a"), tool("a")],
        [ToolGroup(1, ("a",), frozenset({"a"}), (3,))],
        [2, 4],
        id="unknown-and-second-answer-are-orphans",
    ),
    pytest.param(
        [user(), assistant("", "a"), record(), tool("a")],
        [ToolGroup(1, ("a",), frozenset({"a"}), (3,))],
        [],
        id="record-inside-run-is-transparent",
    ),
    pytest.param(
        [user(), assistant("", "a", "a", ""), tool("a"), tool("")],
        [ToolGroup(1, ("a",), frozenset({"a"}), (2,))],
        [3],
        id="repeated-and-empty-ids-are-unanswerable",
    ),
    pytest.param([user(), tool("a"), assistant("x")], [], [1], id="result-without-any-call"),
    pytest.param(
        [user(), assistant("", "a"), tool("a"), user(), assistant("", "a"), tool("a")],
        [ToolGroup(1, ("a",), frozenset({"a"}), (2,)), ToolGroup(4, ("a",), frozenset({"a"}), (5,))],
        [],
        id="id-reused-by-a-later-turn",
    ),
]


@pytest.mark.parametrize(("rows", "groups", "orphans"), GROUP_CASES)
def test_tool_groups(rows: list[Message], groups: list[ToolGroup], orphans: list[int]) -> None:
    shape = analyze(rows)
    assert list(shape.groups) == groups
    assert tool_groups(rows) == groups
    assert list(shape.orphan_indices) == orphans


def test_group_properties() -> None:
    g = ToolGroup(assistant_index=3, call_ids=("a", "b", "c"), answered=frozenset({"b"}), result_indices=(5,))
    assert (g.start, g.end, g.unanswered, g.complete) == (3, 5, ("a", "c"), False)
    empty = ToolGroup(assistant_index=3, call_ids=("a",), answered=frozenset(), result_indices=())
    assert (empty.start, empty.end) == (3, 3)


def test_answerable_ids_keep_first_non_empty() -> None:
    assert answerable_ids(assistant("", "b", "", "a", "b")) == ("b", "a")


def test_cut_points_and_splits() -> None:
    #         0       1                 2          3          4                 5       6
    rows = [user(), assistant("", "a", "b"), tool("a"), record(), tool("b"), user(), assistant("x")]
    shape = analyze(rows)
    assert cut_points(rows) == [0, 5]
    assert [i for i in range(len(rows) + 1) if shape.may_cut_before(i)] == [0, 5, 7]
    assert [i for i in range(len(rows)) if shape.splits_group(i)] == [2, 3, 4]
    assert not shape.may_cut_before(-1) and not shape.may_cut_before(8)
    assert shape.group_of(4) == shape.group_of(1) == shape.groups[0]
    assert shape.group_of(3) is None and shape.group_of(0) is None
    assert shape.turn_of(3) is None and shape.turn_of(4) == shape.turns[0]
    assert shape.turn_of(6) == shape.turns[1]


def test_preamble_rows_have_no_turn() -> None:
    shape = analyze([assistant("hi"), user()])
    assert shape.turn_of(0) is None and shape.turn_of(1) == shape.turns[0]
    assert not shape.may_cut_before(0)


# --- properties ------------------------------------------------------------------------------


@given(message_sequences())
def test_rows_are_partitioned(rows: list[Message]) -> None:
    shape = analyze(rows)
    members = [r for t in ([shape.preamble] if shape.preamble else []) + list(shape.turns) for r in t.rows]
    assert sorted(members + list(shape.record_indices)) == list(range(len(rows)))
    assert len(set(members)) == len(members)
    assert [i for i, m in enumerate(rows) if m.role is Role.SYSTEM] == list(shape.record_indices)
    for k, t in enumerate(shape.turns):
        assert rows[t.start].role is Role.USER
        assert [r for r in t.rows if rows[r].role is Role.USER] == [t.start]
        assert all(t.start <= r < t.end for r in t.rows)
        assert t.end == (shape.turns[k + 1].start if k + 1 < len(shape.turns) else len(rows))
    if shape.preamble:
        assert all(rows[r].role is not Role.USER for r in shape.preamble.rows)
        assert shape.preamble.end == (shape.turns[0].start if shape.turns else len(rows))


@given(message_sequences())
def test_groups_answer_only_within_their_run(rows: list[Message]) -> None:
    shape = analyze(rows)
    answering: set[int] = set()
    for g in shape.groups:
        assert rows[g.start].role is Role.ASSISTANT and rows[g.start].tool_calls
        assert g.answered <= set(g.call_ids)
        assert sorted(rows[r].tool_call_id for r in g.result_indices) == sorted(g.answered)
        # Between the call and its last result: only tool rows and records.
        assert all(rows[r].role in (Role.TOOL, Role.SYSTEM) for r in range(g.start + 1, g.end + 1))
        answering.update(g.result_indices)
    tools = {i for i, m in enumerate(rows) if m.role is Role.TOOL}
    assert answering | set(shape.orphan_indices) == tools
    assert not answering & set(shape.orphan_indices)
    assert [g.start for g in shape.groups] == [
        i for i, m in enumerate(rows) if m.role is Role.ASSISTANT and m.tool_calls
    ]


@given(message_sequences())
def test_cut_points_never_split_a_group(rows: list[Message]) -> None:
    shape = analyze(rows)
    for i in range(len(rows) + 1):
        inside = any(g.start < i <= g.end for g in shape.groups)
        assert shape.splits_group(i) == inside
        assert shape.may_cut_before(i) == (i == len(rows) or (rows[i].role is Role.USER and not inside))


@given(message_sequences(), st.data())
def test_cutting_keeps_every_group_whole(rows: list[Message], data: st.DataObject) -> None:
    """The groups of the two sides of a legal cut are exactly the groups of the whole."""
    shape = analyze(rows)
    cut = data.draw(st.sampled_from([*shape.cut_points(), len(rows)]))
    head, tail = analyze(rows[:cut]), analyze(rows[cut:])
    assert list(head.groups) == [g for g in shape.groups if g.start < cut]
    shifted = [
        ToolGroup(g.assistant_index - cut, g.call_ids, g.answered, tuple(r - cut for r in g.result_indices))
        for g in shape.groups
        if g.start >= cut
    ]
    assert list(tail.groups) == shifted


@given(well_formed_conversations())
def test_well_formed_groups_are_complete_except_pending(rows: list[Message]) -> None:
    shape = analyze(numbered(rows))
    assert not shape.orphan_indices and shape.preamble is None
    for g in shape.groups:
        assert g.complete or (g.start == len(rows) - 1 and not g.answered)
