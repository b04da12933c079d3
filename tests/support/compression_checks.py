"""Shared checks for the compression tests: a simple token counter and the defects a view repairs."""

from __future__ import annotations

from collections.abc import Sequence

from contextsvc.core.legal import repair
from contextsvc.core.messages import Message, Role
from contextsvc.core.turns import analyze

#: Every message costs this much on top of its characters, so an empty message is not free.
PER_MESSAGE = 4


def chars(m: Message) -> int:
    """Characters of the text fields of ``m`` (independent of the service's own sizing)."""
    calls = sum(len(c.id) + len(c.name) + len(c.arguments_json) for c in m.tool_calls)
    return len(m.content) + len(m.thinking) + len(m.tool_call_id) + len(m.name) + calls


def count_chars(messages: Sequence[Message]) -> int:
    """A monotone token counter for tests: characters plus a per-message overhead."""
    return sum(chars(m) + PER_MESSAGE for m in messages)


def conversation(rows: Sequence[Message]) -> list[Message]:
    """``rows`` without ``role=system`` records (the view places records before the conversation)."""
    return [m for m in rows if m.role is not Role.SYSTEM]


def defects(rows: Sequence[Message]) -> set[int]:
    """Sequence numbers of the conversation rows the legal repair drops or changes."""
    conv = conversation(rows)
    intact = {conv[i].sequence_number for i, m in repair(conv) if m is conv[i]}
    return {m.sequence_number for m in conv} - intact


def split_groups(original: Sequence[Message], kept: Sequence[Message]) -> list[int]:
    """Assistant sequence numbers of tool-call groups that ``kept`` holds only part of."""
    kept_ids = {id(m) for m in kept}
    broken = []
    for g in analyze(original).groups:
        members = [original[g.assistant_index], *(original[i] for i in g.result_indices)]
        inside = {id(m) in kept_ids for m in members}
        if len(inside) > 1:
            broken.append(original[g.assistant_index].sequence_number)
    return broken
