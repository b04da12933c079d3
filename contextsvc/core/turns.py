"""Turns and tool-call groups of a context, and where it may be cut.

Definitions (DESIGN §2), over a list of messages in context order:

* **record** — a ``role=system`` row. Records are not members of any turn or group: the view places
  them before the conversation, so here they are transparent (skipped, never closing a group).
* **turn** — one user message plus every assistant/tool row after it up to the next user message.
  Non-system rows before the first user message form the **preamble** (a turn without a user).
* **tool-call group** — an assistant message with tool calls plus the tool results that answer it.
  A result answers the group only when it sits in the group's *run*: the tool rows that follow the
  assistant with nothing but tool (or record) rows in between. Chat APIs demand exactly that
  adjacency (a tool result must respond to the immediately preceding assistant message), so a
  result separated from its call by a user or assistant message answers nothing: it is an
  **orphan**, as are results with an unknown id and second answers to an already answered id.
  Calls with an empty id, or repeating an id earlier in the same message, can never be answered.

Because a run holds only tool rows, a group never contains a user message; a cut before a user
message therefore never splits a group. ``splits_group`` exists for the intra-turn cut (one long
turn, DESIGN §5.4), which cuts before an assistant row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contextsvc.core.messages import Message, Role


@dataclass(slots=True, frozen=True)
class Turn:
    """A turn's place in the context: row indices, ``end`` exclusive.

    ``user_index`` is None for the preamble. ``rows`` lists the member rows (records excluded),
    so ``rows[0] == start`` always.
    """

    start: int
    end: int
    user_index: int | None
    rows: tuple[int, ...]

    @property
    def is_preamble(self) -> bool:
        return self.user_index is None


@dataclass(slots=True, frozen=True)
class ToolGroup:
    """An assistant message with tool calls and the results that answer it.

    ``call_ids`` are the answerable ids of the message's calls (non-empty, first occurrence), in
    call order; ``answered`` the ids that got a result; ``result_indices`` the rows of those
    results (the first answer to each id), in row order.
    """

    assistant_index: int
    call_ids: tuple[str, ...]
    answered: frozenset[str]
    result_indices: tuple[int, ...]

    @property
    def start(self) -> int:
        return self.assistant_index

    @property
    def end(self) -> int:
        """The last row of the group (inclusive): its last answering result, else the assistant."""
        return self.result_indices[-1] if self.result_indices else self.assistant_index

    @property
    def unanswered(self) -> tuple[str, ...]:
        return tuple(i for i in self.call_ids if i not in self.answered)

    @property
    def complete(self) -> bool:
        return len(self.answered) == len(self.call_ids)


class ContextShape:
    """Turns, groups, records and orphans of one context (built by ``analyze``); cut questions in O(1)."""

    __slots__ = (
        "_group_of_row",
        "_inside_group",
        "_turn_of_row",
        "groups",
        "orphan_indices",
        "preamble",
        "record_indices",
        "size",
        "turns",
    )

    def __init__(
        self,
        *,
        size: int,
        preamble: Turn | None,
        turns: tuple[Turn, ...],
        groups: tuple[ToolGroup, ...],
        record_indices: tuple[int, ...],
        orphan_indices: tuple[int, ...],
        group_of_row: list[int],
    ) -> None:
        self.size = size
        self.preamble = preamble
        self.turns = turns
        self.groups = groups
        self.record_indices = record_indices
        self.orphan_indices = orphan_indices
        self._group_of_row = group_of_row
        self._turn_of_row = [-1] * size
        for k, t in enumerate(turns):
            for r in t.rows:
                self._turn_of_row[r] = k
        # Rows strictly after a group's assistant and up to its last result (orphans and records in
        # the run included): a cut before any of them would separate the call from an answer.
        self._inside_group = [False] * size
        for g in groups:
            for r in range(g.start + 1, g.end + 1):
                self._inside_group[r] = True

    def group_of(self, i: int) -> ToolGroup | None:
        """The group row ``i`` belongs to (as its assistant or as an answering result)."""
        g = self._group_of_row[i]
        return self.groups[g] if g >= 0 else None

    def turn_of(self, i: int) -> Turn | None:
        """The turn row ``i`` belongs to; None for records and preamble rows."""
        t = self._turn_of_row[i]
        return self.turns[t] if t >= 0 else None

    def splits_group(self, i: int) -> bool:
        """Would a cut before row ``i`` separate a group's assistant from one of its results?"""
        return 0 <= i < self.size and self._inside_group[i]

    def may_cut_before(self, i: int) -> bool:
        """May the context be cut so that the kept tail starts at row ``i``?

        Legal at a user message (which never splits a group, see the module docstring) and at
        ``size`` (an empty tail). Records before the cut go with the older part; the view places
        records before the conversation anyway.
        """
        if i == self.size:
            return True
        if not 0 <= i < self.size or self._inside_group[i]:
            return False
        t = self._turn_of_row[i]
        return t >= 0 and self.turns[t].start == i

    def cut_points(self) -> tuple[int, ...]:
        """Every legal cut inside the context, oldest first: the start of each turn."""
        return tuple(t.start for t in self.turns)


def analyze(messages: Sequence[Message]) -> ContextShape:
    """Split ``messages`` (context order) into preamble, turns and tool-call groups. O(n)."""
    n = len(messages)
    group_of_row = [-1] * n
    records: list[int] = []
    orphans: list[int] = []
    groups: list[ToolGroup] = []
    turn_rows: list[list[int]] = []
    preamble_rows: list[int] = []

    # The open group: its assistant row, answerable ids, and answered id -> result row.
    open_index = -1
    open_ids: tuple[str, ...] = ()
    open_answered: dict[str, int] = {}

    def close() -> None:
        nonlocal open_index, open_ids, open_answered
        if open_index >= 0:
            groups.append(
                ToolGroup(
                    assistant_index=open_index,
                    call_ids=open_ids,
                    answered=frozenset(open_answered),
                    result_indices=tuple(sorted(open_answered.values())),
                )
            )
        open_index, open_ids, open_answered = -1, (), {}

    for i, m in enumerate(messages):
        if m.role is Role.SYSTEM:
            records.append(i)  # transparent: does not close the open run
            continue
        if m.role is Role.USER:
            close()
            turn_rows.append([i])
            continue
        (turn_rows[-1] if turn_rows else preamble_rows).append(i)
        if m.role is Role.TOOL:
            if open_index >= 0 and m.tool_call_id in open_ids and m.tool_call_id not in open_answered:
                open_answered[m.tool_call_id] = i
                group_of_row[i] = len(groups)
            else:
                orphans.append(i)
            continue
        close()  # any assistant message ends the previous run
        if m.tool_calls:
            open_index, open_ids = i, answerable_ids(m)
            group_of_row[i] = len(groups)
    close()

    # A turn's range ends where the next turn starts; records in between stay inside the range.
    starts = [rows[0] for rows in turn_rows] + [n]
    turns = tuple(
        Turn(start=starts[k], end=starts[k + 1], user_index=starts[k], rows=tuple(rows))
        for k, rows in enumerate(turn_rows)
    )
    preamble = None
    if preamble_rows:
        preamble = Turn(start=preamble_rows[0], end=starts[0], user_index=None, rows=tuple(preamble_rows))
    return ContextShape(
        size=n,
        preamble=preamble,
        turns=turns,
        groups=tuple(groups),
        record_indices=tuple(records),
        orphan_indices=tuple(orphans),
        group_of_row=group_of_row,
    )


def answerable_ids(m: Message) -> tuple[str, ...]:
    """The ids of ``m``'s tool calls that a result could answer: non-empty, first occurrence only."""
    seen: dict[str, None] = {}
    for call in m.tool_calls:
        if call.id and call.id not in seen:
            seen[call.id] = None
    return tuple(seen)


def split_turns(messages: Sequence[Message]) -> list[Turn]:
    """The preamble (if any) followed by every turn, oldest first."""
    shape = analyze(messages)
    return ([shape.preamble] if shape.preamble else []) + list(shape.turns)


def tool_groups(messages: Sequence[Message]) -> list[ToolGroup]:
    """Every tool-call group, in order of its assistant message."""
    return list(analyze(messages).groups)


def cut_points(messages: Sequence[Message]) -> list[int]:
    """Rows before which the context may be cut (each turn's user message), oldest first."""
    return list(analyze(messages).cut_points())
