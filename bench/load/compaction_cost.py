"""What one automatic compaction costs the server's event loop, in process.

    python bench/load/compaction_cost.py                        # this checkout
    python bench/load/compaction_cost.py --ab ../base --rounds 3   # alternating with another checkout

Runs ``turns_inproc.py``'s agent turn loop (50 sessions of 40 messages, memory store, the load
suite's ``bench`` profile, each baseline 5 % above the estimate) long enough that every session
crosses its compaction trigger once (~115 turns a session: the 5 % compounds through baseline +
delta), and measures the process CPU spent inside ``Compactor.run``: the extractive summary, the
breadcrumbs, the history index, the commit. A compaction runs on the event loop, so this is how
long every other request of the server waits behind one. Prints CPU per compaction and how many
rows the compacted contexts held.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


async def _measure(turns: int) -> tuple[int, float, int]:
    import turns_inproc

    from contextsvc.engine import compaction

    original = compaction.Compactor.run
    spent: list[float] = []
    rows: list[int] = []

    async def timed(self: Any, s: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.process_time()
        try:
            return await original(self, s, *args, **kwargs)
        finally:
            spent.append(time.process_time() - began)
            rows.append(len(s.context))

    compaction.Compactor.run = timed  # type: ignore[method-assign]
    await turns_inproc._loop(50, 40, turns, 0, True, "memory", compounding=True)
    if not spent:
        raise SystemExit(f"no session compacted in {turns} turns: give more (--turns)")
    return len(spent), statistics.median(spent) * 1e3, max(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=6500, help="turns over the 50 sessions")
    parser.add_argument("--ab", default="", help="another checkout to alternate with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--root", default=str(HERE.parents[1]), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.ab:
        sys.path.insert(0, args.root)
        sys.path.insert(1, str(HERE))
        count, median_ms, most_rows = asyncio.run(_measure(args.turns))
        print(f"{median_ms:.1f} ms CPU per compaction (median of {count}; contexts of up to {most_rows} rows)")
        return
    sys.path.insert(0, str(HERE))
    from inproc import alternate

    alternate(Path(__file__), args.ab, args.rounds, ["--turns", str(args.turns)], "ms per compaction")


if __name__ == "__main__":
    main()
