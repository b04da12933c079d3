"""Cold-start priors of the calibration: tokens per size unit of each content class, per vocabulary.

A calibration without baselines still has to price text. One ratio for every kind of text was
measured worse than ``chars / 4`` on English and 29-35% off on Cyrillic/CJK, because vocabularies
disagree most where a single ratio cannot see: o200k spends about half the tokens cl100k spends
on a Cyrillic word. So the prior is a ratio per content class (``sizing.CLASSES``) and per
vocabulary *family*, plus the framing each chat template adds per message, per tool call and
per view (the reply primer). A model name maps to a family through ``settings.tokens.model_families``
(globs); an unknown model gets the ``default`` family, the middle of the others, with wider
uncertainty so its own baselines move it further.

The numbers come from ``python bench/fidelity/run.py --fit-prior`` (non-negative least squares on
the *fit* split of the bench corpus only; bench/RESULTS.md lists the sources of each split).
Regenerate them with that command; never edit them by hand. The corpus reads the installed Python
packages, so a refit on a machine with other packages moves the weights and margins: refit only
when the size units change, and compare ``bench/tokens`` and ``bench/fidelity`` before and after.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from contextsvc.core.sizing import (
    CJK_CLASSES,
    CLASSES,
    CYRILLIC,
    CYRILLIC_FAMILIES,
    IDENT_PREFIXED,
    LEGACY_CLASSES,
    N_UNIT_COLUMNS,
)

#: Feature order of a calibration: the content classes, each family's own count of the Cyrillic
#: pieces (``sizing.CYRILLIC_FAMILIES``), the prefixed identifiers counted again
#: (``sizing.IDENT_PREFIXED``: only Claude's prior weights it; all of these in size units:
#: ``sizing.feature_units``), then per-message, per-tool-call and per-view overheads (counts,
#: priced in tokens each).
FEATURES: tuple[str, ...] = (
    *CLASSES,
    *(f"cyrillic_{family}" for family in CYRILLIC_FAMILIES),
    "ident_prefixed",
    "message",
    "tool_call",
    "view",
)
N_CLASSES = len(CLASSES)
#: Features measured in size units (the classes, the families' Cyrillic columns, the prefixed
#: identifiers' column).
N_UNITS = N_UNIT_COLUMNS
MESSAGE, TOOL_CALL, VIEW = N_UNITS, N_UNITS + 1, N_UNITS + 2
N_FEATURES = len(FEATURES)
#: The column of each family's own Cyrillic count (``FEATURES`` index by family name).
CYRILLIC_COLUMNS: dict[str, int] = {family: N_CLASSES + k for k, family in enumerate(CYRILLIC_FAMILIES)}
#: The prefixed identifiers' column (``sizing.IDENT_PREFIXED``): an extra price on top of ``ident``.
IDENT_PREFIXED_COLUMN = IDENT_PREFIXED
assert FEATURES[IDENT_PREFIXED_COLUMN] == "ident_prefixed"
#: The first feature set (one ``cjk`` class): what observations and views stored before the split
#: carry. ``current_features`` maps them.
LEGACY_FEATURES: tuple[str, ...] = (*LEGACY_CLASSES, "message", "tool_call", "view")
_LEGACY_CJK = LEGACY_CLASSES.index("cjk")
#: The second feature set (Han, kana, hangul; no per-family Cyrillic columns): what observations
#: and views stored before those columns carry.
PREVIOUS_FEATURES: tuple[str, ...] = (*CLASSES, "message", "tool_call", "view")
#: The third feature set (the families' Cyrillic columns; no prefixed identifiers' column).
CYRILLIC_FEATURES: tuple[str, ...] = (
    *CLASSES,
    *(f"cyrillic_{family}" for family in CYRILLIC_FAMILIES),
    "message",
    "tool_call",
    "view",
)


def current_cuts(stored: Any) -> tuple[tuple[int, tuple[int, ...]], ...] | None:
    """A view's stored cuts (``ports.ViewRecord.cuts``: pairs of a sequence number and features)
    as that field holds them, or None (not known) when none were stored (``None``: written before
    cuts were kept), when they are not of the current ``FEATURES``, or not pairs at all: an anchor
    whose cuts are not known prices every row as its baseline counted it."""
    if stored is None:
        return None
    try:
        cuts = tuple((int(seq), tuple(int(x) for x in features)) for seq, features in stored)
    except (TypeError, ValueError):
        return None
    return cuts if all(len(features) == N_FEATURES for _, features in cuts) else None


def current_features(stored: Sequence[float]) -> tuple[float, ...]:
    """Stored features in the current ``FEATURES`` order, or ``()`` when they cannot be.

    The feature set is known by its length. Current features are returned as they are. Features
    of an older set map when they hold nothing the newer sets split further, and are dropped
    otherwise (``()``: the observation is not fitted and the view is held against nothing but its
    estimate, as one written before features existed); the fit reads the newest
    ``calibration_window`` observations, so new baselines replace dropped ones:

    - the third set (``CYRILLIC_FEATURES``) always, with 0 in the prefixed identifiers' column.
      Exact for every family whose prior gives that column no weight (all but Claude's); for a
      Claude model such an observation lacks the extra price of its ``_name``/``.attr`` pieces,
      so the fit reads it as a little cheaper than it was until new baselines replace it;
    - the second set (``PREVIOUS_FEATURES``) when it holds no Cyrillic units: the families'
      Cyrillic columns are then 0 too (with Cyrillic units, each family's own count of them is
      not known after the fact), and the prefixed column 0 as for the third set;
    - the first set (``LEGACY_FEATURES``, one ``cjk`` class) when it holds neither CJK nor
      Cyrillic units (the Han, kana and hangul classes and the Cyrillic columns are then 0).
    """
    if len(stored) == N_FEATURES:
        return tuple(float(x) for x in stored)
    values = [float(x) for x in stored]
    if len(values) == len(LEGACY_FEATURES):
        if values[_LEGACY_CJK]:
            return ()
        values = [*values[:_LEGACY_CJK], *([0.0] * len(CJK_CLASSES)), *values[_LEGACY_CJK + 1 :]]
    if len(values) == len(PREVIOUS_FEATURES):
        if values[CYRILLIC]:
            return ()
        values = [*values[:N_CLASSES], *([0.0] * len(CYRILLIC_FAMILIES)), *values[N_CLASSES:]]
    if len(values) == len(CYRILLIC_FEATURES):
        return (*values[:IDENT_PREFIXED_COLUMN], 0.0, *values[IDENT_PREFIXED_COLUMN:])
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


# --- measured by bench/fidelity/run.py --fit-prior (fit split only) -- BEGIN GENERATED ------------
PRIORS: dict[str, Prior] = {
    "o200k": Prior(
        weights=(
            0.5153,
            0.5941,
            0.5549,
            0.3916,
            0.5907,
            0.0000,
            0.4039,
            0.3537,
            0.3502,
            1.0542,
            0.4978,
            0.0000,
            0.0000,
            0.0000,
            0.0000,
            4.7173,
            21.6250,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.1, 0.1, 0.1, 0.1, 0.08, 0.09, 0.09, 0.09),
        cold_margin=0.134,
        feature_margins=(
            0.136,
            0.135,
            0.128,
            0.136,
            0.136,
            0.134,
            0.088,
            0.107,
            0.062,
            0.134,
            0.062,
            0.134,
            0.134,
            0.134,
            0.134,
            0.135,
            0.135,
            0.134,
        ),
    ),
    "cl100k": Prior(
        weights=(
            0.5134,
            0.5731,
            0.5675,
            0.3903,
            0.5953,
            0.0000,
            0.5543,
            0.5180,
            0.5445,
            0.9048,
            0.0000,
            0.4974,
            0.0000,
            0.0000,
            0.0000,
            4.8641,
            21.5372,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.1, 0.1, 0.1, 0.1, 0.08, 0.09, 0.09, 0.09),
        cold_margin=0.151,
        feature_margins=(
            0.151,
            0.147,
            0.136,
            0.151,
            0.170,
            0.151,
            0.202,
            0.076,
            0.089,
            0.151,
            0.151,
            0.045,
            0.151,
            0.151,
            0.151,
            0.150,
            0.151,
            0.151,
        ),
    ),
    "llama3": Prior(
        weights=(
            0.5167,
            0.5680,
            0.5695,
            0.3944,
            0.5818,
            0.0000,
            0.4178,
            0.3332,
            0.3730,
            0.8516,
            0.0000,
            0.0000,
            0.4981,
            0.0000,
            0.0000,
            4.7400,
            21.5825,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.1, 0.1, 0.1, 0.1, 0.08, 0.09, 0.09, 0.09),
        cold_margin=0.143,
        feature_margins=(
            0.143,
            0.148,
            0.129,
            0.148,
            0.143,
            0.143,
            0.064,
            0.123,
            0.050,
            0.143,
            0.143,
            0.143,
            0.050,
            0.143,
            0.143,
            0.148,
            0.148,
            0.143,
        ),
    ),
    "claude": Prior(
        weights=(
            0.5324,
            0.7396,
            0.4777,
            0.4651,
            0.3260,
            0.0000,
            0.5057,
            0.5350,
            0.6455,
            0.5839,
            0.0000,
            0.0000,
            0.0000,
            0.5167,
            0.3580,
            4.3429,
            25.1904,
            3.0000,
        ),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.1, 0.1, 0.15, 0.1, 0.1, 0.1, 0.1, 0.08, 0.09, 0.09, 0.09),
        cold_margin=0.192,
        feature_margins=(
            0.154,
            0.154,
            0.155,
            0.155,
            0.213,
            0.192,
            0.315,
            0.213,
            0.083,
            0.192,
            0.192,
            0.192,
            0.192,
            0.056,
            0.154,
            0.155,
            0.155,
            0.192,
        ),
    ),
    "default": Prior(
        weights=(
            0.5195,
            0.6377,
            0.5265,
            0.4079,
            0.5176,
            0.4723,
            0.4644,
            0.4240,
            0.4618,
            0.9258,
            0.0000,
            0.0000,
            0.0000,
            0.0000,
            0.0000,
            4.6548,
            22.6849,
            3.0000,
        ),
        sigma=(0.12, 0.2, 0.2, 0.2, 0.25, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4, 0.2, 0.12, 0.12, 0.12),
        cold_margin=0.362,
        feature_margins=(
            0.266,
            0.299,
            0.266,
            0.318,
            0.349,
            0.420,
            0.426,
            0.359,
            0.411,
            0.362,
            0.362,
            0.362,
            0.362,
            0.362,
            0.362,
            0.336,
            0.332,
            0.362,
        ),
        fitted_margins=(
            0.191,
            0.217,
            0.217,
            0.215,
            0.269,
            0.293,
            0.422,
            0.359,
            0.406,
            0.271,
            0.271,
            0.271,
            0.271,
            0.271,
            0.271,
            0.256,
            0.256,
            0.271,
        ),
    ),
}
#: The smallest plausible tokens per unit of each feature over every vocabulary measured, with
#: room below: a count under this is below what any tokenizer could have produced.
LOWER_BOUND: tuple[float, ...] = (
    0.3844,
    0.4274,
    0.3242,
    0.2896,
    0.2408,
    0.2607,
    0.3017,
    0.2485,
    0.2616,
    0.6290,
    0.0000,
    0.0000,
    0.0000,
    0.0000,
    0.0000,
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
