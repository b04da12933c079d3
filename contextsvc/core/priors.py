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
            0.5117,
            0.6102,
            0.5592,
            0.3636,
            0.6220,
            0.3333,
            0.3947,
            0.3340,
            0.3754,
            0.9984,
            4.8068,
            21.9708,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.145,
        feature_margins=(0.128, 0.132, 0.132, 0.132, 0.153, 0.115, 0.195, 0.149, 0.080, 0.145, 0.149, 0.149, 0.145),
    ),
    "cl100k": Prior(
        weights=(
            0.5051,
            0.6036,
            0.5671,
            0.3671,
            0.6136,
            0.5438,
            0.5361,
            0.4927,
            0.5845,
            0.7548,
            5.0170,
            21.7326,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.155,
        feature_margins=(0.142, 0.154, 0.130, 0.155, 0.159, 0.155, 0.406, 0.100, 0.108, 0.155, 0.154, 0.154, 0.155),
    ),
    "llama3": Prior(
        weights=(
            0.5062,
            0.5946,
            0.5672,
            0.3708,
            0.6185,
            0.3651,
            0.4073,
            0.3138,
            0.3989,
            0.7214,
            4.9731,
            21.7360,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.153,
        feature_margins=(0.130, 0.146, 0.130, 0.146, 0.165, 0.116, 0.168, 0.165, 0.072, 0.153, 0.156, 0.156, 0.153),
    ),
    "claude": Prior(
        weights=(
            0.5623,
            0.8397,
            0.4701,
            0.4134,
            0.2944,
            0.6405,
            0.4955,
            0.5114,
            0.6992,
            1.0951,
            3.9717,
            27.2704,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.09, 0.09, 0.09),
        cold_margin=0.245,
        feature_margins=(0.188, 0.191, 0.191, 0.191, 0.258, 0.115, 0.562, 0.258, 0.097, 0.245, 0.205, 0.205, 0.245),
    ),
    "default": Prior(
        weights=(
            0.5208,
            0.6549,
            0.5393,
            0.3782,
            0.5135,
            0.4537,
            0.4546,
            0.4031,
            0.4974,
            0.8784,
            4.6717,
            23.0652,
            3.0000,
        ),
        sigma=(0.12, 0.2, 0.2, 0.2, 0.25, 0.4, 0.4, 0.4, 0.4, 0.4, 0.12, 0.12, 0.12),
        cold_margin=0.380,
        feature_margins=(0.281, 0.293, 0.269, 0.321, 0.392, 0.433, 0.669, 0.416, 0.437, 0.380, 0.347, 0.347, 0.380),
        fitted_margins=(0.201, 0.216, 0.219, 0.216, 0.300, 0.303, 0.668, 0.417, 0.436, 0.285, 0.262, 0.262, 0.285),
    ),
}
#: The smallest plausible tokens per unit of each feature over every vocabulary measured, with
#: room below: a count under this is below what any tokenizer could have produced.
LOWER_BOUND: tuple[float, ...] = (
    0.3788,
    0.4459,
    0.3526,
    0.2727,
    0.2208,
    0.2500,
    0.2960,
    0.2353,
    0.2815,
    0.5410,
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
