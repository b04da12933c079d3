"""Compaction use cases: decide (triggers, hysteresis, loop guard), plan, summarize, commit.

Every path — pre-turn, mid-turn, post-turn, forced — goes through ``Compactor.run``, so a
summarizer failure is never fatal anywhere: retry once with a wider keep window, then
hard-truncate without a summarizer. The plan comes from the one planning function
(``core.compression.plan``), shared with dry runs so prediction and action never disagree.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from contextsvc import telemetry
from contextsvc.config import COMPACTION_STRATEGIES, Settings
from contextsvc.core.breadcrumbs import extract_breadcrumbs, merge_breadcrumbs, shared_extraction
from contextsvc.core.chunking import pieces
from contextsvc.core.compression.cheap import ClearedToolResults, clear_old_tool_results, is_placeholder
from contextsvc.core.compression.formatting import (
    META_SUMMARY_PROMPT,
    cut_summary_text,
    format_for_summary,
    format_meta_summary_input,
    is_refusal,
    needs_meta_summary,
    summary_instructions,
    summary_parts,
)
from contextsvc.core.compression.plan import CompactionPlan, mid_turn_keep_messages, plan_compaction, plan_hard_truncate
from contextsvc.core.compression.records import compression_record, demoted_ranges, summary_message
from contextsvc.core.facts import fact_lines, facts_block
from contextsvc.core.history import HistoryChunk
from contextsvc.core.messages import Message, Role
from contextsvc.core.profile import EffectiveProfile
from contextsvc.core.session import Principal, SessionInfo
from contextsvc.core.tokens import CalibratedCounter, TextCounter, each_message_features, image_tokens_of
from contextsvc.core.view_budget import additive, budget_images, column_max, none_cut, truncate_for_view
from contextsvc.engine.accounting import TokenAccounting
from contextsvc.engine.state import EngineState
from contextsvc.errors import Conflict, ContextError, NothingToCompact, SessionDamaged
from contextsvc.ports import (
    CutSummary,
    EventBus,
    SessionStore,
    StoredEvent,
    SummarizerError,
    Summarizers,
    SummarizerUnavailable,
    SummaryRequest,
)

log = logging.getLogger(__name__)

Count = Callable[[Sequence[Message]], int]

#: Compaction strategies a profile may list, tried in the profile's order (their names' home is config).
STRATEGIES = COMPACTION_STRATEGIES
STRATEGY_CLEAR, STRATEGY_SUMMARIZE = STRATEGIES

#: Summary metadata: the exact runs of original sequence numbers the summary stands for. Its
#: ``replaces`` range also spans rows the compaction kept (pinned rows, the current request of a
#: long turn, an important turn swapped in), which ExpandSummary must not return.
REPLACED_RANGES_KEY = "replaced_ranges"

# Engine-state keys (kept in the session's opaque state mapping).
_LAST_AFTER = "last_compaction_tokens"
_FLUSH_EPOCH = "memory_flush_epoch"


#: Within one compaction (``_shared_shown``): each row as the view shows it, per counter and view
#: rules. A compaction plans more than once (the plan, a wider one, the clearing, the checks of
#: progress), each over the same rows: ~5 passes of ``truncate_for_view`` over a 500-row context.
_SHOWN: ContextVar[dict[tuple[int, int, bool, int], tuple[object, dict[int, tuple[Message, Message]]]] | None] = (
    ContextVar("contextsvc_shown_rows", default=None)
)


@contextlib.contextmanager
def _shared_shown() -> Iterator[None]:
    """Rows are cut for the view once per counter within this block (``Compactor.counter``); what
    is remembered lives as long as the block, so it is bounded by the rows one compaction reads."""
    token = _SHOWN.set({})
    try:
        yield
    finally:
        _SHOWN.reset(token)


def _shown_cache(text: TextCounter, budget: int, vision: bool, window: int) -> dict[int, tuple[Message, Message]]:
    """The rows shown by ``text`` under these view rules so far in this compaction (a new dict
    outside one). Keyed by the calibration a counter prices with (each call of ``counter`` makes a
    new counter of the cached calibration), held with it: a refit during the compaction (a
    baseline recorded while the summarizer runs) is another calibration, and cuts anew."""
    shared = _SHOWN.get()
    if shared is None:
        return {}
    prices = text.calibration if isinstance(text, CalibratedCounter) else text
    key = (id(prices), budget, vision, window)
    entry = shared.get(key)
    if entry is None or entry[0] is not prices:
        entry = shared[key] = (prices, {})
    return entry[1]


class Reason(StrEnum):
    PRETURN = "preturn"
    MIDTURN = "midturn"
    POSTTURN = "postturn"
    FORCED = "forced"


class Method(StrEnum):
    SUMMARY = "summary"
    HARD_TRUNCATE = "hard_truncate"
    CLEAR_TOOL_RESULTS = "clear_tool_results"


class Refusal(StrEnum):
    """Why a compaction announced with ``compression_started`` committed nothing; the engine
    publishes it as ``compression_refused`` so every started compaction has a closing event."""

    CONFLICT = "conflict"
    NO_PROGRESS = "no_progress"
    FAILED = "failed"


@dataclass(slots=True, frozen=True)
class Stage:
    """One stage of a committed compaction: what it did and what it removed (view tokens)."""

    method: Method
    messages_removed: int
    messages_added: int
    tokens_before: int
    tokens_after: int

    def payload(self) -> dict[str, Any]:
        return {
            "method": self.method.value,
            "messages_removed": self.messages_removed,
            "messages_added": self.messages_added,
            "tokens_before": self.tokens_before,
            "tokens_after": self.tokens_after,
        }


@dataclass(slots=True, frozen=True)
class CompressionReport:
    compressed: bool
    reason: Reason
    method: Method | None = None
    summary: str = ""
    messages_before: int = 0
    messages_after: int = 0
    context_tokens_before: int = 0
    context_tokens_after: int = 0
    breadcrumbs: tuple[str, ...] = ()
    plan: CompactionPlan | None = None
    #: every stage that ran, in order (``method`` is the last one's); empty when not compressed
    #: (a dry run: the clearing stage the run would commit, when it would).
    stages: tuple[Stage, ...] = ()
    #: set when a compaction was carried out but committed nothing.
    refused: Refusal | None = None


@dataclass(slots=True, frozen=True)
class Bounds:
    """The levels of automatic compaction, in view tokens (see ``Compactor.bounds``).

    ``trigger``: it fires at or above this. ``goal``: the planner aims the view at this.
    ``limit``: the most an automatic compaction may leave (``target x window``, proof of progress).
    """

    trigger: float
    goal: float
    limit: float

    @property
    def band(self) -> float:
        """Growth below which an automatic re-run is refused (loop guard). A compaction that got
        to ``limit`` or below can never be refused: the next trigger lies this far above it."""
        return self.trigger - self.limit


@runtime_checkable
class CompressionLog(Protocol):
    """The compression events of a bus that keeps them where every replica reads them
    (``stores.postgres.bus.PostgresEventBus``): what ``Compactor.close_abandoned`` asks."""

    async def open_compressions(self, *, started_before: datetime, limit: int) -> list[StoredEvent]: ...

    async def newest_compression(self, session_id: str) -> StoredEvent | None: ...

    async def publish_close(
        self, started: StoredEvent, *, kind: str, payload: Mapping[str, Any]
    ) -> StoredEvent | None: ...

    async def start_closed(self, started: StoredEvent) -> bool: ...


@dataclass(slots=True, frozen=True)
class _Truncation:
    """What a hard truncation commits (``Compactor._truncation_outcome``)."""

    demote: list[Message]
    placeholders: list[Message]
    kept: list[Message]
    cut: CompactionPlan
    stages: list[Stage]


class CompactionBusy(Exception):
    """The session's compaction lock was not free within the bound a caller gave."""


@dataclass(slots=True)
class Situation:
    """What a compaction decision is made on: the context and the numbers of the view around it.

    ``fixed_tokens`` are the view's tokens outside the context buffer (system prompt, incoming
    message); ``view_tokens`` the view's whole estimate, the number triggers compare.
    """

    session: SessionInfo
    profile: EffectiveProfile
    context: list[Message]
    view_tokens: int
    fixed_tokens: int
    reason: Reason
    mid_turn: bool = False
    note: str = ""
    #: the estimate's margin (TokenEstimate.margin): the trigger compares view_tokens + margin.
    margin: int = 0
    state: EngineState = field(init=False)
    #: margin per token of the context priced whole (``Compactor.margin_rate``), computed once.
    rate: float | None = field(default=None, init=False)
    #: the view's tokens with its context priced whole (``Compactor.priced_before``), computed once.
    priced: int | None = field(default=None, init=False)
    #: the session's context tokens when ``context`` was read with it (at one moment): kept when
    #: ``session`` is read again later, so a commit keeps what appends added since that read.
    tokens_read: int = field(default=0, init=False)
    #: the compaction's closing event went out (``context_compressed``): a run cancelled after
    #: its commit landed must not close it a second time, as ``refused``.
    closed: bool = field(default=False, init=False)
    #: the compaction's ``compression_started`` event, once published (what its close names).
    started: StoredEvent | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.state = EngineState.of(self.session)
        self.tokens_read = self.session.context_tokens


def summarizer_budget(settings: Settings, name: str) -> float | None:
    """How long one compaction's calls of summarizer ``name`` may take together: its
    ``total_timeout_seconds`` (None: a summarizer without one, the extractive one, runs in-process)."""
    section = getattr(settings.summarizer, name, None)
    budget = getattr(section, "total_timeout_seconds", None)
    return float(budget) if budget is not None else None


class Compactor:
    def __init__(
        self,
        *,
        store: SessionStore,
        bus: EventBus,
        settings: Settings,
        accounting: TokenAccounting,
        summarizers: Summarizers,
    ):
        self._store = store
        self._bus = bus
        self._settings = settings
        self._accounting = accounting
        self._summarizers = summarizers
        #: the compression events every replica reads (PostgreSQL's bus), when there is such a
        #: log, asked directly: the engine's own bus may be a wrapper (telemetry) or a stand-in (a
        #: start before the store answered) without these queries. With it, a compaction closes a
        #: start its session's last compaction left open (``_run``), and ``close_abandoned`` runs.
        self.compression_log: CompressionLog | None = None
        # session id -> [lock, holders and waiters]
        self._locks: dict[str, list[Any]] = {}
        #: the last profile ``bounds`` was asked about (by identity: resolved profiles are shared
        #: objects) and its bounds; a turn asks about its session's profile three times.
        self._last_bounds: tuple[EffectiveProfile, Bounds] | None = None

    # -- locking ----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lock(self, session_id: str, *, wait: float | None = None) -> AsyncIterator[None]:
        """One compaction (or state read-modify-write) per session at a time: an in-process lock,
        then the store's cross-process lock. The in-process entry lives only while someone holds
        or waits for it, so the map never grows with the number of sessions ever seen.

        ``wait`` bounds the time spent acquiring both locks (``CompactionBusy`` past it); what runs
        under the lock is not bounded by it."""
        entry = self._lock_entry(session_id)
        try:
            store_lock = self._store.compaction_lock(session_id)
            if entry[1] == 1 and isinstance(store_lock, contextlib.nullcontext) and not entry[0].locked():
                # Nobody else holds or waits for the session's lock and the store's is a no-op:
                # taken without suspending, so no timer and no exit stack (a baseline's anchor
                # takes this path on every turn).
                await entry[0].acquire()
                try:
                    yield
                finally:
                    entry[0].release()
                return
            async with contextlib.AsyncExitStack() as held:
                try:
                    async with asyncio.timeout(wait):
                        await held.enter_async_context(entry[0])
                        await held.enter_async_context(store_lock)
                except TimeoutError:
                    raise CompactionBusy(f"session {session_id} is compacting; waited {wait:g} s") from None
                yield
        finally:
            self._lock_left(session_id, entry)

    def local_lock(self, session_id: str) -> _LocalLock:
        """The in-process half of ``lock`` alone: for a state write whose store call checks the
        cross-process half itself (``update_state_if_unchanged``)."""
        return _LocalLock(self, session_id)

    def _lock_entry(self, session_id: str) -> list[Any]:
        """The session's in-process lock and its count of holders and waiters, counting one more."""
        entry = self._locks.get(session_id)
        if entry is None:
            entry = self._locks[session_id] = [asyncio.Lock(), 0]
        entry[1] += 1
        return entry

    def _lock_left(self, session_id: str, entry: list[Any]) -> None:
        entry[1] -= 1
        if entry[1] == 0 and self._locks.get(session_id) is entry:
            del self._locks[session_id]

    # -- pricing ------------------------------------------------------------------------------

    def counter(self, profile: EffectiveProfile) -> Count:
        """Tokens of rows as the view shows them, so the planner decides on what the model would
        be sent, not on raw stored sizes: each row cut to the per-message budget, and images
        priced as the view does. Without vision the view carries none (only a notice naming
        them): pricing every stored image made such a session look thousands of tokens larger
        than its view, so it over-compacted and its loop guard refused what it needed. With
        vision every image is priced: the view fits the newest images into ``0.8 x window`` minus
        the text, and a compacted context frees room for more of them, so the full price is the
        bound that keeps the compacted view under its goal (and keeps ``count`` monotone)."""
        text = self._accounting.counter(profile.model)
        budget = profile.per_message_budget
        fallback = self._settings.tokens.image_tokens_fallback
        cache = _shown_cache(text, budget, profile.vision, profile.context_window)

        def shown(m: Message) -> Message:
            key = id(m)
            got = cache.get(key)
            if got is None:
                cut = truncate_for_view(m, budget, text)
                if cut.images and not profile.vision:
                    # The view's copy: no images, a notice naming them (per message, so additive).
                    cut = budget_images([cut], window=profile.context_window, text_tokens=0, vision=False).messages[0]
                got = cache[key] = (m, cut)  # ``m`` held: its id names no other row while cached
            return got[1]

        def seed(rows: Sequence[Message]) -> None:
            # The rows not shown yet that the view keeps as they are, told at once: the first
            # count of a compaction cut every row of the context alone (~10 µs a row). When the
            # largest of their features fit one message's budget none is cut (``none_cut``);
            # else each is priced from its features, and only those over it are cut one by one.
            if not isinstance(text, CalibratedCounter):
                return
            fresh = [m for m in rows if not m.images and id(m) not in cache]
            if len(fresh) < 2:
                return
            each = each_message_features(fresh)
            cuttable = [f for m, f in zip(fresh, each, strict=True) if not m.flags.is_pinned]  # (pinned: never cut)
            if not (additive(text) and none_cut(text, column_max(cuttable), budget)):
                price = text.count_features
                fresh = [m for m, f in zip(fresh, each, strict=True) if m.flags.is_pinned or price(f) <= budget]
            for m in fresh:
                cache[id(m)] = (m, m)

        def count(rows: Sequence[Message]) -> int:
            seed(rows)
            # Sizes summed first and rounded once, as the view's estimate does: rounding each row
            # drifted from the estimate by up to half a token per row on long contexts.
            cut = [shown(m) for m in rows]
            return text.count_messages(cut) + image_tokens_of(cut, fallback_tokens=fallback)

        return count

    # -- decisions ----------------------------------------------------------------------------

    def bounds(self, p: EffectiveProfile) -> Bounds:
        """Where automatic compaction fires, where it aims, and the most it may leave, on the
        view's estimate + margin (what triggers and guards compare, DESIGN §5.3).

        Normally ``threshold x window``, ``target x window`` and ``target x window``. On a small
        window the reply reserve (up to window / 4) puts the size guard (``window - reserve``)
        below the threshold: with 8192 tokens and the default reserve, 6144 fit but the trigger
        sat at 7373, so a growing session hit CONTEXT_TOO_LARGE without ever being compressed.
        The trigger is then the size guard's budget, and the planner aims lower by as much, so a
        compaction still leaves ``(threshold - target) x window`` of growth before the next one
        (never below the hard-truncate level). What it must reach stays ``target x window``: one
        long turn whose newest tool group cannot shrink may land between the two, which beats a
        hard truncation that would leave it over the budget.
        """
        last = self._last_bounds
        if last is not None and last[0] is p:
            return last[1]
        c = p.compression
        window = p.context_window
        trigger = c.threshold * window
        limit = goal = c.target * window
        budget = window - p.output_reserve
        if budget < trigger:
            floor = min(goal, self._settings.summarizer.hard_truncate_fraction * window)
            trigger, goal = budget, max(goal - (trigger - budget), floor)
            # Automatic runs must reach the lower aim too, or the next trigger would come back
            # after less than (threshold - target) x window of growth: the hysteresis band holds.
            limit = goal
        bounds = Bounds(trigger=trigger, goal=goal, limit=limit)
        self._last_bounds = (p, bounds)
        return bounds

    def far_below(self, p: EffectiveProfile, context_tokens: int) -> bool:
        """A session whose recorded context size (``context_tokens``: its last real count plus
        what was appended since, or what its last compaction left) is so far under every level
        automatic compaction and the memory flush fire at that its view's estimate and margin
        cannot reach them: ``hot_path.post_turn_headroom`` times that size and the system prompt
        (a token per character: no vocabulary counts more; the factor covers its framing) stays
        under both the trigger and the lowest level the soft threshold can take (``limit``)."""
        headroom = self._settings.hot_path.post_turn_headroom
        if headroom <= 0:
            return False
        b = self.bounds(p)
        return headroom * (max(0, context_tokens) + len(p.system_prompt)) < min(b.trigger, b.limit)

    def aim(self, s: Situation) -> Bounds:
        """``bounds`` with the goal and the limit on the estimate alone, as the planner and the
        proof of progress need them: lower by the margin the compacted view will carry.

        A compaction clears the baseline, so the view after it is priced whole and its margin is
        ``margin_rate`` of it (a calibrated model's 2-3%, a cold one's 15-30%, more for content of
        a class it has never seen). Where the trigger is the threshold, the aim is ``goal / (1 +
        rate)``, never below the hard-truncate level (a summary aimed under it would lose to plain
        truncation): estimate + margin starts at the goal, and a crossing of the threshold that
        only the margin makes waits for a band of growth (``over_threshold``).

        Where the trigger is the size guard's budget, a crossing of it by estimate + margin is
        always honoured (``over_threshold``: served, the real count could pass ``window -
        reserve``). So that it still comes only after a hysteresis band of growth of the
        *estimate*, the aim is a whole band below the estimate at which estimate + margin reaches
        the budget: ``budget / (1 + rate) - band``. It may be under the hard-truncate level (on
        8,192 with the default 2,048 reserve, ``budget - band`` *is* that level, so any margin
        puts it under); the hard truncation then goes as low (``_truncation_level``), or its
        fallback would leave a view that re-fires at once. Never under ``min_kept_fraction x
        window``. A crossing of the budget inside the band then comes only when the compaction
        before it ended above its aim, or when the view's margin is a larger share of it than the
        rate that compaction aimed for (new content of a class priced with a wide margin): the
        only two exemptions from the band besides forced runs (docs/calibration.md), which the
        compression bench counts apart."""
        b = self.bounds(s.profile)
        rate = 1 + self.margin_rate(s)
        window = s.profile.context_window
        floor = min(b.goal, self._settings.summarizer.hard_truncate_fraction * window)
        if self.budget_triggered(s.profile):
            lowest = self._settings.summarizer.min_kept_fraction * window
            goal = min(max(b.trigger / rate - b.band, lowest), max(b.goal / rate, floor))
            return Bounds(trigger=b.trigger, goal=goal, limit=goal)
        return Bounds(trigger=b.trigger, goal=max(b.goal / rate, floor), limit=max(b.limit / rate, floor))

    @staticmethod
    def budget_triggered(p: EffectiveProfile) -> bool:
        """The trigger is the size guard's budget: the reply reserve puts ``window - reserve``
        under ``threshold x window`` (``bounds``)."""
        return p.context_window - p.output_reserve < p.compression.threshold * p.context_window

    def _truncation_level(self, s: Situation) -> float:
        """The view tokens a hard truncation cuts to: the hard-truncate level, or on a
        budget-triggered window the aim where that is lower (``aim``)."""
        level = self._settings.summarizer.hard_truncate_fraction * s.profile.context_window
        return min(level, self.aim(s).limit) if self.budget_triggered(s.profile) else level

    def margin_rate(self, s: Situation) -> float:
        """Margin per token of the session's context priced whole, as the view after a compaction
        is priced (no baseline): each content class with its own relative margin, so a Russian
        session aims lower than a code session. Computed once per situation."""
        if s.rate is None:
            counter = self._accounting.counter(s.profile.model)
            tokens, margin = counter.count_and_margin(s.context)
            s.rate = max(0.0, margin / tokens if tokens > 0 else counter.margin_rate)
        return s.rate

    def priced_before(self, s: Situation) -> int:
        """The view's tokens before the compaction with its context priced whole, as the context it
        leaves is (``count`` of the rows plus the fixed tokens): what the report, its stages and the
        ``context_compressed`` event give as ``context_tokens_before``, so before and after compare.
        ``view_tokens`` (what the trigger compared) may be anchored on a baseline: a real count
        plus a priced delta, which a fresh price of the same rows can be hundreds of tokens off."""
        if s.priced is None:
            s.priced = self.counter(s.profile)(s.context) + s.fixed_tokens
        return s.priced

    def busy(self, session_id: str) -> bool:
        """A compaction (or a state write) of the session is running in this process."""
        entry = self._locks.get(session_id)
        return entry is not None and entry[0].locked()

    def fallback_context(self, s: Situation) -> list[Message]:
        """The context a hard truncation would keep, computed without committing anything: what a
        build serves when it may not wait for a running compaction (its summarizer call)."""
        level = self._truncation_level(s) - s.fixed_tokens
        cut = self._truncation(s, level)
        if cut.tokens_kept > level:
            inner = self._inner_truncation(s, level)
            if inner.would_compress and inner.tokens_kept < cut.tokens_kept:
                cut = inner
        return list(cut.keep) if cut.would_compress else list(s.context)

    def over_threshold(self, s: Situation) -> bool:
        """Estimate + margin at or over the trigger. A crossing that only the margin makes is
        honoured once the context grew a hysteresis band since the last compaction: the margin is
        doubt about the estimate, and it must not make compactions re-fire inside the band.
        A crossing of the size guard's budget is always honoured: served, the view's real count
        could pass ``window - reserve`` (issue #14's soak: by up to the margin, inside the band).
        ``aim`` puts such a crossing a band of estimate growth after the last compaction, except
        when that compaction ended above its aim or the view's margin is a larger share of it than
        the rate it aimed for (the band's two exemptions, docs/calibration.md)."""
        b = self.bounds(s.profile)
        if s.view_tokens >= b.trigger:
            return True
        if s.view_tokens + s.margin < b.trigger:
            return False
        if self._at_budget(s):
            return True
        last_after = s.state.extra.get(_LAST_AFTER)
        return last_after is None or s.view_tokens - int(last_after) >= b.band

    @staticmethod
    def _at_budget(s: Situation) -> bool:
        """Estimate + margin at or over the size guard's budget (``window - reserve``)."""
        return s.view_tokens + s.margin >= s.profile.context_window - s.profile.output_reserve

    def _flush_due(self, s: Situation, state: EngineState) -> bool:
        """The memory flush is due once per cycle, when the view grows past the soft threshold.

        The soft threshold is ``trigger - memory_flush_soft_tokens`` but never below the level a
        compaction may leave: on a small window (8192: 7373 - 4000 = 3373 < 5324) the context right
        after a compaction is already past it, and the "warning" would come right after every
        compaction instead of before the next one.
        """
        c = s.profile.compression
        b = self.bounds(s.profile)
        # The trigger compares estimate + margin: the warning comes that much earlier too, or a wide
        # margin (a cold model's) would compact before the flush it is meant to follow.
        soft = max(b.trigger - self._settings.summarizer.memory_flush_soft_tokens - s.margin, b.limit)
        return c.enabled and s.view_tokens > soft and state.extra.get(_FLUSH_EPOCH) != state.epoch

    async def maybe_memory_flush(self, s: Situation, *, wait: float | None = None) -> None:
        """Once per compaction cycle, warn watchers that a compaction is near (DESIGN §5.4).
        With ``wait``, gives up after that long behind a running compaction (due again next time)."""
        if not self._flush_due(s, s.state):
            return
        try:
            await self._memory_flush(s, wait)
        except CompactionBusy:
            return

    async def _memory_flush(self, s: Situation, wait: float | None) -> None:
        # Decide again on the session as it is now, under the compaction lock: concurrent builds
        # would each flush (and each write back a stale state, undoing a compaction that committed
        # meanwhile: its epoch, its cleared baseline).
        async with self.lock(s.session.id, wait=wait):
            fresh = EngineState.of(await self._store.get_session(s.session.id, caller=_SYSTEM))
            if fresh.epoch != s.state.epoch or not self._flush_due(s, fresh):
                return
            state = dataclasses.replace(fresh, extra={**fresh.extra, _FLUSH_EPOCH: fresh.epoch})
            await self._store.update_state(s.session.id, caller=_SYSTEM, state=state.to_dict())
            s.state = state
            await self._bus.publish(
                session_id=s.session.id,
                user_id=s.session.user_id,
                kind="memory_flush_due",
                payload={
                    "context_tokens": s.view_tokens,
                    "threshold_tokens": int(self.bounds(s.profile).trigger),
                    "margin": s.margin,
                },
            )

    def loop_guarded(self, s: Situation) -> bool:
        """True when an automatic compaction would re-fire inside the hysteresis band.

        Only forced runs are exempt (DESIGN §5.4); a post-turn check answering a truncated prompt
        is automatic and guarded like any other (the flag stays set until a compaction runs). A
        run the threshold triggered is refused only when the last compaction left more than
        ``limit``: on a small window the trigger is the size guard's budget, so refusing it after
        a compaction that met its target would leave the session to fail with CONTEXT_TOO_LARGE.
        A run the truncation flag triggered (under the threshold, no budget pressure) must see the
        whole ``trigger - goal`` of growth.
        """
        last_after = s.state.extra.get(_LAST_AFTER)
        if last_after is None or s.reason is Reason.FORCED:
            return False
        if self._at_budget(s):
            # Refusing would fail the turn with CONTEXT_TOO_LARGE, or serve a view whose real count
            # may pass the budget: another compaction, down to its hard-truncation fallback, is
            # always better than that (issue #14's soak). Inside the band this happens only in the
            # two cases ``aim`` leaves open (``over_threshold``).
            return False
        b = self.bounds(s.profile)
        band = b.band if self.over_threshold(s) else b.trigger - b.goal
        return s.view_tokens - int(last_after) < band

    # -- planning -----------------------------------------------------------------------------

    def plan(self, s: Situation, *, keep_recent: int | None = None, keep_messages: int | None = None) -> CompactionPlan:
        p = s.profile
        c = p.compression
        count = self.counter(p)
        keep = keep_recent or c.keep_recent
        if keep_messages is None and s.mid_turn:
            keep_messages = mid_turn_keep_messages(keep, minimum=self._settings.summarizer.midturn_min_messages)
        return plan_compaction(
            s.context,
            window=p.context_window,
            target=self._kept_target(s),
            keep_recent=keep,
            count=count,
            keep_recent_messages=keep_messages,
            current_tokens=count(s.context),
            critical_tool_names=c.critical_tool_names,
            settings=self._settings.summarizer,
        )

    def _summary_reserve(self, p: EffectiveProfile) -> int:
        return min(
            p.compression.summary_max_tokens, int(self._settings.summarizer.summary_window_fraction * p.context_window)
        )

    def _kept_target(self, s: Situation) -> float:
        """The share of the window the kept rows may use, so that kept + summary + prompt <= goal."""
        p = s.profile
        room = self.aim(s).goal - s.fixed_tokens - self._summary_reserve(p)
        return max(self._settings.summarizer.min_kept_fraction, room / p.context_window)

    # -- running ------------------------------------------------------------------------------

    async def run(self, s: Situation, *, dry_run: bool = False) -> CompressionReport:
        """Plan and (unless ``dry_run``) carry out a compaction. Forced runs raise
        ``NothingToCompact`` when nothing can be removed; automatic ones report ``compressed=False``."""
        # One extraction of each row's entities for the summary, the breadcrumbs and the index.
        with telemetry.compaction_span(s.session.id, s.reason.value), shared_extraction(), _shared_shown():
            report = await self._run(s, dry_run=dry_run)
            telemetry.compaction_done(report)
            return report

    async def _run(self, s: Situation, *, dry_run: bool) -> CompressionReport:
        plan = self.plan(s)
        if dry_run:
            return self._predicted(s, plan)
        if not plan.would_compress:
            if s.reason is Reason.FORCED:
                raise NothingToCompact(
                    plan.detail or "nothing to compact: the context holds only what must be kept",
                    metadata={"context_messages": str(len(s.context)), "context_tokens": str(plan.tokens_before)},
                )
            return CompressionReport(compressed=False, reason=s.reason, plan=plan)
        await self._close_left_open(s.session.id)
        s.started = await self._publish(
            s,
            "compression_started",
            {
                "reason": s.reason.value,
                "context_tokens": s.view_tokens,
                "max_context_tokens": s.profile.context_window,
                "plan": plan_payload(plan),
            },
        )
        # Every compression_started gets exactly one closing event: context_compressed from the
        # commit, or compression_refused saying why nothing was committed (issue #8).
        try:
            report = await self._carry_out(s, plan)
        except BaseException as exc:
            if not s.closed:
                detail = f"compaction stopped: {type(exc).__name__}"
                await self._close_refused(s, Refusal.FAILED, detail)
            raise
        if not report.compressed:
            refusal = report.refused or Refusal.NO_PROGRESS
            await self._close_refused(s, refusal, _REFUSAL_DETAIL[refusal])
            return dataclasses.replace(report, refused=refusal)
        return report

    async def _carry_out(self, s: Situation, plan: CompactionPlan) -> CompressionReport:
        # The profile's strategies in their order; the first that commits wins. Hard truncation is
        # the fallback of every order (unless the profile says ``hard_truncate_fallback = false``),
        # so a summarizer failure never fails the caller's turn. Clearing that fell short of the
        # target is not thrown away when hard truncation follows: truncation starts from the
        # cleared context, and the report names both stages.
        cleared: ClearedToolResults | None = None
        for strategy in s.profile.compression.strategies:
            if strategy == STRATEGY_CLEAR:
                report, cleared = await self._cheap_stage(s, plan)
            elif strategy == STRATEGY_SUMMARIZE:
                report = await self._summarize(s, plan)
            else:  # rejected when the profile is resolved (Engine._profile_for); never reached
                report = None
            if report is not None:
                return report
        if not s.profile.compression.hard_truncate_fallback:
            if cleared is not None and cleared.cleared and cleared.tokens_after < cleared.tokens_before:
                return await self._commit_clearing(s, plan, cleared)
            return CompressionReport(compressed=False, reason=s.reason, plan=plan, refused=Refusal.NO_PROGRESS)
        return await self._hard_truncate(s, plan, cleared=cleared)

    def _predicted(self, s: Situation, plan: CompactionPlan) -> CompressionReport:
        """A dry run's report: the plan, and what the run would commit first where that is known
        without a summarizer (DESIGN §5.4: prediction and action never disagree). The profile's
        strategies are walked as ``_carry_out`` walks them: clearing that reaches its target is
        the outcome, with its counts and stage; a summary depends on the summarizer's answer, so
        the method names it and the plan stands for the rest; past both, hard truncation (no
        method when the profile turned that fallback off). Nothing is written or published."""
        report = CompressionReport(compressed=False, reason=s.reason, plan=plan)
        if not plan.would_compress:
            return report
        before = self.priced_before(s)
        report = dataclasses.replace(report, messages_before=len(s.context), context_tokens_before=before)

        def clearing(cleared: ClearedToolResults) -> CompressionReport:
            after = self.counter(s.profile)(cleared.context) + s.fixed_tokens
            removed, added = len(cleared.demote), len(cleared.placeholders)
            return dataclasses.replace(
                report,
                method=Method.CLEAR_TOOL_RESULTS,
                messages_after=len(cleared.context),
                context_tokens_after=after,
                stages=(Stage(Method.CLEAR_TOOL_RESULTS, removed, added, before, after),),
            )

        cleared: ClearedToolResults | None = None
        for strategy in s.profile.compression.strategies:
            if strategy == STRATEGY_CLEAR:
                cleared = self._clearing(s, plan)
                if self._clearing_suffices(s, cleared):
                    return clearing(cleared)
            elif strategy == STRATEGY_SUMMARIZE:
                return dataclasses.replace(report, method=Method.SUMMARY)
        if not s.profile.compression.hard_truncate_fallback:
            # ``_carry_out`` commits a clearing that shrank the context short of its target.
            if cleared is not None and cleared.cleared and cleared.tokens_after < cleared.tokens_before:
                return clearing(cleared)
            return report
        # What ``_hard_truncate`` commits, from the same plan (after the clearing, when one ran).
        outcome = self._truncation_outcome(s, plan, cleared)
        if outcome is None:
            return report
        if isinstance(outcome, ClearedToolResults):
            return clearing(outcome)
        after = self.counter(s.profile)(outcome.kept) + s.fixed_tokens
        stages = [*outcome.stages[:-1], dataclasses.replace(outcome.stages[-1], tokens_after=after)]
        return dataclasses.replace(
            report,
            method=Method.HARD_TRUNCATE,
            plan=outcome.cut,
            messages_after=len(outcome.kept),
            context_tokens_after=after,
            stages=tuple(stages),
        )

    def _clearing_suffices(self, s: Situation, cleared: ClearedToolResults) -> bool:
        """Clearing alone reaches the target (else a summary, or hard truncation, follows it)."""
        return bool(cleared.cleared) and cleared.tokens_after <= self._clearing_goal(s)

    async def _close_refused(self, s: Situation, refusal: Refusal, detail: str) -> None:
        await self._publish_close(
            s, "compression_refused", {"reason": refusal.value, "trigger": s.reason.value, "detail": detail}
        )

    def _clearing_goal(self, s: Situation) -> int:
        """The context tokens clearing aims at: the aim. A forced run whose profile does not
        summarize, on a context already under the aim, aims at the shrink a forced run must make
        (aiming at the aim, it cleared nothing and fell to a hard truncation, or did nothing); with
        a summarizer to follow, a forced run still summarizes."""
        goal = self.aim(s).goal
        if s.reason is Reason.FORCED and STRATEGY_SUMMARIZE not in s.profile.compression.strategies:
            goal = min(goal, self._progress_limit(s))
        return int(goal) - s.fixed_tokens

    def _clearing(self, s: Situation, plan: CompactionPlan) -> ClearedToolResults:
        c = s.profile.compression
        count = self.counter(s.profile)
        goal = self._clearing_goal(s)
        return clear_old_tool_results(
            s.context,
            plan.keep_from,
            count=count,
            critical_tool_names=c.critical_tool_names,
            target_tokens=goal,
            current_tokens=count(s.context),
        )

    async def _cheap_stage(
        self, s: Situation, plan: CompactionPlan
    ) -> tuple[CompressionReport | None, ClearedToolResults]:
        """Commit the clearing when it reaches the target; else hand back what it would clear."""
        cleared = self._clearing(s, plan)
        if not self._clearing_suffices(s, cleared):
            return None, cleared  # clearing alone does not reach the target: summarize instead
        return await self._commit_clearing(s, plan, cleared), cleared

    async def _commit_clearing(
        self, s: Situation, plan: CompactionPlan, cleared: ClearedToolResults
    ) -> CompressionReport:
        return await self._commit(
            s,
            method=Method.CLEAR_TOOL_RESULTS,
            demote=list(cleared.demote),
            new_rows=list(cleared.placeholders),
            new_context=list(cleared.context),
            summary="",
            breadcrumbs=[],
            plan=plan,
        )

    async def _summarize(self, s: Situation, plan: CompactionPlan) -> CompressionReport | None:
        """Summarize; on failure retry once with a wider keep window. None when both failed, or
        when the summarizer gave no answer at all (``SummarizerUnavailable``): its whole call is
        already bounded by its own timeouts, and a second call at once would wait as long again.

        Every summarizer call of the compaction (a merge of earlier summaries, the summary, and
        both again for the wider window) shares one budget, the summarizer's
        ``total_timeout_seconds``: a summarizer that hangs holds the session's compaction lock that
        long, not four times that, so ``postgres.compaction_lock_timeout_seconds`` can be checked
        against it at start (``Settings._lock_outlasts_summaries``)."""
        c = s.profile.compression
        budget = summarizer_budget(self._settings, c.summarizer)
        deadline = None if budget is None else asyncio.get_running_loop().time() + budget
        try:
            report = await self._try_summary(s, plan, deadline)
            if report is not None:
                return report
            if deadline is not None and asyncio.get_running_loop().time() >= deadline:
                return None
            # Planned only now: the first attempt commits in nearly every compaction, and a plan
            # prices the whole context again.
            wider = self.plan(
                s,
                keep_recent=c.keep_recent * 2,
                keep_messages=(plan.keep_recent_messages * 2) if plan.keep_recent_messages else None,
            )
            if wider.would_compress and wider.drop_sequences != plan.drop_sequences:
                return await self._try_summary(s, wider, deadline)
        except SummarizerUnavailable:
            return None
        return None

    async def _ask(self, summarizer: Any, request: SummaryRequest, deadline: float | None) -> Any:
        """One summarizer call, within the compaction's budget (``_summarize``)."""
        try:
            async with asyncio.timeout_at(deadline):
                return await summarizer.summarize(request)
        except TimeoutError:
            raise SummarizerError(
                f"{summarizer.name}: the compaction's summarizer calls used their whole budget "
                f"(summarizer.{summarizer.name}.total_timeout_seconds)"
            ) from None

    async def _try_summary(
        self, s: Situation, plan: CompactionPlan, deadline: float | None = None
    ) -> CompressionReport | None:
        p = s.profile
        c = p.compression
        count = self.counter(p)
        try:
            summarizer = self._summarizers.get(c.summarizer)
            merged = await self._meta_summary(s, plan, summarizer, deadline)
            appendix = block = ""
            if summarizer.name != "extractive":
                # A model summary must not drop the concrete details silently: it gets the same fact
                # lines the extractive summarizer keeps, and is asked to carry them. They count
                # within the input cap (the formatting makes room for them).
                cfg = self._settings.summarizer.extractive
                block = facts_block(fact_lines(plan.drop, max_facts=cfg.max_facts, fact_chars=cfg.fact_chars))
                if block:
                    appendix = "\n\nKeep these facts in the summary, verbatim where you can:\n" + block
            formatted = format_for_summary(
                plan.drop,
                window=p.context_window,
                vision=summarizer.vision,
                critical_tool_names=c.critical_tool_names,
                merged_summary=merged,
                settings=self._settings.summarizer,
                image_fallback_tokens=self._settings.tokens.image_tokens_fallback,
                appendix=appendix,
            )
            images = [await self._store.get_blob(b) or b"" for b in formatted.image_blob_ids]
            raw = await self._ask(
                summarizer,
                SummaryRequest(
                    session_id=s.session.id,
                    messages=plan.drop,
                    text=formatted.text,
                    instructions=summary_instructions(c.summary_prompt),
                    max_tokens=self._summary_reserve(p),
                    temperature=self._settings.summarizer.temperature,
                    images=[i for i in images if i],
                ),
                deadline,
            )
        except SummarizerError as exc:
            log.warning(
                "summarizer failed; falling back",
                extra={"session_id": s.session.id, "summarizer": c.summarizer, "error": str(exc)},
            )
            if isinstance(exc, SummarizerUnavailable):
                raise  # no wider retry (``_summarize``)
            return None
        text, keys = summary_parts(raw)
        if not text:
            log.warning("summarizer returned an empty summary", extra={"session_id": s.session.id})
            return None
        if is_refusal(text, keys):
            # "I'm sorry, but I can't help with that." is no summary: stored, it would stand for
            # every dropped turn in each later view. The fallback runs instead.
            log.warning(
                "summarizer refused; falling back",
                extra={"session_id": s.session.id, "summarizer": c.summarizer, "answer": text[:200]},
            )
            return None
        if isinstance(raw, CutSummary):
            # The output cap cut the answer before its end, where the facts it was asked to carry
            # and its KEYS line go: stored as it came, they would be gone from every later view.
            # The cut text is kept, marked, and the facts sent with it are added back (their
            # breadcrumbs come from the dropped rows either way).
            log.warning(
                "summary cut at the summarizer's output limit; its facts are added back",
                extra={"session_id": s.session.id, "summarizer": c.summarizer},
            )
            text = cut_summary_text(text, block)
        reserve = self._summary_reserve(p)
        tokens = self._text_tokens(p, text)
        # (One larger than what it replaces is no summary at all: discarded below, as before.)
        if reserve * self._settings.summarizer.summary_overrun_factor < tokens < count(plan.drop):
            # The summarizer ignored the output cap it was sent (``max_tokens``): stored whole, the
            # summary takes room the plan kept for recent turns, and every later view cuts its
            # middle at the per-message budget. It is cut to the cap as the cap would have cut it,
            # and the facts sent with it are added back.
            log.warning(
                "summary longer than the output cap it was sent; cut to it, its facts added back",
                extra={"session_id": s.session.id, "summarizer": c.summarizer, "max_tokens": reserve},
            )
            text = self._cut_to(p, text, block, reserve)
        crumbs = self._breadcrumbs(keys, plan.drop)
        summary = summary_message(
            text,
            dropped=plan.drop,
            kept=plan.keep,
            breadcrumbs=crumbs,
            metadata={REPLACED_RANGES_KEY: demoted_ranges(replaced_originals(plan.drop))},
        )
        # Proof of progress: a summary larger than what it replaces is discarded. It is priced
        # whole: the view would cut an oversized summary to the per-message budget, and that cut
        # copy must not pass for a summary that fits (it would lose its middle on every build).
        summary_tokens = self._accounting.message_tokens(p.model, summary)
        if summary_tokens >= count(plan.drop):
            log.warning("summary larger than what it replaces; discarded", extra={"session_id": s.session.id})
            return None
        kept, demote, placeholders = list(plan.keep), list(plan.drop), []
        stages = None
        if not self._progress(s, summary_tokens + count(kept)):
            # The kept part alone can be over the aim (one long turn: its newest messages and their
            # tool results). The summary is good: its oldest kept results are cleared as hard
            # truncation's last resort clears them, rather than the summary, and every older turn
            # with it, being thrown away for a truncation.
            room = self._progress_limit(s) - s.fixed_tokens - summary_tokens
            clearing = self._clear_kept(s, kept, room)
            if clearing.cleared:
                before = self.priced_before(s)
                summarized = summary_tokens + count(kept) + s.fixed_tokens
                stages = [
                    Stage(Method.SUMMARY, len(demote), 1, before, summarized),
                    Stage(Method.CLEAR_TOOL_RESULTS, len(clearing.demote), len(clearing.placeholders), summarized, 0),
                ]
                kept, placeholders = list(clearing.context), list(clearing.placeholders)
                demote += clearing.demote
            if not self._progress(s, summary_tokens + count(kept)):
                log.warning("summary did not reach the target; discarded", extra={"session_id": s.session.id})
                return None
        return await self._commit(
            s,
            method=Method.SUMMARY,
            demote=demote,
            new_rows=[summary, *placeholders],
            new_context=[summary, *kept],
            summary=text,
            breadcrumbs=crumbs,
            plan=plan,
            stages=stages,
        )

    def _text_tokens(self, p: EffectiveProfile, text: str) -> int:
        return self._accounting.message_tokens(p.model, Message(role=Role.USER, content=text))

    def _cut_to(self, p: EffectiveProfile, text: str, facts: str, tokens: int) -> str:
        """``cut_summary_text`` of the longest head of ``text`` (ended at a line break where one is
        near) that fits in ``tokens``; the facts alone when no head does."""
        # The first head length that no longer fits (longer heads price no lower), less one.
        over = bisect.bisect_left(
            range(len(text) + 1), True, key=lambda n: self._text_tokens(p, cut_summary_text(text[:n], facts)) > tokens
        )
        head = text[: max(0, over - 1)]
        line_end = head.rfind("\n")
        if line_end >= 0.8 * len(head):
            head = head[:line_end]
        return cut_summary_text(head, facts)

    async def _meta_summary(
        self, s: Situation, plan: CompactionPlan, summarizer: Any, deadline: float | None = None
    ) -> str | None:
        """Several old summaries past the threshold are merged into one first."""
        old = [m for m in plan.drop if m.flags.is_summary]
        if len(old) < 2 or not needs_meta_summary(old, self._settings.summarizer.meta_summary_chars):
            return None
        text = format_meta_summary_input(old, settings=self._settings.summarizer)
        # The merge prompt, not the conversation prompt: its input is summaries, not turns.
        answer: str = await self._ask(
            summarizer,
            SummaryRequest(
                session_id=s.session.id,
                messages=old,
                text=text,
                instructions=META_SUMMARY_PROMPT,
                max_tokens=self._summary_reserve(s.profile),
                temperature=self._settings.summarizer.temperature,
            ),
            deadline,
        )
        merged, keys = summary_parts(answer)
        if not merged or is_refusal(merged, keys):
            raise SummarizerError(f"{summarizer.name}: the merge of earlier summaries came back empty or refused")
        return merged if not keys else f"{merged}\nKEYS: {'; '.join(keys)}"

    async def _hard_truncate(
        self, s: Situation, plan: CompactionPlan, *, cleared: ClearedToolResults | None = None
    ) -> CompressionReport:
        outcome = self._truncation_outcome(s, plan, cleared)
        if outcome is None:
            # The planner found rows to summarize but nothing can be dropped: keep the context.
            return CompressionReport(compressed=False, reason=s.reason, plan=plan, refused=Refusal.NO_PROGRESS)
        if isinstance(outcome, ClearedToolResults):
            # Nothing more can be dropped, but the clearing itself shrank the context.
            return await self._commit_clearing(s, plan, outcome)
        return await self._commit(
            s,
            method=Method.HARD_TRUNCATE,
            demote=outcome.demote,
            new_rows=outcome.placeholders,
            new_context=outcome.kept,
            summary="",
            breadcrumbs=self._breadcrumbs([], outcome.demote),
            plan=outcome.cut,
            stages=outcome.stages,
        )

    def _truncation_outcome(
        self, s: Situation, plan: CompactionPlan, cleared: ClearedToolResults | None
    ) -> _Truncation | ClearedToolResults | None:
        """What a hard truncation of ``s`` commits (after ``cleared``, a clearing that fell short of
        its target, when there was one): the rows it demotes and appends and the context it keeps;
        ``cleared`` alone when nothing more can be dropped; None when nothing can be. Pure: a dry
        run reports the same (``_predicted``)."""
        p = s.profile
        first: list[Stage] = []
        original = s
        if cleared is not None and cleared.cleared and cleared.tokens_after < cleared.tokens_before:
            # Clearing ran and fell short: truncate the cleared context. Placeholders are rows to
            # be appended; the originals they stand for are demoted whatever truncation keeps.
            after_clearing = cleared.tokens_after + s.fixed_tokens
            first = [
                Stage(
                    Method.CLEAR_TOOL_RESULTS,
                    messages_removed=len(cleared.demote),
                    messages_added=len(cleared.placeholders),
                    tokens_before=self.priced_before(s),
                    tokens_after=after_clearing,
                )
            ]
            s = dataclasses.replace(s, context=list(cleared.context), view_tokens=after_clearing)
            s.state = original.state
        # The whole view (system prompt and incoming message included) must come down to the
        # hard-truncate level (or the aim, where lower), not only the context buffer. Decided on
        # the original situation: its margin rate is the context's before any clearing.
        level = self._truncation_level(original) - s.fixed_tokens
        cut = self._truncation(s, level)
        if cut.tokens_kept > level:
            # Whole turns are not enough: the context is one long turn (an autonomous tool loop).
            # Drop the older messages of that turn too — the planner keeps the request, the newest
            # messages and every tool group whole — still without a summarizer.
            inner = self._inner_truncation(s, level)
            if inner.would_compress and inner.tokens_kept < cut.tokens_kept:
                cut = inner
        if not cut.would_compress:
            # Already under that level (a forced run, or a silently truncated prompt, on a small
            # context): drop the oldest whole turns down to what the plan would have kept, so a
            # compaction that was announced (CompressionStarted) is carried out, not dropped silently.
            cut = self._truncation(s, plan.tokens_kept)
        demote, placeholders, kept = list(cut.drop), [], list(cut.keep)
        count = self.counter(p)
        if count(kept) > level:
            # The newest tool group alone is over the level (many parallel results): as a last
            # resort clear the oldest results that are still kept, placeholders keeping every call
            # answered. The originals stay in the display history and go to the history index.
            # Its own name: ``cleared`` still holds the first stage, whose placeholders are
            # unsaved rows the commit below must never hand the store as rows to demote.
            last_resort = self._clear_kept(s, kept, level)
            if last_resort.cleared:
                demote += last_resort.demote
                placeholders = list(last_resort.placeholders)
                kept = list(last_resort.context)
        if not demote or count(kept) >= count(s.context):
            return cleared if first and cleared is not None else None
        truncation = Stage(
            Method.HARD_TRUNCATE,
            messages_removed=len(demote),
            messages_added=len(placeholders),
            # after a clearing stage: where it ended (priced whole); else the view priced whole
            tokens_before=s.view_tokens if first else self.priced_before(original),
            tokens_after=count(kept) + s.fixed_tokens,
        )
        if first:
            assert cleared is not None
            # Unsaved placeholders that truncation dropped are simply not appended; those it kept
            # are appended (with the last resort's, if any), and only stored rows are demoted.
            fresh = {id(m) for m in cleared.placeholders}
            placeholders = [m for m in kept if id(m) in fresh] + placeholders
            demote = list(cleared.demote) + [m for m in demote if id(m) not in fresh]
        # The store demotes rows it holds: a row without a sequence number is never one of them.
        assert all(m.sequence_number > 0 for m in demote), "compaction would demote an unsaved row"
        return _Truncation(demote=demote, placeholders=placeholders, kept=kept, cut=cut, stages=[*first, truncation])

    def _clear_kept(self, s: Situation, kept: Sequence[Message], target: float) -> ClearedToolResults:
        """The oldest tool results of ``kept`` (the rows a compaction keeps) cleared until it fits
        ``target`` tokens, or all of them: placeholders keep every call answered, and the originals
        stay in the display history and go to the history index."""
        count = self.counter(s.profile)
        return clear_old_tool_results(
            kept,
            len(kept),
            count=count,
            critical_tool_names=s.profile.compression.critical_tool_names,
            target_tokens=int(target),
            current_tokens=count(kept),
        )

    def _inner_truncation(self, s: Situation, context_tokens: float) -> CompactionPlan:
        """The intra-turn partition with the fewest kept messages, used as a truncation."""
        window = s.profile.context_window
        count = self.counter(s.profile)
        return plan_compaction(
            s.context,
            window=window,
            target=min(1.0, max(context_tokens, 1) / window),
            keep_recent=1,
            count=count,
            keep_recent_messages=self._settings.summarizer.midturn_retry_messages,
            current_tokens=count(s.context),
            critical_tool_names=s.profile.compression.critical_tool_names,
            settings=self._settings.summarizer,
        )

    def _truncation(self, s: Situation, context_tokens: float) -> CompactionPlan:
        """Drop the oldest whole turns until the context fits ``context_tokens`` (no summary)."""
        window = s.profile.context_window
        count = self.counter(s.profile)
        return plan_hard_truncate(
            s.context,
            window=window,
            fraction=min(1.0, max(context_tokens, 1) / window),
            count=count,
            current_tokens=count(s.context),
        )

    def _progress(self, s: Situation, new_context_tokens: int) -> bool:
        """Automatic runs must reach the target; forced ones must shrink by the configured share."""
        return new_context_tokens + s.fixed_tokens <= self._progress_limit(s)

    def _progress_limit(self, s: Situation) -> float:
        """The most view tokens a compaction may leave (``_progress``)."""
        if s.reason is Reason.FORCED:
            before = self.priced_before(s)  # priced as the view after it is
            return before * (1 - self._settings.summarizer.forced_min_shrink)
        return self.aim(s).limit

    def _breadcrumbs(self, keys: Sequence[str], dropped: Sequence[Message]) -> list[str]:
        cfg = self._settings.summarizer
        # Entities of the newly dropped turns first: those carried by older summaries already had
        # their turn, and would otherwise fill every slot compaction after compaction.
        fresh = [m for m in dropped if not m.flags.is_summary]
        carried = [m for m in dropped if m.flags.is_summary]
        extracted = extract_breadcrumbs(
            [*fresh, *carried],
            limit=cfg.breadcrumb_limit,
            max_chars=cfg.breadcrumb_max_chars,
            scan_chars=cfg.breadcrumb_scan_chars,
        )
        return merge_breadcrumbs(keys, extracted, cfg.breadcrumb_limit, max_chars=cfg.breadcrumb_max_chars)

    async def _commit(self, s: Situation, **commit: Any) -> CompressionReport:
        """``_commit_now``, which a cancellation does not cut short: the store's write is shielded
        from its caller, so a compaction cancelled mid-commit (a Compress whose deadline passed, a
        drain) still lands. It waits for that write and its closing event, so watchers hear
        ``context_compressed`` rather than ``refused`` for a committed compaction, then goes on
        being cancelled."""
        landing = asyncio.ensure_future(self._commit_now(s, **commit))
        try:
            return await asyncio.shield(landing)
        except asyncio.CancelledError:
            while not landing.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(landing)
            if not landing.cancelled() and (exc := landing.exception()) is not None:
                # the caller gets its cancellation; ``_run`` closes the start as failed
                log.warning("a cancelled compaction's commit failed", extra={"session_id": s.session.id}, exc_info=exc)
            raise

    async def _commit_now(
        self,
        s: Situation,
        *,
        method: Method,
        demote: list[Message],
        new_rows: list[Message],
        new_context: list[Message],
        summary: str,
        breadcrumbs: list[str],
        plan: CompactionPlan,
        stages: list[Stage] | None = None,
    ) -> CompressionReport:
        count = self.counter(s.profile)
        tokens_after = count(new_context) + s.fixed_tokens
        before = self.priced_before(s)
        if stages is None:
            stages = [Stage(method, len(demote), len(new_rows), before, tokens_after)]
        else:
            # The last stage ends where the commit ends (the same count the report states).
            stages[-1] = dataclasses.replace(stages[-1], tokens_after=tokens_after)
        record = compression_record(
            method=method.value,
            reason=s.reason.value,
            demoted=demote,
            summary=summary,
            breadcrumbs=breadcrumbs,
            tokens_before=before,
            tokens_after=tokens_after,
            messages_before=len(s.context),
            messages_after=len(new_context),
            note=s.note,
        )
        state = s.state.after_compaction()
        state = dataclasses.replace(state, extra={**state.extra, _LAST_AFTER: tokens_after})
        if await self._start_closed(s):
            log.warning(
                "compaction not committed: another replica closed its start as abandoned (its lock was lost)",
                extra={"session_id": s.session.id, "reason": s.reason.value},
            )
            return CompressionReport(compressed=False, reason=s.reason, plan=plan, refused=Refusal.CONFLICT)
        try:
            seqs = await self._store.commit_compaction(
                s.session.id,
                caller=_SYSTEM,
                demote=[m.sequence_number for m in demote],
                append=[*new_rows, record],
                context_tokens=tokens_after,
                state=state.to_dict(),
                # Appends take no compaction lock: those committed since the context was read
                # stay in the context, and so in its count.
                context_tokens_as_of=s.tokens_read,
                # In the same step as the demotion, never after it: a process that dies right
                # after the commit must not leave what it took out of the context unsearchable.
                history=self.history_chunks(demote),
            )
        except (Conflict, SessionDamaged) as exc:
            # A damaged session is read-only (issue #9): no compaction, the view is still built.
            # Someone else compacted first: the compaction lock was lost (a PostgreSQL restart
            # ends the connection holding it) and another replica committed on the same context.
            # The store changed nothing; the context is already compacted, and this turn goes on.
            log.warning(
                "compaction not committed: another compaction got there first",
                extra={
                    "session_id": s.session.id,
                    "reason": s.reason.value,
                    "error_reason": exc.reason,
                    "error": exc.message,
                },
            )
            return CompressionReport(compressed=False, reason=s.reason, plan=plan, refused=Refusal.CONFLICT)
        if s.session.context_truncated:
            try:
                await self._store.update_state(s.session.id, caller=_SYSTEM, context_truncated=False)
            except ContextError as exc:
                # The commit landed: it is announced and reported whatever becomes of this flag
                # (left set, it only makes the next post-turn check look again).
                log.warning(
                    "compaction committed; its session's truncation flag could not be cleared",
                    extra={"session_id": s.session.id, "error_reason": exc.reason, "error": exc.message},
                )
        summary_seq = seqs[0] if method is Method.SUMMARY and seqs else 0
        report = CompressionReport(
            compressed=True,
            reason=s.reason,
            method=method,
            summary=summary,
            messages_before=len(s.context),
            messages_after=len(new_context),
            context_tokens_before=before,
            context_tokens_after=tokens_after,
            breadcrumbs=tuple(breadcrumbs),
            plan=plan,
            stages=tuple(stages),
        )
        s.closed = True
        await self._publish_close(
            s,
            "context_compressed",
            {
                "reason": s.reason.value,
                "method": method.value,
                "summary": summary,
                "messages_before": report.messages_before,
                "messages_after": report.messages_after,
                "context_tokens_before": report.context_tokens_before,
                "context_tokens_after": report.context_tokens_after,
                # Both priced whole. The trigger compared estimate_tokens (the view's estimate,
                # anchored on a baseline when there was one) + margin (the estimate's doubt).
                "estimate_tokens": s.view_tokens,
                "margin": s.margin,
                # Where the automatic runs aimed the estimate (``aim``) and the margin rate it assumed
                # for the compacted view: what the hysteresis band's exemptions are judged on.
                "aim_tokens": int(self.aim(s).goal),
                "margin_rate": self.margin_rate(s),
                "max_context_tokens": s.profile.context_window,
                "breadcrumbs": list(breadcrumbs),
                "summary_sequence": summary_seq,
                "stages": [stage.payload() for stage in stages],
            },
        )
        log.info(
            "context compressed",
            extra={
                "session_id": s.session.id,
                "reason": s.reason.value,
                "method": method.value,
                "tokens_before": before,
                "tokens_after": tokens_after,
            },
        )
        return report

    def history_chunks(self, demoted: Sequence[Message]) -> list[HistoryChunk]:
        """The raw history index's chunks of demoted originals (a compaction's, handed to
        ``commit_compaction``; a fork's inherited demoted rows): a chunk per turn, long turns cut
        by message and long messages by lines (``core/chunking.py``)."""
        originals = [m for m in demoted if not m.flags.is_summary and not is_placeholder(m)]
        if not originals:
            return []
        cfg = self._settings.summarizer
        search = self._settings.search
        chunks = []
        for piece in pieces(originals, max_chars=search.chunk_max_chars, overlap_lines=search.chunk_overlap_lines):
            rows = list(piece.rows)
            # A window of one long message: its breadcrumbs come from that window's text only.
            crumb_rows = rows if len(rows) > 1 else [dataclasses.replace(rows[0], content=piece.text)]
            chunks.append(
                HistoryChunk(
                    content_hash=hashlib.sha256(piece.text.encode()).hexdigest(),
                    text=piece.text,
                    first_sequence=rows[0].sequence_number,
                    last_sequence=rows[-1].sequence_number,
                    start_time=rows[0].create_time,
                    end_time=rows[-1].create_time,
                    breadcrumbs=tuple(
                        extract_breadcrumbs(
                            crumb_rows,
                            limit=cfg.breadcrumb_limit,
                            max_chars=cfg.breadcrumb_max_chars,
                            scan_chars=cfg.breadcrumb_scan_chars,
                        )
                    ),
                )
            )
        return chunks

    async def _publish(self, s: Situation, kind: str, payload: dict[str, Any]) -> StoredEvent | None:
        """Events report what happened; a bus failure must not turn a done compaction into an error."""
        try:
            return await self._bus.publish(
                session_id=s.session.id, user_id=s.session.user_id, kind=kind, payload=payload
            )
        except Exception:
            log.warning("event publish failed", extra={"session_id": s.session.id, "kind": kind}, exc_info=True)
            return None

    async def _publish_close(self, s: Situation, kind: str, payload: dict[str, Any]) -> None:
        """The compaction's closing event. Where compression events are shared by replicas, it
        names its start and is published only if nobody closed that start yet: a compaction whose
        lock died with its connection (a PostgreSQL restart) may have been taken for abandoned and
        closed by another replica meanwhile."""
        if self.compression_log is None or s.started is None:
            await self._publish(s, kind, payload)
            return
        try:
            closed = await self.compression_log.publish_close(s.started, kind=kind, payload=payload)
        except Exception:
            log.warning("event publish failed", extra={"session_id": s.session.id, "kind": kind}, exc_info=True)
            return
        if closed is None and kind == "context_compressed":
            # The commit landed, but another replica closed the start as abandoned in the instant
            # between ``_start_closed`` and the commit: watchers were told it failed. The commit is
            # announced as a compaction of its own (a start, then its close), so every start still
            # gets one close and the last word on the session is what happened.
            log.warning(
                "compaction committed after another replica closed its start as abandoned; announced anew",
                extra={"session_id": s.session.id, "started_event_id": s.started.event_id},
            )
            again = await self._publish(s, "compression_started", dict(s.started.payload))
            if again is not None:
                s.started = again
                try:  # once (a start the sweep closes again in between keeps its one close)
                    if await self.compression_log.publish_close(again, kind=kind, payload=payload) is None:
                        log.warning(
                            "committed compaction's second start was closed by another replica too",
                            extra={"session_id": s.session.id, "started_event_id": again.event_id},
                        )
                except Exception:
                    log.warning("event publish failed", extra={"session_id": s.session.id, "kind": kind}, exc_info=True)
        elif closed is None:
            log.warning(
                "compaction's start was closed already by another replica; its own close not published",
                extra={"session_id": s.session.id, "kind": kind, "started_event_id": s.started.event_id},
            )

    async def _start_closed(self, s: Situation) -> bool:
        """Whether another replica closed this compaction's start (it took it for abandoned: the
        lock died with its connection): such a compaction commits nothing."""
        if self.compression_log is None or s.started is None:
            return False
        try:
            return await self.compression_log.start_closed(s.started)
        except ContextError:
            return False  # the commit's own check in context still stops an overlapping one

    async def close_abandoned(self, *, older_than: float, limit: int = 100) -> int:
        """Close each compaction announced and never closed: ``compression_refused`` (reason
        failed) for a ``compression_started`` that is still its session's newest compression
        event while nothing holds the session's compaction lock. Both events of a compaction are
        published under that lock, so a free lock means the one that announced it is gone: its
        replica died (kill -9, a lost machine), or the closing event could not be published.
        Asks ``compression_log`` (none: nothing to close). How many were closed."""
        events = self.compression_log
        if events is None:
            return 0
        started_before = datetime.now(UTC) - timedelta(seconds=older_than)
        closed = 0
        for started in await events.open_compressions(started_before=started_before, limit=limit):
            try:
                async with self.lock(started.session_id, wait=_ABANDONED_LOCK_WAIT):
                    now = await events.newest_compression(started.session_id)
                    if now is None or now.event_id != started.event_id:
                        continue  # closed meanwhile, or a newer compaction announced itself
                    if await self._close_abandoned_start(started):
                        closed += 1
            except (CompactionBusy, Conflict):
                continue  # a compaction of the session runs: it will close its own
        if closed:
            log.warning("closed compactions announced and never ended", extra={"closed": closed})
        return closed

    async def _close_abandoned_start(self, started: StoredEvent) -> bool:
        """Close ``started`` as failed, unless it was closed meanwhile. Whether this closed it."""
        payload = {
            "reason": Refusal.FAILED.value,
            "trigger": str(started.payload.get("reason", "")),
            "detail": _ABANDONED_DETAIL,
        }
        if self.compression_log is None:
            await self._bus.publish(
                session_id=started.session_id, user_id=started.user_id, kind="compression_refused", payload=payload
            )
            return True
        closed = await self.compression_log.publish_close(started, kind="compression_refused", payload=payload)
        return closed is not None

    async def _close_left_open(self, session_id: str) -> None:
        """Before a compaction announces itself (under the session's compaction lock): a start
        that is still the session's newest compression event was left open by a compaction that
        is gone (no other can run while this lock is held): a replica that died, or a closing
        event that could not be published. It is closed first, so every start gets its one close
        even when the next compaction comes before the sweep (``close_abandoned``) would."""
        if self.compression_log is None:
            return
        try:
            newest = await self.compression_log.newest_compression(session_id)
            if newest is not None and newest.kind == "compression_started":
                await self._close_abandoned_start(newest)
        except ContextError as exc:  # the sweep closes it later; this compaction goes on
            log.warning("could not close a compaction left open", extra={"session_id": session_id, "error": str(exc)})

    async def refuse(self, s: Situation, detail: str) -> None:
        await self._publish(
            s, "compression_refused", {"reason": "loop_guard", "trigger": s.reason.value, "detail": detail}
        )


#: How long ``close_abandoned`` tries a session's lock before leaving it for the next pass.
_ABANDONED_LOCK_WAIT = 1.0
_ABANDONED_DETAIL = (
    "the compaction was announced and its end was never reported (the replica running it stopped, "
    "or its closing event was lost)"
)

_REFUSAL_DETAIL = {
    Refusal.CONFLICT: "another compaction committed first; the context is already compacted",
    Refusal.NO_PROGRESS: "no stage could shrink the context enough; nothing was committed",
    Refusal.FAILED: "the compaction stopped on an error; nothing was committed",
}

# Compaction runs on behalf of the service once the caller's access was checked.
_SYSTEM = Principal(user_id="contextsvc", is_admin=True)


def replaced_originals(dropped: Sequence[Message]) -> set[int]:
    """Original (display) sequence numbers that ``dropped`` rows stand for: a displayed row itself,
    a placeholder its cleared original, an older summary what it replaced in turn."""
    out: set[int] = set()
    for m in dropped:
        if m.flags.is_summary:
            out |= summary_originals(m)
        elif m.flags.is_display:
            out.add(m.sequence_number)
        elif m.context_anchor > 0:
            out.add(m.context_anchor)
    return {seq for seq in out if seq > 0}


def summary_originals(summary: Message) -> set[int]:
    """What a summary stands for: its exact ranges, or (older summaries) its whole range."""
    runs = summary.metadata.get(REPLACED_RANGES_KEY)
    if isinstance(runs, list):
        return {seq for first, last in runs for seq in range(int(first), int(last) + 1)}
    if summary.replaces is not None:
        return set(range(summary.replaces[0], summary.replaces[1] + 1))
    return set()


def plan_payload(plan: CompactionPlan) -> dict[str, Any]:
    covered = plan.replaced_range
    return {
        "would_compress": plan.would_compress,
        "messages_to_drop": len(plan.drop),
        "messages_to_keep": len(plan.keep),
        "turns_kept": plan.turns_kept,
        "tokens_before": plan.tokens_before,
        "tokens_kept": plan.tokens_kept,
        "first_sequence": covered[0] if covered else 0,
        "last_sequence": covered[1] if covered else 0,
        "detail": plan.detail,
    }


class _LocalLock:
    """``Compactor.local_lock``: a class rather than an ``asynccontextmanager`` generator, which
    costs about twice as much to enter and leave (a baseline's anchor takes this lock every turn)."""

    __slots__ = ("_compactor", "_entry", "_session_id")

    def __init__(self, compactor: Compactor, session_id: str) -> None:
        self._compactor = compactor
        self._session_id = session_id
        self._entry: list[Any] | None = None

    async def __aenter__(self) -> None:
        entry = self._entry = self._compactor._lock_entry(self._session_id)
        try:
            await entry[0].acquire()
        except BaseException:  # cancelled while waiting: no longer a waiter
            self._compactor._lock_left(self._session_id, entry)
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        entry = self._entry
        assert entry is not None
        try:
            entry[0].release()
        finally:
            self._compactor._lock_left(self._session_id, entry)
