"""``Calibration.margin_of`` from the margin prices made once per calibration: the same floats as
each feature's margin times its weight times its units, summed in order."""

from __future__ import annotations

import dataclasses
import random

from contextsvc.core.calibration import Calibration
from contextsvc.core.priors import N_FEATURES


def _explicit(cal: Calibration, features: tuple[float, ...]) -> float:
    return sum(m * w * x for m, w, x in zip(cal.margins, cal.weights, features, strict=False))


def test_margin_of_is_exactly_the_explicit_sum_and_follows_a_replaced_calibration() -> None:
    rng = random.Random(7)
    for _ in range(200):
        weights = tuple(rng.uniform(0.01, 2.0) for _ in range(N_FEATURES))
        margins = tuple(rng.uniform(0.0, 0.4) for _ in range(N_FEATURES))
        cal = Calibration(weights, 5, fitted=True, margin=0.1, margins=margins)
        features = tuple(float(rng.choice([0, 0, rng.randint(1, 5000)])) for _ in range(N_FEATURES))
        assert cal.margin_of(features) == _explicit(cal, features)  # bitwise, not approximately
        wider = dataclasses.replace(cal, margins=tuple(2 * m for m in margins))
        assert wider.margin_of(features) == _explicit(wider, features)
    # Without a margin per weight: the overall margin of the price.
    plain = Calibration((0.5,) * N_FEATURES, 1, fitted=False, margin=0.2)
    assert plain.margin_prices == ()
    assert plain.margin_of((10.0,) * N_FEATURES) == 0.2 * plain.price((10.0,) * N_FEATURES)
