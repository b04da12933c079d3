"""The health service's view of the store (``store_health.StoreHealthWatcher``): the probe on its
interval, and a session found damaged while serving reported at once (issue #9)."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from contextsvc.store_health import INTEGRITY_SERVICE, StoreHealthWatcher
from contextsvc.stores.files import StoreHealth

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Store:
    def __init__(self) -> None:
        self.damaged = 0
        self.probes = 0
        self.damage_changed = asyncio.Event()

    async def health_check(self) -> StoreHealth:
        self.probes += 1
        return StoreHealth(writable=True, damaged_sessions=self.damaged)

    def damaged_sessions(self) -> int:
        return self.damaged


async def _status(health: health_aio.HealthServicer, service: str) -> int:
    response = await health.Check(health_pb2.HealthCheckRequest(service=service), None)
    return int(response.status)


async def test_a_session_found_damaged_is_reported_without_waiting_for_the_probe() -> None:
    health = health_aio.HealthServicer()
    store = Store()
    watcher = StoreHealthWatcher(health, store, "contextsvc.v1.ContextService", interval=3600)
    await watcher.start()
    try:
        assert await _status(health, INTEGRITY_SERVICE) == SERVING and store.probes == 1
        store.damaged = 1
        store.damage_changed.set()  # what the files store does when a log read turns out damaged
        for _ in range(100):
            if await _status(health, INTEGRITY_SERVICE) == NOT_SERVING:
                break
            await asyncio.sleep(0.01)
        assert await _status(health, INTEGRITY_SERVICE) == NOT_SERVING
        assert store.probes == 1  # no probe write for it: only the count was read
        assert await _status(health, "contextsvc.v1.ContextService") == SERVING  # degraded, not down
    finally:
        await watcher.stop()


async def test_without_the_event_the_probe_interval_decides() -> None:
    health = health_aio.HealthServicer()
    store = Store()
    del store.damage_changed
    watcher = StoreHealthWatcher(health, store, "contextsvc.v1.ContextService", interval=0.05)
    await watcher.start()
    try:
        store.damaged = 2
        await asyncio.sleep(0.3)
        assert await _status(health, INTEGRITY_SERVICE) == NOT_SERVING and store.probes >= 2
    finally:
        await watcher.stop()
