"""Re-deriving stored search terms made by an older tokenizer (``core/recall.TERMS_VERSION``).

The database ranks history chunks on the ``terms`` column the core computed at insert time. When
the core's terms change (stemming came with version 2), older rows are brought up to date at
start, in bounded batches, so every chunk is ranked with the terms a query is made of. Safe to
run from several replicas at once: each batch rewrites rows to the same values.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from contextsvc.core.history import HistoryChunk
from contextsvc.core.recall import TERMS_VERSION, document_terms

log = logging.getLogger(__name__)

#: rows re-derived per statement.
BATCH = 500


async def rederive_terms(conn: Any, *, batch: int = BATCH) -> int:
    """Recompute ``terms`` of every chunk older than ``TERMS_VERSION``; returns how many rows."""
    stale = int(await conn.fetchval("SELECT count(*) FROM history_chunks WHERE terms_version < $1", TERMS_VERSION))
    done = 0
    # Bounded: one pass over the rows counted now (rows added meanwhile carry the new version).
    for _ in range(stale // batch + 1):
        rows = await conn.fetch(
            """SELECT session_id, chunk_id, text, breadcrumbs FROM history_chunks
                WHERE terms_version < $1 ORDER BY session_id, chunk_id LIMIT $2""",
            TERMS_VERSION,
            batch,
        )
        if not rows:
            break
        sessions, ids, found, counts = [], [], [], []
        for r in rows:
            crumbs = r["breadcrumbs"]
            if isinstance(crumbs, str):
                crumbs = json.loads(crumbs)
            chunk = HistoryChunk("", r["text"], 0, 0, None, None, tuple(str(c) for c in crumbs or ()))
            words = document_terms(chunk)
            sessions.append(r["session_id"])
            ids.append(r["chunk_id"])
            found.append(json.dumps(words))
            counts.append(len(words))
        await conn.execute(
            """UPDATE history_chunks c
                  SET terms = ARRAY(SELECT jsonb_array_elements_text(u.w::jsonb)), term_count = u.n,
                      terms_version = $5
                 FROM unnest($1::text[], $2::bigint[], $3::text[], $4::integer[]) AS u(s, i, w, n)
                WHERE c.session_id = u.s AND c.chunk_id = u.i""",
            sessions,
            ids,
            found,
            counts,
            TERMS_VERSION,
        )
        done += len(rows)
    if done:
        log.info("search terms re-derived", extra={"chunks": done, "terms_version": TERMS_VERSION})
    return done
