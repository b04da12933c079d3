# ruff: noqa: RUF001  (a Chinese sentence keeps its own punctuation)
"""Per-model calibration on content-class features (DESIGN §5.3), with adversarial baselines."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextsvc.config import TokenSettings
from contextsvc.core.calibration import CalibrationRegistry, Observation, fallback, fit, lower_bound
from contextsvc.core.messages import Message, Role, ToolCall
from contextsvc.core.priors import (
    CYRILLIC_COLUMNS,
    CYRILLIC_FEATURES,
    DEFAULT_MODEL_FAMILIES,
    FEATURES,
    IDENT_PREFIXED_COLUMN,
    LEGACY_FEATURES,
    LOWER_BOUND,
    MESSAGE,
    N_CLASSES,
    N_FEATURES,
    PREVIOUS_FEATURES,
    PRIORS,
    TOOL_CALL,
    VIEW,
    current_features,
    family_for,
)
from contextsvc.core.sizing import CYRILLIC, HAN, HANGUL, IDENT, KANA, PUNCT, SPACE, WORD, feature_units
from contextsvc.core.tokens import messages_features

S = TokenSettings()

# A "true" tokenizer for these tests: the o200k prior with Cyrillic (o200k's own column) 40% dearer
# and punctuation 20% cheaper, framing of 6 per message / 9 per tool call / 3 per view.
TRUE = list(PRIORS["o200k"].weights)
O200K_CYRILLIC = CYRILLIC_COLUMNS["o200k"]
TRUE[O200K_CYRILLIC] *= 1.4
TRUE[PUNCT] *= 0.8
TRUE[MESSAGE], TRUE[TOOL_CALL], TRUE[VIEW] = 6.0, 9.0, 3.0


def feats(**units: float) -> tuple[float, ...]:
    names = {
        "space": SPACE,
        "word": WORD,
        "ident": IDENT,
        "punct": PUNCT,
        "cyrillic": CYRILLIC,
        "han": HAN,
        "kana": KANA,
        "hangul": HANGUL,
    }
    x = [0.0] * N_FEATURES
    for k, v in units.items():
        x[names[k] if k in names else {"messages": MESSAGE, "calls": TOOL_CALL, "views": VIEW}[k]] = v
    for j in CYRILLIC_COLUMNS.values():  # each family's own count of the Cyrillic units: here the same
        x[j] = x[CYRILLIC]
    return tuple(x)


def true_tokens(x: tuple[float, ...]) -> int:
    return round(sum(w * v for w, v in zip(TRUE, x, strict=True)))


def obs(x: tuple[float, ...], tokens: int | None = None) -> Observation:
    return Observation(int(sum(x[:N_CLASSES])), true_tokens(x) if tokens is None else tokens, features=x)


def rel(est: float, x: tuple[float, ...]) -> float:
    return abs(est - true_tokens(x)) / true_tokens(x)


CODE = [feats(word=800 * k, ident=900 * k, punct=1200 * k, messages=8 * k, calls=2 * k, views=1) for k in (1, 2, 3)]
PROSE = [feats(word=3000 * k, punct=300 * k, messages=6 * k, views=1) for k in (1, 2, 3)]
RUSSIAN = [feats(cyrillic=2500 * k, word=200 * k, punct=250 * k, messages=6 * k, views=1) for k in (1, 2, 3)]


def test_settings_pins() -> None:
    assert S.calibration_window == 8 and S.truncation_ratio == 0.70
    assert S.margin_floor == 0.01 and S.margin_prior_weight == 16.0
    assert S.model_families == DEFAULT_MODEL_FAMILIES


def test_model_names_map_to_their_vocabulary_family() -> None:
    fam = DEFAULT_MODEL_FAMILIES
    assert family_for("gpt-4o-mini", fam) == "o200k"
    assert family_for("gpt-4-turbo", fam) == "cl100k"
    assert family_for("Claude-3-Haiku", fam) == "claude"
    assert family_for("meta-llama-3-8b-instruct", fam) == "llama3"
    assert family_for("my-local-model", fam) == "default"


def test_without_observations_the_prior_of_the_family() -> None:
    cal = fit([], S, family="cl100k")
    assert not cal.fitted and cal.weights == PRIORS["cl100k"].weights
    assert cal.margin == PRIORS["cl100k"].cold_margin
    assert cal == fallback(S, family="cl100k")


def test_two_baselines_learn_a_cheaper_vocabulary_of_the_content_they_saw() -> None:
    cal = fit([obs(x) for x in RUSSIAN[:2]], S, family="o200k")
    assert cal.fitted and cal.observations == 2
    target = RUSSIAN[2]
    assert rel(cal.price(target), target) < 0.02
    assert rel(fallback(S, family="o200k").price(target), target) > 0.2


def test_a_standalone_list_is_priced_without_the_view_overhead() -> None:
    cal = fit([obs(x) for x in PROSE[:2]], S, family="o200k")
    msgs = [Message(Role.USER, "hello there, how are you today?")]
    as_list, as_view = messages_features(msgs), messages_features(msgs, views=1)
    assert as_list[VIEW] == 0 and as_view[VIEW] == 1
    assert cal.price(as_view) - cal.price(as_list) == pytest.approx(cal.overhead)
    assert cal.overhead < 12  # never a whole view's intercept added to a short list


def test_a_model_switching_content_kinds_keeps_what_it_learned_elsewhere() -> None:
    # Calibrated on Russian, then on code: Russian stays priced right, and code is learned.
    cal = fit([obs(x) for x in (*RUSSIAN[:2], *CODE[:2])], S, family="o200k")
    assert rel(cal.price(RUSSIAN[2]), RUSSIAN[2]) < 0.03
    assert rel(cal.price(CODE[2]), CODE[2]) < 0.02


def test_calibrating_on_one_kind_barely_moves_another() -> None:
    before = rel(fallback(S, family="o200k").price(PROSE[2]), PROSE[2])
    after = rel(fit([obs(x) for x in RUSSIAN[:2]], S, family="o200k").price(PROSE[2]), PROSE[2])
    assert after - before < 0.02


def test_an_outlier_is_downweighted_and_trimmed() -> None:
    clean = [obs(x) for x in (*PROSE, *PROSE[:2])]
    bad = obs(PROSE[1], tokens=true_tokens(PROSE[1]) * 3)  # a wrong count (another model's, a bug)
    cal = fit([*clean[:3], bad, *clean[3:]], S, family="o200k")
    assert rel(cal.price(PROSE[2]), PROSE[2]) < 0.02


def test_truncated_counts_among_honest_ones_do_not_drag_the_fit() -> None:
    honest = [obs(x) for x in PROSE]
    cut = [obs(x, tokens=int(true_tokens(x) * 0.72)) for x in PROSE[1:]]  # just above the 70% rule
    cal = fit([*honest, cut[0], *honest, cut[1]], S, family="o200k")
    assert rel(cal.price(PROSE[2]), PROSE[2]) < 0.03


def test_absurd_counts_never_make_a_weight_negative_or_unbounded() -> None:
    cal = fit([obs(PROSE[0], tokens=1), obs(PROSE[1], tokens=10**7), obs(CODE[0], tokens=2)], S, family="default")
    prior = PRIORS["default"].weights
    for j, (w, p) in enumerate(zip(cal.weights, prior, strict=True)):
        assert w >= 0
        assert w <= (2.5 if j < N_CLASSES else 4.0) * p + 1e-9


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5000), st.integers(0, 5000), st.integers(1, 40), st.floats(0.2, 5.0)),
        min_size=1,
        max_size=10,
    )
)
def test_any_observations_give_bounded_non_negative_prices(points: list[tuple[int, int, int, float]]) -> None:
    observations = []
    for words, cyr, n, factor in points:
        x = feats(word=words + 1, cyrillic=cyr, messages=n, views=1)
        observations.append(obs(x, tokens=max(1, round(true_tokens(x) * factor))))
    cal = fit(observations, S, family="o200k")
    assert all(w >= 0 for w in cal.weights)
    assert cal.margin >= S.margin_floor
    assert cal.price(PROSE[0]) > 0


def test_the_margin_shrinks_as_baselines_agree() -> None:
    cold = fallback(S, family="o200k").margin
    two = fit([obs(x) for x in PROSE[:2]], S, family="o200k").margin
    eight = fit([obs(x) for x in (*PROSE, *PROSE, *PROSE[:2])], S, family="o200k").margin
    assert cold > two > eight >= S.margin_floor


def test_noisy_baselines_widen_the_margin() -> None:
    rng = random.Random(3)
    noisy = [obs(x, tokens=round(true_tokens(x) * rng.uniform(0.9, 1.1))) for x in (*PROSE, *PROSE, *PROSE[:2])]
    clean = fit([obs(x) for x in (*PROSE, *PROSE, *PROSE[:2])], S, family="o200k")
    assert fit(noisy, S, family="o200k").margin > clean.margin + 0.02


def test_the_lower_bound_is_below_every_vocabulary() -> None:
    text = "Привет, мир! Это тест. 你好，世界。 def get_user_id(x): return x['id'] 12345"
    x = (*feature_units(text), 1, 0, 1)
    for prior in PRIORS.values():
        assert lower_bound(x) < sum(w * v for w, v in zip(prior.weights, x, strict=True))
    assert all(b >= 0 for b in LOWER_BOUND)


def test_observations_without_features_or_with_images_are_not_fitted() -> None:
    assert not Observation(1000, 400).usable  # written before the class model
    assert not Observation(1000, 400, True, PROSE[0]).usable
    assert not fit([Observation(1000, 400), Observation(2000, 700)], S).fitted


def test_registry_keeps_models_apart_and_uses_their_families() -> None:
    reg = CalibrationRegistry(S)
    reg.observe("gpt-4o", obs(RUSSIAN[0]))
    assert reg.calibration("gpt-4o").fitted and reg.calibration("gpt-4o").family == "o200k"
    assert not reg.calibration("gpt-4").fitted and reg.calibration("gpt-4").family == "cl100k"
    assert reg.observations("gpt-4") == ()
    reg.observe("gpt-4o", Observation(100, 50, had_images=True, features=PROSE[0]))
    assert len(reg.observations("gpt-4o")) == 1
    reg.forget("gpt-4o")
    assert not reg.is_loaded("gpt-4o") and not reg.calibration("gpt-4o").fitted


def test_reloading_the_same_observations_keeps_the_fit_and_new_ones_refit() -> None:
    reg = CalibrationRegistry(S)
    first = reg.load("gpt-4o", [obs(CODE[0]), obs(PROSE[1])])
    # A periodic re-read from the store that found nothing new: the very same fit, not a refit.
    assert reg.load("gpt-4o", [obs(CODE[0]), obs(PROSE[1])]) is first
    refit = reg.load("gpt-4o", [obs(CODE[0]), obs(PROSE[1]), obs(RUSSIAN[0])])
    assert refit is not first and refit.observations == 3
    assert refit == fit([obs(CODE[0]), obs(PROSE[1]), obs(RUSSIAN[0])], S, family="o200k")


def test_tool_calls_are_priced_by_their_own_framing() -> None:
    call = Message(Role.ASSISTANT, "", tool_calls=(ToolCall("c1", "read_file", '{"path": "a.py"}'),))
    x = messages_features([call])
    assert x[MESSAGE] == 1 and x[TOOL_CALL] == 1


def test_features_of_the_first_feature_set_map_only_without_cjk_or_cyrillic_units() -> None:
    old = [float(k + 1) for k in range(len(LEGACY_FEATURES))]
    old[LEGACY_FEATURES.index("cjk")] = 0.0
    old[LEGACY_FEATURES.index("cyrillic")] = 0.0
    mapped = current_features(old)
    assert len(mapped) == N_FEATURES
    for name, value in zip(LEGACY_FEATURES, old, strict=True):
        if name != "cjk":
            assert mapped[FEATURES.index(name)] == value, name
    assert mapped[HAN] == mapped[KANA] == mapped[HANGUL] == 0.0
    assert all(mapped[j] == 0.0 for j in CYRILLIC_COLUMNS.values())
    # CJK units cannot be split into Han, kana and hangul after the fact: dropped, so not fitted.
    old[LEGACY_FEATURES.index("cjk")] = 120.0
    assert current_features(old) == ()
    assert not Observation(100, 60, features=current_features(old)).usable
    # Nor can Cyrillic units be counted in each family's vocabulary after the fact.
    old[LEGACY_FEATURES.index("cjk")] = 0.0
    old[LEGACY_FEATURES.index("cyrillic")] = 40.0
    assert current_features(old) == ()


def test_features_of_the_second_feature_set_map_only_without_cyrillic_units() -> None:
    # Written before the families' Cyrillic columns: the classes, then the three overheads.
    assert len(PREVIOUS_FEATURES) == N_FEATURES - len(CYRILLIC_COLUMNS) - 1
    old = [float(k + 1) for k in range(len(PREVIOUS_FEATURES))]
    old[CYRILLIC] = 0.0
    mapped = current_features(old)
    assert len(mapped) == N_FEATURES
    for name, value in zip(PREVIOUS_FEATURES, old, strict=True):
        assert mapped[FEATURES.index(name)] == value, name
    assert all(mapped[j] == 0.0 for j in CYRILLIC_COLUMNS.values())
    assert mapped[IDENT_PREFIXED_COLUMN] == 0.0
    assert mapped[MESSAGE] == old[N_CLASSES] and mapped[VIEW] == old[-1]
    # A fit of the mapped observation prices exactly what one of today's features would.
    assert Observation(100, 60, features=mapped).usable
    old[CYRILLIC] = 30.0
    assert current_features(old) == ()
    assert not Observation(100, 60, features=current_features(old)).usable
    assert current_features(feats(word=10, han=5, messages=1)) == feats(word=10, han=5, messages=1)
    assert current_features([1.0, 2.0, 3.0]) == ()  # any other length is no known feature set


def test_features_of_the_third_feature_set_map_with_no_prefixed_identifier_units() -> None:
    # Written before the prefixed identifiers' column: the classes, the families' Cyrillic columns,
    # then the overheads. Mapped whatever they hold (Cyrillic units included), that column 0.
    assert len(CYRILLIC_FEATURES) == N_FEATURES - 1
    old = [float(k + 1) for k in range(len(CYRILLIC_FEATURES))]
    mapped = current_features(old)
    assert len(mapped) == N_FEATURES and FEATURES[IDENT_PREFIXED_COLUMN] == "ident_prefixed"
    for name, value in zip(CYRILLIC_FEATURES, old, strict=True):
        assert mapped[FEATURES.index(name)] == value, name
    assert mapped[IDENT_PREFIXED_COLUMN] == 0.0
    assert Observation(100, 60, features=mapped).usable


def test_only_claude_prices_the_prefixed_identifiers_column() -> None:
    # Every other prior gives it weight 0, which no fit moves: the same baselines with or without
    # prefixed units in that column fit the same weights (their ``ident`` units are priced alike).
    for family in ("o200k", "cl100k", "llama3", "default"):
        assert PRIORS[family].weights[IDENT_PREFIXED_COLUMN] == 0.0
    assert PRIORS["claude"].weights[IDENT_PREFIXED_COLUMN] > 0.1
    base = [feats(word=800 * k, ident=300 * k, punct=200 * k, messages=4 * k, views=1) for k in (1, 2)]
    with_column = []
    for x in base:
        y = list(x)
        y[IDENT_PREFIXED_COLUMN] = 150.0
        with_column.append(tuple(y))
    for family in ("o200k", "cl100k", "llama3", "default"):
        counts = [round(sum(w * v for w, v in zip(TRUE, x, strict=True))) for x in base]
        a = fit([Observation(0, n, features=x) for n, x in zip(counts, base, strict=True)], S, family=family)
        b = fit([Observation(0, n, features=x) for n, x in zip(counts, with_column, strict=True)], S, family=family)
        assert a.weights == b.weights and a.margins == b.margins and a.evidence == b.evidence
        assert a.price(base[1]) == b.price(with_column[1])
    # Claude prices the same ``ident`` units dearer when they are prefixed identifiers.
    cold = fit([], S, family="claude")
    assert cold.price(with_column[1]) > cold.price(base[1])
    assert cold.class_ratios["ident_prefixed"] == PRIORS["claude"].weights[IDENT_PREFIXED_COLUMN]


def test_each_east_asian_script_is_fitted_apart() -> None:
    # A model whose hangul is 50% dearer than its prior: baselines of Korean move hangul, not Han
    # or kana (a Japanese or Chinese view keeps the prior).
    true = list(PRIORS["cl100k"].weights)
    true[HANGUL] *= 1.5
    korean = [feats(hangul=3000 * k, punct=300 * k, space=200 * k, messages=6 * k, views=1) for k in (1, 2, 3)]
    observed = [Observation(0, round(sum(w * v for w, v in zip(true, x, strict=True))), features=x) for x in korean]
    cal = fit(observed, S, family="cl100k")
    prior = PRIORS["cl100k"].weights
    assert cal.weights[HANGUL] > 1.3 * prior[HANGUL]
    assert cal.weights[HAN] == pytest.approx(prior[HAN], rel=0.02)
    assert cal.weights[KANA] == pytest.approx(prior[KANA], rel=0.02)
    assert cal.class_ratios["hangul"] == cal.weights[HANGUL]
    assert cal.class_ratios["cjk"] == cal.weights[HAN]  # the first version's name, kept for clients
