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
from contextsvc.summarizers.extractive import ExtractiveSummarizer
from contextsvc.summarizers.registry import SummarizerSet
from tests.postgres.conftest import pg_settings
from tests.support.compaction_harness import a, overrides, u, words
from tests.support.engines import make_engine
from tests.support.postgres import fetch_rows
from tests.support.stores import TickingClock

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


class _GatedSummarizer:
    """A summarizer whose answer waits for ``gate``: a summary call still running when something
    else happens (``called`` is set once it was asked)."""

    name = "gated"
    vision = False

    def __init__(self) -> None:
        self.called = asyncio.Event()
        self.gate = asyncio.Event()

    async def summarize(self, request: Any) -> str:
        self.called.set()
        await asyncio.wait_for(self.gate.wait(), WAIT)
        return f"- summarized {len(request.messages)} messages\nKEYS: gated"

    async def close(self) -> None:
        return None


async def _end_compaction_lock_connections(dsn: str) -> int:
    """What a PostgreSQL restart does to a compaction's lock: ends the connection holding it
    (the two-key advisory locks, ``compaction_lock_keys``)."""
    rows = await fetch_rows(
        dsn,
        """SELECT pg_terminate_backend(pid) FROM pg_locks
            WHERE locktype = 'advisory' AND objsubid = 2 AND granted AND pid <> pg_backend_pid()""",
    )
    return len(rows)


@pytest.fixture
async def gated_fleet(postgres_db: str) -> AsyncIterator[tuple[_GatedSummarizer, list[Any]]]:
    """Two replicas on one database; the first also has the ``gated`` summarizer."""
    gated = _GatedSummarizer()
    settings = pg_settings(compaction_lock_timeout_seconds=5)
    made: list[tuple[PostgresStore, Any, Engine]] = []
    try:
        for extra in ({"gated": gated}, {}):
            store = await make_postgres_store(postgres_db, settings)
            bus = store.make_event_bus()
            summarizers: dict[str, Any] = {"extractive": ExtractiveSummarizer.from_settings(settings), **extra}
            engine = Engine(
                store=store, bus=bus, settings=settings, clock=TickingClock(), summarizers=SummarizerSet(summarizers)
            )
            engine.compactor.compression_log = bus
            made.append((store, bus, engine))
        yield gated, made
    finally:
        for store, bus, engine in made:
            await engine.close()
            await bus.close()
            await store.close()


async def _compaction_waiting_for_its_summary(
    postgres_db: str, gated: _GatedSummarizer, engine_a: Engine, engine_b: Engine, bus_b: Any
) -> tuple[str, Any, asyncio.Task[Any]]:
    """A session compacted by replica A, whose summarizer has been asked and waits; a watcher of
    the session's events from before it; the compaction's task."""
    sid = (await engine_b.sessions.create(ALICE, profile_id="", name="", metadata={})).id
    for k in range(10):
        turn = [u(f"question {k} " + words(120)), a(f"answer {k} " + words(120))]
        await engine_b.append(ALICE, sid, turn, request_id="", turn_complete=False)
    newest = (await fetch_rows(postgres_db, "SELECT max(event_id) FROM events"))[0][0]
    watcher = bus_b.subscribe(caller=ALICE, session_id=sid, after_event_id=newest)
    first = asyncio.create_task(
        engine_a.compress(
            ALICE, sid, profile=overrides(summarizer="gated", strategies=["summarize"]), note="", dry_run=False
        )
    )
    await asyncio.wait_for(gated.called.wait(), WAIT)
    return sid, watcher, first


async def _compression_kinds(watcher: Any) -> list[str]:
    """The kinds of the compression events a watcher gets until none comes for a while."""
    kinds: list[str] = []
    for _ in range(20):
        try:
            event = await asyncio.wait_for(anext(watcher), 2.0)
        except TimeoutError:
            break
        if event.kind in ("compression_started", "context_compressed", "compression_refused"):
            kinds.append(event.kind)
    return kinds


async def test_a_compaction_whose_lock_died_with_a_server_restart_is_closed_once(
    postgres_db: str, gated_fleet: tuple[_GatedSummarizer, list[Any]]
) -> None:
    """PostgreSQL restarts while replica A's compaction waits for its summarizer: the lock dies
    with its connection, replica B compacts the session (closing A's start, which looks abandoned,
    before announcing its own), and then A's summarizer answers and A finds its rows gone. A must
    not close its start a second time: every start gets exactly one closing event."""
    gated, ((_, _, engine_a), (_, bus_b, engine_b)) = gated_fleet
    sid, watcher, first = await _compaction_waiting_for_its_summary(postgres_db, gated, engine_a, engine_b, bus_b)
    assert await _end_compaction_lock_connections(postgres_db) == 1

    second = await engine_b.compress(ALICE, sid, profile=ProfileOverrides(), note="", dry_run=False)
    assert second.compressed
    gated.gate.set()
    report = await asyncio.wait_for(first, WAIT)
    assert not report.compressed  # B committed first: A's rows left the context

    assert await _compression_kinds(watcher) == [
        "compression_started",  # A
        "compression_refused",  # A's start, closed by B as abandoned
        "compression_started",  # B
        "context_compressed",  # B
    ]
    assert await engine_b.compactor.close_abandoned(older_than=0) == 0


async def test_a_compaction_the_sweep_closed_as_abandoned_commits_nothing(
    postgres_db: str, gated_fleet: tuple[_GatedSummarizer, list[Any]]
) -> None:
    """The same lost lock, and the sweep of replica B closes A's start as failed while A still
    waits for its summary: A then commits nothing (watchers were told it failed) and publishes
    no second close; the session compacts on its next run."""
    gated, ((_, _, engine_a), (_, bus_b, engine_b)) = gated_fleet
    sid, watcher, first = await _compaction_waiting_for_its_summary(postgres_db, gated, engine_a, engine_b, bus_b)
    assert await _end_compaction_lock_connections(postgres_db) == 1
    assert await engine_b.compactor.close_abandoned(older_than=0) == 1

    gated.gate.set()
    report = await asyncio.wait_for(first, WAIT)
    assert not report.compressed
    assert await _compression_kinds(watcher) == ["compression_started", "compression_refused"]
    # Nothing was written: the ten turns' rows only, every one still in the context.
    rows = await fetch_rows(postgres_db, "SELECT last_sequence, context_count FROM sessions WHERE session_id = $1", sid)
    assert tuple(rows[0]) == (20, 20)


async def test_a_commit_after_the_sweep_closed_its_start_in_between_is_announced_anew(
    postgres_db: str, gated_fleet: tuple[_GatedSummarizer, list[Any]]
) -> None:
    """The narrowest case of a lost lock: replica B's sweep closes A's start as failed in the
    instant between A's check (``start_closed``, which still said open) and A's commit. The commit
    lands; watchers, told it failed, then get it as a compaction of its own (a start and its
    close), so every start keeps exactly one close and the last word is what happened."""
    gated, ((_, bus_a, engine_a), (_, bus_b, engine_b)) = gated_fleet

    class _SweptAfterTheCheck:
        """A's compression log: its check answers, then B's sweep runs before A goes on to commit."""

        def __getattr__(self, name: str) -> Any:
            return getattr(bus_a, name)

        async def start_closed(self, started: Any) -> bool:
            closed = await bus_a.start_closed(started)
            assert await engine_b.compactor.close_abandoned(older_than=0) == 1
            return closed

    sid, watcher, first = await _compaction_waiting_for_its_summary(postgres_db, gated, engine_a, engine_b, bus_b)
    assert await _end_compaction_lock_connections(postgres_db) == 1
    engine_a.compactor.compression_log = _SweptAfterTheCheck()  # type: ignore[assignment]
    gated.gate.set()
    report = await asyncio.wait_for(first, WAIT)
    assert report.compressed  # the commit landed
    assert await _compression_kinds(watcher) == [
        "compression_started",  # A
        "compression_refused",  # A's start, closed by B's sweep as abandoned
        "compression_started",  # A's commit, announced anew
        "context_compressed",
    ]
    rows = await fetch_rows(postgres_db, "SELECT context_count FROM sessions WHERE session_id = $1", sid)
    assert rows[0][0] < 20
    assert await engine_b.compactor.close_abandoned(older_than=0) == 0
