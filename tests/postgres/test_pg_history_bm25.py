"""SearchHistory on PostgreSQL scores and ranks as the in-process index (``RecallIndex``): BM25's
term-frequency saturation (k1) and length normalization (b) included.

Until round 35 the database read k1 and b as integers (``$3 + 1`` typed the parameter int4, so
1.5 arrived as 1 and 0.75 as 0): no length normalization at all, and on real text its top 20
differed from the in-process stores' in every query tried. The conformance suite's chunks are
short and alike, where that does not show; these differ in length and repeat their words.
"""

from __future__ import annotations

import random

import pytest

from contextsvc.core.recall import RecallIndex
from contextsvc.core.session import Principal
from contextsvc.ports import HistoryChunk
from contextsvc.stores.postgres import PostgresStore

ALICE = Principal("alice")

VOCABULARY = [
    "deploy",
    "rollback",
    "ledger",
    "invoice",
    "tenant",
    "shard",
    "replica",
    "timeout",
    "retry",
    "cache",
    "warmup",
    "latency",
    "migration",
    "checksum",
    "gateway",
    "certificate",
    "rotation",
    "quota",
    "throttle",
    "backlog",
    "worker",
    "queue",
    "scheduler",
    "payload",
    "schema",
    "index",
    "vacuum",
    "snapshot",
    "restore",
    "failover",
    "primary",
    "standby",
]


def _texts(rng: random.Random, count: int) -> list[str]:
    # Lengths from 5 to 200 words, a small vocabulary: terms repeat within a chunk (tf > 1) and
    # chunks differ in length (dl / avgdl far from 1), where k1 and b change the scores.
    out = []
    for _ in range(count):
        words = rng.choices(VOCABULARY[: rng.randint(4, len(VOCABULARY))], k=rng.randint(5, 200))
        out.append(" ".join(words))
    return out


@pytest.mark.parametrize("seed", [3, 17])
async def test_the_database_scores_and_ranks_as_the_in_process_index(store: PostgresStore, seed: int) -> None:
    rng = random.Random(seed)
    chunks = [HistoryChunk(f"c{i}", t, i + 1, i + 1, None, None) for i, t in enumerate(_texts(rng, 60))]
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.add_history_chunks(sid, chunks)
    index = RecallIndex(chunks)
    queries = [" ".join(rng.sample(VOCABULARY, rng.randint(1, 5))) for _ in range(25)]
    queries.append("ledger ledger tenant")  # a repeated query word adds once per repetition
    for query in queries:
        found = await store.search_history(sid, query, limit=10)
        local = index.search(query, 10)
        assert [s.chunk.content_hash for s in found] == [s.chunk.content_hash for s in local], query
        for got, want in zip(found, local, strict=True):
            assert got.score == pytest.approx(want.score, rel=1e-12)
            assert (got.rarest_df, got.chunk_count) == (want.rarest_df, want.chunk_count)
