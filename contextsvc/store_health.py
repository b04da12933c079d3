"""The health service tells the truth about the store (issue #9).

Every ``store_health_interval_seconds`` the server asks its store for ``health_check()`` (the
files store writes and fsyncs a small probe file in its data directory; the PostgreSQL store asks
the database whether it takes writes: reachable, a primary, not read-only) and sets:

* ``contextsvc.v1.ContextService`` and the server-wide ``""`` status: ``NOT_SERVING`` while the
  store cannot write (a read-only or full data directory, a database that is down or read-only),
  ``SERVING`` again once a probe succeeds. Reads still work meanwhile; a balancer should send writers elsewhere.
* ``contextsvc.store.integrity``: ``NOT_SERVING`` while any session is damaged (read-only,
  ``SESSION_DAMAGED``; ``contextsvc fsck --repair`` clears it). The service itself stays
  ``SERVING`` for this: every other session works, and pulling the replica would take them
  all away. It is the "degraded" signal for an operator's alert.

The memory store has no ``health_check`` and is not polled. A store that can tell when a
session is found damaged (the files store's ``damage_changed``, set when a log read on first use or
checked after a sealed start turns out damaged) has the integrity status updated at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

log = logging.getLogger(__name__)

INTEGRITY_SERVICE = "contextsvc.store.integrity"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class StoreHealthWatcher:
    """Polls ``store.health_check()`` and mirrors it into the health servicer."""

    def __init__(self, health: health_aio.HealthServicer, store: Any, service: str, interval: float) -> None:
        self._health = health
        self._check = getattr(store, "health_check", None)
        self._service = service
        self._interval = interval
        self._task: asyncio.Task[None] | None = None
        self._damage_task: asyncio.Task[None] | None = None
        self._damage_event: asyncio.Event | None = getattr(store, "damage_changed", None)
        self._count_damaged = getattr(store, "damaged_sessions", None)
        self._writable: bool | None = None
        self._damaged: int | None = None

    async def start(self) -> None:
        """One check now (before anyone is told SERVING wrongly for long), then in the background."""
        if self._check is None:
            return
        await self.check_once()
        self._task = asyncio.create_task(self._loop(), name="contextsvc-store-health")
        if self._damage_event is not None and self._count_damaged is not None:
            self._damage_task = asyncio.create_task(self._damage_loop(), name="contextsvc-store-damage")

    async def stop(self) -> None:
        for task in (self._task, self._damage_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._damage_task = None

    async def check_once(self) -> None:
        if self._check is None:
            return
        report = await self._check()
        if report.writable != self._writable:
            status = _SERVING if report.writable else _NOT_SERVING
            for name in ("", self._service):
                await self._health.set(name, status)
            if report.writable:
                if self._writable is not None:
                    log.warning("store writable again: health SERVING")
            else:
                log.error("store cannot write: health NOT_SERVING", extra={"detail": report.detail})
            self._writable = report.writable
        await self._integrity(report.damaged_sessions)

    async def _integrity(self, damaged: int) -> None:
        if damaged != self._damaged:
            await self._health.set(INTEGRITY_SERVICE, _NOT_SERVING if damaged else _SERVING)
            if damaged:
                log.error("damaged sessions are read-only; run contextsvc fsck", extra={"damaged_sessions": damaged})
            self._damaged = damaged

    async def _damage_loop(self) -> None:
        assert self._damage_event is not None and self._count_damaged is not None
        while True:
            await self._damage_event.wait()
            self._damage_event.clear()
            await self._integrity(self._count_damaged())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.check_once()
            except Exception:  # a failing check must not end the watcher
                log.exception("store health check failed")
