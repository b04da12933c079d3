"""Per-model calibration: ``tokens ~ overhead + chars * tokens_per_char`` (DESIGN §5.3).

A fixed chars-per-token ratio was measured ~1.8x off on real prompts, so the service learns a
line per model from the real prompt counts providers report (baselines). The numbers (window,
spread, slope range, fallback ratio) live in ``settings.tokens``.

The unit of ``chars``: size units, not characters. The fit is unit-agnostic; what it is fed is
``contextsvc.core.tokens.messages_size`` of a view (``contextsvc.core.sizing``: pieces of text
priced by class and length, about half a token each, plus the template framing of each
message). Raw characters made one slope wrong for every other kind of content (prose ~0.19
tokens/char, JSON ~0.35); per size unit every kind measured sits near 0.5 tokens. So
``tokens_per_char`` reads "tokens per size unit", the slope range [0.25, 1.0] brackets that with
room on both sides (a slope below it still means a silently truncated prompt), and the fallback
``chars / 1.8`` is ``size / 1.8``. The names stay because observations persist as ``chars``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from contextsvc.config import TokenSettings


@dataclass(slots=True, frozen=True)
class Observation:
    """One baseline: the size of a view that was sent and the prompt tokens the provider counted.

    ``chars`` holds the view's size in size units (see the module docstring), not characters.
    """

    chars: int
    tokens: int
    had_images: bool = False

    @property
    def usable(self) -> bool:
        # Image tokens are not in the size: fed to the fit they would land in the slope and
        # intercept and skew every later text estimate for the model.
        return not self.had_images and self.chars > 0 and self.tokens > 0


@dataclass(slots=True, frozen=True)
class Calibration:
    """A fitted (or fallback) line. ``observations`` counts the usable observations considered."""

    overhead: float
    tokens_per_char: float
    observations: int
    fitted: bool

    def estimate(self, chars: int) -> int:
        """Tokens of a whole prompt of ``chars`` size units (the overhead counted once)."""
        if chars <= 0:
            return 0
        return max(0, round(self.overhead + chars * self.tokens_per_char))

    def estimate_delta(self, chars: int) -> int:
        """Tokens that ``chars`` more size units add to a prompt (no overhead: it is already paid)."""
        return max(0, round(chars * self.tokens_per_char))


def fallback(settings: TokenSettings, observations: int = 0) -> Calibration:
    """The line used without a usable fit: ``size / fallback_chars_per_token``, no overhead."""
    return Calibration(0.0, 1.0 / settings.fallback_chars_per_token, observations, fitted=False)


def fit(observations: Iterable[Observation], settings: TokenSettings) -> Calibration:
    """Least squares over the newest ``calibration_window`` usable observations.

    Fitted only with >= 2 observations whose sizes span ``calibration_min_spread`` and a slope
    inside [``calibration_min_slope``, ``calibration_max_slope``]; otherwise the fallback. An
    implausible slope in practice means a prompt was silently truncated by the provider.
    """
    usable = [o for o in observations if o.usable][-settings.calibration_window :]
    n = len(usable)
    if n < 2:
        return fallback(settings, n)
    xs = [float(o.chars) for o in usable]
    ys = [float(o.tokens) for o in usable]
    if max(xs) < settings.calibration_min_spread * min(xs):
        return fallback(settings, n)
    mean_x = sum(xs) / n
    mean_y = sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx  # sxx > 0: the spread check guarantees two distinct sizes
    if not settings.calibration_min_slope <= slope <= settings.calibration_max_slope:
        return fallback(settings, n)
    return Calibration(mean_y - slope * mean_x, slope, n, fitted=True)


class CalibrationRegistry:
    """Observations per model, in memory; the engine fills it from the store and persists.

    One model's observations never price another (keyed by model). The registry keeps only the
    newest ``calibration_window`` usable observations per model — all the fit ever reads — and
    caches each model's fit until its observations change.
    """

    __slots__ = ("_fits", "_observations", "_settings")

    def __init__(self, settings: TokenSettings) -> None:
        self._settings = settings
        self._observations: dict[str, deque[Observation]] = {}
        self._fits: dict[str, Calibration] = {}

    def load(self, model: str, observations: Iterable[Observation]) -> Calibration:
        """Replace ``model``'s observations (oldest first), e.g. with the store's; returns its calibration."""
        self._observations[model] = deque(
            (o for o in observations if o.usable), maxlen=self._settings.calibration_window
        )
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
        """The model's current line (the fallback for a model never observed)."""
        cached = self._fits.get(model)
        if cached is None:
            cached = self._fits[model] = fit(self._observations.get(model, ()), self._settings)
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
