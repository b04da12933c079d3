"""Per-message work is done once per message object, and forgotten with it."""

from __future__ import annotations

import gc

from contextsvc.core.message_memo import IdentityMemo
from contextsvc.core.messages import Message, Role
from contextsvc.core.tokens import _measure, message_size


def test_computed_once_per_object() -> None:
    memo: IdentityMemo[int] = IdentityMemo()
    calls: list[Message] = []

    def compute(m: Message) -> int:
        calls.append(m)
        return len(m.content)

    a = Message(role=Role.USER, content="hello")
    assert memo.get(a, compute) == 5
    assert memo.get(a, compute) == 5
    assert len(calls) == 1
    # An equal but distinct object is its own entry (identity, not equality).
    b = Message(role=Role.USER, content="hello")
    assert memo.get(b, compute) == 5
    assert len(calls) == 2


def test_entries_die_with_their_messages() -> None:
    memo: IdentityMemo[int] = IdentityMemo()
    rows = [Message(role=Role.USER, content="x" * i) for i in range(100)]
    for m in rows:
        memo.get(m, lambda m: len(m.content))
    assert len(memo) == 100
    del rows, m
    gc.collect()
    assert len(memo) == 0


def test_a_reused_id_is_never_a_stale_hit() -> None:
    memo: IdentityMemo[str] = IdentityMemo()
    for i in range(500):  # freed objects' ids are reused quickly by new ones of the same size
        m = Message(role=Role.USER, content=f"text {i}")
        assert memo.get(m, lambda m: m.content) == f"text {i}"


def test_message_size_is_the_measure_of_its_parts() -> None:
    m = Message(role=Role.USER, content="the quick brown fox " * 50, name="bob")
    assert message_size(m) == _measure(m) == message_size(m)
    flagged = m.with_flags(is_pinned=True)
    assert message_size(flagged) == _measure(m)


def test_get_each_is_get_for_every_message_in_order() -> None:
    memo: IdentityMemo[int] = IdentityMemo()
    calls: list[Message] = []

    def compute(m: Message) -> int:
        calls.append(m)
        return len(m.content)

    rows = [Message(role=Role.USER, content="x" * i) for i in range(5)]
    assert memo.get(rows[2], compute) == 2  # one already known
    assert memo.get_each([*rows, rows[0]], compute) == [0, 1, 2, 3, 4, 0]
    assert calls == [rows[2], rows[0], rows[1], rows[3], rows[4]]  # each computed once
    assert memo.get_each(rows, compute) == [0, 1, 2, 3, 4] and len(calls) == 5
