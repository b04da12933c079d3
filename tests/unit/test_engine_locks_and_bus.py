"""Bounded in-process state: per-session compaction locks and slow event watchers."""

from __future__ import annotations

import asyncio

import pytest

from contextsvc.config import Settings
from contextsvc.core.session import ANONYMOUS
from contextsvc.errors import Unavailable
from contextsvc.events import memory_bus
from contextsvc.events.memory_bus import MemoryEventBus
from contextsvc.stores.memory import MemoryStore
from tests.support.engines import make_engine


async def test_compaction_locks_are_dropped_once_nobody_holds_or_waits() -> None:
    settings = Settings(store="memory")
    store = MemoryStore(settings)
    await store.open()
    engine = make_engine(store, settings, retention=10)
    order: list[str] = []

    async def hold(tag: str, delay: float) -> None:
        async with engine.compactor.lock("s1"):
            order.append(f"{tag}-in")
            await asyncio.sleep(delay)
            order.append(f"{tag}-out")

    await asyncio.gather(hold("a", 0.05), hold("b", 0.0))
    assert order == ["a-in", "a-out", "b-in", "b-out"]  # serialized
    assert engine.compactor._locks == {}  # nothing left behind for the session
    await engine.close()


async def test_a_watcher_that_falls_behind_gets_unavailable_and_other_sessions_never_fill_its_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory_bus, "_SUBSCRIBER_QUEUE", 5)
    bus = MemoryEventBus(retention=100)
    stream = bus.subscribe(caller=ANONYMOUS, session_id="watched")
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    for i in range(50):  # traffic of another session: never queued for this watcher
        await bus.publish(session_id="other", user_id="anonymous", kind="k", payload={"i": i})
    await bus.publish(session_id="watched", user_id="anonymous", kind="k", payload={"i": 0})
    assert (await first).payload == {"i": 0}
    for i in range(10):  # now it lags on its own session's events
        await bus.publish(session_id="watched", user_id="anonymous", kind="k", payload={"i": i})
    with pytest.raises(Unavailable) as err:
        for _ in range(20):
            await stream.__anext__()
    assert "after_event_id" in err.value.message
    await bus.close()
