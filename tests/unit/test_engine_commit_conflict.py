"""A compaction that loses the race at commit (DESIGN §5.8): another replica compacted the same
context first (the cross-replica compaction lock was lost, e.g. in a PostgreSQL restart), so the
store refuses the commit with ``Conflict``. The engine takes that as "someone else compacted": no
error reaches BuildContext, Compress or the post-turn check, no ``context_compressed`` event, no
fallback strategy, nothing indexed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from contextsvc.config import Settings
from contextsvc.core.messages import Message
from contextsvc.core.session import Principal
from contextsvc.ports import HistoryChunk
from contextsvc.stores.memory import MemoryStore
from tests.support.compaction_harness import Rig, ScriptedSummarizer, a, overrides, t, u, words


class RacedStore(MemoryStore):
    """Adversity: while armed, "another replica" gets its compaction in just before ours commits.

    It demotes the oldest row ours demotes (``how="compaction"``: a whole compaction, so the
    session's epoch moves on; ``how="flags"``: that row only), then the real commit runs and the
    store's optimistic check refuses it.
    """

    how = "compaction"

    def __init__(self, settings: Settings | None = None) -> None:
        super().__init__(settings)
        self.armed = False
        self.raced: list[int] = []
        self.committed: list[list[int]] = []

    async def commit_compaction(
        self,
        session_id: str,
        *,
        caller: Principal,
        demote: Sequence[int],
        append: Sequence[Message],
        context_tokens: int,
        state: Mapping[str, Any] | None = None,
        context_tokens_as_of: int | None = None,
        history: Sequence[HistoryChunk] = (),
    ) -> list[int]:
        if self.armed and demote:
            first = min(demote)
            self.raced.append(first)
            if self.how == "flags":
                await self.set_context_flags(session_id, [first], caller=caller, is_context=False)
            else:
                info = await self.get_session(session_id, caller=caller)
                theirs = {**info.state, "epoch": int(info.state.get("epoch", 0)) + 1}
                await super().commit_compaction(
                    session_id, caller=caller, demote=[first], append=[], context_tokens=0, state=theirs
                )
        seqs = await super().commit_compaction(
            session_id,
            caller=caller,
            demote=demote,
            append=append,
            context_tokens=context_tokens,
            state=state,
            context_tokens_as_of=context_tokens_as_of,
            history=history,
        )
        self.committed.append(list(demote))
        return seqs


class FlagsRacedStore(RacedStore):
    how = "flags"


RACES = [RacedStore, FlagsRacedStore]
SUMMARIZE = overrides(summarizer="scripted", strategies=["summarize"])
CLEAR_FIRST = overrides(summarizer="scripted", strategies=["clear_tool_results", "summarize"])


async def _fill_until(rig: Rig, sid: str, fraction: float) -> None:
    k = 0
    while await rig.estimate(sid) < fraction * rig.window:
        assert k < 400, "the session stopped growing"
        await rig.append(
            sid,
            u(f"zq{k}ux ask {k}"),
            a("", (f"c{k}", "read_file")),
            t(f"c{k}", f"zq{k}tx " + words(150)),
            a(f"ok {k}"),
        )
        k += 1


async def _started(store_type: type[RacedStore], *extra: ScriptedSummarizer) -> tuple[Rig, RacedStore]:
    rig = await Rig.start(*extra, store=store_type)
    assert isinstance(rig.store, RacedStore)
    return rig, rig.store


async def _check_nothing_of_ours(rig: Rig, store: RacedStore, sid: str, context_before: set[int]) -> None:
    """Only the other replica's demotion happened: no summary, no record, nothing indexed."""
    assert store.raced and not store.committed
    assert not rig.events(sid, "context_compressed")
    rows = await rig.rows(sid)
    assert not any(m.flags.is_summary or m.flags.is_compression for m in rows)
    assert {m.sequence_number for m in await rig.context(sid)} == context_before - set(store.raced)
    assert await store.search_history(sid, "ask", limit=10) == []


@pytest.mark.parametrize("store_type", RACES)
@pytest.mark.parametrize("profile", [SUMMARIZE, CLEAR_FIRST], ids=["summarize", "clear_first"])
async def test_build_context_goes_on_when_another_replica_compacted_first(
    store_type: type[RacedStore], profile: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rig, store = await _started(store_type, ScriptedSummarizer())
    try:
        sid = await rig.session()
        # Over the trigger (0.90) yet under window - reserve (7,680 of 8,192) after one step of
        # ~230 tokens: a lost race leaves the view as it was, so it must still fit.
        await _fill_until(rig, sid, 0.91)
        assert await rig.estimate(sid) <= rig.window - rig.reserve
        context_before = {m.sequence_number for m in await rig.context(sid)}
        store.armed = True
        with caplog.at_level(logging.WARNING, logger="contextsvc.engine.compaction"):
            view = await rig.build(sid, profile=profile)
        assert view.compression is not None and view.compression.compressed is False
        assert view.messages and view.estimate.total <= rig.window
        assert len(rig.events(sid, "compression_started")) == 1
        # The lost commit is the whole run: no other strategy, no hard truncation after it.
        assert len(store.raced) == 1
        await _check_nothing_of_ours(rig, store, sid, context_before)
        assert any("another compaction got there first" in r.getMessage() for r in caplog.records)
        if store_type is RacedStore:
            # The other replica's compaction moved the epoch on: the view is rebuilt on its context.
            assert {vm.message.sequence_number for vm in view.messages}.isdisjoint(store.raced)

        # Nothing is stuck: with the race over, the next build compacts as usual.
        store.armed = False
        again = await rig.build(sid, profile=profile)
        assert again.compression is not None and again.compression.compressed
        assert len(rig.events(sid, "context_compressed")) == 1 and len(store.committed) == 1
    finally:
        await rig.close()


@pytest.mark.parametrize("store_type", RACES)
async def test_a_forced_compress_that_loses_the_race_reports_compressed_false(store_type: type[RacedStore]) -> None:
    rig, store = await _started(store_type, ScriptedSummarizer())
    try:
        sid = await rig.session()
        await _fill_until(rig, sid, 0.5)
        context_before = {m.sequence_number for m in await rig.context(sid)}
        info_before = await rig.session_info(sid)
        store.armed = True
        report = await rig.compress(sid, profile=SUMMARIZE)
        assert report.compressed is False and report.reason == "forced" and report.method is None
        await _check_nothing_of_ours(rig, store, sid, context_before)
        info = await rig.session_info(sid)
        assert info.context_tokens == (0 if store_type is RacedStore else info_before.context_tokens)
        assert info.state.get("epoch", 0) == (1 if store_type is RacedStore else 0)
    finally:
        await rig.close()


async def test_hard_truncation_that_loses_the_race_reports_compressed_false() -> None:
    """The summarizer is down, so the run falls back to hard truncation, and that commit loses."""
    rig, store = await _started(RacedStore, ScriptedSummarizer(default="raise"))
    try:
        sid = await rig.session()
        await _fill_until(rig, sid, 0.5)
        context_before = {m.sequence_number for m in await rig.context(sid)}
        store.armed = True
        report = await rig.compress(sid, profile=SUMMARIZE)
        assert report.compressed is False
        await _check_nothing_of_ours(rig, store, sid, context_before)
    finally:
        await rig.close()


async def test_the_post_turn_check_that_loses_the_race_fails_nothing(caplog: pytest.LogCaptureFixture) -> None:
    rig, store = await _started(RacedStore, ScriptedSummarizer())
    try:
        sid = await rig.session()
        await rig.build(sid, auto=False, profile=SUMMARIZE)  # remembers the profile for the post-turn check
        await _fill_until(rig, sid, 0.92)
        context_before = {m.sequence_number for m in await rig.context(sid)}
        store.armed = True
        with caplog.at_level(logging.WARNING):
            await rig.append(sid, u("zqlastux one more"), a("done"), turn_complete=True)
            assert await rig.engine.post_turn.drain(within=30)
        assert not any(r.getMessage() == "post-turn check failed" for r in caplog.records)
        assert any("another compaction got there first" in r.getMessage() for r in caplog.records)
        context_before |= {m.sequence_number for m in (await rig.rows(sid))[-2:]}
        await _check_nothing_of_ours(rig, store, sid, context_before)
    finally:
        await rig.close()
