"""What bounds AppendMessages on PostgreSQL: the event order's lock, held through each commit.

    python bench/load/pg_append_bound.py --seconds 8 --writers 50

Starts a throwaway cluster (tests/support/postgres.py; default settings: ``fsync`` and
``synchronous_commit`` on), opens the store and its own event bus, creates ``--sessions``
sessions, then runs ``--writers`` concurrent appenders (2 messages each, the store's append
statement publishing its event, as the served engine does) for ``--seconds`` in each variant,
interleaved ``--rounds`` times, and prints appends/s, this process's CPU per append and how the
appends were batched (transactions of several appends, appends in a transaction of their own):

- ``served``: the statement as served (``_APPEND_PUBLISH_SQL``; appends waiting together commit
  together, ``_APPEND_GROUP_SQL``, at most ``postgres.append_group_max``);
- ``one-each``: as served with ``append_group_max = 1`` (every append its own transaction, as
  before round 9);
- ``no-lock``: the same without the bus's advisory lock (event ids may then become visible out of
  order: a measurement of what the lock costs, never a configuration);
- ``async-commit``: as served, with ``synchronous_commit = off`` for the bench's connections (a
  commit does not wait for its WAL flush: what the lock costs is the flush it is held through).

No gRPC and no engine: the figures are the store's and PostgreSQL's alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from contextsvc.config import Settings  # noqa: E402
from contextsvc.core.messages import Message, Role  # noqa: E402
from contextsvc.core.session import Principal  # noqa: E402
from contextsvc.ports import AppendEvent  # noqa: E402
from contextsvc.stores.postgres import make_postgres_store  # noqa: E402
from contextsvc.stores.postgres import store as pg_store  # noqa: E402
from tests.support.postgres import PgCluster, create_database  # noqa: E402

OWNER = Principal(user_id="bench")
SERVED = pg_store._APPEND_PUBLISH_SQL
NO_LOCK = SERVED.replace("FROM upd, locked", "FROM upd")
SERVED_GROUP = pg_store._APPEND_GROUP_SQL
NO_LOCK_GROUP = SERVED_GROUP.replace("FROM upd, locked", "FROM upd")


async def one(dsn: str, variant: str, seconds: float, writers: int, sessions: int, lanes: int) -> tuple[float, float]:
    pg_store._APPEND_PUBLISH_SQL = NO_LOCK if variant == "no-lock" else SERVED
    pg_store._APPEND_GROUP_SQL = NO_LOCK_GROUP if variant == "no-lock" else SERVED_GROUP
    url = dsn + ("?synchronous_commit=off" if variant == "async-commit" else "")
    settings = Settings()
    if lanes:
        with_lanes = settings.postgres.model_copy(update={"append_lanes": lanes})
        settings = settings.model_copy(update={"postgres": with_lanes})
    if variant == "one-each":
        one_each = settings.postgres.model_copy(update={"append_group_max": 1})
        settings = settings.model_copy(update={"postgres": one_each})
    store = await make_postgres_store(url, settings)
    bus = store.make_event_bus()
    try:
        sids = [(await store.create_session(caller=OWNER, profile_id="default")).id for _ in range(sessions)]
        done = 0
        deadline = time.monotonic() + seconds

        async def writer(k: int) -> None:
            nonlocal done
            i = 0
            while time.monotonic() < deadline:
                i += 1
                rows = [Message(role=Role.USER, content=f"ask {k} {i}"), Message(role=Role.ASSISTANT, content="ok")]
                event = AppendEvent("messages_appended", {"request_id": "", "turn_complete": False})
                await store.append_messages(sids[(k + i) % sessions], rows, caller=OWNER, event=event)
                done += 1

        cpu, start = time.process_time(), time.monotonic()
        await asyncio.gather(*(writer(k) for k in range(writers)))
        elapsed, cpu = time.monotonic() - start, time.process_time() - cpu
        group = store._append_group
        alone = done - group.grouped
        print(
            f"  {variant}: {group.batches} batches of {group.grouped / max(group.batches, 1):.1f} appends on average, "
            f"{alone} appends alone, {group.failed} failed batches",
            flush=True,
        )
        return done / elapsed, cpu / max(done, 1) * 1e3
    finally:
        await bus.close()
        await store.close()
        pg_store._APPEND_PUBLISH_SQL = SERVED
        pg_store._APPEND_GROUP_SQL = SERVED_GROUP


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--writers", type=int, default=50)
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], help="only these variants (repeatable)")
    parser.add_argument("--lanes", type=int, default=0, help="postgres.append_lanes (0: the default)")
    args = parser.parse_args()
    cluster = PgCluster.create()
    try:
        admin = cluster.start()
        variants = tuple(args.variant) or ("served", "one-each", "no-lock", "async-commit")
        rates: dict[str, list[float]] = {v: [] for v in variants}
        cpus: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.rounds):
            for variant in variants:
                dsn = await create_database(admin)
                rate, cpu = await one(dsn, variant, args.seconds, args.writers, args.sessions, args.lanes)
                rates[variant].append(rate)
                cpus[variant].append(cpu)
                print(f"round {r + 1} {variant:13s} {rate:7.0f} appends/s  {cpu:.2f} ms CPU/append", flush=True)
        for v in variants:
            rate, cpu = statistics.median(rates[v]), statistics.median(cpus[v])
            print(f"{v:13s} median {rate:7.0f} appends/s, {cpu:.2f} ms CPU")
        print(f"load average: {os.getloadavg()[0]:.1f}")
    finally:
        cluster.remove()


if __name__ == "__main__":
    asyncio.run(main())
