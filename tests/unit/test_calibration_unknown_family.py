"""Margins of a model of no known family (the ``default`` prior) once its baselines showed a feature.

The default prior's cold margins hold the spread *between* vocabularies (its weights are the
middle of four), 0.27-0.67 per feature, and with ``margin_prior_weight`` 16 against at most
``calibration_window`` 8 residuals they made two thirds of such a model's margin for good: the
compression bench's unknown model priced a compacted context with margins of 30-100 %, and its
budget-triggered compactions aimed at 0.22-0.25 of the window. Where the baselines carried a
feature the margin now starts from ``Prior.fitted_margins`` (measured on the fit split: how far a
new step ran over its price after 1-8 baselines of such a model); elsewhere it stays cold.
"""

from __future__ import annotations

import dataclasses

import pytest

from contextsvc.config import TokenSettings
from contextsvc.core import calibration as cal_mod
from contextsvc.core.calibration import Observation, fallback, fit
from contextsvc.core.priors import MESSAGE, N_CLASSES, N_FEATURES, PRIORS, VIEW
from contextsvc.core.sizing import CLASSES, PUNCT, SPACE, WORD

S = TokenSettings()
DEFAULT = PRIORS["default"]
HAN = CLASSES.index("han")


def feats(word: float = 0, punct: float = 0, space: float = 0, messages: float = 0) -> tuple[float, ...]:
    x = [0.0] * N_FEATURES
    x[WORD], x[PUNCT], x[SPACE], x[MESSAGE], x[VIEW] = word, punct, space, messages, 1
    return tuple(x)


PROSE = [feats(word=2000 * k, punct=300 * k, space=80 * k, messages=4 * k) for k in range(1, 9)]


def counted(x: tuple[float, ...], per_unit: float = 0.5, residual: float | None = 0.01) -> Observation:
    # A vocabulary of its own: every unit 0.5 tokens, 4 per message (no family's prior exactly).
    tokens = round(per_unit * sum(x[:N_CLASSES]) + 4 * x[MESSAGE] + 3)
    return Observation(int(sum(x[:N_CLASSES])), tokens, features=x, residual=residual)


def test_the_default_prior_has_fitted_margins_narrower_than_its_cold_ones_and_no_family_else() -> None:
    assert len(DEFAULT.fitted_margins) == N_FEATURES
    cold = DEFAULT.feature_margins
    assert all(f <= c + 0.002 for f, c in zip(DEFAULT.fitted_margins, cold, strict=True))
    assert DEFAULT.fitted_margins[WORD] < 0.8 * cold[WORD]  # measured 0.20 against 0.28
    # Still wider than what a measured family starts from cold: the fit has seen only a few views.
    assert DEFAULT.fitted_margins[WORD] > max(PRIORS[f].feature_margins[WORD] for f in PRIORS if f != "default")
    assert all(not p.fitted_margins for f, p in PRIORS.items() if f != "default")


def test_baselines_of_an_unknown_model_narrow_the_margin_where_they_showed_the_feature() -> None:
    cal = fit([counted(x) for x in PROSE[:2]], S, family="default")
    assert cal.evidence[WORD] == 1.0 and cal.evidence[HAN] == 0.0
    w, n = S.margin_prior_weight, 2
    # Words: blended from the fitted margin. Han (never shown): from the cold one, as before.
    assert cal.margins[WORD] == pytest.approx((w * DEFAULT.fitted_margins[WORD] + n * 0.01) / (w + n))
    assert cal.margins[HAN] == pytest.approx((w * DEFAULT.feature_margins[HAN] + n * 0.01) / (w + n))
    x = PROSE[2]
    assert cal.margin_of(x) < 0.8 * _cold_only(
        lambda: fit([counted(x) for x in PROSE[:2]], S, family="default")
    ).margin_of(x)
    assert cal.margin < DEFAULT.cold_margin


def test_a_feature_seen_a_little_moves_its_margin_as_far_as_its_evidence() -> None:
    # One short view: the per-message framing carried a fraction of a view's worth.
    cal = fit([counted(PROSE[0])], S, family="default")
    e = cal.evidence[MESSAGE]
    assert 0.0 < e < 1.0
    start = DEFAULT.feature_margins[MESSAGE] + e * (DEFAULT.fitted_margins[MESSAGE] - DEFAULT.feature_margins[MESSAGE])
    w = S.margin_prior_weight
    assert cal.margins[MESSAGE] == pytest.approx((w * start + 0.01) / (w + 1))


def test_no_baseline_and_known_families_keep_their_cold_margins() -> None:
    cold = fallback(S, family="default")
    assert cold.margins == tuple(max(S.margin_floor, m) for m in DEFAULT.feature_margins)
    assert cold.margin == DEFAULT.cold_margin
    known = fit([counted(x) for x in PROSE[:2]], S, family="o200k")
    w = S.margin_prior_weight
    assert known.margins[WORD] == pytest.approx((w * PRIORS["o200k"].feature_margins[WORD] + 2 * 0.01) / (w + 2))


def test_an_underpriced_model_still_widens_its_own_margin() -> None:
    # Recorded residuals still count: estimates that ran 40 % short keep the margin wide.
    short = fit([counted(x, residual=0.4) for x in PROSE], S, family="default")
    calm = fit([counted(x, residual=0.0) for x in PROSE], S, family="default")
    assert short.margins[WORD] > calm.margins[WORD] + 0.1
    for j in (WORD, PUNCT, SPACE):
        assert short.margins[j] >= 0.4 * 8 / (S.margin_prior_weight + 8)


def _cold_only(make):  # type: ignore[no-untyped-def]
    saved = cal_mod.prior_for
    cal_mod.prior_for = lambda family: dataclasses.replace(saved(family), fitted_margins=())  # type: ignore[assignment]
    try:
        return make()
    finally:
        cal_mod.prior_for = saved
