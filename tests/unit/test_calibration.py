"""Per-model calibration (DESIGN §5.3)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contextsvc.config import TokenSettings
from contextsvc.core.calibration import Calibration, CalibrationRegistry, Observation, fallback, fit

S = TokenSettings()


def test_settings_pins() -> None:
    assert (S.calibration_window, S.calibration_min_spread) == (8, 1.25)
    assert (S.calibration_min_slope, S.calibration_max_slope) == (0.25, 1.0)
    assert S.fallback_chars_per_token == 1.8


def test_two_spread_observations_fit_a_line() -> None:
    cal = fit([Observation(1000, 400), Observation(2000, 700)], S)
    assert cal.fitted
    assert cal.tokens_per_char == pytest.approx(0.3)
    assert cal.overhead == pytest.approx(100)
    assert cal.estimate(3000) == 1000
    assert cal.estimate_delta(1000) == 300  # the overhead is paid once per prompt


def test_without_observations_the_fallback_is_chars_over_1_8() -> None:
    cal = fit([], S)
    assert cal == Calibration(0.0, 1 / 1.8, 0, fitted=False)
    assert cal.estimate(1800) == 1000
    assert cal.estimate(0) == 0


def test_one_observation_is_not_a_line() -> None:
    assert not fit([Observation(1000, 400)], S).fitted


def test_observations_too_close_in_size_keep_the_fallback() -> None:
    cal = fit([Observation(1000, 400), Observation(1100, 430)], S)  # 1.1x apart
    assert cal == fallback(S, 2)
    assert cal.estimate(3000) == round(3000 / 1.8)


def test_exactly_the_minimum_spread_fits() -> None:
    assert fit([Observation(1000, 400), Observation(1250, 475)], S).fitted


@pytest.mark.parametrize(
    "points",
    [
        [(1000, 500), (2000, 2000)],  # slope 1.5 tokens/char: a truncated or mismatched count
        [(1000, 400), (2000, 500)],  # slope 0.1
        [(1000, 900), (2000, 400)],  # negative slope
    ],
)
def test_an_implausible_slope_is_rejected(points: list[tuple[int, int]]) -> None:
    cal = fit([Observation(c, t) for c, t in points], S)
    assert not cal.fitted
    assert cal.tokens_per_char == pytest.approx(1 / 1.8)
    assert cal.estimate(3000) == round(3000 / 1.8)


def test_image_observations_change_nothing() -> None:
    base = [Observation(1000, 400), Observation(2000, 700)]
    with_image = [*base, Observation(1500, 5000, had_images=True)]
    assert fit(with_image, S) == fit(base, S)
    # and alone they are not even a fallback "observation"
    assert fit([Observation(1000, 400, True), Observation(2000, 700, True)], S) == fallback(S, 0)


def test_only_the_newest_window_of_observations_is_fitted() -> None:
    old = [Observation(1000 * (i + 1), 900 * (i + 1)) for i in range(5)]  # slope 0.9
    new = [Observation(1000 * (i + 1), 100 + 300 * (i + 1)) for i in range(8)]  # slope 0.3
    cal = fit([*old, *new], S)
    assert cal.observations == 8
    assert cal.tokens_per_char == pytest.approx(0.3)


def test_spread_is_judged_within_the_window_only() -> None:
    # Sizes spread in old observations do not license a fit on eight same-size new ones.
    obs = [Observation(100, 40), *[Observation(5000, 1600)] * 8]
    assert not fit(obs, S).fitted


def test_settings_change_the_rules() -> None:
    loose = TokenSettings(calibration_min_spread=1.05, calibration_max_slope=2.0)
    assert fit([Observation(1000, 400), Observation(1100, 430)], loose).fitted
    assert fit([Observation(1000, 500), Observation(2000, 2000)], loose).fitted


@given(
    st.floats(0.26, 0.99),
    st.floats(0, 500),
    st.lists(st.integers(1000, 200_000), min_size=2, max_size=12, unique=True),
)
def test_exact_lines_are_recovered(slope: float, overhead: float, sizes: list[int]) -> None:
    obs = [Observation(c, round(overhead + slope * c)) for c in sizes]
    cal = fit(obs, S)
    window = sizes[-8:]
    if max(window) < 1.25 * min(window):
        assert not cal.fitted
        return
    assert cal.fitted
    assert cal.tokens_per_char == pytest.approx(slope, abs=0.01)
    big = max(window)
    assert cal.estimate(big) == pytest.approx(overhead + slope * big, rel=0.01, abs=2)


# --- the registry --------------------------------------------------------------------------


def test_registry_is_per_model() -> None:
    reg = CalibrationRegistry(S)
    before_b = reg.calibration("model-b")
    reg.observe("model-a", Observation(1000, 400))
    cal_a = reg.observe("model-a", Observation(2000, 700))
    assert cal_a.fitted and cal_a.estimate(3000) == 1000
    assert reg.calibration("model-b") == before_b == fallback(S)
    assert reg.observations("model-b") == ()


def test_registry_ignores_image_observations() -> None:
    reg = CalibrationRegistry(S)
    reg.observe("m", Observation(1000, 400))
    fitted = reg.observe("m", Observation(2000, 700))
    assert reg.observe("m", Observation(9000, 99_000, had_images=True)) == fitted
    assert len(reg.observations("m")) == 2


def test_registry_keeps_a_bounded_window_and_loads_from_the_store() -> None:
    reg = CalibrationRegistry(S)
    assert not reg.is_loaded("m")
    stored = [Observation(1000 * (i + 1), 100 + 300 * (i + 1)) for i in range(20)]
    cal = reg.load("m", stored)
    assert reg.is_loaded("m")
    assert reg.observations("m") == tuple(stored[-8:])
    assert cal.fitted and cal.tokens_per_char == pytest.approx(0.3)
    reg.observe("m", Observation(50_000, 15_100))
    assert len(reg.observations("m")) == 8
    reg.forget("m")
    assert not reg.is_loaded("m") and reg.calibration("m") == fallback(S)


def test_registry_refits_after_each_observation() -> None:
    reg = CalibrationRegistry(S)
    reg.load("m", [Observation(1000, 400), Observation(2000, 700)])
    first = reg.calibration("m")
    reg.observe("m", Observation(4000, 1700))
    assert reg.calibration("m") != first
