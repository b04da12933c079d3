"""The WebSocket gateway for browsers and the inspector page (DESIGN §5.9, docs/websocket.md)."""

from __future__ import annotations

import asyncio
import logging
import signal

from contextsvc.config import Settings

log = logging.getLogger(__name__)


async def run(settings: Settings) -> None:
    """``contextsvc gateway``: the gateway alone, calling the service at ``settings.gateway.target``."""
    from contextsvc import __version__, telemetry
    from contextsvc.gateway.server import announce, start_gateway

    # The standard OTEL_* variables, as for the server: spans of the calls it makes to the service.
    telemetry.configure(service_version=__version__)
    listen = settings.gateway.listen or "127.0.0.1:8080"
    # Before the start: a SIGTERM or Ctrl-C while it binds closes the gateway once it is up, exit 0.
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    gateway = await start_gateway(settings, listen, settings.gateway.target)
    if stopping.is_set():
        await gateway.close()
        return
    announce(listen, gateway.port, gateway.scheme)
    log.info(
        "gateway serving",
        extra={
            "listen": listen,
            "target": settings.gateway.target,
            "listener_tls": gateway.tls is not None,
            "target_tls": gateway.upstream.tls is not None,
        },
    )
    loop.add_signal_handler(signal.SIGHUP, gateway.reload_certificates)
    await stopping.wait()
    await gateway.close()
    # Flush what the last calls recorded (a no-op when off), not waiting on an unreachable collector.
    telemetry.current().shutdown(settings.shutdown_grace_seconds)
    log.info("gateway stopped")
