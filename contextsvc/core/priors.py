"""Cold-start priors of the calibration: tokens per size unit of each content class, per vocabulary.

A calibration without baselines still has to price text. One ratio for every kind of text was
measured worse than ``chars / 4`` on English and 29-35% off on Cyrillic/CJK, because vocabularies
disagree most where a single ratio cannot see: o200k spends about half the tokens cl100k spends
on a Cyrillic word. So the prior is a ratio per content class (``sizing.CLASSES``) and per
vocabulary *family*, plus the framing each chat template adds per message, per tool call and
per view (the reply primer). A model name maps to a family through ``settings.tokens.model_families``
(globs); an unknown model gets the ``default`` family, the middle of the others, with wider
uncertainty so its own baselines move it further.

The numbers come from ``bench/fidelity/fit_prior.py`` (non-negative least squares on the *fit*
split of the bench corpus only; bench/RESULTS.md lists the sources of each split). Regenerate
them with that script; never edit them by hand.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from contextsvc.core.sizing import CJK_CLASSES, CLASSES, LEGACY_CLASSES

#: Feature order of a calibration: the content classes, then per-message, per-tool-call and
#: per-view overheads (counts, priced in tokens each).
FEATURES: tuple[str, ...] = (*CLASSES, "message", "tool_call", "view")
N_CLASSES = len(CLASSES)
MESSAGE, TOOL_CALL, VIEW = N_CLASSES, N_CLASSES + 1, N_CLASSES + 2
N_FEATURES = len(FEATURES)
#: The first feature set (one ``cjk`` class): what observations and views stored before the split
#: carry. ``current_features`` maps them.
LEGACY_FEATURES: tuple[str, ...] = (*LEGACY_CLASSES, "message", "tool_call", "view")
_LEGACY_CJK = LEGACY_CLASSES.index("cjk")


def current_features(stored: Sequence[float]) -> tuple[float, ...]:
    """Stored features in the current ``FEATURES`` order, or ``()`` when they cannot be.

    The feature set is known by its length. Current features are returned as they are. Features
    of the first set (``LEGACY_FEATURES``, one ``cjk`` class) map exactly when they hold no CJK
    units (the new Han, kana and hangul classes are then 0 too); with CJK units they cannot be
    split after the fact and are dropped (``()``: the observation is not fitted and the view is
    held against nothing but its estimate, as one written before features existed). The fit reads
    the newest ``calibration_window`` observations, so new baselines replace dropped ones.
    """
    if len(stored) == N_FEATURES:
        return tuple(float(x) for x in stored)
    if len(stored) == len(LEGACY_FEATURES) and not stored[_LEGACY_CJK]:
        values = [float(x) for x in stored]
        head, tail = values[:_LEGACY_CJK], values[_LEGACY_CJK + 1 :]
        return (*head, *([0.0] * len(CJK_CLASSES)), *tail)
    return ()


@dataclass(slots=True, frozen=True)
class Prior:
    """Tokens per unit of each feature (``FEATURES`` order), the relative uncertainty of each
    (the spread a fit may move it by), and the cold estimate's relative margin: overall
    (``cold_margin``, what ``Calibration.margin`` reports) and per feature (``feature_margins``:
    the share of a feature's price a new step may run over; Cyrillic text varies far more around
    its price than code does, so one number for both was too wide for one and too narrow for the
    other). Empty ``feature_margins`` means ``cold_margin`` for every feature."""

    weights: tuple[float, ...]
    sigma: tuple[float, ...]
    cold_margin: float
    feature_margins: tuple[float, ...] = ()


# --- measured by bench/fidelity/fit_prior.py (fit split only) -- BEGIN GENERATED ------------
PRIORS: dict[str, Prior] = {
    "o200k": Prior(
        weights=(
            0.5078,
            0.6038,
            0.5581,
            0.3519,
            0.6758,
            0.3788,
            0.3913,
            0.3303,
            0.3717,
            1.0437,
            4.8940,
            22.1273,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.212,
        feature_margins=(0.143, 0.163, 0.146, 0.163, 0.217, 0.217, 0.202, 0.158, 0.089, 0.212, 0.216, 0.203, 0.212),
    ),
    "cl100k": Prior(
        weights=(
            0.5009,
            0.5965,
            0.5661,
            0.3531,
            0.6753,
            0.6219,
            0.5325,
            0.4883,
            0.5802,
            0.8068,
            5.1060,
            21.9290,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.177,
        feature_margins=(0.145, 0.161, 0.145, 0.166, 0.219, 0.219, 0.413, 0.108, 0.115, 0.177, 0.175, 0.175, 0.177),
    ),
    "llama3": Prior(
        weights=(
            0.5024,
            0.5882,
            0.5663,
            0.3587,
            0.6730,
            0.4162,
            0.4038,
            0.3100,
            0.3951,
            0.7676,
            5.0570,
            21.9013,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.191,
        feature_margins=(0.146, 0.166, 0.146, 0.166, 0.209, 0.211, 0.186, 0.175, 0.080, 0.191, 0.192, 0.192, 0.191),
    ),
    "claude": Prior(
        weights=(
            0.5579,
            0.8309,
            0.4688,
            0.3991,
            0.3584,
            0.7379,
            0.4917,
            0.5071,
            0.6948,
            1.1607,
            4.0547,
            27.4922,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.256,
        feature_margins=(0.213, 0.217, 0.218, 0.217, 0.268, 0.221, 0.572, 0.268, 0.104, 0.256, 0.218, 0.218, 0.256),
    ),
    "default": Prior(
        weights=(
            0.5167,
            0.6477,
            0.5382,
            0.3652,
            0.5760,
            0.5186,
            0.4510,
            0.3990,
            0.4933,
            0.9307,
            4.7577,
            23.2491,
            3.0000,
        ),
        sigma=(0.12, 0.2, 0.2, 0.2, 0.25, 0.4, 0.4, 0.4, 0.4, 0.4, 0.12, 0.12, 0.12),
        cold_margin=0.428,
        feature_margins=(0.271, 0.272, 0.275, 0.321, 0.450, 0.527, 0.679, 0.427, 0.448, 0.428, 0.374, 0.363, 0.428),
    ),
}
#: The smallest plausible tokens per unit of each feature over every vocabulary measured, with
#: room below: a count under this is below what any tokenizer could have produced.
LOWER_BOUND: tuple[float, ...] = (
    0.3757,
    0.4411,
    0.3516,
    0.2639,
    0.2688,
    0.2841,
    0.2935,
    0.2325,
    0.2788,
    0.5757,
    1.0000,
    2.0000,
    0.0000,
)
# --- END GENERATED ---------------------------------------------------------------------------

#: Model name globs -> family (checked in order; the first match wins; lower-cased names).
DEFAULT_MODEL_FAMILIES: dict[str, str] = {
    "gpt-4o*": "o200k",
    "chatgpt-4o*": "o200k",
    "gpt-4.1*": "o200k",
    "gpt-4.5*": "o200k",
    "gpt-5*": "o200k",
    "o1*": "o200k",
    "o3*": "o200k",
    "o4*": "o200k",
    "gpt-oss*": "o200k",
    "gpt-4*": "cl100k",
    "gpt-3.5*": "cl100k",
    "text-embedding-3*": "cl100k",
    "claude*": "claude",
    "*llama-3*": "llama3",
    "*llama3*": "llama3",
}


def family_for(model: str, families: Mapping[str, str]) -> str:
    """The vocabulary family of ``model`` by the first matching glob, else ``default``."""
    name = model.lower()
    for pattern, family in families.items():
        if fnmatch.fnmatchcase(name, pattern.lower()) and family in PRIORS:
            return family
    return "default"


def prior_for(family: str) -> Prior:
    """The prior of ``family`` (the ``default`` one for a family not measured)."""
    return PRIORS.get(family) or PRIORS.get("default") or next(iter(PRIORS.values()))
