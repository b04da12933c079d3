"""What recall costs a session's history: finding a chunk's search terms, and one search (BM25).

    python bench/load/recall_cost.py
    PYTHONPATH=../base python ../base/bench/load/recall_cost.py   # another checkout, to compare

Once a session has compacted, every build that carries the user's message searches its history
for excerpts to recall (``engine/recall.py``), and every compaction adds chunks whose terms the
next search finds (``RecallIndex.index_pending``). Both are timed on text the load suite never
sends: the held-out generator of ``bench/tokens/corpus.py`` (English, code, JSON, Cyrillic, and
mixed chunks), seeded, so two checkouts see the same text.

- terms: ``document_terms`` of 40 chunks of ~2,000 characters per kind, µs per 1,000
  characters, the token cache emptied before each pass (a history's new words);
- search: ``RecallIndex.search`` (limit 20) of 60 queries of ~200 characters on a 250-chunk
  index of the same kind, µs per search; "first" is each query with the index's per-term
  weights forgotten (as just after a compaction), "again" with them kept.

Each figure is the fastest of ``--passes`` passes (CPU time). Each row ends with a digest of
the terms or of the rankings (chunk, score to the bit, rarest document frequency): equal
digests at two checkouts mean equal results.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import _checkout  # noqa: F401 - this checkout's contextsvc

from contextsvc.core import recall
from contextsvc.core.history import HistoryChunk

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tokens"))
import corpus  # bench/tokens' held-out text generator

KINDS = ("english", "code", "json", "cyrillic")


def _chunks(rng: random.Random, kind: str, count: int, chars: int) -> list[HistoryChunk]:
    out = []
    for i in range(count):
        if kind == "mixed":  # a turn of several messages, with the headers chunking writes
            text = "\n".join(f"#{j} user: " + corpus._filler(rng, rng.choice(KINDS), chars // 4) for j in range(4))
        else:
            text = corpus._filler(rng, kind, chars)
        out.append(HistoryChunk(f"{kind}-{i}", text, i + 1, i + 1, None, None))
    return out


def _fastest(passes: int, run: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(passes):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    return best


def _forget_tokens() -> None:
    cache = getattr(recall, "_token_terms", None)  # absent in checkouts before round 33
    if cache is not None:
        cache.cache_clear()


def _row(kind: str, rng: random.Random, passes: int) -> str:
    chunks = _chunks(rng, kind, 40, 2000)
    kb = sum(len(c.text) for c in chunks) / 1000
    digest = hashlib.sha256(repr([recall.document_terms(c) for c in chunks]).encode()).hexdigest()[:12]

    def find_terms() -> None:
        _forget_tokens()
        for c in chunks:
            recall.document_terms(c)

    terms_us = 1e6 * _fastest(passes, find_terms) / kb

    history = _chunks(rng, kind, 250, 1500)
    queries = [corpus._filler(rng, kind if kind != "mixed" else rng.choice(KINDS), 200) for _ in range(60)]
    index = recall.RecallIndex(history)
    ranked = hashlib.sha256()
    for q in queries:
        for hit in index.search(q, 20):
            ranked.update(f"{hit.chunk.content_hash}:{hit.score!r}:{hit.rarest_df};".encode())
    weights = getattr(index, "_weights", {})  # per-term weights (round 33): kept until chunks come
    vectors = getattr(index, "_vectors", {})  # the same as numpy arrays (round 35)

    def search_first() -> None:
        for q in queries:
            weights.clear()
            vectors.clear()
            index.search(q, 20)

    def search_again() -> None:
        for q in queries:
            index.search(q, 20)

    first_us = 1e6 * _fastest(passes, search_first) / len(queries)
    again_us = 1e6 * _fastest(passes, search_again) / len(queries)
    return f"| {kind} | {terms_us:.0f} | {first_us:.0f} | {again_us:.0f} | {digest} | {ranked.hexdigest()[:12]} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--seed", type=int, default=99)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    print("| text | terms µs/KB | search µs, first | search µs, again | terms digest | ranking digest |")
    print("|---|---|---|---|---|---|")
    for kind in (*KINDS, "mixed"):
        print(_row(kind, rng, args.passes))


if __name__ == "__main__":
    main()
