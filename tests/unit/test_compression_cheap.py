"""The cheap stage: clearing old tool results (contextsvc.core.compression.cheap)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextsvc.core.compression import clear_old_tool_results, clearable_results, is_placeholder, placeholder_for
from contextsvc.core.compression.cheap import ClearedToolResults, placeholder_text
from contextsvc.core.legal import is_legal
from contextsvc.core.messages import Flags, ImageRef, Message, Role, context_order
from tests.support.compression_checks import count_chars, defects
from tests.support.message_strategies import (
    assistant,
    message_sequences,
    numbered,
    tool,
    user,
    well_formed_conversations,
)


def pinned(m: Message) -> Message:
    return dataclasses.replace(m, flags=Flags(is_pinned=True))


def critical(m: Message) -> Message:
    return dataclasses.replace(m, flags=Flags(is_compression_critical=True))


def base_context() -> list[Message]:
    return numbered(
        [
            user("go"),  # 1
            assistant("", "c1", "c2"),  # 2
            tool("c1", "A" * 5000),  # 3: cleared
            tool("c2", "tiny"),  # 4: a placeholder would not be shorter
            user("next"),  # 5  <- keep_from = 4
            assistant("", "c4"),  # 6
            tool("c4", "C" * 5000),  # 7: in the kept region
        ]
    )


def commit(context: list[Message], result: ClearedToolResults) -> list[Message]:
    """What a store holds after the commit: originals demoted, placeholders appended and numbered."""
    gone = {m.sequence_number for m in result.demote}
    rows = [m.with_flags(is_context=False) if m.sequence_number in gone else m for m in context]
    rows += [dataclasses.replace(p, sequence_number=len(context) + k + 1) for k, p in enumerate(result.placeholders)]
    return context_order(rows)


def test_an_old_result_becomes_a_placeholder_at_its_place() -> None:
    ctx = base_context()
    r = clear_old_tool_results(ctx, 4, count=count_chars)
    assert [m.sequence_number for m in r.demote] == [3]
    (p,) = r.placeholders
    assert p.content == (
        "[tool result #3 cleared: 5000 chars; the original is in the display history and the history index]"
    )
    assert (p.role, p.tool_call_id, p.name, p.context_anchor) == (Role.TOOL, "c1", "", 3)
    assert p.flags.is_context and not p.flags.is_display and is_placeholder(p)
    assert p.metadata == {"cleared_from": 3, "cleared_chars": 5000}
    assert r.chars_cleared == 5000
    assert r.tokens_before == count_chars(ctx) and r.tokens_after == count_chars(r.context)
    assert r.tokens_after == r.tokens_before - 5000 + len(p.content)
    stored = commit(ctx, r)
    assert [m.content for m in stored] == [m.content for m in r.context]
    assert stored[2] is not ctx[2] and stored[2].tool_call_id == "c1" and is_legal(stored)


def test_images_of_a_cleared_result_are_named_in_the_placeholder() -> None:
    shot = ImageRef(blob_id="b" * 64, width=1024, height=1024)
    ctx = numbered([user("go"), assistant("", "c1"), dataclasses.replace(tool("c1", "ok"), images=(shot, shot))])
    r = clear_old_tool_results(ctx, 3, count=count_chars)
    assert r.placeholders[0].content.startswith("[tool result #3 cleared: 2 chars, 2 image(s);")
    assert r.placeholders[0].images == ()


def test_only_results_before_keep_from_are_cleared() -> None:
    ctx = base_context()
    assert clearable_results(ctx, 2) == []
    assert clearable_results(ctx, 3) == clearable_results(ctx, 4) == [2]
    assert clearable_results(ctx, 7) == clearable_results(ctx, 99) == [2, 6]
    assert clearable_results(ctx, -1) == []


NEVER_CLEARED = [
    pytest.param(lambda rows: [*rows[:2], pinned(rows[2]), *rows[3:]], 4, id="pinned-result"),
    pytest.param(lambda rows: [rows[0], pinned(rows[1]), *rows[2:]], 4, id="pinned-group"),
    pytest.param(lambda rows: [*rows[:2], critical(rows[2]), *rows[3:]], 4, id="critical-flag"),
    pytest.param(lambda rows: [rows[0], assistant("done"), *rows[2:]], 4, id="orphan"),
]


@pytest.mark.parametrize(("change", "keep_from"), NEVER_CLEARED)
def test_results_that_are_never_cleared(change: object, keep_from: int) -> None:
    ctx = numbered(change(base_context()))  # type: ignore[operator]
    assert clearable_results(ctx, keep_from) == []
    assert clear_old_tool_results(ctx, keep_from, count=count_chars).demote == ()


def test_a_critical_tool_name_is_never_cleared() -> None:
    ctx = base_context()
    assert clearable_results(ctx, 4, critical_tool_names=("tool_c1",)) == []
    assert clearable_results(ctx, 4, critical_tool_names=("tool_other",)) == [2]


def test_a_placeholder_is_never_cleared_again() -> None:
    ctx = base_context()
    first = clear_old_tool_results(ctx, 4, count=count_chars)
    stored = commit(ctx, first)
    again = clear_old_tool_results(
        stored, stored.index(next(m for m in stored if m.content == "next")), count=count_chars
    )
    assert again.demote == ()


def test_with_a_target_only_the_oldest_results_needed_are_cleared() -> None:
    rows: list[Message] = [user("go")]
    for k in range(1, 5):
        rows += [assistant("", f"c{k}"), tool(f"c{k}", "x" * 1000)]
    ctx = numbered([*rows, user("now")])
    full = count_chars(ctx)
    one = clear_old_tool_results(ctx, len(ctx) - 1, count=count_chars, target_tokens=full - 900)
    assert [m.sequence_number for m in one.demote] == [3]
    two = clear_old_tool_results(ctx, len(ctx) - 1, count=count_chars, target_tokens=full - 1000)
    assert [m.sequence_number for m in two.demote] == [3, 5]
    unreachable = clear_old_tool_results(ctx, len(ctx) - 1, count=count_chars, target_tokens=10)
    assert [m.sequence_number for m in unreachable.demote] == [3, 5, 7, 9]
    assert unreachable.tokens_after > 10
    assert clear_old_tool_results(ctx, len(ctx) - 1, count=count_chars, target_tokens=full).demote == ()


def test_current_tokens_is_reported_as_the_before_count() -> None:
    r = clear_old_tool_results(base_context(), 4, count=count_chars, current_tokens=12_345)
    assert r.tokens_before == 12_345


def test_placeholder_text_names_sequence_and_size() -> None:
    original = dataclasses.replace(tool("c9", "y" * 812), sequence_number=77)
    assert placeholder_text(original) == (
        "[tool result #77 cleared: 812 chars; the original is in the display history and the history index]"
    )
    assert placeholder_for(original).context_anchor == 77


# --- invariants -----------------------------------------------------------------------------


def _check(context: list[Message], keep_from: int, target: int | None) -> ClearedToolResults:
    r = clear_old_tool_results(context, keep_from, count=count_chars, target_tokens=target)
    index = {id(m): i for i, m in enumerate(context)}
    assert len(r.demote) == len(r.placeholders)
    for original, p in zip(r.demote, r.placeholders, strict=True):
        assert index[id(original)] < keep_from and original.role is Role.TOOL
        assert not original.flags.is_pinned and not original.flags.is_compression_critical
        assert (p.tool_call_id, p.context_anchor, p.role) == (
            original.tool_call_id,
            original.sequence_number,
            Role.TOOL,
        )
        assert len(p.content) < len(original.content) or original.images
    stored = commit(context, r)
    assert [(m.role, m.content, m.tool_call_id) for m in stored] == [
        (m.role, m.content, m.tool_call_id) for m in r.context
    ]
    # Clearing never makes the view worse: a placeholder answers exactly what its original answered.
    by_placeholder = {len(context) + k + 1: o.sequence_number for k, o in enumerate(r.demote)}
    after = {by_placeholder.get(s, s) for s in defects(stored)}
    assert after <= defects(context)
    assert r.tokens_after <= r.tokens_before
    if target is not None and r.tokens_after > target:
        assert len(r.demote) == len(clearable_results(context, keep_from))
    return r


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_clearing_never_orphans_anything(data: st.DataObject) -> None:
    context = data.draw(message_sequences(max_turns=6))
    context = [dataclasses.replace(m, content=m.content * 30) if m.role is Role.TOOL else m for m in context]
    keep_from = data.draw(st.integers(0, len(context)))
    target = data.draw(st.none() | st.integers(0, 3000))
    _check(context, keep_from, target)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_clearing_a_legal_context_keeps_it_legal(data: st.DataObject) -> None:
    context = data.draw(well_formed_conversations(max_turns=6))
    context = [dataclasses.replace(m, content=m.content * 30) if m.role is Role.TOOL else m for m in context]
    keep_from = data.draw(st.integers(0, len(context)))
    r = _check(context, keep_from, None)
    assert is_legal(commit(context, r))
