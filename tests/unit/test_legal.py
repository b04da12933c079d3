"""Legal views and legal suffixes (contextsvc.core.legal)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contextsvc.core.legal import _repair, is_legal, legal_suffix_start, legal_view, repair
from contextsvc.core.messages import ImageRef, Message, Role
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


def shorthand(messages: list[Message]) -> list[str]:
    """``U1``, ``A2[a,b]``, ``T3:a``, ``S4`` — a row's role, number and calls."""
    out = []
    for m in messages:
        tag = f"{m.role.value[0].upper()}{m.sequence_number}"
        if m.tool_calls:
            tag += "[" + ",".join(c.id for c in m.tool_calls) + "]"
        if m.role is Role.TOOL:
            tag += f":{m.tool_call_id}"
        out.append(tag)
    return out


# --- table-driven ----------------------------------------------------------------------------

CASES = [
    pytest.param([], [], id="empty"),
    pytest.param([user()], ["U1"], id="one-user"),
    pytest.param([record(), record(), user()], ["S1", "S2", "U3"], id="leading-system-kept"),
    pytest.param(
        [record(), assistant("hi"), tool("a"), user(), assistant("b")], ["S1", "U4", "A5"], id="preamble-dropped"
    ),
    pytest.param([assistant("hi"), assistant("", "a"), tool("a")], [], id="no-user-no-conversation"),
    pytest.param([summary(), assistant("ok")], ["U1", "A2"], id="summary-starts-the-conversation"),
    pytest.param([user(), record(), assistant("b")], ["U1", "A3"], id="system-after-start-dropped"),
    pytest.param(
        [user(), assistant("", "a", "b"), tool("b"), tool("a"), assistant("done")],
        ["U1", "A2[a,b]", "T3:b", "T4:a", "A5"],
        id="complete-group-untouched",
    ),
    pytest.param([user(), tool("a"), assistant("x")], ["U1", "A3"], id="orphan-result-dropped"),
    pytest.param(
        [user(), assistant("", "a"), tool("a"), tool("a"), tool("z")],
        ["U1", "A2[a]", "T3:a"],
        id="second-answer-and-unknown-id-dropped",
    ),
    pytest.param(
        [user(), assistant("text", "a", "b"), tool("a"), user()],
        ["U1", "A2[a]", "T3:a", "U4"],
        id="partial-answer-keeps-answered-calls",
    ),
    pytest.param(
        [user(), assistant("", "a"), user(), tool("a")],
        ["U1", "U3"],
        id="interrupted-call-without-text-dropped-with-its-late-result",
    ),
    pytest.param(
        [user(), assistant("I will look", "a"), user(), tool("a")],
        ["U1", "A2", "U3"],
        id="interrupted-call-with-text-keeps-text",
    ),
    pytest.param(
        [user(), assistant("", "a"), assistant("", "b"), tool("a"), tool("b")],
        ["U1", "A3[b]", "T5:b"],
        id="result-after-another-assistant-is-orphan",
    ),
    pytest.param([user(), assistant("", "a", "b")], ["U1", "A2[a,b]"], id="pending-call-as-last-kept"),
    pytest.param(
        [user(), assistant("", "a"), record()],
        ["U1", "A2[a]"],
        id="pending-call-followed-by-dropped-record-still-last",
    ),
    pytest.param(
        [user(), assistant("", "a"), tool("z")],
        ["U1"],
        id="pending-call-followed-by-orphan-is-not-last",
    ),
    pytest.param(
        [user(), assistant("", "a", "a", "", "b")],
        ["U1", "A2[a,b]"],
        id="pending-call-loses-repeated-and-empty-ids",
    ),
    pytest.param(
        [user(), assistant("", "a", "a"), tool("a"), tool("a")],
        ["U1", "A2[a]", "T3:a"],
        id="repeated-id-keeps-first-call-and-first-answer",
    ),
    pytest.param(
        [user(), assistant("  ", "a"), user()],
        ["U1", "U3"],
        id="blank-text-does-not-keep-an-assistant",
    ),
    pytest.param(
        [user(), assistant("", "a"), record(), tool("a"), user()],
        ["U1", "A2[a]", "T4:a", "U5"],
        id="record-inside-run-dropped-group-kept",
    ),
    pytest.param(
        [user(), user("b", pinned=True), summary(), assistant("x"), user()],
        ["U1", "U2", "U3", "A4", "U5"],
        id="every-user-message-kept",
    ),
]


@pytest.mark.parametrize(("rows", "expected"), CASES)
def test_legal_view(rows: list[Message], expected: list[str]) -> None:
    rows = numbered(rows)
    view = legal_view(rows)
    assert shorthand(view) == expected
    assert legality_violations(view) == []
    assert is_legal(rows) == (view == rows)


def test_images_keep_an_assistant_whose_calls_go() -> None:
    rows = numbered([user(), dataclasses.replace(assistant("", "a"), images=(ImageRef("blob"),)), user()])
    view = legal_view(rows)
    assert shorthand(view) == ["U1", "A2", "U3"]
    assert view[1].images == rows[1].images


def test_thinking_alone_does_not_keep_an_assistant() -> None:
    rows = numbered([user(), dataclasses.replace(assistant("", "a"), thinking="hmm"), user()])
    assert shorthand(legal_view(rows)) == ["U1", "U3"]


def test_untouched_rows_are_the_same_objects() -> None:
    rows = numbered([user(), assistant("", "a", "b"), tool("a"), assistant("ok")])
    view = legal_view(rows)
    assert view[0] is rows[0] and view[2] is rows[2] and view[3] is rows[3]
    assert view[1] is not rows[1] and view[1].tool_calls == rows[1].tool_calls[:1]
    assert rows[1].tool_calls[1].id == "b"  # the input is not mutated


def test_repair_traces_rows() -> None:
    rows = numbered([record(), assistant("x"), user(), tool("q"), assistant("y")])
    assert [i for i, _ in repair(rows)] == [0, 2, 4]


SUFFIX_CASES = [
    pytest.param([], 0, 0, id="empty"),
    pytest.param([user(), assistant("a"), user(), assistant("b")], 0, 0, id="all-legal"),
    pytest.param([user(), assistant("a"), user(), assistant("b")], 1, 2, id="from-next-user"),
    pytest.param([user(), assistant("a")], 1, 2, id="none-after-start"),
    pytest.param([user(), tool("z"), user(), assistant("b")], 0, 2, id="after-orphan"),
    pytest.param([user(), assistant("", "a"), user(), assistant("b")], 0, 2, id="after-unanswered-call"),
    pytest.param([user(), assistant("", "a"), tool("a"), user()], 0, 0, id="complete-group"),
    pytest.param([user(), assistant("b"), user(), assistant("", "a")], 0, 0, id="pending-call-last"),
    pytest.param([user(), user(), assistant("", "a"), tool("z")], 0, 4, id="defect-in-last-turn"),
    pytest.param([user(), record(), user()], 0, 2, id="record-is-a-defect-in-a-suffix"),
    pytest.param([assistant("x"), tool("z"), user(), assistant("b")], 0, 2, id="preamble-skipped"),
]


@pytest.mark.parametrize(("rows", "start", "expected"), SUFFIX_CASES)
def test_legal_suffix_start(rows: list[Message], start: int, expected: int) -> None:
    rows = numbered(rows)
    j = legal_suffix_start(rows, start)
    assert j == expected
    assert is_legal(rows[j:]) and legality_violations(rows[j:]) == []


# --- properties ------------------------------------------------------------------------------


def _by_seq(rows: list[Message]) -> dict[int, tuple[int, Message]]:
    return {m.sequence_number: (i, m) for i, m in enumerate(rows)}


@given(message_sequences())
def test_view_is_legal(rows: list[Message]) -> None:
    view = legal_view(rows)
    assert legality_violations(view) == []
    assert is_legal(view)


@given(message_sequences())
def test_view_starts_at_a_user_after_leading_system(rows: list[Message]) -> None:
    view = legal_view(rows)
    lead = 0
    while lead < len(rows) and rows[lead].role is Role.SYSTEM:
        lead += 1
    assert view[:lead] == rows[:lead]
    assert all(m.role is not Role.SYSTEM for m in view[lead:])
    if len(view) > lead:
        assert view[lead].role is Role.USER
        assert view[lead] is next(m for m in rows if m.role is Role.USER)


@given(message_sequences())
def test_every_user_message_is_kept(rows: list[Message]) -> None:
    view = legal_view(rows)
    # The kept range starts at the first user message, so it holds every user message.
    assert [m for m in view if m.role is Role.USER] == [m for m in rows if m.role is Role.USER]


@given(message_sequences())
def test_view_keeps_order_and_invents_nothing(rows: list[Message]) -> None:
    view = legal_view(rows)
    origin = _by_seq(rows)
    positions = [origin[m.sequence_number][0] for m in view]
    assert positions == sorted(set(positions))
    for m in view:
        original = origin[m.sequence_number][1]
        if m is original:
            continue
        # The only edit: some tool calls of an assistant message removed, the rest in order.
        assert m.role is Role.ASSISTANT
        assert dataclasses.replace(m, tool_calls=original.tool_calls) == original
        calls = iter(original.tool_calls)
        assert all(any(c == o for o in calls) for c in m.tool_calls)
        assert len(m.tool_calls) < len(original.tool_calls)


@given(message_sequences())
def test_view_is_idempotent(rows: list[Message]) -> None:
    once = legal_view(rows)
    twice = legal_view(once)
    assert twice == once
    assert all(a is b for a, b in zip(twice, once, strict=True))


@given(message_sequences())
def test_is_legal_agrees_with_the_oracle(rows: list[Message]) -> None:
    assert is_legal(rows) == (legality_violations(rows) == [])


@given(well_formed_conversations())
def test_legal_input_comes_back_unchanged(rows: list[Message]) -> None:
    assert legality_violations(rows) == []
    view = legal_view(rows)
    assert len(view) == len(rows) and all(a is b for a, b in zip(view, rows, strict=True))


@given(message_sequences())
def test_answered_calls_are_never_lost(rows: list[Message]) -> None:
    """Repair drops only what is broken: a kept-range call answered in its run keeps its result."""
    view = legal_view(rows)
    kept = {m.sequence_number for m in view}
    first_user = next((i for i, m in enumerate(rows) if m.role is Role.USER), len(rows))
    conv = [(i, m) for i, m in enumerate(rows) if m.role is not Role.SYSTEM and i >= first_user]
    for k, (_, m) in enumerate(conv):
        if m.role is not Role.TOOL:
            continue
        head = k - 1
        while head >= 0 and conv[head][1].role is Role.TOOL:
            head -= 1
        if head < 0 or conv[head][1].role is not Role.ASSISTANT:
            continue
        earlier = {r.tool_call_id for _, r in conv[head + 1 : k]}
        if m.tool_call_id and m.tool_call_id in {c.id for c in conv[head][1].tool_calls} - earlier:
            assert m.sequence_number in kept and conv[head][1].sequence_number in kept


@given(message_sequences(), st.data())
def test_legal_suffix_is_the_first_legal_tail(rows: list[Message], data: st.DataObject) -> None:
    start = data.draw(st.integers(0, len(rows)))
    j = legal_suffix_start(rows, start)
    assert start <= j <= len(rows)
    assert j == len(rows) or rows[j].role is Role.USER
    assert legality_violations(rows[j:]) == []
    for k in range(start, j):
        if rows[k].role is Role.USER:
            assert legality_violations(rows[k:]) != [], f"an earlier legal suffix starts at {k}"


@given(message_sequences())
def test_the_one_pass_check_agrees_with_the_full_repair(rows: list[Message]) -> None:
    """``repair`` skips its full pass when ``is_legal`` says nothing needs repair: that
    must be exactly when the full repair would return every row as it is."""
    full = _repair(rows)
    unchanged = len(full) == len(rows) and all(m is rows[i] for i, m in full)
    assert is_legal(rows) == unchanged
    again = repair(rows)
    assert again == full
    assert all((a is rows[i]) == (b is rows[i]) for (i, a), (_, b) in zip(again, full, strict=True))


@given(well_formed_conversations())
def test_well_formed_conversations_take_the_one_pass_check(rows: list[Message]) -> None:
    assert is_legal(rows)
    assert [m for _, m in repair(rows)] == rows
