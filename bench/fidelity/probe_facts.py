"""Probe: planted facts of kinds the recall bench covers thinly, through 3-5 extractive compactions.

    python bench/fidelity/probe_facts.py                # dev and held-out sets
    python bench/fidelity/probe_facts.py --set held     # one set
    python bench/fidelity/probe_facts.py --turns 160    # longer (more compactions)

Kinds: bare numeric ids, file paths, URLs, e-mail-like identifiers, decisions later reversed,
values later corrected, TODO lists, preferences stated once early. The real ``Engine`` over the
memory store (tests/support/compaction_harness.Rig: an 8,192-token window, the default extractive
summarizer), a runtime loop of ask / tool call / tool output / answer; facts planted in the first
turns, corrections some turns later (after at least one compaction), filler after. At the end each
fact is asked about: is its value in the view (kept rows, summary fact lines; recall excerpts
counted apart), in SearchHistory's top 5 for the question, and in what ExpandSummary of the live
summary returns. For a corrected fact: the new value must be visible when asked; "stale" marks a
view that shows the old value and not the new one.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from contextsvc.core.session import ANONYMOUS  # noqa: E402
from tests.support.compaction_harness import Rig, a, t, u, words  # noqa: E402

WINDOW = 8192


@dataclass(frozen=True)
class Fact:
    where: str  # user | assistant | tool
    statement: str
    needle: str
    question: str
    #: a later correction: (statement, new needle); the fact's needle is then the stale value
    correction: tuple[str, str] | None = None


DEV: list[Fact] = [
    Fact(
        "user",
        "My customer number is 48213377, use it on every support form.",
        "48213377",
        "What is my customer number?",
    ),
    Fact("tool", "order 7730021945 refunded in full", "7730021945", "Which order was refunded?"),
    Fact(
        "user",
        "The config lives at /srv/payments/conf/settings.prod.toml on the box.",
        "/srv/payments/conf/settings.prod.toml",
        "Where does the config file live?",
    ),
    Fact(
        "assistant",
        "The failing test is tests/integration/test_ledger_sync.py, it flakes on CI.",
        "tests/integration/test_ledger_sync.py",
        "Which test is flaky?",
    ),
    Fact(
        "tool",
        "runbook: https://wiki.example.net/ops/runbooks/ledger-replay#step-4",
        "https://wiki.example.net/ops/runbooks/ledger-replay#step-4",
        "What is the runbook URL?",
    ),
    Fact(
        "user",
        "Send the weekly report to marta.kowalczyk@finance.example.org please.",
        "marta.kowalczyk@finance.example.org",
        "Who gets the weekly report?",
    ),
    Fact(
        "user",
        "The service account is svc-ledger@prod-east for the cron job.",
        "svc-ledger@prod-east",
        "Which service account runs the cron job?",
    ),
    Fact(
        "user",
        "Please answer in British English and keep replies under five bullet points.",
        "British English",
        "Which spelling should replies use?",
    ),
    Fact(
        "user",
        "TODO for this week: rotate the TLS cert, bump grpcio to 1.85, delete bucket legacy-assets-2019.",
        "legacy-assets-2019",
        "Which bucket is on the TODO list to delete?",
    ),
    Fact(
        "assistant",
        "We decided to run the ledger replay nightly at 02:00.",
        "nightly",
        "How often does the ledger replay run?",
        correction=("Change of plan: the ledger replay runs hourly now, not nightly.", "hourly"),
    ),
    Fact(
        "user",
        "The deploy target is cluster kappa-7.",
        "kappa-7",
        "Which cluster is the deploy target?",
        correction=("Correction: the deploy target is now cluster sigma-2, forget kappa-7.", "sigma-2"),
    ),
    Fact(
        "user",
        "Use port 8443 for the admin API.",
        "8443",
        "Which port does the admin API use?",
        correction=("Actually the admin API moved to port 9447.", "9447"),
    ),
]

HELD: list[Fact] = [
    Fact("user", "Our tenant id is 90017346 in the billing system.", "90017346", "What is our tenant id?"),
    Fact("tool", "invoice 5512098843 marked overdue", "5512098843", "Which invoice is overdue?"),
    Fact(
        "user",
        "Logs are written to /var/log/orchard/worker-blue.log on each node.",
        "/var/log/orchard/worker-blue.log",
        "Where are the worker logs written?",
    ),
    Fact(
        "assistant",
        "The migration script is scripts/migrate_2026_q1.py and it is idempotent.",
        "scripts/migrate_2026_q1.py",
        "Which migration script do we run?",
    ),
    Fact(
        "tool",
        "dashboard at https://grafana.example.io/d/abc123/orchard-latency?orgId=3",
        "https://grafana.example.io/d/abc123/orchard-latency?orgId=3",
        "Where is the latency dashboard?",
    ),
    Fact(
        "user",
        "Escalations go to li.wei@oncall.example.com after hours.",
        "li.wei@oncall.example.com",
        "Who do escalations go to after hours?",
    ),
    Fact(
        "user",
        "The replication user is repl_orchard@db-west for the standby.",
        "repl_orchard@db-west",
        "Which replication user does the standby use?",
    ),
    Fact(
        "user",
        "I never want force pushes to main, always open a pull request.",
        "force pushes",
        "What do I never want on main?",
    ),
    Fact(
        "user",
        "TODO list: 1) renew domain orchard.example 2) archive ticket ORC-5521 3) prune image tags older than 90 days.",
        "ORC-5521",
        "Which ticket should be archived per the TODO list?",
    ),
    Fact(
        "assistant",
        "We agreed to keep the cache TTL at 300 seconds.",
        "300 seconds",
        "What is the cache TTL?",
        correction=("Reversing that: the cache TTL is 45 seconds from now on, 300 seconds was too long.", "45 seconds"),
    ),
    Fact(
        "user",
        "The release branch is release/orchard-3.",
        "release/orchard-3",
        "Which release branch do we use?",
        correction=(
            "Update: the release branch is release/orchard-4 now, release/orchard-3 is frozen.",
            "release/orchard-4",
        ),
    ),
    Fact(
        "user",
        "The build machine is builder-12.",
        "builder-12",
        "Which build machine do we use?",
        correction=("No wait, we switched the build machine to builder-31.", "builder-31"),
    ),
]


def _log(rng: random.Random, lines: int, fact: str = "", crowd: bool = False) -> str:
    out = [f"{rng.randint(10, 23)}:{rng.randint(10, 59)} step ok batch {rng.randint(1, 999)}" for _ in range(lines)]
    if crowd:  # lines with anchors (hosts, paths, ids), as real tool output has: they fill the Facts budget
        for _ in range(4):
            n = rng.randint(100, 999)
            out.insert(
                rng.randrange(len(out)),
                f"synced node-{n}.db{n % 7}.example.com to /data/shard-{n}/wal_{n}.log as job JOB-{n}",
            )
    if fact:
        out.insert(rng.randrange(len(out)), fact)
    return "\n".join(out)


async def run(
    facts: list[Fact], seed: int, turns: int, correct_at: int, crowd: int = 0
) -> tuple[list[str], int, dict[str, int]]:
    rig = await Rig.start(window=WINDOW, reserve=1024)
    rng = random.Random(seed)
    totals = {"visible": 0, "recall_only": 0, "search": 0, "expand": 0, "stale": 0, "facts": len(facts)}
    totals |= {"summary_stale": 0, "summary_new": 0, "corrected": 0}
    rows: list[str] = []
    try:
        sid = await rig.session()
        plant = {2 * i + 1: f.statement for i, f in enumerate(facts)}
        roles = {2 * i + 1: f.where for i, f in enumerate(facts)}
        corrections = [f.correction[0] for f in facts if f.correction]
        for i, c in enumerate(corrections):
            plant[correct_at + 2 * i] = c
            roles[correct_at + 2 * i] = "user" if i % 2 else "assistant"
        for k in range(turns):
            said, role = plant.get(k, ""), roles.get(k, "")
            ask = said if role == "user" else f"next step {k}: {words(12, rng)}"
            await rig.build(sid, incoming=u(ask))
            reply = said if role == "assistant" else f"done with step {k}. {words(20, rng)}"
            await rig.append(
                sid,
                u(ask),
                a("", (f"c{k}", "run_command")),
                t(f"c{k}", _log(rng, rng.randint(20, 60), said if role == "tool" else "", crowd=k < crowd)),
                a(reply),
                turn_complete=True,
            )
            await rig.engine.background_settled(5.0)
        compactions = len(rig.events(sid, "context_compressed"))
        context = await rig.context(sid)
        summary = next((m for m in reversed(context) if m.flags.is_summary), None)
        expanded = ""
        live = (summary.content if summary is not None else "").casefold()
        # the live summary, read without a question: a corrected fact must not be there stale alone
        totals["summary_stale"] = sum(
            1 for f in facts if f.correction and f.needle.casefold() in live and f.correction[1].casefold() not in live
        )
        totals["summary_new"] = sum(1 for f in facts if f.correction and f.correction[1].casefold() in live)
        totals["corrected"] = sum(1 for f in facts if f.correction)
        if summary is not None:
            originals = await rig.engine.expand_summary(ANONYMOUS, sid, sequence_number=summary.sequence_number)
            expanded = "\n".join(m.content for m in originals)
        for f in facts:
            view = await rig.build(sid, incoming=u(f.question))
            base = "\n".join(vm.message.content for vm in view.messages if not vm.message.flags.is_recall).casefold()
            recalled = "\n".join(vm.message.content for vm in view.messages if vm.message.flags.is_recall).casefold()
            want = (f.correction[1] if f.correction else f.needle).casefold()
            hits = await rig.engine.search_history(ANONYMOUS, sid, query=f.question, limit=5)
            top = any(want in h.chunk.text.casefold() for h in hits)
            in_base, in_recall = want in base, want in recalled
            stale = bool(f.correction) and not (in_base or in_recall) and f.needle.casefold() in base + recalled
            totals["visible"] += in_base or in_recall
            totals["recall_only"] += in_recall and not in_base
            totals["search"] += top
            totals["expand"] += want in expanded.casefold()
            totals["stale"] += stale
            where = "kept/summary" if in_base else ("recall" if in_recall else "no")
            shown = f"`{f.needle}` -> `{want}`" if f.correction else f"`{want}`"
            rows.append(
                f"| {f.question} | {shown} | {where}{' (STALE shown)' if stale else ''} | {'yes' if top else 'no'} "
                f"| {'yes' if want in expanded.casefold() else 'no'} |"
            )
        return rows, compactions, totals
    finally:
        await rig.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", choices=("dev", "held", "both"), default="both")
    ap.add_argument("--turns", type=int, default=110)
    ap.add_argument("--correct-at", type=int, default=40, help="turn of the first correction")
    ap.add_argument("--crowd", type=int, default=0, help="tool outputs of the first N turns carry 4 anchor lines each")
    args = ap.parse_args()
    sets = {"dev": (DEV, 101), "held": (HELD, 202)}
    for name in ("dev", "held") if args.set == "both" else (args.set,):
        facts, seed = sets[name]
        rows, compactions, totals = asyncio.run(run(facts, seed, args.turns, args.correct_at, args.crowd))
        print(f"\n## {name}: {args.turns} turns, {compactions} compactions, crowd {args.crowd}\n")
        print("| question | fact | in the view | SearchHistory top 5 | in ExpandSummary of the live summary |")
        print("|---|---|---|---|---|")
        print("\n".join(rows))
        print(
            f"\nvisible {totals['visible']}/{totals['facts']} ({totals['recall_only']} through recall only); "
            f"SearchHistory {totals['search']}/{totals['facts']}; ExpandSummary {totals['expand']}/{totals['facts']}; "
            f"stale-only {totals['stale']}; live summary: {totals['summary_new']}/{totals['corrected']} corrected "
            f"values, {totals['summary_stale']} stale values alone"
        )


if __name__ == "__main__":
    main()
