"""How much of a session's previous view its next view sends again unchanged, in process.

    python bench/load/view_stability.py                        # default profile, long tool results
    python bench/load/view_stability.py --noise 0.02           # the provider's count off by up to 2 %
    PYTHONPATH=../base python bench/load/view_stability.py     # another checkout (run from its root)

A provider's prompt cache (a prefix cache) serves the part of a prompt that starts the previous
one byte for byte; a row the service shows differently from one turn to the next ends that part
there. Runs the agent turn loop of ``turns_inproc.py`` (AppendMessages of 2 messages,
BuildContext, RecordBaseline of the provider's count) on ``--sessions`` sessions, one long tool
result in ``--long-every`` seeded, and for each build after a session's first compares the view's
messages, as sent on the wire, with the previous view's: the bytes of the longest run of whole
leading messages they share, as a share of the previous view's bytes. Builds right after a
compaction share little by design; they are counted apart (the view's first rows changed).
``--noise``: each baseline is the provider's count times 1 +- up to that share, drawn per turn
(seeded), so the calibration moves more than a fixed count lets it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


async def _run(sessions: int, messages: int, turns: int, long_every: int, noise: float) -> dict[str, float]:
    from inproc import CallContext, bench_settings, seed_sessions, serve_in_process
    from workload import provider_tokens, turn_messages

    from contextsvc._gen.v1 import context_service_pb2 as pb
    from contextsvc.api.wire import serialize
    from contextsvc.stores.memory import MemoryStore

    settings = bench_settings()
    engine, servicer = await serve_in_process(MemoryStore(settings), settings)
    ctx: Any = CallContext()
    sids = await seed_sessions(servicer, ctx, sessions, messages, "default", long_every)
    rng = random.Random(7)
    previous: dict[str, list[bytes]] = {}
    shares: list[float] = []
    kept = moved = 0
    for t in range(turns):
        sid = sids[t % sessions]
        await servicer.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=turn_messages(t)), ctx)
        # Decoded from the bytes the server would send (the adapter writes them from its own cache).
        encoded = serialize(await servicer.BuildContext(pb.BuildContextRequest(session_id=sid), ctx))
        built = pb.BuildContextResponse.FromString(encoded)
        rows = [m.SerializeToString() for m in built.messages]
        before = previous.get(sid)
        if before is not None:
            if rows[:1] != before[:1]:
                moved += 1  # a compaction (or the first rows' cut) changed the view's start
            else:
                same = 0
                for a, b in zip(before, rows, strict=False):
                    if a != b:
                        break
                    same += len(a)
                whole = sum(map(len, before))
                shares.append(same / whole)
                kept += same == whole
        previous[sid] = rows
        count = provider_tokens(built.messages)
        if noise:
            count = max(1, round(count * (1 + rng.uniform(-noise, noise))))
        await servicer.RecordBaseline(
            pb.RecordBaselineRequest(session_id=sid, view_id=built.view_id, prompt_tokens=count), ctx
        )
        await asyncio.sleep(0)
    await engine.close()
    compared = len(shares)
    return {
        "builds compared": compared,
        "builds whose first row changed": moved,
        "previous view sent again whole": kept / compared if compared else 0.0,
        "share of the previous view's bytes sent again, median": statistics.median(shares) if shares else 0.0,
        "... mean": statistics.fmean(shares) if shares else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--messages", type=int, default=40)
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--long-every", type=int, default=10)
    parser.add_argument("--noise", type=float, default=0.0)
    args = parser.parse_args()
    figures = asyncio.run(_run(args.sessions, args.messages, args.turns, args.long_every, args.noise))
    for name, value in figures.items():
        print(f"{name}: {value:.3f}" if isinstance(value, float) else f"{name}: {value}")


if __name__ == "__main__":
    main()
