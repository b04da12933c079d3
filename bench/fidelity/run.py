"""Fidelity bench: the calibration's estimates against four real tokenizers, on held-out text.

    python bench/fidelity/run.py --fit-prior   # measure the cold prior on the FIT split, write core/priors.py
    python bench/fidelity/run.py --tune-fit    # FIT split, leave one category out: the fit's spread rule
    python bench/fidelity/run.py --tune-margin # FIT split: views over estimate + margin by margin_prior_weight
    python bench/fidelity/run.py               # score on the SCORE split, print the tables
    python bench/fidelity/run.py --fit         # the same tables on the FIT split (for choosing rules)
    python bench/fidelity/run.py --diagnose-cjk # FIT split: where the Cyrillic/CJK error comes from
    python bench/fidelity/run.py --diagnose-cyrillic # FIT split: why Cyrillic views miss (units vs vocabularies)
    python bench/fidelity/run.py --diagnose-json # FIT split: the tail of JSON views, identifiers by shape
    python bench/fidelity/run.py --split-half --sessions 30 # FIT split: feature variants, prior fitted on half
    python bench/fidelity/run.py --record      # and write them into bench/RESULTS.md (## Fidelity)

Reuses bench/tokens (its npm tokenizers, its ChatML-like rendering and frame counts). A "model"
is a tokenizer with a model name that maps to its family (gpt-4o -> o200k, gpt-4 -> cl100k,
llama-3 -> llama3, claude-2 -> claude). True tokens of a view: each message rendered and counted
plus 3 frame tokens, plus 3 for the reply primer; of a standalone list: the same without the 3.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import platform
import random
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "bench" / "tokens"))
sys.path.insert(0, str(ROOT))

from fidelity_corpus import CATEGORIES, Session, sessions  # noqa: E402
from run import FRAME_PER_MESSAGE, FRAME_PER_PROMPT, count_real, ensure_node_deps, render  # noqa: E402

from contextsvc.config import TokenSettings  # noqa: E402
from contextsvc.core.calibration import Calibration, Observation, fit, lower_bound, margin_base  # noqa: E402
from contextsvc.core.messages import Message, Role  # noqa: E402
from contextsvc.core.priors import (  # noqa: E402
    CYRILLIC_COLUMNS,
    FEATURES,
    IDENT_PREFIXED_COLUMN,
    N_CLASSES,
    N_FEATURES,
    N_UNITS,
    VIEW,
)
from contextsvc.core.tokens import message_features, message_parts  # noqa: E402

MODELS = {"o200k": "gpt-4o", "cl100k": "gpt-4", "llama3": "llama-3-8b", "claude": "claude-2"}
TOKENIZERS = tuple(MODELS)
SETTINGS = TokenSettings()
PRIORS_FILE = ROOT / "contextsvc" / "core" / "priors.py"


@dataclass
class Counted:
    """A session with real counts per message (render + frame) per tokenizer."""

    session: Session
    messages: list[Message]  # system row first, then every step's messages, numbered
    ends: list[int]  # index one past the last message of each step (a view = messages[:end])
    real: dict[str, list[int]]  # tokenizer -> tokens of each message (frame included)


def count_sessions(all_sessions: dict[str, list[Session]]) -> dict[str, list[Counted]]:
    texts: list[str] = []
    index: dict[str, int] = {}
    prepared: dict[str, list[tuple[Session, list[Message], list[int]]]] = {}
    for cat, ss in all_sessions.items():
        for s in ss:
            msgs = [Message(role=Role.SYSTEM, content=s.system)]
            ends = []
            for step in s.steps:
                for m in step:
                    msgs.append(replace(m, sequence_number=len(msgs)))
                ends.append(len(msgs))
            for m in msgs:
                r = render(m)
                if r not in index:
                    index[r] = len(texts)
                    texts.append(r)
            prepared.setdefault(cat, []).append((s, msgs, ends))
    counts = count_real(texts)
    out: dict[str, list[Counted]] = {}
    for cat, items in prepared.items():
        for s, msgs, ends in items:
            real = {t: [counts[t][index[render(m)]] + FRAME_PER_MESSAGE for m in msgs] for t in TOKENIZERS}
            out.setdefault(cat, []).append(Counted(s, msgs, ends, real))
    return out


def features_of(msgs: Sequence[Message], *, view: bool) -> np.ndarray:
    x = np.zeros(N_FEATURES)
    for m in msgs:
        x += np.array(message_features(m), dtype=float)
    x[VIEW] = 1.0 if view else 0.0
    return x


# --- the prior (fit split only) -------------------------------------------------------------


#: The shared Cyrillic class (what the ``default`` family prices Cyrillic text by).
CYR = FEATURES.index("cyrillic")


#: Families whose prior prices the prefixed identifiers' column (``sizing.IDENT_PREFIXED``) on top
#: of ``ident``: the old Claude vocabulary spends ~0.97 tokens per unit on ``_name``/``.attr``
#: pieces against ~0.5 in the others (round 9); every other prior gives the column weight 0.
PREFIXED_FAMILIES: tuple[str, ...] = ("claude",)


def columns(family: str, prefixed: Sequence[str] = PREFIXED_FAMILIES) -> list[int]:
    """Features a family's prior is fitted on (the per-view overhead is fixed, not fitted): a
    measured family prices Cyrillic by its own column (``sizing.CYRILLIC_FAMILIES``), never by the
    shared class or another family's column; ``default`` (any other name) by the shared class.
    The prefixed identifiers' column only for the families in ``prefixed``."""
    skip = {VIEW, *CYRILLIC_COLUMNS.values()}
    own = CYRILLIC_COLUMNS.get(family)
    if own is not None:
        skip = (skip - {own}) | {CYR}
    if family not in prefixed:
        skip.add(IDENT_PREFIXED_COLUMN)
    return [j for j in range(N_FEATURES) if j not in skip]


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares by active-set elimination (small problems)."""
    active = list(range(a.shape[1]))
    w = np.zeros(a.shape[1])
    for _ in range(a.shape[1]):
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (sol >= 0).all():
            w[:] = 0
            w[active] = sol
            return w
        active.pop(int(np.argmin(sol)))
    return w


def fit_prior(counted: dict[str, list[Counted]]) -> str:
    rows, ys = [], {t: [] for t in TOKENIZERS}
    for items in counted.values():
        for c in items:
            for i, m in enumerate(c.messages):
                rows.append(np.array(message_features(m), dtype=float))
                for t in TOKENIZERS:
                    ys[t].append(c.real[t][i])
    a = np.array(rows)
    used = [j for j in range(N_FEATURES) if a[:, j].any()]
    weights: dict[str, np.ndarray] = {}
    # Each tokenizer twice: by the shared classes (what the default family is the middle of, and
    # the lower bound the smallest of) and by its own Cyrillic column (its own prior).
    shared: dict[str, np.ndarray] = {}
    for t in TOKENIZERS:
        y = np.array(ys[t], dtype=float)
        # Relative errors matter: weight each message by 1/tokens (rows scaled by 1/sqrt(y)).
        s = 1 / np.sqrt(np.maximum(y, 1))
        for fam, out in ((t, weights), ("default", shared)):
            cols = [j for j in columns(fam) if j in used]
            w = np.zeros(N_FEATURES)
            w[cols] = nnls(a[:, cols] * s[:, None], y * s)
            w[VIEW] = FRAME_PER_PROMPT
            for j in range(N_CLASSES):  # a class absent from the fit split keeps the median ratio
                if j in columns(fam) and (j not in used or w[j] == 0):
                    w[j] = float(np.median([w[k] for k in range(N_CLASSES) if w[k] > 0]))
            out[t] = w
    weights["default"] = np.exp(np.mean([np.log(np.maximum(shared[t], 1e-3)) for t in TOKENIZERS], axis=0))
    weights["default"][VIEW] = FRAME_PER_PROMPT
    weights["default"][list(CYRILLIC_COLUMNS.values())] = 0.0
    weights["default"][IDENT_PREFIXED_COLUMN] = 0.0
    # How far a fit may move each weight (the fit narrows it 5x unless its baselines clearly ask
    # for more: core/calibration.py, chosen by leave-one-category-out runs on the FIT split).
    known_sigma = tuple(KNOWN_SIGMA[f] for f in FEATURES)
    default_sigma = tuple(DEFAULT_SIGMA[f] for f in FEATURES)
    # The cold margin: the margin_quantile of how far the real count of a new step (the text a
    # baseline + delta estimate prices) lies above its price, out of sample: each category priced
    # with a prior fitted without it (leave one category out), so the figure is not in-sample.
    quantile = TokenSettings().margin_quantile
    loco = _loco_step_errors(counted, weights, shared)
    # A model of no known family, once its baselines showed a feature: the margin starts from how
    # far its next steps ran over their price after 1-8 baselines (leave one category out too).
    fitted_default = cold_margins(_loco_unknown_steps(counted, shared), quantile)[1]
    lines = ["PRIORS: dict[str, Prior] = {"]
    for fam, w in weights.items():
        margin, per_feature = cold_margins(loco[fam], quantile)
        sigma = default_sigma if fam == "default" else known_sigma
        lines.append(f'    "{fam}": Prior(')
        lines.append(f"        weights=({', '.join(f'{v:.4f}' for v in w)}),")
        lines.append(f"        sigma={sigma},")
        lines.append(f"        cold_margin={margin:.3f},")
        lines.append(f"        feature_margins=({', '.join(f'{v:.3f}' for v in per_feature)}),")
        if fam == "default":
            # Never wider than cold: what the baselines showed narrows the margin or leaves it (a
            # class few steps carry, such as Han, has a noisy quantile of its own).
            fitted = [min(f, c) for f, c in zip(fitted_default, per_feature, strict=True)]
            lines.append(f"        fitted_margins=({', '.join(f'{v:.3f}' for v in fitted)}),")
        lines.append("    ),")
    lines.append("}")
    # 3/4 of the cheapest vocabulary per class; overheads at the barest framing a template may use
    # (the bench's tool-call wrapper is verbose; a provider's may cost a couple of tokens).
    # (The families' Cyrillic columns have none: the bound holds for every family at once, and
    # the shared class's bound already covers the Cyrillic units.)
    low = np.min([shared[t] for t in TOKENIZERS], axis=0) * 0.75
    low[N_CLASSES:N_UNITS] = 0.0
    low[N_UNITS:] = (1.0, 2.0, 0.0)
    lines.append("#: The smallest plausible tokens per unit of each feature over every vocabulary measured, with")
    lines.append("#: room below: a count under this is below what any tokenizer could have produced.")
    lines.append(f"LOWER_BOUND: tuple[float, ...] = ({', '.join(f'{v:.4f}' for v in low)})")
    return "\n".join(lines)


#: How far a fit may move each weight of a measured family's prior, and of the ``default`` one.
#: The overheads' spread is 0.3x what it was (0.3 / 0.4): chosen with ``--tune-fit`` (FIT split,
#: leave one category out), where it priced standalone lists better (median 2.98% -> 2.63% on
#: average, worst category 3.70% -> 3.38%) and views no worse: with a wide spread two baselines
#: moved the per-message price by up to 15% on the text's own noise, and a list of short messages
#: is mostly per-message framing. A template far off the prior still moves it: the fit widens every
#: spread up to 5x when the baselines clearly ask for it (core/calibration.py).
#: A family's own Cyrillic column has the spread the shared class had; a weight of 0 (the shared
#: class and the other families' columns of a measured family) stays 0 whatever its spread (the
#: fit moves each weight by a share of itself).
KNOWN_SIGMA = {
    "word": 0.04, "ident": 0.08, "number": 0.08, "punct": 0.08, "space": 0.1, "cyrillic": 0.1,
    "han": 0.1, "kana": 0.1, "hangul": 0.1, "other": 0.15,
    **{f: 0.1 for f in FEATURES if f.startswith("cyrillic_")},
    "ident_prefixed": 0.08,
    "message": 0.09, "tool_call": 0.09, "view": 0.09,
}  # fmt: skip
DEFAULT_SIGMA = {
    "word": 0.12, "ident": 0.2, "number": 0.2, "punct": 0.2, "space": 0.25, "cyrillic": 0.4,
    "han": 0.4, "kana": 0.4, "hangul": 0.4, "other": 0.4,
    **{f: 0.4 for f in FEATURES if f.startswith("cyrillic_")},
    "ident_prefixed": 0.2,
    "message": 0.12, "tool_call": 0.12, "view": 0.12,
}  # fmt: skip


def _nnls_weights(rows: list[np.ndarray], y: list[float], used: list[int], fill: np.ndarray) -> np.ndarray:
    a, yy = np.array(rows), np.array(y, dtype=float)
    s = 1 / np.sqrt(np.maximum(yy, 1))
    w = np.zeros(N_FEATURES)
    # A class the rows barely contain (under 1% of their units) is not measured by them: it keeps
    # ``fill`` (the fit split's own weight), as it would be fitted wild from a few stray pieces.
    share = a[:, :N_UNITS].sum(0) / max(a[:, :N_CLASSES].sum(), 1)  # a family's Cyrillic column: its units' share
    cols = [j for j in used if a[:, j].any() and (j >= N_UNITS or share[j] >= 0.01)]
    w[cols] = nnls(a[:, cols] * s[:, None], yy * s)
    for j in range(N_FEATURES):
        if j not in cols or w[j] == 0:
            w[j] = fill[j]
    return w


def _fold_rows(
    counted: dict[str, list[Counted]], cats: list[str], held: str
) -> tuple[list[np.ndarray], dict[str, list[int]]]:
    """The messages' features and their real counts per tokenizer, over every category but ``held``
    (one fold of a leave-one-category-out fit)."""
    rows: list[np.ndarray] = []
    ys: dict[str, list[int]] = {t: [] for t in TOKENIZERS}
    for cat in cats:
        if cat == held:
            continue
        for c in counted[cat]:
            for i, m in enumerate(c.messages):
                rows.append(np.array(message_features(m), dtype=float))
                for t in TOKENIZERS:
                    ys[t].append(c.real[t][i])
    return rows, ys


def _loco_step_errors(
    counted: dict[str, list[Counted]], weights: dict[str, np.ndarray], shared: dict[str, np.ndarray]
) -> dict[str, list[tuple[float, np.ndarray]]]:
    """Per tokenizer: (real - price) / price of every step (the messages one turn adds) of each
    category, priced with weights fitted on the other categories only (mixed left out), with
    each feature's share of the step's price."""
    cats = [c for c in counted if c != "mixed"]
    out: dict[str, list[tuple[float, np.ndarray]]] = {t: [] for t in (*TOKENIZERS, "default")}
    for held in cats:
        rows, ys = _fold_rows(counted, cats, held)
        fold = {t: _nnls_weights(rows, ys[t], columns(t), weights[t]) for t in TOKENIZERS}
        # the default family: the geometric middle of the fold's shared weights, against every tokenizer
        middle = _middle({t: _nnls_weights(rows, ys[t], columns("default"), shared[t]) for t in TOKENIZERS})
        for c in counted[held]:
            for k in range(1, len(c.ends)):
                prev, end = c.ends[k - 1], c.ends[k]
                x = features_of(c.messages[prev:end], view=False)
                for t in TOKENIZERS:
                    real = sum(c.real[t][prev:end])
                    for fam, w in ((t, fold[t]), ("default", middle)):
                        parts = w * x
                        price = float(parts.sum())
                        out[fam].append(((real - price) / price, parts / price))
    return out


#: Baselines before the first step the default family's fitted margins are read off.
UNKNOWN_FIRST = 1
#: Model name of no known family (the ``default`` prior): what ``--unknown`` and the default
#: family's fitted margins price every tokenizer's counts as.
UNKNOWN_MODEL = "bench-unknown"


def unknown_observations(c: Counted, t: str, n: int, settings: TokenSettings = SETTINGS) -> list[Observation]:
    """``observations`` for a model of no known family (``default`` prior) counted by ``t``."""
    done: list[Observation] = []
    for k in range(n):
        done.append(_step_observation(c, t, k, fit(done, settings, family="default")))
    return done


def anchored_margin(cal: Calibration, x: np.ndarray, est: float, settings: TokenSettings = SETTINGS) -> float:
    """The margin the service gives a baseline + delta view whose delta has features ``x`` and
    whose estimate is ``est``: the delta's per-feature margin, plus the residuals' rate on the part
    of ``margin_base`` past the delta (core/tokens.py ``estimate``)."""
    priced = cal.price(x)
    return cal.margin_of(x) + cal.margin_beyond(margin_base(priced, est, settings.margin_view_share) - priced)


def _step_observation(c: Counted, t: str, k: int, cal: Calibration) -> Observation:
    """Step ``k``'s baseline of ``c`` counted by ``t``, its residual against what ``cal`` priced:
    the whole first view, then each step's messages on top of the previous real count."""
    end = c.ends[k]
    if k == 0:
        priced = cal.price(features_of(c.messages[:end], view=True))
        est = priced
    else:
        prev = c.ends[k - 1]
        priced = cal.price(features_of(c.messages[prev:end], view=False))
        est = real_or(t, c, prev) + priced
    base = margin_base(priced, est, SETTINGS.margin_view_share)  # what the service's residual is relative to
    return observation(c, t, end, (real_or(t, c, end) - est) / base if priced > 0 else None)


def _middle(weights: dict[str, np.ndarray]) -> np.ndarray:
    """The ``default`` family's weights from the tokenizers' shared ones: their geometric middle,
    the families' own Cyrillic columns and the prefixed identifiers' column 0."""
    middle = np.exp(np.mean([np.log(np.maximum(weights[t], 1e-3)) for t in TOKENIZERS], axis=0))
    middle[list(CYRILLIC_COLUMNS.values())] = 0.0
    middle[IDENT_PREFIXED_COLUMN] = 0.0
    return middle


def _loco_unknown_steps(
    counted: dict[str, list[Counted]], shared: dict[str, np.ndarray], first: int = UNKNOWN_FIRST
) -> list[tuple[float, np.ndarray]]:
    """(real - price) / price of every step after 1-8 baselines of a model of no known family,
    with each feature's share of the price: each category's sessions calibrated from a ``default``
    prior fitted without that category (the middle of the other categories' weights), so the
    figure is out of sample. Mixed draws from every category: left out, as in the cold margins."""
    from contextsvc.core import calibration as cal_mod
    from contextsvc.core.priors import PRIORS, Prior

    cats = [c for c in counted if c != "mixed"]
    out: list[tuple[float, np.ndarray]] = []
    saved = cal_mod.prior_for
    base = PRIORS["default"]
    try:
        for held in cats:
            rows, ys = _fold_rows(counted, cats, held)
            middle = _middle({t: _nnls_weights(rows, ys[t], columns("default"), shared[t]) for t in TOKENIZERS})
            middle[VIEW] = FRAME_PER_PROMPT
            prior = Prior(tuple(float(v) for v in middle), base.sigma, base.cold_margin, base.feature_margins)
            cal_mod.prior_for = lambda family, prior=prior: prior  # type: ignore[assignment]
            for c in counted[held]:
                for t in TOKENIZERS:
                    obs = unknown_observations(c, t, len(c.ends) - 1)
                    for k in range(first, len(c.ends)):
                        cal = fit(obs[:k], SETTINGS, family="default")
                        prev, end = c.ends[k - 1], c.ends[k]
                        x = features_of(c.messages[prev:end], view=False)
                        parts = np.array(cal.weights) * x
                        price = float(parts.sum())
                        real = sum(c.real[t][prev:end])
                        out.append(((real - price) / price, parts / price))
    finally:
        cal_mod.prior_for = saved
    return out


def unknown_table(counted: dict[str, list[Counted]]) -> str:
    """A model of no known family counted by each tokenizer: views (baseline + delta) after 2 and
    8 baselines, their median |error|, how many ran over estimate + margin, and the margin's
    median share of the view and of the delta it prices, with the ``default`` prior as it is and
    without its fitted margins (the cold ones throughout)."""
    from contextsvc.core import calibration as cal_mod
    from contextsvc.core.priors import PRIORS

    head = (
        "| tokenizer | category | views 2 / 8 baselines: median err % | over est+margin (fitted / cold) "
        "| margin % of view, median (fitted / cold) | margin % of delta, median (fitted / cold) |"
    )
    rows = [head, "|---" * 6 + "|"]
    saved = cal_mod.prior_for
    cold_only = replace(PRIORS["default"], fitted_margins=())
    totals = {"fitted": [0, [], []], "cold": [0, [], []]}
    try:
        for t in TOKENIZERS:
            for cat in CATEGORIES:
                errs: list[float] = []
                stat = {k: [0, [], []] for k in ("fitted", "cold")}
                for c in counted[cat]:
                    for n in (2, 8):
                        if n >= len(c.ends):
                            continue
                        obs = unknown_observations(c, t, n)
                        prev, end = c.ends[n - 1], c.ends[n]
                        x = features_of(c.messages[prev:end], view=False)
                        real = real_or(t, c, end)
                        for kind in ("fitted", "cold"):
                            if kind == "cold":
                                cal_mod.prior_for = lambda family: cold_only  # type: ignore[assignment]
                            cal = fit(obs, SETTINGS, family="default")
                            cal_mod.prior_for = saved
                            est = real_or(t, c, prev) + cal.price(x)
                            margin = math.ceil(anchored_margin(cal, x, est))
                            if kind == "fitted":
                                errs.append(err(est, real))
                            for into in (stat[kind], totals[kind]):
                                into[0] += est + margin < real
                                into[1].append(100 * margin / real)
                                into[2].append(100 * margin / max(cal.price(x), 1))
                rows.append(
                    f"| {t} | {cat} | {pct(errs, 0.5):.1f} | {stat['fitted'][0]} / {stat['cold'][0]} "
                    f"| {statistics.median(stat['fitted'][1]):.1f} / {statistics.median(stat['cold'][1]):.1f} "
                    f"| {statistics.median(stat['fitted'][2]):.1f} / {statistics.median(stat['cold'][2]):.1f} |"
                )
    finally:
        cal_mod.prior_for = saved
    f, c0 = totals["fitted"], totals["cold"]
    rows.append(
        f"| all | all | | {f[0]} / {c0[0]} of {len(f[1])} | {statistics.median(f[1]):.1f} / "
        f"{statistics.median(c0[1]):.1f} | {statistics.median(f[2]):.1f} / {statistics.median(c0[2]):.1f} |"
    )
    return "\n".join(rows)


def cold_margins(steps: list[tuple[float, np.ndarray]], q: float) -> tuple[float, list[float]]:
    """The cold margin, overall and per feature, from out-of-sample step errors ``(relative error,
    each feature's share of the step's price)``: the ``q`` quantile of the underestimates, and per
    feature the same quantile with each step weighted by that feature's share of its price (so
    the margin of Cyrillic text is read off the steps made of Cyrillic text). A feature with under
    ``MIN_SHARE`` steps' worth of price keeps the overall margin."""
    errs = np.maximum(np.array([e for e, _ in steps]), 0.0)
    shares = np.array([s for _, s in steps])
    overall = float(np.quantile(errs, q))
    order = np.argsort(errs)
    per_feature = []
    for j in range(N_FEATURES):
        w = shares[order, j]
        if w.sum() < MIN_SHARE:
            per_feature.append(overall)
            continue
        cum = np.cumsum(w) / w.sum()
        per_feature.append(float(errs[order][min(len(errs) - 1, int(np.searchsorted(cum, q)))]))
    return overall, per_feature


#: Steps' worth of price a feature needs before its own cold margin is read off them.
MIN_SHARE = 3.0


def real_or(t: str, c: Counted, end: int) -> float:
    return sum(c.real[t][:end]) + FRAME_PER_PROMPT


def write_prior(block: str) -> None:
    text = PRIORS_FILE.read_text()
    begin = text.index("\n", text.index("-- BEGIN GENERATED")) + 1
    end = text.index("# --- END GENERATED")
    PRIORS_FILE.write_text(text[:begin] + block + "\n" + text[end:])


# --- scoring --------------------------------------------------------------------------------


def err(est: float, real: float) -> float:
    return abs(est - real) / real


def pct(values: list[float], q: float) -> float:
    return 100 * float(np.percentile(values, 100 * q)) if values else float("nan")


def cell(values: list[float]) -> str:
    return f"{pct(values, 0.5):.1f} / {pct(values, 0.9):.1f}"


def calibrate(tokenizer: str, obs: list[Observation], settings: TokenSettings = SETTINGS) -> Calibration:
    from contextsvc.core.priors import DEFAULT_MODEL_FAMILIES, family_for

    return fit(obs, settings, family=family_for(MODELS[tokenizer], DEFAULT_MODEL_FAMILIES))


def _east_asian(ch: str) -> int:
    """0 Han, 1 kana, 2 hangul for a character of the vocabulary table's blocks, else -1."""
    o = ord(ch)
    return 0 if 0x4E00 <= o < 0xA000 else 1 if 0x3040 <= o < 0x3100 else 2 if 0xAC00 <= o < 0xD7A4 else -1


def diagnose_cjk(counted: dict[str, list[Counted]]) -> None:
    """FIT split: where the Cyrillic/CJK error comes from, and whether per-character costs read off
    the vocabularies (core/_cjk_costs.py) explain East Asian text better than one price per
    character. (1) The category's tool outputs priced after 2 baselines, by their main script.
    (2) Tool outputs (cyrillic_cjk and mixed) that are at least 30% East Asian: the three class
    weights fitted leave one out, the rest priced by the prior; |error| of the whole output with
    character counts against the table's mean costs."""
    from contextsvc.core import sizing
    from contextsvc.core.priors import PRIORS

    names = {j: FEATURES[j] for j in range(N_CLASSES)}
    for t in TOKENIZERS:
        by: dict[str, list[float]] = {}
        for c in counted["cyrillic_cjk"]:
            cal = calibrate(t, observations(c, t, 2))
            for i, m in enumerate(c.messages):
                if m.role is Role.TOOL:
                    x = features_of([m], view=False)
                    main = names[int(np.argmax(x[:N_CLASSES]))]
                    by.setdefault(main, []).append(abs(err(cal.price(x), c.real[t][i])))
        print(
            t,
            "tool outputs by main class (count, median / p90 |error| %):",
            {k: (len(v), round(pct(v, 0.5), 1), round(pct(v, 0.9), 1)) for k, v in sorted(by.items())},
        )
    rows = []
    seen: set[str] = set()
    for c in counted["cyrillic_cjk"] + counted["mixed"]:
        for i, m in enumerate(c.messages):
            if m.role is not Role.TOOL or m.content in seen:
                continue
            seen.add(m.content)
            chars = [ch for ch in m.content if _east_asian(ch) >= 0]
            if len(chars) >= 0.3 * len(m.content):
                rows.append((features_of([m], view=False), chars, {t: c.real[t][i] for t in TOKENIZERS}))
    cjk = [FEATURES.index(n) for n in ("han", "kana", "hangul")]
    for t in TOKENIZERS:
        w = PRIORS[t].weights
        y = np.array([real[t] - sum(w[j] * x[j] for j in range(N_FEATURES) if j not in cjk) for x, _, real in rows])
        tot = np.array([real[t] for _, _, real in rows], dtype=float)
        flat = np.zeros((len(rows), 3))
        table = np.zeros((len(rows), 3))
        for r, (_, chars, _) in enumerate(rows):
            for ch in chars:
                flat[r, _east_asian(ch)] += 1
                table[r, _east_asian(ch)] += sizing._cjk_char_tokens(ch, sizing.WEIGHTS)
        out = {}
        for name, a in (("one price per character", flat), ("vocabulary table", table)):
            errs = []
            for i in range(len(rows)):
                keep = [k for k in range(len(rows)) if k != i]
                s = 1 / np.sqrt(tot[keep])
                coef, *_ = np.linalg.lstsq(a[keep] * s[:, None], y[keep] * s, rcond=None)
                errs.append(100 * abs(a[i] @ coef - y[i]) / tot[i])
            out[name] = f"{np.median(errs):.2f} / {np.percentile(errs, 90):.2f}"
        print(t, f"{len(rows)} East Asian tool outputs, leave-one-out median / p90 |error| %:", out)


def _loo_scaled(rest: np.ndarray, part: np.ndarray, real: np.ndarray) -> list[float]:
    """|error| of ``rest + part @ s`` against ``real``, ``s`` fitted (relative least squares) on
    every other row: leave one out, so a column set is not judged on the rows it was fitted to."""
    y, a = (real - rest) / real, part / real[:, None]
    out = []
    for i in range(len(real)):
        keep = np.arange(len(real)) != i
        s, *_ = np.linalg.lstsq(a[keep], y[keep], rcond=None)
        out.append(abs(rest[i] + part[i] @ s - real[i]) / real[i])
    return out


def _outputs_of(counted: dict[str, list[Counted]], cats: Sequence[str], cls: int, share: float) -> list[tuple]:
    """Distinct tool outputs of ``cats`` whose units are at least ``share`` of class ``cls``, with
    their features and real counts per tokenizer."""
    out, seen = [], set()
    for cat in cats:
        for c in counted[cat]:
            for i, m in enumerate(c.messages):
                if m.role is not Role.TOOL or m.content in seen:
                    continue
                x = features_of([m], view=False)
                if x[cls] >= share * x[:N_CLASSES].sum():
                    seen.add(m.content)
                    out.append((m, x, {t: c.real[t][i] for t in TOKENIZERS}))
    return out


def diagnose_cyrillic(counted: dict[str, list[Counted]]) -> None:
    """FIT split: why Cyrillic views after 2 baselines miss. (1) The 2-baseline views of the
    category: |error| and signed error with the calibration of 2 baselines against the prior alone
    (the delta is all a 2-baseline view prices). (2) Tool outputs at least 30% Cyrillic (both
    Cyrillic categories of the fit split), the rest of each output priced by the prior and its
    Cyrillic pieces by (a) the size units, (b) each piece counted alone by the model's own
    vocabulary, (c) by the mean of the four, (d) by another vocabulary, one scale fitted leave one
    out: what a better Cyrillic measure could gain, and whether one measure can serve every
    vocabulary. (3) Tokens of a lower-case Cyrillic word after a space, alone, by length."""
    from contextsvc.core import sizing
    from contextsvc.core.priors import PRIORS

    cyr = FEATURES.index("cyrillic")
    for t in TOKENIZERS:
        fitted, prior = [], []
        for c in counted["cyrillic_cjk"]:
            prev, end = c.ends[1], c.ends[2]
            x = features_of(c.messages[prev:end], view=False)
            real, base = real_or(t, c, end), real_or(t, c, prev)
            for out, cal in ((fitted, calibrate(t, observations(c, t, 2))), (prior, calibrate(t, []))):
                out.append((base + cal.price(x) - real) / real)
        print(
            f"{MODELS[t]}: 2-baseline views, |error| median / p90 (signed median): fitted "
            f"{pct([abs(v) for v in fitted], 0.5):.2f} / {pct([abs(v) for v in fitted], 0.9):.2f} "
            f"({pct(fitted, 0.5):+.2f}), prior alone {pct([abs(v) for v in prior], 0.5):.2f} / "
            f"{pct([abs(v) for v in prior], 0.9):.2f} ({pct(prior, 0.5):+.2f})"
        )
    outs = _outputs_of(counted, ("cyrillic_cjk", "mixed"), cyr, 0.3)
    found: list[list[tuple[str, int]]] = []
    distinct: set[str] = set()
    for m, _, _ in outs:
        ps = sizing.pieces(m.content)
        mine = [
            (p, sizing.piece_units(p) if k == 0 else sizing._inner_units(p))
            for k, p in enumerate(ps)
            if sizing.piece_class(p) == sizing.CYRILLIC
        ]
        found.append(mine)
        distinct.update(p for p, _ in mine)
    names = sorted(distinct)
    counts = count_real(names)
    alone = {p: {t: counts[t][i] for t in TOKENIZERS} for i, p in enumerate(names)}
    own = {t: k for k, t in enumerate(sizing.CYRILLIC_FAMILIES)}
    measures = {
        "size units": lambda p, u, t: u,
        "own column (sizing.feature_units)": lambda p, u, t: sizing._cyrillic_family_units(p)[own[t]],
        "own vocabulary alone": lambda p, u, t: alone[p][t],
        "mean of the four": lambda p, u, t: statistics.fmean(alone[p].values()),
        **{f"{v} for all": (lambda p, u, t, v=v: alone[p][v]) for v in TOKENIZERS},
    }
    print(f"{len(outs)} tool outputs >= 30% Cyrillic ({len(names)} distinct pieces), leave-one-out |error| %:")
    for name, f in measures.items():
        cells = []
        for t in TOKENIZERS:
            w = np.array(PRIORS[t].weights)
            cols = [cyr, *CYRILLIC_COLUMNS.values()]  # every Cyrillic column: the measure prices them
            rest = np.array([float(w @ x) - sum(w[j] * x[j] for j in cols) for _, x, _ in outs])
            part = np.array([[sum(f(p, u, t) for p, u in ps)] for ps in found], dtype=float)
            real = np.array([r[t] for _, _, r in outs], dtype=float)
            e = _loo_scaled(rest, part, real)
            cells.append(f"{t} {pct(e, 0.5):.2f} / {pct(e, 0.9):.2f}")
        print(f"  {name}: " + " | ".join(cells))
    print("lower-case Cyrillic words after a space, mean tokens alone by letters (size units' tokens):")
    for n in range(2, 15, 2):
        ws = [p for p in names if p[0] == " " and p[1:].islower() and len(p) == n + 1 and p[1:].isalpha()]
        if ws:
            row = " ".join(f"{t} {statistics.fmean(alone[p][t] for p in ws):.2f}" for t in TOKENIZERS)
            units = statistics.fmean(sizing.piece_tokens(p) for p in ws)
            print(f"  {n:2d} letters ({len(ws)}): {row} (units {units:.2f})")


def _merged(x: np.ndarray, merge: dict[int, int]) -> np.ndarray:
    """``x`` with each feature of ``merge``'s keys added into its value's (and zeroed): the feature
    vector as a set without those features would have measured it."""
    if not merge:
        return x
    y = x.copy()
    for src, dst in merge.items():
        y[..., dst] += y[..., src]
        y[..., src] = 0.0
    return y


#: Variants ``--split-half`` compares: name -> (the features a tokenizer's prior is fitted on,
#: features merged into another before anything is fitted or priced).
SPLIT_HALF_VARIANTS: dict[str, tuple[Callable[[str], list[int]], dict[int, int]]] = {
    "without the prefixed identifiers' column (round 10)": (lambda t: columns(t, ()), {}),
    "prefixed identifiers' column for Claude (kept)": (columns, {}),
    "prefixed identifiers' column for every family": (lambda t: columns(t, tuple(TOKENIZERS)), {}),
}


def split_half(counted: dict[str, list[Counted]]) -> None:
    """FIT split, split-half: a prior fitted (non-negative least squares, as ``--fit-prior``) on the
    sessions of even index of every category, the others priced with it, then the halves swapped.
    Per variant of ``SPLIT_HALF_VARIANTS``, tokenizer and category: median / p90 |error| % of the
    2-baseline views (baseline + delta, the fit of 2 baselines towards that prior) and of every
    step priced by the prior alone. How a feature choice is judged without the SCORE split."""
    from contextsvc.core import calibration as cal_mod
    from contextsvc.core.priors import Prior, prior_for

    feats = {
        id(c): np.array([message_features(m) for m in c.messages], dtype=float) for v in counted.values() for c in v
    }
    saved = cal_mod.prior_for
    try:
        for name, (cols_of, merge) in SPLIT_HALF_VARIANTS.items():
            views: dict[tuple[str, str], list[float]] = {}
            steps: dict[tuple[str, str], list[float]] = {}
            for half in (0, 1):
                rows: list[np.ndarray] = []
                ys: dict[str, list[int]] = {t: [] for t in TOKENIZERS}
                for items in counted.values():
                    for i, c in enumerate(items):
                        if i % 2 == half:
                            rows += list(_merged(feats[id(c)], merge))
                            for t in TOKENIZERS:
                                ys[t] += c.real[t]
                for t in TOKENIZERS:
                    cols = cols_of(t)
                    fill = np.array(prior_for(t).weights)
                    fill[[j for j in range(N_UNITS) if j not in cols]] = 0.0
                    w = _nnls_weights(rows, ys[t], cols, fill)
                    w[VIEW] = FRAME_PER_PROMPT
                    prior = Prior(tuple(float(v) for v in w), prior_for(t).sigma, prior_for(t).cold_margin)
                    cal_mod.prior_for = lambda _family, prior=prior: prior  # type: ignore[assignment]
                    for cat, items in counted.items():
                        for i, c in enumerate(items):
                            if i % 2 == half:
                                continue
                            x_all = _merged(feats[id(c)], merge)

                            def x_of(a: int, b: int, view: bool, x_all: np.ndarray = x_all) -> np.ndarray:
                                x = x_all[a:b].sum(0)
                                x[VIEW] = 1.0 if view else 0.0
                                return x

                            obs = [
                                Observation(
                                    int(x_of(0, e, True)[:N_CLASSES].sum()),
                                    int(real_or(t, c, e)),
                                    features=tuple(float(v) for v in x_of(0, e, True)),
                                )
                                for e in c.ends[:2]
                            ]
                            cal = fit(obs, SETTINGS, family=t)
                            prev, end = c.ends[1], c.ends[2]
                            est = real_or(t, c, prev) + cal.price(x_of(prev, end, False))
                            views.setdefault((t, cat), []).append(err(est, real_or(t, c, end)))
                            for k in range(1, len(c.ends)):
                                a, b = c.ends[k - 1], c.ends[k]
                                steps.setdefault((t, cat), []).append(
                                    err(float(w @ x_of(a, b, False)), sum(c.real[t][a:b]))
                                )
            print(f"{name}: 2-baseline views | steps by the prior, median / p90 |error| %")
            for cat in counted:
                print(
                    f"  {cat:13s} "
                    + " ".join(f"{t} {cell(views[(t, cat)])} | {cell(steps[(t, cat)])};" for t in TOKENIZERS)
                )
    finally:
        cal_mod.prior_for = saved


def diagnose_json(counted: dict[str, list[Counted]]) -> None:
    """FIT split: the tail of JSON views after 2 baselines (the largest |errors|, with the shares of
    the delta's price by feature), and identifier pieces of JSON and code by shape, tokens per
    unit alone in each vocabulary: where one ``ident`` ratio cannot price every vocabulary."""
    from contextsvc.core import sizing

    for t in TOKENIZERS:
        rows = []
        for c in counted["json"]:
            cal = calibrate(t, observations(c, t, 2))
            prev, end = c.ends[1], c.ends[2]
            x = features_of(c.messages[prev:end], view=False)
            real, base = real_or(t, c, end), real_or(t, c, prev)
            parts = np.array(cal.weights) * x
            rows.append((100 * (base + cal.price(x) - real) / real, parts / parts.sum()))
        rows.sort(key=lambda r: -abs(r[0]))
        print(f"{MODELS[t]}: JSON 2-baseline views, largest |error| first")
        for e, share in rows[:3]:
            top = sorted(((share[j], FEATURES[j]) for j in range(N_FEATURES)), reverse=True)[:4]
            print(f"  {e:+.2f}%: " + ", ".join(f"{n} {v:.2f}" for v, n in top))

    def shape(p: str) -> str:
        head = p[0]
        letters = p if head.isalnum() or head == " " else p[1:]
        prefix = "bare" if head.isalnum() or head == " " else head if head in "_." else "punct"
        humps = "camel" if re.search("[a-z][A-Z]", letters) else "lower" if letters.islower() else "other"
        return f"{prefix}/{humps}"

    freq: dict[tuple[str, str], int] = {}
    for cat in ("json", "code"):
        for c in counted[cat]:
            for m in c.messages:
                for p in sizing.pieces(m.content):
                    if p[-1].isalpha() and p.isascii() and not p.isspace():
                        k = (cat, p)
                        freq[k] = freq.get(k, 0) + 1
    names = sorted({p for _, p in freq})
    counts = count_real(names)
    alone = {p: {t: counts[t][i] for t in TOKENIZERS} for i, p in enumerate(names)}
    for cat in ("json", "code"):
        agg: dict[str, list[float]] = {}
        for (cc, p), n in freq.items():
            if cc == cat:
                a = agg.setdefault(f"{sizing.CLASSES[sizing.piece_class(p)]} {shape(p)}", [0.0] * 5)
                a[0] += n * sizing.piece_units(p)
                for j, t in enumerate(TOKENIZERS):
                    a[j + 1] += n * alone[p][t]
        print(f"{cat}: letter pieces by class and shape, tokens per unit alone")
        for k, a in sorted(agg.items(), key=lambda kv: -kv[1][0])[:8]:
            print(
                f"  {k} ({a[0]:.0f} units): " + " ".join(f"{t} {a[j + 1] / a[0]:.3f}" for j, t in enumerate(TOKENIZERS))
            )


def diagnose_lists(counted: dict[str, list[Counted]]) -> None:
    """On the FIT split: where a standalone list's error comes from. Single messages by kind (the
    prior's |error| median / p90 and signed median: a per-role framing constant would show as a
    signed bias), and lists after 2 baselines by their number of messages."""
    from contextsvc.core.messages import Role

    def kind(m: Message) -> str:
        return "tool output" if m.role is Role.TOOL else "tool call" if m.tool_calls else m.role.value

    for t in TOKENIZERS:
        cal = calibrate(t, [])
        print(f"{MODELS[t]}: single messages, |error| median / p90 (signed median), cold prior")
        for cat, items in counted.items():
            by: dict[str, list[float]] = {}
            for c in items:
                for i, m in enumerate(c.messages):
                    real = c.real[t][i]
                    by.setdefault(kind(m), []).append((cal.price(features_of([m], view=False)) - real) / real)
            print(
                f"  {cat}: "
                + "; ".join(
                    f"{k} {pct([abs(v) for v in vs], 0.5):.1f} / {pct([abs(v) for v in vs], 0.9):.1f} "
                    f"({pct(vs, 0.5):+.1f})"
                    for k, vs in sorted(by.items())
                )
            )
    rng = random.Random(7)
    by_len: dict[int, list[float]] = {}
    for t in TOKENIZERS:
        for items in counted.values():
            for c in items:
                cal = calibrate(t, observations(c, t, 2))
                end = c.ends[2]
                for _ in range(LIST_SLICES):
                    a = rng.randrange(1, end - 1)
                    b = rng.randrange(a + 1, end + 1)
                    e = err(cal.price(features_of(c.messages[a:b], view=False)), sum(c.real[t][a:b]))
                    by_len.setdefault(min(b - a, 6), []).append(e)
    print("lists after 2 baselines by messages (6 = 6 or more): |error| median / p90")
    for k, vs in sorted(by_len.items()):
        print(f"  {k}: {len(vs)} lists, {cell(vs)}")


def tune_margin(counted: dict[str, list[Counted]]) -> None:
    """On the FIT split: share of next views (baseline + delta) whose real count exceeds
    estimate + margin, and what the margin costs, for candidate quantiles (the cold margins
    re-measured at each, leave one category out), one cold margin or one per feature, and
    ``margin_prior_weight`` values."""
    from contextsvc.core import calibration as cal_mod
    from contextsvc.core.priors import PRIORS, Prior

    default = np.array(PRIORS["default"].weights)
    loco = _loco_step_errors(
        counted, {f: np.array(p.weights) for f, p in PRIORS.items()}, dict.fromkeys(TOKENIZERS, default)
    )
    saved = cal_mod.prior_for
    try:
        for q in (0.95, 0.98, 0.99, 0.995):
            for per_feature in (False, True):
                priors = {}
                for fam, p in PRIORS.items():
                    overall, each = cold_margins(loco[fam], q)
                    priors[fam] = Prior(p.weights, p.sigma, overall, tuple(each) if per_feature else ())
                cal_mod.prior_for = lambda family, priors=priors: priors[family]  # type: ignore[assignment]
                for w in (4.0, 8.0, 16.0):
                    st = TokenSettings(margin_prior_weight=w, margin_quantile=q)
                    over: dict[str, int] = {}
                    total = 0
                    spent = []
                    for t in TOKENIZERS:
                        for cat, items in counted.items():
                            for c in items:
                                for n in range(1, len(c.ends)):
                                    cal = calibrate(t, observations(c, t, n, st), st)
                                    prev, end = c.ends[n - 1], c.ends[n]
                                    x = features_of(c.messages[prev:end], view=False)
                                    est = real_or(t, c, prev) + cal.price(x)
                                    margin = anchored_margin(cal, x, est, st)
                                    out = est + math.ceil(margin) < real_or(t, c, end)
                                    over[cat] = over.get(cat, 0) + out
                                    total += 1
                                    spent.append(margin / real_or(t, c, end))
                    n_over = sum(over.values())
                    print(
                        f"quantile {q}, {'per feature' if per_feature else 'one cold margin'}, "
                        f"margin_prior_weight={w}: over {n_over}/{total} ({100 * n_over / total:.1f}%; "
                        + ", ".join(f"{k} {v}" for k, v in over.items())
                        + f"), margin median {100 * statistics.median(spent):.2f}% "
                        f"mean {100 * statistics.mean(spent):.2f}% of the view"
                    )
    finally:
        cal_mod.prior_for = saved


def tune_fit(counted: dict[str, list[Counted]]) -> None:
    """On the FIT split, leave one category out: the prior fitted on the other categories, the next
    view after 2 and 8 baselines of the held-out one (its error in % of the view), for candidate
    spread choices of core/calibration.py. How the spread rule and its constants were chosen."""
    from contextsvc.core import calibration as cal_mod
    from contextsvc.core.priors import Prior, prior_for

    cats = [c for c in CATEGORIES if c != "mixed"]
    feats_all = {
        cat: [np.array([message_features(m) for m in c.messages], dtype=float) for c in counted[cat]] for cat in cats
    }
    folds = []
    for held in cats:
        rows, ys = [], {t: [] for t in TOKENIZERS}
        for cat in cats:
            if cat != held:
                for c, f in zip(counted[cat], feats_all[cat], strict=True):
                    rows += list(f)
                    for t in TOKENIZERS:
                        ys[t] += c.real[t]
        folds.append(
            (held, {t: _nnls_weights(rows, ys[t], columns(t), np.array(prior_for(t).weights)) for t in TOKENIZERS})
        )
    # (spread scales the evidence chooses from, text noise, Bayes factor, overhead spread multiplier)
    candidates = {
        "prior spread as measured (x1)": ((1.0,), 0.05, 10.0, 1.0),
        "narrow (x0.2)": ((0.2,), 0.05, 10.0, 1.0),
        "by evidence, text noise 3%, factor 3": ((0.2, 1.0, 5.0), 0.03, 3.0, 1.0),
        "by evidence, text noise 5%, factor 10 (chosen)": ((0.2, 1.0, 5.0), 0.05, 10.0, 1.0),
        "as chosen, overheads' spread as before (x3.33)": ((0.2, 1.0, 5.0), 0.05, 10.0, 1 / 0.3),
        "as chosen, overheads' spread x0.33": ((0.2, 1.0, 5.0), 0.05, 10.0, 1 / 3),
    }
    saved = (cal_mod._SCALES, cal_mod._TEXT_SIGMA, cal_mod._BAYES_FACTOR, cal_mod.prior_for)
    try:
        for name, (scales, text_sigma, factor, overheads) in candidates.items():
            cal_mod._SCALES, cal_mod._TEXT_SIGMA, cal_mod._BAYES_FACTOR = scales, text_sigma, factor
            med2, p90_2, med8, lmed, lp90 = [], [], [], [], []
            for held, pri in folds:
                for t in TOKENIZERS:
                    sigma = tuple(v * (overheads if j >= N_UNITS else 1.0) for j, v in enumerate(prior_for(t).sigma))
                    prior = Prior(tuple(float(v) for v in pri[t]), sigma, prior_for(t).cold_margin)
                    cal_mod.prior_for = lambda _family, prior=prior: prior  # type: ignore[assignment]
                    e2, e8, lists = [], [], []
                    rng = random.Random(11)
                    for c in counted[held]:
                        for n, out in ((2, e2), (8, e8)):
                            obs = [observation(c, t, e) for e in c.ends[:n]]
                            cal = cal_mod.fit(obs, SETTINGS, family=t)
                            prev, end = c.ends[n - 1], c.ends[n]
                            delta = cal.price(features_of(c.messages[prev:end], view=False))
                            out.append(err(real_or(t, c, prev) + delta, real_or(t, c, end)))
                            if n == 2:
                                lists += list_errors(c, t, cal, end, rng, LIST_SLICES)
                    med2.append(pct(e2, 0.5))
                    p90_2.append(pct(e2, 0.9))
                    med8.append(pct(e8, 0.5))
                    lmed.append(pct(lists, 0.5))
                    lp90.append(pct(lists, 0.9))
            print(
                f"{name}: 2 baselines median mean {statistics.mean(med2):.2f}% worst {max(med2):.2f}%, "
                f"p90 worst {max(p90_2):.2f}%; 8 baselines median mean {statistics.mean(med8):.2f}%; "
                f"lists after 2: median mean {statistics.mean(lmed):.2f}% worst {max(lmed):.2f}%, "
                f"p90 mean {statistics.mean(lp90):.2f}% worst {max(lp90):.2f}%"
            )
    finally:
        cal_mod._SCALES, cal_mod._TEXT_SIGMA, cal_mod._BAYES_FACTOR, cal_mod.prior_for = saved


#: Standalone lists priced per session and baseline count (random slices of the messages so far).
LIST_SLICES = 10


def list_errors(c: Counted, t: str, cal: Calibration, end: int, rng: random.Random, k: int) -> list[float]:
    """|error| of ``k`` standalone lists: random slices of the messages before ``end`` (never the
    system row), each priced alone (no view overhead) against the sum of its messages' real counts."""
    out = []
    for _ in range(k):
        a = rng.randrange(1, end - 1)
        b = rng.randrange(a + 1, end + 1)
        out.append(err(cal.price(features_of(c.messages[a:b], view=False)), sum(c.real[t][a:b])))
    return out


def observation(c: Counted, t: str, end: int, residual: float | None = None) -> Observation:
    x = features_of(c.messages[:end], view=True)
    return Observation(
        int(x[:N_CLASSES].sum()), int(real_or(t, c, end)), features=tuple(float(v) for v in x), residual=residual
    )


_OBS_CACHE: dict[tuple[int, str, float], list[Observation]] = {}


def observations(c: Counted, t: str, n: int, settings: TokenSettings = SETTINGS) -> list[Observation]:
    """The first ``n`` baselines of session ``c`` as the service records them: each with the
    residual of the estimate made for its view before its count was known (cold for the first,
    baseline + delta after), relative to what that estimate priced."""
    key = (id(c), t, settings.margin_prior_weight)
    done = _OBS_CACHE.setdefault(key, [])
    while len(done) < n:
        done.append(_step_observation(c, t, len(done), calibrate(t, done, settings)))
    return done[:n]


def chars_of(msgs: Sequence[Message]) -> int:
    return sum(len(p) for m in msgs for p in message_parts(m))


def bytes_of(msgs: Sequence[Message]) -> int:
    return sum(len(p.encode()) for m in msgs for p in message_parts(m))


def score(counted: dict[str, list[Counted]]) -> tuple[str, str, list[str]]:
    rng = random.Random(7)
    head = (
        "| model (tokenizer) | category | views: cold | 2 baselines | 8 baselines | lists: cold | 2 | 8 "
        "| chars/4 views | bytes/4x1.3 views | chars/4 lists | refused | cut caught | over est+margin |"
    )
    rows = [head, "|---" * 14 + "|"]
    verdicts: list[str] = []
    cold_by: dict[tuple[str, str], float] = {}
    for t in TOKENIZERS:
        for cat in CATEGORIES:
            col: dict[str, list[float]] = {}
            refused = over = caught = cuts = 0
            for c in counted[cat]:
                views = c.ends
                for n in (0, 2, 8):
                    if n >= len(views):
                        continue
                    cal = calibrate(t, observations(c, t, n))
                    end = views[n]
                    real = real_or(t, c, end)
                    if n == 0:
                        est = cal.price(features_of(c.messages[:end], view=True))
                    else:  # baseline + delta, as the service does
                        prev = views[n - 1]
                        x = features_of(c.messages[prev:end], view=False)
                        est = real_or(t, c, prev) + cal.price(x)
                        over += est + math.ceil(anchored_margin(cal, x, est)) < real
                    col.setdefault(f"v{n}", []).append(err(est, real))
                    # standalone lists: random slices of the session's messages after those baselines
                    for _ in range(LIST_SLICES):
                        a = rng.randrange(1, end - 1)
                        b = rng.randrange(a + 1, end + 1)
                        lst = c.messages[a:b]
                        lreal = sum(c.real[t][a:b])
                        col.setdefault(f"l{n}", []).append(err(cal.price(features_of(lst, view=False)), lreal))
                        if n == 0:
                            col.setdefault("c4l", []).append(err(chars_of(lst) / 4, lreal))
                for e in views:
                    real = real_or(t, c, e)
                    col.setdefault("c4", []).append(err(chars_of(c.messages[:e]) / 4, real))
                    col.setdefault("b4", []).append(err(bytes_of(c.messages[:e]) / 4 * 1.3, real))
                    # The service's truncation rule on this honest count, with the calibration of the
                    # baselines before it: below ratio x the estimate made for the view AND below its
                    # floor (calibrated price where baselines back it, vocabulary-free bound elsewhere).
                    k = views.index(e)
                    cal = calibrate(t, observations(c, t, k))
                    x = features_of(c.messages[:e], view=True)
                    if k == 0:
                        est = cal.price(x)
                    else:
                        prev = views[k - 1]
                        est = real_or(t, c, prev) + cal.price(features_of(c.messages[prev:e], view=False))
                    ratio = SETTINGS.truncation_ratio
                    floor = max(lower_bound(tuple(x)), cal.floor(tuple(x), ratio))
                    refused += real < min(ratio * est, floor)
                    # A prompt whose head the provider dropped: 40-65% of the honest count.
                    cut = real * rng.uniform(0.40, 0.65)
                    caught += cut < min(ratio * est, floor)
                    cuts += 1
            cold_by[(t, cat)] = pct(col["v0"], 0.5)
            rows.append(
                f"| {MODELS[t]} ({t}) | {cat} | "
                + " | ".join(cell(col[k]) for k in ("v0", "v2", "v8", "l0", "l2", "l8", "c4", "b4", "c4l"))
                + f" | {refused} | {caught}/{cuts} | {over} |"
            )
            v2, l2 = col["v2"], col["l2"]
            ok = pct(v2, 0.5) <= 1.5 and pct(v2, 0.9) <= 5 and pct(l2, 0.5) <= 4 and pct(l2, 0.9) <= 10
            cold_ok = pct(col["v0"], 0.5) <= pct(col["c4"], 0.5) and (
                cat != "cyrillic_cjk" or pct(col["v0"], 0.5) <= 15
            )
            verdicts.append(
                f"- {MODELS[t]} / {cat}: 2-baseline targets {'met' if ok else 'NOT met'}; "
                f"cold {'met' if cold_ok else 'NOT met'} "
                f"({pct(col['v0'], 0.5):.1f}% vs chars/4 {pct(col['c4'], 0.5):.1f}%); "
                f"refused {refused}; views over estimate+margin {over}"
            )
    return "\n".join(rows), cross_table(counted), verdicts


def cross_table(counted: dict[str, list[Counted]]) -> str:
    """Calibrate a model with 2 baselines of category A, price cold views of category B: the change of
    B's median error against the uncalibrated prior (points; positive = worse)."""
    cats = [c for c in CATEGORIES if c != "mixed"]
    head = "| model | calibrated on | " + " | ".join(cats) + " | worst |"
    rows = [head, "|---" * (len(cats) + 3) + "|"]
    for t in TOKENIZERS:
        base: dict[str, float] = {}
        for b in cats:
            base[b] = pct(
                [
                    err(
                        calibrate(t, []).price(features_of(c.messages[: c.ends[-1]], view=True)),
                        real_or(t, c, c.ends[-1]),
                    )
                    for c in counted[b]
                ],
                0.5,
            )
        for a in cats:
            deltas = []
            for b in cats:
                errs = []
                for i, cb in enumerate(counted[b]):
                    ca = counted[a][i % len(counted[a])]
                    cal = calibrate(t, observations(ca, t, 2))
                    errs.append(
                        err(cal.price(features_of(cb.messages[: cb.ends[-1]], view=True)), real_or(t, cb, cb.ends[-1]))
                    )
                deltas.append(pct(errs, 0.5) - base[b])
            worst = max(d for d, b in zip(deltas, cats, strict=True) if b != a)
            rows.append(f"| {MODELS[t]} | {a} | " + " | ".join(f"{d:+.1f}" for d in deltas) + f" | {worst:+.1f} |")
    return "\n".join(rows)


def record(table: str, cross: str, verdicts: list[str], command: str) -> None:
    path = ROOT / "bench" / "RESULTS.md"
    text = path.read_text()
    section = (
        "## Fidelity (`bench/fidelity/`)\n\n"
        f"{dt.date.today().isoformat()}, `{command}`, {platform.machine()} {platform.python_version()}, "
        f"{__import__('os').cpu_count()} cores, load average {__import__('os').getloadavg()[0]:.1f} (no figure "
        "here is a timing: the load does not change them).\n"
        "Held-out corpus (bench/fidelity/fidelity_corpus.py). Everything tuned was tuned on the FIT split only: "
        "the prior and its cold margins in core/priors.py (`--fit-prior`; cold margin = the `margin_quantile` "
        "(0.995) of how far a new step's real count lies above its price, each category priced by a prior fitted "
        "without it; per feature, each step weighted by the feature's share of its price), the fit's spread rule "
        "and the overheads' spread (`--tune-fit`, leave one category out), the margin quantile, weight and the "
        "per-feature rule (`--tune-margin`), and the diagnosis of standalone lists (`--diagnose-lists`). Every "
        "figure below is on the SCORE split, which none of them saw (it was re-scored after each change to see "
        "where things stood, never to choose). Median / p90 |error| in %. Views after n "
        "baselines are baseline + delta, the delta being one whole agent step (ask, tool call, tool output, "
        "answer: about a third of the view after 2 baselines). Lists: "
        f"{LIST_SLICES} random slices of each session's messages per baseline count ({10 * LIST_SLICES} per cell; "
        "before 2026-12-01 round 4 one slice, so a p90 of 10 values), each priced alone. 'over est+margin': views "
        "(of the 2- and 8-baseline ones, 20 per row) whose real count exceeded estimate + margin, the margin "
        "coming from the per-feature cold margins and the residuals recorded with each earlier baseline. The "
        "real-file sources are whatever the machine has installed, so figures move a little between machines "
        "(and runs, as packages are installed).\n\n"
        "Where standalone lists lose (`--diagnose-lists`, FIT split): not a per-message or per-role constant. "
        "Priced alone with the prior, every kind of message is centred (signed median error within about 2% "
        "for user, assistant and tool-output messages; tool-call messages within 0.2%), but one tool output is "
        "3-4% off at the median and 8-11% at p90 (Cyrillic/CJK 4-9% / 13-18%), a short assistant excerpt 3-6% / "
        "9-15%: the text's own variation around its price, which a view averages over a dozen messages and a "
        "list of one or two does not (lists of 1-2 messages: p90 about 10.5%; 6 or more: 5.5%). What the "
        "baselines added was the per-message and per-tool-call prices moving by up to 15% on that noise, which "
        "a list of short messages (mostly framing) felt in full: the overheads' spread is now 0.3x "
        "(`--tune-fit`: lists median 2.98% -> 2.63% on average over the held-out categories of the fit split). "
        "Splitting Cyrillic into per-word and per-letter features was tried and did not help (the prototype's "
        "per-message errors were printed on both splits; it was dropped).\n\n"
        + ROUND6
        + "\n\n"
        + ROUND7
        + "\n\n"
        + ROUND8
        + "\n\n"
        + SOURCES_TABLE
        + "\n\n"
        "### Estimates (views: baseline + delta after n baselines; lists: a random slice priced alone)\n\n"
        f"{table}\n\n### Cross-category: median error change (points) after 2 baselines of one category\n\n"
        f"{cross}\n\n### Verdicts\n\n"
        + "\n".join(verdicts)
        + "\n\n### Prior (tokens per size unit, fit split)\n\n"
        + prior_table()
        + "\n"
    )
    # Only this section: "## Fidelity: concurrent soak" (soak.py) and the others are kept.
    this = r"## Fidelity \(`bench/fidelity/`\).*?(?=\n## |\Z)"
    if re.search(this, text, flags=re.S):
        # The fact-recall subsection (bench/fidelity/recall.py --record) sits under Fidelity: kept.
        old = re.search(this, text, flags=re.S)
        recall = re.search(r"### Fact recall.*", old.group(0), flags=re.S) if old else None
        if recall:
            section += "\n" + recall.group(0).rstrip("\n") + "\n"
        text = re.sub(this, lambda _: section, text, count=1, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)


#: What round 8 measured and changed (kept in the section).
ROUND8 = (
    "Round 8 (issue 14, 2026-12-02, wip/fid8): (a) where the Cyrillic/CJK error comes from (FIT split, "
    "`--diagnose-cjk`): the category's tool outputs priced after 2 baselines, 100 per tokenizer, are 55 "
    "Cyrillic, 22 Japanese (kana), 15 Chinese (Han), 8 Korean. Median |error| of one output before the change "
    "below, o200k / cl100k / Llama 3 / Claude: Cyrillic 3.3 / 4.5 / 2.3 / 4.1%, Han 2.0 / 4.4 / 3.1 / 2.9%, kana "
    "2.3 / 2.3 / 2.6 / 3.4%, hangul 4.0 / 3.1 / 3.4 / 3.2%; after it: Cyrillic 3.1 / 4.9 / 2.4 / 4.0%, Han 3.4 / "
    "3.0 / 2.7 / 2.4%, kana 1.7 / 2.3 / 2.4 / 3.2%, hangul 3.2 / 2.9 / 2.9 / 2.5% (15 and 8 outputs: noisy). Most "
    "of the error is Cyrillic, which this change does not touch; a 2-baseline cell is 10 views. (b) Kept: Han, "
    "kana and hangul priced per character by a table read off the vocabularies (`python "
    "bench/tokens/cjk_costs.py` writes core/_cjk_costs.py: every code point of the unified ideographs, kana and "
    "hangul syllables counted alone by the four tokenizers, the mean kept as a level; no corpus text involved), "
    "`cjk_table_scale` 0.9 (a unit convention: tokens per unit stay 0.3-0.6), prior refitted (`--fit-prior`). "
    "On FIT, the 39 tool outputs at least 30% East Asian, the three class weights fitted leave-one-out "
    "(`--diagnose-cjk`): median / p90 |error| with one price per character 3.6 / 8.2, 4.6 / 8.0, 3.0 / 7.6, "
    "4.1 / 14.3 -> with the table 3.2 / 7.1, 3.0 / 6.0, 2.7 / 6.8, 4.2 / 11.4; this protocol on FIT (`--fit`): "
    "cells met 16 -> 18 (gpt-4 Cyrillic/CJK 2.1 / 3.2 -> 1.3 / 3.1, Claude 1.5 / 6.3 -> 1.3 / 4.8, gpt-4o 1.4 / "
    "3.3 -> 1.2 / 3.1 with its list p90 10.7 -> 10.2 still over); cold margins narrower (Han: o200k 0.195 -> "
    "0.093, cl100k 0.406 -> 0.202, Claude 0.562 -> 0.310; overall o200k 0.145 -> 0.123, Claude 0.245 -> 0.199); "
    "`--unknown --fit`: 0 / 0 of 480 over estimate + margin, margin 4.7 -> 4.3% of the view. SCORE (A/B with "
    "main's tree in the same window): 21 -> 21 of 24 met; Cyrillic/CJK views gpt-4o 1.8 / 3.0 -> 2.0 / 3.0, "
    "gpt-4 2.2 / 3.5 -> 2.1 / 3.6 (both still over 1.5%), cold 3.7 / 5.0 / 3.8 / 5.1 -> 3.7 / 4.3 / 3.4 / 5.0, "
    "mixed cold medians 1.8 / 2.0 / 1.9 / 1.9 -> 1.5 / 1.7 / 1.5 / 2.0, 'over est+margin' unchanged; Claude JSON "
    "1.1 / 5.8 -> 1.1 / 5.9 (no idea tried for it this round). SCORE was run twice for this idea: first with "
    "`cjk_table_scale` 0.5 (the same table, units half as large; FIT 18 cells too): 21 met, cold Cyrillic/CJK "
    "4.1 / 5.2 / 4.3 / 5.6; the scale went to 0.9 for the unit convention (a sizing unit test of tokens per unit "
    "failed at 0.5), not on those figures. bench/tokens/run.py accuracy tables: identical (its corpus has no "
    "East Asian text). (c) Margins (engine): residuals are now relative to `margin_base` and anchored views' "
    "margins cover it; this bench computes them the same way (the cells do not depend on margins; 'over "
    "est+margin' unchanged)."
)

#: What round 7 measured and changed (kept in the section).
ROUND7 = (
    "Round 7 (issue 14, 2026-12-01): (a) **a model of no known family** (`default` prior) now starts the "
    "margin of a feature its baselines showed from the prior's `fitted_margins` (`--fit-prior`, FIT split, leave "
    "one category out: how far a new step ran over its price after 1-8 baselines of such a model; word 0.201 "
    "against 0.281 cold, whitespace 0.300 / 0.392, Cyrillic 0.303 / 0.433, per message 0.262 / 0.347; Han, kana, "
    "hangul unchanged), blended by `evidence`; the table above is unchanged by it (its four models have known "
    "families). `python bench/fidelity/run.py --unknown` prices every tokenizer as such a model, views after 2 and "
    "8 baselines (480): FIT split (`--fit`) over estimate + margin 0 with the fitted margins / 0 with the cold "
    "ones, margin of the delta median 23.7% / 27.3%, of the view 4.7% / 5.3%; SCORE split 5 / 4 (claude mixed 2 "
    "/ 1), 23.9% / 27.5%, 4.6% / 5.3%. The same model with `margin_prior_weight` 8 / 4 / 2 instead of 16 (FIT, "
    "steps after 1-9 baselines, 2,160): over 8 / 13 / 33 against 7, so the weight stays. (b) Truncation: a "
    "view's images now carry 0.7 of their rule price in the floor (engine/views.py; no image is in this corpus, "
    "so 'refused' and 'cut caught' are unchanged). (c) 2-baseline cells: the Cyrillic/CJK classes' spread "
    "(KNOWN_SIGMA 0.1) at 0.25x / 0.5x / 1x / 2x / 3x on the FIT split, this protocol: cells met 18 / 18 / 16 / "
    "16 / 16 (0.5x: gpt-4 Cyrillic/CJK median 2.1 -> 1.0%, Claude's p90 6.3 -> 4.6%; list medians +0.3 to +0.6 "
    "points). Scored once on SCORE: 21 / 24 met either way (gpt-4o 1.8 / 3.0 and gpt-4 2.2 / 3.5 unchanged, "
    "Claude Cyrillic/CJK p90 3.0 -> 2.4%), list medians worse (gpt-4 Cyrillic/CJK 2.5 -> 3.5%, Llama 1.8 -> 2.3%): "
    "not kept (this choice of the status quo was made after seeing SCORE; no rule was chosen on it). The corpus "
    "drifted since round 6 with the installed packages (english, json and mixed rows differ at 0.1-0.4 points; "
    "Claude JSON views 1.4 / 5.7 -> 1.1 / 5.8, its list cell 4.1 / 10.7 -> 2.9 / 9.5, now met)."
)

#: What round 6 changed for the 2-baseline cells, and on what it was chosen (kept in the section).
ROUND6 = (
    "Round 6 (2-baseline cells, issue 14): the size units of `core/sizing.py`, chosen on the FIT split only. "
    "How: every distinct piece of the fit texts counted alone by the tokenizers (o200k, cl100k and Llama 3 "
    "split text into exactly these pieces) and compared with its price by piece shape; each candidate rule "
    "then checked by a split-half run on the fit split (prior fitted on sessions 0, 2, 4, ..., step errors "
    "of the others) and by this bench's protocol on the fit split (prior refitted with `--fit-prior`); the "
    "SCORE split was scored once after each kept change. Kept: (1) a Cyrillic word with letters outside the "
    "Russian alphabet (Ukrainian, Belarusian, Serbian) costs 1.45x: on the fit split Ukrainian catalogues "
    "ran +5 to +16% over their price and Russian ones -3 to -8%; (2) `:`, `+`, `~`, `=` before letters cost a "
    "whole token (`:amd64`, `+dfsg`, `~deb12u1`: 1.0 extra on every vocabulary, against 0.5 priced); "
    "(3) ASCII words cost 0.15 (was 0.2) per letter past 6: words of 8-13 letters in prose, code and JSON "
    "ran 0.6-0.85x their price; (4) a Cyrillic word not right after a space (after a line break, a digit, "
    "punctuation) or with a capital costs 1.45x: lower-case words after a space ran 0.67x the tokens per "
    "unit of all others (o200k; the other vocabularies alike); a text's first word is priced as after a "
    "space so that more text never costs less. Fit split, this protocol, 2-baseline cells met: 13 before, "
    "14 after (1)+(2), 16 after (3), 16 after (4) (which cut the cold, p90 and list errors of Cyrillic/CJK "
    "and mixed). Score split: 12 before, 16 after (1)+(2), 19 after (3), 21 after (4). Tried and dropped on "
    "the fit split: a session-local correction of the delta (a session's earlier steps do not predict its "
    "next one: the correlation of consecutive steps' residuals was -0.47 to +0.35, mostly near 0, as the "
    "corpus draws each step from another text); a per-role per-message overhead (split-half step errors "
    "no better: English 2.9 -> 3.0%, Cyrillic/CJK 4.5 -> 4.7%); a Cyrillic word without a leading space "
    "dearer even at a text's start (it helped, but a space put in front made the text cheaper: replaced "
    "by (4)); a capital-only Cyrillic rule (mixed on the fit split: dropped for (4))."
)


SOURCES_TABLE = "\n".join(
    line for line in (__import__("fidelity_corpus").__doc__ or "").splitlines() if line.startswith("|")
)


def prior_table() -> str:
    from contextsvc.core.priors import PRIORS

    rows = ["| family | " + " | ".join(FEATURES) + " | cold margin |", "|---" * (len(FEATURES) + 2) + "|"]
    for fam, p in PRIORS.items():
        rows.append(f"| {fam} | " + " | ".join(f"{w:.3f}" for w in p.weights) + f" | {p.cold_margin:.3f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit-prior", action="store_true")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--tune-margin", action="store_true")
    ap.add_argument("--tune-fit", action="store_true")
    ap.add_argument("--diagnose-lists", action="store_true")
    ap.add_argument("--diagnose-cjk", action="store_true", help="FIT split: where the Cyrillic/CJK error comes from")
    ap.add_argument("--diagnose-cyrillic", action="store_true", help="FIT split: why Cyrillic views miss")
    ap.add_argument("--diagnose-json", action="store_true", help="FIT split: the tail of JSON views, identifiers")
    ap.add_argument("--split-half", action="store_true", help="FIT split: feature variants, split-half")
    ap.add_argument("--unknown", action="store_true", help="a model of no known family (FIT split with --fit)")
    ap.add_argument("--fit", action="store_true", help="score (or --unknown) on the FIT split: for choosing rules")
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    ensure_node_deps()
    fit_only = (
        args.fit_prior
        or args.tune_margin
        or args.tune_fit
        or args.diagnose_lists
        or args.diagnose_cjk
        or args.diagnose_cyrillic
        or args.diagnose_json
        or args.split_half
    )
    split = "fit" if fit_only else "score"
    if args.fit:
        if args.record:
            ap.error("--record writes the SCORE split's tables; --fit is for choosing rules")
        split = "fit"
    print(f"split: {split}")
    counted = count_sessions(sessions(split, count=args.sessions, steps=args.steps))
    if args.unknown:
        print(unknown_table(counted))
        return
    if args.tune_margin:
        tune_margin(counted)
        return
    if args.diagnose_cjk:
        diagnose_cjk(counted)
        return
    if args.diagnose_cyrillic:
        diagnose_cyrillic(counted)
        return
    if args.diagnose_json:
        diagnose_json(counted)
        return
    if args.split_half:
        split_half(counted)
        return
    if args.diagnose_lists:
        diagnose_lists(counted)
        return
    if args.tune_fit:
        tune_fit(counted)
        return
    if args.fit_prior:
        block = fit_prior(counted)
        write_prior(block)
        print(block)
        return
    table, cross, verdicts = score(counted)
    print(table, cross, "\n".join(verdicts), sep="\n\n")
    if args.record:
        record(table, cross, verdicts, "python bench/fidelity/run.py --record")


if __name__ == "__main__":
    main()
