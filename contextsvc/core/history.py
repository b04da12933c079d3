"""Chunks of the raw history index: verbatim text of messages compression removed from the context."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime


@dataclass(slots=True, frozen=True)
class HistoryChunk:
    """Verbatim text of messages compression removed from the context (the raw history index)."""

    content_hash: str
    text: str
    first_sequence: int
    last_sequence: int
    start_time: datetime | None
    end_time: datetime | None
    breadcrumbs: tuple[str, ...] = ()


@dataclass(slots=True, frozen=True)
class ScoredChunk:
    chunk: HistoryChunk
    score: float
    #: in how many of the session's chunks the rarest query term this chunk matched occurs, and how
    #: many chunks the session has: recall takes only chunks matched on a distinctive term.
    rarest_df: int = 0
    chunk_count: int = 0
    #: the chunk's search terms when the store has them at hand (``core.recall.document_terms``,
    #: distinct), so recall's coverage check does not find them again; None: not known.
    terms: Collection[str] | None = field(default=None, compare=False)
