"""Per-model calibration: tokens as a priced sum of content-class units and overheads (DESIGN §5.3).

What a view costs is modelled where the cost arises::

    tokens ~ sum_c ratio_c * units_c  +  per_message * messages  +  per_tool_call * tool_calls
             + per_view * views

``units_c`` are the size units of each content class (``sizing.CLASSES``: words, identifiers,
numbers, punctuation, whitespace, Cyrillic, CJK, other scripts) and of each vocabulary family's
own count of the Cyrillic pieces (``sizing.CYRILLIC_FAMILIES``: a measured family's prior prices
its own column and not the shared Cyrillic class; ``default`` the other way round), and the
units of the ``_name``/``.attr`` identifier pieces again (``sizing.IDENT_PREFIXED``: an extra
price on top of ``ident`` that only Claude's prior weights); ``messages``/``tool_calls``
count the chat-template framing; ``views`` is 1 for a whole prompt (its reply primer) and 0 for
a standalone message list, which is therefore never charged a view's overhead. One line with one
intercept (the first version) priced a model's other content with the slope of the last one and
added a whole view's intercept to any list.

The fit is a regularized, robust regression *towards the prior* (``core.priors``, measured per
vocabulary family on the bench corpus): each weight is ``prior * (1 + delta)``; the deltas
minimize the squared *relative* residuals of the baselines plus ``(delta / sigma)^2`` per
feature. With two baselines of code it moves the classes code is made of and leaves Cyrillic
alone; a model switching content kinds keeps what earlier baselines taught about other classes.
Outliers are down-weighted (Huber weights, a few reweighting passes) and observations still far
off after that are trimmed. Every weight is clamped to a bounded range around its prior, so it
is never negative and never absurd.

Every calibration carries a relative ``margin`` that guards add to the estimate
(``TokenEstimate.margin``). It comes from *out-of-sample* residuals: each accepted baseline
records how far its real count was above the estimate the service had made for that view,
relative to what that estimate's margin protects (``margin_base``: what it priced, at least
``margin_view_share`` of the view's text; the part anchored on an earlier baseline is a real
count and is not priced, but a model may miss by a share of the whole view). The margin is the
``margin_quantile`` of the recent residuals, blended with the prior's cold margin (itself such
a quantile, measured on content the prior was not fitted on) while there are few of them, and
never below ``margin_floor``. In-sample residuals of the fit are no measure of the next view's
error (two baselines are fitted almost exactly; the next message is new text), which is why they
are only the fallback for observations written before residuals were recorded.

The calibration also knows which features its baselines have shown (``evidence``): the
truncation floor (``Calibration.floor``) holds a count against the fitted price of what the
baselines covered and against the vocabulary-free ``lower_bound`` for the rest, so a calibrated
model catches a truncated prompt that the bare bound would let through, and an uncalibrated
class (Cyrillic for a model seen only on English) can never refuse an honest count.

Observations persist ``features`` (one number per ``priors.FEATURES``); ``chars`` keeps the
total size units for older readers. An observation without features (written before this
model) is ignored by the fit.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import mul

from contextsvc.config import TokenSettings
from contextsvc.core import calibration_solve as solver
from contextsvc.core.priors import (
    CYRILLIC_COLUMNS,
    FEATURES,
    LOWER_BOUND,
    N_CLASSES,
    N_FEATURES,
    N_UNITS,
    VIEW,
    Prior,
    family_for,
    prior_for,
)
from contextsvc.core.sizing import CLASSES

#: Relative noise of one baseline (its count is exact; the template's details are not).
_OBS_SIGMA = 0.01
#: Huber threshold on the relative residual, and the trim level past the reweighting.
_HUBER = 0.03
_TRIM = 0.25
_IRLS_PASSES = 4
#: Multiples of the prior's spread the fit may choose between (by the baselines' evidence).
_SCALES = (0.2, 1.0, 5.0)
#: Relative noise of a baseline as the evidence sees it: the view's own text, which no weight
#: explains, differs from its price by a few percent.
_TEXT_SIGMA = 0.05
#: Log-evidence a wider spread must win by (nats) to be chosen over a narrower one.
_BAYES_FACTOR = 10.0
#: Bounds of a fitted weight as a multiple of its prior: classes, then the overheads.
_CLASS_BOUNDS = (0.4, 2.5)
_OVERHEAD_BOUNDS = (0.0, 4.0)


@dataclass(slots=True, frozen=True)
class Observation:
    """One baseline: the size of a view that was sent and the prompt tokens the provider counted.

    ``features`` holds the view's units per ``priors.FEATURES`` (empty for observations written
    before the class model; those are not fitted). ``chars`` is its total size units.
    """

    chars: int
    tokens: int
    had_images: bool = False
    features: tuple[float, ...] = ()
    #: (real - estimate) / margin_base of the estimate made for this view before its count was known
    #: (None when not known: written before residuals were recorded, or nothing was priced).
    residual: float | None = None

    @property
    def usable(self) -> bool:
        # Image tokens are not in the size: fed to the fit they would land in the class weights
        # and skew every later text estimate for the model.
        return (
            not self.had_images
            and self.tokens > 0
            and len(self.features) == N_FEATURES
            and sum(self.features[:N_CLASSES]) > 0
        )


@dataclass(slots=True, frozen=True)
class Calibration:
    """Prices per feature (tokens per unit), how it was obtained, and its relative margin."""

    weights: tuple[float, ...]
    observations: int
    fitted: bool
    margin: float
    family: str = "default"
    residuals: tuple[float, ...] = field(default=(), compare=False)
    #: how much of each feature the fitted baselines carried (0 = never seen, 1 = a view's worth
    #: or more): where the fitted weights are backed by real counts.
    evidence: tuple[float, ...] = field(default=(), compare=False)
    #: relative margin of each feature's price (``FEATURES`` order; empty: ``margin`` for all).
    margins: tuple[float, ...] = field(default=(), compare=False)
    #: the ``margin_quantile`` of the recorded residuals (each relative to its view's
    #: ``margin_base``), and the weight it has in ``margins`` (n / (margin_prior_weight + n));
    #: 0 without recorded residuals. ``margin_beyond`` prices the base past what was priced.
    residual_rate: float = field(default=0.0, compare=False)
    residual_weight: float = field(default=0.0, compare=False)
    #: each feature's margin times its weight (``margins`` by ``weights``; empty when ``margins``
    #: does not give one per weight), made once: ``margin_of`` runs on every estimate.
    margin_prices: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.margins) == len(self.weights):
            object.__setattr__(self, "margin_prices", tuple(map(mul, self.margins, self.weights)))

    def price(self, features: Sequence[float]) -> float:
        """Tokens of something with these ``features`` (unrounded)."""
        total: float = sum(map(mul, self.weights, features))
        return total

    def margin_of(self, features: Sequence[float]) -> float:
        """Tokens the price of ``features`` may be short by: each feature's price times its own
        relative margin (``margins``), or the overall ``margin`` times the price."""
        if len(self.margins) != len(self.weights):
            return self.margin * max(0.0, self.price(features))
        # (m * w) * x for each feature, as ``m * w * x`` evaluates: the same floats, summed in order.
        total: float = sum(map(mul, self.margin_prices, features))
        return total

    def margin_beyond(self, tokens: float) -> float:
        """Tokens of margin for ``tokens`` of a ``margin_base`` that the estimate did not price
        (a share of a baseline-anchored view past its delta): the residuals' part of the margin
        only, as the recorded residuals are relative to that base too. 0 when none are recorded."""
        return self.residual_weight * self.residual_rate * max(0.0, tokens)

    @property
    def overhead(self) -> float:
        """Tokens a whole prompt adds once (the reply primer): the per-view weight."""
        return self.weights[VIEW]

    @property
    def class_ratios(self) -> dict[str, float]:
        """Tokens per size unit of each content class by name, and ``cjk`` (the first version's
        single East Asian class, kept for clients that read it) as the Han ratio. A measured family
        prices Cyrillic by its own column (``priors.CYRILLIC_COLUMNS``): ``cyrillic`` is then that
        column's ratio, and each column is listed by its own name too (``ident_prefixed`` included: the
        extra price of a prefixed identifier on top of ``ident``, 0 for every family but Claude's)."""
        ratios = dict(zip(CLASSES, self.weights, strict=False))
        ratios["cjk"] = ratios["han"]
        for name, j in zip(FEATURES[N_CLASSES:N_UNITS], range(N_CLASSES, N_UNITS), strict=True):
            ratios[name] = self.weights[j] if j < len(self.weights) else 0.0
        own = CYRILLIC_COLUMNS.get(self.family)
        if own is not None and own < len(self.weights) and self.weights[own] > 0:
            ratios["cyrillic"] = self.weights[own]
        return ratios

    @property
    def tokens_per_char(self) -> float:
        """Tokens per size unit of plain words (kept for the contract's single-number field)."""
        return self.weights[0]

    def floor(self, features: Sequence[float], ratio: float) -> int:
        """Fewest tokens an honest count of something with these ``features`` may plausibly have:
        ``ratio`` x the fitted price where the baselines showed the feature (``evidence``), the
        vocabulary-free ``lower_bound`` where they did not, blended by how much they showed."""
        total = 0.0
        for j, x in enumerate(features[:N_FEATURES]):
            if not x:  # most columns of a view are empty: adding 0.0 changes nothing
                continue
            low = LOWER_BOUND[j]
            e = self.evidence[j] if j < len(self.evidence) else 0.0
            total += x * (low + e * max(0.0, ratio * self.weights[j] - low))
        return math.floor(total)


def margin_base(priced: float, text: float, share: float) -> float:
    """What a margin protects, and what a baseline's residual is relative to: the tokens the
    estimate priced, but at least ``share`` (``margin_view_share``) of the view's text.

    A baseline-anchored view prices only its delta (the rest is a real count), yet a model's
    count can miss by a share of the whole view (its hidden framing, tokens it adds per prompt):
    relative to a small delta such a miss is a huge rate, and applied to a whole context priced
    fresh (after a compaction) that rate aimed the compaction far too low. Relative to this base
    a residual means the same for a delta and for a whole context, and the margin of an anchored
    view covers at least that share of it (``Calibration.margin_beyond``)."""
    return max(priced, share * text)


def lower_bound(features: Sequence[float]) -> int:
    """Fewest tokens any vocabulary measured could count for these ``features`` (with room):
    valid before any calibration, so an honest count is never below it."""
    total: float = sum(map(mul, LOWER_BOUND, features))  # the same products, summed in the same order
    return math.floor(total)


def fallback(settings: TokenSettings, observations: int = 0, *, family: str = "default") -> Calibration:
    """The cold calibration: the family's prior and its cold margin."""
    prior = prior_for(family)
    return Calibration(
        prior.weights,
        observations,
        fitted=False,
        margin=max(settings.margin_floor, prior.cold_margin),
        family=family,
        evidence=(0.0,) * N_FEATURES,
        margins=tuple(max(settings.margin_floor, m) for m in _cold_margins(prior.feature_margins, prior.cold_margin)),
    )


def _cold_margins(feature_margins: Sequence[float], cold: float) -> tuple[float, ...]:
    return tuple(feature_margins) if len(feature_margins) == N_FEATURES else (cold,) * N_FEATURES


def fit(observations: Iterable[Observation], settings: TokenSettings, *, family: str = "default") -> Calibration:
    """The regularized robust fit over the newest ``calibration_window`` usable observations.

    Fitted with at least one usable observation; otherwise the prior (``fallback``). The numeric
    kernels are ``core.calibration_solve``'s (the same operations, kept cheap across fits).
    """
    usable = [o for o in observations if o.usable][-settings.calibration_window :]
    if not usable:
        return fallback(settings, 0, family=family)
    prior = prior_for(family)
    p = prior.weights
    # a[i][j]: feature j's share of observation i's count at the prior; r[i]: what is left over.
    rows = [tuple([x * w / o.tokens for x, w in zip(o.features, p, strict=True)]) for o in usable]
    left = [1.0 - sum(a) for a in rows]
    # How far the weights may move: the prior's spread times the scale the baselines make most
    # likely (empirical Bayes over ``_SCALES``, on the observations the robust fit kept). Counts
    # that agree with the prior within the text's own noise keep it close (two baselines hardly
    # tell the next message's text apart from the prior); counts far from it (a model mapped to
    # the wrong family, a new vocabulary) widen it so a few baselines can move it all the way.
    # The kernels run over the features some observation of the window has (English text never
    # shows Han or Cyrillic columns): a column of zeros adds only exact zeros to every product and
    # sum, and its delta stays 0.0 through every pass, so the fit is the same to the last bit.
    used = _used_columns(rows)
    narrow = rows if len(used) == N_FEATURES else [tuple([a[j] for j in used]) for a in rows]
    sigma = [prior.sigma[j] for j in used]
    bounds = tuple(_BOUNDS[j] for j in used)
    grams = {k: solver.gram(narrow, tuple([k * s for s in sigma])) for k in _SCALES}
    delta, keep, weights, residuals = _robust(narrow, left, grams[1.0], bounds)
    evidence_of = {k: solver.log_evidence(left, keep, weights, grams[k][1], _TEXT_SIGMA**2) for k in _SCALES}
    best = _SCALES[0]
    for k in _SCALES[1:]:  # a wider spread only when the baselines clearly ask for it
        if evidence_of[k] > evidence_of[best] + _BAYES_FACTOR:
            best = k
    if best != 1.0:
        delta, keep, weights, residuals = _robust(narrow, left, grams[best], bounds)
    if len(used) < N_FEATURES:
        full = [0.0] * N_FEATURES
        for j, d in zip(used, delta, strict=True):
            full[j] = d
        delta = full
    fitted = tuple(w * (1.0 + d) for w, d in zip(p, delta, strict=True))
    evidence = tuple(min(1.0, sum(rows[i][j] for i in keep)) for j in range(N_FEATURES))
    # Residuals of the baselines the robust fit kept: a trimmed count (another model's, a bug) says
    # nothing about how far this model's estimates run short.
    recorded = [r for r in (usable[i].residual for i in keep) if r is not None]
    # The margin's quantile of the recorded residuals is the same for every cold margin it blends.
    q = _quantile([max(0.0, r) for r in recorded], settings.margin_quantile) if recorded else 0.0

    def blended(cold: float) -> float:
        return (
            _margin_of(q, len(recorded), cold, settings) if recorded else _in_sample_margin(residuals, cold, settings)
        )

    starts = _starting_margins(prior, evidence)
    n = len(recorded)
    return Calibration(
        fitted,
        len(usable),
        fitted=True,
        margin=blended(_starting_margin(prior, evidence, starts)),
        family=family,
        residuals=tuple(residuals),
        evidence=evidence,
        margins=tuple(blended(m) for m in starts),
        residual_rate=q,
        residual_weight=n / (settings.margin_prior_weight + n) if n else 0.0,
    )


def _starting_margins(prior: Prior, evidence: Sequence[float]) -> tuple[float, ...]:
    """Per feature, the margin a fitted calibration blends its recorded residuals with: the
    prior's cold margin, moved towards its ``fitted_margins`` by how much of the feature the
    baselines carried (``evidence``: 0 = never seen, the cold margin; 1 = a view's worth, the
    fitted one, never wider than the cold one). Only the ``default`` family has fitted margins."""
    cold = _cold_margins(prior.feature_margins, prior.cold_margin)
    if len(prior.fitted_margins) != N_FEATURES:
        return cold
    return tuple(c + e * (min(f, c) - c) for c, f, e in zip(cold, prior.fitted_margins, evidence, strict=True))


def _starting_margin(prior: Prior, evidence: Sequence[float], starts: Sequence[float]) -> float:
    """The overall counterpart of ``_starting_margins`` (``starts``, what it gave): the cold margin
    scaled as the features' margins are, weighted by how much the baselines carried of each (the
    classes only)."""
    if len(prior.fitted_margins) != N_FEATURES:
        return prior.cold_margin
    cold = _cold_margins(prior.feature_margins, prior.cold_margin)
    seen = [(e, s / c) for e, s, c in zip(evidence[:N_UNITS], starts, cold, strict=False) if e > 0 and c > 0]
    if not seen:
        return prior.cold_margin
    return prior.cold_margin * sum(e * r for e, r in seen) / sum(e for e, _ in seen)


_BOUNDS = tuple(_CLASS_BOUNDS if j < N_UNITS else _OVERHEAD_BOUNDS for j in range(N_FEATURES))


def _used_columns(rows: Sequence[tuple[float, ...]]) -> list[int]:
    """The features some row is non-zero in; every feature when none is (the kernels then keep
    their float sums, never an empty one)."""
    used = [j for j, column in enumerate(zip(*rows, strict=True)) if any(column)]
    return used or list(range(N_FEATURES))


def _robust(
    rows: Sequence[tuple[float, ...]],
    left: Sequence[float],
    gram: tuple[list[tuple[float, ...]], list[list[float]]],
    bounds: Sequence[tuple[float, float]],
) -> tuple[list[float], list[int], list[float], list[float]]:
    """The robust MAP deltas (``solver.robust``: Huber reweighting, then a second round without
    the observations still past ``_TRIM``) of ``rows`` whose features are held in ``bounds``: the
    deltas, the kept observations, their weights and residuals."""
    return solver.robust(
        rows,
        left,
        *gram,
        bounds=bounds,
        obs_var=_OBS_SIGMA**2,
        huber=_HUBER,
        trim=_TRIM,
        passes=_IRLS_PASSES,
    )


def _quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank, so it is one of them)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _margin_of(q: float, n: int, cold: float, settings: TokenSettings) -> float:
    """Relative margin from ``n`` out-of-sample residuals whose ``margin_quantile`` of the
    underestimates (an estimate that was high never let a view overflow) is ``q``: blended with
    the cold margin as if it were ``margin_prior_weight`` residuals, never below ``margin_floor``."""
    w = settings.margin_prior_weight
    return max(settings.margin_floor, (w * cold + n * q) / (w + n))


def _in_sample_margin(residuals: Sequence[float], cold: float, settings: TokenSettings) -> float:
    """The fallback for observations without recorded residuals: p90 |in-sample residual| plus a
    share of the cold margin that fades as baselines accumulate."""
    p90 = _quantile([abs(r) for r in residuals], 0.9) if residuals else cold
    fading = cold * settings.margin_prior_weight / (settings.margin_prior_weight + len(residuals))
    return max(settings.margin_floor, p90 + fading)


class CalibrationRegistry:
    """Observations per model, in memory; the engine fills it from the store and persists.

    One model's observations never price another (keyed by model). The registry keeps only the
    newest ``calibration_window`` usable observations per model — all the fit ever reads — and
    caches each model's fit until its observations change.
    """

    __slots__ = ("_families", "_fits", "_observations", "_settings")

    def __init__(self, settings: TokenSettings, families: Mapping[str, str] | None = None) -> None:
        self._settings = settings
        self._families = dict(families) if families is not None else dict(settings.model_families)
        self._observations: dict[str, deque[Observation]] = {}
        self._fits: dict[str, Calibration] = {}

    def family(self, model: str) -> str:
        return family_for(model, self._families)

    def load(self, model: str, observations: Iterable[Observation]) -> Calibration:
        """Replace ``model``'s observations (oldest first), e.g. with the store's; returns its calibration.

        The same observations as held (a periodic re-read that found nothing new) keep the fit."""
        loaded = deque((o for o in observations if o.usable), maxlen=self._settings.calibration_window)
        if self._observations.get(model) != loaded:
            self._observations[model] = loaded
            self._fits.pop(model, None)
        return self.calibration(model)

    def observe(self, model: str, observation: Observation) -> Calibration:
        """Add one baseline; an image-carrying (or empty) one changes nothing. Returns the calibration."""
        if observation.usable:
            bucket = self._observations.get(model)
            if bucket is None:
                bucket = self._observations[model] = deque(maxlen=self._settings.calibration_window)
            bucket.append(observation)
            self._fits.pop(model, None)
        return self.calibration(model)

    def calibration(self, model: str) -> Calibration:
        """The model's current calibration (its family's prior for a model never observed)."""
        cached = self._fits.get(model)
        if cached is None:
            cached = self._fits[model] = fit(
                self._observations.get(model, ()), self._settings, family=self.family(model)
            )
        return cached

    def observations(self, model: str) -> Sequence[Observation]:
        """The model's retained observations, oldest first."""
        return tuple(self._observations.get(model, ()))

    def is_loaded(self, model: str) -> bool:
        """Whether ``model`` has been loaded or observed since this registry was made."""
        return model in self._observations

    def forget(self, model: str) -> None:
        """Drop ``model`` (e.g. to reload it from the store after another replica wrote)."""
        self._observations.pop(model, None)
        self._fits.pop(model, None)
