"""What a client sends beside each view (tool definitions): learned per session from its baselines.

A provider's count of a view holds the tool definitions the agent sends with it, which the view's
rows do not show. Anchored builds (a baseline plus the rows since) hold them already; a view
priced whole (the session's first, every one after a compaction) did not, and the count's excess
went into the model's calibration as an error ~10x the view: every view's margin grew to several
times its price, and an agent with 3,000 tokens of tools on an 8k window was compacted to its
newest message on every turn. The excess is now the session's ``beside`` tokens: whole-priced
views add them, the compaction counts them among what it cannot drop, and such counts are kept
out of the model's fit and margin."""

from __future__ import annotations

import statistics

import pytest

from contextsvc.core.session import ANONYMOUS
from contextsvc.engine.state import EngineState
from tests.support.compaction_harness import Rig, a, real_tokens, u, words

WINDOW = 8192


async def _turns(rig: Rig, sid: str, n: int, *, tools: int, slope: float = 0.6) -> list[tuple[int, int, int, int]]:
    """``n`` agent turns, each counted by the provider as the view plus ``tools``: (view rows,
    estimate, margin, real count) of each turn's view."""
    out = []
    for k in range(n):
        await rig.append(sid, u(f"ask {k} about module_{k}.py " + words(40)), a(f"answer {k} " + words(80)))
        view = await rig.build(sid)
        real = real_tokens(view, slope=slope) + tools
        await rig.engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=real)
        await rig.engine.anchors_applied(5)
        await rig.engine.background_settled(5)
        out.append((len(view.messages), view.estimate.total, view.estimate.margin, real))
    return out


async def test_an_agent_with_tool_definitions_keeps_its_turns_between_compactions() -> None:
    rig = await Rig.start(window=WINDOW, reserve=WINDOW // 4)
    try:
        sid = await rig.session()
        views = await _turns(rig, sid, 40, tools=3000)
        assert (await rig.session_info(sid)).state.get("beside_tokens", 0) > 2500
        rows = [n for n, *_ in views[1:]]
        # Compacted to one or two turns every turn before; now the context grows between compactions.
        assert statistics.median(rows) >= 12, rows
        assert len(rig.events(sid, "context_compressed")) <= 6
        # Every view after the first is priced with the tools in it: close to the real count, and
        # the margin stays a small share of the view, as without tools.
        for n, estimate, margin, real in views[1:]:
            assert abs(estimate - real) <= 0.05 * real, (n, estimate, real)
            assert margin <= 0.1 * real, (n, margin, real)
        # Nothing served passed the budget in real tokens.
        assert max(real for *_, real in views) <= WINDOW - WINDOW // 4
    finally:
        await rig.close()


async def test_a_view_priced_whole_after_a_compaction_holds_the_tools_in_its_system_segment() -> None:
    rig = await Rig.start(window=WINDOW, reserve=WINDOW // 4)
    try:
        sid = await rig.session()
        await _turns(rig, sid, 3, tools=3000)
        beside = EngineState.of(await rig.session_info(sid)).beside
        assert beside > 2500
        report = await rig.compress(sid)
        assert report.compressed
        view = await rig.build(sid)
        assert view.estimate.method.value != "baseline_delta"  # priced whole: the compaction cleared the anchor
        assert view.estimate.segments.system >= beside
        assert abs(view.estimate.total - (real_tokens(view) + 3000)) <= 0.05 * view.estimate.total
        # The compaction counted them among what it cannot drop.
        assert report.context_tokens_after >= beside
    finally:
        await rig.close()


@pytest.mark.parametrize("slope", [0.45, 0.6, 0.9])
async def test_a_client_that_sends_nothing_beside_its_views_learns_none(slope: float) -> None:
    # A calibration that misses by a third is no tool definition.
    rig = await Rig.start(window=WINDOW, reserve=WINDOW // 4)
    try:
        sid = await rig.session()
        await _turns(rig, sid, 12, tools=0, slope=slope)
        assert EngineState.of(await rig.session_info(sid)).beside == 0
    finally:
        await rig.close()


async def test_tool_heavy_counts_leave_the_models_calibration_to_other_sessions() -> None:
    rig = await Rig.start(window=WINDOW, reserve=WINDOW // 4)
    try:
        plain = await rig.session()
        before = await _turns(rig, plain, 6, tools=0)
        tooled = await rig.session()
        await _turns(rig, tooled, 10, tools=3000)
        after = await _turns(rig, plain, 4, tools=0)
        # The other session's margin is what it was: the tools' excess is no error of the model.
        assert max(m for _, _, m, _ in after) <= 2 * max(m for _, _, m, _ in before[1:]) + 10
    finally:
        await rig.close()


async def test_a_client_that_stops_sending_tools_loses_its_beside_tokens() -> None:
    rig = await Rig.start(window=WINDOW, reserve=WINDOW // 4)
    try:
        sid = await rig.session()
        await _turns(rig, sid, 3, tools=3000)
        assert EngineState.of(await rig.session_info(sid)).beside > 2500
        await rig.compress(sid)  # the next view is priced whole, and its count shows no tools
        await _turns(rig, sid, 2, tools=0)
        assert EngineState.of(await rig.session_info(sid)).beside == 0
    finally:
        await rig.close()
