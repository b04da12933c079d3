"""Issue #15 items 5 and 6: on PostgreSQL with the store's own bus, a baseline of the view this
process just built writes its anchor, its calibration observation and its ``baseline_recorded``
event in one statement (``PostgresStore.anchor_baseline``): one round trip and one commit instead
of three.

What a client and a watcher see must not change: the same anchor, observation and event (kind,
session, owner, payload) as an engine writing them one by one through the bus; all three or none
(a refused anchor writes neither of the others); event ids gap-free and in order while baselines
race appends and the bus's own publishes; the id drawn only under the bus's publish lock; and the
observations of a model still bounded by ``postgres.calibration_keep``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from contextsvc.config import Settings
from contextsvc.core.calibration import Observation
from contextsvc.core.profile import ProfileOverrides
from contextsvc.core.session import Principal, SessionInfo
from contextsvc.engine.views import BaselineResult, BuiltView
from contextsvc.errors import Conflict, InvalidArgument, NotFound
from contextsvc.ports import BaselineWrite, StoredEvent, ViewRecord
from contextsvc.stores.postgres import PostgresStore, make_postgres_event_bus, make_postgres_store
from contextsvc.stores.postgres.bus import PUBLISH_LOCK
from tests.postgres.conftest import two_profile_settings
from tests.postgres.test_pg_append_publish import Replica, _rows
from tests.postgres.test_pg_bus import Collector, until
from tests.support.engines import make_engine

ALICE = Principal(user_id="alice")
BOB = Principal(user_id="bob")
WRITES = ("anchor_baseline", "update_state_if_unchanged", "add_calibration_observation", "observe_baseline")


def _settings(**postgres: Any) -> Settings:
    base = two_profile_settings()
    return base.model_copy(update={"postgres": base.postgres.model_copy(update=postgres)})


class Counted(Replica):
    """A replica that counts its store's calls of the baseline's writes."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.calls: Counter[str] = Counter()
        for name in WRITES:
            method = getattr(self.store, name)

            async def counted(*a: Any, _name: str = name, _method: Any = method, **k: Any) -> Any:
                self.calls[_name] += 1
                return await _method(*a, **k)

            setattr(self.store, name, counted)


@asynccontextmanager
async def _replicas(postgres_db: str, settings: Settings) -> AsyncIterator[tuple[Counted, Counted]]:
    """Two replicas on one database: one whose engine uses the store's own bus (``folded``: its
    statements publish the events) and one with a bus of its own (the engine publishes)."""
    made: list[Counted] = []
    try:
        for folded in (True, False):
            store = await make_postgres_store(postgres_db, settings)
            bus = store.make_event_bus() if folded else await make_postgres_event_bus(postgres_db, settings)
            made.append(Counted(store, bus, make_engine(store, settings, bus=bus)))
        yield made[0], made[1]
    finally:
        for r in made:
            await r.engine.close()
            await r.bus.close()
            await r.store.close()


@pytest.fixture
async def replicas(postgres_db: str) -> AsyncIterator[tuple[Counted, Counted]]:
    async with _replicas(postgres_db, _settings()) as both:
        yield both


async def _session(engine: Any) -> str:
    """A new session of ALICE's on the "small" profile."""
    return (await engine.sessions.create(ALICE, profile_id="small", name="", metadata={})).id


async def _build(r: Replica, sid: str) -> BuiltView:
    return await r.engine.build_context(
        ALICE, sid, profile=ProfileOverrides(), incoming=None, mid_turn=False, auto_compress=False
    )


async def _turn(r: Replica, sid: str, text: str, extra: int = 7) -> tuple[BuiltView, BaselineResult]:
    await r.engine.append(ALICE, sid, _rows(text, "reply"), request_id="", turn_complete=False)
    view = await _build(r, sid)
    result = await r.engine.record_baseline(ALICE, sid, view_id=view.view_id, prompt_tokens=view.estimate.total + extra)
    return view, result


async def _observations(store: PostgresStore, model: str = "hp") -> list[int]:
    """The tokens of the model's stored observations, oldest first."""
    return [o.tokens for o in await store.list_calibration_observations(model, limit=10_000)]


async def _last_event_id(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval("SELECT coalesce(max(event_id), 0) FROM events"))


async def _writes(conn: asyncpg.Connection, store: PostgresStore) -> tuple[int, list[int]]:
    """The newest event's id and the stored observations: what a write refused leaves as it was."""
    return await _last_event_id(conn), await _observations(store)


async def test_a_baseline_of_the_view_just_built_is_one_store_call_with_the_same_outcome(
    replicas: tuple[Counted, Counted],
) -> None:
    folded, plain = replicas
    watcher = Collector(plain.bus)
    await watcher.started()
    before = await _observations(folded.store)
    outcomes: dict[str, tuple[Counted, BuiltView, BaselineResult]] = {}
    for r in (folded, plain):
        sid = await _session(r.engine)
        r.calls.clear()
        r.publishes = 0
        view, result = await _turn(r, sid, "hello there")
        outcomes[sid] = (r, view, result)
    assert folded.calls == {"anchor_baseline": 1} and folded.publishes == 0
    assert plain.calls == {"update_state_if_unchanged": 1, "add_calibration_observation": 1}
    assert plain.publishes == 2  # the append's event and the baseline's

    await watcher.wait_for(4)
    for sid, (r, view, result) in outcomes.items():
        assert result.recorded and not result.truncated
        (event,) = [e for e in watcher.events if e.session_id == sid and e.kind == "baseline_recorded"]
        assert event.user_id == "alice"
        assert dict(event.payload) == {
            "view_id": view.view_id,
            "prompt_tokens": view.estimate.total + 7,
            "estimated_tokens": view.estimate.total,
            "model": "hp",
        }
        session = await r.store.get_session(sid, caller=ALICE)
        assert session.context_tokens == view.estimate.total + 7  # the anchor
        assert session.state["baseline"]["view_id"] == view.view_id
    totals = [v.estimate.total + 7 for _, v, _ in outcomes.values()]
    assert await _observations(folded.store) == [*before, *totals]  # one observation each
    # The folded replica's calibration holds its observation without writing it a second time.
    assert folded.engine.accounting._written == 1
    await asyncio.sleep(0.3)  # nothing more, nothing twice
    assert len([e for e in watcher.events if e.kind == "baseline_recorded"]) == 2
    await watcher.stop()


async def test_a_refused_anchor_writes_no_observation_and_no_event(
    postgres_db: str, replicas: tuple[Counted, Counted]
) -> None:
    folded, plain = replicas
    store = folded.store
    sid = await _session(folded.engine)
    await folded.engine.append(ALICE, sid, _rows("one"), request_id="", turn_complete=False)
    read = await store.get_session(sid, caller=ALICE)
    write = BaselineWrite("hp", Observation(chars=40, tokens=123, features=()), "baseline_recorded", {"n": 1})
    state = {**read.state, "baseline": {"tokens": 123}}
    probe = await asyncpg.connect(postgres_db)
    try:
        events, observations = await _last_event_id(probe), await _observations(store)

        async def nothing_written() -> None:
            assert await _last_event_id(probe) == events
            assert await _observations(store) == observations
            assert (await store.get_session(sid, caller=ALICE)).state == read.state

        # A stranger, an unknown session: refused.
        for caller, session_id in ((BOB, sid), (ALICE, "no-such-session")):
            got = await store.anchor_baseline(
                session_id, caller=caller, read=read, context_tokens=123, state=state, write=write
            )
            assert got is None
            await nothing_written()
        # Another replica holds the session's compaction lock: refused at once.
        async with plain.store.compaction_lock(sid):
            async with asyncio.timeout(5):
                got = await store.anchor_baseline(
                    sid, caller=ALICE, read=read, context_tokens=123, state=state, write=write
                )
            assert got is None
            await nothing_written()
        # The session changed since the read (another replica appended): refused.
        await plain.engine.append(ALICE, sid, _rows("two"), request_id="", turn_complete=False)
        events = await _last_event_id(probe)
        got = await store.anchor_baseline(sid, caller=ALICE, read=read, context_tokens=123, state=state, write=write)
        assert got is None
        assert await _last_event_id(probe) == events
        assert await _observations(store) == observations
        # On the session as it is now: all three, and the event names the session's owner.
        now = await store.get_session(sid, caller=ALICE)
        got = await store.anchor_baseline(sid, caller=ALICE, read=now, context_tokens=123, state=state, write=write)
        assert isinstance(got, SessionInfo) and got.context_tokens == 123 and got.state == state
        assert await _observations(store) == [*observations, 123]
        row = await probe.fetchrow("SELECT * FROM events WHERE event_id > $1", events)
        assert (row["session_id"], row["user_id"], row["kind"]) == (sid, "alice", "baseline_recorded")
    finally:
        await probe.close()


async def test_baselines_of_a_refused_anchor_go_the_usual_way_and_observe_once(
    replicas: tuple[Counted, Counted],
) -> None:
    folded, plain = replicas
    watcher = Collector(plain.bus)
    await watcher.started()
    sid = await _session(folded.engine)
    await folded.engine.append(ALICE, sid, _rows("one"), request_id="", turn_complete=False)
    view = await _build(folded, sid)
    await plain.store.update_state(sid, caller=ALICE, state={"epoch": 0, "other": "writer"})
    before = await _observations(folded.store)
    folded.calls.clear()
    result = await folded.engine.record_baseline(ALICE, sid, view_id=view.view_id, prompt_tokens=321)
    assert result.recorded
    assert folded.calls["anchor_baseline"] == 1  # tried, refused: the session changed
    # then anchored the usual way, and observed once, with its event, in one statement
    assert folded.calls["observe_baseline"] == 1 and folded.calls["add_calibration_observation"] == 0
    assert await _observations(folded.store) == [*before, 321]
    session = await folded.store.get_session(sid, caller=ALICE)
    assert session.state["other"] == "writer" and session.context_tokens == 321
    await watcher.wait_for(2)  # the append's event and the baseline's
    await asyncio.sleep(0.3)
    assert [e.kind for e in watcher.events if e.session_id == sid] == ["messages_appended", "baseline_recorded"]
    await watcher.stop()


async def test_a_baseline_while_its_session_compacts_is_one_statement_of_observation_and_event(
    replicas: tuple[Counted, Counted],
) -> None:
    """A compaction of the session runs here: the anchor waits for it, and the baseline is one
    statement (the observation with the event, checked against the session as the build read
    it), not a read and three writes; the anchor applies once the compaction lets go of it."""
    folded, plain = replicas
    watcher = Collector(plain.bus)
    await watcher.started()
    sid = await _session(folded.engine)
    await folded.engine.append(ALICE, sid, _rows("one"), request_id="", turn_complete=False)
    view = await _build(folded, sid)
    before = await _observations(folded.store)
    folded.calls.clear()
    folded.publishes = 0
    reads = Counter[str]()
    get_session = folded.store.get_session

    async def counted_read(*a: Any, **k: Any) -> SessionInfo:
        reads["get_session"] += 1
        return await get_session(*a, **k)

    folded.store.get_session = counted_read  # type: ignore[method-assign]
    async with folded.engine.compactor.lock(sid):
        result = await folded.engine.record_baseline(ALICE, sid, view_id=view.view_id, prompt_tokens=333)
        assert result.recorded and not result.truncated
        # One statement: the session as the build read it vouches for the owner; nothing read.
        assert folded.calls == {"observe_baseline": 1} and folded.publishes == 0 and reads == {}
        folded.store.get_session = get_session  # type: ignore[method-assign]
        # A stranger's baseline of that view writes nothing and is not found.
        with pytest.raises(NotFound):
            await folded.engine.record_baseline(BOB, sid, view_id=view.view_id, prompt_tokens=334)
        assert folded.calls == {"observe_baseline": 2}
        assert await _observations(folded.store) == [*before, 333]
        assert (await folded.store.get_session(sid, caller=ALICE)).context_tokens != 333  # deferred
        await watcher.wait_for(2)
        (event,) = [e for e in watcher.events if e.kind == "baseline_recorded"]
        assert (event.session_id, event.user_id) == (sid, "alice")
        assert dict(event.payload) == {
            "view_id": view.view_id,
            "prompt_tokens": 333,
            "estimated_tokens": view.estimate.total,
            "model": "hp",
        }
    assert await folded.engine.anchors_applied(5.0)
    session = await folded.store.get_session(sid, caller=ALICE)
    assert session.context_tokens == 333 and session.state["baseline"]["view_id"] == view.view_id
    assert folded.engine.accounting._written == 1  # refit from the stored observation, not written twice
    await asyncio.sleep(0.3)
    assert [e.kind for e in watcher.events if e.session_id == sid] == ["messages_appended", "baseline_recorded"]
    await watcher.stop()


async def test_an_observation_with_its_event_is_both_or_neither(
    postgres_db: str, replicas: tuple[Counted, Counted]
) -> None:
    folded, _ = replicas
    store = folded.store
    sid = await _session(folded.engine)
    created = (await store.get_session(sid, caller=ALICE)).create_time
    probe = await asyncpg.connect(postgres_db)
    try:
        before = await _writes(probe, store)
        events, observations = before
        write = BaselineWrite("hp", Observation(chars=40, tokens=77, features=()), "baseline_recorded", {"n": 1})
        # A stranger, an unknown session, the session as created at another time: neither.
        for session_id, caller, when in (
            (sid, BOB, None),
            ("no-such-session", ALICE, None),
            (sid, ALICE, created + timedelta(seconds=1)),
        ):
            assert not await store.observe_baseline(session_id, caller=caller, write=write, created=when)
            assert await _writes(probe, store) == before
        # A payload the event column refuses (NUL is no jsonb text): the observation goes too.
        bad = BaselineWrite("hp", Observation(chars=40, tokens=78, features=()), "baseline_recorded", {"n": "\x00"})
        with pytest.raises(InvalidArgument):
            await store.observe_baseline(sid, caller=ALICE, write=bad)
        assert await _writes(probe, store) == before
        # The owner's, and an admin's: both, the event naming the session's owner.
        admin = Principal(user_id="root", is_admin=True)
        for caller, tokens in ((ALICE, 77), (admin, 79)):
            write = BaselineWrite("hp", Observation(chars=40, tokens=tokens, features=()), "baseline_recorded", {})
            assert await store.observe_baseline(sid, caller=caller, write=write, created=created)
            assert (await _observations(store))[-1] == tokens
            row = await probe.fetchrow("SELECT * FROM events WHERE event_id > $1", events)
            assert (row["session_id"], row["user_id"], row["kind"]) == (sid, "alice", "baseline_recorded")
            events = row["event_id"]
        assert await _observations(store) == [*observations, 77, 79]
    finally:
        await probe.close()


async def test_baselines_racing_appends_and_publishes_arrive_in_order_without_gaps(
    replicas: tuple[Counted, Counted],
) -> None:
    folded, plain = replicas
    watcher = Collector(plain.bus)
    await watcher.started()
    sessions = [await _session(folded.engine) for _ in range(6)]

    async def turns(sid: str) -> list[str]:
        return [(await _turn(folded, sid, f"{sid} {i}", extra=i))[0].view_id for i in range(5)]

    async def publishes(k: int) -> None:
        for i in range(8):
            await plain.bus.publish(session_id=sessions[k], user_id="alice", kind="note", payload={"i": i})

    folded.calls.clear()
    results = await asyncio.gather(*(turns(s) for s in sessions), *(publishes(k) for k in range(3)))
    assert folded.calls["anchor_baseline"] >= 1
    expected = 6 * 5 * 2 + 3 * 8  # an append's and a baseline's event a turn, and the publishes
    got = await watcher.wait_for(expected)
    ids = [e.event_id for e in got]
    assert ids == sorted(ids) and len(set(ids)) == expected
    assert ids == list(range(ids[0], ids[0] + expected))  # no gap: nothing rolled back here
    for sid, views in zip(sessions, results[:6], strict=True):
        mine = [dict(e.payload)["view_id"] for e in got if e.session_id == sid and e.kind == "baseline_recorded"]
        assert mine == views  # each baseline once, in the session's order
    await asyncio.sleep(0.3)
    assert len(watcher.events) == expected
    await watcher.stop()


async def test_a_baseline_draws_its_event_id_only_once_it_holds_the_publish_lock(
    postgres_db: str, replicas: tuple[Counted, Counted]
) -> None:
    folded, _ = replicas
    sid = await _session(folded.engine)
    await folded.engine.append(ALICE, sid, _rows("first"), request_id="", turn_complete=False)
    view = await _build(folded, sid)
    observations = await _observations(folded.store)
    holder = await asyncpg.connect(postgres_db)
    probe = await asyncpg.connect(postgres_db)
    try:
        seq = await holder.fetchval("SELECT pg_get_serial_sequence('events', 'event_id')")
        before = await holder.fetchval(f"SELECT last_value FROM {seq}")
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT pg_advisory_xact_lock($1)", PUBLISH_LOCK)
        waiting = asyncio.create_task(
            folded.engine.record_baseline(ALICE, sid, view_id=view.view_id, prompt_tokens=222)
        )
        await asyncio.sleep(0.5)
        assert not waiting.done()
        assert await probe.fetchval(f"SELECT last_value FROM {seq}") == before
        # Neither the anchor nor the observation is visible: they commit with the event.
        state = await probe.fetchval("SELECT state FROM sessions WHERE session_id = $1", sid)
        assert "222" not in str(state)
        assert await _observations(folded.store) == observations
        await tx.commit()
        async with asyncio.timeout(15):
            result = await waiting
        assert result.recorded
        assert folded.calls["anchor_baseline"] == 1
        assert await _observations(folded.store) == [*observations, 222]
        events = await folded.bus._fetch(before, Principal("root", is_admin=True), sid)
        assert [(e.event_id, e.kind) for e in events] == [(before + 1, "baseline_recorded")]
    finally:
        await holder.close()
        await probe.close()


async def test_observations_written_with_anchors_stay_bounded(postgres_db: str) -> None:
    keep, every = 4, 3
    settings = _settings(calibration_keep=keep, calibration_trim_every=every)
    async with _replicas(postgres_db, settings) as (folded, _plain):
        sid = await _session(folded.engine)
        await folded.engine.append(ALICE, sid, _rows("one"), request_id="", turn_complete=False)
        store = folded.store
        counts = []
        for i in range(1, 13):
            read = await store.get_session(sid, caller=ALICE)
            write = BaselineWrite("hp", Observation(chars=10, tokens=i, features=()), "baseline_recorded", {})
            got = await store.anchor_baseline(
                sid, caller=ALICE, read=read, context_tokens=i, state={**read.state, "i": i}, write=write
            )
            assert got is not None
            counts.append(len(await _observations(store)))
        assert max(counts) <= keep + every - 1 and counts[:keep] == [1, 2, 3, 4]
        # The twelfth observation was the third since the last trim: trimmed to the newest four.
        assert await _observations(store) == [9, 10, 11, 12]


async def test_baselines_and_views_waiting_together_are_written_together(postgres_db: str) -> None:
    # One statement lane: while one statement runs, the others wait and are then run as a batch.
    async with _replicas(postgres_db, _settings(statement_lanes=1)) as (folded, plain):
        watcher = Collector(plain.bus)
        await watcher.started()
        engine, store = folded.engine, folded.store
        sessions = [await _session(engine) for _ in range(12)]
        for i, sid in enumerate(sessions):
            await engine.append(ALICE, sid, _rows(f"turn of {i}"), request_id="", turn_complete=False)
        views = await asyncio.gather(*(_build(folded, s) for s in sessions))
        assert store._view_group.grouped >= 2 and store._view_group.failed == 0
        for sid, view in zip(sessions, views, strict=True):
            record = await store.get_view(sid, view.view_id)
            assert record is not None and record.estimated_tokens == view.estimate.total
        # Saved together with a view of a session another replica deleted: only that one fails.
        gone = await _session(engine)
        await plain.engine.sessions.delete(ALICE, gone)
        now = datetime.now(UTC)
        saves = [(sid, ViewRecord(f"extra-{k}", "hp", 10, k, False, 1, now)) for k, sid in enumerate(sessions)]
        saves.insert(5, (gone, ViewRecord("extra-gone", "hp", 10, 99, False, 1, now)))
        grouped = store._view_group.grouped
        outcomes = await asyncio.gather(
            *(store.save_view(sid, record, keep=8) for sid, record in saves), return_exceptions=True
        )
        assert store._view_group.grouped >= grouped + 2
        assert [isinstance(o, NotFound) for o in outcomes] == [sid == gone for sid, _ in saves]
        for sid, record in saves:
            if sid != gone:
                assert await store.get_view(sid, record.view_id) == record

        # Another replica changes one session: its anchor is refused within the batch and taken
        # the usual way; the others are written together.
        changed = sessions[3]
        await plain.store.update_state(changed, caller=ALICE, state={"epoch": 0, "other": "writer"})
        before = await _observations(store)
        counts = {sid: 1000 + k for k, sid in enumerate(sessions)}
        results = await asyncio.gather(
            *(
                engine.record_baseline(ALICE, sid, view_id=view.view_id, prompt_tokens=counts[sid])
                for sid, view in zip(sessions, views, strict=True)
            )
        )
        assert all(r.recorded for r in results)
        assert store._anchor_group.grouped >= 2 and store._anchor_group.failed == 0
        assert sorted(await _observations(store)) == sorted([*before, *counts.values()])  # each once
        for sid, view in zip(sessions, views, strict=True):
            session = await store.get_session(sid, caller=ALICE)
            assert session.context_tokens == counts[sid]
            assert session.state["baseline"]["view_id"] == view.view_id
        assert (await store.get_session(changed, caller=ALICE)).state["other"] == "writer"

        def recorded() -> list[StoredEvent]:
            return [e for e in watcher.events if e.kind == "baseline_recorded"]

        await until(lambda: len(recorded()) >= len(sessions))
        ids = [e.event_id for e in recorded()]
        assert ids == list(range(ids[0], ids[0] + len(sessions)))  # in order, no gap
        assert sorted(dict(e.payload)["prompt_tokens"] for e in recorded()) == sorted(counts.values())
        await asyncio.sleep(0.3)
        assert len(recorded()) == len(sessions)  # each once
        await watcher.stop()


async def test_trims_racing_each_other_and_observations_never_deadlock(postgres_db: str) -> None:
    # Every anchored observation trims (trim_every 1) while plain observations trim in their own
    # statement: the trims' row sets overlap all the time. SKIP LOCKED: none waits for another.
    keep = 5
    settings = _settings(calibration_keep=keep, calibration_trim_every=1)
    async with _replicas(postgres_db, settings) as (folded, plain):
        engine, store = folded.engine, folded.store
        sessions = [await _session(engine) for _ in range(8)]
        for sid in sessions:
            await engine.append(ALICE, sid, _rows("one"), request_id="", turn_complete=False)

        async def anchors(sid: str) -> None:
            for i in range(6):
                read = await store.get_session(sid, caller=ALICE)
                write = BaselineWrite("hp", Observation(chars=10, tokens=i + 1, features=()), "baseline_recorded", {})
                state = {**read.state, "i": i}
                assert await store.anchor_baseline(
                    sid, caller=ALICE, read=read, context_tokens=i + 1, state=state, write=write
                )

        async def observations(k: int) -> None:
            for _ in range(6):
                await plain.store.add_calibration_observation("hp", Observation(chars=10, tokens=100 + k, features=()))

        async with asyncio.timeout(30):
            await asyncio.gather(*(anchors(s) for s in sessions), *(observations(k) for k in range(4)))
        assert len(await _observations(store)) <= keep + 1


async def test_a_trim_that_fails_leaves_the_baseline_recorded_and_trims_next_time(
    postgres_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Whatever level an earlier test left the root logger at (``logs.configure``), the warning is seen.
    caplog.set_level(logging.WARNING)
    keep, every = 2, 2
    settings = _settings(calibration_keep=keep, calibration_trim_every=every)
    async with _replicas(postgres_db, settings) as (folded, _plain):
        store = folded.store
        sid = await _session(folded.engine)
        await folded.engine.append(ALICE, sid, _rows("one"), request_id="", turn_complete=False)
        trim = store._trim
        failures = [Conflict("concurrent update, retry: deadlock detected")]

        async def failing_once(model: str, conn: Any) -> None:
            if failures:
                raise failures.pop()
            await trim(model, conn)

        store._trim = failing_once  # type: ignore[method-assign]
        for i in range(1, 4):
            read = await store.get_session(sid, caller=ALICE)
            write = BaselineWrite("hp", Observation(chars=10, tokens=i, features=()), "baseline_recorded", {})
            got = await store.anchor_baseline(
                sid, caller=ALICE, read=read, context_tokens=i, state={**read.state, "i": i}, write=write
            )
            assert got is not None and got.context_tokens == i  # recorded, the failed trim or not
        assert not failures and "not trimmed" in caplog.text
        # The second write's trim failed; the third tried again.
        assert await _observations(store) == [2, 3]


async def test_a_trim_skips_rows_another_trim_holds_instead_of_waiting(postgres_db: str) -> None:
    keep = 3
    settings = _settings(calibration_keep=keep, calibration_trim_every=1)
    async with _replicas(postgres_db, settings) as (folded, _plain):
        await _trim_skipping(postgres_db, folded)


async def _trim_skipping(postgres_db: str, folded: Counted) -> None:
    holder = await asyncpg.connect(postgres_db)
    try:
        store = folded.store
        await holder.execute(
            """INSERT INTO calibration_observations (model, chars, tokens, had_images, create_time, features)
               SELECT 'hp', 10, g, false, now(), '{}' FROM generate_series(0, 9) AS g"""
        )
        sid = await _session(folded.engine)
        await folded.engine.append(ALICE, sid, _rows("one"), request_id="", turn_complete=False)
        # Another trim, under way: it holds the two oldest rows it is deleting.
        tx = holder.transaction()
        await tx.start()
        oldest = await holder.fetch(
            "SELECT observation_id FROM calibration_observations ORDER BY observation_id LIMIT 2 FOR UPDATE"
        )
        assert len(oldest) == 2
        read = await store.get_session(sid, caller=ALICE)
        write = BaselineWrite("hp", Observation(chars=10, tokens=99, features=()), "baseline_recorded", {})
        async with asyncio.timeout(5):  # waiting for the holder would be a deadlock waiting to happen
            got = await store.anchor_baseline(
                sid, caller=ALICE, read=read, context_tokens=99, state={**read.state, "x": 1}, write=write
            )
        assert got is not None
        # Trimmed to the newest three, but for the two rows the other trim holds (it deletes them).
        assert await _observations(store) == [0, 1, 8, 9, 99]
        await tx.rollback()
    finally:
        await holder.close()
