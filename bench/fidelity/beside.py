"""Agents that send tool definitions beside every view: does the service keep their context?

    python bench/fidelity/beside.py

Each run is one session of an agent on the memory store, in process: every turn appends a
question and an answer, builds the view (compressing as the service decides), and records as its
baseline the provider's count of the view plus ``tools`` tokens of tool definitions the view's rows
do not show. Printed per (window, tools): compactions, the median number of messages in a view,
the estimate's error against the real count (median and worst, every view after the first) and the
largest margin and real count. The shapes the rule was written on are 8,192 windows with 1,000
and 3,000 tokens of tools; the others (16,384 with 6,000, 32,768 with 12,000, 8,192 with 300) are
held out. Deterministic.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from contextsvc.core.session import ANONYMOUS  # noqa: E402
from tests.support.compaction_harness import Rig, a, real_tokens, u, words  # noqa: E402

SHAPES = [(8192, 0, "written on"), (8192, 1000, "written on"), (8192, 3000, "written on")]
HELD_OUT = [(8192, 300, "held out"), (16384, 6000, "held out"), (32768, 12000, "held out")]
TURNS = 60


async def run(window: int, tools: int) -> tuple[int, float, float, float, int, int]:
    rig = await Rig.start(window=window, reserve=window // 4)
    try:
        sid = await rig.session()
        views = []
        for k in range(TURNS):
            await rig.append(sid, u(f"ask {k} about module_{k}.py " + words(40)), a(f"answer {k} " + words(80)))
            view = await rig.build(sid)
            real = real_tokens(view) + tools
            await rig.engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=real)
            await rig.engine.anchors_applied(5)
            await rig.engine.background_settled(5)
            views.append((len(view.messages), view.estimate.total, view.estimate.margin, real))
        errors = [abs(e - r) / r for _, e, _, r in views[1:]]
        return (
            len(rig.events(sid, "context_compressed")),
            statistics.median(n for n, *_ in views[1:]),
            statistics.median(errors),
            max(errors),
            max(m for _, _, m, _ in views[1:]),
            max(r for *_, r in views),
        )
    finally:
        await rig.close()


async def main() -> None:
    print(f"{TURNS} turns a session; the budget is 3/4 of the window\n")
    print("| window | tools | set | compactions | median view rows | error median / worst | margin max | real max |")
    print("|---|---|---|---|---|---|---|---|")
    for window, tools, kind in [*SHAPES, *HELD_OUT]:
        comp, rows, med, worst, margin, real = await run(window, tools)
        print(
            f"| {window:,} | {tools:,} | {kind} | {comp} | {rows:g} | {med:.2%} / {worst:.1%} | {margin:,} | {real:,} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
