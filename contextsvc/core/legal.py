"""Legal message sequences for chat APIs, and the repair that produces them (DESIGN §5.2).

A sequence is **legal** when it is ``[system rows...] + conversation`` and the conversation:

1. is empty or starts at a user message (a summary is a user message, so it may start it);
2. holds no ``role=system`` row (system content only leads);
3. has no orphan tool result: every tool result answers a call of the assistant message heading its
   run (the tool rows right after it, see ``core/turns.py``), and is the only answer to that id;
4. has no call without its result: every tool call of an assistant message is answered in its run,
   has a non-empty id, and its id is unique within the message. The one exception is the **pending
   call**: the very last message of the sequence may be an assistant message whose (well-formed)
   calls have no results yet — the runtime is executing them.

``legal_view`` repairs any sequence into a legal one. It never fails, never invents a message and
never reorders; every output message is an input message, or an input assistant message with some
of its tool calls removed. The rules, in the order the repair applies them:

* the leading ``role=system`` rows are kept as they are; a ``role=system`` row after the first
  non-system row is dropped (the view builder places the records it wants first);
* every non-system row before the first user message (the preamble) is dropped; the kept range is
  from that user message to the end, and **every user message in it is kept**;
* a tool result that answers nothing (unknown id, call not in its run, second answer) is dropped;
* an assistant message with tool calls keeps only its answered calls (calls with an empty or
  repeated id are never answered), in their original order. The unanswered calls of a message that
  is not the last row are dropped, whatever its position — an interrupted tool call would otherwise
  make the provider reject the whole prompt. When no call remains, the message is kept without
  calls if it has text (non-blank content) or images, and dropped otherwise (thinking alone does not
  keep it);
* the last row of the input, when it is an assistant message with calls, keeps all its well-formed
  calls (pending). "Last" is decided on the input: an assistant followed only by rows the repair
  drops (an orphan result, a stray system row) is not last, so its unanswered calls are dropped.

The repair is idempotent: a legal sequence comes back unchanged (the same objects).

A **legal suffix** (used by hard truncation) is a tail ``messages[j:]`` that starts at a user message
and is legal as it stands, with no repair. Because a run never crosses a user message, whether a row
after ``j`` needs repair does not depend on ``j``; so the legal suffixes of a list are exactly the
tails starting at a user message after its last defective row.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from contextsvc.core.messages import Message, Role
from contextsvc.core.turns import ToolGroup, analyze, answerable_ids


def repair(messages: Sequence[Message]) -> list[tuple[int, Message]]:
    """The legal view as ``(input index, message)`` pairs, for callers that must trace each row.

    A message is the input object itself unless the repair removed some of its tool calls.
    """
    if is_legal(messages):
        return list(enumerate(messages))  # a legal sequence comes back unchanged
    return _repair(messages)


def _repair(messages: Sequence[Message]) -> list[tuple[int, Message]]:
    shape = analyze(messages)
    n = len(messages)
    out: list[tuple[int, Message]] = []
    lead = 0
    while lead < n and messages[lead].role is Role.SYSTEM:
        out.append((lead, messages[lead]))
        lead += 1
    if not shape.turns:
        return out
    first_user = shape.turns[0].start
    last_row = _last_non_system(messages)
    for i in range(first_user, n):
        kept = _repaired_row(messages, shape.group_of(i), i, last_row)
        if kept is not None:
            out.append((i, kept))
    return out


def legal_view(messages: Sequence[Message]) -> list[Message]:
    """``messages`` made legal by the rules of the module docstring. O(n)."""
    return [m for _, m in repair(messages)]


def is_legal(messages: Sequence[Message]) -> bool:
    """True when ``legal_view`` would return ``messages`` unchanged: one pass, without building the
    context's shape: stored contexts are legal nearly always, and a view assembled from scratch
    checks them every time. The rules are the module docstring's, read as "nothing to repair"."""
    # Enum members bound to locals: ``Role.USER`` is a class attribute lookup that costs several
    # times a comparison on Python 3.11, and this runs for every row of every view.
    system, user, assistant, tool = Role.SYSTEM, Role.USER, Role.ASSISTANT, Role.TOOL
    n = len(messages)
    i = 0
    while i < n and messages[i].role is system:
        i += 1
    if i < n and messages[i].role is not user:
        return False  # a preamble: dropped
    open_ids: set[str] = set()  # calls of the open run still waiting for their answer
    run_open = False  # an assistant with calls heads the run the next tool rows belong to
    for m in itertools.islice(messages, i, None):
        role = m.role
        if role is user and not open_ids:
            run_open = False
            continue
        if role is tool:
            if not run_open or m.tool_call_id not in open_ids:
                return False  # an orphan, or a second answer
            open_ids.discard(m.tool_call_id)
            continue
        if open_ids:
            return False  # the run ended with a call unanswered
        if role is system:
            return False  # a record after the conversation began: dropped
        run_open = False
        if role is assistant and m.tool_calls:
            ids = {call.id for call in m.tool_calls}
            if "" in ids or len(ids) != len(m.tool_calls):
                return False  # an empty or repeated id is never answered: the call goes
            open_ids, run_open = ids, True
    # Calls still open at the end are pending only on the very last row.
    return not open_ids or messages[n - 1].role is assistant


def legal_suffix_start(messages: Sequence[Message], start: int = 0) -> int:
    """The smallest ``j >= start`` such that ``messages[j:]`` is a legal suffix; ``len(messages)`` if none.

    ``messages[j]`` is then a user message and ``messages[j:]`` is legal without repair, so the
    caller can keep that tail verbatim. An empty tail (``len(messages)``) is trivially legal. Pass
    the conversation without its ``role=system`` records: a system row is illegal inside a tail, so
    no tail that holds one is a legal suffix.
    """
    n = len(messages)
    shape = analyze(messages)
    last_row = _last_non_system(messages)
    # Rows at or after the first user message repair the same way in every tail starting at a user
    # message before them (module docstring), so one backward scan finds the last defective row.
    floor = max(start, 0)
    last_defect = -1
    for i in range(n - 1, floor - 1, -1):
        m = messages[i]
        if m.role is Role.USER:
            continue
        if m.role is Role.SYSTEM or _repaired_row(messages, shape.group_of(i), i, last_row) is not m:
            last_defect = i
            break
    for t in shape.turns:
        if t.start >= floor and t.start > last_defect:
            return t.start
    return n


def _last_non_system(messages: Sequence[Message]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role is not Role.SYSTEM:
            return i
    return -1


def _repaired_row(messages: Sequence[Message], group: ToolGroup | None, i: int, last_row: int) -> Message | None:
    """Row ``i`` (at or after the first user message) as the legal view keeps it; None = dropped."""
    m = messages[i]
    if m.role is Role.USER:
        return m
    if m.role is Role.SYSTEM:
        return None
    if m.role is Role.TOOL:
        # Only the first answer to a call of its own run belongs to a group (core/turns.py).
        return m if group is not None else None
    if not m.tool_calls:
        return m
    # The pending exception: the last row keeps its well-formed calls although none is answered.
    keep = set(answerable_ids(m)) if i == last_row else set(group.answered if group is not None else ())
    calls = []
    for call in m.tool_calls:
        if call.id in keep:
            calls.append(call)
            keep.discard(call.id)  # a repeated id keeps only its first call
    if len(calls) == len(m.tool_calls):
        return m
    if calls or m.content.strip() or m.images:
        return dataclasses.replace(m, tool_calls=tuple(calls))
    return None
