"""What a compaction reports (issue #8, items 2 and 3).

* Every ``compression_started`` is closed by exactly one ``context_compressed`` or
  ``compression_refused`` (reason ``conflict``, ``no_progress`` or ``failed``), so a watcher's
  "compressing…" state always ends.
* A compaction names every stage that ran, with what each removed: clearing that fell short of
  the target and the hard truncation that followed are both in the report and the event; a
  profile can forbid the hard truncation (``hard_truncate_fallback``, default true).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from contextsvc._gen.v1 import events_pb2
from contextsvc.api.mapping import event_to_pb
from contextsvc.api.views import report_to_compress_response
from contextsvc.config import CompressionDefaults
from contextsvc.core.compression.cheap import is_placeholder
from contextsvc.core.legal import is_legal
from contextsvc.core.messages import Message, Role
from contextsvc.core.session import ANONYMOUS, Principal
from contextsvc.engine.compaction import Method, Refusal
from contextsvc.errors import Unavailable
from contextsvc.ports import HistoryChunk
from contextsvc.stores.memory import MemoryStore
from tests.support.compaction_harness import Rig, ScriptedSummarizer, a, overrides, t, u
from tests.unit.test_engine_commit_conflict import RacedStore

CLOSING = ("context_compressed", "compression_refused")


def check_every_start_is_closed(rig: Rig, sid: str) -> list[str]:
    """started → exactly one closing event, before the next start; returns the closing kinds."""
    kinds = [e.kind for e in rig.events(sid, "compression_started", *CLOSING)]
    closings: list[str] = []
    open_ = False
    for kind in kinds:
        if kind == "compression_started":
            assert not open_, kinds
            open_ = True
        elif open_:
            closings.append(kind)
            open_ = False
    assert not open_, f"a compression_started was never closed: {kinds}"
    return closings


def refusal(rig: Rig, sid: str) -> Mapping[str, Any]:
    refused = rig.events(sid, "compression_refused")
    assert len(refused) == 1
    return refused[0].payload


async def _turns(rig: Rig, sid: str, n: int, *, chat: int = 400, result: int = 100) -> None:
    """Turns whose bulk is conversation, not tool output: clearing results cannot reach the target."""
    for k in range(n):
        await rig.append(
            sid,
            u(rig.sized(chat, prefix=f"zq{k}ux ask {k}", role=Role.USER)),
            a("", (f"c{k}", "read_file")),
            t(f"c{k}", rig.sized(result, prefix=f"zq{k}tx")),
            a(rig.sized(chat, prefix=f"zq{k}ax answer {k}", role=Role.ASSISTANT)),
        )


# -- item 3: closing events ---------------------------------------------------------------------


async def test_a_lost_commit_closes_with_a_conflict_refusal() -> None:
    rig = await Rig.start(ScriptedSummarizer(), store=RacedStore)
    try:
        sid = await rig.session()
        await _turns(rig, sid, 6)
        assert isinstance(rig.store, RacedStore)
        rig.store.armed = True
        report = await rig.compress(sid, profile=overrides(summarizer="scripted", strategies=["summarize"]))
        assert not report.compressed and report.refused is Refusal.CONFLICT
        assert check_every_start_is_closed(rig, sid) == ["compression_refused"]
        assert refusal(rig, sid)["reason"] == "conflict" and refusal(rig, sid)["trigger"] == "forced"
        pb = event_to_pb(rig.events(sid, "compression_refused")[0])
        assert pb.compression_refused.reason == events_pb2.COMPRESSION_REASON_CONFLICT
        assert pb.compression_refused.trigger == events_pb2.COMPRESSION_REASON_FORCED
    finally:
        await rig.close()


async def test_a_discarded_summary_without_fallback_closes_with_no_progress() -> None:
    """The summary is larger than what it replaces (proof of progress discards it) and the
    profile forbids hard truncation: nothing commits, and watchers are told so."""
    rig = await Rig.start(ScriptedSummarizer(default="huge"))
    try:
        sid = await rig.session()
        await _turns(rig, sid, 6)
        before = [m.sequence_number for m in await rig.context(sid)]
        profile = overrides(summarizer="scripted", strategies=["summarize"], hard_truncate_fallback=False)
        report = await rig.compress(sid, profile=profile)
        assert not report.compressed and report.refused is Refusal.NO_PROGRESS
        assert [m.sequence_number for m in await rig.context(sid)] == before
        assert check_every_start_is_closed(rig, sid) == ["compression_refused"]
        assert refusal(rig, sid)["reason"] == "no_progress"
        pb = event_to_pb(rig.events(sid, "compression_refused")[0])
        assert pb.compression_refused.reason == events_pb2.COMPRESSION_REASON_NO_PROGRESS
    finally:
        await rig.close()


class FailingStore(MemoryStore):
    """Adversity: the store goes away between the start of a compaction and its commit."""

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
        raise Unavailable("store went away")


async def test_an_error_after_the_start_closes_with_a_failed_refusal() -> None:
    rig = await Rig.start(ScriptedSummarizer(), store=FailingStore)
    try:
        sid = await rig.session()
        await _turns(rig, sid, 6)
        with pytest.raises(Unavailable):
            await rig.compress(sid, profile=overrides(summarizer="scripted", strategies=["summarize"]))
        assert check_every_start_is_closed(rig, sid) == ["compression_refused"]
        assert refusal(rig, sid)["reason"] == "failed"
    finally:
        await rig.close()


# -- item 2: every stage in the report ----------------------------------------------------------


async def test_clearing_then_hard_truncation_reports_both_stages() -> None:
    rig = await Rig.start()
    try:
        sid = await rig.session()
        await _turns(rig, sid, 7)
        before = await rig.context(sid)
        report = await rig.compress(sid, profile=overrides(strategies=["clear_tool_results"]))
        assert report.compressed and report.method is Method.HARD_TRUNCATE
        assert [s.method for s in report.stages] == [Method.CLEAR_TOOL_RESULTS, Method.HARD_TRUNCATE]
        clear, cut = report.stages
        assert clear.messages_removed > 0 and clear.messages_added == clear.messages_removed
        assert cut.messages_removed > 0
        # The stages chain: each starts where the previous ended, from the report's before to after.
        assert clear.tokens_before == report.context_tokens_before
        assert clear.tokens_after == cut.tokens_before < clear.tokens_before
        assert cut.tokens_after == report.context_tokens_after < cut.tokens_before

        context = await rig.context(sid)
        assert is_legal(context)
        placeholders = [m for m in context if is_placeholder(m)]
        # Whatever truncation kept of the cleared results stays cleared (placeholders, stored).
        assert all(m.sequence_number > 0 for m in placeholders)
        kept = {m.sequence_number for m in context}
        assert not any(m.role is Role.TOOL and not is_placeholder(m) and m.sequence_number in kept for m in before[:4])

        event = rig.events(sid, "context_compressed")[0]
        assert [s["method"] for s in event.payload["stages"]] == ["clear_tool_results", "hard_truncate"]
        assert event.payload["stages"][1]["messages_removed"] == cut.messages_removed
        pb = event_to_pb(event).context_compressed
        assert [s.method for s in pb.stages] == [
            events_pb2.COMPRESSION_METHOD_CLEAR_TOOL_RESULTS,
            events_pb2.COMPRESSION_METHOD_HARD_TRUNCATE,
        ]
        response = report_to_compress_response(report)
        assert [s.messages_removed for s in response.stages] == [clear.messages_removed, cut.messages_removed]
        assert check_every_start_is_closed(rig, sid) == ["context_compressed"]
    finally:
        await rig.close()


async def test_without_the_fallback_a_clearing_only_profile_drops_no_turn() -> None:
    rig = await Rig.start()
    try:
        sid = await rig.session()
        await _turns(rig, sid, 7)
        users = [m.sequence_number for m in await rig.context(sid) if m.role is Role.USER]
        profile = overrides(strategies=["clear_tool_results"], hard_truncate_fallback=False)
        report = await rig.compress(sid, profile=profile)
        assert report.compressed and report.method is Method.CLEAR_TOOL_RESULTS
        assert [s.method for s in report.stages] == [Method.CLEAR_TOOL_RESULTS]
        assert report.stages[0].tokens_after == report.context_tokens_after < report.context_tokens_before
        context = await rig.context(sid)
        assert [m.sequence_number for m in context if m.role is Role.USER] == users
        assert any(is_placeholder(m) for m in context)
    finally:
        await rig.close()


async def test_a_single_stage_compaction_reports_one_stage() -> None:
    rig = await Rig.start(ScriptedSummarizer())
    try:
        sid = await rig.session()
        await _turns(rig, sid, 7)
        report = await rig.compress(sid, profile=overrides(summarizer="scripted", strategies=["summarize"]))
        assert report.compressed and report.method is Method.SUMMARY
        (stage,) = report.stages
        assert stage.method is Method.SUMMARY and stage.messages_added == 1
        assert (stage.tokens_before, stage.tokens_after) == (report.context_tokens_before, report.context_tokens_after)
        assert stage.messages_removed == report.messages_before - report.messages_after + 1
    finally:
        await rig.close()


def test_hard_truncation_may_follow_by_default() -> None:
    assert CompressionDefaults().hard_truncate_fallback is True


class SlowCommitStore(MemoryStore):
    """A commit that suspends (a disk sync, a database round trip), shielded from its caller's
    cancellation like every store's writes: cancelled mid-commit, the commit still lands."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.committing = asyncio.Event()
        self.commits: list[asyncio.Task[list[int]]] = []

    async def commit_compaction(self, session_id: str, **kwargs: Any) -> list[int]:
        async def slow() -> list[int]:
            self.committing.set()
            await asyncio.sleep(0.05)
            return await MemoryStore.commit_compaction(self, session_id, **kwargs)

        task = asyncio.ensure_future(slow())
        self.commits.append(task)
        return await asyncio.shield(task)


async def test_a_compaction_cancelled_mid_commit_closes_with_what_the_commit_did() -> None:
    """The caller goes away (a Compress whose deadline passed, a drain's cancel) while the store
    commits: the commit lands, so watchers are told ``context_compressed``, never ``refused``."""
    rig = await Rig.start(ScriptedSummarizer(), store=SlowCommitStore)
    try:
        sid = await rig.session()
        await _turns(rig, sid, 6)
        store = rig.store
        assert isinstance(store, SlowCommitStore)
        running = asyncio.create_task(
            rig.compress(sid, profile=overrides(summarizer="scripted", strategies=["summarize"]))
        )
        await asyncio.wait_for(store.committing.wait(), 5)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        await asyncio.gather(*store.commits)
        assert any(m.flags.is_summary for m in await rig.context(sid))  # the commit landed
        assert check_every_start_is_closed(rig, sid) == ["context_compressed"]
        assert not rig.events(sid, "compression_refused")
    finally:
        await rig.close()


class FlagFailsStore(MemoryStore):
    """The store goes away right after a compaction's commit, as it clears the session's
    ``context_truncated`` flag."""

    async def update_state(self, session_id: str, **kwargs: Any) -> Any:
        if kwargs.get("context_truncated") is False:
            raise Unavailable("store went away")
        return await super().update_state(session_id, **kwargs)


async def test_a_commit_that_landed_is_announced_though_clearing_the_truncation_flag_fails() -> None:
    rig = await Rig.start(ScriptedSummarizer(), store=FlagFailsStore)
    try:
        sid = await rig.session()
        await _turns(rig, sid, 6)
        await rig.store.update_state(sid, caller=ANONYMOUS, context_truncated=True)
        report = await rig.compress(sid, profile=overrides(summarizer="scripted", strategies=["summarize"]))
        assert report.compressed
        assert any(m.flags.is_summary for m in await rig.context(sid))
        assert check_every_start_is_closed(rig, sid) == ["context_compressed"]
    finally:
        await rig.close()
