"""Recalled excerpts as view records (the pure part of ``engine/recall.py``).

An excerpt is a history chunk's text, cut down to the lines that hold the question's terms when it
is longer than its share of the recall budget, sent as a ``role=system`` record flagged
``is_recall`` (never stored) with a first line that says where it comes from, so the model can
tell recalled history from the live conversation.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Sequence

from contextsvc.core.history import HistoryChunk
from contextsvc.core.messages import Flags, Message, Role
from contextsvc.core.recall import terms

__all__ = ["RECALL_SOURCE", "covers_any", "excerpt", "recall_record"]

#: ``metadata.source`` of a recalled record.
RECALL_SOURCE = "recall"


def covers_any(chunk: HistoryChunk, sorted_sequences: Sequence[int]) -> bool:
    """Whether any of ``sorted_sequences`` lies in the chunk's range (its messages are in view)."""
    i = bisect.bisect_left(sorted_sequences, chunk.first_sequence)
    return i < len(sorted_sequences) and sorted_sequences[i] <= chunk.last_sequence


def excerpt(text: str, wanted: Collection[str], max_chars: int) -> str:
    """``text`` if it fits ``max_chars``; else its header line (``#12 tool c3:``) and the run of
    lines around the one holding most of the ``wanted`` terms, within ``max_chars``. Lines are
    kept whole except a single line longer than the room, which is cut."""
    if len(text) <= max_chars:
        return text
    cut = _excerpt(text, wanted, max_chars)
    # Whatever the shape (a header longer than the room), never more than asked.
    return cut if len(cut) <= max_chars else cut[: max(0, max_chars - 1)] + "…"


def _excerpt(text: str, wanted: Collection[str], max_chars: int) -> str:
    lines = text.splitlines()
    header = ""
    if lines and lines[0].startswith("#") and lines[0].endswith(":"):
        header, lines = lines[0], lines[1:]
    if not lines:
        return text[: max(0, max_chars - 1)] + "…"
    want = set(wanted)
    hits = [len(want.intersection(terms(line))) for line in lines]
    best = max(range(len(lines)), key=lambda i: (hits[i], -i))
    room = max_chars - (len(header) + 1 if header else 0)
    if len(lines[best]) >= room:
        body = lines[best][: max(0, room - 1)] + "…"
        return f"{header}\n{body}" if header else body
    lo = hi = best
    size = len(lines[best])
    while True:
        grown = False
        # Prefer the side whose next line holds more of the terms; then the line after.
        sides = sorted(
            (s for s in (hi + 1, lo - 1) if 0 <= s < len(lines)),
            key=lambda s: (-hits[s], s < best),
        )
        for s in sides:
            if size + len(lines[s]) + 1 <= room:
                size += len(lines[s]) + 1
                lo, hi = min(lo, s), max(hi, s)
                grown = True
                break
        if not grown:
            break
    body = "\n".join(lines[lo : hi + 1])
    return f"{header}\n{body}" if header else body


def recall_record(chunk: HistoryChunk, text: str, score: float) -> Message:
    """The view record of one excerpt (unstored: sequence number 0)."""
    span = (
        f"message #{chunk.first_sequence}"
        if chunk.first_sequence == chunk.last_sequence
        else f"messages #{chunk.first_sequence}-#{chunk.last_sequence}"
    )
    content = f"Recalled from earlier in this conversation ({span}, no longer in the context; may be outdated):\n{text}"
    return Message(
        role=Role.SYSTEM,
        content=content,
        flags=Flags(is_context=False, is_display=False, is_recall=True),
        metadata={
            "source": RECALL_SOURCE,
            "chunk_id": chunk.content_hash,
            "first_sequence": chunk.first_sequence,
            "last_sequence": chunk.last_sequence,
            "score": round(score, 4),
        },
    )
