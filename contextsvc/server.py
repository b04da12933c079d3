"""Server bootstrap: wire store, bus, summarizers and engine into a grpc.aio server; stop gracefully."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from contextsvc import __version__, telemetry
from contextsvc._gen.v1 import context_service_pb2
from contextsvc.api.auth import AuthInterceptor
from contextsvc.api.decoding import DecodeGuard
from contextsvc.api.health import HealthService
from contextsvc.api.servicer import ContextServicer, add_to_server
from contextsvc.clock import SystemClock
from contextsvc.config import Settings
from contextsvc.engine.authn import Authenticator
from contextsvc.engine.engine import Engine
from contextsvc.events.memory_bus import MemoryEventBus
from contextsvc.ports import EventBus, SessionStore
from contextsvc.stores import open_store
from contextsvc.stores.token_access import server_token_store
from contextsvc.summarizers.registry import build_summarizers
from contextsvc.transport import CertificateReloader, Transport, check_transport

log = logging.getLogger(__name__)

SERVICE_NAME = context_service_pb2.DESCRIPTOR.services_by_name["ContextService"].full_name


@dataclass(slots=True)
class RunningServer:
    server: grpc.aio.Server
    health: health_aio.HealthServicer
    engine: Engine
    store: SessionStore
    bus: EventBus
    port: int
    transport: Transport | None = None
    authenticator: Authenticator | None = None
    certificates: CertificateReloader | None = None
    #: closes what authentication opened (a separate token store), before the store closes.
    auth_resources: AsyncExitStack = field(default_factory=AsyncExitStack)

    def reload_certificates(self) -> None:
        """SIGHUP: read the TLS certificate, key and client CAs again (no-op without TLS)."""
        if self.certificates is not None:
            self.certificates.reload()


def _make_bus(settings: Settings, store: SessionStore) -> EventBus:
    """Replicas sharing PostgreSQL share its event bus; otherwise events stay in this process."""
    make_shared: Callable[[], EventBus] | None = getattr(store, "make_event_bus", None)
    if make_shared is not None:
        return make_shared()
    return MemoryEventBus(retention=settings.event_retention)


async def start(settings: Settings) -> RunningServer:
    transport = check_transport(settings)  # refuses before anything is opened
    certificates = (
        CertificateReloader(settings.tls_cert, settings.tls_key, settings.tls_client_ca) if transport.tls else None
    )
    # Before anything opens a connection: the asyncpg/httpx instrumentations patch at install time.
    tel = telemetry.configure(service_version=__version__)
    store = open_store(settings.store, settings)
    await store.open()
    auth_resources = AsyncExitStack()
    authenticator: Authenticator | None = None
    if transport.auth_required:
        try:
            tokens = await auth_resources.enter_async_context(server_token_store(store, settings))
        except BaseException:
            await store.close()
            raise
        authenticator = Authenticator(tokens, settings.auth, SystemClock())
    bus = _make_bus(settings, store)
    engine = Engine(
        store=tel.wrap_store(store),
        bus=tel.wrap_bus(bus),
        settings=settings,
        clock=SystemClock(),
        summarizers=tel.wrap_summarizers(build_summarizers(settings)),
    )
    limits = settings.limits
    server = grpc.aio.server(
        # Telemetry outermost, so refused calls are measured and traced too.
        interceptors=[
            *tel.server_interceptors(),
            DecodeGuard(log_per_minute=settings.refusal_log_per_minute),
            AuthInterceptor(authenticator),
        ],
        options=[
            ("grpc.max_receive_message_length", limits.grpc_max_receive_bytes),
            ("grpc.max_send_message_length", limits.grpc_max_send_bytes),
            # gRPC sets SO_REUSEPORT by default, which lets a second server share our port and
            # split the traffic silently (issue #9): a port in use must be refused.
            ("grpc.so_reuseport", 0),
        ],
    )
    add_to_server(ContextServicer(engine), server)
    health = HealthService()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    try:
        if certificates is not None:
            port = server.add_secure_port(settings.listen, certificates.credentials())
        else:
            port = server.add_insecure_port(settings.listen)
    except RuntimeError as exc:
        await auth_resources.aclose()
        await store.close()
        raise OSError(f"cannot listen on {settings.listen}: {exc}") from None
    await server.start()
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(
        server=server,
        health=health,
        engine=engine,
        store=store,
        bus=bus,
        port=port,
        transport=transport,
        authenticator=authenticator,
        certificates=certificates,
        auth_resources=auth_resources,
    )


async def stop(running: RunningServer, grace: float) -> None:
    """Health NOT_SERVING first so balancers drain us, then finish in-flight calls, then close."""
    for name in ("", SERVICE_NAME):
        await running.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await running.server.stop(grace)
    await running.engine.close()
    await running.bus.close()
    if running.authenticator is not None:
        await running.authenticator.close()
    await running.auth_resources.aclose()
    await running.store.close()
    # Flush what the last calls recorded; a no-op when telemetry is off.
    telemetry.current().shutdown()


async def serve(settings: Settings) -> None:
    running = await start(settings)
    host = settings.listen.rpartition(":")[0]
    # Tests and scripts read this line to learn the port when listening on port 0.
    print(f"contextsvc listening on {host}:{running.port} (store: {settings.store})", flush=True)
    log.info(
        "serving",
        extra={
            "listen": f"{host}:{running.port}",
            "store": settings.store,
            "transport": running.transport.describe() if running.transport else "",
        },
    )
    gateway = None
    if settings.gateway.listen:
        # The bundled gateway is still a gRPC client of this server, over loopback.
        from contextsvc.gateway.server import announce, start_gateway

        target_host = "127.0.0.1" if host in ("0.0.0.0", "", "[::]", "::") else host
        try:
            gateway = await start_gateway(settings, settings.gateway.listen, f"{target_host}:{running.port}")
        except OSError:
            await stop(running, 0)
            raise
        announce(settings.gateway.listen, gateway.port)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    loop.add_signal_handler(signal.SIGHUP, running.reload_certificates)
    await stopping.wait()
    log.info("stopping", extra={"grace_seconds": settings.shutdown_grace_seconds})
    if gateway is not None:
        await gateway.close()
    await stop(running, settings.shutdown_grace_seconds)
    log.info("stopped")
