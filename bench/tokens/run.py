"""Token-accuracy benchmark: our estimates against real tokenizers, offline.

    python bench/tokens/run.py            # print the table
    python bench/tokens/run.py --record   # and write it into bench/RESULTS.md (## Token accuracy)

On first run it installs the pinned npm tokenizers into bench/tokens/node_modules. It generates
a deterministic corpus (corpus.py), counts the real prompt tokens of every view with each
tokenizer (count.mjs), then replays each session as an agent would: every model call reports
its real count as a baseline (fed through contextsvc.core.calibration), and the next view is
estimated the way the service does it. Errors are |estimate - real| / real.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

from corpus import KINDS, Session, sessions  # noqa: E402

from contextsvc.config import TokenSettings  # noqa: E402
from contextsvc.core.calibration import Observation, fit  # noqa: E402
from contextsvc.core.messages import Message, Role  # noqa: E402
from contextsvc.core.tokens import Baseline, CalibratedCounter, estimate, message_chars  # noqa: E402

TOKENIZERS = ("o200k", "cl100k", "llama3", "claude")
BASELINES = (0, 1, 2, 8)
#: Special tokens of a ChatML-like template that are not in the rendered text:
#: <|im_start|> before a message, <|im_end|> and a newline after it.
FRAME_PER_MESSAGE = 3
#: The reply primer ``<|im_start|>assistant\n``.
FRAME_PER_PROMPT = 3
WINDOW = 1_000_000  # large enough that no other rule (truncation, guard) interferes
TARGET = 0.03
#: A lower slope bound shown beside the default: English prose is ~0.2 tokens/char on these vocabularies.
WHAT_IF_MIN_SLOPE = 0.15


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


@dataclass
class View:
    messages: list[Message]  # numbered, oldest first
    chars: int  # what the service measures (system prompt + message_chars)
    real: dict[str, int]  # tokenizer -> real prompt tokens


def build_views(all_sessions: list[Session]) -> list[list[View]]:
    """Number the messages, count every distinct text once, and sum each view's real tokens."""
    texts: dict[str, int] = {}

    def idx(text: str) -> int:
        return texts.setdefault(text, len(texts))

    plans = []
    for s in all_sessions:
        seq = 0
        sys_idx = idx(f"system\n{s.system}")
        numbered: list[list[tuple[Message, int]]] = []
        for step in s.steps:
            row = []
            for m in step:
                seq += 1
                row.append((replace(m, sequence_number=seq), idx(render(m))))
            numbered.append(row)
        plans.append((s, sys_idx, numbered))

    started = time.perf_counter()
    counts = count_real(list(texts))
    print(
        f"counted {len(texts)} texts ({sum(map(len, texts)):,} chars) in {time.perf_counter() - started:.1f}s",
        file=sys.stderr,
    )

    out: list[list[View]] = []
    for s, sys_idx, numbered in plans:
        views: list[View] = []
        msgs: list[Message] = []
        real = {t: counts[t][sys_idx] + FRAME_PER_MESSAGE + FRAME_PER_PROMPT for t in TOKENIZERS}
        chars = len(s.system)
        for row in numbered:
            for m, i in row:
                msgs.append(m)
                chars += message_chars(m)
                for t in TOKENIZERS:
                    real[t] += counts[t][i] + FRAME_PER_MESSAGE
            views.append(View(list(msgs), chars, dict(real)))
        out.append(views)
    return out


def err(est: float, real: int) -> float:
    return abs(est - real) / real


def simulate(system: str, views: list[View], tokenizer: str, settings: TokenSettings) -> dict[str, float]:
    """Errors of one session, as a fresh model would see it (no earlier calibration)."""
    res: dict[str, float] = {}
    for n in BASELINES:
        if n >= len(views):
            continue
        target = views[n]
        obs = [Observation(v.chars, v.real[tokenizer]) for v in views[:n]]
        counter = CalibratedCounter(fit(obs, settings))
        line = estimate(counter=counter, window=WINDOW, reserve=0, system=system, context=target.messages).total
        res[f"line{n}"] = err(line, target.real[tokenizer])
        if n == 0:
            res[f"delta{n}"] = res[f"line{n}"]  # nothing to anchor on yet
            continue
        prev = views[n - 1]
        base = Baseline(prev.real[tokenizer], prev.messages[-1].sequence_number)
        total = estimate(
            counter=counter, window=WINDOW, reserve=0, system=system, context=target.messages, baseline=base
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=40, help="sessions per text kind (default 40)")
    parser.add_argument("--steps", type=int, default=12, help="model calls per session (default 12)")
    parser.add_argument("--record", action="store_true", help="write the table into bench/RESULTS.md")
    args = parser.parse_args()

    ensure_node_deps()
    settings = TokenSettings()
    by_kind = {k: sessions(k, args.sessions, args.steps) for k in KINDS}
    flat = [s for k in KINDS for s in by_kind[k]]
    views = build_views(flat)
    views_by_kind: dict[str, list[tuple[Session, list[View]]]] = {k: [] for k in KINDS}
    for s, v in zip(flat, views, strict=True):
        views_by_kind[s.kind].append((s, v))

    table, verdicts = accuracy_table(views_by_kind, settings, full=True)
    print(table)
    print("\nTarget (mixed agent turns, median |error| <= 3% after 2 baselines):")
    print("\n".join(verdicts))
    what_if = TokenSettings(calibration_min_slope=WHAT_IF_MIN_SLOPE)
    alt_table, alt_verdicts = accuracy_table(views_by_kind, what_if, full=False)
    print(f"\nWhat if calibration_min_slope = {WHAT_IF_MIN_SLOPE} (default {settings.calibration_min_slope}):")
    print(alt_table)
    print("\n".join(alt_verdicts))
    if args.record:
        record(table, verdicts, alt_table, alt_verdicts, args)


def accuracy_table(
    views_by_kind: dict[str, list[tuple[Session, list[View]]]], settings: TokenSettings, *, full: bool
) -> tuple[str, list[str]]:
    """The markdown table (all columns when ``full``, else only the calibrated ones) and the verdicts."""
    names = ["delta1", "delta2", "delta8", "line2", "line8"]
    titles = ["1 baseline", "2", "8", "line only, 2", "line only, 8"]
    if full:
        names = ["c4", "c18", "delta0", *names]
        titles = ["chars/4", "chars/1.8", "0 baselines", *titles]
    rows = ["| tokenizer | text | real tok/char | " + " | ".join(titles) + " |", "|---" * (3 + len(titles)) + "|"]
    verdicts = []
    for t in TOKENIZERS:
        for k in KINDS:
            cols: dict[str, list[float]] = {}
            ratios = []
            for s, vs in views_by_kind[k]:
                for name, e in simulate(s.system, vs, t, settings).items():
                    cols.setdefault(name, []).append(e)
                for v in vs:  # the static heuristics, over every view of the session
                    cols.setdefault("c4", []).append(err(v.chars / 4, v.real[t]))
                    cols.setdefault("c18", []).append(err(v.chars / 1.8, v.real[t]))
                    ratios.append(v.real[t] / v.chars)
            cells = [f"{pct(cols[n], 0.5):.1f} / {pct(cols[n], 0.9):.1f}" for n in names]
            rows.append(f"| {t} | {k} | {statistics.median(ratios):.3f} | " + " | ".join(cells) + " |")
            if k == "mixed":
                med = pct(cols["delta2"], 0.5) / 100
                verdict = "met" if med <= TARGET else "NOT met"
                verdicts.append(f"- {t}: median {100 * med:.1f}% after 2 baselines: {verdict}")
    return "\n".join(rows), verdicts


FINDINGS = (
    "Why the target is not met (read with the `real tok/char` column):",
    "",
    "- The slope floor of 0.25 tokens/char (DESIGN §5.3) rejects English prose on all four vocabularies "
    "(~0.19 tokens/char) and Cyrillic on o200k (~0.24): the fit falls back to chars/1.8, which is 2-3x too high "
    "for such text, so the delta after a baseline is priced far too high. With the floor at 0.15 (second table) "
    "the single-kind rows drop to <= 1.5% median after 2 baselines.",
    "- Mixed agent turns change density from one tool result to the next (0.19 tokens/char for prose, 0.25 for "
    "code, 0.35 for JSON, 0.24-0.50 for Cyrillic by vocabulary). A line through 2 early baselines is the density "
    "of whatever the first tool returned; the next view adds a result of another kind, and early on that delta "
    "is about half the view. No chars-only line can know the next result's kind, so the median error after 2 "
    "baselines is ~9-12% even with the lower floor; it falls to 1.3-3% after 8 baselines, as the delta becomes "
    "a small part of a larger view.",
    "- Each session here starts a cold model (no earlier calibration, a 600-char system prompt). In service "
    "the calibration is per model and shared by every session, so a new session starts from the model's last "
    "8 baselines (the `line only, 8` column), and a long session's next view is mostly its last real count.",
)


def record(table: str, verdicts: list[str], alt_table: str, alt_verdicts: list[str], args: argparse.Namespace) -> None:
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
            "- cells: median / p90 of |estimate - real| / real, in %. `N baselines`: the service's estimate of "
            "the next view after N real counts (baseline + calibrated delta); `line only`: the fitted line over "
            "the whole view (what is used once compression clears the baseline). "
            "`chars/4`, `chars/1.8`: over every view.",
            "",
            table,
            "",
            "Target: median |error| <= 3% after 2 baselines on mixed agent turns:",
            *verdicts,
            "",
            *FINDINGS,
            "",
            f"What if `tokens.calibration_min_slope` = {WHAT_IF_MIN_SLOPE} (same corpus, same run):",
            "",
            alt_table,
            "",
            *alt_verdicts,
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
