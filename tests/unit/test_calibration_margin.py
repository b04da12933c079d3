"""The calibration's margin (out-of-sample residuals), its spread choice and its truncation floor,
with adversarial baselines (DESIGN §5.3)."""

from __future__ import annotations

import math
import random

from contextsvc.config import TokenSettings
from contextsvc.core.calibration import Observation, fallback, fit, lower_bound
from contextsvc.core.messages import Message, Role
from contextsvc.core.priors import (
    CYRILLIC_COLUMNS,
    LOWER_BOUND,
    MESSAGE,
    N_CLASSES,
    N_FEATURES,
    PRIORS,
    TOOL_CALL,
    VIEW,
)
from contextsvc.core.sizing import CYRILLIC, PUNCT, SPACE, WORD
from contextsvc.core.tokens import Baseline, CalibratedCounter, estimate, messages_features

S = TokenSettings()
O200K = PRIORS["o200k"].weights


def feats(word: float = 0, punct: float = 0, space: float = 0, cyrillic: float = 0, messages: float = 0) -> tuple:
    x = [0.0] * N_FEATURES
    x[WORD], x[PUNCT], x[SPACE], x[CYRILLIC], x[MESSAGE], x[VIEW] = word, punct, space, cyrillic, messages, 1
    for j in CYRILLIC_COLUMNS.values():  # each family's own count of the Cyrillic pieces: here the same
        x[j] = cyrillic
    return tuple(x)


def price(weights: tuple[float, ...], x: tuple[float, ...]) -> float:
    return sum(w * v for w, v in zip(weights, x, strict=True))


PROSE = [feats(word=2000 * k, punct=300 * k, space=80 * k, messages=4 * k) for k in range(1, 9)]


def honest(x: tuple[float, ...], factor: float = 1.0, residual: float | None = None) -> Observation:
    return Observation(int(sum(x[:N_CLASSES])), round(price(O200K, x) * factor), features=x, residual=residual)


def test_settings_pin_the_margin_quantile() -> None:
    assert S.margin_quantile == 0.995 and S.margin_prior_weight == 16.0 and S.margin_floor == 0.01


def test_recorded_residuals_set_the_margin_not_the_in_sample_fit() -> None:
    # Two baselines are fitted almost exactly, yet the estimates made for their views ran 12% short:
    # the margin follows what happened out of sample, blended with the cold margin.
    cold = PRIORS["o200k"].cold_margin
    obs = [honest(x, residual=0.12) for x in PROSE[:2]]
    cal = fit(obs, S, family="o200k")
    w = S.margin_prior_weight
    assert abs(cal.margin - (w * cold + 2 * 0.12) / (w + 2)) < 1e-9
    # Eight baselines whose estimates were never short: the margin falls towards the floor.
    calm = fit([honest(x, residual=-0.02) for x in PROSE], S, family="o200k")
    assert calm.margin == max(S.margin_floor, w * cold / (w + 8))
    assert calm.margin < cal.margin


def test_overestimates_never_widen_the_margin() -> None:
    low = fit([honest(x, residual=-0.3) for x in PROSE], S, family="o200k")
    none = fit([honest(x, residual=0.0) for x in PROSE], S, family="o200k")
    assert low.margin == none.margin


def test_short_estimates_widen_the_margin_by_their_quantile() -> None:
    rng = random.Random(5)
    residuals = [rng.uniform(0.0, 0.2) for _ in PROSE]
    cal = fit([honest(x, residual=r) for x, r in zip(PROSE, residuals, strict=True)], S, family="o200k")
    q95 = sorted(residuals)[-1]  # nearest rank of 0.95 over 8 values
    w = S.margin_prior_weight
    assert abs(cal.margin - (w * PRIORS["o200k"].cold_margin + 8 * q95) / (w + 8)) < 1e-9


def test_an_outlier_count_does_not_blow_up_the_margin() -> None:
    # Another model's count (3x) lands once among honest ones: the robust fit trims it, and its huge
    # residual is not in the margin either.
    obs = [honest(x, residual=0.01) for x in PROSE[:7]]
    obs.insert(3, honest(PROSE[3], factor=3.0, residual=2.0))
    cal = fit(obs, S, family="o200k")
    w = S.margin_prior_weight
    assert abs(cal.margin - (w * PRIORS["o200k"].cold_margin + 7 * 0.01) / (w + 7)) < 1e-9
    assert abs(price(cal.weights, PROSE[7]) / price(O200K, PROSE[7]) - 1) < 0.02


def test_observations_without_residuals_fall_back_to_the_in_sample_margin() -> None:
    cal = fit([honest(x) for x in PROSE[:2]], S, family="o200k")
    assert cal.margin >= S.margin_floor and cal.margin > 0.5 * PRIORS["o200k"].cold_margin


def test_text_noise_around_the_prior_keeps_the_weights_close() -> None:
    # Counts within a few percent of the prior, either way (the text's own variation): two baselines
    # move no weight by more than a couple of percent.
    rng = random.Random(11)
    for _ in range(20):
        obs = [honest(x, factor=rng.uniform(0.96, 1.04)) for x in PROSE[:2]]
        cal = fit(obs, S, family="o200k")
        for j in (WORD, PUNCT, SPACE):
            assert abs(cal.weights[j] / O200K[j] - 1) < 0.03


def test_a_model_far_from_its_family_is_learned_within_a_few_baselines() -> None:
    # A model mapped to the wrong family: every count 35% above the prior. The baselines' evidence
    # widens the spread and the fit follows.
    obs = [honest(x, factor=1.35) for x in PROSE[:3]]
    cal = fit(obs, S, family="o200k")
    assert abs(price(cal.weights, PROSE[5]) / (1.35 * price(O200K, PROSE[5])) - 1) < 0.03


def test_the_cold_floor_is_the_vocabulary_free_bound() -> None:
    cold = fallback(S, family="o200k")
    for x in (PROSE[0], feats(cyrillic=3000, messages=3)):
        assert cold.floor(x, S.truncation_ratio) == lower_bound(x)


def test_the_floor_tightens_only_where_baselines_back_the_weights() -> None:
    # Chatty views (many short messages, indented output): framing and whitespace, where the
    # vocabulary-free bound is loosest.
    chatty = [feats(word=300 * k, punct=150 * k, space=200 * k, messages=30 * k) for k in range(1, 7)]
    cal = fit([honest(x) for x in chatty[:4]], S, family="o200k")
    ratio = S.truncation_ratio
    # Backed by the baselines, the floor is close to ratio x the calibrated price, so a prompt cut
    # to 60% of it is caught where the bare bound would have let it through.
    x = chatty[5]
    real = price(O200K, x)
    cut = int(0.6 * real)
    assert cut > lower_bound(x)
    assert cut < cal.floor(x, ratio) < 0.75 * real
    # Cyrillic never seen: its part of the floor stays at the vocabulary-free bound, so the cheapest
    # vocabulary's honest count of a Russian view is still above the floor.
    russian = feats(cyrillic=4000, word=100, messages=3)
    cheapest = min(price(p.weights, russian) for p in PRIORS.values())
    assert cal.floor(russian, ratio) < cheapest
    assert cal.floor(russian, ratio) - lower_bound(russian) < 0.05 * cheapest


def test_an_honest_count_of_any_vocabulary_clears_the_floor_of_a_cold_model() -> None:
    rng = random.Random(2)
    for _ in range(200):
        x = [rng.uniform(0, 3000) if j < N_CLASSES else 0.0 for j in range(N_FEATURES)]
        for j in CYRILLIC_COLUMNS.values():  # each family's own count of the Cyrillic pieces
            x[j] = x[CYRILLIC] * rng.uniform(0.7, 1.4)
        x[MESSAGE], x[TOOL_CALL], x[VIEW] = rng.randint(1, 30), rng.randint(0, 10), 1
        t = tuple(x)
        for fam in PRIORS:
            cheapest_honest = 0.85 * price(PRIORS[fam].weights, t)  # 15% below its own family's prior
            assert fallback(S, family=fam).floor(t, S.truncation_ratio) <= cheapest_honest
    assert all(b >= 0 for b in LOWER_BOUND)


def test_each_feature_has_its_own_margin() -> None:
    # The prior measured how far a new step's real count lies over its price per feature: text of
    # one class scatters more around its price than another's, so their deltas carry different
    # relative margins (which is wider is measured: before the Cyrillic size rules of round 6 it
    # was Cyrillic, now English words).
    prior = PRIORS["o200k"]
    assert len(prior.feature_margins) == N_FEATURES
    assert prior.feature_margins[CYRILLIC] != prior.feature_margins[WORD]
    cold = fallback(S, family="o200k")
    english, russian = feats(word=1000, messages=2), feats(cyrillic=1000, messages=2)
    wider = prior.feature_margins[CYRILLIC] > prior.feature_margins[WORD]
    relative = cold.margin_of(russian) / price(O200K, russian), cold.margin_of(english) / price(O200K, english)
    assert (relative[0] > relative[1]) == wider
    # each feature's price times its own margin
    expected = sum(m * w * x for m, w, x in zip(cold.margins, O200K, english, strict=True))
    assert abs(cold.margin_of(english) - expected) < 1e-9
    # baselines move every feature's margin toward what this model missed by (here: 1% short)
    obs = [honest(x, 1.0, residual=0.01) for x in PROSE]
    cal = fit(obs, S, family="o200k")
    w = S.margin_prior_weight
    for j in (WORD, CYRILLIC):
        assert abs(cal.margins[j] - (w * prior.feature_margins[j] + 8 * 0.01) / (w + 8)) < 1e-9
    assert cal.margin_of(russian) < cold.margin_of(russian)


def test_the_estimate_carries_the_per_feature_margin_of_what_it_priced() -> None:
    counter = CalibratedCounter(fallback(S, family="o200k"))
    context = [
        Message(Role.USER, "Проверь, пожалуйста, журнал сборки и скажи, что сломалось.", sequence_number=1),
        Message(Role.ASSISTANT, "The build failed in the linker step; see the log above.", sequence_number=2),
    ]
    est = estimate(counter=counter, window=100_000, reserve=0, system="Be brief.", context=context)
    rows = [Message(Role.SYSTEM, "Be brief."), *context]
    expected = counter.calibration.margin_of(messages_features(rows)) + counter.margin_rate * counter.overhead
    assert abs(est.margin - expected) <= 1.0 and est.margin >= expected
    # with a baseline only the rows after it are priced, and only they carry a margin
    anchored = estimate(
        counter=counter, window=100_000, reserve=0, system="Be brief.", context=context, baseline=Baseline(500, 1)
    )
    assert anchored.margin == math.ceil(counter.calibration.margin_of(messages_features(context[1:])))
