"""Issue #15 item 6, fewer round trips a turn: the post-turn check a baseline queues for a session
near a compaction level judges the session as the baseline's anchor wrote it, with the context
this replica read for the view's build (``PostgresStore.context_as_read``): no statement. Without
that context held (another version, or no cache) it reads both in one statement, as before; and
either way it decides as a check that reads them does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from contextsvc.core.messages import Message, Role
from contextsvc.core.profile import ProfileOverrides
from contextsvc.core.session import Principal
from contextsvc.engine.engine import Engine
from contextsvc.engine.state import EngineState
from contextsvc.engine.validation import IncomingMessage
from contextsvc.engine.views import BuiltView
from contextsvc.stores.postgres import PostgresStore, make_postgres_event_bus, make_postgres_store
from tests.postgres.conftest import two_profile_settings
from tests.support.engines import make_engine

ALICE = Principal(user_id="alice")
READS = ("context_and_session", "load_context")


class Reads:
    """Counts a store's context reads (each one statement on PostgreSQL)."""

    def __init__(self, store: PostgresStore) -> None:
        self.count = 0
        for name in READS:
            method = getattr(store, name)

            async def counted(*a: Any, _method: Any = method, **k: Any) -> Any:
                self.count += 1
                return await _method(*a, **k)

            setattr(store, name, counted)


@asynccontextmanager
async def _replica(postgres_db: str, *, folded: bool, cache_mb: float = 64.0) -> AsyncIterator[tuple[Engine, Reads]]:
    """An engine on its own store: the store's own bus (``folded``: the anchor, observation and
    event in one statement) or a bus of its own (the anchor alone: ``update_state_if_unchanged``)."""
    base = two_profile_settings()
    settings = base.model_copy(update={"postgres": base.postgres.model_copy(update={"context_cache_mb": cache_mb})})
    store = await make_postgres_store(postgres_db, settings)
    bus = store.make_event_bus() if folded else await make_postgres_event_bus(postgres_db, settings)
    engine = make_engine(store, settings, bus=bus)
    try:
        yield engine, Reads(store)
    finally:
        await engine.close()
        await bus.close()
        await store.close()


def _turn(k: int) -> list[IncomingMessage]:
    return [
        IncomingMessage(Message(role=Role.USER, content=f"ask {k}: " + "where did the deploy fail? " * 6)),
        IncomingMessage(Message(role=Role.ASSISTANT, content=f"answer {k}: " + "the migration timed out. " * 30)),
    ]


async def _near_a_level(engine: Engine) -> str:
    """A new session grown past half its lowest compaction level."""
    sid = (await engine.sessions.create(ALICE, profile_id="small", name="", metadata={})).id
    info = await engine.store.get_session(sid, caller=ALICE)
    bounds = engine.compactor.bounds(await engine._profile_for(info, None))
    k = 0
    while 2 * (await engine.store.get_session(sid, caller=ALICE)).context_tokens < min(bounds.trigger, bounds.limit):
        assert k < 400
        await engine.append(ALICE, sid, _turn(k), request_id="", turn_complete=False)
        k += 1
    return sid


async def _build(engine: Engine, sid: str) -> BuiltView:
    view = await engine.build_context(
        ALICE, sid, profile=ProfileOverrides(), incoming=None, mid_turn=False, auto_compress=False
    )
    assert await engine.post_turn.drain(5)
    return view


async def _checked_reads(engine: Engine, reads: Reads, sid: str, prompt_tokens: int) -> int:
    """Context reads from a baseline of a fresh build of ``sid`` through its post-turn check."""
    view = await _build(engine, sid)
    before = reads.count
    result = await engine.record_baseline(
        ALICE, sid, view_id=view.view_id, prompt_tokens=prompt_tokens or view.estimate.total + 7
    )
    assert result.recorded
    assert await engine.post_turn.drain(5)
    return reads.count - before


async def test_the_check_after_a_baseline_near_a_level_reads_nothing(postgres_db: str) -> None:
    for folded in (True, False):
        async with _replica(postgres_db, folded=folded) as (engine, reads):
            sid = await _near_a_level(engine)
            assert engine.post_turn  # the check runs in this process's worker
            assert await _checked_reads(engine, reads, sid, 0) == 0, folded
            # Queued by anything else, the check reads the context as before.
            before = reads.count
            engine.post_turn.schedule(sid)
            assert await engine.post_turn.drain(5)
            assert reads.count > before


async def test_without_the_views_context_held_the_check_reads_it_in_one_statement(postgres_db: str) -> None:
    async with _replica(postgres_db, folded=True, cache_mb=0) as (engine, reads):
        sid = await _near_a_level(engine)
        assert await _checked_reads(engine, reads, sid, 0) == 1


async def test_a_baseline_over_the_trigger_is_compacted_by_its_check_without_a_read_before(postgres_db: str) -> None:
    """The check decides on the anchored session and the held context as a reading check does:
    a count past the trigger compacts the session (the compaction reads under its own lock)."""
    for folded in (True, False):
        async with _replica(postgres_db, folded=folded) as (engine, reads):
            sid = await _near_a_level(engine)
            info = await engine.store.get_session(sid, caller=ALICE)
            bounds = engine.compactor.bounds(await engine._profile_for(info, None))
            epoch = EngineState.of(info).epoch
            view = await _build(engine, sid)
            compactions: list[Any] = []
            run = engine.compactor.run

            async def counted(s: Any, _seen: list[Any] = compactions, _run: Any = run, **k: Any) -> Any:
                _seen.append(reads.count)
                return await _run(s, **k)

            engine.compactor.run = counted  # type: ignore[method-assign]
            before = reads.count
            over = bounds.trigger + 500
            assert (await engine.record_baseline(ALICE, sid, view_id=view.view_id, prompt_tokens=over)).recorded
            assert await engine.post_turn.drain(10)
            assert compactions == [before], folded  # compacted, and nothing read before it ran
            after = await engine.store.get_session(sid, caller=ALICE)
            assert EngineState.of(after).epoch == epoch + 1
            assert after.context_tokens < over
