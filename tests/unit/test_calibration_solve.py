"""The fit's kernels (core/calibration_solve.py) give bitwise the fit of the plain loops.

``reference_fit`` below is the fit as it was written before the kernels moved out (plain
Python, a Gram matrix computed in full for every fit, residuals recomputed where read): the
oracle. Every field of ``fit``'s calibration must equal it exactly, on random windows (honest
counts, outliers that trigger the trim, every family), on windows sliding one baseline at a time
(the Gram entries then come from the cache kept across fits), and after the cache starts afresh.
"""

from __future__ import annotations

import math
import random
from operator import mul

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextsvc.config import TokenSettings
from contextsvc.core import calibration, calibration_solve
from contextsvc.core.calibration import Calibration, Observation, _starting_margin, _starting_margins, fit
from contextsvc.core.priors import CYRILLIC_COLUMNS, MESSAGE, N_CLASSES, N_FEATURES, N_UNITS, TOOL_CALL, VIEW, prior_for
from contextsvc.core.sizing import CYRILLIC

S = TokenSettings()

# --- the oracle: the fit as plain loops (constants as in core/calibration.py) ----------------
_OBS_SIGMA, _HUBER, _TRIM, _IRLS_PASSES = 0.01, 0.03, 0.25, 4
_SCALES, _TEXT_SIGMA, _BAYES_FACTOR = (0.2, 1.0, 5.0), 0.05, 10.0
_CLASS_BOUNDS, _OVERHEAD_BOUNDS = (0.4, 2.5), (0.0, 4.0)


def _dot(a, b):  # type: ignore[no-untyped-def]
    return sum(map(mul, a, b))


def _gram(rows, sigma):  # type: ignore[no-untyped-def]
    s2 = [s * s for s in sigma]
    scaled = [list(map(mul, row, s2)) for row in rows]
    return scaled, [[sum(map(mul, si, rk)) for rk in rows] for si in scaled]


def _clamp(delta):  # type: ignore[no-untyped-def]
    out = []
    for j, d in enumerate(delta):
        lo, hi = _CLASS_BOUNDS if j < N_UNITS else _OVERHEAD_BOUNDS
        out.append(min(max(1.0 + d, lo), hi) - 1.0)
    return out


def _solve(m, b):  # type: ignore[no-untyped-def]
    n = len(b)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        b[col], b[pivot] = b[pivot], b[col]
        top = m[col][col:]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                m[r][col:] = [x - f * y for x, y in zip(m[r][col:], top, strict=True)]
                b[r] -= f * b[col]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (b[r] - sum(map(mul, m[r][r + 1 :], x[r + 1 :]))) / m[r][r]
    return x


def _map_solve(scaled, gram, keep, left, weights):  # type: ignore[no-untyped-def]
    m = [[gram[i][k] for k in keep] for i in keep]
    for a, i in enumerate(keep):
        m[a][a] += _OBS_SIGMA**2 / max(weights[i], 1e-6)
    z = _solve(m, [left[i] for i in keep])
    kept = [scaled[i] for i in keep]
    return [sum(map(mul, column, z)) for column in zip(*kept, strict=True)]


def _robust(rows, left, sigma):  # type: ignore[no-untyped-def]
    keep = list(range(len(rows)))
    weights = [1.0] * len(rows)
    delta = [0.0] * N_FEATURES
    scaled, gram = _gram(rows, sigma)
    for _ in range(2):
        for _ in range(_IRLS_PASSES):
            delta = _clamp(_map_solve(scaled, gram, keep, left, weights))
            changed = False
            for i in keep:
                e = abs(left[i] - _dot(rows[i], delta))
                w = 1.0 if e <= _HUBER else _HUBER / e
                changed |= abs(w - weights[i]) > 1e-3
                weights[i] = w
            if not changed:
                break
        residual = {i: left[i] - _dot(rows[i], delta) for i in keep}
        trimmed = [i for i in keep if abs(residual[i]) <= _TRIM]
        if len(trimmed) == len(keep) or not trimmed:
            break
        keep = trimmed
    return delta, keep, weights


def _log_evidence(rows, left, keep, weights, sigma):  # type: ignore[no-untyped-def]
    r = [left[i] for i in keep]
    n = len(keep)
    gram = _gram(rows, sigma)[1]
    m = [[gram[keep[i]][keep[k]] for k in range(i + 1)] for i in range(n)]
    for i in range(n):
        m[i][i] += _TEXT_SIGMA**2 / max(weights[keep[i]], 1e-6)
    low: list[list[float]] = []
    for i in range(n):
        row: list[float] = []
        for k in range(i):
            row.append((m[i][k] - sum(map(mul, row, low[k]))) / low[k][k])
        row.append(math.sqrt(max(m[i][i] - sum(map(mul, row, row)), 1e-300)))
        low.append(row)
    z: list[float] = []
    for i in range(n):
        z.append((r[i] - sum(map(mul, low[i], z))) / low[i][i])
    return -0.5 * (sum(v * v for v in z) + 2 * sum(math.log(low[i][i]) for i in range(n)))


def _quantile(values, q):  # type: ignore[no-untyped-def]
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _margin(residuals, cold):  # type: ignore[no-untyped-def]
    q = _quantile([max(0.0, r) for r in residuals], S.margin_quantile)
    w = S.margin_prior_weight
    return max(S.margin_floor, (w * cold + len(residuals) * q) / (w + len(residuals)))


def _in_sample_margin(residuals, cold):  # type: ignore[no-untyped-def]
    p90 = _quantile([abs(r) for r in residuals], 0.9) if residuals else cold
    fading = cold * S.margin_prior_weight / (S.margin_prior_weight + len(residuals))
    return max(S.margin_floor, p90 + fading)


def reference_fit(observations: list[Observation], family: str) -> Calibration:
    usable = [o for o in observations if o.usable][-S.calibration_window :]
    prior = prior_for(family)
    p = prior.weights
    rows = [[x * w / o.tokens for x, w in zip(o.features, p, strict=True)] for o in usable]
    left = [1.0 - sum(a) for a in rows]
    delta, keep, weights = _robust(rows, left, prior.sigma)
    evidence_of = {k: _log_evidence(rows, left, keep, weights, [k * s for s in prior.sigma]) for k in _SCALES}
    best = _SCALES[0]
    for k in _SCALES[1:]:
        if evidence_of[k] > evidence_of[best] + _BAYES_FACTOR:
            best = k
    if best != 1.0:
        delta, keep, weights = _robust(rows, left, [best * s for s in prior.sigma])
    fitted = tuple(w * (1.0 + d) for w, d in zip(p, delta, strict=True))
    residuals = tuple(left[i] - _dot(rows[i], delta) for i in keep)
    evidence = tuple(min(1.0, sum(rows[i][j] for i in keep)) for j in range(N_FEATURES))
    recorded = [r for r in (usable[i].residual for i in keep) if r is not None]

    def blended(cold: float) -> float:
        return _margin(recorded, cold) if recorded else _in_sample_margin(residuals, cold)

    # Where the margins start from (core/calibration.py's, not a kernel of the fit).
    starts = _starting_margins(prior, evidence)
    return Calibration(
        fitted,
        len(usable),
        fitted=True,
        margin=blended(_starting_margin(prior, evidence, starts)),
        family=family,
        residuals=residuals,
        evidence=evidence,
        margins=tuple(blended(m) for m in starts),
    )


# --- the comparison ----------------------------------------------------------------------------

FAMILIES = ("default", "o200k", "cl100k")


def same(a: Calibration, b: Calibration) -> None:
    for name in ("weights", "observations", "fitted", "margin", "family", "residuals", "evidence", "margins"):
        assert getattr(a, name) == getattr(b, name), name


def observation(rng: random.Random, spread: bool) -> Observation:
    f = [0.0] * N_FEATURES
    for j in rng.sample(range(N_CLASSES), rng.randint(1, 5)):
        f[j] = rng.uniform(1, 8000)
    for j in CYRILLIC_COLUMNS.values():  # each family's own count of the Cyrillic pieces
        f[j] = f[CYRILLIC] * rng.uniform(0.6, 1.5)
    f[MESSAGE], f[TOOL_CALL], f[VIEW] = rng.randint(1, 300), rng.randint(0, 30), rng.choice([0, 1])
    ratio = rng.choice([1.0, 0.5, 2.0, 1.05, 0.97, rng.uniform(0.3, 3)]) if spread else rng.uniform(0.95, 1.08)
    tokens = max(1, int(sum(f) / rng.choice([2.5, 3.5, 4.0]) * ratio))
    return Observation(
        chars=int(sum(f)), tokens=tokens, features=tuple(f), residual=rng.choice([None, 0.01, -0.02, 0.1, 0.3])
    )


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 12), spread=st.booleans(), family=st.sampled_from(FAMILIES))
def test_a_fit_is_bitwise_the_plain_loops_fit(seed: int, n: int, spread: bool, family: str) -> None:
    rng = random.Random(seed)
    window = [observation(rng, spread) for _ in range(n)]
    same(fit(window, S, family=family), reference_fit(window, family))


@pytest.mark.parametrize("spread", [False, True])
def test_windows_sliding_one_baseline_at_a_time_reuse_gram_entries_and_stay_exact(spread: bool) -> None:
    rng = random.Random(7 if spread else 8)
    history = [observation(rng, spread) for _ in range(60)]
    for end in range(1, len(history) + 1):
        window = history[max(0, end - S.calibration_window) : end]
        same(fit(window, S, family="o200k"), reference_fit(window, "o200k"))
    # the same windows again: every entry comes from the cache
    for end in range(S.calibration_window, len(history) + 1, 7):
        window = history[end - S.calibration_window : end]
        same(fit(window, S, family="o200k"), reference_fit(window, "o200k"))


@pytest.mark.parametrize("spread", [False, True])
def test_windows_sliding_several_baselines_at_a_time_stay_exact(spread: bool) -> None:
    """Baselines that shared a refit (``TokenAccounting._gather``) slide the window by several:
    the kept matrix without its first rows and columns plus the new rows' entries."""
    rng = random.Random(17 if spread else 18)
    history = [observation(rng, spread) for _ in range(90)]
    end = 0
    steps = [1, 2, 3, 5, 8, 4, 1, 7, 2, 6, 3, 9, 1]
    for k in range(40):
        end = min(len(history), end + steps[k % len(steps)])
        window = history[max(0, end - S.calibration_window) : end]
        same(fit(window, S, family="default"), reference_fit(window, "default"))
    assert calibration_solve._slide((1, 2, 3), (3, 4)) == 2
    assert calibration_solve._slide((1, 2, 3), (4, 5)) is None
    assert calibration_solve._slide((1, 2, 3), (1, 2, 3, 4)) == 0


def test_the_gram_cache_is_bounded_and_starting_afresh_keeps_fits_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibration_solve, "_MAX_ROWS", 20)
    monkeypatch.setattr(calibration_solve, "_spreads", {})
    rng = random.Random(3)
    history = [observation(rng, True) for _ in range(80)]
    for end in range(S.calibration_window, len(history) + 1):
        window = history[end - S.calibration_window : end]
        same(fit(window, S, family="cl100k"), reference_fit(window, "cl100k"))
        assert all(len(spread.ids) <= 20 + S.calibration_window for spread in calibration_solve._spreads.values())


def test_solve_matches_elimination_over_whole_rows() -> None:
    rng = random.Random(5)
    for n in range(1, 10):
        for _ in range(30):
            a = [[rng.uniform(-1, 1) for _ in range(n)] for _ in range(n)]
            m = [
                [sum(a[i][k] * a[j][k] for k in range(n)) + (1.0 if i == j else 0.0) for j in range(n)]
                for i in range(n)
            ]
            b = [rng.uniform(-5, 5) for _ in range(n)]
            assert calibration_solve.solve([list(r) for r in m], list(b)) == _solve([list(r) for r in m], list(b))


@pytest.mark.parametrize("classes", [(0,), (0, 3, 4), tuple(range(N_CLASSES))])
def test_a_window_that_never_shows_some_features_fits_bitwise_as_over_every_feature(classes: tuple[int, ...]) -> None:
    """One script's text leaves most columns zero in every baseline; the fit runs its kernels over
    the others only (``calibration._used_columns``), and must give the full width's numbers."""
    rng = random.Random(len(classes))
    window = []
    for _ in range(S.calibration_window):
        f = [0.0] * N_FEATURES
        for j in classes:
            f[j] = rng.uniform(50, 8000)
        f[MESSAGE], f[TOOL_CALL], f[VIEW] = rng.randint(1, 300), 0, 1  # never a tool call
        tokens = max(1, int(sum(f) / 3.2 * rng.uniform(0.95, 1.1)))
        window.append(Observation(chars=int(sum(f)), tokens=tokens, features=tuple(f), residual=0.01))
    fitted = fit(window, S, family="o200k")
    same(fitted, reference_fit(window, "o200k"))
    unused = [j for j in range(N_FEATURES) if j not in classes and j not in (MESSAGE, VIEW)]
    prior = prior_for("o200k").weights
    assert all(fitted.weights[j] == prior[j] for j in unused)  # a feature never seen keeps its prior
    assert calibration._used_columns([tuple(o.features) for o in window]) == sorted([*classes, MESSAGE, VIEW])
