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
            0.4987,
            0.5905,
            0.5888,
            0.3514,
            0.6793,
            0.3996,
            0.3912,
            0.3302,
            0.3716,
            1.1400,
            5.0207,
            21.8828,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.221,
        feature_margins=(0.162, 0.167, 0.165, 0.167, 0.277, 0.378, 0.207, 0.163, 0.091, 0.221, 0.225, 0.225, 0.221),
    ),
    "cl100k": Prior(
        weights=(
            0.4915,
            0.5832,
            0.5961,
            0.3522,
            0.6819,
            0.6542,
            0.5323,
            0.4879,
            0.5800,
            0.9128,
            5.2391,
            21.6910,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.256,
        feature_margins=(0.164, 0.170, 0.166, 0.170, 0.322, 0.322, 0.418, 0.111, 0.117, 0.256, 0.211, 0.211, 0.256),
    ),
    "llama3": Prior(
        weights=(
            0.4939,
            0.5764,
            0.5965,
            0.3580,
            0.6727,
            0.4438,
            0.4041,
            0.3102,
            0.3954,
            0.8622,
            5.1635,
            21.6772,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.179,
        feature_margins=(0.153, 0.162, 0.162, 0.170, 0.239, 0.339, 0.178, 0.179, 0.081, 0.179, 0.170, 0.170, 0.179),
    ),
    "claude": Prior(
        weights=(
            0.5490,
            0.8134,
            0.5121,
            0.3997,
            0.3534,
            0.7838,
            0.4923,
            0.5076,
            0.6954,
            1.2957,
            4.1647,
            27.1586,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.275,
        feature_margins=(0.233, 0.238, 0.241, 0.238, 0.276, 0.290, 0.583, 0.276, 0.105, 0.275, 0.241, 0.241, 0.275),
    ),
    "default": Prior(
        weights=(
            0.5077,
            0.6339,
            0.5722,
            0.3648,
            0.5761,
            0.5492,
            0.4511,
            0.3991,
            0.4934,
            1.0384,
            4.8768,
            22.9918,
            3.0000,
        ),
        sigma=(0.12, 0.2, 0.2, 0.2, 0.25, 0.4, 0.4, 0.4, 0.4, 0.4, 0.12, 0.12, 0.12),
        cold_margin=0.466,
        feature_margins=(0.280, 0.293, 0.293, 0.357, 0.469, 0.603, 0.690, 0.437, 0.451, 0.466, 0.435, 0.435, 0.466),
    ),
}
#: The smallest plausible tokens per unit of each feature over every vocabulary measured, with
#: room below: a count under this is below what any tokenizer could have produced.
LOWER_BOUND: tuple[float, ...] = (
    0.3686,
    0.4323,
    0.3841,
    0.2635,
    0.2651,
    0.2997,
    0.2934,
    0.2326,
    0.2787,
    0.6466,
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
