"""AppendMessages in process on PostgreSQL: the servicer's own CPU per append, without gRPC.

    python bench/load/append_inproc.py                          # CPU per append, this checkout
    python bench/load/append_inproc.py --profile 30             # + cProfile, the 30 costliest functions
    python bench/load/append_inproc.py --ab ../base --rounds 5  # interleaved against another checkout

Starts one throwaway cluster (tests/support/postgres.py), then, per round and checkout, a fresh
database and a subprocess that builds ``ContextServicer`` on the PostgreSQL store with the
store's own event bus (what ``serve`` wires: the append statement publishes its event), creates
``--sessions`` sessions of the load suite's ``bench`` profile seeded with ``--messages`` messages,
and runs ``--appends`` AppendMessages of 2 messages from ``--concurrency`` concurrent callers
(requests parsed from bytes and responses serialized, as the server does). Prints this process's
CPU per append: the engine, the store, asyncpg and the event bus, not gRPC and not PostgreSQL's
own processes. ``--ab DIR`` alternates with another checkout (e.g. ``git archive main``
unpacked) on the same cluster, each run on its own new database.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


async def _loop(dsn: str, sessions: int, messages: int, appends: int, concurrency: int, profile: int) -> float:
    from inproc import CallContext, bench_settings, seed_sessions
    from workload import messages as seed_messages

    from contextsvc._gen.v1 import context_service_pb2 as pb
    from contextsvc.api.servicer import ContextServicer
    from contextsvc.api.wire import serialize
    from contextsvc.clock import SystemClock
    from contextsvc.engine.engine import Engine
    from contextsvc.stores.postgres import make_postgres_store
    from contextsvc.summarizers.registry import build_summarizers

    settings = bench_settings()
    store = await make_postgres_store(dsn, settings)
    bus = store.make_event_bus()
    engine = Engine(
        store=store, bus=bus, settings=settings, clock=SystemClock(), summarizers=build_summarizers(settings)
    )
    servicer = ContextServicer(engine)
    ctx: Any = CallContext()
    sids = await seed_sessions(servicer, ctx, sessions, messages)
    # The same two messages for every call, as the ghz scenario sends them (run.py call_data).
    batch = seed_messages(2, start=messages)
    requests = [pb.AppendMessagesRequest(session_id=s, messages=batch).SerializeToString() for s in sids]

    async def one(raw: bytes) -> None:
        serialize(await servicer.AppendMessages(pb.AppendMessagesRequest.FromString(raw), ctx))

    for raw in requests:  # warm: every session appended to once (the engine then knows its profile)
        await one(raw)
    left = appends

    async def caller(k: int) -> None:
        nonlocal left
        i = k
        while left > 0:
            left -= 1
            await one(requests[i % len(requests)])
            i += concurrency

    prof = cProfile.Profile() if profile else None
    start = time.process_time()
    if prof:
        prof.enable()
    await asyncio.gather(*(caller(k) for k in range(concurrency)))
    if prof:
        prof.disable()
    spent = (time.process_time() - start) / appends * 1e3
    await engine.close()
    await bus.close()
    await store.close()
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(profile)
    return spent


def _child(args: argparse.Namespace) -> None:
    sys.path.insert(0, args.root)
    sys.path.insert(1, str(HERE))
    ms = asyncio.run(_loop(args.dsn, args.sessions, args.messages, args.appends, args.concurrency, args.profile))
    print(f"{ms:.3f} ms CPU per append ({args.appends} appends, {args.concurrency} concurrent)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--messages", type=int, default=20)
    parser.add_argument("--appends", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's N costliest functions")
    parser.add_argument("--ab", default="", help="another checkout to alternate with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--root", default=str(HERE.parents[1]), help=argparse.SUPPRESS)
    parser.add_argument("--dsn", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dsn:
        _child(args)
        return
    sys.path.insert(0, str(HERE.parents[1]))
    from tests.support.postgres import PgCluster, create_database

    checkouts = {"this": HERE.parents[1], "other": Path(args.ab).resolve()} if args.ab else {"this": HERE.parents[1]}
    figures: dict[str, list[float]] = {name: [] for name in checkouts}
    cluster = PgCluster.create()
    try:
        admin = cluster.start()
        for r in range(args.rounds if args.ab else 1):
            for name, root in checkouts.items():
                dsn = asyncio.run(create_database(admin))
                cmd = [sys.executable, str(Path(__file__).resolve()), "--root", str(root), "--dsn", dsn]
                cmd += ["--sessions", str(args.sessions), "--messages", str(args.messages)]
                cmd += ["--appends", str(args.appends), "--concurrency", str(args.concurrency)]
                cmd += ["--profile", str(args.profile)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900).stdout
                if not args.ab:
                    print(out)
                    return
                figures[name].append(float(out.split()[0]))
            print(
                f"round {r + 1}: this {figures['this'][-1]:.3f}  other {figures['other'][-1]:.3f} ms/append", flush=True
            )
    finally:
        cluster.remove()
    from inproc import print_ab

    print_ab(figures, "ms/append")


if __name__ == "__main__":
    main()
