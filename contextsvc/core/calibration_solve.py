"""The numeric kernels of the calibration fit (``core.calibration.fit``), made cheap and exact.

Every ``RecordBaseline`` refits its model (the response carries the fit), so a fit runs once per
agent turn. What it computes is defined in ``core.calibration``; this module computes exactly
that — the same floating-point operations on the same operands in the same order, so every fit
is bitwise the one the plain loops gave (``bench/load/fit_cost.py`` compares them; the unit tests
in ``tests/unit/test_calibration_solve.py`` compare with a direct transcription) — with less
Python around them:

- **Gram entries are kept across fits.** A model's observation window slides by one baseline at
  a time, so a new fit shares all but one of its rows with the last one. Each row (an
  observation's shares of its count at the prior) gets a number per spread ``sigma``, and each
  entry ``sum_j (a_i[j] * s2[j]) * a_k[j]`` is computed once per pair of rows and spread: a
  window of ``n`` adds ``2n - 1`` products instead of ``n^2``. Bounded: past ``_MAX_ROWS`` rows
  a spread starts afresh.
- **Residuals are computed once** per reweighting pass and handed on (the trim and the fit's
  in-sample residuals read the same numbers the last pass computed).
- **Gaussian elimination** skips the column it just eliminated (those entries are never read
  again) and finds its pivot without a key function; the pivot is the same row ``max`` picked
  (the first of the largest magnitudes).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from operator import mul

#: One observation's row: each feature's share of its count at the prior (``core.calibration``
#: sets the constants the kernels take: noise, Huber threshold, trim level, passes, bounds).
Row = tuple[float, ...]
Matrix = Sequence[Sequence[float]]

#: Rows a spread keeps Gram entries for before it starts afresh: the windows of 16 models of a family
#: at the default ``calibration_window`` (about 2 KB a row with its entries: ~256 KB a spread, three
#: spreads a vocabulary family).
_MAX_ROWS = 128


class _Spread:
    """Gram entries of one spread: each distinct row's number, ``A S`` row, and its products."""

    __slots__ = ("dots", "ids", "last", "last_index", "s2", "scaled")

    def __init__(self, sigma: Sequence[float]) -> None:
        self.s2 = [s * s for s in sigma]
        self.ids: dict[Row, int] = {}
        self.scaled: list[Row] = []
        self.dots: list[dict[int, float]] = []
        #: the rows (by number) of the last Gram matrix made, and that matrix (never changed after)
        self.last_index: tuple[int, ...] = ()
        self.last: list[list[float]] = []


_spreads: dict[tuple[float, ...], _Spread] = {}
_lock = threading.Lock()


def gram(rows: Sequence[Row], sigma: tuple[float, ...]) -> tuple[list[Row], list[list[float]]]:
    """``(A S, A S A')`` of ``rows`` for the spread ``sigma``: entry ``[i][k]`` is
    ``sum(map(mul, a_i * s2, a_k))`` with ``s2 = sigma^2``, as written out in full."""
    with _lock:
        spread = _spreads.get(sigma)
        if spread is None or len(spread.ids) > _MAX_ROWS:
            if len(_spreads) > 48:
                _spreads.clear()
            spread = _spreads[sigma] = _Spread(sigma)
        ids, scaled_of, dots_of, s2 = spread.ids, spread.scaled, spread.dots, spread.s2
        index = []
        for row in rows:
            i = ids.get(row)
            if i is None:
                i = ids[row] = len(scaled_of)
                scaled_of.append(tuple(map(mul, row, s2)))
                dots_of.append({})
            index.append(i)
        scaled = [scaled_of[i] for i in index]
        key = tuple(index)
        last_index, last = spread.last_index, spread.last
        if key == last_index:
            return scaled, last
        shift = _slide(last_index, key)
        if shift is not None:
            # The window slid by ``shift`` baselines (one per baseline; more when baselines shared
            # a refit) and gained the rest: the last matrix without its first ``shift`` rows and
            # columns, then the new rows' entries (the same numbers the cache holds for the pairs).
            kept = len(last_index) - shift
            out = [line[shift:] for line in last[shift:]]
            new, new_rows = key[kept:], rows[kept:]
            for line, i, si in zip(out, key, scaled, strict=False):
                dots = dots_of[i]
                for k, rk in zip(new, new_rows, strict=True):
                    v = dots.get(k)
                    if v is None:
                        v = dots[k] = sum(map(mul, si, rk))
                    line.append(v)
            out += [_line(dots_of[i], si, key, rows) for i, si in zip(new, scaled[kept:], strict=True)]
        else:
            out = [_line(dots_of[i], si, key, rows) for i, si in zip(key, scaled, strict=True)]
        spread.last_index, spread.last = key, out
    return scaled, out


def _slide(last: tuple[int, ...], key: tuple[int, ...]) -> int | None:
    """How many rows ``key`` dropped from the front of ``last`` when its first rows are the rest of
    ``last`` (a window that slid and grew); None when it shares no such run with it."""
    for shift in range(len(last)):
        kept = len(last) - shift
        if kept <= len(key) and key[:kept] == last[shift:]:
            return shift
    return None


def _line(dots: dict[int, float], si: Row, index: Sequence[int], rows: Sequence[Row]) -> list[float]:
    """Row ``i`` of the Gram matrix (``si`` = row ``i`` of ``A S``), from the cache or computed."""
    line = []
    for k, rk in zip(index, rows, strict=True):
        v = dots.get(k)
        if v is None:
            v = dots[k] = sum(map(mul, si, rk))
        line.append(v)
    return line


def clamp(delta: Sequence[float], bounds: Sequence[tuple[float, float]]) -> list[float]:
    """Each ``delta[j]`` with ``1 + delta[j]`` held in ``bounds[j]``."""
    return [min(max(1.0 + d, lo), hi) - 1.0 for d, (lo, hi) in zip(delta, bounds)]  # noqa: B905


def map_solve(
    scaled: Sequence[Row],
    gram_: Matrix,
    keep: Sequence[int],
    left: Sequence[float],
    weights: Sequence[float],
    obs_var: float,
    width: int,
    columns: Sequence[Row] = (),
) -> list[float]:
    """``delta = S A' (A S A' + obs_var W^-1)^-1 r`` over the ``keep`` rows (the dual form: an
    n x n system for n observations)."""
    if len(keep) == len(gram_):
        m = [list(line) for line in gram_]
        for a in range(len(m)):
            m[a][a] += obs_var / max(weights[a], 1e-6)
        z = solve(m, list(left))
        if columns:  # ``zip(*scaled)``, made once by the caller
            return [sum(map(mul, column, z)) for column in columns]
        kept: Sequence[Row] = scaled
    else:
        m = [[gram_[i][k] for k in keep] for i in keep]
        for a, i in enumerate(keep):
            m[a][a] += obs_var / max(weights[i], 1e-6)
        z = solve(m, [left[i] for i in keep])
        kept = [scaled[i] for i in keep]
    return [sum(map(mul, column, z)) for column in zip(*kept)] if kept else [0.0] * width  # noqa: B905


def solve(m: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (``m`` is symmetric positive definite); ``m``
    and ``b`` are overwritten."""
    n = len(b)
    for col in range(n):
        pivot, largest = col, abs(m[col][col])
        for r in range(col + 1, n):
            v = abs(m[r][col])
            if v > largest:
                pivot, largest = r, v
        if pivot != col:
            m[col], m[pivot] = m[pivot], m[col]
            b[col], b[pivot] = b[pivot], b[col]
        head = m[col]
        p = head[col]
        top = head[col + 1 :]
        bc = b[col]
        nxt = col + 1
        for r in range(nxt, n):
            row = m[r]
            f = row[col] / p
            if f:
                # zip without ``strict``: the check costs a fifth of this line (same lengths here).
                row[nxt:] = [x - f * y for x, y in zip(row[nxt:], top)]  # noqa: B905
                b[r] -= f * bc
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (b[r] - sum(map(mul, m[r][r + 1 :], x[r + 1 :]))) / m[r][r]
    return x


def robust(
    rows: Sequence[Row],
    left: Sequence[float],
    scaled: Sequence[Row],
    gram_: Matrix,
    *,
    bounds: Sequence[tuple[float, float]],
    obs_var: float,
    huber: float,
    trim: float,
    passes: int,
) -> tuple[list[float], list[int], list[float], list[float]]:
    """The robust MAP deltas: Huber reweighting, then a second round without the observations
    still past ``trim``. Returns the deltas, the kept observations, their weights and the kept
    observations' residuals under the deltas."""
    n = len(rows)
    keep = list(range(n))
    weights = [1.0] * n
    width = len(bounds)
    delta = [0.0] * width
    residual: dict[int, float] = {}
    columns = list(zip(*scaled))  # noqa: B905 - rows of one width
    for _ in range(2):  # the second round without the trimmed observations
        for _ in range(passes):
            delta = clamp(map_solve(scaled, gram_, keep, left, weights, obs_var, width, columns), bounds)
            changed = False
            residual = {}
            for i in keep:
                e = residual[i] = left[i] - sum(map(mul, rows[i], delta))
                e = abs(e)
                w = 1.0 if e <= huber else huber / e
                changed |= abs(w - weights[i]) > 1e-3
                weights[i] = w
            if not changed:
                break
        trimmed = [i for i in keep if abs(residual[i]) <= trim]
        if len(trimmed) == len(keep) or not trimmed:
            break
        keep = trimmed
    return delta, keep, weights, [residual[i] for i in keep]


def log_evidence(
    left: Sequence[float], keep: Sequence[int], weights: Sequence[float], gram_: Matrix, text_var: float
) -> float:
    """Log marginal likelihood of the kept residuals under deltas ~ N(0, sigma^2), ``gram_`` being
    ``A S A'`` for that sigma: with ``M = A S A' + text_var W^-1``, ``-(r' M^-1 r + log det M) / 2``."""
    r = [left[i] for i in keep]
    n = len(keep)
    # Only the lower triangle (k <= i): all the Cholesky below reads.
    if n == len(gram_):
        m = [list(line[: i + 1]) for i, line in enumerate(gram_)]
    else:
        m = [[gram_[keep[i]][keep[k]] for k in range(i + 1)] for i in range(n)]
    for i in range(n):
        m[i][i] += text_var / max(weights[keep[i]], 1e-6)
    # Cholesky: M = L L'; r' M^-1 r = |L^-1 r|^2, log det M = 2 sum log L_ii. Row i of L grows
    # one entry at a time, so ``map`` over it reads exactly its first k entries (no slices).
    low: list[list[float]] = []
    for i in range(n):
        row: list[float] = []
        mi = m[i]
        for k in range(i):
            lk = low[k]
            row.append((mi[k] - sum(map(mul, row, lk))) / lk[k])
        row.append(math.sqrt(max(mi[i] - sum(map(mul, row, row)), 1e-300)))
        low.append(row)
    z: list[float] = []
    for i in range(n):
        z.append((r[i] - sum(map(mul, low[i], z))) / low[i][i])
    return -0.5 * (sum(v * v for v in z) + 2 * sum(math.log(low[i][i]) for i in range(n)))
