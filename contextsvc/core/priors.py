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
from collections.abc import Mapping
from dataclasses import dataclass

from contextsvc.core.sizing import CLASSES

#: Feature order of a calibration: the content classes, then per-message, per-tool-call and
#: per-view overheads (counts, priced in tokens each).
FEATURES: tuple[str, ...] = (*CLASSES, "message", "tool_call", "view")
N_CLASSES = len(CLASSES)
MESSAGE, TOOL_CALL, VIEW = N_CLASSES, N_CLASSES + 1, N_CLASSES + 2
N_FEATURES = len(FEATURES)


@dataclass(slots=True, frozen=True)
class Prior:
    """Tokens per unit of each feature (``FEATURES`` order), the relative uncertainty of each
    (the spread a fit may move it by), and the cold estimate's relative margin."""

    weights: tuple[float, ...]
    sigma: tuple[float, ...]
    cold_margin: float


# --- measured by bench/fidelity/fit_prior.py (fit split only) -- BEGIN GENERATED ------------
PRIORS: dict[str, Prior] = {
    "o200k": Prior(
        weights=(0.4969, 0.5878, 0.5878, 0.3556, 0.6794, 0.3992, 0.3580, 1.1577, 5.0761, 21.7788, 3.0000),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.15, 0.3, 0.3, 0.3),
        cold_margin=0.122,
    ),
    "cl100k": Prior(
        weights=(0.4905, 0.5803, 0.5958, 0.3554, 0.6816, 0.6539, 0.5195, 0.9347, 5.2610, 21.6322, 3.0000),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.15, 0.3, 0.3, 0.3),
        cold_margin=0.136,
    ),
    "llama3": Prior(
        weights=(0.4914, 0.5716, 0.5951, 0.3647, 0.6730, 0.4431, 0.3560, 0.8940, 5.2409, 21.5226, 3.0000),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.15, 0.3, 0.3, 0.3),
        cold_margin=0.118,
    ),
    "claude": Prior(
        weights=(0.5488, 0.8099, 0.5130, 0.3994, 0.3574, 0.7836, 0.5311, 1.3292, 4.1455, 27.1928, 3.0000),
        sigma=(0.04, 0.08, 0.08, 0.08, 0.1, 0.1, 0.1, 0.15, 0.3, 0.3, 0.3),
        cold_margin=0.202,
    ),
    "default": Prior(
        weights=(0.5064, 0.6304, 0.5718, 0.3684, 0.5777, 0.5487, 0.4330, 1.0649, 4.9079, 22.9150, 3.0000),
        sigma=(0.12, 0.2, 0.2, 0.2, 0.25, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4),
        cold_margin=0.230,
    ),
}
#: The smallest plausible tokens per unit of each feature over every vocabulary measured, with
#: room below: a count under this is below what any tokenizer could have produced.
LOWER_BOUND: tuple[float, ...] = (
    0.3679,
    0.4287,
    0.3848,
    0.2665,
    0.2681,
    0.2994,
    0.2670,
    0.6705,
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
