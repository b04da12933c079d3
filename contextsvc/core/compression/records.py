"""The rows a compaction appends: the summary and the compression service record (DESIGN §5.1, §5.4).

* The **summary** is a context-only user message (``is_summary``, ``is_display=False``). Its
  ``replaces`` is the range of original sequence numbers it stands for (ExpandSummary returns
  those), and its ``context_anchor`` makes it sort before every row the compaction keeps — pinned
  messages, records and the current request of a long turn included (``summary_anchor``).
* The **compression record** is a display-only ``role=system`` row (``is_compression``,
  ``is_context=False``, ``metadata.source = "compression"``) carrying the summary and, under
  ``DEMOTED_RANGES_KEY``, the exact runs of sequence numbers the compaction demoted — a fork taken
  before the compaction uses them to restore those rows to its context.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from contextsvc.core.messages import Flags, Message, Role

#: Metadata key of the compression record listing ``[first, last]`` runs of demoted sequence numbers
#: (read by the fork use case, ``contextsvc/engine/sessions.py``).
DEMOTED_RANGES_KEY = "demoted_ranges"
#: Metadata key of the breadcrumbs (summary KEYS line + extracted entities), on both rows.
BREADCRUMBS_KEY = "breadcrumbs"
#: ``metadata.source`` of a compression record (never in the view's allow-list).
COMPRESSION_SOURCE = "compression"


def sort_anchor(m: Message) -> int:
    """Where ``m`` sits in the context order (its anchor, else its own sequence number)."""
    return m.context_sort_key[0]


def summary_anchor(dropped: Sequence[Message], kept: Sequence[Message]) -> int:
    """The ``context_anchor`` that places a new summary before every kept row.

    The context sorts by ``(anchor or sequence, sequence)`` and the summary is the newest row, so it
    loses every tie: its anchor must be strictly below every kept row's. That is normally where the
    first message it replaces was. When a kept row sits at or before that (a pinned first message,
    the current request of a long turn), it is one less than the smallest kept anchor; that can be
    0 or below, and since 0 means "own sequence number" it becomes -1 (stores sort anchors as plain
    integers, so a negative anchor simply sorts first).
    """
    first_kept = min((sort_anchor(m) for m in kept), default=None)
    first_dropped = min((sort_anchor(m) for m in dropped), default=None)
    if first_dropped is not None and (first_kept is None or first_dropped < first_kept):
        anchor = first_dropped
    elif first_kept is not None:
        anchor = first_kept - 1
    else:
        anchor = 1
    return anchor if anchor != 0 else -1


def covered_range(dropped: Iterable[Message]) -> tuple[int, int] | None:
    """``(first, last)`` original sequence numbers a summary of ``dropped`` replaces; None if unknown.

    A displayed row stands for itself; an older summary for its ``replaces`` range; a context-only
    row with an anchor (a cleared tool result's placeholder) for the row it replaced. Rows kept
    inside the range (pinned ones) are not excluded: the range is what ExpandSummary looks at.
    """
    points: list[int] = []
    for m in dropped:
        if m.flags.is_summary and m.replaces is not None:
            points += m.replaces
        elif not m.flags.is_display and m.context_anchor > 0:
            points.append(m.context_anchor)
        elif m.sequence_number > 0:
            points.append(m.sequence_number)
    return (min(points), max(points)) if points else None


def demoted_ranges(sequence_numbers: Iterable[int]) -> list[list[int]]:
    """Runs of consecutive sequence numbers, ``[[first, last], ...]`` ascending (0s ignored)."""
    runs: list[list[int]] = []
    for s in sorted({s for s in sequence_numbers if s > 0}):
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return runs


def summary_message(
    text: str,
    *,
    dropped: Sequence[Message],
    kept: Sequence[Message],
    breadcrumbs: Sequence[str] = (),
    metadata: Mapping[str, Any] | None = None,
) -> Message:
    """The context-only summary row replacing ``dropped``, placed before every row of ``kept``."""
    meta: dict[str, Any] = dict(metadata or {})
    meta[BREADCRUMBS_KEY] = list(breadcrumbs)
    meta["summarized_messages"] = len(dropped)
    return Message(
        role=Role.USER,
        content=text,
        flags=Flags(is_context=True, is_display=False, is_summary=True),
        metadata=meta,
        replaces=covered_range(dropped),
        context_anchor=summary_anchor(dropped, kept),
    )


def compression_record(
    *,
    method: str,
    reason: str,
    demoted: Iterable[Message],
    summary: str = "",
    breadcrumbs: Sequence[str] = (),
    tokens_before: int = 0,
    tokens_after: int = 0,
    messages_before: int = 0,
    messages_after: int = 0,
    note: str = "",
) -> Message:
    """The display-only service record of one compaction.

    ``method`` is ``summary``, ``hard_truncate`` or ``clear_tool_results``; ``reason`` the trigger
    (``preturn``, ``midturn``, ``postturn``, ``forced``). Its content is the summary, or a sentence
    saying what was removed when there is none. ``note``: the caller's free-text reason
    (``Compress``), kept as ``metadata.note`` when given.
    """
    rows = list(demoted)
    seqs = [m.sequence_number for m in rows]
    covered = covered_range(rows)
    content = summary or _describe(method, len(rows), covered)
    metadata: dict[str, Any] = {
        "source": COMPRESSION_SOURCE,
        "method": method,
        "reason": reason,
        DEMOTED_RANGES_KEY: demoted_ranges(seqs),
        BREADCRUMBS_KEY: list(breadcrumbs),
        "tokens_before": tokens_before,
        "tokens_after": tokens_after,
        "messages_before": messages_before,
        "messages_after": messages_after,
    }
    if covered is not None:
        metadata["replaces"] = list(covered)
    if note:
        metadata["note"] = note
    return Message(
        role=Role.SYSTEM,
        content=content,
        flags=Flags(is_context=False, is_display=True, is_compression=True),
        metadata=metadata,
    )


def _describe(method: str, count: int, covered: tuple[int, int] | None) -> str:
    where = f" (#{covered[0]}-#{covered[1]})" if covered else ""
    if method == "clear_tool_results":
        what = f"{count} old tool result(s){where} cleared from the context"
    else:
        what = f"{count} message(s){where} removed from the context without a summary"
    return f"Context compressed: {what}; the originals remain in the display history and the history index."
