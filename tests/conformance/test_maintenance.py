"""Store maintenance over every store: the same plan removes the same sessions (DESIGN §5.7)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from contextsvc.config import MaintenanceSettings
from contextsvc.engine.maintenance import run_maintenance
from contextsvc.errors import NotFound
from contextsvc.events.memory_bus import MemoryEventBus
from contextsvc.ports import SessionStore
from tests.conformance.helpers import ADMIN, ALICE, user
from tests.support.stores import TickingClock

# The conformance clock starts on 2026-01-01: every session here is months idle by then.
NOW = datetime(2026, 6, 1, tzinfo=UTC)


async def test_maintenance_removes_idle_sessions_never_pinned_or_streamed_ones(
    store: SessionStore, clock: TickingClock
) -> None:
    ids = []
    for k in range(4):
        sid = (await store.create_session(caller=ALICE, profile_id="p", name=f"s{k}")).id
        await store.append_messages(sid, [user("x" * 100)], caller=ALICE)
        ids.append(sid)
    pinned, idle, streamed, _ = ids
    await store.update_session(pinned, caller=ALICE, pinned=True)
    bus = MemoryEventBus(retention=10)
    candidates, _other = await store.maintenance_candidates(())  # type: ignore[attr-defined]
    assert {c.session_id for c in candidates} == set(ids)
    assert all(c.size_bytes > 0 and c.user_id == "alice" for c in candidates)

    warn = await run_maintenance(store, bus, MaintenanceSettings(max_sessions=9), now=NOW, busy={streamed})
    assert warn is not None and {r.session_id for r in warn.removals} == {idle, ids[3]}
    assert len((await store.list_sessions(caller=ADMIN, offset=0, limit=10)).sessions) == 4  # warn: only told

    done = await run_maintenance(store, bus, MaintenanceSettings(mode="enforce"), now=NOW, busy={streamed})
    assert done is not None and sorted(r.session_id for r in done.removals) == sorted([idle, ids[3]])
    for sid in (idle, ids[3]):
        with pytest.raises(NotFound):
            await store.get_session(sid, caller=ALICE)
    for sid in (pinned, streamed):
        assert (await store.get_session(sid, caller=ALICE)).id == sid
