"""Compactions announced and never ended (``Compactor.close_abandoned``).

A replica that dies while compacting (kill -9) has published ``compression_started`` and never
publishes the closing event; the compaction lock died with its connection. Any replica's sweep
then closes that start with ``compression_refused`` (reason failed), so a watcher's
"compressing" indicator ends. A start whose session's lock is held belongs to a compaction still
running (it closes its own), and a closed one is never touched.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from contextsvc.core.profile import ProfileOverrides
from contextsvc.core.session import Principal
from contextsvc.engine.engine import Engine
from contextsvc.startup import DeferredBus
from contextsvc.stores.postgres import PostgresStore, make_postgres_store
from tests.postgres.conftest import pg_settings
from tests.support.compaction_harness import a, u, words
from tests.support.engines import make_engine

ALICE = Principal("alice")
WAIT = 30.0


@pytest.fixture
async def fleet(postgres_db: str) -> AsyncIterator[list[tuple[PostgresStore, Any, Engine]]]:
    """Two replicas on one database: each a store, its event bus and an engine."""
    out = []
    for _ in range(2):
        settings = pg_settings(compaction_lock_timeout_seconds=0.5)
        store = await make_postgres_store(postgres_db, settings)
        bus = store.make_event_bus()
        # The engine's bus as a replica that started before the database answered holds it: a
        # stand-in forwarding to the real one, without its queries (the sweep asks the real bus).
        stand_in = DeferredBus()
        stand_in.target = bus
        engine = make_engine(store, settings, bus=stand_in)
        engine.compactor.compression_log = bus  # as ``serve`` wires it on PostgreSQL
        out.append((store, bus, engine))
    try:
        yield out
    finally:
        for store, bus, engine in out:
            await engine.close()
            await bus.close()
            await store.close()


async def _started(bus: Any, sid: str, reason: str = "forced") -> Any:
    return await bus.publish(
        session_id=sid,
        user_id="alice",
        kind="compression_started",
        payload={"reason": reason, "context_tokens": 900, "max_context_tokens": 1000},
    )


async def test_a_start_left_by_a_dead_replica_is_closed_once(fleet: list[Any]) -> None:
    (store_a, bus_a, _), (_, bus_b, engine_b) = fleet
    dead = (await store_a.create_session(caller=ALICE, profile_id="p")).id
    done = (await store_a.create_session(caller=ALICE, profile_id="p")).id
    running = (await store_a.create_session(caller=ALICE, profile_id="p")).id
    # Replica A announced three compactions: one it closed, one it is still running (it holds the
    # lock), and one it never closed (it died: its lock went with its connection).
    abandoned = await _started(bus_a, dead)
    await _started(bus_a, done, "postturn")
    await bus_a.publish(session_id=done, user_id="alice", kind="context_compressed", payload={"reason": "postturn"})
    await _started(bus_a, running)
    watcher = bus_b.subscribe(caller=ALICE, session_id=dead, after_event_id=abandoned.event_id)
    async with store_a.compaction_lock(running):
        assert await engine_b.compactor.close_abandoned(older_than=0) == 1

    newest = await bus_b.newest_compression(dead)
    assert newest is not None and newest.kind == "compression_refused"
    assert newest.payload["reason"] == "failed" and newest.payload["trigger"] == "forced"
    assert "never reported" in newest.payload["detail"]
    # A watcher of the session (on the other replica) sees the close.
    seen = await asyncio.wait_for(anext(watcher), WAIT)
    assert (seen.kind, seen.event_id) == ("compression_refused", newest.event_id)
    assert (await bus_b.newest_compression(done)).kind == "context_compressed"  # type: ignore[union-attr]
    assert (await bus_b.newest_compression(running)).kind == "compression_started"  # type: ignore[union-attr]

    # Once the running one's holder is gone too, the next pass closes it; nothing is closed twice.
    assert await engine_b.compactor.close_abandoned(older_than=0) == 1
    assert (await bus_b.newest_compression(running)).kind == "compression_refused"  # type: ignore[union-attr]
    assert await engine_b.compactor.close_abandoned(older_than=0) == 0


async def test_a_young_start_is_left_alone(fleet: list[Any]) -> None:
    (store_a, bus_a, _), (_, bus_b, engine_b) = fleet
    sid = (await store_a.create_session(caller=ALICE, profile_id="p")).id
    await _started(bus_a, sid)
    # Younger than the sweep's age bound: its compaction may still be taking the lock.
    assert await engine_b.compactor.close_abandoned(older_than=3600) == 0
    assert (await bus_b.newest_compression(sid)).kind == "compression_started"  # type: ignore[union-attr]


async def test_the_next_compaction_closes_a_start_left_open_before_announcing_its_own(fleet: list[Any]) -> None:
    """A replica died while compacting, and the session compacts again on another replica before
    any sweep ran (the sweep skips a start that is no longer the newest): the new compaction closes
    the old start first, under the session's lock, so every start still gets exactly one close."""
    (_, bus_a, _), (_, bus_b, engine_b) = fleet
    sid = (await engine_b.sessions.create(ALICE, profile_id="", name="", metadata={})).id
    for k in range(10):
        turn = [u(f"question {k} " + words(120)), a(f"answer {k} " + words(120))]
        await engine_b.append(ALICE, sid, turn, request_id="", turn_complete=False)
    abandoned = await _started(bus_a, sid)  # replica A announced, then died
    watcher = bus_b.subscribe(caller=ALICE, session_id=sid, after_event_id=abandoned.event_id)
    report = await engine_b.compress(ALICE, sid, profile=ProfileOverrides(), note="", dry_run=False)
    assert report.compressed
    seen = [await asyncio.wait_for(anext(watcher), WAIT) for _ in range(3)]
    assert [e.kind for e in seen] == ["compression_refused", "compression_started", "context_compressed"]
    assert seen[0].payload["reason"] == "failed" and "never reported" in seen[0].payload["detail"]
    # Nothing left for the sweep: the old start is closed, the new one closed itself.
    assert await engine_b.compactor.close_abandoned(older_than=0) == 0
