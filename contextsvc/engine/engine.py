"""The engine: one object the API adapter talks to, composed of the use-case services."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from contextsvc import telemetry
from contextsvc.config import Settings
from contextsvc.core.messages import Message
from contextsvc.core.profile import NO_OVERRIDES, EffectiveProfile, ProfileOverrides, resolve_profile
from contextsvc.core.recall import query_terms
from contextsvc.core.session import Principal, SessionInfo
from contextsvc.core.tokens import TokenEstimate, context_total
from contextsvc.core.view_budget import AFTER_COMPRESSION, too_large
from contextsvc.engine.accounting import TokenAccounting
from contextsvc.engine.compaction import (
    STRATEGIES,
    CompactionBusy,
    Compactor,
    CompressionReport,
    Reason,
    Situation,
    summary_originals,
)
from contextsvc.engine.recall import RecallService
from contextsvc.engine.remembered_profile import (
    PROFILE_KEY,
    as_stored,
    counted_budget,
    remembered_overrides,
    remembered_stored,
    session_profile,
    stored_none,
)
from contextsvc.engine.sessions import AppendOutcome, SessionService
from contextsvc.engine.state import EngineState
from contextsvc.engine.validation import IncomingMessage, check_no_nul, require_session_id
from contextsvc.engine.views import Assembled, BaselineResult, BuiltView, PendingAnchor, ViewService
from contextsvc.engine.worker import PostTurnWorker
from contextsvc.errors import ContextError, FailedPrecondition, InvalidArgument, NotFound, quoted
from contextsvc.ports import BaselineWrite, Clock, EventBus, ScoredChunk, SessionStore, Summarizers

log = logging.getLogger(__name__)

_INTERNAL = Principal(user_id="contextsvc", is_admin=True)


class Engine:
    def __init__(
        self,
        *,
        store: SessionStore,
        bus: EventBus,
        settings: Settings,
        clock: Clock,
        summarizers: Summarizers,
    ):
        self.store = store
        self.bus = bus
        self.settings = settings
        self.accounting = TokenAccounting(store, settings)
        self.summarizers = summarizers
        self.sessions = SessionService(store=store, bus=bus, settings=settings, clock=clock, accounting=self.accounting)
        self.views = ViewService(store=store, bus=bus, settings=settings, clock=clock, accounting=self.accounting)
        self.compactor = Compactor(
            store=store, bus=bus, settings=settings, accounting=self.accounting, summarizers=self.summarizers
        )
        self.post_turn = PostTurnWorker(self._post_turn_check)
        #: sessions whose queued post-turn check follows a baseline that found them near a level,
        #: each as that baseline's anchor wrote it
        self._near: dict[str, SessionInfo] = {}
        #: session id -> its newest baseline anchor waiting for a running compaction (``_anchor``).
        self._anchors: dict[str, asyncio.Task[None]] = {}
        #: compactions builds started, which go on past a build's wait (``_compress_within``).
        self._compactions: set[asyncio.Task[CompressionReport | None]] = set()
        self.recall = RecallService(store=store, settings=settings, accounting=self.accounting)
        #: the last profile ``_profile_for`` found valid (its summarizer and strategies exist)
        self._checked_profile: EffectiveProfile | None = None

    async def append(
        self,
        caller: Principal,
        session_id: str,
        incoming: Sequence[IncomingMessage],
        *,
        request_id: str,
        turn_complete: bool,
    ) -> AppendOutcome:
        outcome = await self.sessions.append(
            caller, session_id, incoming, request_id=request_id, turn_complete=turn_complete
        )
        if turn_complete and not outcome.replayed:
            self.post_turn.schedule(require_session_id(session_id))
        return outcome

    # -- views ----------------------------------------------------------------------------------

    async def _profile_for(self, session: SessionInfo, overrides: ProfileOverrides | None) -> EffectiveProfile:
        remembered = overrides is None
        if remembered:
            overrides = remembered_overrides(session)
        profile = resolve_profile(self.settings, session.profile_id, overrides, remembered=remembered)
        if profile is not self._checked_profile:  # (resolved profiles are shared objects)
            if profile.compression.summarizer not in self.summarizers:
                self.summarizers.get(profile.compression.summarizer)  # raises InvalidArgument naming the field
            unknown = [name for name in profile.compression.strategies if name not in STRATEGIES]
            if unknown:
                # A misspelt strategy would otherwise be skipped in silence (a profile that never summarizes).
                raise InvalidArgument.field(
                    "profile.compression.strategies",
                    f"unknown strategy {quoted(unknown[0])}; known: {', '.join(STRATEGIES)}",
                )
            self._checked_profile = profile
        await self.accounting.ensure_loaded(profile.model)
        return profile

    async def _remember_profile(
        self, session: SessionInfo, overrides: ProfileOverrides, *, wait: float | None = None
    ) -> SessionInfo:
        """The session with ``overrides`` remembered as its profile (what appends, ``EstimateTokens``
        of the session without a profile and the post-turn check use; a build without one remembers
        none). ``wait`` bounds the wait for the compaction lock: past it the session is returned as
        it was, and a later build remembers the profile (this one uses it all the same)."""
        # As stored (JSON: tuples come back as lists), so an unchanged profile compares equal and
        # costs no write (and no lock) on every build.
        wanted = stored_none() if overrides is NO_OVERRIDES else as_stored(overrides)
        saved = remembered_stored(session)
        if saved == wanted or (saved is None and wanted == stored_none()):
            # Nothing to remember: no write and no lock (a session's first build without a profile).
            return session
        # Read-modify-write of the engine state under the compaction lock, on a fresh read: writing
        # back the state this request read earlier would undo a compaction committed meanwhile.
        # Both locks: the store's serializes with compactions on other replicas too.
        try:
            async with self.compactor.lock(session.id, wait=wait):
                # The session and its context at one moment: an append between two reads would be
                # priced into the new count and added again through ``context_tokens_as_of``.
                fresh, context = await self.store.context_and_session(session.id, caller=_INTERNAL)
                state = EngineState.of(fresh)
                if remembered_stored(fresh) == wanted:
                    return fresh
                new_state = dataclasses.replace(state, extra={**state.extra, PROFILE_KEY: copy.deepcopy(wanted)})
                tokens = await self._repriced_context(fresh, context, overrides)
                written = await self.store.update_state(
                    session.id,
                    caller=_INTERNAL,
                    state=new_state.to_dict(),
                    context_tokens=tokens,
                    context_tokens_as_of=None if tokens is None else fresh.context_tokens,
                )
                self.sessions.forget_profile(session.id)  # appends price with the new one
                return written
        except CompactionBusy:
            return session  # a compaction's summarizer holds the lock: remembered by a later build

    async def _repriced_context(
        self, session: SessionInfo, context: Sequence[Message], overrides: ProfileOverrides
    ) -> int | None:
        """The session's context tokens with its rows priced for the model ``overrides`` name, when
        it is not the model its count was priced for, or their per-message budget is not the one
        its long rows were counted at (``context_share``) (None: unchanged). Appends add each row's
        price for the remembered model to the session's context tokens; after a build with another
        model the rows appended before must be priced for it too, or every later append's
        ``context_tokens`` and ``window_fraction`` mix two models' prices. Only the rows' price is
        swapped: what the count holds beside them (a compaction's or a baseline's system prompt,
        records and framing) stays."""
        was = session_profile(self.settings, session)  # what its appends priced with
        now = resolve_profile(self.settings, session.profile_id, _or_remembered(overrides))
        before, after = was.model, now.model
        if after == before and now.per_message_budget == was.per_message_budget:
            return None
        rows = [m for m in context if m.flags.is_context]
        await self.accounting.ensure_loaded(before)
        await self.accounting.ensure_loaded(after)
        # Each row as the views of either profile send it (cut to its per-message budget).
        priced_after = self.accounting.context_tokens(after, rows, now.per_message_budget)
        beside = session.context_tokens - self.accounting.context_tokens(before, rows, was.per_message_budget)
        return max(priced_after + beside, priced_after)

    def _situation(
        self,
        session: SessionInfo,
        profile: EffectiveProfile,
        context: list[Message],
        built: Assembled,
        reason: Reason,
        *,
        mid_turn: bool = False,
    ) -> Situation:
        seg = built.estimate.segments
        return Situation(
            session=session,
            profile=profile,
            context=context,
            view_tokens=built.estimate.total,
            # Estimate + margin: the trigger fires before the true size could pass the threshold.
            margin=built.estimate.margin,
            fixed_tokens=seg.system + seg.incoming,
            reason=reason,
            mid_turn=mid_turn,
        )

    async def build_context(
        self,
        caller: Principal,
        session_id: str,
        *,
        profile: ProfileOverrides,
        incoming: IncomingMessage | None,
        mid_turn: bool,
        auto_compress: bool,
    ) -> BuiltView:
        with telemetry.view_span(session_id):
            return await self._build_context(
                caller, session_id, profile=profile, incoming=incoming, mid_turn=mid_turn, auto_compress=auto_compress
            )

    async def _build_context(
        self,
        caller: Principal,
        session_id: str,
        *,
        profile: ProfileOverrides,
        incoming: IncomingMessage | None,
        mid_turn: bool,
        auto_compress: bool,
    ) -> BuiltView:
        sid = require_session_id(session_id)
        # The context and the session state it goes with, read at one moment by the store: read
        # apart, a compaction committed between the two reads (another request's, the post-turn
        # job's, another replica's) would pair the pre-compaction baseline with the compacted
        # context, and baseline + delta would count the dropped turns and their summary both
        # (the soak's CONTEXT_TOO_LARGE).
        session, context = await self.store.context_and_session(sid, caller=caller)
        effective = await self._profile_for(session, profile)
        # A build never waits on a compaction's summarizer past ``build_wait_seconds`` in all: one
        # deadline for every wait of the lock below (remembering the profile, a memory flush, the
        # compression itself).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.hot_path.build_wait_seconds
        remembered = await self._remember_profile(session, profile, wait=_left(deadline, loop))
        if remembered is not session:  # the state was written (or read again): read both again
            session, context = await self.store.context_and_session(sid, caller=caller)
        message, data = await self.views.prepare_incoming(incoming, "incoming")
        built = self.views.assemble(effective, context, message, EngineState.of(session), session_id=sid)
        report: CompressionReport | None = None
        reason = Reason.MIDTURN if mid_turn else Reason.PRETURN
        if auto_compress and effective.compression.enabled:
            situation = self._situation(session, effective, context, built, reason, mid_turn=mid_turn)
            wait = self.settings.hot_path.build_wait_seconds
            await self.compactor.maybe_memory_flush(situation, wait=_left(deadline, loop))
            fits = self._fits_with_margin(built)
            # When a compaction of this session is already running and the current view fits (with
            # its margin: else its real count may not), it is served now rather than after that
            # compaction's summarizer.
            # Two rounds at most: when another compaction committed while this one waited for the
            # lock, what it left (planned before this turn's messages) is judged again, and
            # compressed here if it still does not fit, rather than failing the turn.
            rounds = 2
            while rounds > 0 and self.compactor.over_threshold(situation) and not (fits and self.compactor.busy(sid)):
                rounds -= 1
                try:
                    report = await self._compress_within(situation, deadline, loop)
                except CompactionBusy:
                    # Still compacting after the bound (another request's compaction, or this
                    # build's own, still in its summarizer call): a hard-truncated view, computed
                    # and not committed (the running compaction commits its own result).
                    kept = self.compactor.fallback_context(situation)
                    # Without the baseline: it counts the whole context, and baseline + delta on a
                    # truncated one would count the dropped turns too (CONTEXT_TOO_LARGE in the soak).
                    unanchored = dataclasses.replace(EngineState.of(session), baseline=None)
                    built = self.views.assemble(effective, kept, message, unanchored)
                    notice = (
                        f"a compaction of this session was still running after {wait:g} s: "
                        f"this view is hard-truncated to {len(kept)} of {len(context)} context messages"
                    )
                    built = dataclasses.replace(built, notices=[*built.notices, notice])
                    return await self.views.finish(caller, session, effective, kept, built, data, anchor=False)
                # Reload after our compaction, and also when another request compacted while this
                # one waited for the lock: the view built before it is stale (and may no longer fit).
                epoch = EngineState.of(session).epoch
                fresh, fresh_context = await self.store.context_and_session(sid, caller=caller)
                if EngineState.of(fresh).epoch == epoch:
                    break
                session, context = fresh, fresh_context
                built = self.views.assemble(effective, context, message, EngineState.of(session), session_id=sid)
                fits = self._fits_with_margin(built)
                if report is not None or fits:
                    break
                situation = self._situation(session, effective, context, built, reason, mid_turn=mid_turn)
        if built.estimate.over_budget and auto_compress and effective.compression.enabled:
            # Served with a notice: its real count may pass the budget. Say why it was not compressed.
            judged = self._situation(session, effective, context, built, reason, mid_turn=mid_turn)
            log.info(
                "view over the budget by its margin",
                extra={
                    "session_id": sid,
                    "estimate": built.estimate.total,
                    "margin": built.estimate.margin,
                    "over_threshold": self.compactor.over_threshold(judged),
                    "loop_guarded": self.compactor.loop_guarded(judged),
                    "busy": self.compactor.busy(sid),
                    "compressed": report is not None and report.compressed,
                    "refused": str(report.refused) if report is not None and report.refused else "",
                },
            )
        if not self._fits(effective, built):
            # The turn is about to fail with CONTEXT_TOO_LARGE: say what was decided, and why.
            log.warning(
                "view over the size guard's budget after compression",
                extra={
                    "session_id": sid,
                    "estimate": built.estimate.total,
                    "margin": built.estimate.margin,
                    "auto_compress": auto_compress and effective.compression.enabled,
                    "compressed": report is not None and report.compressed,
                    "refused": str(report.refused) if report is not None and report.refused else "",
                    "plan": report.plan.detail if report is not None and report.plan is not None else "",
                    "plan_tokens_before": report.plan.tokens_before if report and report.plan else -1,
                    "report": report is not None,
                },
            )
        # Recall is layered on the final base view (after the size decision), as a copy.
        built, recalled = await self.recall.add_to_view(session, effective, built, message)
        view = await self.views.finish(
            caller, session, effective, context, built, data, compression=report, after=_after(effective, auto_compress)
        )
        if recalled:
            view = dataclasses.replace(view, injected_chunk_ids=recalled)
        telemetry.view_built(effective.model, len(view.messages), view.estimate.total, view.estimate.fraction)
        return view

    @staticmethod
    def _fits(profile: EffectiveProfile, built: Assembled) -> bool:
        return too_large(built.estimate.total, profile.context_window, profile.output_reserve_tokens) is None

    @staticmethod
    def _fits_with_margin(built: Assembled) -> bool:
        """Estimate + margin within the size guard's budget: the real count fits too."""
        return not built.estimate.over_budget

    async def _compress_within(
        self, s: Situation, deadline: float, loop: asyncio.AbstractEventLoop
    ) -> CompressionReport | None:
        """``_compress_automatically`` for a build, which waits for it until ``deadline`` at most:
        past it, ``CompactionBusy``, and the compaction goes on in the background (its summarizer
        may answer yet) and commits for the builds after this one. A hanging summarizer holds no
        build longer than ``hot_path.build_wait_seconds``."""
        task = asyncio.create_task(
            self._compress_automatically(s, wait=_left(deadline, loop)), name=f"compaction-{s.session.id}"
        )
        self._compactions.add(task)
        task.add_done_callback(self._compactions.discard)
        try:
            done, _ = await asyncio.wait((task,), timeout=_left(deadline, loop))
        except asyncio.CancelledError:  # the caller went away; the compaction goes on
            task.add_done_callback(_log_unwaited)
            raise
        if not done:
            task.add_done_callback(_log_unwaited)
            raise CompactionBusy(s.session.id)
        return task.result()

    async def _compress_automatically(self, s: Situation, *, wait: float | None = None) -> CompressionReport | None:
        """Compress under the session's compaction lock, re-reading the session once inside it:
        a compaction that finished while we waited may have done the work already. ``wait``
        bounds the wait for the lock (``CompactionBusy``)."""
        async with self.compactor.lock(s.session.id, wait=wait):
            fresh = await self.store.get_session(s.session.id, caller=_INTERNAL)
            if EngineState.of(fresh).epoch != s.state.epoch:
                return None
            # Same cycle: decide and commit on the fresh state, so what was written since the
            # situation was read (a memory-flush mark, a truncation flag) is kept, not written over.
            # The count the commit builds on is the fresh one less what the rows appended since
            # brought (the plan did not see them; the commit keeps them and their tokens). Taken
            # from the fresh read, not the situation's: a baseline anchored before the lock was
            # taken re-counted the rows the plan saw, and the commit's own count replaces that.
            appended = 0
            if fresh.last_sequence > s.session.last_sequence:  # rows only appends add, fixed under the lock
                rows = await self.store.get_messages(
                    s.session.id, caller=_INTERNAL, first=s.session.last_sequence + 1, last=fresh.last_sequence
                )
                # At the budget the appends counted them with (their session's profile).
                appended = context_total(
                    rows,
                    counted_budget(self.settings, fresh),
                    fallback_tokens=self.settings.tokens.image_tokens_fallback,
                )
            s.tokens_read = fresh.context_tokens - appended
            s.session, s.state = fresh, EngineState.of(fresh)
            if self.compactor.loop_guarded(s):
                await self.compactor.refuse(
                    s, "the last compaction left the context inside the hysteresis band; not compressing again"
                )
                return None
            return await self.compactor.run(s)

    async def _post_turn_check(self, session_id: str) -> None:
        """After a turn (or a baseline): compress if over the threshold, or unconditionally when
        the last prompt was silently truncated."""
        # A check RecordBaseline scheduled for a session it found near a level (``_near``) judges
        # the session as the baseline's anchor wrote it, with the context of that version when the
        # store holds it (PostgreSQL: the context the view's build read; no statement), else both
        # read at once (one statement). Any other check reads the session alone first, and stops
        # there when the session is far below every level. A change committed since is judged by
        # the next check or build, and a compaction reads the session again under its lock.
        anchored = self._near.pop(session_id, None)
        context: list[Message] | None = None
        try:
            if anchored is not None:
                context = self.store.context_as_read(anchored)
                if context is not None:
                    session = anchored
                else:
                    session, context = await self.store.context_and_session(session_id, caller=_INTERNAL)
            else:
                session = await self.store.get_session(session_id, caller=_INTERNAL)
        except NotFound:
            return
        profile = await self._post_turn_profile(session)
        if profile is None:
            return
        if context is None:
            # The session read again with its context, at one moment (a compaction commits on
            # top of the context tokens read with the context it compacts).
            session, context = await self.store.context_and_session(session_id, caller=_INTERNAL)
        # Through the session's view memo: the next build of an unchanged session reuses this view.
        built = self.views.assemble(profile, context, None, EngineState.of(session), session_id=session_id)
        s = self._situation(session, profile, context, built, Reason.POSTTURN)
        await self.compactor.maybe_memory_flush(s)
        if session.context_truncated or self.compactor.over_threshold(s):
            await self._compress_automatically(s)

    async def estimate_tokens(
        self,
        caller: Principal,
        *,
        model: str,
        messages: Sequence[IncomingMessage],
        session_id: str,
        profile: ProfileOverrides,
    ) -> TokenEstimate:
        if session_id and messages:
            raise InvalidArgument.field("messages", "give either messages or a session_id, not both")
        if len(model) > self.settings.limits.max_model_chars:
            raise InvalidArgument.field("model", f"exceeds {self.settings.limits.max_model_chars} characters")
        check_no_nul(model, "model")
        if session_id:
            # The session and its context read at one moment, as a build reads them: read apart, a
            # compaction committed between the two reads would pair the old baseline with the
            # compacted context, and baseline + delta would count the dropped turns and the summary.
            session, context = await self.store.context_and_session(require_session_id(session_id), caller=caller)
            # Without a profile, the one BuildContext last used, so the estimate prices exactly
            # what BuildContext would send.
            effective = await self._profile_for(session, _or_remembered(profile))
            return await self.views.estimate_session(session, context, model=model, profile=effective)
        effective = resolve_profile(self.settings, "", profile)
        return await self.views.estimate_messages(model=model, profile=effective, messages=messages)

    async def record_baseline(
        self, caller: Principal, session_id: str, *, view_id: str, prompt_tokens: int
    ) -> BaselineResult:
        sid = require_session_id(session_id)
        anchored: list[SessionInfo] = []

        async def anchor(pending: PendingAnchor) -> None:
            session = await self._anchor(caller, sid, pending)
            if session is not None:
                anchored.append(session)

        async def quick_anchor(pending: PendingAnchor, write: BaselineWrite | None) -> bool | None:
            if self._anchor_waits(sid):
                return None  # not tried: the anchor waits for the compaction (``_anchor``)
            session = await self._try_anchor(caller, sid, pending, write)
            if session is not None:
                anchored.append(session)
            return session is not None

        result = await self.views.record_baseline(
            caller, sid, view_id=view_id, prompt_tokens=prompt_tokens, anchor=anchor, quick_anchor=quick_anchor
        )
        # The post-turn check of a session whose new anchor leaves it far from compaction would
        # only read it again and say so: judged here, on the session as the anchor wrote it. A
        # profile that cannot be resolved is left to the check, which logs why.
        try:
            needed = not anchored or await self._post_turn_profile(anchored[-1]) is not None
        except ContextError:
            needed = True
        else:
            if anchored and needed:
                self._near[sid] = anchored[-1]
        if needed:
            self.post_turn.schedule(sid)
        return result

    async def _post_turn_profile(self, session: SessionInfo) -> EffectiveProfile | None:
        """The profile the post-turn check of ``session`` judges it with, or None when the check
        would stop before reading its context: compression is off for it, or it is not truncated
        and ``Compactor.far_below``, or its named profile left the settings (its builds say so: a
        check every turn would log the same failure). Raises when the profile cannot be resolved
        otherwise."""
        try:
            profile = await self._profile_for(session, None)
        except FailedPrecondition as exc:
            if exc.reason != "UNKNOWN_PROFILE":
                raise
            return None
        if not profile.compression.enabled or (
            not session.context_truncated and self.compactor.far_below(profile, session.context_tokens)
        ):
            return None
        return profile

    async def _anchor(self, caller: Principal, sid: str, pending: PendingAnchor) -> SessionInfo | None:
        """Apply a new baseline, without waiting behind a compaction: first unlocked, on the session
        as the baseline read it (``_try_anchor``, one store call), else under the compaction lock.

        The baseline is a read-modify-write of the engine state, serialized with compactions (one
        committed in between would be undone: its epoch, its cleared baseline). When the lock is
        not free within ``hot_path.baseline_wait_seconds`` (a compaction of the session is running
        its summarizer, here or on another replica), RecordBaseline answers at once and the anchor
        is applied after that compaction: if it committed, the view is of an older cycle and the
        anchor is dropped (``apply_anchor``); if it did not, the anchor applies then. Anchors of a
        session apply in the order they were recorded. The session as the anchor left it when it
        was applied at once; None when it was dropped or deferred."""
        if not self._anchor_waits(sid):
            applied = await self._try_anchor(caller, sid, pending)
            if applied is not None:
                return applied
            try:
                async with self.compactor.lock(sid, wait=self.settings.hot_path.baseline_wait_seconds):
                    return await self.views.apply_anchor(caller, sid, pending)
            except CompactionBusy:
                pass
        previous = self._anchors.get(sid)

        async def later() -> None:
            if previous is not None:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await previous
            async with self.compactor.lock(sid):
                await self.views.apply_anchor(caller, sid, pending)

        task = asyncio.create_task(later(), name=f"baseline-anchor-{sid}")
        self._anchors[sid] = task
        task.add_done_callback(functools.partial(self._anchor_done, sid))
        return None

    def _anchor_waits(self, sid: str) -> bool:
        """Whether a new anchor of ``sid`` must wait: a compaction of it runs here, or an anchor
        deferred behind one is still to be applied (anchors apply in the order recorded)."""
        return self.compactor.busy(sid) or sid in self._anchors

    async def _try_anchor(
        self, caller: Principal, sid: str, pending: PendingAnchor, write: BaselineWrite | None = None
    ) -> SessionInfo | None:
        """The anchor written without the store's lock (``ViewService.try_anchor``, with ``write``
        when the store writes it too): one store call when the session is still as
        ``pending.read`` and no compaction runs, here or elsewhere (PostgreSQL: one statement,
        not lock, read, write, unlock). None when not written, nothing changed."""
        if self._anchor_waits(sid):
            return None
        async with self.compactor.local_lock(sid):
            return await self.views.try_anchor(caller, sid, pending, write)

    def _anchor_done(self, sid: str, task: asyncio.Task[None]) -> None:
        if self._anchors.get(sid) is task:
            del self._anchors[sid]
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, NotFound):  # a session deleted meanwhile has no anchor
            log.warning("a deferred baseline could not be applied", extra={"session_id": sid}, exc_info=exc)

    async def background_settled(self, within: float) -> bool:
        """Wait, ``within`` seconds at most, for the compactions running on their own (those builds
        stopped waiting for, and the post-turn checks queued): at shutdown, so the events they
        emit reach watchers before the streams end. True when none is left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        if not await _all_done(self._compactions, within):
            return False
        return await self.post_turn.drain(max(deadline - loop.time(), 0.0))

    async def cancel_background(self, within: float) -> bool:
        """Cancel the compactions running on their own and the post-turn checks (a drain whose
        grace ran out) and wait, ``within`` seconds at most, for them to stop: a cancelled
        compaction publishes its closing event on the way out. True when all stopped."""
        tasks = [*self._compactions, *self.post_turn.cancel()]
        for task in tasks:
            task.cancel()
        return await _all_done(tasks, within)

    async def anchors_applied(self, within: float) -> bool:
        """Wait until every deferred baseline anchor was applied or dropped (tests, shutdown)."""
        return await _all_done(self._anchors.values(), within)

    # -- compression and recall -----------------------------------------------------------------

    async def compress(
        self, caller: Principal, session_id: str, *, profile: ProfileOverrides, note: str, dry_run: bool
    ) -> CompressionReport:
        sid = require_session_id(session_id)
        if len(note) > 1000:
            raise InvalidArgument.field("reason", "exceeds 1000 characters")
        session = await self.store.get_session(sid, caller=caller)
        # Without a profile, the one the session's builds use, as the post-turn check does: a
        # Compress from the inspector aims at the window, model and summarizer of the agent's builds.
        effective = await self._profile_for(session, _or_remembered(profile))
        async with self.compactor.lock(sid):
            # At one moment: the commit counts appends made after this read on top of it.
            session, context = await self.store.context_and_session(sid, caller=caller)
            built = self.views.assemble(effective, context, None, EngineState.of(session))
            s = self._situation(session, effective, context, built, Reason.FORCED)
            s.note = note
            return await self.compactor.run(s, dry_run=dry_run)

    async def search_history(self, caller: Principal, session_id: str, *, query: str, limit: int) -> list[ScoredChunk]:
        sid = require_session_id(session_id)
        cfg = self.settings.summarizer
        if limit < 0:
            raise InvalidArgument.field("limit", "must not be negative")
        if not query_terms(query):
            raise InvalidArgument.field("query", "has no searchable words")
        await self.store.get_session(sid, caller=caller)
        return await self.store.search_history(
            sid, query, limit=min(limit or cfg.search_default_limit, cfg.search_max_limit)
        )

    async def expand_summary(self, caller: Principal, session_id: str, *, sequence_number: int) -> list[Message]:
        sid = require_session_id(session_id)
        if sequence_number <= 0:
            raise InvalidArgument.field("sequence_number", "must be positive")
        rows = await self.store.get_messages(sid, caller=caller, first=sequence_number, last=sequence_number)
        if not rows:
            raise NotFound(f"session {sid} has no message #{sequence_number}", reason="MESSAGE_NOT_FOUND")
        summary = rows[0]
        if not summary.flags.is_summary or summary.replaces is None:
            raise InvalidArgument.field("sequence_number", f"message #{sequence_number} is not a summary")
        first, last = summary.replaces
        wanted = summary_originals(summary)  # the range also spans rows the compaction kept
        originals = await self.store.get_messages(sid, caller=caller, first=first, last=last)
        return [
            m for m in originals if m.flags.is_display and not m.flags.is_compression and m.sequence_number in wanted
        ]

    async def close(self) -> None:
        waiting = [*self._anchors.values(), *self._compactions]
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await self.post_turn.close()
        await self.summarizers.close()


async def _all_done(tasks: Iterable[asyncio.Task[Any]], within: float) -> bool:
    """Wait, ``within`` seconds at most, until each of ``tasks`` is done; True if they all are."""
    pending = list(tasks)
    if not pending:
        return True
    _, waiting = await asyncio.wait(pending, timeout=within)
    return not waiting


def _log_unwaited(task: asyncio.Task[Any]) -> None:
    """The outcome of a compaction its build stopped waiting for: a failure is logged here, as
    nobody else will see it."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, CompactionBusy | NotFound):
        log.warning("a compaction a build stopped waiting for failed", exc_info=exc)


def _after(profile: EffectiveProfile, auto_compress: bool) -> str:
    """How a CONTEXT_TOO_LARGE message of a build ends: a build that could not compress says why,
    rather than claiming it compressed (the caller may enable compression or call Compress)."""
    if not profile.compression.enabled:
        return "and compression is disabled for this profile (compression.enabled = false)"
    if not auto_compress:
        return "and this build did not compress (auto_compress = false; Compress can shrink the context)"
    return AFTER_COMPRESSION


def _left(deadline: float, loop: asyncio.AbstractEventLoop) -> float:
    """Seconds to ``deadline`` (a lock wait bound: a hair above 0 once passed, so a free lock is
    still taken and a held one refused at once)."""
    return max(deadline - loop.time(), 0.001)


def _or_remembered(profile: ProfileOverrides) -> ProfileOverrides | None:
    """``profile``, or None (``_profile_for``: the session's remembered profile) when a call gave
    none: EstimateTokens and Compress of a session use what its builds use. (BuildContext without
    a profile uses the named one, and remembers that.)"""
    return None if profile == NO_OVERRIDES else profile
