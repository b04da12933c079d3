"""A watcher whose session was deleted while it was away resumes up to the deletion: it reads the
events it missed and ``session_deleted``, as DESIGN §5 promises a resume "without gaps" within
retention. Without a resume point, after the deletion, as another user, or once the bus has let
the deletion go, the session is NOT_FOUND as before."""

from __future__ import annotations

import asyncio

import pytest

from contextsvc.config import Settings
from contextsvc.core.session import Principal
from contextsvc.engine.engine import Engine
from contextsvc.errors import NotFound
from contextsvc.events.memory_bus import MemoryEventBus
from contextsvc.ports import StoredEvent
from contextsvc.stores.memory import MemoryStore
from tests.support.compaction_harness import u
from tests.support.engines import make_engine

ALICE = Principal("alice")
BOB = Principal("bob")
ADMIN = Principal("root", is_admin=True)


async def _read_all(engine: Engine, caller: Principal, sid: str, after: int) -> list[StoredEvent]:
    """Every event the stream yields up to and including ``session_deleted`` (bounded)."""
    got: list[StoredEvent] = []

    async def run() -> None:
        async for event in engine.sessions.events(caller, session_id=sid, after_event_id=after):
            got.append(event)
            if event.kind == "session_deleted":
                return

    await asyncio.wait_for(run(), 5)
    return got


async def _session_deleted_while_away(engine: Engine) -> tuple[str, int]:
    """A session with one append the watcher saw, then one it missed, then its deletion."""
    s = await engine.sessions.create(ALICE, profile_id="", name="", metadata={})
    await engine.append(ALICE, s.id, [u("seen")], request_id="", turn_complete=False)
    seen = await _first_event(engine, s.id)
    await engine.append(ALICE, s.id, [u("missed")], request_id="", turn_complete=False)
    await engine.sessions.delete(ALICE, s.id)
    return s.id, seen.event_id


async def _first_event(engine: Engine, sid: str) -> StoredEvent:
    """The session's first event, read from the start of the retained log."""
    stream = engine.sessions.events(ALICE, session_id=sid, after_event_id=1)
    try:
        return await asyncio.wait_for(anext(stream), 5)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def test_a_watcher_resumes_a_session_deleted_while_it_was_away_up_to_the_deletion() -> None:
    engine = make_engine(MemoryStore(Settings()), Settings())
    sid, seen = await _session_deleted_while_away(engine)
    got = await _read_all(engine, ALICE, sid, seen)
    assert [e.kind for e in got] == ["messages_appended", "session_deleted"]
    assert all(e.event_id > seen for e in got) and got[0].event_id < got[1].event_id
    # An admin may read it too (as any of the user's streams).
    assert [e.kind for e in await _read_all(engine, ADMIN, sid, seen)] == ["messages_appended", "session_deleted"]
    await engine.close()


@pytest.mark.parametrize("who", ["past the deletion", "no resume point", "another user"])
async def test_a_deleted_session_stays_not_found_where_nothing_is_left_to_read(who: str) -> None:
    engine = make_engine(MemoryStore(Settings()), Settings())
    sid, seen = await _session_deleted_while_away(engine)
    deletion = (await _read_all(engine, ALICE, sid, seen))[-1].event_id
    caller, after = {
        "past the deletion": (ALICE, deletion),
        "no resume point": (ALICE, 0),
        "another user": (BOB, seen),
    }[who]
    with pytest.raises(NotFound):
        await _read_all(engine, caller, sid, after)
    await engine.close()


async def test_the_deletion_is_let_go_with_the_retained_log() -> None:
    """Once other sessions' traffic pushed the deletion out of the bus's log, a resume is NOT_FOUND
    (the events it would replay are gone too), and the bus keeps no entry for it."""
    bus = MemoryEventBus(retention=8)
    engine = make_engine(MemoryStore(Settings()), Settings(), bus=bus)
    sid, seen = await _session_deleted_while_away(engine)
    assert (await bus.retained_deletion(sid)) is not None
    other = await engine.sessions.create(ALICE, profile_id="", name="", metadata={})
    for i in range(8):
        await engine.append(ALICE, other.id, [u(f"m{i}")], request_id="", turn_complete=False)
    assert (await bus.retained_deletion(sid)) is None
    with pytest.raises(NotFound):
        await _read_all(engine, ALICE, sid, seen)
    await engine.close()
