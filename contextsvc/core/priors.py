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
            0.5123,
            0.6116,
            0.5597,
            0.3697,
            0.6004,
            0.3344,
            0.4057,
            0.3530,
            0.3507,
            0.9909,
            4.7946,
            21.8716,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.123,
        feature_margins=(0.124, 0.124, 0.124, 0.124, 0.119, 0.114, 0.093, 0.117, 0.073, 0.123, 0.124, 0.124, 0.123),
    ),
    "cl100k": Prior(
        weights=(
            0.5061,
            0.6053,
            0.5678,
            0.3736,
            0.5887,
            0.5452,
            0.5568,
            0.5183,
            0.5459,
            0.7462,
            4.9911,
            21.6361,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.152,
        feature_margins=(0.141, 0.147, 0.130, 0.153, 0.158, 0.153, 0.202, 0.077, 0.088, 0.152, 0.147, 0.147, 0.152),
    ),
    "llama3": Prior(
        weights=(
            0.5068,
            0.5960,
            0.5677,
            0.3771,
            0.5965,
            0.3662,
            0.4180,
            0.3320,
            0.3727,
            0.7141,
            4.9610,
            21.6335,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.130,
        feature_margins=(0.123, 0.142, 0.123, 0.142, 0.132, 0.114, 0.084, 0.132, 0.056, 0.130, 0.142, 0.142, 0.130),
    ),
    "claude": Prior(
        weights=(
            0.5638,
            0.8420,
            0.4713,
            0.4197,
            0.2679,
            0.6420,
            0.5157,
            0.5397,
            0.6529,
            1.0826,
            3.9370,
            27.1767,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.199,
        feature_margins=(0.173, 0.175, 0.175, 0.175, 0.217, 0.114, 0.310, 0.217, 0.076, 0.199, 0.199, 0.199, 0.199),
    ),
    "default": Prior(
        weights=(
            0.5217,
            0.6565,
            0.5400,
            0.3845,
            0.4875,
            0.4550,
            0.4698,
            0.4255,
            0.4646,
            0.8695,
            4.6497,
            22.9665,
            3.0000,
        ),
        sigma=(0.12, 0.2, 0.2, 0.2, 0.25, 0.4, 0.4, 0.4, 0.4, 0.4, 0.12, 0.12, 0.12),
        cold_margin=0.368,
        feature_margins=(0.275, 0.290, 0.265, 0.319, 0.360, 0.430, 0.432, 0.374, 0.412, 0.368, 0.345, 0.345, 0.368),
        fitted_margins=(0.191, 0.213, 0.212, 0.206, 0.179, 0.276, 0.212, 0.133, 0.108, 0.213, 0.239, 0.239, 0.213),
    ),
}
#: The smallest plausible tokens per unit of each feature over every vocabulary measured, with
#: room below: a count under this is below what any tokenizer could have produced.
LOWER_BOUND: tuple[float, ...] = (
    0.3796,
    0.4470,
    0.3534,
    0.2772,
    0.2009,
    0.2508,
    0.3043,
    0.2490,
    0.2631,
    0.5356,
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
