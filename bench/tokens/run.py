"""Token-accuracy benchmark: our estimates against real tokenizers, offline.

    python bench/tokens/run.py            # print the tables
    python bench/tokens/run.py --record   # and write them into bench/RESULTS.md (## Token accuracy)

On first run it installs the pinned npm tokenizers into bench/tokens/node_modules. It generates
a deterministic corpus (corpus.py), counts the real prompt tokens of every view with each
tokenizer (count.mjs), then replays each session as an agent would: every model call reports
its real count as a baseline (fed through contextsvc.core.calibration), and the next view is
estimated the way the service does it. Errors are |estimate - real| / real.

Two measures are replayed in the same run: raw characters (the service before
contextsvc.core.sizing; "before") and size units (what the service fits on now; "after").
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

from corpus import KINDS, Session, cyrillic, english, json_output, python_code, sessions  # noqa: E402

from contextsvc.config import TokenSettings  # noqa: E402
from contextsvc.core import sizing  # noqa: E402
from contextsvc.core.messages import Message, Role  # noqa: E402
from contextsvc.core.tokens import (  # noqa: E402
    Baseline,
    EstimateMethod,
    TextCounter,
    estimate,
    message_budget,
    messages_chars,
    messages_size,
    text_chars,
)
from contextsvc.core.view_budget import truncate_view  # noqa: E402

TOKENIZERS = ("o200k", "cl100k", "llama3", "claude")
BASELINES = (0, 1, 2, 8)
#: Special tokens of a ChatML-like template that are not in the rendered text:
#: <|im_start|> before a message, <|im_end|> and a newline after it.
FRAME_PER_MESSAGE = 3
#: The reply primer ``<|im_start|>assistant\n``.
FRAME_PER_PROMPT = 3
WINDOW = 1_000_000  # large enough that no other rule (truncation, guard) interferes
TARGET = 0.03
MEASURES = ("chars", "size")


def ensure_node_deps() -> None:
    """Install the pinned tokenizers on first run (npm ci when the lock file is there)."""
    if all((HERE / "node_modules" / p).exists() for p in ("gpt-tokenizer", "llama3-tokenizer-js", "@anthropic-ai")):
        return
    npm = shutil.which("npm")
    if npm is None:
        sys.exit("npm is required (Node.js 18+) to install the reference tokenizers")
    verb = "ci" if (HERE / "package-lock.json").exists() else "install"
    print(f"installing tokenizers: npm {verb} in {HERE}", file=sys.stderr)
    subprocess.run([npm, verb, "--no-audit", "--no-fund"], cwd=HERE, check=True)


def write_generated(out: Path, text: str, *, check: bool) -> None:
    """Write a generated module of the package, or with ``check`` fail if it differs from ``text``."""
    shown = out.relative_to(HERE.parents[1])
    if check:
        if out.read_text(encoding="utf-8") != text:
            sys.exit(f"{shown} differs from what the vocabularies give; rerun without --check")
        print("ok")
        return
    out.write_text(text, encoding="utf-8")
    print(f"wrote {shown} ({len(text):,} bytes)")


def render(m: Message) -> str:
    """The text a ChatML-style template puts between <|im_start|> and <|im_end|>."""
    body: list[str] = []
    if m.thinking:
        body.append(f"<think>\n{m.thinking}\n</think>\n")
    if m.role is Role.TOOL:
        body.append(f"<tool_response>\n{m.content}\n</tool_response>")
    elif m.content:
        body.append(m.content)
    for call in m.tool_calls:
        payload = f'{{"id": "{call.id}", "name": "{call.name}", "arguments": {call.arguments_json}}}'
        body.append(f"<tool_call>\n{payload}\n</tool_call>")
    return f"{m.role.value}\n" + "\n".join(body)


def count_real(texts: list[str]) -> dict[str, list[int]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "texts.json"
        path.write_text(json.dumps(texts), encoding="utf-8")
        out = subprocess.run(
            ["node", str(HERE / "count.mjs"), str(path)], cwd=HERE, check=True, capture_output=True, text=True
        )
    counts: dict[str, list[int]] = json.loads(out.stdout)
    return counts


# --- the service before sizing: a line over raw characters ----------------------------------


@dataclass(slots=True, frozen=True)
class Observation:
    chars: int
    tokens: int


@dataclass(slots=True, frozen=True)
class Calibration:
    """The first version's calibration, kept here to replay it: one line ``overhead + x * slope``
    over a measure (raw characters, or size units). The service now fits content-class features
    (core/calibration.py; measured by bench/fidelity)."""

    overhead: float
    tokens_per_char: float
    fitted: bool

    def estimate_delta(self, chars: int) -> int:
        return max(0, round(chars * self.tokens_per_char))


def fit(observations: list[Observation], settings: TokenSettings) -> Calibration:
    """Least squares over the newest 8 observations, 1.25x spread, slope in [0.25, 1.0], else size/1.8."""
    fallback = Calibration(0.0, 1 / 1.8, fitted=False)
    usable = [o for o in observations if o.chars > 0 and o.tokens > 0][-8:]
    if len(usable) < 2:
        return fallback
    xs, ys = [float(o.chars) for o in usable], [float(o.tokens) for o in usable]
    if max(xs) < 1.25 * min(xs):
        return fallback
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    if not 0.25 <= slope <= 1.0:
        return fallback
    return Calibration(my - slope * mx, slope, fitted=True)


@dataclass(slots=True, frozen=True)
class SizeLineCounter:
    """The first version's line over size units (what the service fitted before content classes)."""

    calibration: Calibration

    @property
    def method(self) -> EstimateMethod:
        return EstimateMethod.CALIBRATED if self.calibration.fitted else EstimateMethod.FALLBACK

    @property
    def overhead(self) -> int:
        return round(self.calibration.overhead)

    @property
    def margin_rate(self) -> float:
        return 0.0

    def count_text(self, text: str) -> int:
        return self.calibration.estimate_delta(sizing.text_size(text))

    def count_messages(self, messages: Iterable[Message]) -> int:
        return self.calibration.estimate_delta(messages_size(messages))

    def count_and_margin(self, messages: Sequence[Message]) -> tuple[int, float]:
        return self.count_messages(messages), 0.0


@dataclass(slots=True, frozen=True)
class RawCharCounter:
    """The calibrated counter as it was before ``contextsvc.core.sizing``: the same line, fitted
    and applied over plain characters of the same message parts (no framing allowance)."""

    calibration: Calibration

    @property
    def margin_rate(self) -> float:
        return 0.0

    @property
    def method(self) -> EstimateMethod:
        return EstimateMethod.CALIBRATED if self.calibration.fitted else EstimateMethod.FALLBACK

    @property
    def overhead(self) -> int:
        return round(self.calibration.overhead)

    def count_text(self, text: str) -> int:
        return self.calibration.estimate_delta(len(text))

    def count_messages(self, messages: Iterable[Message]) -> int:
        return self.calibration.estimate_delta(sum(text_chars(m) for m in messages))

    def count_and_margin(self, messages: Sequence[Message]) -> tuple[int, float]:
        return self.count_messages(messages), 0.0


def counter(measure: str, calibration: Calibration) -> TextCounter:
    return RawCharCounter(calibration) if measure == "chars" else SizeLineCounter(calibration)


# --- views -----------------------------------------------------------------------------------


@dataclass
class View:
    messages: list[Message]  # numbered, oldest first
    chars: int  # plain characters (system prompt + message parts): the old measure
    size: int  # size units of the system prompt message and the messages: the new measure
    real: dict[str, int]  # tokenizer -> real prompt tokens

    def x(self, measure: str) -> int:
        return self.chars if measure == "chars" else self.size


def build_views(all_sessions: list[Session], counts: dict[str, list[int]], idx: dict[str, int]) -> list[list[View]]:
    """Number the messages and sum each view's real tokens from per-text counts."""
    out: list[list[View]] = []
    for s in all_sessions:
        seq = 0
        msgs: list[Message] = []
        real = {t: counts[t][idx[f"system\n{s.system}"]] + FRAME_PER_MESSAGE + FRAME_PER_PROMPT for t in TOKENIZERS}
        # What the engine records for a view: the size of its rows, the system prompt row included.
        chars = len(s.system)
        size = messages_size([Message(role=Role.SYSTEM, content=s.system)])
        views: list[View] = []
        for step in s.steps:
            for m in step:
                seq += 1
                msgs.append(replace(m, sequence_number=seq))
                chars += text_chars(m)
                size += messages_size([m])
                for t in TOKENIZERS:
                    real[t] += counts[t][idx[render(m)]] + FRAME_PER_MESSAGE
            views.append(View(list(msgs), chars, size, dict(real)))
        out.append(views)
    return out


def session_texts(all_sessions: list[Session]) -> list[str]:
    texts = []
    for s in all_sessions:
        texts.append(f"system\n{s.system}")
        texts += [render(m) for step in s.steps for m in step]
    return texts


# --- the replay ------------------------------------------------------------------------------


def err(est: float, real: int) -> float:
    return abs(est - real) / real


def simulate(system: str, views: list[View], tokenizer: str, settings: TokenSettings, measure: str) -> dict[str, float]:
    """Errors of one session, as a fresh model would see it (no earlier calibration)."""
    res: dict[str, float] = {}
    for n in BASELINES:
        if n >= len(views):
            continue
        target = views[n]
        obs = [Observation(v.x(measure), v.real[tokenizer]) for v in views[:n]]
        c = counter(measure, fit(obs, settings))
        line = estimate(counter=c, window=WINDOW, reserve=0, system=system, context=target.messages).total
        res[f"line{n}"] = err(line, target.real[tokenizer])
        if n == 0:
            res[f"delta{n}"] = res[f"line{n}"]  # nothing to anchor on yet
            continue
        prev = views[n - 1]
        base = Baseline(prev.real[tokenizer], prev.messages[-1].sequence_number)
        total = estimate(
            counter=c, window=WINDOW, reserve=0, system=system, context=target.messages, baseline=base
        ).total
        res[f"delta{n}"] = err(total, target.real[tokenizer])
    return res


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return 100 * (values[lo] + (values[hi] - values[lo]) * (k - lo))


def cell(values: list[float]) -> str:
    return f"{pct(values, 0.5):.1f} / {pct(values, 0.9):.1f}"


def accuracy_tables(
    views_by_kind: dict[str, list[tuple[Session, list[View]]]], settings: TokenSettings
) -> tuple[str, str, list[str]]:
    """The before/after table, the detail table of the new measure, and the verdicts."""
    head1 = (
        "| tokenizer | text | tok/char | tok/unit | chars/4 | chars/1.8 | size/1.8 "
        "| before: 2 baselines | before: 8 | after: 2 baselines | after: 8 |"
    )
    head2 = "| tokenizer | text | 0 baselines | 1 baseline | 2 | 8 | line only, 2 | line only, 8 |"
    rows1, rows2, verdicts = [head1, "|---" * 11 + "|"], [head2, "|---" * 8 + "|"], []
    for t in TOKENIZERS:
        for k in KINDS:
            cols: dict[str, list[float]] = {}
            per_char, per_unit = [], []
            for s, vs in views_by_kind[k]:
                for measure in MEASURES:
                    for name, e in simulate(s.system, vs, t, settings, measure).items():
                        cols.setdefault(f"{measure}:{name}", []).append(e)
                for v in vs:  # the static heuristics, over every view of the session
                    cols.setdefault("c4", []).append(err(v.chars / 4, v.real[t]))
                    cols.setdefault("c18", []).append(err(v.chars / 1.8, v.real[t]))
                    cols.setdefault("s18", []).append(err(v.size / 1.8, v.real[t]))
                    per_char.append(v.real[t] / v.chars)
                    per_unit.append(v.real[t] / v.size)
            ratios = f"{statistics.median(per_char):.3f} | {statistics.median(per_unit):.3f}"
            before = [cell(cols[f"chars:{n}"]) for n in ("delta2", "delta8")]
            after = [cell(cols[f"size:{n}"]) for n in ("delta2", "delta8")]
            static = [cell(cols[n]) for n in ("c4", "c18", "s18")]
            rows1.append(f"| {t} | {k} | {ratios} | " + " | ".join([*static, *before, *after]) + " |")
            detail = [cell(cols[f"size:{n}"]) for n in ("delta0", "delta1", "delta2", "delta8", "line2", "line8")]
            rows2.append(f"| {t} | {k} | " + " | ".join(detail) + " |")
            if k == "mixed":
                old, new = (pct(cols[f"{m}:delta2"], 0.5) / 100 for m in MEASURES)
                verdict = "met" if new <= TARGET else "NOT met"
                verdicts.append(
                    f"- {t}: median {100 * new:.1f}% after 2 baselines (raw chars: {100 * old:.1f}%): {verdict}"
                )
    return "\n".join(rows1), "\n".join(rows2), verdicts


# --- real text found on this machine ---------------------------------------------------------

_STDLIB = sysconfig.get_paths()["stdlib"]
# Real text that every machine running this benchmark has: the Python standard library and the
# benchmark's own npm packages. Add files of other kinds with --real-file KIND=GLOB.
REAL_FILES: dict[str, tuple[str, ...]] = {
    "english": (f"{_STDLIB}/LICENSE.txt",),
    "code": (f"{_STDLIB}/argparse.py", f"{_STDLIB}/dataclasses.py", f"{_STDLIB}/asyncio/streams.py"),
    "json": (str(HERE / "package-lock.json"), str(HERE / "node_modules/*/package.json")),
}
REAL_CHUNK = 4000
REAL_CHUNKS_PER_KIND = 24


def real_chunks() -> dict[str, tuple[list[str], list[str]]]:
    """Per kind: chunks of up to REAL_CHUNK chars from the files present, and the files used."""
    out: dict[str, tuple[list[str], list[str]]] = {}
    for kind, patterns in REAL_FILES.items():
        files = sorted({p for pattern in patterns for p in glob.glob(pattern)})
        texts = []
        for path in files:
            try:
                texts.append(Path(path).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError):
                continue
        chunks = [t[i : i + REAL_CHUNK] for t in texts for i in range(0, len(t), REAL_CHUNK)]
        chunks = [c for c in chunks if len(c) >= REAL_CHUNK // 2]
        if chunks:
            random.Random(kind).shuffle(chunks)
            out[kind] = (chunks[:REAL_CHUNKS_PER_KIND], files)
    return out


def real_table(
    chunks: dict[str, tuple[list[str], list[str]]], counts: dict[str, list[int]], idx: dict[str, int]
) -> str:
    """tokens/char and tokens/unit per kind and tokenizer, and their spread across kinds."""
    head = "| text | files | " + " | ".join(f"{t} tok/char / tok/unit" for t in TOKENIZERS) + " |"
    rows = [head, "|---" * (2 + len(TOKENIZERS)) + "|"]
    ratios: dict[str, dict[str, tuple[float, float]]] = {}
    for kind, (texts, files) in chunks.items():
        cells = []
        for t in TOKENIZERS:
            per_char = statistics.median(counts[t][idx[x]] / len(x) for x in texts)
            per_unit = statistics.median(counts[t][idx[x]] / sizing.text_size(x) for x in texts)
            ratios.setdefault(t, {})[kind] = (per_char, per_unit)
            cells.append(f"{per_char:.3f} / {per_unit:.3f}")
        rows.append(f"| {kind} | {len(files)} | " + " | ".join(cells) + " |")
    spread = []
    for t in TOKENIZERS:
        latin = [v for k, v in ratios.get(t, {}).items() if k in ("english", "code", "json")]
        if latin:
            c = max(r[0] for r in latin) / min(r[0] for r in latin)
            u = max(r[1] for r in latin) / min(r[1] for r in latin)
            spread.append(f"{c:.2f}x / {u:.2f}x")
        else:
            spread.append("-")
    rows.append("| max/min over english, code, json | | " + " | ".join(spread) + " |")
    return "\n".join(rows)


# --- what the measure costs ------------------------------------------------------------------


def best_ms(fn: Callable[[], object], repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return 1000 * best


def size_cost_row(kind: str, text: str) -> str:
    """Milliseconds to size one megabyte of ``text``: cold, new text, and memoized."""

    def cold() -> None:
        sizing.clear_caches()
        sizing.text_size(text)

    def fresh() -> None:
        sizing.clear_caches(pieces=False)  # a text never seen: split again, pieces priced from cache
        sizing.text_size(text)

    def again() -> None:
        sizing.text_size(text)

    n = len(sizing.pieces(text))
    return (
        f"| {kind} | {n:,} | {sizing.text_size(text) / len(text):.2f} | {best_ms(cold, 3):.1f} ms "
        f"| {best_ms(fresh):.1f} ms | {best_ms(again):.3f} ms |"
    )


def cost_tables(mixed: list[tuple[Session, list[View]]]) -> str:
    """Sizing speed per MB by kind, and the token accounting of one 200-message view."""
    rng = random.Random(7)
    gen = {"english": english, "code": python_code, "json": json_output, "cyrillic": cyrillic}
    rows = [
        "| text (1 MB) | pieces | units/char | size, cold | size, new text | size, same text again |",
        "|---|---|---|---|---|---|",
    ]
    for kind, f in gen.items():
        rows.append(size_cost_row(kind, "".join(f(rng, 5000) for _ in range(230))[:1_000_000]))

    # A 200-message view, as BuildContext accounts for it: cut oversized messages, estimate by
    # segment, record the view's size for the next baseline.
    msgs = [m for _, vs in mixed for m in vs[-1].messages][:200]
    msgs = [replace(m, sequence_number=i + 1) for i, m in enumerate(msgs)]
    chars = sum(text_chars(m) for m in msgs)
    line = fit([Observation(10_000, 5_000), Observation(20_000, 10_000)], TokenSettings())
    budget = message_budget(128_000, 0)

    def build(c: TextCounter, measure: str) -> None:
        view = truncate_view(msgs, budget, c)
        estimate(counter=c, window=128_000, reserve=2048, system="You are an agent.", context=view)
        if measure == "size":
            messages_chars(view)
        else:
            sum(text_chars(m) for m in view)

    old = best_ms(lambda: build(RawCharCounter(line), "chars"))

    def cold_build() -> None:
        sizing.clear_caches()
        build(SizeLineCounter(line), "size")

    cold_ms = best_ms(cold_build, 3)
    build(SizeLineCounter(line), "size")
    warm = best_ms(lambda: build(SizeLineCounter(line), "size"))
    rows += [
        "",
        f"Token accounting of one 200-message view ({chars:,} chars of mixed agent turns), as BuildContext does it "
        "(per-message cut check, segment estimate, view size for the baseline):",
        "",
        "| measure | per build |",
        "|---|---|",
        f"| raw chars (before) | {old:.2f} ms |",
        f"| size units, cold (first build after a restart) | {cold_ms:.2f} ms |",
        f"| size units, warm (the same messages rebuilt next turn) | {warm:.2f} ms |",
    ]
    return "\n".join(rows)


# --- main ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=40, help="sessions per text kind (default 40)")
    parser.add_argument("--steps", type=int, default=12, help="model calls per session (default 12)")
    parser.add_argument("--record", action="store_true", help="write the tables into bench/RESULTS.md")
    parser.add_argument(
        "--real-file",
        action="append",
        default=[],
        metavar="KIND=GLOB",
        help="also measure real files of a kind (e.g. cyrillic=some/dir/*.txt); repeatable",
    )
    args = parser.parse_args()
    for spec in args.real_file:
        kind, sep, pattern = spec.partition("=")
        if not sep or not kind or not pattern:
            parser.error(f"--real-file wants KIND=GLOB, got {spec!r}")
        REAL_FILES[kind] = (*REAL_FILES.get(kind, ()), pattern)

    ensure_node_deps()
    settings = TokenSettings()
    by_kind = {k: sessions(k, args.sessions, args.steps) for k in KINDS}
    flat = [s for k in KINDS for s in by_kind[k]]
    chunks = real_chunks()

    texts: dict[str, int] = {}
    for text in [*session_texts(flat), *(c for cs, _ in chunks.values() for c in cs)]:
        texts.setdefault(text, len(texts))
    started = time.perf_counter()
    counts = count_real(list(texts))
    print(
        f"counted {len(texts)} texts ({sum(map(len, texts)):,} chars) in {time.perf_counter() - started:.1f}s",
        file=sys.stderr,
    )

    views = build_views(flat, counts, texts)
    views_by_kind: dict[str, list[tuple[Session, list[View]]]] = {k: [] for k in KINDS}
    for s, v in zip(flat, views, strict=True):
        views_by_kind[s.kind].append((s, v))

    table, detail, verdicts = accuracy_tables(views_by_kind, settings)
    real = real_table(chunks, counts, texts)
    cost = cost_tables(views_by_kind["mixed"])
    print(table)
    print("\nTarget (mixed agent turns, median |error| <= 3% after 2 baselines):")
    print("\n".join(verdicts))
    print("\nSize units, every column:\n")
    print(detail)
    print("\nReal text (files found on this machine):\n")
    print(real)
    print("\nCost of the measure:\n")
    print(cost)
    if args.record:
        record(table, verdicts, detail, real, cost, args)


FINDINGS = (
    "How to read it:",
    "",
    "- `tok/char` is what a line over raw characters had to follow: ~0.19 for English prose, 0.25 for code, 0.35 "
    "for JSON, 0.24-0.50 for Cyrillic by vocabulary. Below the 0.25 slope floor (DESIGN §5.3), prose fits were "
    "rejected and fell back to chars/1.8 (2-3x too high), and a line learned on one kind mispriced the next "
    "(`before` columns).",
    "- `tok/unit` is the same real count per size unit (`contextsvc/core/sizing.py`: text split like a BPE "
    "pre-tokenizer, each piece priced by class and length, ~half a token each, plus a framing allowance per "
    "message and per tool call). English, code and JSON sit within a few percent of each other on every "
    "vocabulary, so one slope fits all of them, the slope is mid-range in [0.25, 1.0], and `size/1.8` is a "
    "usable fallback.",
    "- What remains is Cyrillic (and CJK, not in the corpus): the vocabularies disagree ~2x on it (o200k and "
    "Llama 3 have many Cyrillic merges, cl100k and the old Claude vocabulary few), so no tokenizer-free measure "
    "fits all four; the weights price it in the middle (about 0.7x-1.45x of the Latin density per vocabulary). "
    "Most of the remaining error after 2 baselines in mixed sessions is a slope learned on a Latin-script step "
    "applied to a Cyrillic one (or the reverse); it fades as baselines accumulate (`after: 8`).",
    "- The real-text table checks the measure on natural text (the synthetic word lists are all common words; "
    "real text has rarer, longer words, hashes, CamelCase). Most of these files were among those the weights "
    "were read from, so it shows the weights hold on natural text; it is not a blind test.",
)


def record(table: str, verdicts: list[str], detail: str, real: str, cost: str, args: argparse.Namespace) -> None:
    path = HERE.parent / "RESULTS.md"
    cmd = "python bench/tokens/run.py --record"
    if (args.sessions, args.steps) != (40, 12):
        cmd += f" --sessions {args.sessions} --steps {args.steps}"
    node = subprocess.run(["node", "--version"], capture_output=True, text=True, check=False).stdout.strip()
    section = "\n".join(
        [
            "## Token accuracy",
            "",
            f"- date: {dt.date.today().isoformat()}; machine: {os.cpu_count()} cores (nproc), "
            f"Python {platform.python_version()}, Node {node}, {platform.system()} {platform.machine()}",
            f"- command: `{cmd}`",
            f"- corpus: {args.sessions} sessions x {args.steps} model calls per text kind, generated from a fixed seed",
            "- cells: median / p90 of |estimate - real| / real, in %. `before`: the calibration line fitted on raw "
            "characters (the service before `contextsvc/core/sizing.py`); `after`: fitted on size units (now). "
            "`N baselines`: the estimate of the next view after N real counts (baseline + calibrated delta); "
            "`line only`: the fitted line over the whole view (used once compression clears the baseline). "
            "`chars/4`, `chars/1.8`, `size/1.8`: static heuristics over every view. `tok/char`, `tok/unit`: median "
            "real tokens per character / per size unit of the views.",
            "",
            table,
            "",
            "Target: median |error| <= 3% after 2 baselines on mixed agent turns:",
            *verdicts,
            "",
            "Size units, every column (same run):",
            "",
            detail,
            "",
            *FINDINGS,
            "",
            "Real text (files found on this machine, chunks of 4,000 chars; median per chunk):",
            "",
            real,
            "",
            "Cost of the measure (best of several runs; `cold`: no cached piece prices; `new text`: a text never "
            "measured, pieces priced from cache; `same text again`: memoized):",
            "",
            cost,
            "",
        ]
    )
    old = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n\n"
    pattern = re.compile(r"## Token accuracy\n.*?(?=\n## |\Z)", re.S)
    new = (
        pattern.sub(lambda _: section.rstrip("\n") + "\n", old)
        if pattern.search(old)
        else old.rstrip("\n") + "\n\n" + section
    )
    path.write_text(new, encoding="utf-8")
    print(f"\nrecorded in {path}")


if __name__ == "__main__":
    main()
