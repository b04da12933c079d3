"""The cheap first stage of a compaction: clear old tool results (DESIGN §5.4).

Before a summarizer is called, bulky tool results outside the kept region are replaced in the
context by a short placeholder. Nothing is lost: the original is demoted (``is_context=False``),
stays in the display history and goes to the raw history index like any demoted row. If that
alone brings the context to its target, no summary is written.

A placeholder is a new context-only row (``is_display=False``) with the original's role
(``tool``), ``tool_call_id`` and ``name``, and ``context_anchor`` = the original's sequence
number: it sorts exactly where the original was, inside the same run after the same assistant
message, so the call keeps its answer and no result is orphaned.

Never cleared: results at or after ``keep_from``; pinned results and every result of a pinned
tool-call group; compression-critical results (flag or ``critical_tool_names``); results that
answer nothing (an orphan stays as it is — the view drops it anyway, and a placeholder would be
an orphan too); rows that are not in the display history (placeholders themselves); and results
whose placeholder would not be shorter.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from contextsvc.core.compression.importance import call_names, is_critical
from contextsvc.core.compression.plan import Count, protected_rows
from contextsvc.core.messages import Flags, Message, Role
from contextsvc.core.turns import analyze

#: Metadata of a placeholder: the sequence number of the result it replaced, and its size.
CLEARED_FROM_KEY = "cleared_from"
CLEARED_CHARS_KEY = "cleared_chars"


@dataclass(slots=True, frozen=True)
class ClearedToolResults:
    """The outcome of the cheap stage.

    ``demote`` are the originals to demote and ``placeholders`` their replacements (same order);
    ``context`` is the context as it would be after the commit, in context order. Token counts are
    ``count`` of the context before (or the caller's ``current_tokens``) and after.
    """

    demote: tuple[Message, ...]
    placeholders: tuple[Message, ...]
    context: tuple[Message, ...]
    tokens_before: int
    tokens_after: int
    chars_cleared: int

    @property
    def cleared(self) -> bool:
        return bool(self.demote)


def placeholder_text(original: Message) -> str:
    """``[tool result #<seq> cleared: <n> chars; ...]``, naming the images too when there were some."""
    size = f"{len(original.content)} chars"
    if original.images:
        size += f", {len(original.images)} image(s)"
    return (
        f"[tool result #{original.sequence_number} cleared: {size}; "
        "the original is in the display history and the history index]"
    )


def placeholder_for(original: Message) -> Message:
    """The context-only row standing in for a cleared tool result, at the original's position."""
    return Message(
        role=Role.TOOL,
        content=placeholder_text(original),
        tool_call_id=original.tool_call_id,
        name=original.name,
        flags=Flags(is_context=True, is_display=False),
        metadata={CLEARED_FROM_KEY: original.sequence_number, CLEARED_CHARS_KEY: len(original.content)},
        context_anchor=original.sequence_number,
    )


def is_placeholder(m: Message) -> bool:
    return m.role is Role.TOOL and CLEARED_FROM_KEY in m.metadata


def clearable_results(
    context: Sequence[Message], keep_from: int, *, critical_tool_names: Collection[str] = ()
) -> list[int]:
    """Indices of the tool results the cheap stage may clear, oldest first (module docstring)."""
    shape = analyze(context)
    protected = protected_rows(context, shape)
    names = call_names(context)
    out: list[int] = []
    for i in range(min(max(keep_from, 0), len(context))):
        m = context[i]
        if m.role is not Role.TOOL or i in protected or shape.group_of(i) is None:
            continue
        if not m.flags.is_display or m.sequence_number <= 0 or is_placeholder(m):
            continue
        if is_critical(m, names, critical_tool_names):
            continue
        if m.images or len(m.content) > len(placeholder_text(m)):
            out.append(i)
    return out


def clear_old_tool_results(
    context: Sequence[Message],
    keep_from: int,
    *,
    count: Count,
    critical_tool_names: Collection[str] = (),
    target_tokens: int | None = None,
    current_tokens: int | None = None,
) -> ClearedToolResults:
    """Clear the tool results before ``keep_from`` (use the plan's ``keep_from``).

    Without ``target_tokens`` every clearable result is cleared. With it, only the oldest ones
    needed to bring ``count`` of the context to ``target_tokens`` or below (all of them if that is
    not enough), so recent results survive when they can.
    """
    candidates = clearable_results(context, keep_from, critical_tool_names=critical_tool_names)
    placeholders = {i: placeholder_for(context[i]) for i in candidates}

    def after(j: int) -> list[Message]:
        chosen = set(candidates[:j])
        return [placeholders[i] if i in chosen else m for i, m in enumerate(context)]

    j = len(candidates)
    if target_tokens is not None and candidates:
        lo, hi = 0, len(candidates)  # smallest j whose result fits; monotone since each clear shrinks
        while lo < hi:
            mid = (lo + hi) // 2
            if count(after(mid)) <= target_tokens:
                hi = mid
            else:
                lo = mid + 1
        j = lo
    chosen = candidates[:j]
    new_context = after(j)
    return ClearedToolResults(
        demote=tuple(context[i] for i in chosen),
        placeholders=tuple(placeholders[i] for i in chosen),
        context=tuple(new_context),
        tokens_before=current_tokens if current_tokens is not None else count(context),
        tokens_after=count(new_context),
        chars_cleared=sum(len(context[i].content) for i in chosen),
    )
