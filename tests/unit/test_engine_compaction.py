"""Compaction rules through the real engine (DESIGN §5.4-§5.6): hysteresis, loop guard, memory flush,
what a compaction may change, pinned messages, per-profile overrides.

Each test drives ``Engine`` in process over ``MemoryStore`` + ``MemoryEventBus`` (see
``tests/support/compaction_harness.py``) and checks the rule on the events and the stored buffers.
"""

from __future__ import annotations

from typing import Any

import pytest

from contextsvc.core.messages import Flags, Role
from contextsvc.core.profile import ProfileOverrides
from contextsvc.core.session import ANONYMOUS
from contextsvc.errors import ContextTooLarge, FailedPrecondition, InvalidArgument, NothingToCompact
from tests.support.compaction_harness import (
    AgentLoop,
    DisplayLedger,
    Rig,
    ScriptedSummarizer,
    a,
    check_raw_index,
    check_view,
    overrides,
    t,
    u,
    view_rows,
    words,
)

THRESHOLD, TARGET = 0.90, 0.65
AUTOMATIC = {"preturn", "midturn", "postturn"}


def _payloads(rig: Rig, sid: str, kind: str) -> list[dict[str, Any]]:
    return [dict(e.payload) for e in rig.events(sid, kind)]


def check_hysteresis(
    rig: Rig, sid: str, loop: AgentLoop, *, threshold: float, target: float, trigger: float | None = None
) -> int:
    """Every automatic compaction fired over the trigger (``threshold x window`` unless given),
    reached the target, and the next one came only after a band of growth. One the margin alone
    started at the size guard's budget (its real count could pass it) is honoured inside the
    band, but only the margin may have made up the difference: growth >= band - margin."""
    window = rig.window
    trigger = threshold * window if trigger is None else trigger
    done = _payloads(rig, sid, "context_compressed")
    assert len(done) == len(loop.after_estimates), "a compaction went unmeasured"
    band = (threshold - target) * window
    for k, p in enumerate(done):
        assert p["reason"] in AUTOMATIC, p
        # The trigger compares estimate + margin; the event carries both.
        assert p["estimate_tokens"] + p.get("margin", 0) >= trigger, p
        assert p["context_tokens_after"] <= target * window, p
        assert p["context_tokens_after"] < p["context_tokens_before"], p
        # Measured independently after the commit: the view the runtime gets next.
        assert loop.after_estimates[k] <= target * window, (k, loop.after_estimates[k])
        if k:
            growth = p["estimate_tokens"] - loop.after_estimates[k - 1]
            at_budget = p["estimate_tokens"] + p["margin"] >= rig.window - rig.reserve
            least = band - p["margin"] if at_budget else band
            assert growth >= least, f"compaction {k} after only {growth} tokens of growth (band {band})"
    return len(done)


async def _loop(rig: Rig, *, turns: int, seed: int, **kw: Any) -> tuple[str, AgentLoop]:
    sid = await rig.session()
    loop = AgentLoop(rig, sid, seed=seed, **kw)
    await loop.run(turns)
    return sid, loop


# --- hysteresis over a long agent loop -----------------------------------------------------------


@pytest.mark.parametrize(
    ("seed", "background", "triggers"),
    [
        # Baselines and turn_complete: the post-turn worker checks after every baseline. With
        # estimate + margin a build (pre- or mid-turn, which sees the new tool output first) can
        # cross the trigger before it: which one gets there first depends on the seed and on
        # scheduling (since compactions aim estimate + margin at the goal, mostly the build).
        (1, True, set()),
        (2, True, set()),
        (3, False, {"preturn", "midturn"}),  # no post-turn checks: BuildContext compresses
    ],
)
async def test_long_agent_loop_keeps_hysteresis_and_every_invariant(
    seed: int, background: bool, triggers: set[str]
) -> None:
    rig = await Rig.start()
    try:
        sid, loop = await _loop(rig, turns=300, seed=seed, pin_every=60, baselines=background, turn_complete=background)
        compactions = check_hysteresis(rig, sid, loop, threshold=THRESHOLD, target=TARGET)
        assert compactions >= 10  # the loop really went round the cycle many times
        reasons = {p["reason"] for p in _payloads(rig, sid, "context_compressed")}
        assert triggers <= reasons
        assert not rig.events(sid, "compression_refused")
        methods = {p["method"] for p in _payloads(rig, sid, "context_compressed")}
        assert {"summary", "clear_tool_results"} <= methods
        # Every started event announced a compaction that happened, with the same trigger.
        started = [p["reason"] for p in _payloads(rig, sid, "compression_started")]
        assert started == [p["reason"] for p in _payloads(rig, sid, "context_compressed")]
        # No view ever went over the window (the size guard would have raised) and all were legal.
        assert all(v.estimate.total <= rig.window for v in loop.views)
        await loop.ledger.check(rig, sid)
        assert await check_raw_index(rig, sid) > 100
        await _check_pinned_after_summary(rig, sid)
        await _check_every_summary_expands_exactly(rig, sid)
    finally:
        await rig.close()


async def test_small_window_with_default_reply_reserve_compresses_before_the_size_guard() -> None:
    """window 8192, reserve 2048: the view budget (6144) is below 0.9 x window (7373). The session
    must be compressed before it stops fitting, not end in CONTEXT_TOO_LARGE."""
    rig = await Rig.start(reserve=2048)
    try:
        sid, loop = await _loop(rig, turns=150, seed=3)
        done = _payloads(rig, sid, "context_compressed")
        assert len(done) >= 5
        assert all(v.estimate.total <= v.estimate.budget for v in loop.views)
        budget = rig.window - 2048
        # Every compaction fired at the budget and left at most target x window: never refused, so
        # the growth between two is at least budget - target x window ...
        check_hysteresis(rig, sid, loop, threshold=budget / rig.window, target=TARGET, trigger=budget)
        assert not rig.events(sid, "compression_refused")
        # ... and the planner aims (threshold - target) x window below the budget, so compactions
        # normally leave the whole band of the design.
        aim = budget - (THRESHOLD - TARGET) * rig.window
        assert sum(a <= aim for a in loop.after_estimates) >= 0.8 * len(loop.after_estimates)
    finally:
        await rig.close()


@pytest.mark.parametrize("vision", [False, True])
async def test_agent_loop_with_screenshots_prices_compactions_like_the_view(vision: bool) -> None:
    """Images the view leaves out (no vision, or over the image budget) cost nothing in it; the
    compactor must price the kept part the same way, or it reports a context far larger than the
    view, over-compacts, and its loop guard then refuses compactions the session needs."""
    rig = await Rig.start(vision=vision)
    try:
        sid, loop = await _loop(rig, turns=150, seed=4, image_every=3)
        done = _payloads(rig, sid, "context_compressed")
        assert len(done) >= 5
        check_hysteresis(rig, sid, loop, threshold=THRESHOLD, target=TARGET)
        assert not rig.events(sid, "compression_refused")
        for p, measured in zip(done, loop.after_estimates, strict=True):
            # What the compaction reported is what the next view is estimated at (rounding apart).
            assert abs(p["context_tokens_after"] - measured) <= 5, (p, measured)
        assert any(v.estimate.images for v in loop.views) is vision
    finally:
        await rig.close()


async def _check_pinned_after_summary(rig: Rig, sid: str) -> None:
    rows = await rig.rows(sid)
    pinned = [m for m in rows if m.flags.is_pinned]
    assert pinned, "the loop pins standing rules"
    context = await rig.context(sid)
    assert [m.sequence_number for m in context if m.flags.is_pinned] == [m.sequence_number for m in pinned]
    summaries = [i for i, m in enumerate(context) if m.flags.is_summary]
    assert len(summaries) <= 1
    if summaries:
        first_pinned = min(i for i, m in enumerate(context) if m.flags.is_pinned)
        assert summaries[0] < first_pinned
    view = await rig.build(sid, auto=False)
    shown = {m.sequence_number: m.content for m in view_rows(view)}
    assert all(shown[m.sequence_number] == m.content for m in pinned)  # verbatim


async def _check_every_summary_expands_exactly(rig: Rig, sid: str) -> None:
    """ExpandSummary returns exactly the display rows each compaction replaced by that summary."""
    rows = await rig.rows(sid)
    by_seq = {m.sequence_number: m for m in rows}
    records = [m for m in rows if m.flags.is_compression and m.metadata.get("method") == "summary"]
    summaries = [m for m in rows if m.flags.is_summary]
    assert len(records) == len(summaries) and summaries
    replaced: dict[int, set[int]] = {}
    for record, summary in zip(records, summaries, strict=True):
        demoted = {s for first, last in record.metadata["demoted_ranges"] for s in range(first, last + 1)}
        originals: set[int] = set()
        for s in demoted:
            m = by_seq[s]
            if m.flags.is_summary:
                originals |= replaced[s]
            elif m.flags.is_display:
                originals.add(s)
            else:  # a cleared tool result's placeholder stands for its original
                originals.add(m.context_anchor)
        replaced[summary.sequence_number] = originals
        got = await rig.engine.expand_summary(ANONYMOUS, sid, sequence_number=summary.sequence_number)
        assert sorted(m.sequence_number for m in got) == sorted(originals), summary.sequence_number
        assert all(m.content == by_seq[m.sequence_number].content for m in got)


# --- loop guard ----------------------------------------------------------------------------------


async def test_loop_guard_refuses_an_automatic_rerun_inside_the_band_and_never_loops() -> None:
    """Pinned content near its cap plus a low target: no compaction can reach the target, the
    hard-truncate fallback lands above it, and the next trigger inside the band is refused."""
    rig = await Rig.start()
    profile = overrides(threshold=0.6, target=0.2)
    try:
        sid = await rig.session()
        # ~1900 pinned tokens (the cap is 2048): over the 0.2 x window target on their own.
        await rig.append(sid, u(rig.sized(1900, prefix="zq0pinx rules", role=Role.USER), pinned=True))
        await _fill(rig, sid, 20, output=150)
        first = await rig.build(sid, profile=profile)
        assert first.compression is not None and first.compression.compressed
        done = _payloads(rig, sid, "context_compressed")
        assert len(done) == 1 and done[0]["method"] == "hard_truncate"
        after = done[0]["context_tokens_after"]
        assert after > 0.2 * rig.window  # could not reach the target

        # Grow past the threshold again, but by less than (threshold - target) x window.
        k = 100
        while await rig.estimate(sid, profile) < 0.6 * rig.window:
            assert k < 400
            await rig.append(sid, u(f"ask {k}"), a(f"answer {k} " + words(60)))
            k += 1
        view = await rig.build(sid, profile=profile)
        assert view.estimate.total - after < (0.6 - 0.2) * rig.window
        assert view.compression is None or not view.compression.compressed
        refused = _payloads(rig, sid, "compression_refused")
        assert len(refused) == 1 and refused[0]["reason"] == "loop_guard" and refused[0]["trigger"] == "preturn"
        assert len(rig.events(sid, "context_compressed")) == 1
        assert len(rig.events(sid, "compression_started")) == 1  # a refusal announces nothing
        # The post-turn check on the same state refuses too, once per check, without looping.
        await rig.append(sid, a("more"), turn_complete=True)
        assert await rig.engine.post_turn.drain(10)
        assert len(rig.events(sid, "context_compressed")) == 1
        assert [p["trigger"] for p in _payloads(rig, sid, "compression_refused")] == ["preturn", "postturn"]
        # Past the band the guard lets the next compaction run.
        while await rig.estimate(sid, profile) < after + (0.6 - 0.2) * rig.window:
            assert k < 400
            await rig.append(sid, u(f"ask {k}"), a(f"answer {k} " + words(60)))
            k += 1
        await rig.build(sid, profile=profile)
        assert len(rig.events(sid, "context_compressed")) == 2
        # A forced compaction is never guarded.
        forced = await rig.compress(sid, profile=profile)
        assert forced.compressed
    finally:
        await rig.close()


async def test_the_loop_guard_never_fails_a_turn_another_compaction_would_fit() -> None:
    """On a window whose trigger is the size guard's budget, a compaction that could not reach its
    aim (pinned content) leaves the next crossing of the budget inside the band. Refusing it would
    fail the turn with CONTEXT_TOO_LARGE, so it compacts again (issue #14's soak)."""
    rig = await Rig.start(reserve=2048)
    profile = overrides(threshold=0.9, target=0.2)
    budget = rig.window - 2048  # below 0.9 x window: the trigger is the budget
    band = budget - 0.2 * rig.window
    try:
        sid = await rig.session()
        await rig.append(sid, u(rig.sized(1900, prefix="zq0pinx rules", role=Role.USER), pinned=True))
        k = 0
        while not _payloads(rig, sid, "context_compressed"):
            assert k < 200, "never compressed"
            await rig.append(sid, u(f"ask {k}"), a(f"answer {k} " + words(60)))
            k += 1
            await rig.build(sid, profile=profile)
        after = _payloads(rig, sid, "context_compressed")[0]["context_tokens_after"]
        assert after > 0.2 * rig.window  # the pinned rules: the aim was out of reach
        while len(_payloads(rig, sid, "context_compressed")) < 2:
            assert k < 400, "never compressed again"
            await rig.append(sid, u(f"ask {k}"), a(f"answer {k} " + words(60)))
            k += 1
            view = await rig.build(sid, profile=profile)  # every turn served: no ContextTooLarge
            assert view.estimate.total <= budget
        second = _payloads(rig, sid, "context_compressed")[1]
        # the budget was crossed (by estimate + margin: the real count could pass it)
        assert second["estimate_tokens"] + second["margin"] >= budget
        assert second["estimate_tokens"] - after < band  # inside the band: once refused
        assert "loop_guard" not in [p["reason"] for p in _payloads(rig, sid, "compression_refused")]
    finally:
        await rig.close()


async def test_loop_guard_after_one_enormous_turn() -> None:
    """One turn whose newest tool group alone is over the target, its results critical (never
    cleared, never cut short by a summary): the compaction cannot reach the target. No reply
    reserve: this cold session's estimate + margin stays under the size guard's budget (a crossing
    of the budget is always honoured), so the loop guard alone decides."""
    rig = await Rig.start(reserve=0)
    profile = overrides(threshold=0.7, target=0.3)
    try:
        sid = await rig.session()
        for k in range(6):
            await rig.append(sid, u(f"old ask {k}"), a(f"old answer {k} " + words(150)))
        calls = [(f"big{j}", "read_file") for j in range(4)]
        critical = Flags(is_compression_critical=True)
        results = [t(cid, rig.sized(1200), flags=critical) for cid, _ in calls]
        await rig.append(sid, u("the big one"), a("", *calls), *results)
        first = await rig.build(sid, mid_turn=True, profile=profile)
        assert first.compression is not None and first.compression.compressed
        assert first.compression.reason.value == "midturn"
        after = _payloads(rig, sid, "context_compressed")[0]["context_tokens_after"]
        assert after > 0.3 * rig.window
        await rig.append(sid, a(rig.sized(1100, prefix="still working", role=Role.ASSISTANT)))
        second = await rig.build(sid, mid_turn=True, profile=profile)
        assert second.estimate.total >= 0.7 * rig.window
        assert [p["reason"] for p in _payloads(rig, sid, "compression_refused")] == ["loop_guard"]
        assert len(rig.events(sid, "context_compressed")) == 1
    finally:
        await rig.close()


# --- memory flush -----------------------------------------------------------------------------


async def test_memory_flush_due_once_per_cycle_when_crossing_the_soft_threshold() -> None:
    rig = await Rig.start(window=32768)  # soft threshold 29491 - 4000 = 25491, above the target
    try:
        sid = await rig.session()
        soft = THRESHOLD * 32768 - rig.settings.summarizer.memory_flush_soft_tokens
        cycles = 0
        k = 0
        crossed_at: list[int] = []
        while cycles < 3:
            assert k < 500, "the session never compressed"
            await rig.append(sid, u(f"ask {k}"), a("", (f"c{k}", "grep")), t(f"c{k}", words(400)), a(f"ok {k}"))
            k += 1
            view = await rig.build(sid)
            flushes = rig.events(sid, "memory_flush_due")
            if len(flushes) > len(crossed_at):
                # estimate + margin, the quantity the compaction trigger compares
                crossed_at.append(int(flushes[-1].payload["context_tokens"]) + int(flushes[-1].payload["margin"]))
            if view.compression is not None and view.compression.compressed:
                cycles += 1
                assert len(crossed_at) == cycles, "one flush in each cycle, before its compaction"
            # Builds below the soft threshold never flush; above it, only once.
            assert len(rig.events(sid, "memory_flush_due")) <= cycles + 1
        assert all(c >= soft for c in crossed_at)
        events = [e.kind for e in rig.events(sid, "memory_flush_due", "context_compressed")]
        assert events == ["memory_flush_due", "context_compressed"] * 3
    finally:
        await rig.close()


async def test_memory_flush_not_repeated_right_after_a_compaction_on_a_small_window() -> None:
    """When threshold x window - soft tokens lies below the target (window 8192: 3373 < 5324), the
    context after a compaction is already past it; the flush must wait for real growth."""
    rig = await Rig.start()
    try:
        sid = await rig.session()
        for k in range(40):
            await rig.append(sid, u(f"ask {k}"), a("", (f"c{k}", "grep")), t(f"c{k}", words(200)), a(f"ok {k}"))
        view = await rig.build(sid)
        assert view.compression is not None and view.compression.compressed
        assert len(rig.events(sid, "memory_flush_due")) == 1
        await rig.append(sid, u("a small follow-up"))
        await rig.build(sid)
        assert len(rig.events(sid, "memory_flush_due")) == 1  # nothing grew since the compaction
    finally:
        await rig.close()


# --- started / nothing to compact ----------------------------------------------------------------


async def test_forced_on_an_incompressible_session_is_nothing_to_compact_without_started() -> None:
    rig = await Rig.start()
    try:
        sid = await rig.session()
        with pytest.raises(NothingToCompact):
            await rig.compress(sid)
        await rig.append(sid, u("one question " + words(50)), a("one answer"))
        with pytest.raises(NothingToCompact) as err:
            await rig.compress(sid)
        assert err.value.reason == "NOTHING_TO_COMPACT"
        dry = await rig.compress(sid, dry_run=True)
        assert not dry.compressed and not dry.plan.would_compress
        assert not rig.events(sid, "compression_started", "context_compressed")
    finally:
        await rig.close()


async def test_compression_started_only_when_the_plan_can_shrink() -> None:
    """Over the threshold with one turn made of one tool group that cannot be split: no started event."""
    rig = await Rig.start(reserve=0)
    try:
        sid = await rig.session()
        calls = [(f"c{j}", "read_file") for j in range(6)]
        await rig.append(sid, u("read them all"), a("", *calls), *[t(cid, rig.sized(1250)) for cid, _ in calls])
        assert await rig.estimate(sid) >= 0.9 * rig.window
        got = await rig.build(sid)
        assert got.compression is None or not got.compression.compressed
        assert not rig.events(sid, "compression_started", "context_compressed")
        with pytest.raises(NothingToCompact):
            await rig.compress(sid)
        assert not rig.events(sid, "compression_started")
    finally:
        await rig.close()


# --- what a compaction changes ------------------------------------------------------------------


async def test_forced_compactions_change_only_the_context_and_keep_everything_recoverable() -> None:
    rig = await Rig.start(system_prompt="You are a coding agent.")
    try:
        sid = await rig.session()
        ledger = DisplayLedger()
        for round_ in range(3):
            for k in range(12):
                n = round_ * 100 + k
                seqs = await rig.append(
                    sid,
                    u(f"zq{n}ux ask {n}"),
                    a(f"zq{n}ax", (f"c{n}", "read_file")),
                    t(f"c{n}", f"zq{n}tx " + words(150)),
                    a(f"zq{n}fx answer {n}"),
                )
                await ledger.record(rig, sid, seqs)
            strategies = ["summarize"] if round_ != 1 else ["clear_tool_results", "summarize"]
            report = await rig.compress(sid, profile=overrides(strategies=strategies))
            assert report.compressed
            check_view(await rig.build(sid, auto=False))
            await ledger.check(rig, sid)
        assert await check_raw_index(rig, sid) >= 30
        await _check_every_summary_expands_exactly(rig, sid)
    finally:
        await rig.close()


# --- pinned --------------------------------------------------------------------------------------


async def test_pinned_messages_survive_several_compactions_verbatim_in_order_after_the_summary() -> None:
    rig = await Rig.start()
    try:
        sid = await rig.session()
        pins: list[int] = []
        for k in range(4):
            pins += await rig.append(sid, u(f"zqpin{k}x rule {k}: " + words(40), pinned=True))
            for j in range(10):
                n = k * 10 + j
                await rig.append(sid, u(f"ask {n}"), a("", (f"c{n}", "grep")), t(f"c{n}", words(100)), a(f"ok {n}"))
            report = await rig.compress(sid, profile=overrides(strategies=["summarize"]))
            assert report.compressed and report.method.value == "summary"
            context = await rig.context(sid)
            assert context[0].flags.is_summary
            assert [m.sequence_number for m in context if m.flags.is_pinned] == pins
            view = view_rows(await rig.build(sid, auto=False))
            pinned_in_view = [m for m in view if m.flags.is_pinned]
            assert [m.sequence_number for m in pinned_in_view] == pins
            summary_at = next(i for i, m in enumerate(view) if m.flags.is_summary)
            assert all(view.index(m) > summary_at for m in pinned_in_view)
        stored = {m.sequence_number: m.content for m in await rig.rows(sid)}
        assert all(stored[p].startswith(f"zqpin{k}x rule {k}: ") for k, p in enumerate(pins))
    finally:
        await rig.close()


async def test_pinning_past_the_cap_is_refused() -> None:
    rig = await Rig.start()
    try:
        sid = await rig.session()
        await rig.append(sid, u("rule one " + words(1500), pinned=True))  # ~ 1500 tokens of a 2048 cap
        before = (await rig.session_info(sid)).last_sequence
        with pytest.raises(FailedPrecondition) as err:
            await rig.append(sid, u("rule two " + words(600), pinned=True))
        assert err.value.reason == "PINNED_CAP_EXCEEDED"
        assert int(err.value.metadata["cap"]) == int(0.25 * rig.window)
        assert (await rig.session_info(sid)).last_sequence == before  # nothing appended
        await rig.append(sid, u("not pinned " + words(600)))  # the same content unpinned is fine
    finally:
        await rig.close()


async def test_a_retried_pinned_append_is_answered_as_its_first_call_not_refused() -> None:
    """A runtime retries an append it saw fail (UNAVAILABLE while its replica died or PostgreSQL
    restarted) although it was stored. Its pinned row is then in the context already: the cap
    check must not count it twice and refuse the retry with PINNED_CAP_EXCEEDED."""
    rig = await Rig.start()
    try:
        sid = await rig.session()
        rule = u("rule one " + words(1500), pinned=True)  # ~ 1500 tokens of a 2048 cap: twice is over
        first = await rig.engine.append(ANONYMOUS, sid, [rule], request_id="pin-1", turn_complete=False)
        again = await rig.engine.append(ANONYMOUS, sid, [rule], request_id="pin-1", turn_complete=False)
        assert again.sequence_numbers == first.sequence_numbers
        assert again.context_tokens == first.context_tokens
        assert (await rig.session_info(sid)).last_sequence == first.sequence_numbers[-1]  # nothing appended
        with pytest.raises(FailedPrecondition) as err:  # another request over the cap is still refused
            await rig.engine.append(ANONYMOUS, sid, [rule], request_id="pin-2", turn_complete=False)
        assert err.value.reason == "PINNED_CAP_EXCEEDED"
        with pytest.raises(InvalidArgument) as reused:  # the id with other messages, as any append
            await rig.engine.append(
                ANONYMOUS, sid, [u("rule two " + words(1500), pinned=True)], request_id="pin-1", turn_complete=False
            )
        assert reused.value.reason == "REQUEST_ID_REUSED"
    finally:
        await rig.close()


async def test_the_pinned_cap_and_window_share_follow_the_window_the_builds_use() -> None:
    """A session whose builds send a smaller window inline than its named profile's: appends cap
    pinned rows by that window (which its builds and compactions use), and report their share of
    it, rather than the named profile's larger one (which let a pinned row in that no build could
    ever fit, and no compaction remove)."""
    rig = await Rig.start()
    small = ProfileOverrides(context_window=rig.window // 4)
    try:
        sid = await rig.session()
        await rig.append(sid, u("hello"))
        await rig.build(sid, profile=small)  # remembered as the session's profile
        with pytest.raises(FailedPrecondition) as err:
            await rig.append(sid, u("rule " + words(700), pinned=True))  # under the named cap, over this one
        assert err.value.reason == "PINNED_CAP_EXCEEDED"
        assert int(err.value.metadata["cap"]) == int(0.25 * rig.window // 4)
        out = await rig.engine.append(ANONYMOUS, sid, [u("more " + words(50))], request_id="", turn_complete=False)
        assert out.window_fraction == out.context_tokens / (rig.window // 4)
        # Built again with the named profile's window: both follow it back.
        await rig.build(sid, profile=ProfileOverrides(context_window=rig.window))
        out = await rig.engine.append(
            ANONYMOUS, sid, [u("rule " + words(700), pinned=True)], request_id="", turn_complete=False
        )
        assert out.window_fraction == out.context_tokens / rig.window
    finally:
        await rig.close()


# --- per-profile overrides ------------------------------------------------------------------------


async def _fill(rig: Rig, sid: str, turns: int, *, output: int = 150, start: int = 0) -> None:
    for k in range(start, start + turns):
        await rig.append(sid, u(f"ask {k}"), a("", (f"c{k}", "read_file")), t(f"c{k}", words(output)), a(f"ok {k}"))


async def test_compression_disabled_never_compresses_and_fails_when_over() -> None:
    rig = await Rig.start()
    off = overrides(enabled=False)
    try:
        sid = await rig.session()
        k = 0
        while await rig.estimate(sid, off) <= rig.window - 512:
            await _fill(rig, sid, 1, start=k)
            k += 1
        with pytest.raises(ContextTooLarge) as err:
            await rig.build(sid, profile=off)
        assert err.value.reason == "CONTEXT_TOO_LARGE"
        await rig.append(sid, a("done"), turn_complete=True)
        assert await rig.engine.post_turn.drain(10)  # the post-turn check honours the saved profile
        assert not rig.events(sid, "compression_started", "context_compressed", "memory_flush_due")
        assert len(await rig.context(sid)) == k * 4 + 1
    finally:
        await rig.close()


@pytest.mark.parametrize(
    ("threshold", "target", "level", "fires"),
    [
        (0.5, 0.3, 0.6, True),  # lowered: fires at 60% (the default 0.9 would not) and goes down to 30%
        (0.95, 0.6, 0.92, False),  # raised: 92% no longer fires (the default 0.9 would)
        (0.9, 0.65, 0.92, True),  # the defaults, on the same session shape
    ],
)
async def test_threshold_and_target_overrides_take_effect(
    threshold: float, target: float, level: float, fires: bool
) -> None:
    rig = await Rig.start()
    profile = overrides(threshold=threshold, target=target)
    try:
        sid = await rig.session()
        await _fill(rig, sid, 8)

        async def guarded() -> tuple[int, int]:
            # The trigger compares estimate + margin (DESIGN §5.3); this cold session has no
            # baselines, so its margin is the cold one (~15%), and `level` is placed on that sum.
            est = await rig.engine.estimate_tokens(
                ANONYMOUS, model="", messages=(), session_id=sid, profile=ProfileOverrides()
            )
            return est.guarded, est.margin

        k = 0
        while (await guarded())[0] < level * rig.window:  # small steps, to stop just past `level`
            assert k < 1000
            await rig.append(sid, u(f"note {k}"), a(f"ack {k} " + words(30)))
            k += 1
        assert (await guarded())[0] < min(0.95, level + 0.02) * rig.window
        _, margin = await guarded()
        view = await rig.build(sid, profile=profile)
        compressed = view.compression is not None and view.compression.compressed
        assert compressed is fires
        if fires:
            assert view.estimate.total <= target * rig.window
            done = _payloads(rig, sid, "context_compressed")[0]
            assert done["context_tokens_after"] <= target * rig.window
            # Events keep the estimate; the trigger fired on estimate + margin.
            assert done["estimate_tokens"] + margin >= threshold * rig.window
    finally:
        await rig.close()


async def test_strategy_summarize_only_never_clears_tool_results() -> None:
    """The session of the next test, where the default order clears: ``["summarize"]`` never does."""
    rig = await Rig.start()
    try:
        sid = await rig.session()
        await _fill(rig, sid, 12, output=500)
        report = await rig.compress(sid, profile=overrides(strategies=["summarize"]))
        assert report.method.value == "summary"
        assert not any(m.metadata.get("cleared_from") for m in await rig.rows(sid))
    finally:
        await rig.close()


async def test_strategy_clear_only_never_calls_the_summarizer() -> None:
    recorder = ScriptedSummarizer()
    rig = await Rig.start(recorder)
    try:
        sid = await rig.session()
        await _fill(rig, sid, 40, output=20)  # tool results too small for clearing to reach the target
        report = await rig.compress(sid, profile=overrides(summarizer="scripted", strategies=["clear_tool_results"]))
        assert report.method.value == "hard_truncate"
        assert recorder.calls == []
    finally:
        await rig.close()


@pytest.mark.parametrize("fallback", [True, False])
async def test_forced_clearing_under_the_target_clears_what_a_forced_run_must_shrink(fallback: bool) -> None:
    """A forced run with clearing only, on a context already under the target: clearing aims at
    the shrink a forced run must make (it aimed at the target, cleared nothing, and the run fell to
    a hard truncation, or, without that fallback, did nothing)."""
    rig = await Rig.start()
    try:
        sid = await rig.session()
        await _fill(rig, sid, 8, output=300)
        before = await rig.estimate(sid)
        assert before < 0.65 * rig.window
        profile = overrides(strategies=["clear_tool_results"], hard_truncate_fallback=fallback)
        report = await rig.compress(sid, profile=profile)
        assert report.compressed and report.method.value == "clear_tool_results"
        assert report.context_tokens_after <= 0.9 * report.context_tokens_before
        context = await rig.context(sid)
        cleared = [m for m in context if m.metadata.get("cleared_from")]
        assert cleared and len(context) == 8 * 4  # every turn kept, only results cleared
        # The oldest results went first; the newest is still whole.
        assert not context[-2].metadata.get("cleared_from")
    finally:
        await rig.close()


async def test_default_strategies_try_clearing_tool_results_first() -> None:
    recorder = ScriptedSummarizer()
    rig = await Rig.start(recorder)
    try:
        sid = await rig.session()
        await _fill(rig, sid, 12, output=500)
        report = await rig.compress(sid, profile=overrides(summarizer="scripted"))
        assert report.method.value == "clear_tool_results"
        assert recorder.calls == []  # clearing alone reached the target: no summary written
        cleared = [m for m in await rig.context(sid) if m.metadata.get("cleared_from")]
        assert cleared and all(not m.flags.is_display for m in cleared)
    finally:
        await rig.close()


@pytest.mark.parametrize(
    ("strategies", "output", "method", "fallback"),
    [
        (["clear_tool_results", "summarize"], 500, "clear_tool_results", True),  # clearing reaches the target
        (["clear_tool_results", "summarize"], 20, "summary", True),  # results too small: the summary follows
        (["summarize", "clear_tool_results"], 500, "summary", True),
        (["clear_tool_results"], 20, "hard_truncate", True),
        (["clear_tool_results"], 60, "clear_tool_results", False),  # no fallback: clearing alone
    ],
)
async def test_a_dry_run_names_what_the_run_then_does(
    strategies: list[str], output: int, method: str, fallback: bool
) -> None:
    """DESIGN §5.4: prediction and action never disagree. A dry run under a profile that clears
    tool results first used to show the summary's plan alone (drop 104, keep 16) while the run
    cleared 26 results; it names the method the run commits, and a clearing's counts exactly."""
    recorder = ScriptedSummarizer()
    rig = await Rig.start(recorder)
    try:
        sid = await rig.session()
        await _fill(rig, sid, 12, output=output)
        profile = overrides(summarizer="scripted", strategies=strategies, hard_truncate_fallback=fallback)
        before = await rig.context(sid)
        dry = await rig.compress(sid, profile=profile, dry_run=True)
        assert not dry.compressed and await rig.context(sid) == before and not recorder.calls
        assert dry.method is not None and dry.method.value == method
        report = await rig.compress(sid, profile=profile)
        assert report.compressed and report.method is not None and report.method.value == method
        assert (dry.messages_before, dry.context_tokens_before) == (
            report.messages_before,
            report.context_tokens_before,
        )
        if method in ("clear_tool_results", "hard_truncate"):
            # A hard truncation after a clearing that fell short: the dry run showed the plan
            # before the clearing (104 to drop) while the run dropped 44 of the cleared context.
            assert (dry.messages_after, dry.context_tokens_after) == (
                report.messages_after,
                report.context_tokens_after,
            )
            assert dry.stages == report.stages
            assert dry.plan is not None and report.plan is not None
            assert dry.plan.drop_sequences == report.plan.drop_sequences
    finally:
        await rig.close()


async def test_strategy_order_summarize_first_then_clearing() -> None:
    """``["summarize", "clear_tool_results"]``: the summarizer is asked first; clearing is the
    fallback when it fails, before hard truncation."""
    failing = ScriptedSummarizer(default="raise")
    rig = await Rig.start(failing)
    try:
        sid = await rig.session()
        await _fill(rig, sid, 12, output=500)
        report = await rig.compress(
            sid, profile=overrides(summarizer="scripted", strategies=["summarize", "clear_tool_results"])
        )
        assert failing.calls, "summarize comes first"
        assert report.method.value == "clear_tool_results"
    finally:
        await rig.close()


async def test_unknown_strategy_is_invalid_argument() -> None:
    rig = await Rig.start()
    try:
        sid = await rig.session()
        await _fill(rig, sid, 2)
        with pytest.raises(InvalidArgument) as err:
            await rig.build(sid, profile=overrides(strategies=["sumarize"]))
        assert [v.field for v in err.value.violations] == ["profile.compression.strategies"]
    finally:
        await rig.close()


async def test_the_note_of_a_forced_compaction_is_recorded_with_it() -> None:
    """``CompressRequest.reason`` is "free-text reason recorded with the compaction": the
    compaction's service record carries it (``metadata.note``); without one, no note."""
    rig = await Rig.start()
    try:
        sid = await rig.session()
        for round_, note in enumerate(["nightly cleanup before the demo", ""]):
            for k in range(12):
                n = round_ * 100 + k
                await rig.append(sid, u(f"ask {n}"), a("", (f"c{n}", "read_file")), t(f"c{n}", words(150)), a("ok"))
            await rig.engine.compress(ANONYMOUS, sid, profile=overrides(), note=note, dry_run=False)
        records = [m for m in await rig.rows(sid) if m.flags.is_compression]
        assert [m.metadata.get("note") for m in records] == ["nightly cleanup before the demo", None]
    finally:
        await rig.close()
