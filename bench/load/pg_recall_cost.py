"""What one recall search costs on PostgreSQL: ``PostgresStore.search_history``, BM25 in SQL.

    python bench/load/pg_recall_cost.py
    PYTHONPATH=../base python ../base/bench/load/pg_recall_cost.py   # another checkout, to compare

Every build that carries the user's message searches the session's compacted history; on
PostgreSQL the whole ranking runs in the database, on the same machine's cores as everything else
in the load suite. Starts a throwaway cluster (tests/support/postgres.py), and per kind of text
stores one session of ``--chunks`` chunks of ~1,500 characters from the held-out generator of
``bench/tokens/corpus.py`` (the text ``recall_cost.py`` times in process; the load suite never
sends it), then runs 60 queries of ~200 characters one at a time, ``--passes`` times, and prints
per kind:

- the median wall time of one search (one client, nothing else running: the database's time);
- how many of the searches rank their chunks as the in-process index does (``RecallIndex``, same
  chunks and query) and the largest relative difference of a score (the database adds in its own
  order, so the last bits may differ);
- a digest of the rankings (chunk, score to 9 significant digits, rarest document frequency):
  equal digests at two checkouts mean equal results.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "tokens"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import corpus  # noqa: E402  (bench/tokens' held-out text generator)
from recall_cost import KINDS, _chunks  # noqa: E402

from contextsvc.core.recall import RecallIndex  # noqa: E402
from contextsvc.core.session import Principal  # noqa: E402
from contextsvc.stores.postgres import make_postgres_store  # noqa: E402
from tests.support.postgres import PgCluster, create_database  # noqa: E402

OWNER = Principal(user_id="bench")
LIMIT = 20


async def _kind(store: object, kind: str, rng: random.Random, chunks: int, passes: int) -> str:
    history = _chunks(rng, kind, chunks, 1500)
    queries = [corpus._filler(rng, kind if kind != "mixed" else rng.choice(KINDS), 200) for _ in range(60)]
    session = await store.create_session(caller=OWNER, profile_id="")  # type: ignore[attr-defined]
    await store.add_history_chunks(session.id, history)  # type: ignore[attr-defined]
    index = RecallIndex(history)
    digest = hashlib.sha256()
    same = 0
    worst = 0.0
    times: list[float] = []
    for p in range(passes):
        for q in queries:
            began = time.perf_counter()
            found = await store.search_history(session.id, q, limit=LIMIT)  # type: ignore[attr-defined]
            times.append(time.perf_counter() - began)
            if p:
                continue
            local = index.search(q, LIMIT)
            same += [s.chunk.content_hash for s in found] == [s.chunk.content_hash for s in local]
            for a, b in zip(found, local, strict=False):
                if a.chunk.content_hash == b.chunk.content_hash:
                    worst = max(worst, abs(a.score - b.score) / b.score)
            for s in found:
                digest.update(f"{s.chunk.content_hash}:{s.score:.9g}:{s.rarest_df};".encode())
    ms = 1e3 * statistics.median(times)
    return f"| {kind} | {chunks} | {ms:.2f} | {same}/{len(queries)} | {worst:.1e} | {digest.hexdigest()[:12]} |"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=250)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--seed", type=int, default=99)
    args = parser.parse_args()
    cluster = PgCluster.create()
    try:
        dsn = await create_database(cluster.start())
        store = await make_postgres_store(dsn)
        try:
            rng = random.Random(args.seed)
            print("| text | chunks | search ms, median | ranked as in process | score, largest rel. diff | digest |")
            print("|---|---|---|---|---|---|")
            for kind in (*KINDS, "mixed"):
                print(await _kind(store, kind, rng, args.chunks, args.passes), flush=True)
        finally:
            await store.close()
    finally:
        cluster.remove()


if __name__ == "__main__":
    asyncio.run(main())
