"""Long-session fact recall: 400 turns on an 8,192 window with the default (extractive) summarizer.

    python bench/fidelity/recall.py            # print the table
    python bench/fidelity/recall.py --record   # and write it into bench/RESULTS.md (### Fact recall)

20 facts are planted in the first 40 turns (14 said by the user or assistant, 6 inside long tool
outputs); 360 filler turns follow, so the early turns are compacted many times. At the end each fact
is asked about with a natural question: is it visible in that turn's view (summary fact lines,
kept messages or a recalled excerpt), and does ``SearchHistory`` with the question find it in its
top 5? Also counted: how much recall adds to the views of the 400 working turns (its cost).
In process (the engine over the memory store), deterministic.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import re
import sys
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from contextsvc.core.session import ANONYMOUS  # noqa: E402
from tests.support.compaction_harness import Rig, a, t, u, words  # noqa: E402

WINDOW = 8192
TURNS = 400

# (where, statement, needle, question)
FACTS: list[tuple[str, str, str, str]] = [
    ("user", "I prefer tabs over spaces; never reformat my files.", "tabs", "Do I prefer tabs or spaces?"),
    (
        "user",
        "The primary database is db-primary.internal.example.com now.",
        "db-primary.internal.example.com",
        "What is the hostname of the primary database?",
    ),
    (
        "assistant",
        "The crash comes from src/api/handler.py:142 in the retry loop.",
        "src/api/handler.py:142",
        "Which file and line did the crash come from?",
    ),
    ("user", "This is tracked as INC-4411 by the on-call team.", "INC-4411", "What is the incident ticket id?"),
    (
        "user",
        "Please loop in our colleague Zoë Müller before deploying.",
        "Zoë Müller",
        "Who should be looped in before deploying?",
    ),
    ("user", "The release freeze starts on 2026-03-14 at noon.", "2026-03-14", "When does the release freeze start?"),
    ("user", "Everything runs in region eu-west-1 for this customer.", "eu-west-1", "Which region does it run in?"),
    (
        "tool",
        "vault path secret/data/prod/payments holds the payments credentials",
        "secret/data/prod/payments",
        "Which vault path holds the payments credentials?",
    ),
    ("user", "Бюджет согласует Алексей Иванов.", "Алексей Иванов", "Who approves the budget?"),
    (
        "tool",
        "status page https://status.example.org/incidents/88 lists the outage",
        "https://status.example.org/incidents/88",
        "What is the status page URL of the outage?",
    ),
    (
        "user",
        "Set the request timeout to 750 ms for the gateway.",
        "750 ms",
        "What request timeout should the gateway use?",
    ),
    (
        "tool",
        "cache node cache-02.eu.example.net evicted 1200 keys",
        "cache-02.eu.example.net",
        "Which cache node evicted keys?",
    ),
    (
        "assistant",
        "The billing account is acct_9f3k2x in the new system.",
        "acct_9f3k2x",
        "What is the billing account id?",
    ),
    ("user", "Work on the branch release/2026.03 only.", "release/2026.03", "Which branch should we work on?"),
    (
        "user",
        "Page oncall@example.com if the job fails again.",
        "oncall@example.com",
        "Who do we page if the job fails?",
    ),
    (
        "tool",
        "replica listening on 10.0.3.7 port 5433 accepted the connection",
        "10.0.3.7",
        "What is the replica's IP address?",
    ),
    ("user", "Always run the linters before committing.", "linters", "What must always run before committing?"),
    (
        "assistant",
        "We decided to use PostgreSQL 15 for the archive.",
        "PostgreSQL 15",
        "Which database did we decide to use for the archive?",
    ),
    (
        "tool",
        "build id b7e4c1d9a2 published to the registry",
        "b7e4c1d9a2",
        "What was the build id that was published?",
    ),
    ("tool", "certificate for api.example.com expires 2026-06-30", "2026-06-30", "When does the certificate expire?"),
]


def _log(rng: random.Random, lines: int, fact: str = "") -> str:
    out = [
        f"{rng.randint(10, 23)}:{rng.randint(10, 59)}:{rng.randint(10, 59)} worker ok batch {rng.randint(1, 999)}"
        for _ in range(lines)
    ]
    if fact:
        out.insert(rng.randrange(len(out)), fact)
    return "\n".join(out)


@dataclass
class Outcome:
    visible: int = 0
    by_recall: int = 0
    found: int = 0
    rows: list[str] = field(default_factory=list)
    #: recall on the working (filler) turns: views with excerpts, excerpts, their tokens
    working_views: int = 0
    working_excerpts: int = 0
    working_tokens: int = 0


async def run(facts: list[tuple[str, str, str, str]], seed: int) -> Outcome:
    rig = await Rig.start(window=WINDOW, reserve=1024)
    rng = random.Random(seed)
    out = Outcome()
    try:
        sid = await rig.session()
        plant = {2 * i + 1: f for i, f in enumerate(facts)}
        for k in range(TURNS):
            fact = plant.get(k)
            ask = fact[1] if fact and fact[0] == "user" else f"next step {k}: {words(12, rng)}"
            built = await rig.build(sid, incoming=u(ask))
            if built.injected_chunk_ids:
                out.working_views += 1
                out.working_excerpts += len(built.injected_chunk_ids)
                out.working_tokens += built.estimate.segments.recall
            reply = fact[1] if fact and fact[0] == "assistant" else f"done with step {k}. {words(20, rng)}"
            tool_fact = fact[1] if fact and fact[0] == "tool" else ""
            await rig.append(
                sid,
                u(ask),
                a("", (f"c{k}", "run_command")),
                t(f"c{k}", _log(rng, rng.randint(20, 60), tool_fact)),
                a(reply),
            )
        for _, _, needle, question in facts:
            view = await rig.build(sid, incoming=u(question))
            base = "\n".join(vm.message.content for vm in view.messages if not vm.message.flags.is_recall)
            recalled = "\n".join(vm.message.content for vm in view.messages if vm.message.flags.is_recall)
            in_base = needle.casefold() in base.casefold()
            in_recall = needle.casefold() in recalled.casefold()
            hits = await rig.engine.search_history(ANONYMOUS, sid, query=question, limit=5)
            top = any(needle.casefold() in h.chunk.text.casefold() for h in hits)
            out.visible += in_base or in_recall
            out.by_recall += in_recall and not in_base
            out.found += top
            where = "fact lines / kept" if in_base else ("recall" if in_recall else "no")
            out.rows.append(f"| {question} | `{needle}` | {where} | {'yes' if top else 'no'} |")
        return out
    finally:
        await rig.close()


def _summary(o: Outcome) -> str:
    return (
        f"visible in the view when asked: {o.visible}/20 (target 16; {o.by_recall} of them only through recall); "
        f"SearchHistory top 5: {o.found}/20 (target 20); recall on the {TURNS} working turns: "
        f"{o.working_excerpts} excerpts in {o.working_views} views, {o.working_tokens} tokens in all"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", action="store_true", help="run every set and write them into bench/RESULTS.md")
    ap.add_argument(
        "--set",
        choices=("score", "holdout", "dev"),
        default="score",
        help="score: FACTS below; holdout: recall_holdout_facts.py; dev: recall_dev_facts.py (tuning only)",
    )
    args = ap.parse_args()
    from recall_dev_facts import DEV_FACTS
    from recall_holdout_facts import HOLDOUT_FACTS

    sets = {"score": (FACTS, 14), "holdout": (HOLDOUT_FACTS, 27), "dev": (DEV_FACTS, 41)}
    header = ["| question | fact | in the view | SearchHistory top 5 |", "|---|---|---|---|"]
    if not args.record:
        facts, seed = sets[args.set]
        o = asyncio.run(run(facts, seed))
        print("\n".join([*header, *o.rows]), _summary(o), sep="\n\n")
        return
    results = {name: asyncio.run(run(facts, seed)) for name, (facts, seed) in sets.items()}
    for name, o in results.items():
        print(f"{name}: {_summary(o)}")
    score, holdout, dev = results["score"], results["holdout"], results["dev"]
    path = ROOT / "bench" / "RESULTS.md"
    text = path.read_text()
    section = (
        "### Fact recall (`python bench/fidelity/recall.py --record`)\n\n"
        f"{date.today().isoformat()} · {platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} cores · {TURNS} turns, window {WINDOW}, extractive summarizer, default recall "
        "(2 excerpts, min score 0.5, 1,024 tokens / 10% of the window), 20 facts planted in turns 1-39 "
        "(6 inside tool output), each asked at the end with a natural question.\n\n"
        "Three fact sets, same mix, different facts and filler seeds: **dev** (`recall_dev_facts.py`) is "
        "what search and recall were tuned on; **score** (below) was published before this work, so its "
        'questions were known, and one rule (issue keys such as `INC-4411` are a "ticket") was added '
        "after its one miss; **holdout** (`recall_holdout_facts.py`) was written after the rules were "
        "final. Its first run gave 13/20 visible (none through recall) and 20/20 found: every question "
        "came late in a compaction cycle, where estimate + margin sat at the trigger (`window - reserve`) "
        "and recall, measured against estimate + margin, had no room. Recall's room is now measured "
        "against the estimate alone, like the size guard; the figures below are after that one change, "
        "so the holdout set informed it (no other setting was changed on it).\n\n"
        f"- holdout: {_summary(holdout)}\n"
        f"- score: {_summary(score)}\n"
        f"- dev (tuning set): {_summary(dev)}\n\n"
        "Holdout set:\n\n" + "\n".join([*header, *holdout.rows]) + "\n\n"
        "Score set:\n\n" + "\n".join([*header, *score.rows]) + "\n"
    )
    if "### Fact recall" in text:
        text = re.sub(r"### Fact recall.*?(?=\n## |\n### |\Z)", lambda _: section, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)


if __name__ == "__main__":
    main()
