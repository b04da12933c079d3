"""Compaction paths through the real engine: mid-turn, meta-summary, summarizer failures, concurrency,
the post-turn worker and the baseline (DESIGN §5.3, §5.4)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from contextsvc.core.calibration import Observation
from contextsvc.core.compression import DEFAULT_SUMMARY_PROMPT, META_SUMMARY_PROMPT
from contextsvc.core.compression.cheap import is_placeholder
from contextsvc.core.compression.formatting import CUT_MARKER
from contextsvc.core.messages import Flags, Message, Role
from contextsvc.core.session import ANONYMOUS
from contextsvc.core.tokens import EstimateMethod
from contextsvc.core.turns import analyze
from contextsvc.engine.validation import IncomingMessage
from contextsvc.ports import SummaryRequest
from contextsvc.stores.memory import MemoryStore
from tests.support.compaction_harness import (
    Rig,
    ScriptedSummarizer,
    a,
    check_view,
    overrides,
    t,
    u,
    view_rows,
    words,
)


def _payloads(rig: Rig, sid: str, kind: str) -> list[dict[str, Any]]:
    return [dict(e.payload) for e in rig.events(sid, kind)]


async def _fill(rig: Rig, sid: str, turns: int, *, output: int = 150, start: int = 0) -> None:
    for k in range(start, start + turns):
        await rig.append(
            sid,
            u(f"zq{k}ux ask {k}"),
            a("", (f"c{k}", "read_file")),
            t(f"c{k}", f"zq{k}tx " + words(output)),
            a(f"zq{k}fx ok {k}"),
        )


async def _fill_until(rig: Rig, sid: str, fraction: float, *, output: int = 150) -> int:
    k = 0
    while await rig.estimate(sid) < fraction * rig.window:
        assert k < 400, "the session stopped growing"
        await _fill(rig, sid, 1, output=output, start=k)
        k += 1
    return k


# --- mid-turn ------------------------------------------------------------------------------------


@pytest.mark.parametrize("keep_recent", [4, 8])
async def test_mid_turn_keeps_the_request_and_the_newest_messages_and_summarizes_the_rest(keep_recent: int) -> None:
    rig = await Rig.start()
    profile = overrides(keep_recent=keep_recent, strategies=["summarize"])
    keep = max(12, 2 * keep_recent)
    try:
        sid = await rig.session()
        await _fill(rig, sid, 3)
        (request,) = await rig.append(sid, u("zqreqx refactor the whole package, file by file"))
        compressed = None
        for k in range(200):
            before = await rig.context(sid)
            view = await rig.build(sid, mid_turn=True, profile=profile)
            check_view(view)
            if view.compression is not None and view.compression.compressed:
                compressed = (before, view)
                break
            calls = [(f"m{k}_{j}", "edit_file") for j in range(1 + k % 2)]  # some parallel calls
            await rig.append(sid, a(f"step {k}", *calls), *[t(cid, f"zqm{k}x " + words(120)) for cid, _ in calls])
        assert compressed is not None, "the long turn never compressed"
        before, view = compressed
        report = view.compression
        assert report.reason.value == "midturn"
        assert _payloads(rig, sid, "context_compressed")[0]["reason"] == "midturn"
        after = await rig.context(sid)
        assert after[0].flags.is_summary
        kept = [m.sequence_number for m in after[1:]]
        turn_start = next(i for i, m in enumerate(before) if m.sequence_number == request)
        tail = [m.sequence_number for m in before[turn_start + 1 :]]
        # The current request, then a tail of the same turn of at least `keep` messages, cut at a group boundary.
        assert kept[0] == request
        assert kept[1:] == tail[len(tail) - len(kept[1:]) :]
        assert keep <= len(kept) - 1 < keep + 3  # at most one more group than asked
        first_kept = next(m for m in after[1:] if m.sequence_number == kept[1])
        assert first_kept.role is Role.ASSISTANT
        # Older messages of the same turn were summarized (not just the older turns).
        replaced = {m.sequence_number for m in before if m.sequence_number not in set(kept)} - {
            after[0].sequence_number
        }
        assert any(s > request for s in replaced)
        # No tool-call group is split: every group of the new context is complete.
        assert all(g.complete for g in analyze(after).groups)
        assert analyze(after).groups
        assert view.estimate.total <= 0.65 * rig.window
    finally:
        await rig.close()


async def test_a_turn_whose_kept_part_is_over_the_aim_keeps_its_summary_and_clears_its_oldest_results() -> None:
    """One turn of parallel tool calls whose kept newest messages alone are over the aim: the
    summary (of the older turns and the earlier summary) is committed, with the oldest kept result
    cleared, rather than discarded for a hard truncation that drops them all unsummarized."""
    rig = await Rig.start()
    profile = overrides(keep_recent=2)
    try:
        sid = await rig.session()
        await rig.append(sid, u("zqkeyx the deploy key is KEY-7000"), a("noted"))
        for k in range(3):
            await rig.append(sid, u(f"ask {k} " + words(120)), a(f"ok {k} " + words(120)))
        first = await rig.compress(sid, profile=profile)
        assert first.compressed and first.method.value == "summary"
        (request,) = await rig.append(sid, u("zqreqx read every file"))
        for r in range(2):
            calls = [(f"r{r}_{j}", "read_file") for j in range(3)]
            size = rig.window * 17 // 100
            await rig.append(sid, a("", *calls), *[t(cid, rig.sized(size, prefix=f"zq{cid}x")) for cid, _ in calls])
        before = await rig.rows(sid)
        view = await rig.build(sid, mid_turn=True, profile=profile)
        check_view(view)
        report = view.compression
        assert report is not None and report.compressed
        assert report.method.value == "summary"
        assert [s.method.value for s in report.stages] == ["summary", "clear_tool_results"]
        assert report.stages[1].tokens_before > report.stages[1].tokens_after == report.context_tokens_after
        context = await rig.context(sid)
        summary, kept = context[0], context[1:]
        assert summary.flags.is_summary and "KEY-7000" in summary.content  # the earlier summary's fact
        assert kept[0].sequence_number == request
        cleared = [m for m in kept if is_placeholder(m)]
        assert cleared and all(m.role is Role.TOOL for m in cleared)
        assert all(g.complete for g in analyze(context).groups)  # every kept call still answered
        assert view.estimate.total <= 0.65 * rig.window
        # Nothing lost: every row appended is still in the display history.
        display = {m.sequence_number for m in await rig.rows(sid) if m.flags.is_display}
        assert {m.sequence_number for m in before if m.flags.is_display} <= display
    finally:
        await rig.close()


# --- meta-summary --------------------------------------------------------------------------------


def _old_summary(k: int, chars: int) -> IncomingMessage:
    text = f"zqsum{k}x earlier summary {k}: " + words(chars // 6)
    return IncomingMessage(
        Message(role=Role.USER, content=text[:chars], flags=Flags(is_summary=True, is_display=False))
    )


async def test_several_large_old_summaries_are_merged_first() -> None:
    recorder = ScriptedSummarizer()
    rig = await Rig.start(recorder)
    try:
        sid = await rig.session()
        await rig.append(sid, *[_old_summary(k, 4000) for k in range(3)])  # 12,000 chars > 10,600
        await _fill(rig, sid, 10)
        report = await rig.compress(sid, profile=overrides(summarizer="scripted", strategies=["summarize"]))
        assert report.compressed and report.method.value == "summary"
        assert len(recorder.calls) == 2
        meta, main = recorder.calls
        # The merge is asked with the merge prompt (it once got the conversation prompt).
        assert meta.instructions == META_SUMMARY_PROMPT and main.instructions == DEFAULT_SUMMARY_PROMPT
        assert [m.content[:8] for m in meta.messages] == ["zqsum0x ", "zqsum1x ", "zqsum2x "]
        assert all(m.flags.is_summary for m in meta.messages)
        assert "[summary 1 of 3" in meta.text and "[summary 3 of 3" in meta.text
        # The main call reads the merge instead of the three originals.
        assert "summarized 3 messages (call 1)" in main.text
        assert "zqsum0x" not in main.text and "zqsum2x" not in main.text
        assert "zq0ux" in main.text  # and the dropped turns
    finally:
        await rig.close()


async def test_a_refused_merge_is_a_failed_attempt() -> None:
    """A merge that comes back as a refusal never reaches the main summary's input as "the earlier
    summaries": the attempt fails, and the documented fallback runs."""
    refusing = ScriptedSummarizer(default=lambda request: "I'm sorry, but I can't help with that.")
    rig = await Rig.start(refusing)
    try:
        sid = await rig.session()
        await rig.append(sid, *[_old_summary(k, 4000) for k in range(3)])
        await _fill(rig, sid, 10)
        report = await rig.compress(sid, profile=overrides(summarizer="scripted", strategies=["summarize"]))
        assert report.compressed and report.method.value == "hard_truncate"
        assert all(call.instructions == META_SUMMARY_PROMPT for call in refusing.calls)
    finally:
        await rig.close()


async def test_small_old_summaries_are_not_merged() -> None:
    recorder = ScriptedSummarizer()
    rig = await Rig.start(recorder)
    try:
        sid = await rig.session()
        await rig.append(sid, *[_old_summary(k, 3000) for k in range(3)])  # 9,000 chars <= 10,600
        await _fill(rig, sid, 10)
        await rig.compress(sid, profile=overrides(summarizer="scripted", strategies=["summarize"]))
        assert len(recorder.calls) == 1
        assert "zqsum0x" in recorder.calls[0].text
    finally:
        await rig.close()


# --- summarizer failures -------------------------------------------------------------------------


@pytest.mark.parametrize("failure", ["raise", "huge", "empty"])
async def test_summarizer_failure_retries_wider_then_hard_truncates_and_the_turn_succeeds(failure: str) -> None:
    broken = ScriptedSummarizer(default=failure)
    rig = await Rig.start(broken, system_prompt="You are a careful coding agent. " + words(60))
    profile = overrides(summarizer="scripted", strategies=["summarize"])
    try:
        sid = await rig.session()
        await _fill_until(rig, sid, 0.95, output=150)
        incoming = u("zqnextx what next? " + words(150))
        view = await rig.build(sid, incoming=incoming, profile=profile)
        check_view(view)
        assert view.compression is not None and view.compression.compressed
        assert view.compression.method.value == "hard_truncate"
        assert view.estimate.total <= 0.5 * rig.window  # the whole view, prompt and incoming included
        assert view_rows(view)[-1].content == incoming.message.content
        done = _payloads(rig, sid, "context_compressed")
        assert [p["method"] for p in done] == ["hard_truncate"]
        # Two summarizer attempts, the second with a wider keep window (fewer rows to summarize).
        assert len(broken.calls) == 2
        assert len(broken.calls[1].messages) < len(broken.calls[0].messages)
        # Nothing written by a failed attempt survives: no summary anywhere.
        assert not any(m.flags.is_summary for m in await rig.rows(sid))
    finally:
        await rig.close()


async def test_a_summarizer_that_gives_no_answer_is_called_once_then_hard_truncates() -> None:
    """No answer at all (its own timeouts spent, or nobody listening): a second call with a wider
    keep window would wait its whole bound again, holding the caller's turn twice as long (a hung
    summarizer held a pre-turn build for 2 x total_timeout_seconds, past the compaction lock's
    wait). One call, then the fallback, and the turn succeeds."""
    hung = ScriptedSummarizer(default="unavailable")
    rig = await Rig.start(hung)
    profile = overrides(summarizer="scripted", strategies=["summarize"])
    try:
        sid = await rig.session()
        await _fill_until(rig, sid, 0.95, output=150)
        view = await rig.build(sid, incoming=u("zqnextx what next?"), profile=profile)
        check_view(view)
        assert view.compression is not None and view.compression.method.value == "hard_truncate"
        assert len(hung.calls) == 1
        kinds = [e.kind for e in rig.events(sid, "compression_started", "context_compressed", "compression_refused")]
        assert kinds == ["compression_started", "context_compressed"]
    finally:
        await rig.close()


async def test_forced_with_the_summarizer_down_under_the_hard_truncate_level_still_compacts() -> None:
    """A small context (under 0.5 x window) and a failing summarizer: the announced compaction is
    carried out (oldest turns dropped to the plan's kept part), never a started without an outcome."""
    broken = ScriptedSummarizer(default="raise")
    rig = await Rig.start(broken)
    try:
        sid = await rig.session()
        await _fill(rig, sid, 12)
        assert await rig.estimate(sid) < 0.5 * rig.window
        dry = await rig.compress(sid, profile=overrides(summarizer="scripted"), dry_run=True)
        report = await rig.compress(sid, profile=overrides(summarizer="scripted"))
        assert report.compressed and report.method.value == "hard_truncate"
        assert report.context_tokens_after < report.context_tokens_before
        kept = [m.sequence_number for m in await rig.context(sid)]
        assert kept == list(dry.plan.keep_sequences)
        kinds = [e.kind for e in rig.events(sid, "compression_started", "context_compressed")]
        assert kinds == ["compression_started", "context_compressed"]
    finally:
        await rig.close()


async def test_first_attempt_fails_the_wider_retry_succeeds() -> None:
    flaky = ScriptedSummarizer(script=["raise"])
    rig = await Rig.start(flaky)
    try:
        sid = await rig.session()
        await _fill(rig, sid, 30)
        report = await rig.compress(sid, profile=overrides(summarizer="scripted", strategies=["summarize"]))
        assert report.method.value == "summary"
        assert len(flaky.calls) == 2
        assert len(report.plan.drop) == len(flaky.calls[1].messages) < len(flaky.calls[0].messages)
    finally:
        await rig.close()


async def test_a_summary_larger_than_what_it_replaces_is_discarded_even_when_the_view_would_cut_it() -> None:
    """The summary is priced whole: a view-cut copy of a huge summary must not pass as progress."""
    rig_summarizer = ScriptedSummarizer(default="huge")
    rig = await Rig.start(rig_summarizer)
    try:
        sid = await rig.session()
        await _fill(rig, sid, 30, output=300)
        report = await rig.compress(sid, profile=overrides(summarizer="scripted", strategies=["summarize"]))
        assert report.method.value == "hard_truncate"
        assert not any(m.flags.is_summary for m in await rig.rows(sid))
    finally:
        await rig.close()


def _over_its_cap(request: SummaryRequest) -> str:
    """A model that ignores ``max_tokens``: ~4x the cap of detail lines, then its KEYS line (still
    far shorter than the turns it replaces)."""
    lines = [f"- step {k}: zqdetail{k}x the handler kept its behaviour and its tests passed" for k in range(400)]
    text = "\n".join(lines)[: request.max_tokens * 4 * 4]
    return f"- zqheadx the session fixed many modules\n{text}\nKEYS: zqkeyx"


async def test_a_summary_past_the_output_cap_it_was_sent_is_cut_to_it_with_its_facts() -> None:
    """Stored whole, a summary 4x its cap took room the plan kept for the recent turns and every
    later view cut its middle at the per-message budget. It is cut to the cap (its head kept, marked
    as cut) and the facts sent with it added back; the view then shows it whole."""
    rig = await Rig.start(ScriptedSummarizer(default=_over_its_cap))
    profile = overrides(summarizer="scripted", strategies=["summarize"])
    try:
        sid = await rig.session()
        await _fill(rig, sid, 30, output=300)
        report = await rig.compress(sid, profile=profile)
        assert report.method.value == "summary"
        (summary,) = [m for m in await rig.context(sid) if m.flags.is_summary]
        cap = min(6000, int(0.1 * rig.window))
        assert rig.engine.accounting.message_tokens("m", summary) <= cap
        assert summary.content.startswith("- zqheadx")
        assert CUT_MARKER in summary.content and "zqkeyx" in summary.metadata["breadcrumbs"]
        view = await rig.build(sid, profile=profile)
        shown = [vm for vm in view.messages if vm.message.flags.is_summary]
        assert shown and shown[0].message.content == summary.content  # not cut again by the view
    finally:
        await rig.close()


# --- concurrency ---------------------------------------------------------------------------------


async def test_concurrent_builds_and_appends_commit_exactly_one_compaction() -> None:
    slow = ScriptedSummarizer(delay=0.02)
    # Builds here must wait for the one compaction (what is asserted), not fall back to truncation
    # after ``build_wait_seconds`` when a loaded machine stretches a 20 ms summary past it.
    rig = await Rig.start(slow, hot_path={"build_wait_seconds": 60})
    profile = overrides(summarizer="scripted", strategies=["summarize"])
    try:
        sid = await rig.session()
        await rig.build(sid, auto=False, profile=profile)  # remembers the profile
        await _fill_until(rig, sid, 0.92)
        old_context = {m.sequence_number for m in await rig.context(sid)}

        async def appender(k: int) -> None:
            for j in range(3):
                await rig.append(sid, u(f"zqcc{k}_{j}x concurrent note {k}.{j}"), a(f"noted {k}.{j}"))
                await asyncio.sleep(0)

        results = await asyncio.gather(
            *[rig.build(sid, profile=profile) for _ in range(10)], *[appender(k) for k in range(3)]
        )
        views = results[:10]
        assert len(rig.events(sid, "context_compressed")) == 1
        assert len(rig.events(sid, "compression_started")) == 1
        assert len(rig.events(sid, "memory_flush_due")) == 1
        rows = await rig.rows(sid)
        (summary,) = [m for m in rows if m.flags.is_summary]
        (record,) = [m for m in rows if m.flags.is_compression]
        replaced = {s for first, last in record.metadata["demoted_ranges"] for s in range(first, last + 1)}
        assert replaced and replaced <= old_context
        for view in views:
            check_view(view)
            seqs = {m.sequence_number for m in view_rows(view)}
            if summary.sequence_number in seqs:
                assert not seqs & replaced, "a view holds a summary and a row it replaced"
            else:
                assert replaced <= seqs, "a view without the summary lost rows"
        # Sequence numbers stay gap-free: 10 builds, 9 appends and one commit never collided.
        assert [m.sequence_number for m in rows] == list(range(1, len(rows) + 1))
        assert (await rig.session_info(sid)).last_sequence == len(rows)
        # The concurrent appends all stayed in the context.
        context = {m.sequence_number for m in await rig.context(sid)}
        notes = [m.sequence_number for m in rows if m.content.startswith("zqcc")]
        assert len(notes) == 9 and set(notes) <= context
    finally:
        await rig.close()


async def test_concurrent_forced_and_automatic_never_double_compress_the_same_rows() -> None:
    slow = ScriptedSummarizer(delay=0.02)
    rig = await Rig.start(slow)
    profile = overrides(summarizer="scripted", strategies=["summarize"])
    try:
        sid = await rig.session()
        await _fill_until(rig, sid, 0.92)
        outcomes = await asyncio.gather(
            rig.build(sid, profile=profile), rig.compress(sid, profile=profile), return_exceptions=True
        )
        assert not [o for o in outcomes if isinstance(o, Exception) and type(o).__name__ != "NothingToCompact"]
        rows = await rig.rows(sid)
        demoted: list[int] = []
        for record in (m for m in rows if m.flags.is_compression):
            demoted += [s for first, last in record.metadata["demoted_ranges"] for s in range(first, last + 1)]
        assert len(demoted) == len(set(demoted))  # no row demoted twice
        assert sum(1 for m in await rig.context(sid) if m.flags.is_summary) == 1
    finally:
        await rig.close()


class SlowCalibrationStore(MemoryStore):
    """Adversity: persisting a baseline observation takes a while, so a compaction can commit meanwhile."""

    async def add_calibration_observation(self, model: str, observation: Observation) -> None:
        await asyncio.sleep(0.05)
        await super().add_calibration_observation(model, observation)


async def test_a_baseline_recorded_during_a_compaction_does_not_undo_it() -> None:
    rig = await Rig.start(store=SlowCalibrationStore)
    try:
        sid = await rig.session()
        await _fill(rig, sid, 20)
        view = await rig.build(sid, auto=False)
        recording = asyncio.create_task(rig.baseline(sid, view))
        await asyncio.sleep(0.01)  # RecordBaseline has read the session and is storing its observation
        report = await rig.compress(sid)
        await recording
        assert report.compressed
        info = await rig.session_info(sid)
        assert info.state["epoch"] == 1  # the compaction's cycle was not written over
        assert "baseline" not in info.state  # a baseline of the pre-compaction view is no anchor
        assert (await rig.build(sid, auto=False)).estimate.method is not EstimateMethod.BASELINE_DELTA
    finally:
        await rig.close()


async def test_a_profile_remembered_during_a_compaction_is_kept() -> None:
    """The post-turn check prices with the newest BuildContext's profile; a compaction committing
    the state it read before must not bring back the older profile."""
    slow = ScriptedSummarizer(delay=0.5)
    rig = await Rig.start(slow)
    first = overrides(summarizer="scripted", strategies=["summarize"])
    second = overrides(summarizer="scripted", strategies=["summarize"], keep_recent=2)
    try:
        sid = await rig.session()
        await rig.build(sid, auto=False, profile=first)
        await _fill_until(rig, sid, 0.92)
        compacting = asyncio.create_task(rig.build(sid, profile=first))
        # Wait (bounded) until the compaction is inside the summarizer call, however busy the machine.
        for _ in range(500):
            if slow.calls or compacting.done():
                break
            await asyncio.sleep(0.01)
        assert slow.calls
        await rig.build(sid, profile=second)
        await compacting
        info = await rig.session_info(sid)
        assert info.state["epoch"] == 1
        assert info.state["profile"]["compression"]["keep_recent"] == 2
    finally:
        await rig.close()


async def test_a_profile_remembered_while_a_compaction_waits_for_the_lock_is_kept() -> None:
    """B remembers its profile between A's read of the session and A's compaction: A must commit
    on the state as it is then, not on the one it read first."""
    slow = ScriptedSummarizer(delay=0.02)
    rig = await Rig.start(slow)
    first = overrides(summarizer="scripted", strategies=["summarize"])
    second = overrides(summarizer="scripted", strategies=["summarize"], keep_recent=3)
    try:
        sid = await rig.session()
        await rig.build(sid, auto=False, profile=first)
        await _fill_until(rig, sid, 0.92)
        await asyncio.gather(rig.build(sid, profile=first), rig.build(sid, profile=second))
        info = await rig.session_info(sid)
        assert len(rig.events(sid, "context_compressed")) == 1
        assert info.state["profile"]["compression"]["keep_recent"] == 3
    finally:
        await rig.close()


# --- post-turn -----------------------------------------------------------------------------------


async def test_turn_complete_schedules_a_post_turn_compaction_when_over_threshold() -> None:
    rig = await Rig.start()
    try:
        sid = await rig.session()
        await _fill_until(rig, sid, 0.5)
        await rig.append(sid, a("turn done"), turn_complete=True)
        assert await rig.engine.post_turn.drain(10)
        assert not rig.events(sid, "compression_started", "context_compressed")  # under the threshold

        await _fill_until(rig, sid, 0.92)
        await rig.append(sid, a("turn done"), turn_complete=True)
        assert await rig.engine.post_turn.drain(10)
        kinds = [e.kind for e in rig.events(sid, "compression_started", "context_compressed")]
        assert kinds == ["compression_started", "context_compressed"]
        done = _payloads(rig, sid, "context_compressed")[0]
        assert done["reason"] == "postturn" and done["context_tokens_after"] <= 0.65 * rig.window
        assert await rig.estimate(sid) <= 0.65 * rig.window
    finally:
        await rig.close()


async def test_truncated_baseline_makes_the_post_turn_check_compress_regardless_of_threshold() -> None:
    rig = await Rig.start()
    try:
        sid = await rig.session()
        await _fill_until(rig, sid, 0.6)
        view = await rig.build(sid)
        assert view.compression is None  # 60%: no trigger
        result = await rig.engine.record_baseline(
            ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=view.estimate.total // 2
        )
        assert result.truncated and not result.recorded
        assert await rig.engine.post_turn.drain(10)
        done = _payloads(rig, sid, "context_compressed")
        assert [p["reason"] for p in done] == ["postturn"]
        info = await rig.session_info(sid)
        assert not info.context_truncated
        assert "baseline" not in info.state
    finally:
        await rig.close()


async def test_truncated_baseline_inside_the_hysteresis_band_is_refused_until_the_band_is_crossed() -> None:
    """DESIGN §5.4 exempts only forced runs from the band: a truncated prompt right after a
    compaction is refused (loop_guard), keeps its flag, and compresses once the band is crossed."""
    rig = await Rig.start()
    try:
        sid = await rig.session()
        await _fill_until(rig, sid, 0.92)
        first = await rig.build(sid)
        assert first.compression is not None and first.compression.compressed
        after = _payloads(rig, sid, "context_compressed")[0]["context_tokens_after"]
        await _fill(rig, sid, 2, start=500)  # some growth, far less than the band
        view = await rig.build(sid)
        assert view.compression is None
        await rig.engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=view.estimate.total // 2)
        assert await rig.engine.post_turn.drain(10)
        refused = _payloads(rig, sid, "compression_refused")
        assert [(p["reason"], p["trigger"]) for p in refused] == [("loop_guard", "postturn")]
        assert [p["reason"] for p in _payloads(rig, sid, "context_compressed")] == ["preturn"]
        assert (await rig.session_info(sid)).context_truncated  # still owed a compaction

        # Past the band (but under the threshold) the next post-turn check compresses: the flag did it.
        k = 0
        while await rig.estimate(sid) < after + (0.9 - 0.65) * rig.window:
            assert k < 1000
            # Steps of a few tokens: the room between the band and the threshold is only what the
            # compaction left under its target (~20 tokens), so a bigger step could overshoot both.
            await rig.append(sid, u(f"n{k}"))
            k += 1
        assert await rig.estimate(sid) < 0.9 * rig.window
        await rig.append(sid, a("turn done"), turn_complete=True)
        assert await rig.engine.post_turn.drain(10)
        assert [p["reason"] for p in _payloads(rig, sid, "context_compressed")] == ["preturn", "postturn"]
        assert not (await rig.session_info(sid)).context_truncated
    finally:
        await rig.close()


# --- baseline ------------------------------------------------------------------------------------


async def test_compaction_clears_the_baseline_and_resets_context_tokens() -> None:
    rig = await Rig.start(system_prompt="You are terse.")
    try:
        sid = await rig.session()
        await _fill(rig, sid, 20)
        old_view = await rig.build(sid)
        assert (await rig.baseline(sid, old_view)).recorded
        await rig.append(sid, u("one more"))
        with_baseline = await rig.engine.estimate_tokens(
            ANONYMOUS, model="", messages=(), session_id=sid, profile=overrides()
        )
        assert with_baseline.method is EstimateMethod.BASELINE_DELTA

        report = await rig.compress(sid)
        assert report.compressed
        info = await rig.session_info(sid)
        assert "baseline" not in info.state
        after = await rig.engine.estimate_tokens(ANONYMOUS, model="", messages=(), session_id=sid, profile=overrides())
        assert after.method is not EstimateMethod.BASELINE_DELTA
        assert info.context_tokens == report.context_tokens_after
        # The same calibrated estimate; the view rounds per segment (system, summaries, messages).
        assert abs(after.total - info.context_tokens) <= 3
        # A baseline for a view built before the compaction calibrates but cannot come back as the anchor.
        assert (await rig.baseline(sid, old_view)).recorded
        assert "baseline" not in (await rig.session_info(sid)).state
        assert (await rig.build(sid, auto=False)).estimate.method is not EstimateMethod.BASELINE_DELTA
    finally:
        await rig.close()


async def test_a_fallback_view_is_not_priced_with_the_whole_contexts_baseline() -> None:
    """While another compaction holds the lock past ``build_wait_seconds``, a build serves a
    hard-truncated view. The session's baseline counts the whole context: baseline + delta on the
    truncated one would count the dropped turns too and fail the turn with CONTEXT_TOO_LARGE
    (the PostgreSQL soak, bench/fidelity/soak.py)."""
    rig = await Rig.start(hot_path={"build_wait_seconds": 0.05})
    budget = rig.window - 512
    trigger = 0.9 * rig.window
    try:
        sid = await rig.session()
        k = 0
        while await rig.estimate(sid) < trigger - 700:
            assert k < 300
            await rig.append(sid, u(f"ask {k}"), a(f"answer {k} " + words(60)))
            k += 1
        view = await rig.build(sid, auto=False)  # the whole context, and a baseline for it
        await rig.engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=view.estimate.total)
        assert await rig.engine.anchors_applied(5)
        # The baseline's post-turn check runs now, under the trigger: appends on the memory store
        # never yield, so left pending it would run at the first await below, over the trigger.
        assert await rig.engine.post_turn.drain(5)
        while await rig.estimate(sid) <= budget:
            assert k < 400
            await rig.append(sid, u(f"ask {k}"), a(f"answer {k} " + words(60)))
            k += 1
        release, held = asyncio.Event(), asyncio.Event()

        async def compaction() -> None:  # another request's compaction, inside its summarizer call
            async with rig.engine.compactor.lock(sid):
                held.set()
                await release.wait()

        running = asyncio.create_task(compaction())
        await held.wait()
        fallback = await rig.build(sid)  # served, not CONTEXT_TOO_LARGE
        assert any("still running" in n for n in fallback.notices)
        assert fallback.estimate.total <= budget
        release.set()
        await running
    finally:
        await rig.close()


async def test_one_compactions_summarizer_calls_share_the_summarizers_total_timeout() -> None:
    """A summarizer that hangs held the session's compaction lock for each of a compaction's calls
    (the summary, then again with a wider window), each up to ``total_timeout_seconds``: longer
    than ``postgres.compaction_lock_timeout_seconds``, checked against one such timeout at start.
    The calls share that one budget; past it the compaction falls back at once."""
    from contextsvc.config import OpenAISummarizerConfig, SummarizerSettings

    hanging = ScriptedSummarizer("openai", delay=30.0)
    rig = await Rig.start(
        hanging, summarizer=SummarizerSettings(openai=OpenAISummarizerConfig(total_timeout_seconds=0.5))
    )
    try:
        sid = await rig.session()
        await _fill(rig, sid, 30)
        loop = asyncio.get_running_loop()
        started = loop.time()
        report = await asyncio.wait_for(
            rig.compress(sid, profile=overrides(summarizer="openai", strategies=["summarize"])), 20
        )
        took = loop.time() - started
        assert report.compressed and report.method.value == "hard_truncate"
        assert len(hanging.calls) == 1  # no wider attempt once the budget is spent
        assert 0.5 <= took < 5.0
    finally:
        await rig.close()
