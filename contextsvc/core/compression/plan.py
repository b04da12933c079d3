"""Compaction planning (DESIGN §5.4): which context rows leave the context and which stay verbatim.

``plan_compaction`` is the one decision point. The dry run (``would_compress``, ``Compress{dry_run}``)
and the real run call it with the same arguments and get the same plan, so a prediction and the
action that follows can never disagree. It is pure and deterministic; ``count`` prices a message
list in tokens and must be monotone (more messages never count fewer tokens).

Vocabulary (over the context buffer in context order, see ``core/turns.py``):

* **protected rows** are kept by every plan, wherever they are: pinned messages with the tool-call
  group they belong to (keeping half a group would orphan the other half), and ``role=system``
  records (the view places them before the conversation; they record what happened, like navi's
  system messages, and are not turns). They count toward the kept part.
* **conversational turns** are the turns that can be "recent": not headed by a summary (a summary
  is already history) and not made only of pinned rows (those are kept anyway).
* the **budget** is ``floor(target * window)`` tokens, measured with ``count`` on the kept rows.

Turn mode (the normal case). The newest ``k`` conversational turns are kept whole, starting at
``k = keep_recent`` and shrinking until the kept part fits the budget; everything older is dropped
except protected rows. The cut is a turn start, which never splits a tool-call group. Then
important old turns may swap with filler recent ones (``importance.py``): the most important first,
each against the oldest unused filler, accepted only if the kept part still fits. The newest turn
is never swapped away; rows keep their context order.

Intra-turn mode, for one long turn (an agent loop: one user message, many tool rounds). Used when
even the newest turn alone does not fit the budget, or, when ``keep_recent_messages`` is given
(mid-turn), when turn mode found nothing to drop. The current request (the newest conversational
turn's user message) is kept, and a tail of that turn: it starts at the latest cut point that keeps
at least ``keep_recent_messages`` messages (a cut point is an assistant message that does not split
a group), and when that leaves nothing older in the turn it is retried with
``midturn_retry_messages`` (2). When the kept part still exceeds the budget, the tail shrinks to
later cut points until it fits or only the newest group (or final answer) is left: a compaction
that leaves the context over its target would re-fire a few messages later. Older turns are
dropped (protected rows kept). ``keep_recent_messages`` defaults to ``mid_turn_keep_messages``.

A plan ``would_compress`` only when it drops something, the drop is more than one lone summary
(re-summarizing a summary alone is no progress), and the kept part counts fewer tokens than
``current_tokens``. A turn-mode plan that would compress always fits the budget; an intra-turn plan
may not (``fits_target``), and the engine's proof-of-progress check decides.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from contextsvc.config import SummarizerSettings
from contextsvc.core.compression.importance import call_names, is_filler, turn_importance
from contextsvc.core.compression.records import covered_range
from contextsvc.core.messages import Message, Role
from contextsvc.core.turns import ContextShape, Turn, analyze

Count = Callable[[Sequence[Message]], int]

_DEFAULTS = SummarizerSettings()


class PlanMode(StrEnum):
    """How a plan partitions the context."""

    NONE = "none"
    TURNS = "turns"
    INTRA_TURN = "intra_turn"
    HARD_TRUNCATE = "hard_truncate"


@dataclass(slots=True, frozen=True)
class CompactionPlan:
    """What a compaction would do.

    ``drop`` are the rows to demote, in context order; ``keep`` the rows that stay, in the order the
    new context has them after the summary. ``keep_from`` is the index (in the planned context) where
    the contiguous kept tail starts; rows before it are kept only when protected or swapped in — the
    cheap stage clears tool results before it. ``budget`` is ``floor(target * window)`` (or
    ``fraction * window`` for hard truncation). ``swapped_in`` / ``swapped_out`` are the sequence
    numbers of the user messages of the turns a swap moved.
    """

    mode: PlanMode
    drop: tuple[Message, ...]
    keep: tuple[Message, ...]
    tokens_before: int
    tokens_kept: int
    budget: int
    turns_kept: int
    keep_from: int
    would_compress: bool
    detail: str = ""
    keep_recent: int = 0
    keep_recent_messages: int | None = None
    swapped_in: tuple[int, ...] = ()
    swapped_out: tuple[int, ...] = ()

    @property
    def fits_target(self) -> bool:
        return self.tokens_kept <= self.budget

    @property
    def drop_sequences(self) -> tuple[int, ...]:
        return tuple(m.sequence_number for m in self.drop)

    @property
    def keep_sequences(self) -> tuple[int, ...]:
        return tuple(m.sequence_number for m in self.keep)

    @property
    def replaced_range(self) -> tuple[int, int] | None:
        """``(first, last)`` original sequence numbers the dropped rows stand for."""
        return covered_range(self.drop)


def mid_turn_keep_messages(keep_recent: int, *, minimum: int = _DEFAULTS.midturn_min_messages) -> int:
    """Messages a mid-turn compaction keeps: ``max(12, 2 * keep_recent)`` (DESIGN §5.4)."""
    return max(minimum, 2 * keep_recent)


def plan_compaction(
    context: Sequence[Message],
    *,
    window: int,
    target: float,
    keep_recent: int,
    count: Count,
    keep_recent_messages: int | None = None,
    current_tokens: int | None = None,
    critical_tool_names: Collection[str] = (),
    settings: SummarizerSettings = _DEFAULTS,
) -> CompactionPlan:
    """Plan a summary compaction of ``context`` (see the module docstring for the rules).

    ``current_tokens`` is the caller's estimate of the context now (default ``count(context)``);
    the dry run must pass the same number as the real run.
    """
    _check(window=window, fraction=target, name="target")
    if keep_recent < 1:
        raise ValueError(f"keep_recent must be at least 1, got {keep_recent}")
    if keep_recent_messages is not None and keep_recent_messages < 1:
        raise ValueError(f"keep_recent_messages must be at least 1, got {keep_recent_messages}")
    lay = _Layout.of(context, critical_tool_names, count, hard=False)
    budget = math.floor(target * window)
    before = current_tokens if current_tokens is not None else lay.count_rows(range(len(context)))
    if not lay.conv:
        return _nothing(lay, PlanMode.NONE, budget, before, _no_turn_detail(context))

    turns = _by_turns(lay, budget, keep_recent, settings.filler_turn_chars)
    if turns is not None:
        plan = _finish(lay, turns, budget, before, asked=keep_recent)
        if plan.would_compress or keep_recent_messages is None:
            return plan
    wanted = keep_recent_messages
    if wanted is None:
        wanted = mid_turn_keep_messages(keep_recent, minimum=settings.midturn_min_messages)
    intra = _by_messages(lay, budget, wanted, settings.midturn_retry_messages)
    return _finish(lay, intra, budget, before)


def plan_hard_truncate(
    context: Sequence[Message],
    *,
    window: int,
    fraction: float,
    count: Count,
    current_tokens: int | None = None,
) -> CompactionPlan:
    """Drop the oldest whole turns until the rest fits ``fraction * window``; no summary is written.

    The last resort when summarizing failed. Dropped, in this order, only as far as needed: rows
    before the first user message, conversational turns oldest first, then older summaries oldest
    first (a summary holds far more history per token than any turn, so it goes last). Always
    kept: the newest conversational turn and everything after it, and protected rows — a kept
    pinned row that is not a user message also keeps its turn's user message, so the result, which
    has no summary to lead it, still starts with a user message. When even that is over the
    budget, everything droppable is dropped and ``fits_target`` is False.
    """
    _check(window=window, fraction=fraction, name="fraction")
    lay = _Layout.of(context, (), count, hard=True)
    budget = math.floor(fraction * window)
    before = current_tokens if current_tokens is not None else lay.count_rows(range(len(context)))
    if not lay.conv:
        return _nothing(lay, PlanMode.NONE, budget, before, _no_turn_detail(context))
    newest = lay.conv[-1]
    preamble = [range(0, lay.turns[0].start if lay.turns else len(context))]
    summaries = [t for t in lay.turns if t.start < newest.start and lay.is_summary_turn(t)]
    units = preamble + [range(t.start, t.end) for t in lay.conv[:-1]] + [range(t.start, t.end) for t in summaries]

    def kept_without(j: int) -> list[int]:
        gone = {i for unit in units[:j] for i in unit} - lay.protected
        return [i for i in range(len(context)) if i not in gone]

    j = _first_fitting(len(units) + 1, lambda j: lay.count_rows(kept_without(j)) <= budget)
    if j is None:
        j = len(units)
    kept = kept_without(j)
    kept_set = set(kept)
    first_kept_turn = next((t.start for t in lay.conv if t.start in kept_set), newest.start)
    cand = _Candidate(PlanMode.HARD_TRUNCATE, kept, lay.count_rows(kept), keep_from=first_kept_turn)
    return _finish(lay, cand, budget, before)


# --- the layout of one context ---------------------------------------------------------------


@dataclass(slots=True)
class _Layout:
    context: Sequence[Message]
    shape: ContextShape
    turns: tuple[Turn, ...]
    conv: list[Turn]
    protected: frozenset[int]
    names: dict[str, str]
    critical: Collection[str]
    count: Count
    _cache: dict[tuple[int, ...], int] = field(default_factory=dict)

    @classmethod
    def of(cls, context: Sequence[Message], critical: Collection[str], count: Count, *, hard: bool) -> _Layout:
        shape = analyze(context)
        protected = protected_rows(context, shape, hard=hard)
        conv = [
            t for t in shape.turns if not context[t.start].flags.is_summary and not all(i in protected for i in t.rows)
        ]
        return cls(context, shape, shape.turns, conv, protected, call_names(context), critical, count)

    def is_summary_turn(self, t: Turn) -> bool:
        return self.context[t.start].flags.is_summary

    def count_rows(self, rows: Iterable[int]) -> int:
        key = tuple(sorted(set(rows)))
        if key not in self._cache:
            self._cache[key] = self.count([self.context[i] for i in key])
        return self._cache[key]

    def kept_with_tail(self, tail_from: int, extra: Iterable[int] = (), excluded: Collection[int] = ()) -> list[int]:
        """Protected rows, ``extra`` rows, and every row from ``tail_from`` on except ``excluded``."""
        keep = {i for i in self.protected if i < tail_from}
        keep.update(extra)
        keep.update(i for i in range(tail_from, len(self.context)) if i not in excluded or i in self.protected)
        return sorted(keep)

    def turn_rows(self, t: Turn) -> list[Message]:
        return [self.context[i] for i in t.rows]


def protected_rows(context: Sequence[Message], shape: ContextShape, *, hard: bool = False) -> frozenset[int]:
    """Indices every plan keeps: records, pinned rows and their tool-call groups.

    With ``hard`` (truncation without a summary), a pinned row's turn also keeps its user message.
    """
    keep: set[int] = set(shape.record_indices)
    for i, m in enumerate(context):
        if not m.flags.is_pinned:
            continue
        keep.add(i)
        group = shape.group_of(i)
        if group is not None:
            keep.add(group.assistant_index)
            keep.update(group.result_indices)
        turn = shape.turn_of(i)
        if hard and turn is not None and turn.user_index is not None:
            keep.add(turn.user_index)
    return frozenset(keep)


# --- candidates ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Candidate:
    mode: PlanMode
    kept: list[int]
    tokens_kept: int
    keep_from: int
    keep_recent: int = 0
    keep_recent_messages: int | None = None
    swapped_in: tuple[int, ...] = ()
    swapped_out: tuple[int, ...] = ()


def _first_fitting(n: int, fits: Callable[[int], bool]) -> int | None:
    """The smallest ``j`` in ``range(n)`` with ``fits(j)``, for a ``fits`` monotone in ``j``; None if none."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo if lo < n else None


def _by_turns(lay: _Layout, budget: int, keep_recent: int, filler_chars: int) -> _Candidate | None:
    """Keep the newest k whole turns, k shrinking from ``keep_recent``; None if even one does not fit."""
    conv = lay.conv
    most = min(keep_recent, len(conv))
    # j = most - k: searching the smallest j finds the largest k that fits.
    j = _first_fitting(most, lambda j: lay.count_rows(lay.kept_with_tail(conv[-(most - j)].start)) <= budget)
    if j is None:
        return None
    k = most - j
    tail_from = conv[-k].start
    extra: set[int] = set()
    excluded: set[int] = set()
    swapped_in: list[int] = []
    swapped_out: list[int] = []
    fillers = [
        t for t in conv[-k:-1] if is_filler(lay.turn_rows(t), lay.names, lay.critical, filler_chars)
    ]  # never the newest turn; oldest first
    # The older turns are scored only when a filler could make room for one (a few hundred turns).
    scored = [(turn_importance(lay.turn_rows(t), lay.names, lay.critical), t) for t in conv[:-k]] if fillers else []
    important = [t for s, t in sorted(scored, key=lambda st: (-st[0], -st[1].start)) if s > 0]
    for t in important:
        if not fillers:
            break
        filler = fillers[0]
        trial_extra = extra | set(range(t.start, t.end))
        trial_excluded = excluded | set(range(filler.start, filler.end))
        if lay.count_rows(lay.kept_with_tail(tail_from, trial_extra, trial_excluded)) <= budget:
            extra, excluded = trial_extra, trial_excluded
            swapped_in.append(lay.context[t.start].sequence_number)
            swapped_out.append(lay.context[filler.start].sequence_number)
            fillers.pop(0)
    kept = lay.kept_with_tail(tail_from, extra, excluded)
    return _Candidate(
        PlanMode.TURNS,
        kept,
        lay.count_rows(kept),
        keep_from=tail_from,
        keep_recent=k,
        swapped_in=tuple(sorted(swapped_in)),
        swapped_out=tuple(sorted(swapped_out)),
    )


def _by_messages(lay: _Layout, budget: int, wanted: int, retry: int) -> _Candidate:
    """Keep the current request and the newest messages of its turn (module docstring)."""
    context, shape = lay.context, lay.shape
    n = len(context)
    request = lay.conv[-1].start
    # Non-system rows from i to the end: the "messages" a tail keeps.
    after = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        after[i] = after[i + 1] + (context[i].role is not Role.SYSTEM)
    cuts = [
        i for i in range(request + 1, n) if context[i].role in (Role.ASSISTANT, Role.USER) and not shape.splits_group(i)
    ]

    def tail_for(keep: int) -> int:
        """The latest cut keeping at least ``keep`` messages; the whole turn if none does."""
        return max((i for i in cuts if after[i] >= keep), default=request + 1)

    def drops_in_turn(tail_from: int) -> bool:
        return any(i not in lay.protected for i in range(request + 1, tail_from))

    used = wanted
    tail_from = tail_for(wanted)
    if not drops_in_turn(tail_from) and retry < wanted:
        used, tail_from = retry, tail_for(retry)
    options = [tail_from] + [i for i in cuts if i > tail_from]
    k = _first_fitting(len(options), lambda k: lay.count_rows(lay.kept_with_tail(options[k], (request,))) <= budget)
    tail_from = options[k if k is not None else -1]
    kept = lay.kept_with_tail(tail_from, (request,))
    return _Candidate(PlanMode.INTRA_TURN, kept, lay.count_rows(kept), keep_from=tail_from, keep_recent_messages=used)


# --- the plan --------------------------------------------------------------------------------


def _finish(lay: _Layout, cand: _Candidate, budget: int, before: int, *, asked: int = 0) -> CompactionPlan:
    context = lay.context
    kept_set = set(cand.kept)
    drop = tuple(m for i, m in enumerate(context) if i not in kept_set)
    keep = tuple(context[i] for i in cand.kept)
    # Replacing one summary by a summary of itself is no progress; dropping it outright (hard
    # truncation) is.
    lone_summary = cand.mode is not PlanMode.HARD_TRUNCATE and len(drop) == 1 and drop[0].flags.is_summary
    would = bool(drop) and not lone_summary and cand.tokens_kept < before
    detail = ""
    if not drop:
        detail = _keep_all_detail(lay, cand, asked)
    elif lone_summary:
        detail = "only the existing summary could be dropped; summarizing it again would not shrink the context"
    elif not would:
        detail = (
            f"dropping {len(drop)} message(s) would not shrink the context "
            f"({cand.tokens_kept} tokens kept, {before} now)"
        )
    elif cand.tokens_kept > budget:
        detail = f"the kept part ({cand.tokens_kept} tokens) stays over the budget of {budget} tokens"
    turns_kept = sum(1 for t in lay.conv if all(i in kept_set for i in t.rows))
    return CompactionPlan(
        mode=cand.mode,
        drop=drop,
        keep=keep,
        tokens_before=before,
        tokens_kept=cand.tokens_kept,
        budget=budget,
        turns_kept=turns_kept,
        keep_from=cand.keep_from,
        would_compress=would,
        detail=detail,
        keep_recent=cand.keep_recent,
        keep_recent_messages=cand.keep_recent_messages,
        swapped_in=cand.swapped_in,
        swapped_out=cand.swapped_out,
    )


def _nothing(lay: _Layout, mode: PlanMode, budget: int, before: int, detail: str) -> CompactionPlan:
    kept = list(range(len(lay.context)))
    return CompactionPlan(
        mode=mode,
        drop=(),
        keep=tuple(lay.context),
        tokens_before=before,
        tokens_kept=lay.count_rows(kept),
        budget=budget,
        turns_kept=0,
        keep_from=0,
        would_compress=False,
        detail=detail,
    )


def _keep_all_detail(lay: _Layout, cand: _Candidate, asked: int) -> str:
    pinned = sum(1 for m in lay.context if m.flags.is_pinned)
    pins = f", {pinned} pinned" if pinned else ""
    what = f"all {len(lay.context)} context message(s) must stay ({len(lay.conv)} turn(s){pins}"
    if cand.mode is PlanMode.TURNS:
        return f"nothing to compress: {what}, keep_recent={asked})"
    if cand.mode is PlanMode.INTRA_TURN:
        return f"nothing to compress: {what}; the current turn cannot be cut without splitting a tool-call group)"
    return f"nothing to drop: {what}; the newest turn is always kept)"


def _no_turn_detail(context: Sequence[Message]) -> str:
    if not context:
        return "nothing to compress: the context is empty"
    return "nothing to compress: the context holds no user turn (only summaries, records or pinned messages)"


def _check(*, window: int, fraction: float, name: str) -> None:
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    if not 0 < fraction <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {fraction}")
