"""The per-call telemetry paths: server interceptor, child spans, store events, and what a trace the
sampler dropped records (nothing below the server span)."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Sampler
from opentelemetry.trace import StatusCode

from contextsvc import telemetry
from contextsvc.telemetry_spans import SpanFactory

METHOD = "/contextsvc.v1.ContextService/BuildContext"


class Rig:
    """Telemetry recording into memory; ``light``: our spans from ``SpanFactory`` (what ``serve``
    uses with the samplers OTEL_TRACES_SAMPLER names), else from the SDK's tracer (any other)."""

    def __init__(self, sampler: Sampler, light: bool) -> None:
        telemetry._last_fill.clear()
        self.spans = InMemorySpanExporter()
        provider = TracerProvider(sampler=sampler)
        processor = SimpleSpanProcessor(self.spans)
        provider.add_span_processor(processor)
        self.reader = InMemoryMetricReader()
        meters = MeterProvider(metric_readers=[self.reader])
        self.tel = telemetry.Telemetry(
            tracing=True,
            metering=True,
            tracer=provider.get_tracer("test"),
            spans=SpanFactory(provider, processor, "test") if light else None,
            instruments=telemetry._Instruments.from_meter(meters.get_meter("test")),
            slow_store_ms=60_000.0,  # no call counts as slow unless a test says so (a loaded machine)
        )

    def durations(self) -> list[Any]:
        data = self.reader.get_metrics_data()
        assert data is not None
        return [
            point
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for metric in sm.metrics
            if metric.name == "rpc.server.call.duration"
            for point in metric.data.data_points
        ]


class Store:
    async def get_session(self, session_id: str, *, caller: Any = None) -> str:
        return session_id

    async def broken(self, session_id: str) -> None:
        raise LookupError("gone")

    async def slow(self, session_id: str) -> None:
        await asyncio.sleep(0.02)


class Context:
    def __init__(self, metadata: tuple[tuple[str, str], ...] = (), code: grpc.StatusCode | None = None) -> None:
        self._metadata = metadata
        self._code = code

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def code(self) -> grpc.StatusCode | None:
        return self._code


@pytest.fixture(params=["light", "sdk"])
def sampled(request: pytest.FixtureRequest) -> Iterator[Rig]:
    rig = Rig(ALWAYS_ON, request.param == "light")
    previous = telemetry.set_current(rig.tel)
    yield rig
    telemetry.set_current(previous)


@pytest.fixture(params=["light", "sdk"])
def dropped(request: pytest.FixtureRequest) -> Iterator[Rig]:
    rig = Rig(ALWAYS_OFF, request.param == "light")
    previous = telemetry.set_current(rig.tel)
    yield rig
    telemetry.set_current(previous)


async def _serve(rig: Rig, behavior: Any, context: Context) -> Any:
    (interceptor,) = rig.tel.server_interceptors()

    async def continuation(details: Any) -> Any:
        return grpc.unary_unary_rpc_method_handler(behavior)

    class Details:
        method = METHOD

    handler = await interceptor.intercept_service(continuation, Details())
    assert handler is not None
    # The wrapped handler is built once per method.
    again = await interceptor.intercept_service(continuation, Details())
    assert again is not None
    return await handler.unary_unary(object(), context)


async def test_a_sampled_call_has_a_server_span_a_child_and_its_store_calls(sampled: Rig) -> None:
    store: Any = sampled.tel.wrap_store(Store())  # type: ignore[arg-type]

    async def build(request: Any, context: Any) -> str:
        await store.get_session("sid-1", caller=None)  # under the server span
        with telemetry.view_span("sid-1") as span:
            assert span.is_recording()
            await store.get_session("sid-1", caller=None)
            await store.get_session("sid-1", caller=None)
            with pytest.raises(LookupError):
                await store.broken("sid-1")
            telemetry.view_built("m", 3, 120, 0.25)
        return "ok"

    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert await _serve(sampled, build, Context((("traceparent", parent),))) == "ok"
    spans = {s.name: s for s in sampled.spans.get_finished_spans()}
    assert set(spans) == {METHOD, "contextsvc.build_view"}
    server, view = spans[METHOD], spans["contextsvc.build_view"]
    assert server.context.trace_id == int("4bf92f3577b34da6a3ce929d0e0e4736", 16)
    assert server.parent is not None and server.parent.span_id == int("00f067aa0ba902b7", 16)
    assert view.parent is not None and view.parent.span_id == server.context.span_id
    server_attributes = dict(server.attributes or {})
    assert server_attributes.pop("contextsvc.store.get_session.duration_ms") >= 0
    assert server_attributes == {
        "rpc.system": "grpc",
        "rpc.service": "contextsvc.v1.ContextService",
        "rpc.method": "BuildContext",
        "rpc.grpc.status_code": 0,
        "contextsvc.store.get_session.calls": 1,
    }
    # Store calls are counted and timed per operation on the span they ran under.
    view_attributes = dict(view.attributes or {})
    assert view_attributes.pop("contextsvc.store.get_session.duration_ms") >= 0
    assert view_attributes.pop("contextsvc.store.broken.duration_ms") >= 0
    assert view_attributes == {
        "contextsvc.session_id": "sid-1",
        "gen_ai.request.model": "m",
        "contextsvc.view.messages": 3,
        "contextsvc.view.tokens": 120,
        "contextsvc.store.get_session.calls": 2,
        "contextsvc.store.broken.calls": 1,
    }
    # Only the failed call (none was slow) has an event of its own.
    (failed,) = view.events
    assert failed.name == "store.broken" and failed.attributes is not None
    assert failed.attributes["error.type"] == "LookupError"
    assert failed.attributes["contextsvc.store.duration_ms"] >= 0
    assert view.start_time is not None and view.end_time is not None
    assert view.start_time <= failed.timestamp <= view.end_time
    assert server.events == ()
    (point,) = sampled.durations()
    assert point.count == 1 and dict(point.attributes)["rpc.grpc.status_code"] == 0


async def test_a_slow_store_call_gets_an_event_of_its_own(sampled: Rig) -> None:
    sampled.tel.slow_store_ms = 5.0
    store: Any = sampled.tel.wrap_store(Store())  # type: ignore[arg-type]

    async def build(request: Any, context: Any) -> str:
        with telemetry.view_span("sid-3"):
            await store.get_session("sid-3")  # fast: counted only
            await store.slow("sid-3")  # 20 ms: counted and an event
        return "ok"

    await _serve(sampled, build, Context())
    spans = {s.name: s for s in sampled.spans.get_finished_spans()}
    view = spans["contextsvc.build_view"]
    (slow,) = view.events
    assert slow.name == "store.slow" and slow.attributes is not None
    assert slow.attributes["contextsvc.store.duration_ms"] >= 5.0
    assert "error.type" not in slow.attributes
    assert view.attributes is not None
    assert view.attributes["contextsvc.store.slow.calls"] == 1
    assert view.attributes["contextsvc.store.get_session.calls"] == 1


def test_the_fill_metric_is_recorded_when_a_sessions_fill_changes(sampled: Rig) -> None:
    def fills() -> list[Any]:
        data = sampled.reader.get_metrics_data()
        assert data is not None
        return [
            point
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for metric in sm.metrics
            if metric.name == "contextsvc.context.fill"
            for point in metric.data.data_points
        ]

    for session, fraction in [("a", 0.25), ("a", 0.25), ("b", 0.25), ("a", 0.5), ("a", 0.5), ("a", 0.25)]:
        with telemetry.view_span(session):
            telemetry.view_built("m", 3, 120, fraction)
    (point,) = fills()
    # a: 0.25, 0.5, 0.25 (the repeats skipped); b: 0.25
    assert point.count == 4 and point.sum == 1.25


async def test_a_dropped_trace_records_nothing_below_the_server_span(dropped: Rig) -> None:
    store: Any = dropped.tel.wrap_store(Store())  # type: ignore[arg-type]

    async def build(request: Any, context: Any) -> str:
        with telemetry.view_span("sid-2") as span:
            assert not span.is_recording()
            await store.get_session("sid-2")
            telemetry.view_built("m", 3, 120, 0.25)
        return "ok"

    assert await _serve(dropped, build, Context()) == "ok"
    assert dropped.spans.get_finished_spans() == ()
    (point,) = dropped.durations()  # metrics do not depend on sampling
    assert point.count == 1


@pytest.mark.parametrize(
    ("code", "error"),
    [(grpc.StatusCode.NOT_FOUND, False), (grpc.StatusCode.INVALID_ARGUMENT, False), (grpc.StatusCode.INTERNAL, True)],
)
async def test_only_server_side_codes_mark_the_server_span_as_an_error(
    sampled: Rig, code: grpc.StatusCode, error: bool
) -> None:
    class Aborted(Exception):
        pass

    async def fail(request: Any, context: Any) -> None:
        raise Aborted("aborted")

    with pytest.raises(Aborted):
        await _serve(sampled, fail, Context(code=code))
    (span,) = sampled.spans.get_finished_spans()
    assert span.attributes is not None and span.attributes["rpc.grpc.status_code"] == code.value[0]
    assert (span.status.status_code is StatusCode.ERROR) is error
    assert any(event.name == "exception" for event in span.events) is error
    (point,) = sampled.durations()
    assert dict(point.attributes)["rpc.grpc.status_code"] == code.value[0]


async def test_a_stream_closed_from_another_context_ends_its_span_without_a_detach_error(
    sampled: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    (interceptor,) = sampled.tel.server_interceptors()
    store: Any = sampled.tel.wrap_store(Store())  # type: ignore[arg-type]

    async def watch(request: Any, context: Any) -> Any:
        await store.get_session("sid-4")
        for n in range(10):
            yield n

    async def continuation(details: Any) -> Any:
        return grpc.unary_stream_rpc_method_handler(watch)

    class Details:
        method = "/contextsvc.v1.ContextService/StreamEvents"

    handler = await interceptor.intercept_service(continuation, Details())
    assert handler is not None
    stream = handler.unary_stream(object(), Context())
    assert await stream.__anext__() == 0
    # The caller hangs up: the generator is closed by a task of another context (as the event
    # loop's async-generator finalizer does).
    await asyncio.get_running_loop().create_task(stream.aclose(), context=contextvars.Context())
    (span,) = sampled.spans.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert span.attributes["contextsvc.store.get_session.calls"] == 1
    assert not [r for r in caplog.records if "detach" in r.getMessage().lower()]
