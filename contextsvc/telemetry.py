"""OpenTelemetry traces and metrics, configured only by the standard ``OTEL_*`` variables.

Nothing is exported unless an exporter is named (``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``)
or an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` and its per-signal forms). Without one,
nothing of OpenTelemetry is imported (not even the API, ``_load_api``): the engine's hooks find
telemetry off in one look-up, the server adds no interceptor and wraps no port, so "off" costs a
few attribute look-ups per call.

What is recorded (DESIGN §5.11):
- a server span per RPC (one interceptor of ours, which also continues an incoming ``traceparent``
  through the configured propagators and records the RPC duration metric in the same layer), child
  spans for view assembly, compaction and every summarizer call (a GenAI client span,
  ``chat {model}``), every store call counted and timed on the span it runs under
  (``contextsvc.store.<op>.calls`` / ``.duration_ms``; an event ``store.<op>`` for a failed or slow
  call), and asyncpg/httpx spans from their instrumentations;
- metrics: RPC duration by method and code, compressions by reason and method, context fill fraction
  (when a session's fill changes), the estimate error of each accepted baseline, summarizer
  latency/failures/token usage, sessions, events published and delivered, watchers.

Message content never goes into a span or a metric: spans carry ids, counts and token figures only.

Cost (bench/RESULTS.md, "Telemetry overhead"): everything below the server span is recorded only
under a recording span, so a trace the sampler dropped costs one non-recording span and one metric
measurement per call, that measurement added to a bucket count by ``telemetry_metrics`` (the SDK's
readers collect it). The server, view and compaction spans come from ``telemetry_spans`` (the
SDK's sampler, ids, limits and ``ReadableSpan``, fewer steps), and spans are encoded for OTLP by
``telemetry_otlp``; see docs/telemetry.md, "Why these choices".
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import grpc

from contextsvc.ports import EventBus, SessionStore, StoredEvent, Summarizer, Summarizers, SummaryRequest

if TYPE_CHECKING:
    # The API is bound to these names by ``_load_api`` once telemetry is on (a ``Telemetry`` that
    # traces or meters): with it off, a server never imports OpenTelemetry (~20 ms of a start,
    # issue #9). The trace SDK is imported only when tracing is configured.
    from opentelemetry import context as otel_context
    from opentelemetry import metrics, propagate, trace
    from opentelemetry.trace import Span, SpanKind, Status, StatusCode

    from contextsvc.telemetry_spans import SpanFactory

log = logging.getLogger(__name__)

__all__ = [
    "Telemetry",
    "compaction_done",
    "compaction_span",
    "configure",
    "note_genai_usage",
    "view_built",
    "view_span",
]

_SCOPE = "contextsvc"
_SERVICE_DEFAULT = "contextsvc"

#: seconds; the boundaries suit calls from ~0.1 ms (a cached view) to a minute (a slow summarizer).
_DURATION_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
#: the GenAI semantic conventions' advice for gen_ai.client.token.usage.
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
_RPC_DURATION = "rpc.server.call.duration"
_RPC_DURATION_DESCRIPTION = "Duration of each RPC, by method and gRPC status code"
_RATIO_BUCKETS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5, 2.0)
_FRACTION_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.65, 0.7, 0.8, 0.9, 0.95, 1.0)


def _wanted(signal: str) -> str:
    """The exporter named for ``signal`` ('traces' or 'metrics'): 'otlp', 'console', 'prometheus' or ''."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ""
    variable = f"OTEL_{signal.upper()}_EXPORTER"
    named = os.environ.get(variable, "").strip().lower()
    if named:
        names = [name.strip() for name in named.split(",")]
        known = _EXPORTERS[signal]
        for name in names:
            if name not in known:
                # Not taken for OTLP over HTTP to the default endpoint, as it was, in silence.
                raise ValueError(f"{variable}: unknown exporter {name!r}; known: {', '.join(known)}")
        return "" if names[0] == "none" else names[0]
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
        f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"
    )
    return "otlp" if endpoint else ""


#: the exporters each signal can use (``OTEL_TRACES_EXPORTER``, ``OTEL_METRICS_EXPORTER``).
_EXPORTERS = {"traces": ("otlp", "console", "none"), "metrics": ("otlp", "console", "prometheus", "none")}
#: the OTLP protocols the SDK's exporters speak (``http/json`` has none in Python).
_PROTOCOLS = ("http/protobuf", "grpc")


def _protocol(signal: str) -> str:
    # The specification's default is http/protobuf; grpc when asked for.
    for variable in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        given = os.environ.get(variable, "").strip()
        if given:
            if given not in _PROTOCOLS:
                raise ValueError(f"{variable}: unknown protocol {given!r}; known: {', '.join(_PROTOCOLS)}")
            return given
    return "http/protobuf"


@dataclass(slots=True)
class _Instruments:
    """Every instrument, created once from one meter (no-op when metrics are off)."""

    rpc_duration: Any
    compressions: Any
    fill: Any
    estimate_ratio: Any
    genai_duration: Any
    genai_tokens: Any
    summarizer_failures: Any
    sessions_created: Any
    sessions_deleted: Any
    events_published: Any
    events_delivered: Any
    watchers: Any

    @classmethod
    def from_meter(cls, meter: metrics.Meter, rpc_duration: Any = None) -> _Instruments:
        """``rpc_duration``: the RPC duration histogram when it is not the meter's (telemetry_metrics)."""
        return cls(
            rpc_duration=rpc_duration
            or meter.create_histogram(
                _RPC_DURATION,
                unit="s",
                description=_RPC_DURATION_DESCRIPTION,
                explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
            ),
            compressions=meter.create_counter(
                "contextsvc.compressions",
                unit="{compression}",
                description="Committed compactions by reason and method",
            ),
            fill=meter.create_histogram(
                "contextsvc.context.fill",
                unit="1",
                description="Estimated view size as a fraction of the model's window, per BuildContext",
                explicit_bucket_boundaries_advisory=_FRACTION_BUCKETS,
            ),
            estimate_ratio=meter.create_histogram(
                "contextsvc.estimate.ratio",
                unit="1",
                description="Estimated / reported prompt tokens of each accepted baseline, by model",
                explicit_bucket_boundaries_advisory=_RATIO_BUCKETS,
            ),
            genai_duration=meter.create_histogram(
                "gen_ai.client.operation.duration",
                unit="s",
                description="Duration of summarizer calls",
                explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
            ),
            genai_tokens=meter.create_histogram(
                "gen_ai.client.token.usage",
                unit="{token}",
                description="Tokens used by summarizer calls, by gen_ai.token.type",
                explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS,
            ),
            summarizer_failures=meter.create_counter(
                "contextsvc.summarizer.failures", unit="{call}", description="Summarizer calls that failed"
            ),
            sessions_created=meter.create_counter(
                "contextsvc.sessions.created", unit="{session}", description="Sessions created or forked"
            ),
            sessions_deleted=meter.create_counter(
                "contextsvc.sessions.deleted", unit="{session}", description="Sessions deleted"
            ),
            events_published=meter.create_counter(
                "contextsvc.events.published", unit="{event}", description="Events published, by kind"
            ),
            events_delivered=meter.create_counter(
                "contextsvc.events.delivered", unit="{event}", description="Events delivered to watchers, by kind"
            ),
            watchers=meter.create_up_down_counter(
                "contextsvc.watchers", unit="{watcher}", description="Open StreamEvents watchers"
            ),
        )


def _load_api() -> None:
    """Bind the OpenTelemetry API to this module's names (see the ``TYPE_CHECKING`` imports)."""
    if "trace" in globals():
        return
    import opentelemetry.context
    import opentelemetry.metrics
    import opentelemetry.trace

    try:
        import opentelemetry.propagate  # reads OTEL_PROPAGATORS at import
    except ValueError as exc:
        raise ValueError(f"OTEL_PROPAGATORS: {exc}") from None

    api = opentelemetry.trace
    globals().update(
        otel_context=opentelemetry.context,
        metrics=opentelemetry.metrics,
        propagate=opentelemetry.propagate,
        trace=api,
        Span=api.Span,
        SpanKind=api.SpanKind,
        Status=api.Status,
        StatusCode=api.StatusCode,
    )


#: a ``Telemetry`` field not given: filled in by ``__post_init__`` when telemetry is on.
_UNSET: Any = None


@dataclass(slots=True)
class Telemetry:
    """What ``configure`` set up; ``shutdown`` flushes and stops the exporters.

    Off (neither tracing nor metering) it holds no tracer and no instruments, and nothing of
    OpenTelemetry is imported; on, the API's no-op tracer and instruments stand in for what was
    not given."""

    tracing: bool = False
    metering: bool = False
    #: a store call at least this slow (ms) gets an event of its own on its span (settings:
    #: ``telemetry_slow_store_ms``); every call is counted in the span's store attributes
    slow_store_ms: float = 10.0
    tracer: trace.Tracer = _UNSET
    #: starts the server, view and compaction spans (None: the tracer does; see telemetry_spans)
    spans: SpanFactory | None = None
    instruments: _Instruments = _UNSET
    _shutdowns: list[Callable[[], Any]] = field(default_factory=list)
    _flushes: list[Callable[[], Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.tracing or self.metering or self.tracer is not None or self.instruments is not None:
            _load_api()
            if self.tracer is None:
                self.tracer = trace.NoOpTracer()
            if self.instruments is None:
                self.instruments = _Instruments.from_meter(metrics.NoOpMeter(_SCOPE))

    @property
    def enabled(self) -> bool:
        return self.tracing or self.metering

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The interceptors to install: none when telemetry is off, else one for spans and metrics."""
        if not self.enabled:
            return []
        return [
            _ServerInterceptor(
                self.tracer if self.tracing else None, self.instruments if self.metering else None, self.spans
            )
        ]

    def wrap_store(self, store: SessionStore) -> SessionStore:
        return cast(SessionStore, _TracedStore(store, self.tracer, self.slow_store_ms)) if self.tracing else store

    def wrap_bus(self, bus: EventBus) -> EventBus:
        return cast(EventBus, _MeteredBus(bus, self.instruments)) if self.metering else bus

    def wrap_summarizers(self, summarizers: Summarizers) -> Summarizers:
        if not self.enabled:
            return summarizers
        return cast(Summarizers, _TracedSummarizers(summarizers, self.tracer, self.instruments))

    def flush(self) -> None:
        """Export the spans waiting in the batch processor now (benchmarks measure it this way)."""
        for flush in self._flushes:
            flush()

    def shutdown(self, timeout_seconds: float = 30.0) -> bool:
        """Flush and stop the exporters, waiting at most ``timeout_seconds``; False if they did not
        finish. The SDK's shutdowns have no overall bound: with the collector unreachable its
        exporters retry with backoff for tens of seconds, past any orchestrator's patience."""
        stops, self._shutdowns = self._shutdowns, []
        if not stops:
            return True
        # One daemon thread each, so a stuck meter provider does not keep spans from being flushed;
        # left behind when the time is up (the process is about to exit).
        workers = [
            threading.Thread(target=_stop, args=(stop,), name="contextsvc-telemetry-shutdown", daemon=True)
            for stop in stops
        ]
        deadline = time.monotonic() + timeout_seconds
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(max(deadline - time.monotonic(), 0.0))
        if any(worker.is_alive() for worker in workers):
            log.warning(
                "telemetry not flushed in time; what was not yet exported is dropped",
                extra={"timeout_seconds": round(timeout_seconds, 3)},
            )
            return False
        return True


def _stop(stop: Callable[[], Any]) -> None:
    # The providers' own exit-time shutdown would run again, unbounded, if this one is cut short.
    atexit.unregister(stop)
    try:
        stop()
    except Exception:  # an exporter that cannot flush must not block the shutdown
        log.warning("telemetry exporter did not shut down cleanly", exc_info=True)


#: the process's telemetry: the no-op one until ``configure`` installs exporters.
_current = Telemetry()
#: tokens a summarizer reported for the call in progress (set by the HTTP summarizers).
_usage: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("contextsvc_genai_usage", default=None)


def current() -> Telemetry:
    return _current


def set_current(telemetry: Telemetry) -> Telemetry:
    """Make ``telemetry`` the one the engine's hooks use and return the previous one.

    For in-process comparisons (bench/load/telemetry_cost.py); the server calls ``configure``.
    """
    global _current
    previous, _current = _current, telemetry
    return previous


def configure(*, service_version: str = "", slow_store_ms: float = 10.0) -> Telemetry:
    """Install tracer and meter providers when the environment names an exporter; once per process."""
    global _current
    if _current.enabled:
        return _current
    try:
        traces, metrics_exporter = _wanted("traces"), _wanted("metrics")
        if not traces and not metrics_exporter:
            return _current
        _current = build(traces, metrics_exporter, service_version=service_version, install=True)
    except ValueError as exc:  # an OTEL_* variable nothing can take: one line, no traceback
        from contextsvc.startup import StartupError

        raise StartupError(f"telemetry: {' '.join(str(exc).split())}") from None
    _current.slow_store_ms = slow_store_ms
    log.info("telemetry on", extra={"traces": traces or "off", "metrics": metrics_exporter or "off"})
    return _current


def build(traces: str, metrics_exporter: str, *, service_version: str = "", install: bool = False) -> Telemetry:
    """A ``Telemetry`` exporting traces / metrics with the named exporters ('' = that signal off).

    ``install`` makes its providers the process's global ones and instruments asyncpg and httpx
    (``configure`` does); without it the providers are private to the returned object.
    """
    created = _resource_attributes(service_version)
    resource = _resource_type()(created.attributes, created.schema_url)
    _load_api()
    telemetry = Telemetry(tracer=trace.NoOpTracer())
    if traces:
        telemetry.tracer, telemetry.spans = _tracing(
            traces, resource, telemetry._shutdowns, install, telemetry._flushes
        )
        telemetry.tracing = True
    if metrics_exporter:
        telemetry.instruments = _metering(metrics_exporter, resource, telemetry._shutdowns, install)
        telemetry.metering = True
    return telemetry


def _resource_attributes(service_version: str = "") -> Any:
    """The SDK's resource for this process: ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME``
    as the SDK reads them (the latter wins), ``service.version``, and the service name
    ``contextsvc`` only when neither variable names one (a ``service.name`` given in
    ``OTEL_RESOURCE_ATTRIBUTES`` is the operator's, not to be replaced by the default)."""
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource

    attributes: dict[str, str] = {}
    if not OTELResourceDetector().detect().attributes.get(SERVICE_NAME):
        attributes[SERVICE_NAME] = _SERVICE_DEFAULT
    if service_version:
        attributes["service.version"] = service_version
    return Resource.create(attributes)  # the variables are merged in by the SDK


def _resource_type() -> type[Any]:
    """The SDK's Resource with its hash computed once.

    The OTLP encoders group every exported span and metric by resource, and ``Resource.__hash__``
    serialises all its attributes to JSON each time: a tenth of the export thread's CPU. A resource
    never changes once created, so its hash need not either.
    """
    from opentelemetry.sdk.resources import Resource

    class _Resource(Resource):
        _hash: int | None = None

        def __hash__(self) -> int:
            if self._hash is None:
                self._hash = super().__hash__()
            return self._hash

    return _Resource


def _tracing(
    exporter_name: str,
    resource: Any,
    shutdowns: list[Callable[[], Any]],
    install: bool,
    flushes: list[Callable[[], Any]],
) -> tuple[trace.Tracer, SpanFactory | None]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    provider = TracerProvider(resource=resource)
    exporter: SpanExporter
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    elif _protocol("traces") == "grpc":
        from contextsvc.telemetry_otlp import grpc_span_exporter

        exporter = grpc_span_exporter()
    else:
        from contextsvc.telemetry_otlp import http_span_exporter

        exporter = http_span_exporter()
    # The SDK's defaults (OTEL_BSP_*): batches of 512 every 5 s, 2048 queued; encoding runs on the
    # processor's thread, and costs in proportion to the spans and attributes a call records.
    processor = BatchSpanProcessor(exporter)
    provider.add_span_processor(processor)
    shutdowns.append(provider.shutdown)
    flushes.append(provider.force_flush)
    from contextsvc.telemetry_spans import SpanFactory

    # Our own spans go straight to that processor (telemetry_spans); other code's via the provider.
    spans = SpanFactory(provider, processor, _SCOPE) if SpanFactory.usable(provider) else None
    if not install:
        return provider.get_tracer(_SCOPE), spans
    trace.set_tracer_provider(provider)
    # The drivers' own spans: statements (without parameters) and HTTP calls to summarizers.
    from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

    AsyncPGInstrumentor().instrument(tracer_provider=provider)  # type: ignore[no-untyped-call]
    HTTPXClientInstrumentor().instrument(tracer_provider=provider)
    return provider.get_tracer(_SCOPE), spans


def _metering(exporter_name: str, resource: Any, shutdowns: list[Callable[[], Any]], install: bool) -> _Instruments:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricReader, PeriodicExportingMetricReader
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from contextsvc.telemetry_metrics import OwnHistogram, with_histograms

    # Every reader is the SDK's, extended to add the RPC duration histogram the interceptor
    # aggregates itself when it collects (telemetry_metrics: the SDK's instrument cost ~20x more).
    reader: MetricReader
    if exporter_name == "prometheus":
        # A scrape endpoint, OTEL_EXPORTER_PROMETHEUS_HOST/PORT (default localhost:9464).
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server

        reader = with_histograms(PrometheusMetricReader)()
        host = os.environ.get("OTEL_EXPORTER_PROMETHEUS_HOST", "localhost")
        given = os.environ.get("OTEL_EXPORTER_PROMETHEUS_PORT", "9464").strip()
        if not given.isdigit() or int(given) > 65535:
            raise ValueError(f"OTEL_EXPORTER_PROMETHEUS_PORT: must be a port number, got {given!r}")
        port = int(given)
        try:
            server, thread = start_http_server(port, addr=host)
        except OSError as exc:
            raise ValueError(
                f"cannot listen on {host}:{port} for the Prometheus scrape endpoint "
                f"(OTEL_EXPORTER_PROMETHEUS_HOST/PORT): {exc.strerror or exc}"
            ) from None
        shutdowns.append(server.shutdown)
        log.info("prometheus metrics", extra={"listen": f"{host}:{port}"})
        del thread
    elif exporter_name == "console":
        reader = with_histograms(PeriodicExportingMetricReader)(ConsoleMetricExporter())
    elif _protocol("metrics") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetricExporter

        # OTEL_METRIC_EXPORT_INTERVAL (60 s by default)
        reader = with_histograms(PeriodicExportingMetricReader)(GrpcMetricExporter())
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter

        reader = with_histograms(PeriodicExportingMetricReader)(HttpMetricExporter())
    rpc_duration = OwnHistogram(
        _RPC_DURATION,
        unit="s",
        description=_RPC_DURATION_DESCRIPTION,
        boundaries=_DURATION_BUCKETS,
        scope=InstrumentationScope(_SCOPE),
    )
    cast(Any, reader).attach([rpc_duration], resource)  # with_histograms readers have attach()
    provider = MeterProvider(resource=resource, metric_readers=[reader])
    if install:
        metrics.set_meter_provider(provider)
    shutdowns.append(provider.shutdown)
    return _Instruments.from_meter(provider.get_meter(_SCOPE), rpc_duration=rpc_duration)


# -- spans and measurements the engine records --------------------------------------------------


class _Tally:
    """What the store calls under one recording span add up to, written onto it when it ends.

    Per operation the number of calls and their total duration (``contextsvc.store.<op>.calls``,
    ``contextsvc.store.<op>.duration_ms``); a call that failed or took at least the slow threshold
    also gets an event of its own (``store.<op>``). ``extra`` collects attributes the engine's hooks
    add (the view's model and sizes), so a span is given all its late attributes in one call.
    """

    __slots__ = ("extra", "ops", "span")

    def __init__(self, span: Span) -> None:
        self.span: Span | None = span
        #: operation -> [calls, total nanoseconds]
        self.ops: dict[str, list[int]] = {}
        self.extra: dict[str, Any] | None = None

    def attributes(self) -> dict[str, Any] | None:
        """The attributes to set on the span now ending (None: nothing to add); closes the tally."""
        self.span = None  # later calls (a task the span's block left running) are not counted
        ops = self.ops
        if not ops:
            return self.extra
        out: dict[str, Any] = dict(self.extra) if self.extra else {}
        for op, (calls, nanos) in ops.items():
            calls_key, ms_key = _op_keys(op)
            out[calls_key] = calls
            out[ms_key] = nanos / 1e6
        return out


#: the tally of the recording span store calls count towards (None: not recording, or off)
_tally: contextvars.ContextVar[_Tally | None] = contextvars.ContextVar("contextsvc_store_tally", default=None)
#: operation -> its two attribute keys, built once per store method (bounded by the port's methods)
_keys: dict[str, tuple[str, str]] = {}


def _op_keys(op: str) -> tuple[str, str]:
    found = _keys.get(op)
    if found is None:
        found = _keys[op] = (f"contextsvc.store.{op}.calls", f"contextsvc.store.{op}.duration_ms")
    return found


def _end(span: Span, tally: _Tally, more: dict[str, Any] | None = None) -> None:
    """Write the tally (and ``more``) onto ``span`` in one call; the caller ends it."""
    attributes = tally.attributes()
    if more:
        attributes = {**attributes, **more} if attributes else more
    if attributes:
        span.set_attributes(attributes)


class _ChildSpan:
    """A child span made current for the block, started only under a recording span.

    Lighter than ``start_as_current_span`` (no generator context managers), and free when the
    trace is not sampled: the block then gets the (non-recording) current span, so nothing below a
    dropped trace is created, timed or exported.
    """

    __slots__ = ("_attributes", "_name", "_span", "_tally_token", "_token")

    def __init__(self, name: str, attributes: dict[str, Any]) -> None:
        self._name = name
        self._attributes = attributes
        self._span: Span | None = None
        self._token: object = None
        self._tally_token: contextvars.Token[_Tally | None] | None = None

    def __enter__(self) -> Span:
        telemetry = _current
        if not telemetry.tracing:
            return _OFF_SPAN  # off: a no-op span, nothing looked up
        tally = _tally.get()
        above = None if tally is None else tally.span
        span: Span
        if above is None:
            # Not under a recording span of ours: under someone else's (a caller's own span), or
            # under none / a dropped trace, where the block gets the non-recording span.
            parent = trace.get_current_span()
            if not parent.is_recording():
                return parent
            span = telemetry.tracer.start_span(self._name, attributes=self._attributes)
        elif telemetry.spans is not None and isinstance(above, telemetry.spans.span_type):
            span = telemetry.spans.child(self._name, above, self._attributes)
        else:
            span = telemetry.tracer.start_span(self._name, attributes=self._attributes)
        self._span = span
        self._token = otel_context.attach(trace.set_span_in_context(span))
        self._tally_token = _tally.set(_Tally(span))
        return span

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        span = self._span
        if span is None:
            return
        tally = _tally.get()
        _tally.reset(self._tally_token)  # type: ignore[arg-type]
        otel_context.detach(self._token)  # type: ignore[arg-type]
        more = None
        if exc is not None and not isinstance(exc, asyncio.CancelledError):
            more = {"error.type": type(exc).__name__}
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        if tally is not None:
            _end(span, tally, more)
        elif more:
            span.set_attributes(more)
        span.end()


class _OffSpan:
    """The span a block gets with tracing off: records nothing (the API's ``INVALID_SPAN`` without
    importing the API)."""

    __slots__ = ()

    def is_recording(self) -> bool:
        return False

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None) -> None:
        pass

    def set_status(self, status: Any, description: str | None = None) -> None:
        pass

    def record_exception(self, exception: BaseException, *args: Any, **kwargs: Any) -> None:
        pass

    def update_name(self, name: str) -> None:
        pass

    def end(self, end_time: int | None = None) -> None:
        pass


_OFF_SPAN = cast("Span", _OffSpan())


class _ViewSpan(_ChildSpan):
    """The view span; with metrics on it also tells ``view_built`` whose view it is."""

    __slots__ = ("_session_token",)

    def __enter__(self) -> Span:
        self._session_token = (
            _view_session.set(self._attributes["contextsvc.session_id"]) if _current.metering else None
        )
        return super().__enter__()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._session_token is not None:
            _view_session.reset(self._session_token)
        super().__exit__(kind, exc, tb)


def client_span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A client span around an outgoing call (the gateway's calls to the service), current while
    the call runs so ``outgoing_metadata`` carries it; nothing when tracing is off."""
    if not _current.tracing:
        return contextlib.nullcontext()
    return _current.tracer.start_as_current_span(name, kind=SpanKind.CLIENT)


def outgoing_metadata() -> tuple[tuple[str, str], ...]:
    """The current trace context as gRPC metadata (``traceparent``, by the configured
    propagators), so the service's spans continue the caller's trace; empty when tracing is off."""
    if not _current.tracing:
        return ()
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def view_span(session_id: str) -> _ChildSpan:
    """The span around assembling one view (BuildContext); ``view_built`` adds model and sizes."""
    return _ViewSpan("contextsvc.build_view", {"contextsvc.session_id": session_id})


def compaction_span(session_id: str, reason: str) -> _ChildSpan:
    """The span around one compaction; the caller adds method, messages and tokens before/after."""
    return _ChildSpan(
        "contextsvc.compaction", {"contextsvc.session_id": session_id, "contextsvc.compaction.reason": reason}
    )


#: model -> the fill metric's attributes, built once per model (bounded: cleared when full).
_model_attributes: dict[str, dict[str, str]] = {}
_MODEL_ATTRIBUTES_MAX = 256
#: session -> (model, fill) last recorded: a view whose fill did not change is not measured again
#: (bounded: cleared when full, which costs one measurement per session seen again).
_last_fill: dict[str, tuple[str, float]] = {}
_LAST_FILL_MAX = 4096
#: the session whose view is being built (set by ``view_span`` when metrics are on)
_view_session: contextvars.ContextVar[str] = contextvars.ContextVar("contextsvc_view_session", default="")


def view_built(model: str, messages: int, tokens: int, fraction: float) -> None:
    """What the view span and the fill metric say about a view that was just built.

    The fill metric is recorded when the session's fill (or model) differs from the one last
    recorded for it, so a session rebuilt unchanged turn after turn counts once per change.
    """
    telemetry = _current
    if telemetry.tracing:
        tally = _tally.get()
        if tally is not None and tally.span is not None:
            # Written onto the view span with the store tally when it ends, in one call.
            tally.extra = {
                "gen_ai.request.model": model,
                "contextsvc.view.messages": messages,
                "contextsvc.view.tokens": tokens,
            }
    if telemetry.metering:
        session = _view_session.get()
        if session:
            last = _last_fill.get(session)
            if last is not None and last[1] == fraction and last[0] == model:
                return
            if len(_last_fill) >= _LAST_FILL_MAX:
                _last_fill.clear()
            _last_fill[session] = (model, fraction)
        attributes = _model_attributes.get(model)
        if attributes is None:
            if len(_model_attributes) >= _MODEL_ATTRIBUTES_MAX:
                _model_attributes.clear()
            attributes = _model_attributes[model] = {"gen_ai.request.model": model}
        telemetry.instruments.fill.record(fraction, attributes)


def compaction_done(report: Any) -> None:
    """Method and sizes of a finished compaction on the current (compaction) span."""
    if not _current.tracing:
        return
    tally = _tally.get()
    if tally is None or tally.span is None:
        return
    method = getattr(report.method, "value", report.method)
    attributes: dict[str, Any] = {
        "contextsvc.compaction.compressed": bool(report.compressed),
        "contextsvc.compaction.messages_before": report.messages_before,
        "contextsvc.compaction.messages_after": report.messages_after,
        "contextsvc.compaction.tokens_before": report.context_tokens_before,
        "contextsvc.compaction.tokens_after": report.context_tokens_after,
    }
    if method:
        attributes["contextsvc.compaction.method"] = str(method)
    # Written onto the compaction span with its store tally when it ends.
    tally.extra = {**tally.extra, **attributes} if tally.extra else attributes


def note_genai_usage(input_tokens: int | None, output_tokens: int | None) -> None:
    """A summarizer reports the tokens its provider counted for the call in progress."""
    if not _current.enabled:
        return
    _usage.set((int(input_tokens or 0), int(output_tokens or 0)))


# -- wrappers installed by the bootstrap when telemetry is on ------------------------------------


class _TracedStore:
    """Every coroutine method of the store is counted and timed under the span it serves.

    Not a span per call: that cost more than most memory- and file-store calls themselves (four per
    BuildContext), and so did an event per call. The span the call runs under (view, compaction or
    server span) gets, when it ends, the number of calls and their total duration per operation
    (``contextsvc.store.<op>.calls`` / ``.duration_ms``); a call that failed or took at least
    ``slow_ms`` also gets an event ``store.<op>`` with its start, duration and ``error.type``.
    PostgreSQL statements still get their own spans from the asyncpg instrumentation. Nothing is
    counted, nor timed, when the current span is not recording (a trace the sampler dropped).
    """

    def __init__(self, inner: SessionStore, tracer: trace.Tracer, slow_ms: float = 10.0) -> None:
        self._inner = inner
        self._slow_ns = int(slow_ms * 1e6)
        del tracer  # the tally goes on the current span, whichever tracer started it

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name.startswith("_") or not callable(attr) or not _is_coroutine_function(attr):
            return attr
        wrapped = self._wrap(name)
        # Kept on the instance: later look-ups find it without coming back here.
        object.__setattr__(self, name, wrapped)
        return wrapped

    def _wrap(self, name: str) -> Callable[..., Awaitable[Any]]:
        inner, event_name, slow_ns = self._inner, f"store.{name}", self._slow_ns

        async def timed(tally: _Tally, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            started = time.perf_counter_ns()
            error = ""
            try:
                return await getattr(inner, name)(*args, **kwargs)
            except BaseException as exc:
                error = type(exc).__name__
                raise
            finally:
                took = time.perf_counter_ns() - started
                op = tally.ops.get(name)
                if op is None:
                    tally.ops[name] = [1, took]
                else:
                    op[0] += 1
                    op[1] += took
                span = tally.span
                if (error or took >= slow_ns) and span is not None:
                    attributes: dict[str, Any] = {"contextsvc.store.duration_ms": took / 1e6}
                    if error:
                        attributes["error.type"] = error
                    span.add_event(event_name, attributes, timestamp=time.time_ns() - took)

        def call(*args: Any, **kwargs: Any) -> Awaitable[Any]:
            # Not a coroutine function itself: outside a recording span it hands back the store's
            # own coroutine, adding no frame to the await.
            tally = _tally.get()
            if tally is None or tally.span is None:
                return cast(Awaitable[Any], getattr(inner, name)(*args, **kwargs))
            return timed(tally, args, kwargs)

        return call


def _is_coroutine_function(fn: Any) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


class _MeteredBus:
    """Counts events published and delivered, watchers, and what compaction and baseline events say."""

    def __init__(self, inner: EventBus, instruments: _Instruments) -> None:
        self._inner = inner
        self._m = instruments

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def publish(self, *, session_id: str, user_id: str, kind: str, payload: Mapping[str, Any]) -> StoredEvent:
        event = await self._inner.publish(session_id=session_id, user_id=user_id, kind=kind, payload=payload)
        self._m.events_published.add(1, {"contextsvc.event.kind": kind})
        if kind == "context_compressed":
            self._m.compressions.add(
                1,
                {
                    "contextsvc.compaction.reason": str(payload.get("reason", "")),
                    "contextsvc.compaction.method": str(payload.get("method", "")),
                },
            )
        elif kind == "baseline_recorded":
            reported = payload.get("prompt_tokens") or 0
            estimated = payload.get("estimated_tokens") or 0
            if reported > 0 and estimated > 0:
                self._m.estimate_ratio.record(
                    estimated / reported, {"gen_ai.request.model": str(payload.get("model", ""))}
                )
        return event

    def subscribe(self, **kwargs: Any) -> AsyncIterator[StoredEvent]:
        return self._follow(self._inner.subscribe(**kwargs))

    async def retained_deletion(self, session_id: str) -> StoredEvent | None:
        return await self._inner.retained_deletion(session_id)

    async def _follow(self, events: AsyncIterator[StoredEvent]) -> AsyncIterator[StoredEvent]:
        self._m.watchers.add(1)
        try:
            async for event in events:
                self._m.events_delivered.add(1, {"contextsvc.event.kind": event.kind})
                yield event
        finally:
            self._m.watchers.add(-1)
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()


class _TracedSummarizers:
    """The bootstrap's summarizers, each wrapped once in ``_TracedSummarizer``."""

    def __init__(self, inner: Summarizers, tracer: trace.Tracer, instruments: _Instruments) -> None:
        self._inner = inner
        self._tracer = tracer
        self._m = instruments
        self._wrapped: dict[str, Summarizer] = {}

    def get(self, name: str) -> Summarizer:
        found = self._wrapped.get(name)
        if found is None:
            found = cast(Summarizer, _TracedSummarizer(self._inner.get(name), self._tracer, self._m))
            self._wrapped[name] = found
        return found

    def __contains__(self, name: object) -> bool:
        return name in self._inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def close(self) -> None:
        await self._inner.close()


class _TracedSummarizer:
    """A GenAI client span (``chat {model}``) and the GenAI client metrics around each call."""

    def __init__(self, inner: Summarizer, tracer: trace.Tracer, instruments: _Instruments) -> None:
        self._inner = inner
        self._tracer = tracer
        self._m = instruments
        self.name = inner.name
        self.vision = inner.vision
        config = getattr(inner, "config", None)
        self._model = str(getattr(config, "model", "") or inner.name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def summarize(self, request: SummaryRequest) -> str:
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": self.name,
            "gen_ai.request.model": self._model,
            "gen_ai.request.max_tokens": request.max_tokens,
            "gen_ai.request.temperature": request.temperature,
        }
        session_id = getattr(request, "session_id", "")
        if session_id:
            attributes["gen_ai.conversation.id"] = session_id
        metric_attrs = {
            k: attributes[k] for k in ("gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model")
        }
        token = _usage.set(None)
        started = time.perf_counter()
        with self._tracer.start_as_current_span(
            f"chat {self._model}", kind=SpanKind.CLIENT, attributes=attributes, record_exception=False
        ) as span:
            try:
                text = await self._inner.summarize(request)
            except Exception as exc:
                error_type = type(exc).__name__
                span.set_status(Status(StatusCode.ERROR, error_type))
                span.set_attribute("error.type", error_type)
                self._m.summarizer_failures.add(1, {**metric_attrs, "error.type": error_type})
                self._m.genai_duration.record(time.perf_counter() - started, {**metric_attrs, "error.type": error_type})
                raise
            finally:
                usage = _usage.get()
                _usage.reset(token)
            self._m.genai_duration.record(time.perf_counter() - started, metric_attrs)
            if usage is not None:
                input_tokens, output_tokens = usage
                span.set_attribute("gen_ai.usage.input_tokens", input_tokens)
                span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
                self._m.genai_tokens.record(input_tokens, {**metric_attrs, "gen_ai.token.type": "input"})
                self._m.genai_tokens.record(output_tokens, {**metric_attrs, "gen_ai.token.type": "output"})
            return text


#: gRPC codes that mark a server span as an error (the RPC semantic conventions); the others are
#: the client's doing (NOT_FOUND, INVALID_ARGUMENT, ...) and leave the status unset.
_SERVER_ERROR_CODES = frozenset(
    code.value[0]
    for code in (
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    )
)
_CANCELLED = grpc.StatusCode.CANCELLED.value[0]
_CODE_NAMES = {int(code.value[0]): code.name for code in grpc.StatusCode}


class _Method:
    """What one method's calls record, built once per method: span name, attributes, counters."""

    __slots__ = ("attributes", "by_code", "by_status", "created", "deleted", "name", "path", "service")

    def __init__(self, path: str) -> None:
        service, _, name = path.lstrip("/").partition("/")
        self.path, self.service, self.name = path, service, name
        self.attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
        #: status code -> the duration metric's attributes
        self.by_code: dict[int, dict[str, Any]] = {}
        #: status code -> the span's status attribute
        self.by_status: dict[int, dict[str, Any]] = {}
        self.created = name in ("CreateSession", "ForkSession")
        self.deleted = name == "DeleteSession"

    def status_attributes(self, code: int) -> dict[str, Any]:
        found = self.by_status.get(code)
        if found is None:
            found = self.by_status[code] = {"rpc.grpc.status_code": code}
        return found

    def metric_attributes(self, code: int) -> dict[str, Any]:
        found = self.by_code.get(code)
        if found is None:
            found = self.by_code[code] = {**self.attributes, "rpc.grpc.status_code": code}
        return found


class _ServerInterceptor(grpc.aio.ServerInterceptor):
    """The server span of every RPC and its duration metric, in one layer.

    Ours rather than ``opentelemetry-instrumentation-grpc``'s aio interceptor: that one starts each
    span through two generator context managers, copies the metadata twice, parses the peer address
    and proxies every servicer-context call through a wrapper, and the duration metric needed a
    second interceptor of its own (bench/RESULTS.md, "Telemetry overhead: where it went"). This one
    continues an incoming trace through the configured propagators (W3C ``traceparent`` by
    default), names the span by method, records ``rpc.*`` attributes and the status code, and marks
    the server-side failure codes as errors.
    """

    def __init__(
        self, tracer: trace.Tracer | None, instruments: _Instruments | None, spans: SpanFactory | None = None
    ) -> None:
        self._tracer = tracer
        self._m = instruments
        self._spans = spans
        # The metadata keys the configured propagators read (traceparent, tracestate, baggage by
        # default): a call carrying none of them starts a new trace without running the extractors.
        self._fields = frozenset(propagate.get_global_textmap().fields)
        # method path -> (handler as given, wrapped handler); bounded by the registered methods.
        self._wrapped: dict[str, tuple[Any, Any]] = {}
        # method path -> what its calls record; kept apart from the handlers, which an inner
        # interceptor may build anew for every call (authentication does).
        self._methods: dict[str, _Method] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        path = handler_call_details.method
        cached = self._wrapped.get(path)
        if cached is not None and cached[0] is handler:
            return cast("grpc.RpcMethodHandler[Any, Any]", cached[1])
        method = self._methods.get(path)
        if method is None:
            method = self._methods[path] = _Method(path)
        wrapped: grpc.RpcMethodHandler[Any, Any] = self._wrap(handler, method)
        self._wrapped[path] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler: Any, method: _Method) -> Any:
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(method, handler.unary_unary))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=self._unary(method, handler.stream_unary))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._stream(method, handler.unary_stream))
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=self._stream(method, handler.stream_stream))
        return handler

    def _start(self, method: _Method, context: Any) -> tuple[Span | None, tuple[object, object, _Tally | None]]:
        """The server span, current from here on (also when not sampled: children then skip), and
        what ``_finish`` undoes: the context token, the tally's token and the tally."""
        tracer = self._tracer
        if tracer is None:
            return None, (None, None, None)
        metadata = context.invocation_metadata()
        fields = self._fields
        parent = None
        if metadata and any(key in fields for key, _ in metadata):
            parent = propagate.extract(dict(metadata))
        span = (
            self._spans.start(method.path, parent, SpanKind.SERVER, method.attributes)
            if self._spans is not None
            else tracer.start_span(method.path, context=parent, kind=SpanKind.SERVER, attributes=method.attributes)
        )
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        if not span.is_recording():
            return span, (token, None, None)
        tally = _Tally(span)
        return span, (token, _tally.set(tally), tally)

    def _finish(
        self,
        method: _Method,
        span: Span | None,
        tokens: tuple[object, object, _Tally | None],
        started: float,
        code: int,
        exc: BaseException | None,
        closed: bool = False,
    ) -> None:
        if span is not None:
            token, tally_token, tally = tokens
            if not closed:
                otel_context.detach(token)  # type: ignore[arg-type]
                if tally_token is not None:
                    _tally.reset(tally_token)  # type: ignore[arg-type]
            # else: a stream closed by its caller (GeneratorExit), possibly from another context
            # than the one it started in; that context ends with the stream, nothing to restore.
            if tally is not None:
                _end(span, tally, method.status_attributes(code))
                if code in _SERVER_ERROR_CODES:
                    span.set_status(Status(StatusCode.ERROR, _CODE_NAMES.get(code, "UNKNOWN")))
                    if exc is not None and not isinstance(exc, grpc.aio.AbortError):
                        span.record_exception(exc)
            span.end()
        m = self._m
        if m is None:
            return
        m.rpc_duration.record(time.perf_counter() - started, method.metric_attributes(code))
        if code == 0 and method.created:
            m.sessions_created.add(1)
        elif code == 0 and method.deleted:
            m.sessions_deleted.add(1)

    def _unary(self, method: _Method, behavior: Any) -> Any:
        async def call(request: Any, context: Any) -> Any:
            started = time.perf_counter()
            span, tokens = self._start(method, context)
            failure: BaseException | None = None
            cancelled = False
            try:
                return await behavior(request, context)
            except asyncio.CancelledError:
                cancelled = True  # the client went away or the server is stopping
                raise
            except BaseException as exc:
                failure = exc
                raise
            finally:
                code = _CANCELLED if cancelled else _code_of(context, failure is not None)
                self._finish(method, span, tokens, started, code, failure)

        return call

    def _stream(self, method: _Method, behavior: Any) -> Any:
        async def call(request: Any, context: Any) -> AsyncIterator[Any]:
            started = time.perf_counter()
            span, tokens = self._start(method, context)
            failure: BaseException | None = None
            cancelled = closed = False
            try:
                async for item in behavior(request, context):
                    yield item
            except GeneratorExit:
                cancelled = closed = True  # a watcher that hangs up ends its stream this way
                raise
            except asyncio.CancelledError:
                cancelled = True
                raise
            except BaseException as exc:
                failure = exc
                raise
            finally:
                code = _CANCELLED if cancelled else _code_of(context, failure is not None)
                self._finish(method, span, tokens, started, code, failure, closed)

        return call


def _code_of(context: Any, failed: bool) -> int:
    try:
        code = context.code()
    except Exception:  # older runtimes have no code(); fall back to what we saw
        code = None
    if code is None:
        return grpc.StatusCode.UNKNOWN.value[0] if failed else 0
    if isinstance(code, grpc.StatusCode):
        return int(code.value[0])
    return int(code)
