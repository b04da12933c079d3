"""Server bootstrap: wire store, bus, summarizers and engine into a grpc.aio server; stop gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from contextsvc import __version__, telemetry
from contextsvc._gen.v1 import context_service_pb2
from contextsvc.api.auth import AuthInterceptor
from contextsvc.api.auth_limit import FailedAuthLimiter
from contextsvc.api.decoding import Admission, DecodeGuard
from contextsvc.api.gate import ServingGate
from contextsvc.api.health import HealthService
from contextsvc.api.quotas import Quotas
from contextsvc.api.servicer import ContextServicer, add_to_server
from contextsvc.api.wire import WireCache
from contextsvc.clock import SystemClock
from contextsvc.config import Settings, redacted_url
from contextsvc.core.session import Principal
from contextsvc.engine.authn import Authenticator
from contextsvc.engine.compaction import CompressionLog
from contextsvc.engine.engine import Engine
from contextsvc.engine.maintenance import maintenance_loop
from contextsvc.errors import Unavailable
from contextsvc.events.memory_bus import MemoryEventBus
from contextsvc.heap_trim import load_malloc_trim, trim_loop
from contextsvc.ports import EventBus, SessionStore
from contextsvc.startup import DeferredBus, StartupError, open_store_until_ready
from contextsvc.store_health import StoreHealthWatcher
from contextsvc.stores import FilesStore, open_store
from contextsvc.stores.token_access import server_token_store
from contextsvc.summarizers.registry import build_summarizers
from contextsvc.transport import CertificateReloader, Transport, check_bindable, check_transport

log = logging.getLogger(__name__)

SERVICE_NAME = context_service_pb2.DESCRIPTOR.services_by_name["ContextService"].full_name
#: The process itself: SERVING from the moment it listens until it drains, whatever the store
#: does (for liveness and startup probes: a database outage takes a replica out of the Service
#: through ``SERVICE_NAME``, and must not get it restarted).
LIVENESS_NAME = "contextsvc.liveness"
#: the streams that run until their client leaves: a drain ends them after the other calls.
WATCH_METHODS = frozenset({f"/{SERVICE_NAME}/StreamEvents"})


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
    #: admits ContextService calls only while SERVING (not before the store answers, not draining).
    gate: ServingGate = field(default_factory=ServingGate)
    #: retries opening a store that did not answer at start (None when it did).
    opener: asyncio.Task[None] | None = None
    #: mirrors the store's health (writable, damaged sessions) into the health service.
    store_health: StoreHealthWatcher | None = None
    #: the periodic store maintenance run (``engine/maintenance.py``).
    maintenance: asyncio.Task[None] | None = None
    #: the periodic close of compactions a dead replica announced and never ended (PostgreSQL).
    abandoned: asyncio.Task[None] | None = None
    #: hands the C heap's free memory back to the system (``heap_trim.py``; ``serve`` only).
    heap_trim: asyncio.Task[None] | None = None

    def reload_certificates(self) -> None:
        """SIGHUP: read the TLS certificate, key and client CAs again (no-op without TLS)."""
        if self.certificates is not None:
            self.certificates.reload()


def _interceptors(
    tel: telemetry.Telemetry,
    gate: ServingGate,
    authenticator: Authenticator | None,
    quotas: Quotas,
    log_per_minute: int,
    stream_check_seconds: float,
    failures: FailedAuthLimiter | None = None,
) -> list[grpc.aio.ServerInterceptor]:
    """Telemetry outermost, so refused calls are measured and traced too. The serving gate runs
    before authentication (a server whose store is not ready cannot check tokens); quotas after
    it, since they are per authenticated user. Without authentication no auth interceptor runs
    (caller_of() is the local admin) and one guard admits a call past both; with every quota off
    (the default) none is asked: each interceptor and admission costs every call."""
    after_auth: list[Admission] = [quotas] if quotas.enabled else []
    chain: list[grpc.aio.ServerInterceptor] = list(tel.server_interceptors())
    if authenticator is None:
        chain.append(DecodeGuard(log_per_minute=log_per_minute, admissions=[gate, *after_auth]))
        return chain
    chain.append(DecodeGuard(log_per_minute=log_per_minute, admissions=[gate]))
    chain.append(AuthInterceptor(authenticator, stream_check_seconds=stream_check_seconds, failures=failures))
    if after_auth:
        chain.append(DecodeGuard(log_per_minute=log_per_minute, admissions=after_auth, decoding=False))
    return chain


def _failure_limiter(settings: Settings) -> FailedAuthLimiter | None:
    """Failed authentications per peer address (``api/auth_limit.py``); None when switched off."""
    auth = settings.auth
    if not auth.failures_per_peer_per_minute:
        return None
    return FailedAuthLimiter(
        per_minute=auth.failures_per_peer_per_minute,
        max_peers=auth.max_tracked_peers,
        log_per_minute=settings.refusal_log_per_minute,
    )


def _make_bus(settings: Settings, store: SessionStore) -> EventBus:
    """Replicas sharing PostgreSQL share its event bus; otherwise events stay in this process."""
    make_shared: Callable[[], EventBus] | None = getattr(store, "make_event_bus", None)
    if make_shared is not None:
        return make_shared()
    return MemoryEventBus(retention=settings.event_retention)


def share_memory_budget(store: FilesStore, engine: Engine, wire_cache: WireCache) -> None:
    """One memory budget (``files.cache_mb``) for everything held per session touched: the
    store's rows, the encoded messages of the API adapter (counted by the store as the cache
    reports them) and the engine's caches of the rows. A session the store lets go is dropped
    from every cache, or they would keep its rows alive outside the budget (issue #9)."""

    def forget(session_id: str) -> None:
        engine.views.forget(session_id)
        wire_cache.forget_session(session_id)

    store.on_evict = forget
    wire_cache.on_size = store.hold_outside


def check_tokenizer_files(settings: Settings) -> None:
    """Each configured tokenizer file can be read and loads as a tokenizer: one line at start, not
    FAILED_PRECONDITION on every call of its model while health says SERVING. The tokenizer loaded
    here is the one the first count uses (``load_tokenizer`` keeps it): the start pays what that
    call would have; a start without tokenizer files imports nothing of it."""
    if not settings.tokens.tokenizer_files:
        return
    from contextsvc.core.tokens import load_tokenizer

    for model, path in settings.tokens.tokenizer_files.items():
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise StartupError(
                f"tokens.tokenizer_files[{model!r}]: {path} cannot be read: {exc.strerror or exc}"
            ) from None
        try:
            load_tokenizer(path)
        except ValueError as exc:
            why = " ".join(str(exc).split())[:300]
            raise StartupError(f"tokens.tokenizer_files[{model!r}]: {path} is not a tokenizer.json: {why}") from None


#: settings only the files store reads.
FILES_ONLY_SETTINGS = ("durability", "fsync_batch_ms", "files")


def _warn_of_files_settings_unused(settings: Settings) -> None:
    """One warning when settings of the files store were given (a flag, the environment, the file)
    to a server on another store: ``serve --store postgres://… --durability batch`` said nothing,
    and an operator took the durability for set."""
    if settings.store.strip().startswith("files:"):
        return
    given = [name for name in FILES_ONLY_SETTINGS if name in settings.model_fields_set]
    if given:
        log.warning(
            "settings of the files store given to a server on another store are ignored",
            extra={"settings": given, "store": redacted_url(settings.store)},
        )


def _open_failure(exc: Exception) -> str:
    """Why a store did not open, in one line. An entry of the data directory of the wrong kind (a
    file where the store keeps a folder, or the other way round) is named as such: Python's own
    words for it (``[Errno 17] File exists``) do not say what is wrong."""
    path = getattr(exc, "filename", None)
    if isinstance(exc, FileExistsError) and path and not os.path.isdir(path):
        return f"{path} is a file where a directory is expected"
    if isinstance(exc, IsADirectoryError) and path:
        return f"{path} is a directory where a file is expected"
    return " ".join(str(exc).split())


async def start(settings: Settings, *, freeze: bool = False) -> RunningServer:
    """Open the store and start listening. ``freeze`` (the ``serve`` process, which lives with
    what it made here): see ``_freeze_startup_objects``."""
    transport = check_transport(settings)  # refuses before anything is opened
    # A port in use is one line before the store opens (a files store may take seconds to load).
    check_bindable(settings.listen)
    check_tokenizer_files(settings)
    _warn_of_files_settings_unused(settings)
    certificates = (
        CertificateReloader(settings.tls_cert, settings.tls_key, settings.tls_client_ca) if transport.tls else None
    )
    if certificates is not None:
        certificates.warn_if_expired()
    # Before anything opens a connection: the asyncpg/httpx instrumentations patch at install time.
    tel = telemetry.configure(service_version=__version__, slow_store_ms=settings.telemetry_slow_store_ms)
    try:
        store = open_store(settings.store, settings)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    gate = ServingGate(watch_methods=WATCH_METHODS)
    first_error: Unavailable | None = None
    try:
        await store.open()
    except Unavailable as exc:
        # Transient (PostgreSQL not up yet): listen NOT_SERVING and keep trying (contextsvc/startup.py).
        first_error = exc
    except Exception as exc:
        named = redacted_url(settings.store)
        raise StartupError(f"cannot open the store {named}: {_open_failure(exc)}") from None
    if freeze:
        _freeze_startup_objects(settings.hot_path.gc_young_threshold)
    auth_resources = AsyncExitStack()
    authenticator: Authenticator | None = None
    if transport.auth_required:
        try:
            tokens = await auth_resources.enter_async_context(server_token_store(store, settings))
        except ValueError as exc:  # a token store URL that names no store: one line, not a traceback
            await store.close()
            raise StartupError(f"auth.token_store: {exc}") from None
        except BaseException:
            await store.close()
            raise
        authenticator = Authenticator(tokens, settings.auth, SystemClock())
        if not settings.auth.token_store and settings.store.strip() == "memory":
            # Started with `serve`, such a server refuses every call and says nothing of why.
            log.warning(
                "API tokens are kept in the memory store, inside this process, where `contextsvc tokens` "
                "cannot add any: every call will be refused; keep tokens in a file or a database with "
                "auth.token_store (CONTEXTSVC_AUTH__TOKEN_STORE=files:PATH)"
            )
    deferred: DeferredBus | None = None
    bus: EventBus
    if first_error is None:
        bus = _make_bus(settings, store)
        gate.ready()
    else:
        bus = deferred = DeferredBus()
    engine = Engine(
        store=tel.wrap_store(store),
        bus=tel.wrap_bus(bus),
        settings=settings,
        clock=SystemClock(),
        summarizers=tel.wrap_summarizers(build_summarizers(settings)),
    )
    limits = settings.limits

    async def owned_sessions(caller: Principal) -> int:
        # Counted as a non-admin of the same user: an admin's quota is on what they own.
        owner = Principal(user_id=caller.user_id)
        return (await engine.sessions.list(owner, page_size=1, page_token="", profile_id="", query="")).total

    quotas = Quotas(settings.quotas, count_sessions=owned_sessions)
    server = grpc.aio.server(
        interceptors=_interceptors(
            tel,
            gate,
            authenticator,
            quotas,
            settings.refusal_log_per_minute,
            settings.auth.stream_check_seconds,
            _failure_limiter(settings),
        ),
        options=[
            ("grpc.max_receive_message_length", limits.grpc_max_receive_bytes),
            ("grpc.max_send_message_length", limits.grpc_max_send_bytes),
            # gRPC sets SO_REUSEPORT by default, which lets a second server share our port and
            # split the traffic silently (issue #9): a port in use must be refused.
            ("grpc.so_reuseport", 0),
        ],
    )
    servicer = ContextServicer(engine, stopping=gate.stopping)
    if isinstance(store, FilesStore):
        share_memory_budget(store, engine, servicer.wire_cache)
    add_to_server(servicer, server)
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
        # Taken between our check and gRPC's bind: gRPC's own words say only "Failed to bind".
        why = " ".join(str(exc).split()).split(";")[0]
        raise OSError(f"cannot listen on {settings.listen}: {why}") from None
    await _set_health(
        health,
        health_pb2.HealthCheckResponse.SERVING if first_error is None else health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    await health.set(LIVENESS_NAME, health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    running = RunningServer(
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
        gate=gate,
    )
    trim = load_malloc_trim() if freeze and settings.hot_path.heap_trim_interval_seconds > 0 else None
    if trim is not None:
        running.heap_trim = asyncio.create_task(
            trim_loop(settings.hot_path.heap_trim_interval_seconds, trim), name="contextsvc-heap-trim"
        )
    if deferred is None or first_error is None:
        await _start_background(running, settings, bus)
        return running
    log.warning(
        "store not reachable; serving NOT_SERVING until it answers",
        extra={
            "store": redacted_url(settings.store),
            "error": " ".join(str(first_error).split()),
            # When the start ends if it never answers (store_start_timeout_seconds; 0 = never).
            "gives_up_after_seconds": settings.store_start_timeout_seconds,
        },
    )

    async def ready() -> None:
        deferred.target = _make_bus(settings, store)
        gate.ready()
        await _set_health(health, health_pb2.HealthCheckResponse.SERVING)
        await _start_background(running, settings, deferred.target)

    running.opener = asyncio.create_task(
        open_store_until_ready(
            store,
            name=redacted_url(settings.store),
            first_error=first_error,
            retry_max_seconds=settings.store_retry_max_seconds,
            give_up_after_seconds=settings.store_start_timeout_seconds,
            on_ready=ready,
        )
    )
    return running


def _freeze_startup_objects(young_threshold: int = 0) -> None:
    """Move what the start made (modules, the settings, the files store's summary of every session:
    ~12 objects per session) out of the cyclic garbage collector's reach. They live as long as the
    process, and collections would otherwise walk them all again: the first, due right after the
    store's load, cost ~45 ms before SERVING at 10,000 sessions, and each full one later ~80 ms
    (issue #9, start-up). Sessions removed later are freed by their reference counts (no cycles).
    Only for the process of ``serve``: a process starting many servers (tests) would keep the
    cyclic garbage of whatever was alive at each start. The collector, paused since the process
    began (``contextsvc._launch``), runs again from here, its youngest generation collected every
    ``young_threshold`` new objects (``hot_path.gc_young_threshold``; 0: Python's default)."""
    gc.freeze()
    tune_collector(young_threshold)
    gc.enable()


def tune_collector(young_threshold: int) -> None:
    """The collector's youngest-generation threshold (the older two keep theirs); 0 changes nothing."""
    if young_threshold > 0:
        _, middle, oldest = gc.get_threshold()
        gc.set_threshold(young_threshold, middle, oldest)


async def _start_background(running: RunningServer, settings: Settings, bus: EventBus) -> None:
    """Once the store answers: mirror its health (writable, damaged sessions) into the health
    service, and run store maintenance periodically (``engine/maintenance.py``)."""
    if isinstance(running.store, FilesStore):
        running.store.begin_checks()  # a sealed start's check of its logs: after the start, not during it
    store_health = StoreHealthWatcher(
        running.health, running.store, SERVICE_NAME, settings.store_health_interval_seconds
    )
    await store_health.start()
    running.store_health = store_health
    watched = getattr(bus, "watched_sessions", None)
    running.maintenance = asyncio.create_task(
        maintenance_loop(
            running.store,
            bus,
            settings.maintenance,
            now=SystemClock().now,
            busy=watched if watched is not None else frozenset,
            sleep=asyncio.sleep,
        ),
        name="contextsvc-maintenance",
    )
    if isinstance(bus, CompressionLog):  # the real bus (PostgreSQL's), not the engine's wrapper
        running.engine.compactor.compression_log = bus
        running.abandoned = asyncio.create_task(
            _close_abandoned_loop(running.engine, settings), name="contextsvc-abandoned-compactions"
        )


async def _close_abandoned_loop(engine: Engine, settings: Settings) -> None:
    """Every ``postgres.abandoned_compaction_check_seconds``: close the compactions announced and
    never ended (``Compactor.close_abandoned``), so a watcher's "compressing" ends even when the
    replica running it died."""
    pg = settings.postgres
    while True:
        await asyncio.sleep(pg.abandoned_compaction_check_seconds)
        try:
            await engine.compactor.close_abandoned(older_than=pg.abandoned_compaction_after_seconds)
        except Exception as exc:  # the database away: the next pass tries again
            log.warning("closing abandoned compactions failed", extra={"error": f"{type(exc).__name__}: {exc}"})


async def _set_health(health: health_aio.HealthServicer, status: int) -> None:
    for name in ("", SERVICE_NAME):
        await health.set(name, status)


async def stop(running: RunningServer, grace: float, close_grace: float = 0.5, quiet: float = 0.0) -> None:
    """Drain: new ContextService calls get UNAVAILABLE (SHUTTING_DOWN) and health says NOT_SERVING
    so balancers move on; calls in flight finish within ``grace``; then open StreamEvents calls
    end with UNAVAILABLE carrying the ``after_event_id`` to resume from (after the events those
    calls emitted); the transport closes once no call arrived for ``quiet`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    running.gate.drain()
    await _stop_background(running)
    # Calls in flight finish first, while the transport still accepts (and the gate refuses) new
    # ones; grpc's own stop would cancel calls it had accepted but not yet handed over.
    if not await running.gate.calls.wait_idle(max(deadline - loop.time(), 0.0)):
        log.warning("grace period over; cancelling calls still running", extra={"calls": running.gate.calls.count})
        # Cancelled here, not by the transport's stop after the streams ended: a compaction such a
        # call runs closes with compression_refused (failed), and watchers must get that event.
        running.gate.cancel_calls()
        await running.gate.calls.wait_idle(close_grace)
    # Compactions running on their own (one a build stopped waiting for, a post-turn check) emit
    # their closing events before the streams end, within the same grace; past it they are
    # cancelled, and close, before the streams end too.
    if not await running.engine.background_settled(max(deadline - loop.time(), 0.0)):
        await running.engine.cancel_background(close_grace)
    running.gate.end_watches()
    await running.gate.watches.wait_idle(close_grace)
    await running.gate.wait_quiet(quiet, at_most=close_grace)
    # What remains are health watchers and calls refused meanwhile: a short close.
    await running.server.stop(min(max(deadline - loop.time(), 0.0), close_grace))
    await running.engine.close()
    await running.bus.close()
    if running.authenticator is not None:
        await running.authenticator.close()
    await running.auth_resources.aclose()
    await running.store.close()
    # Flush what the last calls recorded (a no-op when telemetry is off), within what is left of
    # the grace: an unreachable collector must not hold the exit up. At least the short close, so
    # calls that used the whole grace still get their spans sent to a collector that answers.
    telemetry.current().shutdown(max(deadline - loop.time(), close_grace))


async def _stop_background(running: RunningServer) -> None:
    """Health NOT_SERVING for good, and the periodic tasks stopped, at the start of a drain."""
    # The store's health watcher would otherwise turn SERVING back on during the drain.
    if running.store_health is not None:
        await running.store_health.stop()
    for task in (running.maintenance, running.heap_trim, running.abandoned):
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    await _set_health(running.health, health_pb2.HealthCheckResponse.NOT_SERVING)
    await running.health.set(LIVENESS_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    if running.opener is not None:
        running.opener.cancel()
        with contextlib.suppress(asyncio.CancelledError, StartupError):
            await running.opener


def _reloader(running: RunningServer, gateway: Any) -> Callable[[], None]:
    """SIGHUP: the server's certificates, and the bundled gateway listener's."""

    def reload() -> None:
        running.reload_certificates()
        if gateway is not None:
            gateway.reload_certificates()

    return reload


async def serve(settings: Settings) -> None:
    host = settings.listen.rpartition(":")[0]
    target_host = "127.0.0.1" if host in ("0.0.0.0", "", "[::]", "::") else host
    if settings.gateway.listen:
        # The bundled gateway's TLS is checked before the server listens: a setup it cannot serve
        # is refused in one line, not after the port was open for a moment.
        from contextsvc.gateway.tls import bundled_upstream_tls, listener_tls

        bundled_upstream_tls(settings, target_host)
        listener_tls(settings, bundled=True)
    # Before the start: a SIGTERM right after the listening line must drain and exit 0, and one
    # (or a Ctrl-C) while the store opens must stop it cleanly too, not kill the process by the
    # signal's default action or interrupt the start half-way (a KeyboardInterrupt, then grpc's
    # finalizer on a closed loop).
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        # A Ctrl-C while this module loaded: asyncio.run's own handler cancelled this task, and the
        # cancellation would land half-way through the start. It lands here instead, and is taken
        # as the request to stop it is.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0)
        task.uncancel()
        stopping.set()
    running = await start(settings, freeze=True)
    if stopping.is_set():  # asked to stop while it started: stop without saying it listens
        log.info("stopping", extra={"grace_seconds": settings.shutdown_grace_seconds})
        await stop(running, 0.0, settings.shutdown_close_seconds)
        log.info("stopped")
        return
    gateway = None
    if settings.gateway.listen:
        # The bundled gateway is still a gRPC client of this server, over loopback. It listens
        # before the server is announced: a gateway port in use stops the start, in one line,
        # before any script or orchestrator took the server for started.
        from contextsvc.gateway.server import announce, start_gateway

        try:
            gateway = await start_gateway(
                settings, settings.gateway.listen, f"{target_host}:{running.port}", bundled=True
            )
        except BaseException:
            await stop(running, 0)
            raise
    # Tests and scripts read this line to learn the port when listening on port 0.
    print(f"contextsvc listening on {host}:{running.port} (store: {redacted_url(settings.store)})", flush=True)
    log.info(
        "serving",
        extra={
            "listen": f"{host}:{running.port}",
            "store": redacted_url(settings.store),
            "transport": running.transport.describe() if running.transport else "",
        },
    )
    if gateway is not None:
        announce(settings.gateway.listen, gateway.port, gateway.scheme)
    loop.add_signal_handler(signal.SIGHUP, _reloader(running, gateway))
    failed: BaseException | None = None
    if running.opener is not None:
        # A store that never answers within store_start_timeout_seconds ends the process.
        running.opener.add_done_callback(
            lambda task: stopping.set() if not task.cancelled() and task.exception() is not None else None
        )
    await stopping.wait()
    if running.opener is not None and running.opener.done():
        if not running.opener.cancelled():
            failed = running.opener.exception()
        running.opener = None
    log.info("stopping", extra={"grace_seconds": settings.shutdown_grace_seconds})
    # The drain starts at once (health NOT_SERVING, new calls refused) while the bundled gateway
    # closes its sockets: a browser slow to answer the close must not keep the server SERVING.
    closing = asyncio.create_task(gateway.close()) if gateway is not None else None
    await stop(
        running, settings.shutdown_grace_seconds, settings.shutdown_close_seconds, settings.shutdown_quiet_seconds
    )
    if closing is not None:
        await closing
    log.info("stopped")
    if failed is not None:
        raise failed
