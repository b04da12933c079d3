"""The agent turn loop in process: the servicer's own code without gRPC, for profiles and A/B.

    python bench/load/turns_inproc.py                       # CPU per turn, this checkout
    python bench/load/turns_inproc.py --profile 25          # + cProfile, the 25 costliest functions
    python bench/load/turns_inproc.py --ab ../base --rounds 5   # interleaved against another checkout
    python bench/load/turns_inproc.py --concurrent              # the sessions' turns overlap, as 50 agents'
    python bench/load/turns_inproc.py --incoming                # the user message sent with BuildContext

Builds ``ContextServicer`` on a memory store with the load suite's ``bench`` profile (run.py
``SERVER_CONFIG``), seeds ``--sessions`` sessions of ``--messages`` messages, then runs
``--turns`` turns round-robin over them, each what ``drivers.py turns`` sends over gRPC:
AppendMessages of 2 messages, BuildContext, RecordBaseline of the provider's count of the view
(``workload.provider_tokens``), and lets the post-turn checks the engine scheduled run. Prints
the process's CPU per turn (no sockets, no gRPC: what is left of a turn's server CPU when the
transport is taken away). ``--ab DIR`` runs the same loop in a subprocess from another checkout
(e.g. a detached worktree of ``main``), alternating with this one, and prints both per round.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _import_checkout(root: Path) -> None:
    sys.path.insert(0, str(root))
    sys.path.insert(1, str(HERE))


async def _loop(
    sessions: int,
    messages: int,
    turns: int,
    profile: int,
    concurrent: bool = False,
    store_kind: str = "memory",
    compounding: bool = False,
    dsn: str = "",
    session_profile: str = "bench",
    long_every: int = 0,
    incoming: bool = False,
    profile_out: str = "",
) -> float:
    """``compounding``: each baseline 5 % above the view's estimate, which compounds through
    baseline + delta until the sessions compact (``compaction_cost.py``); else the provider's
    count of the view (``workload.provider_tokens``), as the drivers send. ``incoming``: each turn
    sends its user message with BuildContext (``incoming``) and appends it with the answer after
    the baseline, as an agent that builds before it stores does."""
    from inproc import CallContext, bench_settings, seed_sessions, serve_in_process
    from workload import provider_tokens, turn_messages

    from contextsvc._gen.v1 import context_service_pb2 as pb
    from contextsvc.api.wire import serialize
    from contextsvc.stores.memory import MemoryStore

    settings = bench_settings()
    from contextsvc import server

    # The collector as ``serve`` sets it (an older checkout without the setting keeps Python's).
    tune = getattr(server, "tune_collector", None)
    if tune is not None:
        tune(settings.hot_path.gc_young_threshold)
    data_dir = None
    if store_kind == "memory":
        store: Any = MemoryStore(settings)
    elif store_kind == "postgres":  # ``dsn``: the throwaway cluster ``main`` started
        from contextsvc.stores.postgres import PostgresStore

        store = PostgresStore(dsn, settings)
    else:  # files (batched fsyncs, as run.py's server) or files-fsync (serve's default)
        from contextsvc.config import Durability
        from contextsvc.stores.files import FilesStore

        durability = Durability.FSYNC if store_kind == "files-fsync" else Durability.BATCH
        settings = settings.model_copy(update={"durability": durability})
        data_dir = tempfile.mkdtemp(prefix="ctxturns-")
        store = FilesStore(data_dir, settings)
    engine, servicer = await serve_in_process(store, settings)
    ctx: Any = CallContext()
    prof = cProfile.Profile() if profile else None

    def wire(request: Any) -> Any:
        return type(request).FromString(request.SerializeToString())

    sids = await seed_sessions(servicer, ctx, sessions, messages, session_profile, long_every)

    profiling: Any = None  # the profiler while the measured turns run
    client = 0.0  # CPU spent as the client (decoding the view's response), taken off the figure

    async def turn(k: int, t: int, appended: bytes) -> None:
        nonlocal client
        sid = sids[k]
        # Requests parsed and responses serialized as the server would (bytes in, bytes out).
        append = pb.AppendMessagesRequest.FromString(appended)
        if incoming:
            build = pb.BuildContextRequest(session_id=sid, incoming=append.messages[0])
        else:
            serialize(await servicer.AppendMessages(append, ctx))
            build = pb.BuildContextRequest(session_id=sid)
        encoded = serialize(await servicer.BuildContext(wire(build), ctx))
        began = time.process_time()
        if profiling:
            prof.disable()
        built = pb.BuildContextResponse.FromString(encoded)
        count = max(1, int(built.estimate.total * 1.05)) if compounding else provider_tokens(built.messages)
        request = pb.RecordBaselineRequest(
            session_id=sid, view_id=built.view_id, prompt_tokens=count
        ).SerializeToString()
        if profiling:
            prof.enable()
        client += time.process_time() - began
        serialize(await servicer.RecordBaseline(pb.RecordBaselineRequest.FromString(request), ctx))
        if incoming:
            serialize(await servicer.AppendMessages(pb.AppendMessagesRequest.FromString(appended), ctx))
        await asyncio.sleep(0)

    def appends(k: int, t: int) -> bytes:
        return pb.AppendMessagesRequest(session_id=sids[k], messages=turn_messages(k * 100_000 + t)).SerializeToString()

    for k in range(sessions):  # warm: every session built and baselined once
        await turn(k, 0, appends(k, 0))
    await asyncio.sleep(0.05)
    requests = [appends(i % sessions, 1 + i // sessions) for i in range(turns)]
    client = 0.0
    start = time.process_time()
    if prof:
        profiling = prof
        prof.enable()
    if concurrent:  # every session's turn at once, round by round (agents whose turns overlap)
        for first in range(0, turns, sessions):
            batch = requests[first : first + sessions]
            await asyncio.gather(*(turn(k, 1 + first // sessions, r) for k, r in enumerate(batch)))
    else:
        for i, appended in enumerate(requests):
            await turn(i % sessions, 1 + i // sessions, appended)
    await asyncio.sleep(0)
    if prof:
        prof.disable()
    spent = (time.process_time() - start - client) / turns * 1e3
    stats: Any = getattr(store, "stats", None)
    if hasattr(stats, "evictions"):  # the files store: sessions read from their log again past files.cache_mb
        print(f"files store: {stats.loads} sessions loaded, {stats.evictions} evicted", file=sys.stderr)
    await engine.close()
    if store_kind == "postgres":
        await engine.bus.close()
        await store.close()
    if data_dir is not None:
        shutil.rmtree(data_dir, ignore_errors=True)
    if prof:
        if profile_out:
            prof.dump_stats(profile_out)
        pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(profile)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--messages", type=int, default=40)
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's N costliest functions")
    parser.add_argument("--profile-out", default="", help="with --profile: also keep cProfile's stats in this file")
    parser.add_argument("--ab", default="", help="another checkout to alternate with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--concurrent", action="store_true", help="each round runs every session's turn at once (shared refits)"
    )
    parser.add_argument("--store", default="memory", choices=("memory", "files", "files-fsync", "postgres"))
    parser.add_argument(
        "--session-profile", default="bench", help="the sessions' profile (bench: 4 M tokens; default: 32,768)"
    )
    parser.add_argument("--long-every", type=int, default=0, help="every N seeded tool results, one of ~8,000 tokens")
    parser.add_argument(
        "--incoming", action="store_true", help="the user message goes with BuildContext, appended after the baseline"
    )
    parser.add_argument("--root", default=str(HERE.parents[1]), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.ab:
        _import_checkout(Path(args.root))
        cluster: Any = None
        if args.store == "postgres":  # a private cluster on loopback, removed even when the run fails
            from tests.support.postgres import PgCluster

            cluster = PgCluster.create()
        try:
            dsn = cluster.start() if cluster is not None else ""
            run = (args.sessions, args.messages, args.turns, args.profile, args.concurrent, args.store)
            ms = asyncio.run(
                _loop(
                    *run,
                    dsn=dsn,
                    session_profile=args.session_profile,
                    long_every=args.long_every,
                    incoming=args.incoming,
                    profile_out=args.profile_out,
                )
            )
        finally:
            if cluster is not None:
                cluster.stop()
                cluster.remove()
        print(f"{ms:.3f} ms CPU per turn ({args.turns} turns, {args.sessions} sessions)")
        return
    sys.path.insert(0, str(HERE))
    from inproc import alternate

    run = ["--sessions", str(args.sessions), "--messages", str(args.messages), "--turns", str(args.turns)]
    run += ["--concurrent"] if args.concurrent else []
    run += ["--session-profile", args.session_profile] if args.session_profile != "bench" else []
    run += ["--long-every", str(args.long_every)] if args.long_every else []
    run += ["--incoming"] if args.incoming else []
    alternate(Path(__file__), args.ab, args.rounds, [*run, "--store", args.store], "ms/turn")


if __name__ == "__main__":
    main()
