"""The health service tells the truth about the store (issue #9).

Every ``store_health_interval_seconds`` the server asks its store for ``health_check()`` (the
files store writes and fsyncs a small probe file in its data directory) and sets:

* ``contextsvc.v1.ContextService`` and the server-wide ``""`` status: ``NOT_SERVING`` while the
  store cannot write (a read-only or full data directory), ``SERVING`` again once a probe
  succeeds. Reads still work meanwhile; a balancer should send writers elsewhere.
* ``contextsvc.store.integrity``: ``NOT_SERVING`` while any session is damaged (read-only,
  ``SESSION_DAMAGED``; ``contextsvc fsck --repair`` clears it). The service itself stays
  ``SERVING`` for this: every other session works, and pulling the replica would take them
  all away. It is the "degraded" signal for an operator's alert.

Stores without ``health_check`` (memory, PostgreSQL) are not polled.
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
        self._writable: bool | None = None
        self._damaged: int | None = None

    async def start(self) -> None:
        """One check now (before anyone is told SERVING wrongly for long), then in the background."""
        if self._check is None:
            return
        await self.check_once()
        self._task = asyncio.create_task(self._loop(), name="contextsvc-store-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

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
        if report.damaged_sessions != self._damaged:
            await self._health.set(INTEGRITY_SERVICE, _NOT_SERVING if report.damaged_sessions else _SERVING)
            if report.damaged_sessions:
                log.error(
                    "damaged sessions are read-only; run contextsvc fsck",
                    extra={"damaged_sessions": report.damaged_sessions},
                )
            self._damaged = report.damaged_sessions

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.check_once()
            except Exception:  # a failing check must not end the watcher
                log.exception("store health check failed")
