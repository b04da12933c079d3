"""OpenTelemetry traces and metrics, configured only by the standard ``OTEL_*`` variables.

Nothing is exported unless an exporter is named (``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``)
or an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` and its per-signal forms). Without one,
no SDK is installed: the spans and instruments below are the API's no-op objects, the server adds no
interceptor and wraps no port, so "off" costs a few attribute look-ups per call.

What is recorded (DESIGN §5.11):
- a server span per RPC (``opentelemetry-instrumentation-grpc``'s aio interceptor, which also continues
  an incoming ``traceparent``), child spans for view assembly, compaction, every store call and every
  summarizer call (a GenAI client span, ``chat {model}``), and asyncpg/httpx spans from their
  instrumentations;
- metrics: RPC duration by method and code, compressions by reason and method, context fill fraction,
  the estimate error of each accepted baseline, summarizer latency/failures/token usage, sessions,
  events published and delivered, watchers.

Message content never goes into a span or a metric: spans carry ids, counts and token figures only.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
from opentelemetry import metrics, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from contextsvc.ports import EventBus, SessionStore, StoredEvent, Summarizer, Summarizers, SummaryRequest

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
_RATIO_BUCKETS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5, 2.0)
_FRACTION_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.65, 0.7, 0.8, 0.9, 0.95, 1.0)


def _wanted(signal: str) -> str:
    """The exporter named for ``signal`` ('traces' or 'metrics'): 'otlp', 'console', 'prometheus' or ''."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ""
    named = os.environ.get(f"OTEL_{signal.upper()}_EXPORTER", "").strip().lower()
    if named:
        first = named.split(",")[0].strip()
        return "" if first == "none" else first
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
        f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"
    )
    return "otlp" if endpoint else ""


def _protocol(signal: str) -> str:
    # The specification's default is http/protobuf; grpc when asked for.
    return (
        os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()


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
    def from_meter(cls, meter: metrics.Meter) -> _Instruments:
        return cls(
            rpc_duration=meter.create_histogram(
                "rpc.server.call.duration",
                unit="s",
                description="Duration of each RPC, by method and gRPC status code",
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


@dataclass(slots=True)
class Telemetry:
    """What ``configure`` set up; ``shutdown`` flushes and stops the exporters."""

    tracing: bool = False
    metering: bool = False
    tracer: trace.Tracer = field(default_factory=lambda: trace.NoOpTracer())
    instruments: _Instruments = field(default_factory=lambda: _Instruments.from_meter(metrics.NoOpMeter(_SCOPE)))
    _shutdowns: list[Callable[[], Any]] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.tracing or self.metering

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The interceptors to install: none when telemetry is off."""
        found: list[grpc.aio.ServerInterceptor] = []
        if self.metering:
            found.append(_MetricsInterceptor(self.instruments))
        if self.tracing:
            from opentelemetry.instrumentation.grpc import aio_server_interceptor

            found.append(aio_server_interceptor(tracer_provider=trace.get_tracer_provider()))  # type: ignore[no-untyped-call]
        return found

    def wrap_store(self, store: SessionStore) -> SessionStore:
        return cast(SessionStore, _TracedStore(store, self.tracer)) if self.tracing else store

    def wrap_bus(self, bus: EventBus) -> EventBus:
        return cast(EventBus, _MeteredBus(bus, self.instruments)) if self.metering else bus

    def wrap_summarizers(self, summarizers: Summarizers) -> Summarizers:
        if not self.enabled:
            return summarizers
        return cast(Summarizers, _TracedSummarizers(summarizers, self.tracer, self.instruments))

    def shutdown(self) -> None:
        for stop in reversed(self._shutdowns):
            try:
                stop()
            except Exception:  # an exporter that cannot flush must not block the shutdown
                log.warning("telemetry exporter did not shut down cleanly", exc_info=True)
        self._shutdowns.clear()


#: the process's telemetry: the no-op one until ``configure`` installs exporters.
_current = Telemetry()
#: tokens a summarizer reported for the call in progress (set by the HTTP summarizers).
_usage: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("contextsvc_genai_usage", default=None)


def current() -> Telemetry:
    return _current


def configure(*, service_version: str = "") -> Telemetry:
    """Install tracer and meter providers when the environment names an exporter; once per process."""
    global _current
    if _current.enabled:
        return _current
    traces, metrics_exporter = _wanted("traces"), _wanted("metrics")
    if not traces and not metrics_exporter:
        return _current
    from opentelemetry.sdk.resources import Resource

    attributes = {"service.name": os.environ.get("OTEL_SERVICE_NAME") or _SERVICE_DEFAULT}
    if service_version:
        attributes["service.version"] = service_version
    resource = Resource.create(attributes)  # OTEL_RESOURCE_ATTRIBUTES are merged in by the SDK
    telemetry = Telemetry()
    if traces:
        telemetry.tracer = _tracing(traces, resource, telemetry._shutdowns)
        telemetry.tracing = True
    if metrics_exporter:
        telemetry.instruments = _metering(metrics_exporter, resource, telemetry._shutdowns)
        telemetry.metering = True
    _current = telemetry
    log.info("telemetry on", extra={"traces": traces or "off", "metrics": metrics_exporter or "off"})
    return telemetry


def _tracing(exporter_name: str, resource: Any, shutdowns: list[Callable[[], Any]]) -> trace.Tracer:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    provider = TracerProvider(resource=resource)
    exporter: SpanExporter
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    elif _protocol("traces") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter

        exporter = GrpcSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter

        exporter = HttpSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_* tune it
    trace.set_tracer_provider(provider)
    shutdowns.append(provider.shutdown)
    # The drivers' own spans: statements (without parameters) and HTTP calls to summarizers.
    from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

    AsyncPGInstrumentor().instrument(tracer_provider=provider)  # type: ignore[no-untyped-call]
    HTTPXClientInstrumentor().instrument(tracer_provider=provider)
    return provider.get_tracer(_SCOPE)


def _metering(exporter_name: str, resource: Any, shutdowns: list[Callable[[], Any]]) -> _Instruments:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricReader, PeriodicExportingMetricReader

    reader: MetricReader
    if exporter_name == "prometheus":
        # A scrape endpoint, OTEL_EXPORTER_PROMETHEUS_HOST/PORT (default localhost:9464).
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server

        reader = PrometheusMetricReader()
        host = os.environ.get("OTEL_EXPORTER_PROMETHEUS_HOST", "localhost")
        port = int(os.environ.get("OTEL_EXPORTER_PROMETHEUS_PORT", "9464"))
        server, thread = start_http_server(port, addr=host)
        shutdowns.append(server.shutdown)
        log.info("prometheus metrics", extra={"listen": f"{host}:{port}"})
        del thread
    elif exporter_name == "console":
        reader = PeriodicExportingMetricReader(ConsoleMetricExporter())
    elif _protocol("metrics") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetricExporter

        reader = PeriodicExportingMetricReader(GrpcMetricExporter())  # OTEL_METRIC_EXPORT_INTERVAL
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter

        reader = PeriodicExportingMetricReader(HttpMetricExporter())
    provider = MeterProvider(resource=resource, metric_readers=[reader])
    metrics.set_meter_provider(provider)
    shutdowns.append(provider.shutdown)
    return _Instruments.from_meter(provider.get_meter(_SCOPE))


# -- spans and measurements the engine records --------------------------------------------------


@contextmanager
def view_span(session_id: str) -> Iterator[Span]:
    """The span around assembling one view (BuildContext); the caller adds model and sizes."""
    with _current.tracer.start_as_current_span(
        "contextsvc.build_view", attributes={"contextsvc.session_id": session_id}
    ) as span:
        yield span


@contextmanager
def compaction_span(session_id: str, reason: str) -> Iterator[Span]:
    """The span around one compaction; the caller adds method, messages and tokens before/after."""
    with _current.tracer.start_as_current_span(
        "contextsvc.compaction",
        attributes={"contextsvc.session_id": session_id, "contextsvc.compaction.reason": reason},
    ) as span:
        yield span


def view_built(model: str, messages: int, tokens: int, fraction: float) -> None:
    """What the view span and the fill metric say about a view that was just built."""
    if _current.tracing:
        span = trace.get_current_span()
        span.set_attribute("gen_ai.request.model", model)
        span.set_attribute("contextsvc.view.messages", messages)
        span.set_attribute("contextsvc.view.tokens", tokens)
    if _current.metering:
        _current.instruments.fill.record(fraction, {"gen_ai.request.model": model})


def compaction_done(report: Any) -> None:
    """Method and sizes of a finished compaction on the current (compaction) span."""
    if not _current.tracing:
        return
    span = trace.get_current_span()
    span.set_attribute("contextsvc.compaction.compressed", bool(report.compressed))
    method = getattr(report.method, "value", report.method)
    if method:
        span.set_attribute("contextsvc.compaction.method", str(method))
    span.set_attribute("contextsvc.compaction.messages_before", report.messages_before)
    span.set_attribute("contextsvc.compaction.messages_after", report.messages_after)
    span.set_attribute("contextsvc.compaction.tokens_before", report.context_tokens_before)
    span.set_attribute("contextsvc.compaction.tokens_after", report.context_tokens_after)


def note_genai_usage(input_tokens: int | None, output_tokens: int | None) -> None:
    """A summarizer reports the tokens its provider counted for the call in progress."""
    if not _current.enabled:
        return
    _usage.set((int(input_tokens or 0), int(output_tokens or 0)))


# -- wrappers installed by the bootstrap when telemetry is on ------------------------------------


class _TracedStore:
    """Every coroutine method of the store runs inside a ``store.<method>`` client span."""

    def __init__(self, inner: SessionStore, tracer: trace.Tracer) -> None:
        self._inner = inner
        self._tracer = tracer
        self._wrapped: dict[str, Callable[..., Awaitable[Any]]] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name.startswith("_") or not callable(attr) or not _is_coroutine_function(attr):
            return attr
        wrapped = self._wrapped.get(name)
        if wrapped is None:
            wrapped = self._wrap(name)
            self._wrapped[name] = wrapped
        return wrapped

    def _wrap(self, name: str) -> Callable[..., Awaitable[Any]]:
        tracer, inner, span_name = self._tracer, self._inner, f"store.{name}"
        system = type(inner).__name__

        async def call(*args: Any, **kwargs: Any) -> Any:
            with tracer.start_as_current_span(
                span_name, kind=SpanKind.CLIENT, attributes={"contextsvc.store": system}
            ) as span:
                if args and isinstance(args[0], str):
                    span.set_attribute("contextsvc.session_id", args[0])
                return await getattr(inner, name)(*args, **kwargs)

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


class _MetricsInterceptor(grpc.aio.ServerInterceptor):
    """RPC duration by method and status code, and session counts, for every call."""

    def __init__(self, instruments: _Instruments) -> None:
        self._m = instruments

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(method, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _record(self, method: str, started: float, context: Any, failed: bool, cancelled: bool = False) -> None:
        code = grpc.StatusCode.CANCELLED.value[0] if cancelled else _code_of(context, failed)
        service, _, name = method.lstrip("/").partition("/")
        self._m.rpc_duration.record(
            time.perf_counter() - started,
            {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name, "rpc.grpc.status_code": code},
        )
        if code == 0 and name in ("CreateSession", "ForkSession"):
            self._m.sessions_created.add(1)
        elif code == 0 and name == "DeleteSession":
            self._m.sessions_deleted.add(1)

    def _unary(self, method: str, behavior: Any) -> Any:
        async def call(request: Any, context: Any) -> Any:
            started, failed, cancelled = time.perf_counter(), True, False
            try:
                response = await behavior(request, context)
                failed = False
                return response
            except asyncio.CancelledError:
                cancelled = True  # the client went away or the server is stopping
                raise
            finally:
                self._record(method, started, context, failed, cancelled)

        return call

    def _stream(self, method: str, behavior: Any) -> Any:
        async def call(request: Any, context: Any) -> AsyncIterator[Any]:
            started, failed, cancelled = time.perf_counter(), True, False
            try:
                async for item in behavior(request, context):
                    yield item
                failed = False
            except (asyncio.CancelledError, GeneratorExit):
                cancelled = True  # a watcher that hangs up ends its stream this way
                raise
            finally:
                self._record(method, started, context, failed, cancelled)

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
