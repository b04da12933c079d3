"""Where the files store server's memory goes after BuildContext on many sessions (issue #9).

    python bench/store/memory.py --data /tmp/mem2k                     # 2,000 sessions x 100 rows
    python bench/store/memory.py --data /tmp/mem2k --trace 25          # + tracemalloc top stats
    python bench/store/memory.py --data /tmp/mem2k --env CONTEXTSVC_FILES__CACHE_MB=16

A diagnostic, in one process: the real server (``server.start``: store, engine, servicer, gRPC on
loopback) and a gRPC client calling ``BuildContext`` on every session once. Then it prints the
resident memory (``VmRSS``), what each cache says it holds (the store's rows, the wire cache, the
view memo, the per-message memo), the live objects by type, and the RSS after ``gc.collect()``
and after glibc's ``malloc_trim(0)`` (what fragmentation keeps). ``--trace N`` runs tracemalloc
(slow) and prints the N biggest allocation sites by line and by traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import os
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401 - this checkout's contextsvc, see _checkout.py
import grpc
from bulk import write_files
from synth import Generator, Plan

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import context_service_pb2_grpc
from contextsvc.config import Settings


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def malloc_trim() -> bool:
    """One ``malloc_trim(0)`` as ``serve`` makes them (``contextsvc.heap_trim``); False off glibc."""
    from contextsvc.heap_trim import load_malloc_trim

    trim = load_malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def caches(running: Any, servicer: Any) -> dict[str, Any]:
    from contextsvc.core import tokens

    engine = running.engine
    store = running.store
    out: dict[str, Any] = {}
    out["store.held_mb"] = getattr(store, "held_bytes", 0) / 1e6
    out["store.resident_sessions"] = getattr(store, "resident_sessions", 0)
    if servicer is not None:
        out["wire"] = servicer.wire_cache.stats()
    views = engine.views
    out["view_memo.sessions"] = len(views._memo)
    out["views.saved"] = len(views._saved)
    memos = {n: len(v) for n, v in vars(tokens).items() if isinstance(v, tokens.IdentityMemo)}
    out["tokens.memos"] = memos
    return out


def pymalloc_summary() -> None:
    """pymalloc's own totals (``sys._debugmallocstats``): arenas mapped vs bytes in live blocks,
    i.e. how much of the small-object heap is fragmentation."""
    import io
    import re as _re
    import tempfile

    with tempfile.TemporaryFile(mode="w+") as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = io.StringIO(tmp.read()).getvalue()
    for key in (
        "# arenas allocated current",
        "# bytes in allocated blocks",
        "# bytes in available blocks",
        "# bytes lost to pool headers",
        "# bytes lost to quantization",
        "Total",
    ):
        match = _re.search(_re.escape(key) + r"\s*=\s*([\d,]+)", text)
        if match:
            print(f"  pymalloc {key.lstrip('# ')}: {match.group(1)}")


def by_type(limit: int = 15) -> list[tuple[str, int]]:
    counts = collections.Counter(type(o).__name__ for o in gc.get_objects())
    return counts.most_common(limit)


async def run(args: argparse.Namespace) -> None:
    from contextsvc import server as server_mod
    from contextsvc.api.servicer import ContextServicer

    servicers: list[Any] = []
    original = server_mod.add_to_server

    def capture(servicer: Any, srv: Any) -> None:
        servicers.append(servicer)
        original(servicer, srv)

    server_mod.add_to_server = capture  # type: ignore[assignment]
    settings = Settings(listen="127.0.0.1:0", store=f"files:{args.data}")
    before = rss_mb()
    running = await server_mod.start(settings)
    print(f"RSS before start {before:.0f} MB, after start {rss_mb():.0f} MB", flush=True)
    servicer: ContextServicer | None = servicers[0] if servicers else None
    plan = Plan(args.sessions, args.sessions * args.rows)
    ids = [plan.session_id(i) for i in range(args.sessions)]
    if args.trace:
        tracemalloc.start(args.depth)
    first = tracemalloc.take_snapshot() if args.trace else None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ch:
        stub = context_service_pb2_grpc.ContextServiceStub(ch)
        started = time.perf_counter()
        for n, sid in enumerate(ids, 1):
            await stub.BuildContext(pb.BuildContextRequest(session_id=sid))
            if n % max(1, len(ids) // 4) == 0:
                print(f"  {n:,} sessions: RSS {rss_mb():.0f} MB ({time.perf_counter() - started:.0f} s)", flush=True)
    print(f"RSS after BuildContext on {len(ids):,} sessions: {rss_mb():.0f} MB", flush=True)
    for k, v in caches(running, servicer).items():
        print(f"  {k}: {v}")
    if first is not None:
        snap = tracemalloc.take_snapshot()
        filters = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen*")]
        snap = snap.filter_traces(filters)
        total = sum(s.size for s in snap.statistics("filename"))
        print(f"tracemalloc: {total / 1e6:.1f} MB traced now")
        print("-- by line --")
        for stat in snap.compare_to(first.filter_traces(filters), "lineno")[: args.trace]:
            print(f"  {stat.size_diff / 1e6:8.2f} MB {stat.count_diff:9,d}  {stat.traceback[0]}")
        print("-- by traceback --")
        for stat in snap.statistics("traceback")[: args.trace // 2]:
            print(f"  {stat.size / 1e6:8.2f} MB {stat.count:9,d}")
            for frame in stat.traceback.format()[-2 * args.depth :]:
                print(f"      {frame}")
        tracemalloc.stop()
    print("objects by type:", by_type())
    pymalloc_summary()
    gc.collect()
    print(f"RSS after gc.collect(): {rss_mb():.0f} MB")
    if malloc_trim():
        print(f"RSS after malloc_trim(0): {rss_mb():.0f} MB")
    await server_mod.stop(running, grace=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="data directory (written there if missing)")
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=100, help="rows per session (about)")
    parser.add_argument("--trace", type=int, default=0, help="tracemalloc: print this many top entries")
    parser.add_argument("--depth", type=int, default=6, help="tracemalloc traceback depth")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE settings for the server")
    args = parser.parse_args()
    for item in args.env:
        key, _, value = item.partition("=")
        os.environ[key] = value
    if not (args.data / "sessions").is_dir():
        plan = Plan(args.sessions, args.sessions * args.rows)
        print(f"writing {plan.sessions:,} sessions / {plan.messages:,} messages ...", flush=True)
        print(f"  {write_files(args.data, Generator(plan)):.0f} s", flush=True)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
