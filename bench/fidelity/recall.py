"""Long-session fact recall: 400 turns on an 8,192 window with the default (extractive) summarizer.

    python bench/fidelity/recall.py            # print the table
    python bench/fidelity/recall.py --record   # and write it into bench/RESULTS.md (### Fact recall)

20 facts are planted in the first 40 turns (14 said by the user or assistant, 6 inside long tool
outputs); 360 filler turns follow, so the early turns are compacted many times. At the end each fact
is asked about with a natural question: is it visible in that turn's view (summary fact lines or
kept messages), and does ``SearchHistory`` with the question find it in its top 5?
In process (the engine over the memory store), deterministic.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

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


async def run() -> tuple[int, int, list[str]]:
    rig = await Rig.start(window=WINDOW, reserve=1024)
    rng = random.Random(14)
    try:
        sid = await rig.session()
        plant = {2 * i + 1: f for i, f in enumerate(FACTS)}
        for k in range(TURNS):
            fact = plant.get(k)
            ask = fact[1] if fact and fact[0] == "user" else f"next step {k}: {words(12, rng)}"
            await rig.build(sid, incoming=u(ask))
            reply = fact[1] if fact and fact[0] == "assistant" else f"done with step {k}. {words(20, rng)}"
            tool_fact = fact[1] if fact and fact[0] == "tool" else ""
            await rig.append(
                sid,
                u(ask),
                a("", (f"c{k}", "run_command")),
                t(f"c{k}", _log(rng, rng.randint(20, 60), tool_fact)),
                a(reply),
            )
        visible = found = 0
        rows: list[str] = []
        for _, _, needle, question in FACTS:
            view = await rig.build(sid, incoming=u(question))
            text = "\n".join(vm.message.content for vm in view.messages)
            seen = needle.casefold() in text.casefold()
            hits = await rig.engine.search_history(ANONYMOUS, sid, query=question, limit=5)
            top = any(needle.casefold() in h.chunk.text.casefold() for h in hits)
            visible += seen
            found += top
            rows.append(f"| {question} | `{needle}` | {'yes' if seen else 'no'} | {'yes' if top else 'no'} |")
        return visible, found, rows
    finally:
        await rig.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    visible, found, rows = asyncio.run(run())
    table = "\n".join(["| question | fact | in the view | SearchHistory top 5 |", "|---|---|---|---|", *rows])
    summary = f"visible in the view when asked: {visible}/20 (target 16); SearchHistory top 5: {found}/20 (target 20)"
    print(table, summary, sep="\n\n")
    if args.record:
        path = ROOT / "bench" / "RESULTS.md"
        text = path.read_text()
        section = (
            "### Fact recall (`python bench/fidelity/recall.py --record`)\n\n"
            f"{TURNS} turns, window {WINDOW}, extractive summarizer, 20 facts planted in turns 1-39 "
            "(6 inside tool output).\n\n" + table + "\n\n" + summary + "\n"
        )
        if "### Fact recall" in text:
            text = re.sub(r"### Fact recall.*?(?=\n## |\n### |\Z)", section, text, flags=re.S)
        else:
            text = text.rstrip() + "\n\n" + section
        path.write_text(text)


if __name__ == "__main__":
    main()
