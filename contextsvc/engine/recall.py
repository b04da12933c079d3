"""Recall into the view (issue 14 item 7; the raw-history-index behaviour of DESIGN §5.6).

On a BuildContext whose incoming message is the user's, the session's compacted history (the raw
history index) is searched with that message, and up to ``recall.max_excerpts`` excerpts are
added to the view as ``is_recall`` system records, after the system prompt and the stored records
and before the conversation (a system row inside the conversation is illegal, ``core/legal.py``):

- only chunks no longer in view (no sequence number of theirs is in the view), once each, at most
  one per source message range, each containing at least ``recall.min_score`` of the message's
  search terms (``core.recall.term_coverage``) and at least one distinctive one (found in at most
  ``recall.distinctive_share`` of the session's chunks, or in one), best BM25 first;
- within ``min(recall.max_tokens, recall.window_fraction x window)`` tokens and what the view's
  estimate leaves under ``window - reserve`` (the margin's share may be used, as the size guard
  allows): recall never makes a view too large and never triggers a compression (it is added
  after the size decision);
- priced as the estimate's own ``recall`` segment, with a notice, and reported as
  ``injected_chunk_ids``.

A layer on the assembled view: the base view (``Assembled``) is never changed, only copied, so the
view memo and the wire cache keep serving it; the recalled records are unstored rows encoded fresh.
Nothing is stored either: the excerpts of a turn are a function of its message and the index, so a
retried build of the same turn gets the same excerpts, never a second set, and the next turn's view
no longer carries them. A search failure never fails a build (no recall, logged).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Sequence

from contextsvc.config import Settings
from contextsvc.core.messages import Message, Role
from contextsvc.core.profile import EffectiveProfile
from contextsvc.core.recall import query_terms, term_coverage
from contextsvc.core.recall_view import covers_any, excerpt, recall_record
from contextsvc.core.session import SessionInfo
from contextsvc.core.tokens import messages_chars
from contextsvc.core.view import Segment
from contextsvc.engine.accounting import TokenAccounting
from contextsvc.engine.state import EngineState
from contextsvc.engine.views import Assembled, ViewMessage, stored_sequences
from contextsvc.ports import ScoredChunk, SessionStore

log = logging.getLogger(__name__)

_Count = Callable[[Iterable[Message]], int]

#: below this many tokens of room an excerpt says too little to be worth a record.
_MIN_EXCERPT_TOKENS = 24


class RecallService:
    def __init__(self, *, store: SessionStore, settings: Settings, accounting: TokenAccounting):
        self._store = store
        self._settings = settings
        self._accounting = accounting

    def budget(self, profile: EffectiveProfile, built: Assembled) -> int:
        """Tokens the excerpts of this view may take (0: none).

        The room is what the *estimate* leaves under ``window - reserve``, as for the size guard
        (a turn fails only when the estimate does not fit; a margin is doubt). Measured against
        estimate + margin there was no room at all late in a compaction cycle, when the trigger
        (``window - reserve`` on small windows) lets estimate + margin come right up to it: the
        held-out fact set recalled nothing. The view's notice says when its margin is over."""
        cfg = profile.recall
        room = built.estimate.budget - built.estimate.total
        return max(0, min(cfg.max_tokens, int(cfg.window_fraction * profile.context_window), room))

    async def add_to_view(
        self, session: SessionInfo, profile: EffectiveProfile, built: Assembled, incoming: Message | None
    ) -> tuple[Assembled, tuple[str, ...]]:
        """``built`` with recalled excerpts (a copy), and their chunk ids; ``built`` itself when none."""
        cfg = profile.recall
        if not cfg.enabled or cfg.max_excerpts <= 0 or incoming is None or incoming.role is not Role.USER:
            return built, ()
        # Nothing was ever compacted: no history to recall (and no search on a young session's builds).
        if EngineState.of(session).epoch <= 0:
            return built, ()
        wanted = query_terms(incoming.content)
        budget = self.budget(profile, built)
        if not wanted or budget < _MIN_EXCERPT_TOKENS:
            return built, ()
        try:
            found = await self._store.search_history(
                session.id, incoming.content, limit=self._settings.search.recall_candidates
            )
        except Exception:
            log.warning(
                "recall search failed; view built without recall", extra={"session_id": session.id}, exc_info=True
            )
            return built, ()
        chosen = self._choose(found, wanted, built, profile)
        if not chosen:
            return built, ()
        return self._with_records(profile, built, chosen, wanted, budget)

    @staticmethod
    def _choose(
        found: Sequence[ScoredChunk], wanted: list[str], built: Assembled, profile: EffectiveProfile
    ) -> list[ScoredChunk]:
        cfg = profile.recall
        in_view = built.sequences if built.sequences is not None else stored_sequences(built.rows)
        chosen: list[ScoredChunk] = []
        for hit in found:
            c = hit.chunk
            if covers_any(c, in_view) or term_coverage(wanted, c, hit.terms) < cfg.min_score:
                continue
            if hit.chunk_count and hit.rarest_df > max(1.0, cfg.distinctive_share * hit.chunk_count):
                continue
            # One excerpt per source range: two windows of one long output would say the same.
            if any(
                c.first_sequence <= o.chunk.last_sequence and o.chunk.first_sequence <= c.last_sequence for o in chosen
            ):
                continue
            chosen.append(hit)
            if len(chosen) >= cfg.max_excerpts:
                break
        return chosen

    def _with_records(
        self,
        profile: EffectiveProfile,
        built: Assembled,
        chosen: list[ScoredChunk],
        wanted: list[str],
        budget: int,
    ) -> tuple[Assembled, tuple[str, ...]]:
        counter = self._accounting.counter(profile.model)
        rate = counter.margin_rate
        records: list[Message] = []
        used = 0
        for i, hit in enumerate(chosen):
            # An even share of what is left, so a long first excerpt cannot starve the second.
            share = (budget - used) // (len(chosen) - i)
            record = self._fitting(hit, wanted, share, counter.count_messages, rate)
            if record is None:
                continue
            records.append(record)
            used += _cost(counter.count_messages([record]), rate)
        if not records:
            return built, ()
        tokens = counter.count_messages(records)
        est = built.estimate
        estimate = dataclasses.replace(
            est,
            total=est.total + tokens,
            text=est.text + tokens,
            fraction=(est.total + tokens) / est.window if est.window > 0 else 0.0,
            segments=dataclasses.replace(est.segments, recall=tokens),
            margin=est.margin + math.ceil(rate * tokens),
        )
        # After the system prompt and the stored records, before the conversation: a system row
        # inside the conversation is illegal (core/legal.py), and providers take system content first.
        at = next(
            (i for i, seg in enumerate(built.segments) if seg not in (Segment.SYSTEM, Segment.RECORDS)),
            len(built.rows),
        )
        rows = [*built.rows[:at], *records, *built.rows[at:]]
        ids = tuple(str(r.metadata["chunk_id"]) for r in records)
        spans = ", ".join(
            f"#{r.metadata['first_sequence']}"
            + (
                f"-#{r.metadata['last_sequence']}"
                if r.metadata["last_sequence"] != r.metadata["first_sequence"]
                else ""
            )
            for r in records
        )
        notice = (
            f"recalled {len(records)} excerpt{'s' if len(records) > 1 else ''} of compacted history "
            f"({tokens} tokens, messages {spans}) as is_recall records before the conversation"
        )
        plain = None
        if built.plain is not None:
            added = [ViewMessage(message=r, image_data=(), truncated=False) for r in records]
            plain = [*built.plain[:at], *added, *built.plain[at:]]
        return (
            dataclasses.replace(
                built,
                rows=rows,
                segments=[*built.segments[:at], *([Segment.RECALL] * len(records)), *built.segments[at:]],
                truncated=[*built.truncated[:at], *([False] * len(records)), *built.truncated[at:]],
                estimate=estimate,
                notices=[*built.notices, notice],
                chars=messages_chars(rows),
                plain=plain,
                extends=None,  # records sit inside the conversation: no longer an extension
            ),
            ids,
        )

    @staticmethod
    def _fitting(hit: ScoredChunk, wanted: list[str], share: int, count: _Count, rate: float) -> Message | None:
        """The record of ``hit`` cut to fit ``share`` tokens (margin included), or None."""
        if share < _MIN_EXCERPT_TOKENS:
            return None
        chars = len(hit.chunk.text)
        for _ in range(4):
            record = recall_record(hit.chunk, excerpt(hit.chunk.text, wanted, chars), hit.score)
            cost = _cost(count([record]), rate)
            if cost <= share:
                return record
            # Shrink in proportion to the overshoot (a little more, the header costs too).
            chars = int(min(chars, len(record.content)) * share / cost * 0.9)
            if chars < 40:
                return None
        return None


def _cost(tokens: int, rate: float) -> int:
    return tokens + math.ceil(rate * tokens)
