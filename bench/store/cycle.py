"""Agents taking turns in a cycle on long, compressed sessions past ``files.cache_mb``.

    python bench/store/cycle.py                                   # 40 agents x 1,500 rows, 64 MB
    python bench/store/cycle.py --agents 100 --rows 600 --cache-mb 32 --rounds 3

Each agent's session holds ``--rows`` agent-loop rows (``reload._rows``), of which a compaction
took all but the newest ``--context`` out of the context (a summary stands in for them), so the
histories together outgrow ``--cache-mb`` while the contexts fit in it many times. Then every
agent takes ``--turns`` turns in a cycle, each what a turn asks of the store: the context, an
append of two rows, the context again, and a state update. Two variants, each in its own process
on the same data, alternating for ``--rounds`` rounds:

- ``lean``: the shipped store (past the budget, rows outside a context go first, all but
  ``files.resident_tail_rows``; whole sessions go only if that is not enough);
- ``whole``: the same store with ``resident_tail_rows`` past every session's length, so only
  whole sessions go (the store before round 19).

Prints per variant the CPU per turn, the logs read again per turn, the rows let go, and the
process's RSS at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _checkout  # noqa: F401 - this checkout's contextsvc, see _checkout.py
from memory import rss_mb
from reload import _rows

VARIANTS = ("lean", "whole")


async def _seed(data: Path, agents: int, rows: int, context: int) -> None:
    from contextsvc.config import Durability, Settings
    from contextsvc.core.messages import Flags, Message, Role
    from contextsvc.core.session import Principal
    from contextsvc.stores.files import FilesStore

    caller = Principal(user_id="bench")
    store = FilesStore(data, Settings(durability=Durability.BATCH))
    await store.open()
    history = _rows(rows)
    for a in range(agents):
        sid = (await store.create_session(caller=caller, profile_id="bench", name=f"agent {a}")).id
        for start in range(0, rows, 200):
            await store.append_messages(sid, history[start : start + 200], caller=caller)
        summary = Message(Role.SYSTEM, f"summary of agent {a}'s first turns", flags=Flags(is_display=False))
        demote = list(range(1, rows - context + 1))
        await store.commit_compaction(sid, caller=caller, demote=demote, append=[summary], context_tokens=1)
    await store.close()


async def _cycle(data: Path, variant: str, turns: int, cache_mb: float) -> dict[str, float]:
    from contextsvc.config import Durability, FilesSettings, Settings
    from contextsvc.core.messages import Message, Role
    from contextsvc.core.session import Principal
    from contextsvc.stores.files import FilesStore

    tail = 128 if variant == "lean" else 10**9
    settings = Settings(durability=Durability.BATCH, files=FilesSettings(cache_mb=cache_mb, resident_tail_rows=tail))
    caller = Principal(user_id="bench")
    store = FilesStore(data, settings)
    await store.open()
    sids = [s.id for s in (await store.list_sessions(caller=caller, offset=0, limit=10_000)).sessions]
    ask = Message(Role.USER, "and the next step? " + "check the retry budget " * 6)
    answer = Message(Role.ASSISTANT, "done: " + "the budget is read once per call " * 5)
    for sid in sids:  # one turn each first: every session read once (the cold start is not measured)
        await store.load_context(sid, caller=caller)
    loads = store.stats.loads
    started = time.process_time()
    for turn in range(turns):
        for sid in sids:
            await store.load_context(sid, caller=caller)
            await store.append_messages(sid, [ask, answer], caller=caller)
            await store.load_context(sid, caller=caller)
            await store.update_state(sid, caller=caller, context_tokens=turn + 2)
    cpu = time.process_time() - started
    out = {
        "cpu_us_per_turn": 1e6 * cpu / (turns * len(sids)),
        "loads_per_turn": (store.stats.loads - loads) / (turns * len(sids)),
        "rows_shed": store.stats.rows_shed,
        "evictions": store.stats.evictions,
        "held_mb": store.held_bytes / 2**20,
        "rss_mb": rss_mb(),
    }
    await store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=40)
    parser.add_argument("--rows", type=int, default=1500, help="rows of each session before the turns")
    parser.add_argument("--context", type=int, default=60, help="of those, the newest in the context")
    parser.add_argument("--turns", type=int, default=5, help="turns of each agent per variant and round")
    parser.add_argument("--cache-mb", type=float, default=64.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one run, in a subprocess
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        copy = Path(tempfile.mkdtemp(prefix="ctxcycle-run-")) / "data"
        shutil.copytree(args.data, copy)  # every run starts from the same logs
        try:
            print(json.dumps(asyncio.run(_cycle(copy, args.variant, args.turns, args.cache_mb))))
        finally:
            shutil.rmtree(copy.parent, ignore_errors=True)
        return
    work = Path(tempfile.mkdtemp(prefix="ctxcycle-"))
    try:
        data = work / "data"
        asyncio.run(_seed(data, args.agents, args.rows, args.context))
        results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                cmd = [sys.executable, __file__, "--variant", variant, "--data", str(data)]
                cmd += ["--turns", str(args.turns), "--cache-mb", str(args.cache_mb)]
                out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                results[variant].append(out)
                print(
                    f"round {r + 1} {variant:5}: {out['cpu_us_per_turn']:8.0f} µs a turn, "
                    f"{out['loads_per_turn']:.2f} logs read a turn, {out['rows_shed']:,} rows let go, "
                    f"{out['evictions']} sessions dropped, held {out['held_mb']:.1f} MB, RSS {out['rss_mb']:.0f} MB",
                    flush=True,
                )
        med = {v: statistics.median(o["cpu_us_per_turn"] for o in results[v]) for v in VARIANTS}
        print(
            f"{args.agents} agents x {args.rows} rows ({args.context} in the context), cache {args.cache_mb:g} MB: "
            f"lean {med['lean']:.0f} µs a turn, whole {med['whole']:.0f} µs a turn, "
            f"lean/whole {med['lean'] / med['whole']:.3f}x (medians of {args.rounds})"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
