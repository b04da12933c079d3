"""Bounded in-process state: per-session compaction locks and slow event watchers."""

from __future__ import annotations

import asyncio

import pytest

from contextsvc.config import Settings
from contextsvc.core.session import ANONYMOUS
from contextsvc.errors import EventsExpired
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


async def test_a_watcher_that_falls_behind_catches_up_from_the_log_and_other_sessions_never_wake_it() -> None:
    bus = MemoryEventBus(retention=100)
    stream = bus.subscribe(caller=ANONYMOUS, session_id="watched")
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    for i in range(50):  # traffic of another session: the watcher stays asleep
        await bus.publish(session_id="other", user_id="anonymous", kind="k", payload={"i": i})
    assert not first.done()
    await bus.publish(session_id="watched", user_id="anonymous", kind="k", payload={"i": 0})
    assert (await first).payload == {"i": 0}
    for i in range(1, 40):  # it lags on its own session's events, within retention: nothing is lost
        await bus.publish(session_id="watched", user_id="anonymous", kind="k", payload={"i": i})
        await bus.publish(session_id="other", user_id="anonymous", kind="k", payload={"i": i})
    got = [(await stream.__anext__()).payload["i"] for _ in range(39)]
    assert got == list(range(1, 40))
    await bus.close()


async def test_a_watcher_whose_unread_events_left_the_log_ends_with_events_expired() -> None:
    bus = MemoryEventBus(retention=10)
    stream = bus.subscribe(caller=ANONYMOUS, session_id="watched")
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    await bus.publish(session_id="watched", user_id="anonymous", kind="k", payload={"i": 0})
    delivered = await first
    for i in range(1, 4):  # unread by the watcher...
        await bus.publish(session_id="watched", user_id="anonymous", kind="k", payload={"i": i})
    for i in range(20):  # ...and pushed out of the log by another session's traffic
        await bus.publish(session_id="other", user_id="anonymous", kind="k", payload={"i": i})
    with pytest.raises(EventsExpired) as err:
        await stream.__anext__()  # never a silent skip to what is still kept
    assert err.value.metadata["after_event_id"] == str(delivered.event_id)
    assert int(err.value.metadata["lost_event_id"]) == delivered.event_id + 1
    await bus.close()


async def test_other_sessions_pushing_only_invisible_events_out_of_the_log_cost_a_watcher_nothing() -> None:
    bus = MemoryEventBus(retention=10)
    stream = bus.subscribe(caller=ANONYMOUS, session_id="watched")
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    for i in range(50):
        await bus.publish(session_id="other", user_id="anonymous", kind="k", payload={"i": i})
    await bus.publish(session_id="watched", user_id="anonymous", kind="k", payload={"i": 0})
    assert (await first).payload == {"i": 0}
    await bus.close()


@pytest.mark.parametrize("back", [0, 1, 12_345])
async def test_a_resume_on_a_bus_that_has_published_nothing_waits_for_the_first_event(back: int) -> None:
    # A restarted replica's bus holds no event yet, and ids below where its clock started name none
    # of its own: the watcher waits (it raised IndexError, INTERNAL, from an empty log).
    bus = MemoryEventBus(retention=10)
    start = bus._next_id - back
    stream = bus.subscribe(caller=ANONYMOUS, after_event_id=start)
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    assert not first.done()
    event = await bus.publish(session_id="s", user_id="anonymous", kind="k", payload={"i": 1})
    assert (await asyncio.wait_for(first, 1)).event_id == event.event_id
    await bus.close()
