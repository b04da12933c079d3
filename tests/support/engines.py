"""One way to build an engine over a store for tests that drive the engine without a server."""

from __future__ import annotations

from contextsvc.config import Settings
from contextsvc.engine.engine import Engine
from contextsvc.events.memory_bus import MemoryEventBus
from contextsvc.ports import Clock, EventBus, SessionStore
from contextsvc.summarizers.registry import build_summarizers
from tests.support.stores import TickingClock


def make_engine(
    store: SessionStore,
    settings: Settings,
    *,
    bus: EventBus | None = None,
    clock: Clock | None = None,
    retention: int = 100,
) -> Engine:
    """An engine with the settings' summarizers, an in-memory bus keeping ``retention`` events
    (unless ``bus`` is given) and a deterministic clock (unless ``clock`` is given)."""
    return Engine(
        store=store,
        bus=bus if bus is not None else MemoryEventBus(retention=retention),
        settings=settings,
        clock=clock if clock is not None else TickingClock(),
        summarizers=build_summarizers(settings),
    )
