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
    other). Empty ``feature_margins`` means ``cold_margin`` for every feature.

    ``fitted_margins`` (per feature; empty: the cold ones) is what the margin starts from once a
    model's baselines have shown a feature (``Calibration.evidence``). For a measured family it is
    empty: its cold margins already are those of its own vocabulary. For ``default`` (a model of
    no known family) the cold margins hold the spread *between* vocabularies (the geometric middle
    against four of them: 0.27-0.67 per feature), which a model's own baselines resolve for the
    features they carried: there the margin starts from how far a new step ran over its price
    after 1-8 baselines of a model of no known family, measured on the fit split."""

    weights: tuple[float, ...]
    sigma: tuple[float, ...]
    cold_margin: float
    feature_margins: tuple[float, ...] = ()
    fitted_margins: tuple[float, ...] = ()


# --- measured by bench/fidelity/fit_prior.py (fit split only) -- BEGIN GENERATED ------------
PRIORS: dict[str, Prior] = {
    "o200k": Prior(
        weights=(
            0.5129,
            0.5949,
            0.5534,
            0.3860,
            0.6144,
            0.3475,
            0.4023,
            0.3520,
            0.3487,
            1.0515,
            4.7506,
            21.6998,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.138,
        feature_margins=(0.139, 0.139, 0.131, 0.139, 0.139, 0.114, 0.090, 0.111, 0.064, 0.138, 0.139, 0.139, 0.138),
    ),
    "cl100k": Prior(
        weights=(
            0.5124,
            0.5766,
            0.5665,
            0.3884,
            0.6003,
            0.5680,
            0.5540,
            0.5176,
            0.5442,
            0.8839,
            4.8604,
            21.5697,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.158,
        feature_margins=(0.158, 0.148, 0.143, 0.158, 0.177, 0.142, 0.203, 0.076, 0.089, 0.158, 0.156, 0.158, 0.158),
    ),
    "llama3": Prior(
        weights=(
            0.5125,
            0.5699,
            0.5666,
            0.3904,
            0.6068,
            0.3810,
            0.4156,
            0.3314,
            0.3712,
            0.8383,
            4.8473,
            21.5708,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.137,
        feature_margins=(0.137, 0.149, 0.129, 0.149, 0.137, 0.109, 0.093, 0.128, 0.054, 0.137, 0.149, 0.149, 0.137),
    ),
    "claude": Prior(
        weights=(
            0.5404,
            0.8463,
            0.4323,
            0.4730,
            0.3214,
            0.6618,
            0.5021,
            0.5353,
            0.6452,
            0.9414,
            4.1979,
            26.2303,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.187,
        feature_margins=(0.170, 0.171, 0.171, 0.170, 0.203, 0.105, 0.313, 0.203, 0.080, 0.187, 0.171, 0.171, 0.187),
    ),
    "default": Prior(
        weights=(
            0.5194,
            0.6378,
            0.5264,
            0.4079,
            0.5179,
            0.4723,
            0.4644,
            0.4240,
            0.4617,
            0.9254,
            4.6558,
            22.6852,
            3.0000,
        ),
        sigma=(0.12, 0.2, 0.2, 0.2, 0.25, 0.4, 0.4, 0.4, 0.4, 0.4, 0.12, 0.12, 0.12),
        cold_margin=0.362,
        feature_margins=(0.266, 0.299, 0.266, 0.318, 0.349, 0.420, 0.426, 0.359, 0.411, 0.362, 0.336, 0.332, 0.362),
        fitted_margins=(0.191, 0.217, 0.217, 0.214, 0.270, 0.293, 0.424, 0.359, 0.409, 0.275, 0.255, 0.255, 0.275),
    ),
}
#: The smallest plausible tokens per unit of each feature over every vocabulary measured, with
#: room below: a count under this is below what any tokenizer could have produced.
LOWER_BOUND: tuple[float, ...] = (
    0.3843,
    0.4274,
    0.3242,
    0.2895,
    0.2410,
    0.2606,
    0.3017,
    0.2485,
    0.2615,
    0.6287,
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
