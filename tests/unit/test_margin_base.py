"""A margin scales with what it protects (issue #14, round 8).

A baseline's residual used to be relative to the priced *delta* only, while the margin rate it
made was applied to a whole context priced fresh (the view after a compaction): a model whose
counts miss by a share of the whole view turned a 300-token delta's miss into a rate near 1, and
compactions aimed far too low. Residuals are now relative to ``margin_base`` (what was priced, at
least ``margin_view_share`` of the view's text), and an anchored view's margin covers that base.

Also: a compaction's ``context_tokens_before`` is the view priced whole, as ``after`` is, and the
event names the estimate the trigger compared apart (``estimate_tokens``).
"""

from __future__ import annotations

import random
from datetime import UTC, datetime

from contextsvc.config import TokenSettings
from contextsvc.core.calibration import Observation, fit, margin_base
from contextsvc.core.messages import Message, Role
from contextsvc.core.priors import MESSAGE, N_CLASSES, N_FEATURES, PRIORS, VIEW
from contextsvc.core.session import ANONYMOUS
from contextsvc.core.sizing import PUNCT, SPACE, WORD
from contextsvc.core.tokens import Baseline, CalibratedCounter, estimate
from contextsvc.engine.views import _residual
from contextsvc.ports import ViewRecord
from tests.support.compaction_harness import Rig, ScriptedSummarizer, a, overrides, t, u

S = TokenSettings()
O200K = PRIORS["o200k"].weights


def _features(words: float) -> tuple[float, ...]:
    x = [0.0] * N_FEATURES
    x[WORD], x[PUNCT], x[SPACE], x[MESSAGE], x[VIEW] = words, words * 0.15, words * 0.04, words / 400, 1
    return tuple(x)


def _price(x: tuple[float, ...]) -> float:
    return sum(w * v for w, v in zip(O200K, x, strict=True))


def _view(estimated: int, priced: int, features: tuple[float, ...]) -> ViewRecord:
    return ViewRecord(
        view_id="v",
        model="gpt-4o",
        chars=int(sum(features[:N_CLASSES])),
        estimated_tokens=estimated,
        had_images=False,
        last_sequence=1,
        create_time=datetime(2026, 1, 1, tzinfo=UTC),
        features=features,
        priced_tokens=priced,
    )


def test_the_margin_base_is_what_was_priced_but_at_least_a_share_of_the_view() -> None:
    assert S.margin_view_share == 0.25
    assert margin_base(300, 6000, 0.25) == 1500  # a small delta: a quarter of the view
    assert margin_base(5000, 6000, 0.25) == 5000  # a whole context priced fresh: what was priced
    assert margin_base(300, 6000, 0.0) == 300  # share 0: the delta, as before round 8


def test_a_miss_of_the_whole_view_is_not_charged_to_a_small_delta() -> None:
    # A 6,000-token view anchored on a baseline, 300 tokens of it priced (the delta), counted 5% of
    # the view (300 tokens) over its estimate: relative to the delta that was a residual of 1.0.
    view = _view(6000, 300, _features(9000))
    r = _residual(6300, view, S.margin_view_share)
    assert r is not None and abs(r - 300 / 1500) < 1e-9
    # A view priced whole is its own base: the same rule as before.
    fresh = _view(6000, 5990, _features(9000))
    r = _residual(6300, fresh, S.margin_view_share)
    assert r is not None and abs(r - 300 / 5990) < 1e-9


def test_whole_view_noise_does_not_inflate_the_rate_a_fresh_context_is_priced_with() -> None:
    """A model whose count is its view's price +-5% (noise on the whole view, the compression
    bench's ``estimate`` model): eight baselines of anchored views, each 6,000 tokens with a
    ~300-token delta. The margin rate of a whole context priced fresh (what a compaction aims
    with) stays near the cold margin; relative to the deltas it went to ~0.5 (main before round 8:
    ``aim 3,751 tokens because of a 5,790-token margin``)."""
    rng = random.Random(3)
    obs: list[Observation] = []
    for k in range(8):
        x = _features(11_000 + 200 * k)
        view_price = _price(x)
        real = round(view_price * (1 + rng.uniform(-0.05, 0.05)))
        priced = round(view_price * 0.05)  # the delta
        est = round(view_price)
        r = _residual(real, _view(est, priced, x), S.margin_view_share)
        obs.append(Observation(int(sum(x[:N_CLASSES])), real, features=x, residual=r))
    cal = fit(obs, S, family="o200k")
    assert cal.residual_weight == 8 / (S.margin_prior_weight + 8)
    assert 0 < cal.residual_rate <= 0.05 / S.margin_view_share + 1e-3
    context = _features(8000)
    rate = cal.margin_of(context) / _price(context)
    cold = PRIORS["o200k"].cold_margin
    assert rate <= (S.margin_prior_weight * 0.2 + 8 * 0.2) / (S.margin_prior_weight + 8)
    assert rate < 2 * cold
    # The anchored view's margin covers the base past its delta at the residuals' rate, so a view's
    # absolute margin is about what it was (a share of the view, not of a large rate x delta).
    counter = CalibratedCounter(cal)
    rows = [Message(Role.USER, "word " * 40, sequence_number=k + 1) for k in range(60)]
    since = [Message(Role.USER, "word " * 40, sequence_number=61)]
    plain = estimate(counter=counter, window=100_000, reserve=0, context=[*rows, *since], baseline=Baseline(3000, 60))
    shared = estimate(
        counter=counter,
        window=100_000,
        reserve=0,
        context=[*rows, *since],
        baseline=Baseline(3000, 60),
        margin_share=S.margin_view_share,
    )
    beyond = cal.margin_beyond(margin_base(shared.priced, shared.text, S.margin_view_share) - shared.priced)
    assert beyond > 0
    assert abs(shared.margin - (plain.margin + beyond)) <= 1
    # A view priced whole gets nothing beyond its own per-feature margin.
    whole = estimate(counter=counter, window=100_000, reserve=0, context=rows, margin_share=S.margin_view_share)
    assert whole.margin == estimate(counter=counter, window=100_000, reserve=0, context=rows).margin


def test_without_recorded_residuals_nothing_is_added_past_the_delta() -> None:
    cal = fit([Observation(9000, round(_price(_features(9000))), features=_features(9000))], S, family="o200k")
    assert cal.residual_rate == 0.0 and cal.margin_beyond(5000) == 0.0


async def _turns(rig: Rig, sid: str, n: int) -> None:
    for k in range(n):
        await rig.append(
            sid,
            u(rig.sized(300, prefix=f"zq{k}ux ask {k}", role=Role.USER)),
            a("", (f"c{k}", "read_file")),
            t(f"c{k}", rig.sized(100, prefix=f"zq{k}tx")),
            a(rig.sized(300, prefix=f"zq{k}ax answer {k}", role=Role.ASSISTANT)),
        )


async def test_a_compaction_reports_before_and_after_priced_the_same_way() -> None:
    """A baseline counted 900 tokens over the view's price anchors the next estimate high (the fit
    takes in only part of it); the compaction's ``context_tokens_before`` is still the view priced
    whole (as ``after`` is, and as its stages say), and ``estimate_tokens`` is the anchored one."""
    rig = await Rig.start(ScriptedSummarizer())
    try:
        sid = await rig.session()
        await _turns(rig, sid, 7)
        view = await rig.build(sid, auto=False)
        got = await rig.engine.record_baseline(
            ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=view.estimate.total + 900
        )
        assert got.recorded
        anchored = await rig.build(sid, auto=False)
        # the same rows priced whole with the calibration the baseline refitted
        counter = rig.engine.accounting.counter("m")
        fresh = estimate(counter=counter, window=rig.window, reserve=0, context=await rig.context(sid)).total
        assert anchored.estimate.total >= fresh + 150  # the fit took in part of the 900, not all
        report = await rig.compress(sid, profile=overrides(summarizer="scripted", strategies=["summarize"]))
        assert report.compressed
        (done,) = [e.payload for e in rig.events(sid, "context_compressed")]
        assert done["estimate_tokens"] == anchored.estimate.total
        # priced whole: within rounding of the view's own fresh price, not the anchored 900 more
        assert abs(done["context_tokens_before"] - fresh) <= 2, (done["context_tokens_before"], fresh)
        assert report.context_tokens_before == done["context_tokens_before"]
        assert report.stages[0].tokens_before == done["context_tokens_before"]
        assert done["context_tokens_after"] < done["context_tokens_before"]
    finally:
        await rig.close()
